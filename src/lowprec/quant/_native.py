"""Fused CPU kernels for the eager round-to-nearest route, compiled at first use with the system C compiler.

Eagerly, ``round_nearest_fast`` is five to nine tensor operations, each a pass over memory plus a few
microseconds of dispatch; for the mid-size tensors of training (10^4 to 10^6 elements) that is most of the
quantizer's time.  ``_native.c`` does the same float32 operations, in the same order, in one loop per element
(``lp_round_nearest``), and the tensorwise amax with the finiteness check in another (``lp_absmax``): the same
bits in two passes.  It is compiled with ``-ffp-contract=off`` (no fused multiply-add, which would round once
where the tensor operations round twice), without ``-ffast-math`` and with ``-fno-strict-aliasing`` (float
data is also read through its bit patterns); the tests compare it bit for bit with the
integer kernel on whole binades of every float format.

Set-up: the shared library is built once per source version and machine type into ``$LOWPREC_CACHE_DIR/native``
(default ``~/.cache/lowprec/native``; written atomically, so concurrent first uses are safe) and loaded with
ctypes; no torch headers are involved, so the build takes a few seconds (most of it the grouped kernel's
specialised loops).  Where no C compiler is found, the build fails, or ``LOWPREC_NATIVE=0`` is set,
``available()`` is False and the tensor-operation route runs instead: the bits are the same either way, only the
speed differs.  Each kernel is a single-threaded loop; calls on large tensors are split into ranges that run on
several threads at once (``_parallel``; from 2^22 elements for the single passes here, 2^20 for the grouped
kernel), which ctypes allows by releasing the GIL during every call.  Under the default backend ("auto") the
native kernels are used at every size where they apply, outside compiled regions (``_backend.runs_native``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _native_build
from . import _parallel

_SOURCES = tuple(Path(__file__).with_name(n) for n in ("_native.c", "_native_group.c", "_native_accum.c"))
"""The kernels: elementwise rounding, amax and statistics here; scaled fake quantization of any spec in
``_native_group.c`` (its Python side: ``_native_group``); GEMMs through an emulated accumulator in
``_native_accum.c`` (its Python side: ``lowprec.nn._accum``)."""
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off", "-fno-fast-math",
          "-fno-strict-aliasing", "-fopenmp-simd")
_state: dict[str, object] = {}
_ALIGN = 1024
"""A split call's ranges start at multiples of this many elements (4 KiB: few memory pages written by two threads)."""


def _build() -> ctypes.CDLL | None:
    out = _native_build.build("lowprec_native", _SOURCES, _FLAGS)
    if out is None:
        return None
    lib = ctypes.CDLL(str(out))
    f32, i64, i32, ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.lp_absmax.argtypes = [ptr, i64, ptr]
    lib.lp_absmax.restype = i32
    lib.lp_round_nearest.argtypes = [ptr, ptr, i64, f32, i32, f32, i32, f32, f32, i32, f32, i32]
    lib.lp_round_nearest.restype = None
    lib.lp_round_bf16.argtypes = [ptr, ptr, i64, i32]
    lib.lp_round_bf16.restype = None
    lib.lp_round_ieee.argtypes = [ptr, ptr, i64, f32, f32, f32, i32]
    lib.lp_round_ieee.restype = None
    lib.lp_stats.argtypes = [ptr, ptr, ptr, i64, f32, i32, f32, i32, i32, f32, ptr]
    lib.lp_stats.restype = None
    u32 = ctypes.c_uint32
    lib.lp_group_fake.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, u32, u32, u32, i64, i64, i64,
                                  i32, f32, ptr]
    lib.lp_group_fake.restype = i32
    lib.lp_kahan_update.argtypes = [ptr, ptr, ptr, i64, ptr]
    lib.lp_kahan_update.restype = None
    lib.lp_accum_seq.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, i32]
    lib.lp_accum_seq.restype = None
    lib.lp_accum_blocked.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i32, ptr]
    lib.lp_accum_blocked.restype = None
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (not built, or disabled)."""
    return _lib() if available() else None


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        _state["lib"] = None if os.environ.get("LOWPREC_NATIVE", "1") == "0" else _build()
    return _state["lib"]  # type: ignore[return-value]


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within the block, use the native kernels only if ``on`` (and they are available); tests compare both
    routes this way."""
    with _native_build.switch(_state, on):
        yield


def available() -> bool:
    """Whether the native kernels are built and enabled (``LOWPREC_NATIVE=0`` disables them)."""
    return not _state.get("off", False) and _lib() is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def usable(t: torch.Tensor) -> bool:
    """Whether ``t`` can go through the native kernels: a contiguous float32 CPU tensor outside autograd, and a
    plain one (a tensor subclass, e.g. FSDP2's wrapped weight shard ``LowpGatherWeight``, may have no storage of its
    own: ``data_ptr()`` is 0)."""
    return (
        type(t) in _PLAIN
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not (t.requires_grad and torch.is_grad_enabled())
        and available()
    )


