"""The fused CPU quantizer inside ``torch.compile``: an opaque custom operator.

Traced by inductor, tensorwise fake quantization becomes generated C++ that redoes the bit-level rounding kernel;
on CPU that is slower than the fused C loop of ``_native`` (bench_train: the compiled fp8 step was slower than
the eager one).  Inside a compiled region ``fake_quantize_tensors`` therefore calls
``torch.ops.lowprec.fake_quantize_tensorwise``, a ``torch.library.custom_op`` whose implementation is the eager
quantizer (the C loop where it applies, the eager kernel otherwise): inductor compiles everything around it and
calls it as a function.  The bits are those of the eager path, which the eager-vs-compiled tests compare.

Specs cannot be operator arguments, so each spec is registered once and passed as an integer key (a compile-time
constant).  Used for CPU tensors below ``_backend.AUTO_MIN_NUMEL`` elements with tensor scaling, float32 scales
and round-to-nearest (the specs ``_scaled._tensorwise_fast`` handles).
"""

from __future__ import annotations

import torch

from . import _backend, _native
from ._elementwise import fast_round_ok
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


@torch._dynamo.assume_constant_result
def _key(spec: QuantSpec) -> int:
    key = _KEYS.get(spec)
    if key is None:
        key = _KEYS[spec] = len(_SPECS)
        _SPECS.append(spec)
    return key


@torch.library.custom_op("lowprec::fake_quantize_tensorwise", mutates_args=())
def _op(x: torch.Tensor, amax: torch.Tensor | None, key: int) -> torch.Tensor:
    from ._scaled import fake_quantize_tensors

    with _backend.backend("eager"):
        y = fake_quantize_tensors(x, _SPECS[key], amax=amax)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


@_op.register_fake
def _(x: torch.Tensor, amax: torch.Tensor | None, key: int) -> torch.Tensor:
    return torch.empty_like(x)


def call(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None) -> torch.Tensor:
    """``fake_quantize_tensors(x, spec, amax=amax)`` through the custom operator."""
    return torch.ops.lowprec.fake_quantize_tensorwise(x, amax, _key(spec))  # type: ignore[no-any-return]
