"""``tensor_stats``: how well one tensor fits a quantization spec.

For a tensor ``x`` and a ``QuantSpec`` (see ``lowprec.quant``), quantization computes per scaling group a scale
``s`` and rounds the *scaled* values ``v = x / s`` (``v = x * m`` for float32 scales, ``m = max_elem / amax``) onto
the element grid, ``x_hat = Q(v) * s``.  Two things go wrong, at the two ends of the grid:

* **underflow**: ``|v|`` is below half the smallest subnormal, so a nonzero ``x`` becomes 0 (information lost
  entirely; with few exponent bits, e.g. fp4, most of a group's small values do this);
* **overflow / saturation**: ``v`` rounded with an unbounded exponent range exceeds ``max_elem`` (IEEE 754's
  definition, and the quantizer's own test: ``quant._round.quantize_f32`` rounds the magnitude, then compares
  with max).  The OCP MX ``floor`` scale rule deliberately lets a block's largest element land up to 2x above
  ``max_elem``; delayed or clamped scales do too.  Saturating specs clamp it to ``+-max_elem``, the others turn
  it into inf/NaN.  A ``v`` just above max that rounds down to max anyway (a float32 multiplier
  ``m = fl(max_elem / amax)`` rounded up puts the amax element one float32 ulp above max) is *not* overflow.

This module counts both *exactly*: ``v`` is computed with the very scale arithmetic the quantizer uses
(``quant._scaled``) and rounded with the quantizer's ``round_magnitude`` (stochastic specs: to nearest), so
overflow is "rounds past max" (or a non-finite ``x_hat`` from a finite ``x``, e.g. every element of an MX block
holding an inf), and underflow is ``x != 0`` but ``fake_quantize(x) == 0``.  Both are percentages of the nonzero
elements (zeros can neither underflow nor overflow).

The overall error is the SQNR ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB (``lowprec.testing.sqnr_db``; each
bit of mantissa adds about 6 dB while nothing under- or overflows).  The dynamic range ``log2(amax / min |x|>0)``
in binades (over the whole tensor) says how much exponent range it needs: fp8 e4m3 spans about 17.8 binades
(2^-9 .. 448), fp4 e2m1 only 3.6 (0.5 .. 6), so under one tensor scale a tensor of 20 binades must lose its small
values to underflow; finer groups (rows, blocks) each need only their own range.  The scales are reported as log2
(min/mean/max over groups whose amax is nonzero and finite): a collapsing or exploding scale shows up there before
the loss does.

Trade-off: the statistics cost one eager fake quantization (the scale pass is shared with the overflow count)
plus about fifteen elementwise passes and reductions, and one device synchronisation (about 1.5 ms for a
128x128 float32 tensor on a CPU core); the observer therefore samples steps.
"""

from __future__ import annotations

import functools
import math

import torch

from .._errors import UsageError
from ..formats import FormatSpec
from ..quant import QuantSpec, _groups, _native
from ..quant._elementwise import stochastic_args
from ..quant._round import round_magnitude
from ..quant._scale import uses_multiplier
from ..quant._scaled import _f32, _fake, _prescaled, _scales

STATS: tuple[str, ...] = (
    "amax",
    "dynamic_range_log2",
    "underflow_pct",
    "overflow_pct",
    "nonfinite_pct",
    "sqnr_db",
    "scale_log2_min",
    "scale_log2_mean",
    "scale_log2_max",
)
"""The keys of ``tensor_stats``' result, in order."""


def resolve_spec(spec: QuantSpec | str | None) -> QuantSpec | None:
    """A ``QuantSpec`` (or None) from a spec, a name from ``QuantSpec.names()``, or None."""
    if spec is None or isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        return QuantSpec.named(spec)
    raise UsageError(f"spec must be a QuantSpec, a spec name or None; got {type(spec).__name__}")


@functools.lru_cache(maxsize=256)
def spec_name(spec: QuantSpec | None) -> str:
    """A short name: the built-in name where ``spec`` is one, "float32" for None, else ``<elem>/<scaling>``."""
    if spec is None:
        return "float32"
    for name in QuantSpec.names():
        if QuantSpec.named(name) == spec:
            return name
    return f"{spec.format.name}/{spec.scaling}"


def _scale_sums(xf: torch.Tensor, spec: QuantSpec, s: torch.Tensor, eff: torch.Tensor) -> list[torch.Tensor]:
    """[min, sum, max] of log2(effective scale) over groups with a nonzero finite amax, and their count."""
    g = _groups.group(xf, spec)
    gmax = g.abs().amax(dim=_groups.reduce_dims(spec, g.dim()), keepdim=True) if g.numel() else s.new_zeros(())
    eff, gmax = torch.broadcast_tensors(eff, gmax)
    valid = (gmax > 0) & (gmax < math.inf) & (eff > 0) & (eff < math.inf)
    lg = torch.log2(eff.double())
    return [torch.where(valid, lg, math.inf).amin(), torch.where(valid, lg, 0.0).sum(),
            torch.where(valid, lg, -math.inf).amax(), valid.sum().double()]


