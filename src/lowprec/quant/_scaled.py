"""Scaled quantization: ``fake_quantize``, ``quantize_scaled`` (real storage) and ``dequantize``.

For each scaling group (see ``QuantSpec``) with scale ``s``:

    codes   = Q_elem(x / s)            rounded and saturated onto the element grid
    x_hat   = codes * s                what the hardware sees after dequantization

``fake_quantize(x, spec)`` returns ``x_hat`` in ``x``'s dtype; ``dequantize(*quantize_scaled(x, spec), spec)``
returns the same bits in float32.  With power-of-two scales both the division and the multiplication are exact.

Float32 scales follow TransformerEngine and torchao instead: ``m = max_elem / amax`` (float32), ``codes = Q(x * m)``
and ``x_hat = codes * fl(1/m)``; the stored scale is ``fl(1/m)``, exactly what ``torch._scaled_mm`` is given, so a
GEMM of fake-quantized operands reproduces torchao's Float8Linear bit for bit.

Two-level specs with ``two_level_rule="te"`` (NVFP4 as TransformerEngine computes it, ``QuantSpec``) also multiply:
``codes = Q(clamp(x * m))`` with ``m = fl(1 / fl(s * S_dec))``, and ``x_hat = codes * fl(s * s_t)``.

The work is two passes: ``_scales``, a reduction (per-group amax, then the scale), and ``_elements``, elementwise
(``x / s`` rounded onto the grid).  ``fake_quantize`` runs them as two kernels.  Compiled as one graph, inductor's
C++ backend inlines the per-group scale arithmetic into the elementwise loop and redoes it for every vector of
elements, which made block scaling (MX, NVFP4) four to five times slower than an unscaled cast; as two kernels the
scale arithmetic runs once per group (vectorized across groups) and the elementwise pass runs as fast as with one
tensor scale.  The values are the same either way: the same operations on the same float32 numbers.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, TypeAlias

import torch

from .._errors import UsageError
from . import _backend, _codec, _groups, _native, _native_group, _native_op, _random
from ._elementwise import (
    check_tensor,
    clamp_for,
    fast_round_ok,
    round_nearest_fast,
    route_constants,
    route_fits,
    stochastic_args,
)
from ._round import quantize_f32
from ._scale import _F32_MAX, group_scale, stored_tensor_scale, tensor_scale_from_amax, uses_multiplier
from ._scale_rules import TwoLevelScales as TwoLevelScales
from ._spec import QuantSpec
from ._spec_args import _resolve as _resolve

Scales: TypeAlias = torch.Tensor | TwoLevelScales


def _amax(g: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``max |g|`` over ``dims`` (kept as size 1); 0 for empty groups, so empty tensors pass through."""
    if g.numel() == 0:
        keep = {d % g.dim() for d in dims}
        return g.new_zeros([1 if i in keep else n for i, n in enumerate(g.shape)])
    return g.abs().amax(dim=dims, keepdim=True) if dims else g.abs()


