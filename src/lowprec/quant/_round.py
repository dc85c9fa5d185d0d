"""Rounding a float32 tensor onto a format's grid, with bit operations only.

A finite float32 ``x = (-1)^s * sig * 2^(e - 150)`` has a 24-bit significand ``sig`` (implicit bit included for
normals; ``e`` is the biased exponent, 1 for subnormals).  A target format with ``M`` mantissa bits and smallest
normal exponent ``emin`` has, around ``x``, the step

    step = 2^(E - M),   E = max(e - 127, emin)

(a binade holds ``2^M`` steps; below ``2^emin`` subnormals keep the step ``2^(emin - M)``).  Rounding ``x`` to a
multiple of ``step`` discards the low ``d = 23 - M + max(0, emin + 127 - e)`` bits of ``sig``:

    n   = sig >> d                 the multiple of step at or below |x|
    rem = sig & (2^d - 1)          the discarded part, in units of 2^-d steps
    n' = n + up                    up = 1 when rounding away from zero

* nearest, ties to even: ``up = rem > 2^(d-1) or (rem == 2^(d-1) and n is odd)``
* toward zero: ``up = 0``
* stochastic: ``up = u < rem * 2^(31 - d)`` with ``u`` 31 uniform random bits, so ``P(up) = rem / 2^d`` exactly:
  the distance to the lower grid point over the step.  This uses every discarded bit whenever ``d <= 31``, i.e. for
  every ``|x| >= 2^-8`` times the format's smallest subnormal; below that (``P(up) < 2^-8``) the probability is
  truncated to a multiple of 2^-31 (a bias under 2^-31 of one smallest step).

The result ``n' * 2^(E - M)`` is computed as an int-to-float conversion (exact: ``n' <= 2^24``) times a power of
two (exact: the result is on the target grid, which float32 contains).  ``n' = 2^(M+1)`` is the carry into the
next binade and comes out right by itself.  Overflow (result above the format's max) and NaN/inf are applied after.

Integer formats reuse the same kernel: an integer with step ``2^-f`` is a float whose range is all "subnormal",
``M = bits - 1`` and ``emin = M - f``.
"""

from __future__ import annotations

import torch

from .._errors import UsageError
from ..formats import FormatSpec
from . import _backend

_SIGN = -(1 << 31)  # 0x80000000 as int32
_ABS = 0x7FFFFFFF
_EXP_INF = 0x7F800000


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0 ** k`` as float32 for int32 ``k`` in ``[-149, 127]``, built from bits."""
    k = k.to(torch.int32)
    normal = (k + 127) << 23
    sub = 1 << torch.clamp(k + 149, 0, 22)
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def round_magnitude(
    a: torch.Tensor,
    *,
    mbits: int,
    emin: int,
    rounding: str,
    rbits: torch.Tensor | None,
    ties_away: bool = False,
) -> torch.Tensor:
    """Round the magnitudes ``a`` (int32 float32 bit patterns, sign cleared, finite) onto the grid.

    Returns float32 magnitudes (possibly above the format's max: overflow is the caller's job).
    """
    e = a >> 23
    eff_e = torch.clamp(e, min=1)
    sig = torch.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
    d = (23 - mbits) + torch.clamp((emin + 127) - eff_e, min=0)
    dc = torch.clamp(d, max=30)  # sig < 2^24, so shifting by >= 25 already gives 0
    n = sig >> dc
    mask = (1 << dc) - 1
    rem = sig & mask
    if rounding == "nearest":
        half = (1 << dc) >> 1
        bias = half if ties_away else half - 1 + (n & 1)
        up = (rem + bias) > mask
    elif rounding == "toward_zero":
        up = None
    elif rounding == "away":  # internal: round magnitudes up (used for "ceil" scale rounding)
        up = rem != 0
    elif rounding == "stochastic":
        if rbits is None:
            raise UsageError("stochastic rounding needs random bits")
        u = (rbits >> 1) & _ABS
        # P(up) = rem / 2^d.  For d <= 31 the threshold rem * 2^(31-d) < 2^31 is exact.
        thr_exact = rem << torch.clamp(31 - d, 0, 31)
        thr_trunc = sig >> torch.clamp(d - 31, 0, 31)
        up = u < torch.where(d <= 31, thr_exact, thr_trunc)
    else:
        raise UsageError(f"rounding must be 'nearest', 'stochastic' or 'toward_zero', got {rounding!r}")
    if up is not None:
        n = n + up.to(torch.int32)
    big_e = torch.clamp(eff_e - 127, min=emin)
    if _backend.xla_forms(a):  # XLA flushes float32 subnormals: build n' * 2^k from bits (``_make_float``)
        return _make_float(n, big_e - mbits)
    return n.to(torch.float32) * _pow2(big_e - mbits)


def _make_float(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``n * 2^k`` as float32 for int32 ``0 <= n <= 2^24`` and ``k >= -149`` (the value on float32's grid; +inf above
    its range), by integer operations only: what ``n.to(float32) * _pow2(k)`` gives on the CPU.  XLA (on the CPU as on
    TPUs) reads float32 subnormal operands as zero and writes zero for subnormal results, so the product would lose
    every subnormal; here no subnormal reaches float arithmetic (the int-to-float conversion is exact and normal)."""
    fb = n.to(torch.float32).view(torch.int32)
    ef = (fb >> 23) + k  # the result's exponent field where it is normal
    sub = n << torch.clamp(k + 149, 0, 31)  # a subnormal's bits are its multiple of 2^-149
    out = torch.where(ef >= 1, fb + (k << 23), sub)
    out = torch.where(ef >= 255, _EXP_INF, out)
    return torch.where(n == 0, 0, out).view(torch.float32)