@functools.lru_cache(maxsize=64)
def _overflow_bounds(fmt: FormatSpec, rounding: str) -> tuple[tuple[float, bool], tuple[float, bool]]:
    """For positive and negative values: ``(bound, inclusive)`` such that ``|v| > bound`` (``>=`` when inclusive)
    is exactly "``v`` rounded with an unbounded exponent range lies beyond the format's finite range".

    Nearest: the midpoint between the largest magnitude and the next grid value above it; whether the midpoint
    itself overflows (ties to even) is asked of the quantizer's own ``round_magnitude``.  Toward zero: the next grid
    value.  Stochastic rounding is judged as nearest.
    """
    lims = (fmt.max, -fmt.min if fmt.kind == "int" else fmt.max)
    if fmt.kind == "float" and fmt.mbits == 23 and fmt.emin <= -126:
        return (math.inf, False), (math.inf, False)  # float32 itself: nothing to round
    step = math.ldexp(1.0, -fmt.frac_bits if fmt.kind == "int" else fmt.emax - fmt.mbits)
    out = []
    for lim in lims:
        if rounding == "toward_zero":
            out.append((lim + step, True))
            continue
        mid = lim + step / 2
        bits = torch.tensor([mid], dtype=torch.float32).view(torch.int32)
        up = round_magnitude(bits, mbits=fmt.mbits, emin=fmt.emin, rounding="nearest", rbits=None,
                             ties_away=fmt.mbits == 0)
        out.append((mid, bool(up.item() > lim)))
    return out[0], out[1]


def _past(a: torch.Tensor, bound: tuple[float, bool]) -> torch.Tensor:
    return a >= bound[0] if bound[1] else a > bound[0]


def _rounds_past_max(v: torch.Tensor, fmt: FormatSpec, rounding: str) -> torch.Tensor:
    """Elementwise: ``v`` (float32), rounded onto ``fmt``'s grid with an unbounded exponent range, lies outside
    the format's finite range (inf counts; NaN does not)."""
    pos, neg = _overflow_bounds(fmt, rounding)
    a = v.abs()
    return _past(a, pos) if pos == neg else torch.where(v < 0, _past(a, neg), _past(a, pos))


