"""Computing a group's scale from its amax (see ``QuantSpec`` for the rules).

Two-level specs (NVFP4) carry a float32 tensor scale between the two passes of ``_scaled``: for
``two_level_rule="divide"`` the scalar ``s_t``; for ``"te"`` (TransformerEngine's arithmetic) the three float32
numbers ``[s_t, m6, S_dec]`` of ``te_tensor_scales`` (the decode scale that is stored, the group-scale multiplier
``fl(S_enc * fl(1/max_elem))``, and ``fl(1 / S_enc)`` from which the element multiplier is made).
"""

from __future__ import annotations

import torch

from ..formats import FormatSpec
from ._round import _pow2, quantize_f32
from ._scale_rules import _F32_MAX as _F32_MAX
from ._scale_rules import _SCALE_ROUNDING_TO_ELEM as _SCALE_ROUNDING_TO_ELEM
from ._scale_rules import _mantissa_bits as _mantissa_bits
from ._scale_rules import te_constants
from ._scale_rules import uses_multiplier as uses_multiplier
from ._spec import QuantSpec


def _log2_parts(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For finite ``v >= 0``: ``(floor(log2 v), 23 mantissa bits)`` as int32; subnormals are normalised first.

    ``v == 0`` gives an exponent of -191, below any scale range (callers clamp).
    """
    sub = v < float.fromhex("0x1p-126")
    vn = torch.where(sub, v * float.fromhex("0x1p64"), v)
    bits = vn.view(torch.int32)
    exp = (bits >> 23) - 127 - sub.to(torch.int32) * 64
    return exp, bits & 0x7FFFFF


def pow2_scale(amax: torch.Tensor, spec: QuantSpec, elem: FormatSpec, sfmt: FormatSpec) -> torch.Tensor:
    """Power-of-two (E8M0) scale for each amax, as float32."""
    exp, mant = _log2_parts(amax)
    if spec.scale_rounding == "floor":  # OCP MX: 2^(floor(log2 amax) - emax_elem)
        k = exp - elem.emax
    elif spec.scale_rounding == "ceil":  # smallest 2^k with 2^k * max_elem >= amax
        k = exp - elem.emax + (mant > _mantissa_bits(elem.max)).to(torch.int32)
    else:  # amax / max_elem to the nearest power of two (ties up, as the E8M0 cast)
        r_exp, r_mant = _log2_parts(amax / elem.max)
        k = r_exp + (r_mant >= 0x400000).to(torch.int32)
    lo, hi = sfmt.emin, sfmt.emax
    k = torch.clamp(k + spec.margin, lo, hi)
    return _pow2(k)


def float_scale(raw: torch.Tensor, spec: QuantSpec, sfmt: FormatSpec) -> torch.Tensor:
    """``raw`` (= amax / max_elem, positive float32) rounded into a float scale format and clamped."""
    if spec.margin:
        raw = raw * float(2.0**spec.margin)
    if not (sfmt.mbits == 23 and sfmt.emin <= -126):
        raw = quantize_f32(
            raw, sfmt, rounding=_SCALE_ROUNDING_TO_ELEM[spec.scale_rounding], saturate=True, rbits=None
        )
    return torch.clamp(raw, min=sfmt.min_subnormal, max=sfmt.max)


def float_scale_te(raw: torch.Tensor, spec: QuantSpec, sfmt: FormatSpec) -> torch.Tensor:
    """TE's group scale from ``raw = amax * m6``: rounded into the scale format, saturating, no lower bound."""
    if spec.margin:
        raw = raw * float(2.0**spec.margin)
    raw = quantize_f32(raw, sfmt, rounding=_SCALE_ROUNDING_TO_ELEM[spec.scale_rounding], saturate=True, rbits=None)
    return torch.clamp(raw, max=sfmt.max)


def group_scale(amax: torch.Tensor, spec: QuantSpec, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """Per group: the dequantization scale (float32, exactly in ``spec.scale_format``), or for float32 scales the
    quantization multiplier ``m`` (see ``uses_multiplier``); NaN for groups with NaN/inf.  ``tensor_scale``: what
    ``tensor_scale_from_amax`` gave (module docstring), or None."""
    elem, sfmt = spec.format, spec.scale_spec
    finite = amax <= _F32_MAX  # False for NaN and inf
    safe = torch.where(finite, amax, 0.0)
    if uses_multiplier(spec):
        # A tensor numerator: ``python_float / tensor`` is computed as reciprocal-then-multiply (two roundings).
        m = torch.clamp(torch.full_like(safe, elem.max) / safe, max=_F32_MAX)  # amax 0 -> inf -> float32 max
        if spec.margin:
            m = m * float(2.0**-spec.margin)
        return torch.where(finite, m, float("nan"))
    if not sfmt.signed:
        s = pow2_scale(safe, spec, elem, sfmt)
    elif tensor_scale is not None and spec.two_level_rule == "te":
        s = float_scale_te(safe * tensor_scale[1], spec, sfmt)  # amax * fl(S_enc * fl(1/6))
    else:
        raw = safe / elem.max
        if tensor_scale is not None:
            raw = raw / tensor_scale
        s = float_scale(raw, spec, sfmt)
    return torch.where(finite, s, float("nan"))


def te_tensor_scales(amax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """TransformerEngine's two-level scales from the tensor's amax (a 0-dim float32 tensor): ``[s_t, m6, S_dec]``.

    ``S_enc = fl(D / amax)`` with ``D = max_elem * max_scale``, at most float32 max, 1 when amax is 0 (TE's
    ``compute_global_encode_scaling_factor_FP4``); ``S_dec = fl(1 / S_enc)``; ``m6 = fl(S_enc * fl(1/max_elem))``;
    the stored decode scale ``s_t = fl(amax / D)`` (1 when amax is 0; the smallest float32 subnormal where the
    quotient underflows to 0).  All NaN for a non-finite amax.
    """
    d, inv_elem = te_constants(spec)
    finite = amax <= _F32_MAX
    safe = torch.where(finite, amax, 0.0)
    pos = safe > 0
    s_enc = torch.where(pos, torch.clamp(torch.full_like(safe, d) / safe, max=_F32_MAX), 1.0)
    s_dec = torch.ones_like(s_enc) / s_enc
    m6 = s_enc * inv_elem
    s_t = torch.where(pos, torch.clamp(safe / d, min=float.fromhex("0x1p-149")), 1.0)
    out = torch.stack([s_t, m6, s_dec])
    return torch.where(finite, out, float("nan"))


def tensor_scale_from_amax(amax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Two-level (NVFP4) tensor scale(s) from the tensor's amax (a 0-dim float32 tensor): for
    ``two_level_rule="te"`` the three numbers of ``te_tensor_scales``; for ``"divide"`` the float32 scalar
    ``amax / (max_elem * max_scale)``, 1 for an all-zero tensor."""
    if spec.two_level_rule == "te":
        return te_tensor_scales(amax, spec)
    denom = spec.format.max * spec.scale_spec.max
    finite = amax <= _F32_MAX
    # Clamped to the smallest normal so that group scale * tensor scale never underflows to zero.
    s = torch.where(amax > 0, torch.clamp(amax / denom, min=float.fromhex("0x1p-126")), 1.0)
    return torch.where(finite, s, float("nan"))


def stored_tensor_scale(s_t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The float32 tensor scale (0-dim) a two-level spec stores and dequantizes with, from
    ``tensor_scale_from_amax``'s result."""
    return (s_t[0] if spec.two_level_rule == "te" else s_t).reshape(())