def _bf16_nearest_bits(x: torch.Tensor, fmt: FormatSpec, saturate: bool) -> torch.Tensor:
    """``quantize_f32(x, bfloat16, rounding="nearest", ...)`` in four integer operations, the form compiled graphs
    use for bfloat16 (1.5x the time of a copy at 400K elements, the float route below 2.5x).  bfloat16 is float32
    with the low 16 bits dropped (same exponent field, subnormals included), so round-to-nearest-even is
    ``(b + 0x7FFF + bit16) & 0xFFFF0000`` on the bits ``b``: the carry out of the dropped bits steps the magnitude
    to the next bfloat16 up, or from the largest finite one to inf (IEEE overflow), and never reaches the sign.
    Saturation clamps first (max is on the grid); non-finite values pass unchanged (inf stays inf even when
    saturating, NaN keeps its bits), as in the integer route."""
    v = torch.clamp(x, -fmt.max, fmt.max) if saturate else x
    b = v.view(torch.int32)
    r = ((b + (0x7FFF + ((b >> 16) & 1))) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), r, x)


def _nearest_magnitude_float_route(a: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """``round_magnitude(a, rounding="nearest")`` for a float format with 1 to 22 mantissa bits and ``emin >= -126``
    by float32 arithmetic, the form compiled graphs use: with ``C = 1.5 * 2^(E + 23 - M)`` for the exponent ``E``
    of ``v`` (at least ``emin``: subnormals of the format round on its fixed grid), ``v + C`` lies in a binade whose
    float32 spacing is the format's step at ``v``, so float32's own round-to-nearest-even in the addition is the
    format's, and ``(v + C) - C`` is exact.  Magnitudes are clamped to ``2 * max`` first (``v + C`` stays finite;
    anything above max is overflow either way, decided by the caller on the result).

    Why: inside torch.compile the integer route's variable shifts become a loop inductor's CPU code does not
    vectorize (bfloat16 at 400K elements: 3.5x the time of a copy; this route 1.4x).  The dtype cast
    ``x.to(bfloat16).to(float32)`` is no substitute: inductor drops such cast pairs inside fused kernels (its
    ``emulate_precision_casts`` is off by default).  Eager calls keep the integer route, the oracle this one is
    tested against (tests/test_compiled.py: whole binades, 2^32 strided bit patterns)."""
    v = torch.clamp(a.view(torch.float32), max=2.0 * fmt.max)
    k, cmin = 1.5 * 2.0 ** (23 - fmt.mbits), 1.5 * 2.0 ** (23 + fmt.emin - fmt.mbits)
    c = torch.clamp((v.view(torch.int32) & _EXP_INF).view(torch.float32) * k, min=cmin)
    return (v + c) - c


def traced_nearest_is_fast(fmt: FormatSpec) -> bool:
    """Whether round-to-nearest onto ``fmt`` traces, inside torch.compile, to a route inductor vectorizes (the
    bf16 bit form or the float route of ``quantize_f32``); the integer route of other formats does not."""
    return fmt.name == "bfloat16" or _float_route_ok(fmt)


def _float_route_ok(fmt: FormatSpec) -> bool:
    """Formats the float route handles: ``v + C`` must stay finite for ``v`` up to ``2 * max``, so not the formats
    with float32's exponent range (bfloat16 takes its bit form, tf32 the integer route)."""
    return (fmt.kind == "float" and fmt.signed and 1 <= fmt.mbits <= 22 and fmt.emin >= -126
            and 2.0 * fmt.max < 2.0 ** (126 - (24 - fmt.mbits)))


def _bits_of(v: float) -> int:
    """The float32 bit pattern of ``v`` (exactly a float32) as a Python int (non-negative ``v``)."""
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


def _no_negative_zero(v: torch.Tensor) -> torch.Tensor:
    """``v`` with -0 turned into +0 (``v + 0.0``; on XLA, whose simplifier drops an added zero, by bits)."""
    if _backend.xla_forms(v):
        return torch.where((v.view(torch.int32) & _ABS) == 0, 0.0, v)
    return v + 0.0


def quantize_f32(
    x: torch.Tensor,
    fmt: FormatSpec,
    *,
    rounding: str,
    saturate: bool,
    rbits: torch.Tensor | None,
) -> torch.Tensor:
    """``x`` (float32) rounded onto ``fmt``'s grid, with the format's overflow and NaN rules; float32 out.

    Overflow with ``saturate=False``: inf where the format has inf, NaN where it has NaN but no inf, and the
    largest finite value for formats with neither (float6/float4, as ml_dtypes does) and for integers.
    Round-toward-zero never overflows a finite value (it gives +-max, as IEEE 754 specifies).
    ``saturate=True`` clamps finite values to +-max.  NaN in gives NaN out.  Infinite input becomes inf, or NaN
    for formats without inf (kept visible even under ``saturate=True``), or +-max for formats with neither
    (integers: the most positive / most negative code).
    """
    if fmt.kind == "float" and fmt.mbits == 23 and fmt.emin <= -126:
        return x.clone()  # float32 itself
    compiling = torch.compiler.is_compiling() and not _backend.is_portable()  # inductor's forms (float arithmetic)
    if fmt.name == "bfloat16" and rounding == "nearest" and compiling:
        return _bf16_nearest_bits(x, fmt, saturate)
    bits = x.view(torch.int32)
    a = bits & _ABS
    finite = a < _EXP_INF
    if rounding == "nearest" and _float_route_ok(fmt) and compiling:
        mag = _nearest_magnitude_float_route(torch.where(finite, a, 0), fmt)
    else:
        mag = round_magnitude(
            torch.where(finite, a, 0),
            mbits=fmt.mbits,
            emin=fmt.emin,
            rounding=rounding,
            rbits=rbits,
            ties_away=fmt.mbits == 0,
        )
    fmax = fmt.max
    nan = float("nan")
    if fmt.kind == "int":
        signed = torch.where(bits < 0, -mag, mag)
        out = _no_negative_zero(torch.clamp(signed, fmt.min, fmax))  # integers have one zero
        inf_out = torch.clamp(x, fmt.min, fmax)
        if _backend.xla_forms(x):  # XLA's clamp of NaN gives the lower bound, torch's NaN
            inf_out = torch.where(torch.isnan(x), x, inf_out)
        return torch.where(finite, out, inf_out)  # inf saturates, NaN stays NaN
    if not fmt.signed:  # exponent-only scale format (E8M0): no zero, no sign
        if _backend.xla_forms(mag):  # min_normal (2^-127) is a float32 subnormal, which XLA compares as zero
            mag = torch.clamp(mag.view(torch.int32), min=_bits_of(fmt.min_normal)).view(torch.float32)
        else:
            mag = torch.clamp(mag, min=fmt.min_normal)
        over = mag > fmax
        mag = torch.where(over, fmax if saturate else nan, mag)
        return torch.where((bits > 0) & finite, mag, nan)
    over = mag > fmax
    # Round-toward-zero never rounds a finite value up past max (IEEE 754: it overflows to max, not inf).
    if saturate or fmt.special == "finite" or rounding == "toward_zero":
        mag = torch.where(over, fmax, mag)
    else:
        mag = torch.where(over, float("inf") if fmt.has_inf else nan, mag)
    if fmt.has_negative_zero:
        out = (mag.view(torch.int32) | (bits & _SIGN)).view(torch.float32)
    else:
        out = _no_negative_zero(torch.where(bits < 0, -mag, mag))  # fnuz: no -0
    # Non-finite input.
    if fmt.has_inf:
        special = x
    elif fmt.special == "finite":
        special = torch.where(torch.isnan(x), x, torch.where(bits < 0, -fmax, fmax))
    else:
        special = torch.full_like(x, nan)
    return torch.where(finite, out, special)