def _zero_scale_groups_underflow(v: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """``v`` with 0 in groups whose effective scale is 0 (NVFP4's "te" rule: a block far below the tensor's amax):
    their values dequantize to 0, an underflow, whatever ``x * m`` (up to x times float32 max) was rounded to."""
    return torch.where(eff == 0, 0.0, v)


def _quantized_parts(xf: torch.Tensor, spec: QuantSpec, finite: torch.Tensor,
                     nonzero: torch.Tensor) -> list[torch.Tensor]:
    """Device scalars: underflow and overflow counts, signal and noise norms, then ``_scale_sums``."""
    _groups.check_layout(xf.shape, spec)
    keys, off = stochastic_args(spec.rounding, 0 if spec.rounding == "stochastic" else None, 0, xf.numel(),
                                xf.device)
    s, s_t = _scales(xf, spec)
    q = _fake(xf, s, s_t, keys, off, spec)  # fake_quantize(xf, spec, seed=0): the same two passes
    v, eff = _prescaled(xf, s, s_t, spec)  # the grouped values the quantizer rounds
    v = _groups.ungroup(_zero_scale_groups_underflow(v, eff), spec, xf.shape)
    under = nonzero & (q == 0)
    over = finite & nonzero & (_rounds_past_max(v, spec.format, spec.rounding) | ~torch.isfinite(q))
    xd = xf.double()
    norms = [torch.linalg.vector_norm(xd), torch.linalg.vector_norm(xd - q)]
    if spec.scaling == "none":
        scale = [s.new_zeros((), dtype=torch.float64)] * 3 + [s.new_ones((), dtype=torch.float64)]
    else:
        scale = _scale_sums(xf, spec, s, eff)
    return [under.sum().double(), over.sum().double(), *norms, *scale]


def _native_parts(xf: torch.Tensor, spec: QuantSpec | None) -> list[float]:
    """``tensor_stats``' values in the order of ``_quantized_parts`` (after the four plain ones), with the
    elementwise counts and sums fused into one C pass (``quant._native.stats``): the quantizer's own passes
    (scales, fake quantization, the scaled values) and then one read of x, v and q instead of about fifteen
    tensor operations.  The sums are accumulated in double in element order (torch's vector_norm sums in its own
    order, so the SQNR may differ in the last bits of a double; the counts are exact either way)."""
    if spec is None:
        return _native.stats(xf, None, None)[:4]
    _groups.check_layout(xf.shape, spec)
    keys, off = stochastic_args(spec.rounding, 0 if spec.rounding == "stochastic" else None, 0, xf.numel(),
                                xf.device)
    s, s_t = _scales(xf, spec)
    q = _fake(xf, s, s_t, keys, off, spec).contiguous()
    bounds = _overflow_bounds(spec.format, spec.rounding)
    one_scale = spec.scaling in ("none", "tensor") and s_t is None
    if one_scale:  # v = x * m, x / s or x: computed inside the C pass with the quantizer's float32 operation
        sv = float(s.reshape(()).item())
        if spec.scaling == "none":
            vals = _native.stats(xf, q, bounds)
        elif uses_multiplier(spec):
            vals = _native.stats(xf, q, bounds, mul=sv)
        else:
            vals = _native.stats(xf, q, bounds, div=sv)
    else:
        v, eff = _prescaled(xf, s, s_t, spec)
        v = _zero_scale_groups_underflow(v, eff)
        vals = _native.stats(xf, q, bounds, v=_groups.ungroup(v, spec, xf.shape).contiguous())
    sq = [vals[6] ** 0.5, vals[7] ** 0.5]
    if spec.scaling == "none":
        scale = [0.0, 0.0, 0.0, 1.0]
    elif one_scale:  # the one group is valid when the whole tensor's amax is nonzero and finite
        eff_v = _f32(1.0 / sv) if uses_multiplier(spec) else sv  # sv is already a float32 value
        ok = vals[3] == 0 and vals[0] > 0 and 0.0 < eff_v < math.inf
        lg = math.log2(eff_v) if ok else 0.0
        scale = [lg, lg, lg, 1.0] if ok else [math.inf, 0.0, -math.inf, 0.0]
    else:
        scale = [float(t) for t in torch.stack(_scale_sums(xf, spec, s, eff)).tolist()]
    return vals[:4] + [vals[4], vals[5], *sq, *scale]


def tensor_stats(x: torch.Tensor, spec: QuantSpec | str | None) -> dict[str, float]:
    """Statistics of ``x`` (any shape; float32, bfloat16 or float16) quantized with ``spec`` (None: float32 only).

    Returns a dict with the keys of ``STATS`` (Python floats):

    * ``amax``: max |x| over finite elements;
    * ``dynamic_range_log2``: log2(amax / smallest nonzero finite |x|); 0 for a constant or all-zero tensor;
    * ``underflow_pct``: % of nonzero elements that quantize to zero;
    * ``overflow_pct``: % of nonzero finite elements whose scaled value rounds past the element format's max
      (they saturate to +-max, or become inf/NaN) or that quantize to inf/NaN;
    * ``nonfinite_pct``: % of all elements of ``x`` that are inf or NaN;
    * ``sqnr_db``: SQNR of ``fake_quantize(x, spec)`` against ``x`` (inf when equal; -inf when finite values
      quantize to inf; NaN when ``x`` has NaN or inf);
    * ``scale_log2_min/mean/max``: log2 of the dequantization scale over groups with a nonzero finite amax (for
      tensor scaling the one scale; for float32 scales ``1/m``; with a two-level spec the effective scale); 0 for
      ``scaling="none"``, for spec None, and when every group is zero.

    ``x`` is quantized as given, so pass GEMM operands with the reduction dimension last, as ``EmulatedLinear``
    quantizes them.  Stochastic-rounding specs use seed 0 (the global random state is never touched).  For spec
    None the under/overflow percentages are 0 and the SQNR is inf.
    """
    spec = resolve_spec(spec)
    xf = x.detach().to(torch.float32)
    out = dict.fromkeys(STATS, 0.0)
    out["sqnr_db"] = math.inf
    if xf.numel() == 0:
        return out
    if _native.usable(xf):
        vals = _native_parts(xf, spec)
    else:
        finite = torch.isfinite(xf)
        nonzero = xf != 0  # NaN counts as nonzero
        ax = xf.abs()
        parts = [torch.where(finite, ax, 0.0).amax(), torch.where(finite & nonzero, ax, math.inf).amin(),
                 nonzero.sum(), (~finite).sum()]
        if spec is not None:
            parts += _quantized_parts(xf, spec, finite, nonzero)
        vals = torch.stack([p.double() for p in parts]).tolist()  # one device synchronisation
    amax, amin, n_nonzero, n_nonfinite = vals[:4]
    out["amax"] = amax
    out["dynamic_range_log2"] = math.log2(amax / amin) if amax > 0 else 0.0
    out["nonfinite_pct"] = 100.0 * n_nonfinite / xf.numel()
    if spec is None:
        return out
    n_under, n_over, signal, noise, lg_min, lg_sum, lg_max, n_valid = vals[4:]
    out["underflow_pct"] = 100.0 * n_under / max(n_nonzero, 1.0)
    out["overflow_pct"] = 100.0 * n_over / max(n_nonzero, 1.0)
    if math.isnan(noise) or math.isnan(signal) or (math.isinf(noise) and math.isinf(signal)):
        out["sqnr_db"] = math.nan
    elif noise > 0:  # an infinite error (finite values quantized to inf) or a zero signal: -inf dB
        ratio = signal / noise
        out["sqnr_db"] = 20.0 * math.log10(ratio) if ratio > 0 else -math.inf
    if n_valid > 0:
        out["scale_log2_min"], out["scale_log2_mean"], out["scale_log2_max"] = lg_min, lg_sum / n_valid, lg_max
    return out
