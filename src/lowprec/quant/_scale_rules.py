"""The pure-Python rules of a spec's scales, shared by the PyTorch and JAX quantizers (no torch, no jax).

``uses_multiplier`` says which of the two scale conventions of ``QuantSpec`` a spec follows (a float32 quantization
multiplier, or a dequantization scale in the scale format); ``TwoLevelScales`` is the pair of scales a two-level
spec (NVFP4) produces, for whichever array type the framework uses.  The tensor arithmetic is in
``lowprec.quant._scale`` (PyTorch) and ``lowprec.jax._scale`` (JAX).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    from ._spec import QuantSpec

_Array = TypeVar("_Array")  # torch.Tensor (lowprec.quant) or jax.Array (lowprec.jax)

_F32_MAX = float.fromhex("0x1.fffffep127")
_SCALE_ROUNDING_TO_ELEM = {"nearest": "nearest", "floor": "toward_zero", "ceil": "away"}


def _mantissa_bits(value: float) -> int:
    """The 23 float32 mantissa bits of a positive normal Python float that float32 holds exactly."""
    import struct

    # Pure Python (no tensor, no .item()): torch.compile traces this without a graph break.
    return int(struct.unpack("<I", struct.pack("<f", value))[0]) & 0x7FFFFF


def uses_multiplier(spec: QuantSpec) -> bool:
    """True for float32 scales, which follow TransformerEngine/torchao: a quantization multiplier
    ``m = max_elem / amax`` (codes = Q(x * m)) whose float32 reciprocal ``1/m`` is the stored dequantization scale
    (the ``scale_a``/``scale_b`` that ``torch._scaled_mm`` takes)."""
    sfmt = spec.scale_spec
    return sfmt.mbits == 23 and sfmt.emin <= -126


def te_constants(spec: QuantSpec) -> tuple[float, float]:
    """TransformerEngine's two float32 constants of a two-level spec: ``D = max_elem * max_scale`` (6 * 448 for
    NVFP4) and ``fl(1 / max_elem)`` (TE's ``fp4_max_inv``), as Python floats holding float32 values."""
    import struct

    def f32(v: float) -> float:
        return float(struct.unpack("<f", struct.pack("<f", v))[0])

    return f32(spec.format.max * spec.scale_spec.max), f32(1.0 / spec.format.max)


class TwoLevelScales(NamedTuple, Generic[_Array]):
    """Scales of a two-level spec (NVFP4): per-group scales in the scale format and a float32 tensor scale.

    The fields are ``torch.Tensor`` from ``lowprec.quant`` and ``jax.Array`` from ``lowprec.jax``.
    """

    group: _Array
    tensor: _Array
