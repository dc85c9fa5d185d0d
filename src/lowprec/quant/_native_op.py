"""The fused CPU quantizer inside ``torch.compile``: an opaque custom operator.

Traced by inductor, tensorwise fake quantization becomes generated C++ that redoes the bit-level rounding kernel;
on CPU that is slower than the fused C loop of ``_native`` (bench_train: the compiled fp8 step was slower than
the eager one).  Inside a compiled region ``fake_quantize_tensors`` therefore calls
``torch.ops.lowprec.fake_quantize_tensorwise``, an operator defined with ``torch.library`` whose CPU kernel is the eager
quantizer (the C loop where it applies, the eager kernel otherwise): inductor compiles everything around it and
calls it as a function.  The bits are those of the eager path, which the eager-vs-compiled tests compare.
``call(..., after=grad)`` is the backward pass quantizing a saved input again (``nn/_masked_inputs.py``).

Specs cannot be operator arguments, so each spec is registered once and passed as an integer key (a compile-time
constant).  Used for CPU tensors below ``_backend.AUTO_MIN_NUMEL`` elements with tensor scaling, float32 scales
and round-to-nearest (the specs ``_scaled._tensorwise_fast`` handles).
"""

from __future__ import annotations

import torch

from . import _backend, _native, _native_group
from ._elementwise import fast_round_ok
from ._round import traced_nearest_is_fast
from ._scale import uses_multiplier
from ._spec import QuantSpec

_SPECS: list[QuantSpec] = []
_KEYS: dict[QuantSpec, int] = {}


@torch._dynamo.assume_constant_result
def _enabled() -> bool:
    return _native.available() and _backend._fast["on"]


def applies(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether a compiled region should quantize ``x`` with ``spec`` through the custom operator."""
    return (
        x.device.type == "cpu"
        and spec.scaling == "tensor"
        and spec.rounding == "nearest"
        and uses_multiplier(spec)
        and fast_round_ok(spec.format, "nearest")
        and 0 < x.numel() < _backend.AUTO_MIN_NUMEL
        and _enabled()
    )


_KEYS_AGAIN: dict[QuantSpec, int] = {}
"""Keys of second quantizations in one graph (``call(..., after=...)``): other numbers for the same specs."""


@torch._dynamo.assume_constant_result
def _key(spec: QuantSpec, again: bool) -> int:
    keys = _KEYS_AGAIN if again else _KEYS
    key = keys.get(spec)
    if key is None:
        key = keys[spec] = len(_SPECS)
        _SPECS.append(spec)
    return key


# Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter's Python wrapper adds
# about 90 microseconds per call (measured: 213 vs 117 us for a 256x784 tensor whose quantization takes 90 us),
# which is most of the operator's cost at the sizes where it is used.
_LIB = torch.library.Library("lowprec", "DEF")
_LIB.define("fake_quantize_tensorwise(Tensor x, Tensor? amax, int key, Tensor? after=None) -> Tensor")


def _op(x: torch.Tensor, amax: torch.Tensor | None, key: int, after: torch.Tensor | None = None) -> torch.Tensor:
    from ._scaled import _tensorwise_fast, fake_quantize_tensors

    spec = _SPECS[key]
    y = _tensorwise_fast(x, spec, amax)
    if y is None:  # NaN/inf in x or an out-of-range scale: the eager kernels' rules
        with _backend.backend("eager"):
            y = fake_quantize_tensors(x, spec, amax=amax)
    return y.clone() if y.data_ptr() == x.data_ptr() else y  # an operator's output must not alias its input


_LIB.impl("fake_quantize_tensorwise", _op, "CPU")


@torch.library.register_fake("lowprec::fake_quantize_tensorwise")
def _(x: torch.Tensor, amax: torch.Tensor | None, key: int, after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x)


def call(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None, *, after: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``fake_quantize_tensors(x, spec, amax=amax)`` through the custom operator.

    ``after`` (a backward pass's gradient) marks a second quantization of a tensor already quantized in the same
    graph: the call passes another key for the same spec, so that AOTAutograd's common subexpression elimination
    keeps it as its own node instead of merging it with the first call, and takes ``after`` as an (unused) input,
    so that the partitioner cannot move it into the forward graph and save its output after all."""
    key = _key(spec, after is not None)
    return torch.ops.lowprec.fake_quantize_tensorwise(x, amax, key, after)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ every other spec
_LIB.define("fake_quantize_grouped(Tensor x, Tensor? keys, Tensor? offset, int key, Tensor? after=None) -> Tensor")


def applies_grouped(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether a compiled region should quantize ``x`` with ``spec`` through the grouped custom operator: the
    specs the native grouped kernel takes (``_native_group.plan``: block, tile, axis and tensor scaling with any
    scale rule, every rounding) for CPU tensors below ``_backend.AUTO_MIN_NUMEL`` elements, except unscaled
    round-to-nearest onto the formats whose traced route inductor vectorizes (``_round.traced_nearest_is_fast``:
    bf16 / fp16 operands), which fuse with their neighbours in the graph instead (MLP bf16 step: 3.3 ms per step
    in the operator, a third of the traced passes' time)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and 0 < x.numel() < _backend.AUTO_MIN_NUMEL
        and _enabled()
        and not (spec.scaling == "none" and spec.rounding == "nearest" and traced_nearest_is_fast(spec.format))
        and _plan_ok(spec)
    )


@torch._dynamo.assume_constant_result
def _plan_ok(spec: QuantSpec) -> bool:
    return _native_group.plan(spec) is not None


def _grouped(x: torch.Tensor, keys: torch.Tensor | None, offset: torch.Tensor | None, key: int,
             after: torch.Tensor | None = None) -> torch.Tensor:
    from ._scaled import fake_quantize_tensors

    spec = _SPECS[key]
    y = _native_group.fake(x, spec, keys, offset)
    if y is None:  # a group with NaN or inf: the eager kernels' rules
        with _backend.backend("eager"):
            y = fake_quantize_tensors(x, spec, keys=keys, offset=offset)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


_LIB.impl("fake_quantize_grouped", _grouped, "CPU")


@torch.library.register_fake("lowprec::fake_quantize_grouped")
def _(x: torch.Tensor, keys: torch.Tensor | None, offset: torch.Tensor | None, key: int,
      after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x)


def call_grouped(x: torch.Tensor, spec: QuantSpec, keys: torch.Tensor | None, offset: torch.Tensor | None, *,
                 after: torch.Tensor | None = None) -> torch.Tensor:
    """``fake_quantize_tensors(x, spec, keys=keys, offset=offset)`` through the grouped custom operator (``after``:
    as for ``call``)."""
    key = _key(spec, after is not None)
    return torch.ops.lowprec.fake_quantize_grouped(x, keys, offset, key, after)  # type: ignore[no-any-return]
