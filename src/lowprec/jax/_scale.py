"""A group's scale from its amax in JAX: the rules of ``lowprec.quant._scale`` (see ``QuantSpec``), on bit patterns.

Every value here is an int32 float32 bit pattern of a non-negative number (NaN marks a non-finite group), and the
divisions and products are the correctly rounded integer ones of ``_bits`` (the arrays are one value per group,
so the integer route costs little), so scales match PyTorch's even where they are subnormal (``1 / m`` for an
all-zero tensor is ``2^-128``, which XLA on CPU would flush to zero).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..formats import FormatSpec
from ..quant._scale_rules import _F32_MAX, _SCALE_ROUNDING_TO_ELEM, _mantissa_bits, te_constants, uses_multiplier
from ..quant._spec import QuantSpec
from ._bits import INF, QNAN, _unpack, const_bits, div_mag, mul_mag, pow2_bits
from ._round import quantize_bits

F32_MAX = const_bits(_F32_MAX)


def _log2_parts(v: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(floor(log2 v), 23 mantissa bits)`` for finite ``v >= 0`` (bits); ``v == 0`` gives -191 as PyTorch."""
    sig, exp = _unpack(jnp.where(v == 0, 1, v))
    return jnp.where(v == 0, -191, exp), jnp.where(v == 0, 0, sig & 0x7FFFFF)


def pow2_scale(amax: jnp.ndarray, spec: QuantSpec, elem: FormatSpec, sfmt: FormatSpec) -> jnp.ndarray:
    exp, mant = _log2_parts(amax)
    if spec.scale_rounding == "floor":
        k = exp - elem.emax
    elif spec.scale_rounding == "ceil":
        k = exp - elem.emax + (mant > _mantissa_bits(elem.max)).astype(jnp.int32)
    else:
        r_exp, r_mant = _log2_parts(div_mag(amax, jnp.int32(const_bits(elem.max))))
        k = r_exp + (r_mant >= 0x400000).astype(jnp.int32)
    return pow2_bits(jnp.clip(k + spec.margin, sfmt.emin, sfmt.emax))


def float_scale(raw: jnp.ndarray, spec: QuantSpec, sfmt: FormatSpec) -> jnp.ndarray:
    if spec.margin:
        raw = mul_mag(raw, jnp.int32(const_bits(2.0**spec.margin)))
    if not (sfmt.mbits == 23 and sfmt.emin <= -126):
        raw = quantize_bits(raw, sfmt, rounding=_SCALE_ROUNDING_TO_ELEM[spec.scale_rounding], saturate=True, rbits=None)
    clamped = jnp.minimum(jnp.maximum(raw, const_bits(sfmt.min_subnormal)), const_bits(sfmt.max))
    return jnp.where(raw > INF, raw, clamped)  # NaN stays NaN (torch.clamp)


def float_scale_te(raw: jnp.ndarray, spec: QuantSpec, sfmt: FormatSpec) -> jnp.ndarray:
    """TE's group scale from ``raw = amax * m6`` (bits): rounded into the scale format, saturating, no lower bound."""
    if spec.margin:
        raw = mul_mag(raw, jnp.int32(const_bits(2.0**spec.margin)))
    raw = quantize_bits(raw, sfmt, rounding=_SCALE_ROUNDING_TO_ELEM[spec.scale_rounding], saturate=True, rbits=None)
    return jnp.where(raw > INF, raw, jnp.minimum(raw, const_bits(sfmt.max)))


def group_scale(amax: jnp.ndarray, spec: QuantSpec, tensor_scale: jnp.ndarray | None) -> jnp.ndarray:
    """Per group: the dequantization scale or, for float32 scales, the multiplier ``m`` (bits; NaN for non-finite).
    ``tensor_scale``: ``tensor_scale_from_amax``'s bits (for ``two_level_rule="te"`` the three of
    ``te_tensor_scales``), or None."""
    elem, sfmt = spec.format, spec.scale_spec
    finite = amax < INF
    safe = jnp.where(finite, amax, 0)
    fmax = jnp.int32(const_bits(elem.max))
    if uses_multiplier(spec):
        m = jnp.minimum(div_mag(fmax, safe), F32_MAX)
        if spec.margin:
            m = mul_mag(m, jnp.int32(const_bits(2.0**-spec.margin)))
        return jnp.where(finite, m, QNAN)
    if not sfmt.signed:
        s = pow2_scale(safe, spec, elem, sfmt)
    elif tensor_scale is not None and spec.two_level_rule == "te":
        s = float_scale_te(mul_mag(safe, tensor_scale[1]), spec, sfmt)  # amax * fl(S_enc * fl(1/6))
    else:
        raw = div_mag(safe, fmax)
        if tensor_scale is not None:
            raw = div_mag(raw, tensor_scale)
        s = float_scale(raw, spec, sfmt)
    return jnp.where(finite, s, QNAN)


def te_tensor_scales(amax: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """``lowprec.quant._scale.te_tensor_scales`` on bits: ``[s_t, m6, S_dec]`` of TransformerEngine's NVFP4 rule."""
    d, inv_elem = te_constants(spec)
    db = jnp.int32(const_bits(d))
    pos = amax > 0
    s_enc = jnp.where(pos, jnp.minimum(div_mag(db, amax), F32_MAX), const_bits(1.0))
    s_dec = div_mag(jnp.int32(const_bits(1.0)), s_enc)
    m6 = mul_mag(s_enc, jnp.int32(const_bits(inv_elem)))
    s_t = jnp.where(pos, jnp.maximum(div_mag(amax, db), 1), const_bits(1.0))  # 1: the smallest subnormal's bits
    return jnp.where(amax < INF, jnp.stack([s_t, m6, s_dec]), QNAN)


def tensor_scale_from_amax(amax: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """Two-level (NVFP4) tensor scale(s) (bits): for ``two_level_rule="te"`` the three of ``te_tensor_scales``; for
    ``"divide"`` the float32 ``amax / (max_elem * max_scale)``, 1 for an all-zero tensor."""
    if spec.two_level_rule == "te":
        return te_tensor_scales(amax, spec)
    denom = jnp.int32(const_bits(float(np.float32(spec.format.max * spec.scale_spec.max))))
    s = jnp.maximum(div_mag(amax, denom), 0x00800000)
    s = jnp.where(amax > 0, s, const_bits(1.0))
    return jnp.where(amax < INF, s, QNAN)