def absmax(x: torch.Tensor) -> float | None:
    """``max |x|`` of a ``usable`` tensor, or None when some element is NaN or inf (large tensors: split across
    threads, ``_parallel``)."""
    lib = _lib()
    assert lib is not None
    n, p = x.numel(), x.data_ptr()
    if n < 2 * _parallel.PASS_MIN_PER_THREAD:  # one call, without the split's few microseconds
        o = ctypes.c_float()
        return float(o.value) if lib.lp_absmax(p, n, ctypes.byref(o)) else None
    spans = _parallel.ranges(n, _parallel.parts(n, _parallel.PASS_MIN_PER_THREAD), _ALIGN)
    outs = [ctypes.c_float() for _ in spans]
    finite = _parallel.run(lib.lp_absmax, [(p + 4 * a, b - a, ctypes.byref(o))
                                           for (a, b), o in zip(spans, outs, strict=True)])
    return max(float(o.value) for o in outs) if all(finite) else None


def round_nearest(x: torch.Tensor, *, k: float, cmin: float, mul: float | None = None, post: float | None = None,
                  clamp: float | None = None, signed_zero: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``RNE(clamp(x * mul)) * post`` elementwise in one pass (``lp_round_nearest`` in ``_native.c``; large
    tensors: split across threads, ``_parallel``).

    ``x``: a ``usable`` tensor of finite values; ``out``: a contiguous float32 tensor of ``x``'s shape (may be
    ``x`` itself), else a new one.  ``k``, ``cmin``: the route's constants for the format.
    """
    lib = _lib()
    assert lib is not None
    consts = (1.0 if mul is None else mul, mul is not None, 1.0 if post is None else post, post is not None, k, cmin,
              clamp is not None, 0.0 if clamp is None else clamp, signed_zero)
    return _pass(lib.lp_round_nearest, x, out, consts)


def _pass(fn: Any, x: torch.Tensor, out: torch.Tensor | None, consts: tuple[Any, ...]) -> torch.Tensor:
    """``fn(x, y, n, *consts)`` over a ``usable`` tensor into ``out`` (may be ``x``: in place; else a new tensor):
    one foreign call below two threads' worth of elements (the training GEMMs' operands and outputs are 10^4 to
    10^5 elements, where the split's bookkeeping is a large part of the time), else split across threads at
    ``_ALIGN``-element boundaries (``_parallel``)."""
    y = torch.empty_like(x) if out is None else out
    n, px, py = x.numel(), x.data_ptr(), y.data_ptr()
    if n < 2 * _parallel.PASS_MIN_PER_THREAD:
        fn(px, py, n, *consts)
        return y
    spans = _parallel.ranges(n, _parallel.parts(n, _parallel.PASS_MIN_PER_THREAD), _ALIGN)
    _parallel.run(fn, [(px + 4 * a, py + 4 * a, b - a, *consts) for a, b in spans])
    return y


def round_bf16(x: torch.Tensor, *, saturate: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_f32(x, bfloat16, rounding="nearest", saturate=saturate)`` of a ``usable`` tensor in one pass
    (``lp_round_bf16``): any values, NaN and inf included, so no amax pass first.  ``out``: a contiguous float32
    tensor of ``x``'s shape (may be ``x`` itself: in place), else a new one (``_pass``: large tensors split across
    threads)."""
    lib = _lib()
    assert lib is not None
    return _pass(lib.lp_round_bf16, x, out, (saturate,))


def round_ieee(x: torch.Tensor, *, k: float, cmin: float, fmax: float, saturate: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest-even of a ``usable`` tensor onto an IEEE float format with inf and -0 (float16,
    float8_e5m2) in one pass (``lp_round_ieee``): any values, NaN and inf included, so no amax pass first.  ``k``,
    ``cmin``: the float route's constants; ``out`` as for ``round_bf16``."""
    lib = _lib()
    assert lib is not None
    return _pass(lib.lp_round_ieee, x, out, (k, cmin, fmax, saturate))


def stats(x: torch.Tensor, q: torch.Tensor | None, bounds: tuple[tuple[float, bool], tuple[float, bool]] | None,
          *, v: torch.Tensor | None = None, mul: float | None = None, div: float | None = None) -> list[float]:
    """One pass of ``lp_stats`` (``_native.c``) over ``usable`` tensors of one shape: ``[amax, min nonzero, nonzero
    count, non-finite count, underflow count, overflow count, sum x^2, sum (x - q)^2]`` (the last four 0 when ``q``
    is None).  The scaled values ``v`` whose overflow is counted: the tensor ``v``, else ``x * mul``, ``x / div`` or
    ``x``.  ``bounds``: ``((bound, inclusive) for v >= 0, (bound, inclusive) for v < 0)``."""
    lib = _lib()
    assert lib is not None
    out = (ctypes.c_double * 8)()
    (pb, pi), (nb, ni) = bounds if bounds is not None else ((0.0, False), (0.0, False))
    mode, scale = (
        (0, 1.0) if v is not None else (1, mul) if mul is not None else (2, div) if div is not None else (3, 1.0)
    )
    lib.lp_stats(x.data_ptr(), None if v is None else v.data_ptr(), None if q is None else q.data_ptr(), x.numel(),
                 pb, pi, nb, ni, mode, scale, out)
    return list(out)
