"""Rounding float32 values onto a format's grid in JAX: the same integer kernel as ``lowprec.quant._round``.

The math is in ``lowprec.quant._round``'s docstring: for the int32 bit pattern of ``|x|`` with significand
``sig`` and ``d`` bits to discard, ``n = sig >> d`` and the discarded ``rem`` decide whether ``n`` goes up by one.
This module runs exactly those integer operations on ``jnp.int32`` arrays.  One difference of route, not of
result: PyTorch forms the rounded value as ``float(n) * 2^k``; here it is assembled from bits (``_bits.make_float``)
and every comparison with the format's max is an integer comparison of bit patterns, because XLA on CPU/TPU
flushes float32 subnormals to zero and would lose the subnormal results that PyTorch keeps.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._errors import UsageError
from ..formats import FormatSpec
from ._bits import ABS, INF, QNAN, SIGN, bits, const_bits, f32, make_float


def round_magnitude(
    a: jnp.ndarray,
    *,
    mbits: int,
    emin: int,
    rounding: str,
    rbits: jnp.ndarray | None,
    ties_away: bool = False,
) -> jnp.ndarray:
    """Round magnitudes ``a`` (int32 float32 bit patterns, sign cleared, finite) onto the grid; int32 bits out
    (possibly above the format's max: overflow is the caller's job)."""
    e = a >> 23
    eff_e = jnp.maximum(e, 1)
    sig = jnp.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
    d = (23 - mbits) + jnp.maximum((emin + 127) - eff_e, 0)
    dc = jnp.minimum(d, 30)
    n = sig >> dc
    one = jnp.int32(1)
    mask = jnp.left_shift(one, dc) - 1
    rem = sig & mask
    if rounding == "nearest":
        half = jnp.left_shift(one, dc) >> 1
        bias = half if ties_away else half - 1 + (n & 1)
        up = (rem + bias) > mask
    elif rounding == "toward_zero":
        up = None
    elif rounding == "away":
        up = rem != 0
    elif rounding == "stochastic":
        if rbits is None:
            raise UsageError("stochastic rounding needs random bits")
        u = (rbits.astype(jnp.uint32) >> 1).astype(jnp.int32)  # 31 random bits
        thr_exact = jnp.left_shift(rem, jnp.clip(31 - d, 0, 31))
        thr_trunc = sig >> jnp.clip(d - 31, 0, 31)
        up = u < jnp.where(d <= 31, thr_exact, thr_trunc)
    else:
        raise UsageError(f"rounding must be 'nearest', 'stochastic' or 'toward_zero', got {rounding!r}")
    if up is not None:
        n = n + up.astype(jnp.int32)
    big_e = jnp.maximum(eff_e - 127, emin)
    return make_float(n, big_e - mbits)


def quantize_bits(
    b: jnp.ndarray, fmt: FormatSpec, *, rounding: str, saturate: bool, rbits: jnp.ndarray | None
) -> jnp.ndarray:
    """``lowprec.quant._round.quantize_f32`` on int32 bit patterns: bits of ``x`` rounded onto ``fmt``'s grid with
    the format's overflow and NaN rules (see that function for the rules)."""
    if fmt.kind == "float" and fmt.mbits == 23 and fmt.emin <= -126:
        return b
    a = b & ABS
    neg = b < 0
    finite = a < INF
    mag = round_magnitude(
        jnp.where(finite, a, 0), mbits=fmt.mbits, emin=fmt.emin, rounding=rounding, rbits=rbits,
        ties_away=fmt.mbits == 0,
    )
    fmax = const_bits(fmt.max)
    if fmt.kind == "int":
        lo = const_bits(-fmt.min)  # magnitude of the most negative code
        mag = jnp.where(neg, jnp.minimum(mag, lo), jnp.minimum(mag, fmax))
        out = jnp.where(neg & (mag != 0), mag | SIGN, mag)  # one zero: +0
        inf_out = jnp.where(neg, lo | SIGN, fmax)
        return jnp.where(finite, out, jnp.where(a == INF, inf_out, b))  # inf saturates, NaN stays NaN
    if not fmt.signed:  # exponent-only scale format (E8M0): no zero, no sign
        mag = jnp.maximum(mag, const_bits(fmt.min_normal))
        mag = jnp.where(mag > fmax, fmax if saturate else QNAN, mag)
        return jnp.where((b > 0) & finite, mag, QNAN)
    over = mag > fmax
    if saturate or fmt.special == "finite" or rounding == "toward_zero":
        mag = jnp.where(over, fmax, mag)
    else:
        mag = jnp.where(over, INF if fmt.has_inf else QNAN, mag)
    if fmt.has_negative_zero:
        out = mag | (b & SIGN)
    else:  # fnuz: no -0
        out = jnp.where(neg & (mag != 0), mag | SIGN, mag)
    if fmt.has_inf:
        special = b
    elif fmt.special == "finite":
        special = jnp.where(a > INF, b, jnp.where(neg, fmax | SIGN, fmax))
    else:
        special = jnp.full_like(b, QNAN)
    return jnp.where(finite, out, special)


def quantize_f32(
    x: jnp.ndarray, fmt: FormatSpec, *, rounding: str, saturate: bool, rbits: jnp.ndarray | None
) -> jnp.ndarray:
    """``x`` (float32) rounded onto ``fmt``'s grid; float32 out (see ``quantize_bits``)."""
    return f32(quantize_bits(bits(x), fmt, rounding=rounding, saturate=saturate, rbits=rbits))
