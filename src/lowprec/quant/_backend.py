"""Eager or compiled execution of the quantization kernels.

Every kernel is a plain PyTorch function of tensors and Python constants.  Run eagerly it is the reference; run
through ``torch.compile`` (inductor: C++/OpenMP on CPU, Triton on GPU) the same function becomes one fused loop.
Both give identical bits (the kernels use integer operations, exact float conversions and exactly rounded float
division/multiplication only; the test suite checks the identity).

``set_backend("eager" | "compiled" | "auto")`` chooses; "auto" (the default) compiles for tensors of at least
``AUTO_MIN_NUMEL`` elements, where the one-off compile time pays for itself, and stays eager for small tensors and
inside a user's own ``torch.compile`` region (where the kernel is traced into the user's graph anyway).
Compiled kernels are specialised to the format, rounding, spec and tensor shape; each new combination compiles
once (a few seconds on CPU) and is cached for the process.

Eager fast paths: where a kernel runs eagerly outside any compiled region (``runs_eager``), the quantizers may take
a shorter route that gives the same bits as the kernel (round-to-nearest by float32 arithmetic instead of ~40
integer operations: ``_elementwise.round_nearest_fast``; the fused C loops of ``_native`` and ``_native_group``).
``fast_paths(False)`` turns them off, so tests can compare the two routes bit for bit.

Native kernels for large CPU tensors (``runs_native``): under "auto" a call outside any compiled region takes the
fused C loops at every size where they apply (contiguous or 2-D transposed CPU tensors outside autograd, finite
groups), split across ``torch.get_num_threads()`` threads for large tensors (``_parallel``: from 2^20 elements);
only where they do not apply does a tensor of ``AUTO_MIN_NUMEL`` or more elements take the compiled kernel.  There
is no size above which the compiled kernel (inductor's C++/OpenMP loops, on as many threads) is faster: on 2 cores,
every named spec, NVFP4 and bf16 with stochastic rounding, float32, the native route took 0.38 to 0.93 of the
compiled kernel's time at 2^20 elements and 0.71 to 1.00 at 2^24 (best of 12 interleaved calls each).  "compiled"
keeps the compiled kernels at every size (the benchmarks' and tests' reference for them), "eager" the eager routes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from .._checks import literal_values
from .._errors import UsageError

Backend = Literal["auto", "eager", "compiled"]
_BACKENDS = literal_values(Backend)
AUTO_MIN_NUMEL = 1 << 20
_state: dict[str, str] = {"backend": os.environ.get("LOWPREC_BACKEND", "auto")}
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
_fast: dict[str, bool] = {"on": True}


def set_backend(backend: Backend) -> None:
    """Select how quantizers run: "auto", "eager" or "compiled" (also env var ``LOWPREC_BACKEND``)."""
    if backend not in _BACKENDS:
        raise UsageError(f"backend must be one of {_BACKENDS}; got {backend!r}")
    _state["backend"] = backend


def get_backend() -> str:
    return _state["backend"]


@contextlib.contextmanager
def backend(name: Backend) -> Iterator[None]:
    """Context manager form of ``set_backend``."""
    old = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        _state["backend"] = old


@contextlib.contextmanager
def fast_paths(enabled: bool) -> Iterator[None]:
    """Turn the eager fast paths on or off inside the block (they are on by default)."""
    old = _fast["on"]
    _fast["on"] = bool(enabled)
    try:
        yield
    finally:
        _fast["on"] = old


def _use_compiled(numel: int) -> bool:
    mode = _state["backend"]
    if mode not in _BACKENDS:
        raise UsageError(f"LOWPREC_BACKEND must be one of {_BACKENDS}; got {mode!r}")
    return mode == "compiled" or (mode == "auto" and numel >= AUTO_MIN_NUMEL)


def runs_eager(numel: int) -> bool:
    """True when ``run`` would call a kernel for ``numel`` elements eagerly, outside any compiled region, and the
    eager fast paths are on: a caller may then use a fast path that gives the kernel's bits."""
    return _fast["on"] and not _use_compiled(numel) and not torch.compiler.is_compiling()


def runs_native(numel: int) -> bool:
    """True when a call on ``numel`` elements may take the native CPU kernels (``_native``, ``_native_group``):
    eagerly outside any compiled region with the fast paths on, and the backend not "compiled".  Unlike
    ``runs_eager`` this holds under "auto" at every size: the caller takes only a native route then (which declines
    for other devices and layouts), and otherwise ``run``, which compiles large tensors."""
    mode = _state["backend"]
    return _fast["on"] and not torch.compiler.is_compiling() and (mode == "auto" or not _use_compiled(numel))


_portable: dict[str, bool] = {"on": False}


@contextlib.contextmanager
def portable() -> Iterator[None]:
    """Within the block the quantizers trace only operations that give the CPU's bits on any XLA backend: no custom
    operator (the native CPU kernels inside traced graphs), no eager fast path, none of the forms compiled graphs use
    for inductor's sake (float32 arithmetic on values that may be subnormal), and the kernels' XLA forms
    (``xla_forms``) whatever the device.  What ``torch.export`` of a program meant for XLA needs around it."""
    from . import _native

    old = _portable["on"]
    _portable["on"] = True
    try:
        with fast_paths(False), _native.enabled(False):
            yield
    finally:
        _portable["on"] = old


def is_portable() -> bool:
    return _portable["on"]


def xla_forms(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` take their XLA forms: ``t`` is an XLA tensor, or a ``portable`` trace is running.
    XLA (on the CPU as on TPUs) reads float32 subnormal operands as zero and writes zero for subnormal results, its
    simplifier drops ``v + 0.0``, and its clamp of NaN gives the lower bound; the XLA forms avoid all three."""
    return _portable["on"] or t.device.type == "xla"


def traces_lazily(x: torch.Tensor) -> bool:
    """True for a tensor on torch_xla's lazy "xla" device, where each operation is recorded into a graph that XLA
    compiles and runs later, as inside a compiled region: the quantizers then take their traced kernels (none of the
    eager fast paths, which read values back to the host, no native CPU kernel, no inductor).  The first such tensor
    registers ``_xla``'s lowerings (torch_xla's own give other bits for some integer operations)."""
    if x.device.type != "xla":
        return False
    from . import _xla

    _xla.register()
    return True


def run(kernel: Callable[..., Any], numel: int, *args: Any, **kwargs: Any) -> Any:
    """Call ``kernel`` eagerly or compiled according to the backend setting (traced into the graph, for a first
    argument on a lazy device: ``traces_lazily``)."""
    if (not _use_compiled(numel) or torch.compiler.is_compiling()
            or (args and isinstance(args[0], torch.Tensor) and traces_lazily(args[0]))):
        return kernel(*args, **kwargs)
    fn = _compiled.get(kernel)
    if fn is None:
        # dynamic=False: format parameters (ints such as mantissa bits) must stay compile-time constants; with
        # automatic dynamic shapes dynamo would turn them into symbols on the second format.  Shapes are static
        # too, so each new shape compiles once (training reuses a fixed set of shapes).
        fn = torch.compile(kernel, fullgraph=True, dynamic=False)
        _compiled[kernel] = fn
    # One graph per (format, rounding, saturation, rank...) combination: allow more than dynamo's default 8,
    # scoped to our calls so the user's own settings are untouched.
    with torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=4096):
        return fn(*args, **kwargs)