def _scales(xf: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 1, a reduction: the grouped scales (broadcastable against the grouped view) and the tensor scale."""
    if spec.scaling == "none":
        return torch.ones((), dtype=torch.float32, device=xf.device), None
    g = _groups.group(xf, spec)
    amax = _amax(g, _groups.reduce_dims(spec, g.dim()))
    s_t = None
    if spec.tensor_scale:  # the tensor's amax is the max of the group amaxes (max is exact): no second read of x
        s_t = tensor_scale_from_amax(_amax(amax, tuple(range(amax.dim()))).reshape(()), spec)
    return group_scale(amax, spec, s_t), s_t


def _elements(
    xf: torch.Tensor,
    s: torch.Tensor,
    s_t: torch.Tensor | None,
    keys: torch.Tensor | None,
    off: torch.Tensor | None,
    spec: QuantSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2, elementwise: grouped element values ``q`` (on the element grid) and the effective scale."""
    rbits = None
    if keys is not None and off is not None:
        rbits = _groups.group(_random.random_bits(keys, off, xf.numel(), xf.device).view(xf.shape), spec)
    v, eff = _prescaled(xf, s, s_t, spec)
    v = _te_clamp(v, spec)
    return quantize_f32(v, spec.format, rounding=spec.rounding, saturate=spec.saturate, rbits=rbits), eff


def _prescaled(
    xf: torch.Tensor, s: torch.Tensor, s_t: torch.Tensor | None, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped values to round (``x / scale``, or ``x * m`` for float32 scales) and the effective scale."""
    if spec.scaling == "none":
        return xf, s
    g = _groups.group(xf, spec)
    if uses_multiplier(spec):  # float32 scales: s is the multiplier m; dequantize with its reciprocal
        return g * s, 1.0 / s
    if s_t is not None and spec.two_level_rule == "te":  # s_t = [s_t, m6, S_dec] (_scale.te_tensor_scales)
        m = torch.clamp(torch.ones_like(s) / (s * s_t[2]), max=_F32_MAX)  # a zero scale: 1/0 -> float32 max
        return g * m, s * s_t[0]  # x * float32 max may be inf: _te_clamp before rounding
    eff = s if s_t is None else s * s_t
    if s_t is None and not spec.scale_spec.signed and _backend.xla_forms(g):
        return _xla_pow2(g, eff, "divide"), eff
    return g / eff, eff


_E8M0_MIN_BITS = 0x00400000
"""The float32 bits of 2^-127, E8M0's smallest scale (a block whose amax is below 2^-118: an all-zero block)."""


def _xla_pow2(v: torch.Tensor, scale: torch.Tensor, op: str) -> torch.Tensor:
    """``v / scale`` or ``v * scale`` for power-of-two (E8M0) scales on XLA.  The smallest scale, 2^-127, is a float32
    subnormal, which XLA reads as zero: an all-zero block would give 0 / 0 = NaN, a tiny one 0.  There the quotient
    is ``v * 2^127`` and the product ``(v * 2^-63) * 2^-64`` (the first factor exact), the same correctly rounded
    values as the CPU's single operation (a product that is itself subnormal XLA still writes as zero)."""
    tiny = scale.view(torch.int32) == _E8M0_MIN_BITS
    if op == "divide":
        return torch.where(tiny, v * 2.0**127, v / scale)
    return torch.where(tiny, (v * 2.0**-63) * 2.0**-64, v * scale)


def _te_clamp(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """TE's clamp of the scaled values to +-max before the cast, for a saturating ``two_level_rule="te"`` spec (the
    same rounding as saturation for finite values; it turns the inf of x * float32 max, a zero group scale's
    multiplier, into +-max).  ``v`` unchanged for other specs."""
    if spec.tensor_scale and spec.two_level_rule == "te" and spec.saturate:
        return torch.clamp(v, -spec.format.max, spec.format.max)
    return v


def _core(
    xf: torch.Tensor, keys: torch.Tensor | None, off: torch.Tensor | None, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Grouped element values ``q`` (on the element grid), grouped scales, and the tensor scale (or None)."""
    s, s_t = _scales(xf, spec)
    q, _ = _elements(xf, s, s_t, keys, off, spec)
    return q, s, s_t


def _scales_kernel(x: torch.Tensor, *, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _scales(x.to(torch.float32), spec)


def _fake_kernel(
    x: torch.Tensor,
    s: torch.Tensor,
    s_t: torch.Tensor | None,
    keys: torch.Tensor | None,
    off: torch.Tensor | None,
    *,
    spec: QuantSpec,
) -> torch.Tensor:
    """``x_hat`` in ``x``'s dtype, still padded where a group size does not divide ``x``'s shape (see ``_fake``)."""
    q, eff = _elements(x.to(torch.float32), s, s_t, keys, off, spec)
    if s_t is None and spec.scaling != "none" and not spec.scale_spec.signed and _backend.xla_forms(q):
        return _groups.ungroup_padded(_xla_pow2(q, eff, "multiply"), spec).to(x.dtype)
    return _groups.ungroup_padded(q * eff, spec).to(x.dtype)


def _fake_fast(x: torch.Tensor, s: torch.Tensor, s_t: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor | None:
    """``_fake_kernel``'s result by the eager float32 rounding route (``_elementwise.round_nearest_fast``), or None
    where that route does not apply."""
    xf = x.to(torch.float32)
    v, eff = _prescaled(xf, s, s_t, spec)
    v = _te_clamp(v, spec)
    # v = x * m or x / scale with positive scales: a fresh tensor with the signs of the grouped x
    sign = None if spec.scaling == "none" else _groups.group(xf, spec)
    q = round_nearest_fast(v, spec.format, saturate=spec.saturate, sign=sign)
    if q is None:
        return None
    return _groups.ungroup_padded(q.mul_(eff), spec).to(x.dtype)


def _f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (ties to even), inf on overflow."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


class _TensorwisePlan(NamedTuple):
    """What ``_tensorwise_fast`` needs from a spec, worked out once per spec (``_tensorwise_plan``)."""

    fmax: float  # the element format's largest finite value
    margin: float  # 2^-margin
    route_limit: float  # ``route_fits``: the float route handles magnitudes below this
    clamp_over: float | bool  # ``clamp_for`` when vmax > fmax: clamp to fmax, or False (the kernel's rules)
    k: float  # ``route_constants``
    cmin: float
    signed_zero: bool


_plans: dict[int, tuple[QuantSpec, _TensorwisePlan | None]] = {}


def _tensorwise_plan(spec: QuantSpec) -> _TensorwisePlan | None:
    """The spec's ``_TensorwisePlan``, or None when ``_tensorwise_fast`` never applies to it (cached by identity:
    specs are frozen, and the cache holds the spec so its id is not reused)."""
    hit = _plans.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    fmt = spec.format
    plan = None
    if (spec.scaling == "tensor" and spec.rounding == "nearest" and uses_multiplier(spec)
            and fast_round_ok(fmt, "nearest")):
        k, cmin = route_constants(fmt)
        over = clamp_for(fmt, math.inf, spec.saturate)  # above every max: fmt.max (clamp) or False, never None
        assert over is not None
        plan = _TensorwisePlan(fmt.max, 2.0 ** -spec.margin, 2.0 ** (126 - (24 - fmt.mbits)), over, k, cmin,
                               fmt.has_negative_zero)
        assert route_fits(fmt, math.nextafter(plan.route_limit, 0.0)) and not route_fits(fmt, plan.route_limit)
    if torch.compiler.is_compiling():  # no global mutation while dynamo traces (a side effect it rejects inside
        return plan  # an autograd.Function's backward)
    if len(_plans) > 4096:
        _plans.clear()
    _plans[id(spec)] = (spec, plan)
    return plan


def _tensorwise_fast(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None, *, native_only: bool = False
                     ) -> torch.Tensor | None:
    """``fake_quantize`` for a float32-scale tensorwise spec with round-to-nearest, eagerly with the scale arithmetic
    on Python floats (about ten tensor operations in all); None where it does not apply (with ``native_only``:
    also where the native kernels do not, ``_backend.runs_native``).

    Same bits as ``_scales`` + ``_fake_kernel``: ``amax`` is exact (a max), and for float32 operands a division,
    product or reciprocal computed in double and rounded once to float32 is the correctly rounded float32 result
    (double has more than 2 * 24 + 2 bits), which is what torch's float32 operations give.  ``max |x * m|`` is
    ``fl(max |x| * m)`` because rounding is monotonic.
    """
    plan = _tensorwise_plan(spec)
    if plan is None:
        return None
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    native = _native.usable(xf)
    if native_only and not native:
        return None
    if native:
        xmax = _native.absmax(xf)
        if xmax is None:
            return None  # NaN or inf in x: the kernels' rules
    else:
        lo_t, hi_t = torch.aminmax(x)
        lo, hi = lo_t.item(), hi_t.item()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None  # NaN or inf in x: the kernels' rules
        xmax = max(abs(lo), abs(hi))
    a = xmax if amax is None else float(amax.to(torch.float32).item())
    if not (math.isfinite(a) and a >= 0.0):
        return None
    m = min(_f32(plan.fmax / a), _F32_MAX) if a > 0.0 else _F32_MAX  # group_scale: clamp(max_elem / amax, max=...)
    if plan.margin != 1.0:
        m = _f32(m * plan.margin)
    if not (math.isfinite(m) and m > 0.0):
        return None
    vmax = _f32(xmax * m)
    # one fused pass (x * m, round, times 1/m) where x * m stays finite and v + C cannot overflow (_native.c)
    if native and math.isfinite(vmax) and min(vmax, plan.fmax) < plan.route_limit:
        clamp = None if vmax <= plan.fmax else plan.clamp_over  # clamp_for
        if clamp is False:
            return None
        y = _native.round_nearest(xf, k=plan.k, cmin=plan.cmin, mul=m, post=_f32(1.0 / m), clamp=clamp,
                                  signed_zero=plan.signed_zero)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    if native_only:
        return None
    v = xf * m
    q = round_nearest_fast(v, spec.format, saturate=spec.saturate, vmax=vmax, sign=xf)
    if q is None:
        return None
    return q.mul_(_f32(1.0 / m)).to(x.dtype)


def _eager_fast(x: torch.Tensor, spec: QuantSpec, keys: torch.Tensor | None, off: torch.Tensor | None,
                amax: torch.Tensor | None) -> torch.Tensor | None:
    """The eager fast routes, same bits as the kernels: tensorwise round-to-nearest with Python-float scale
    arithmetic (``_tensorwise_fast``, which also takes a delayed ``amax``), else any spec in one native call
    (``_native_group``); None where neither applies.  Where the backend would compile (large tensors under
    "auto"), only the native kernels (``_backend.runs_native``)."""
    n = x.numel()
    if n == 0 or not _backend.runs_native(n) or _backend.traces_lazily(x):
        return None
    if _tensorwise_plan(spec) is not None:
        y = _tensorwise_fast(x, spec, amax, native_only=not _backend.runs_eager(n))
        if y is not None:
            return y
    elif spec.scaling == "none" and spec.rounding == "nearest" and x.dtype == torch.float32:
        # unscaled round to nearest (bf16 / fp16 operands): the float route, one fused pass after one max pass
        # (half the time of the grouped kernel's integer loop); None where NaN or inf or overflow is present
        fmt = spec.format
        if fast_round_ok(fmt, "nearest"):
            y = round_nearest_fast(x, fmt, saturate=spec.saturate, native_only=not _backend.runs_eager(n))
            if y is not None:
                return y
    return _native_group.fake(x, spec, keys, off) if amax is None else None


def _fake(
    x: torch.Tensor,
    s: torch.Tensor,
    s_t: torch.Tensor | None,
    keys: torch.Tensor | None,
    off: torch.Tensor | None,
    spec: QuantSpec,
) -> torch.Tensor:
    """Run ``_fake_kernel``, crop its padding outside the kernel, and give the result ``x``'s layout (eagerly).

    Compiled, a crop inside the kernel lets inductor (torch 2.13) iterate over ``floor(K / block)`` whole blocks
    of the cropped output and never write the last partial block (uninitialised memory comes back); the padded
    output has whole blocks only.
    """
    y = None
    if (keys is None and _backend.runs_eager(x.numel()) and fast_round_ok(spec.format, spec.rounding)
            and not _backend.traces_lazily(x)):
        y = _fake_fast(x, s, s_t, spec)
    if y is None:
        y = _backend.run(_fake_kernel, x.numel(), x, s, s_t, keys, off, spec=spec)
    if torch.compiler.is_compiling():
        return y if y.shape == x.shape else _groups.crop(y, x.shape).contiguous()
    if y.shape != x.shape:
        y = _groups.crop(y, x.shape)
    if y.stride() != x.stride():
        y = torch.empty_like(x).copy_(y)  # x's layout, whatever the grouping's views did (as _native_group gives)
    return y


def _check(x: torch.Tensor, spec: object) -> QuantSpec:
    check_tensor(x)
    spec = _resolve(spec)
    _groups.check_layout(x.shape, spec)
    return spec


def fake_quantize(
    x: torch.Tensor, spec: QuantSpec | str, *, seed: int | None = None, offset: int = 0
) -> torch.Tensor:
    """Quantize with ``spec`` and dequantize again: ``x``'s shape and dtype, values as the hardware sees them.

    Args:
        x: float32, bfloat16 or float16 tensor.
        spec: a ``QuantSpec`` or a name from ``QuantSpec.names()`` (e.g. "mxfp8_e4m3", "nvfp4").
        seed, offset: random bits for ``spec.rounding == "stochastic"``, as in ``quantize``.
    """
    spec = _check(x, spec)
    keys, off = stochastic_args(spec.rounding, seed, offset, x.numel(), x.device)
    y = _eager_fast(x, spec, keys, off, None)
    if y is not None:
        return y
    if spec.scaling == "none":
        s, s_t = _scales(x, spec)  # a constant: no kernel needed
    else:
        s, s_t = _backend.run(_scales_kernel, x.numel(), x, spec=spec)  # two kernels: see the module docstring
    return _fake(x, s, s_t, keys, off, spec)


def quantize_scaled(
    x: torch.Tensor, spec: QuantSpec | str, *, seed: int | None = None, offset: int = 0
) -> tuple[torch.Tensor, Scales]:
    """Real low-bit storage: ``(codes, scales)`` with ``x ≈ codes * scales`` per group.

    codes: the element format's storage (``_codec`` module docstring: torch float8 dtypes, packed uint8 for 4- and
    6-bit formats, int8).  scales: in the scale format's dtype (float32, bfloat16, torch.float8_e8m0fnu,
    torch.float8_e4m3fn), shaped as described in ``QuantSpec``; for two-level specs a ``TwoLevelScales``.
    """
    spec = _check(x, spec)
    keys, off = stochastic_args(spec.rounding, seed, offset, x.numel(), x.device)
    q, s, s_t = _core(x.to(torch.float32), keys, off, spec)
    codes = _codec.encode(_groups.ungroup(q, spec, x.shape).contiguous(), spec.format)
    scale_dtype = _codec.torch_dtype(spec.scale_spec)
    if scale_dtype is None:
        raise UsageError(f"no torch dtype stores scale format {spec.scale_spec.name}; use fake_quantize")
    scales = _groups.scales_out(1.0 / s if uses_multiplier(spec) else s, spec).to(scale_dtype)
    if s_t is not None:
        return codes, TwoLevelScales(scales, stored_tensor_scale(s_t, spec))
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: Scales,
    spec: QuantSpec | str,
    *,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values ``codes * scales`` from ``quantize_scaled``'s output, in ``dtype``.

    ``shape``: the original tensor's shape; needed only for packed 4/6-bit codes whose last dimension was not a
    multiple of 2 (float4) or 4 (float6), otherwise inferred.
    """
    spec = _resolve(spec)
    last = shape[-1] if shape else None
    elems = _codec.decode(codes, spec.format, last)
    if shape is not None and tuple(elems.shape) != tuple(shape):
        raise UsageError(f"codes decode to shape {tuple(elems.shape)}, not the given shape {tuple(shape)}")
    if isinstance(scales, TwoLevelScales):
        s = _groups.scales_in(scales.group.to(torch.float32), spec) * scales.tensor.to(torch.float32)
    else:
        s = _groups.scales_in(scales.to(torch.float32), spec)
    g = _groups.group(elems, spec)
    return _groups.ungroup(g * s, spec, elems.shape).to(dtype)


def fake_quantize_tensors(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    keys: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fake_quantize`` for training code: random keys/offset already as int32 tensors (so compiled training steps
    do not specialise on them) and, for tensor scaling, an ``amax`` that replaces the tensor's own (delayed
    scaling).  ``keys``/``offset`` are used only when ``spec.rounding == "stochastic"``."""
    if spec.rounding != "stochastic":
        keys = offset = None
    elif keys is None or offset is None:
        raise UsageError("fake_quantize_tensors: stochastic rounding needs keys and offset tensors")
    if amax is not None and spec.scaling != "tensor":
        raise UsageError(f"an explicit amax needs scaling='tensor'; got scaling={spec.scaling!r}")
    if torch.compiler.is_compiling():  # the fused C loops as opaque operators
        if _native_op.applies(x, spec):
            return _native_op.call(x, spec, amax)
        if amax is None and _native_op.applies_grouped(x, spec):
            return _native_op.call_grouped(x, spec, keys, offset)
    y = _eager_fast(x, spec, keys, offset, amax)
    if y is not None:
        return y
    if amax is None:
        s, s_t = _backend.run(_scales_kernel, x.numel(), x, spec=spec)
    else:
        if spec.scaling != "tensor":
            raise UsageError(f"an explicit amax needs scaling='tensor'; got scaling={spec.scaling!r}")
        s, s_t = group_scale(amax.to(torch.float32).reshape([1] * x.dim()), spec, None), None
    return _fake(x, s, s_t, keys, offset, spec)
