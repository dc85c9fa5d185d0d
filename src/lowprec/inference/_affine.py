"""Inference-convention fake quantization of weights: integer affine (symmetric or with a zero point) and float
formats with float32 scales.

Serving stacks (torchao's quantize primitives, compressed-tensors, vLLM) compute scales by *division*, unlike the
training convention of ``lowprec.quant`` with float32 scales (multiplier ``max/amax``, stored ``fl(1/m)``), so
the two differ in the last bit of many scales.  This module follows torchao 0.18's
``torchao.quantization.quant_primitives`` exactly (the tests compare bit for bit).  Per scale group ``G``
(``_groups``: tensor, output row, ``group_size`` along K, or a 2-D block) of a weight ``W [N, K]``:

Integers, ``q in [qmin, qmax]`` (int8: [-128, 127], int4: [-8, 7]); ``choose_qparams_affine``::

    lo = min(min G, 0)    hi = max(max G, 0)                  (the range always contains 0, so 0 is exact)
    symmetric:   scale = max(-lo, hi) / ((qmax - qmin) / 2)   zero_point = 0     (int8: amax / 127.5)
    asymmetric:  scale = (hi - lo) / (qmax - qmin)
                 zero_point = clamp(qmin - round(lo / scale), qmin, qmax)
    scale = max(scale, 2^-126)                                (float32's smallest normal: an all-zero group)

``quantize_affine`` / ``dequantize_affine``::

    q     = clamp(round(x * (1 / scale)) + zero_point, qmin, qmax)     x times the float32 reciprocal
    x_hat = (q - zero_point) * scale

``round`` is ``torch.round``: half to even.  Note ``qmin - round(lo / scale)``, not ``round(qmin - lo/scale)``:
with ties to even the two differ when ``qmin`` is odd.  compressed-tensors' ``calculate_qparams`` uses the same
scale and zero point formulas but divides (``x / scale``) in ``quantize``, and replaces a zero scale by float32
eps; it was not installed here to compare against.

Floats with float32 scales (fp8 tensor / channel / block), torchao's ``_choose_scale_float8`` and
``_quantize_affine_float8``::

    scale = amax(G) / max_elem        codes = Q_elem(clamp(x / scale, -max_elem, max_elem))     x_hat = codes * scale

with ``Q_elem`` round to nearest even (``lowprec.quant.quantize``).  An all-zero group gets the scale 2^-126 and
zero codes (torchao divides by zero there and gives NaN).
"""

from __future__ import annotations

import torch

from .. import formats
from .._errors import UsageError
from ._scheme import TensorScheme

_TINY = float.fromhex("0x1p-126")  # float32 smallest normal: torchao's default eps for float32 inputs


def int_range(fmt_name: str) -> tuple[int, int]:
    """``(qmin, qmax)`` of an integer format: int8 (-128, 127), int4 (-8, 7)."""
    fmt = formats.get(fmt_name)
    return int(fmt.min), int(fmt.max)


def _groups(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """A view of ``w [N, K]`` whose dims (1, 3) hold one scale group each: ``[N', a, K', b]``."""
    n, k = w.shape
    g = ts.granularity
    if g == "tensor":
        return w.reshape(1, n, 1, k)
    if g == "channel":
        return w.reshape(n, 1, 1, k)
    if g in ("group", "tensor_group"):
        size = int(ts.group_size or 0)
        return w.reshape(n, 1, k // size, size)
    if g == "block":
        a, b = ts.block or (0, 0)
        return w.reshape(n // a, a, k // b, b)
    raise UsageError(f"TensorScheme.granularity={g!r} does not apply to weights; use 'channel', 'group', "
                     "'block' or 'tensor'")


def _check_weight(w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise UsageError(f"a weight must be a 2-D floating-point tensor [out_features, in_features]; got "
                         f"{type(w).__name__} {getattr(w, 'shape', '')}")
    return w


def int_qparams(w: torch.Tensor, ts: TensorScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` float32, one per group, shaped ``[N', 1, K', 1]`` (module docstring)."""
    qmin, qmax = int_range(ts.format)
    g = _groups(_check_weight(w).float(), ts)
    lo = torch.clamp(g.amin(dim=(1, 3), keepdim=True), max=0.0)
    hi = torch.clamp(g.amax(dim=(1, 3), keepdim=True), min=0.0)
    if ts.symmetric:
        scale = torch.clamp(torch.maximum(-lo, hi) / (float(qmax - qmin) / 2), min=_TINY)
        return scale, torch.zeros_like(scale)
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=_TINY)
    zero_point = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale, zero_point


def _reference_fake_quantize_int(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """The plain tensor-operation form of ``fake_quantize_int``: the oracle its tests compare with bit for bit."""
    qmin, qmax = int_range(ts.format)
    scale, zp = int_qparams(w, ts)
    g = _groups(w.float(), ts)
    q = torch.clamp(torch.round(g * (1.0 / scale)) + zp, qmin, qmax)  # codes, integers held in float32
    return ((q - zp) * scale).reshape(w.shape).to(w.dtype)


def fake_quantize_int(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Integer affine quantize-dequantize of ``w [N, K]`` (float32 math); ``w``'s shape and dtype.

    The operations of ``_reference_fake_quantize_int`` in the same order, on one scratch tensor updated in place
    (one allocation instead of five).  Symmetric schemes add and subtract no zero point; the reference's ``+ 0``
    turns a rounded ``-0`` into ``+0``, so the scratch gets ``+ 0.0`` in place once (same bits, one cheap pass)."""
    qmin, qmax = int_range(ts.format)
    scale, zp = int_qparams(w, ts)
    q = _groups(w.float(), ts) * (1.0 / scale)  # the scratch: a new float32 tensor
    q.round_()
    if ts.symmetric:
        q.clamp_(qmin, qmax).mul_(scale).add_(0.0)  # (clamp(round(v) + 0) - 0) * s: -0 -> +0 (scale > 0)
    else:
        q.add_(zp).clamp_(qmin, qmax).sub_(zp).mul_(scale)
    return q.reshape(w.shape).to(w.dtype)


def _reference_fake_quantize_float(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """The plain tensor-operation form of ``fake_quantize_float``: the oracle its tests compare with bit for bit."""
    from ..quant import quantize

    fmt = formats.get(ts.format)
    g = _groups(_check_weight(w).float(), ts)
    scale = torch.clamp(g.abs().amax(dim=(1, 3), keepdim=True) / fmt.max, min=_TINY)
    codes = quantize(torch.clamp(g / scale, -fmt.max, fmt.max), fmt, saturate=True)
    return (codes * scale).reshape(w.shape).to(w.dtype)


def _round_in_place(v: torch.Tensor, fmt: formats.FormatSpec, vmax: float | None) -> torch.Tensor:
    """``lowprec.quant.quantize(v, fmt, saturate=True)`` for float32 ``v`` already clamped to ``+-fmt.max``,
    rounding ``v`` itself where it can (the fused C loop of ``lowprec.quant._native``); ``vmax``: a bound on
    ``|v|`` known to be finite, or None (then it is measured, and NaN sends it to the kernel)."""
    from ..quant import _elementwise, _native, quantize

    if v.dtype == torch.float32 and _elementwise.fast_round_ok(fmt, "nearest"):
        r = _elementwise.round_nearest_fast(v, fmt, saturate=True, vmax=vmax,
                                            sign=v if _native.usable(v) else None)
        if r is not None:
            return r
    return quantize(v, fmt, saturate=True)


def fake_quantize_float(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Float element format with float32 scales, divided (module docstring); ``w``'s shape and dtype.

    The operations of ``_reference_fake_quantize_float`` on one scratch tensor updated in place: the group's
    ``max |x|`` is ``max(-min, max)`` (two reductions, no ``|x|`` tensor; the same value, NaN included), and the
    element rounding is ``lowprec.quant``'s round-to-nearest route on the clamped scratch with its bound ``max``
    known (no second ``max |v|`` pass).  A non-finite input takes the reference operations."""
    fmt = formats.get(ts.format)
    g = _groups(_check_weight(w).float(), ts)
    amax = torch.maximum(-g.amin(dim=(1, 3), keepdim=True), g.amax(dim=(1, 3), keepdim=True))
    if not bool(torch.isfinite(amax).all()):
        return _reference_fake_quantize_float(w, ts)
    scale = torch.clamp(amax / fmt.max, min=_TINY)
    v = torch.div(g, scale).clamp_(-fmt.max, fmt.max)  # finite: |g| <= amax, scale >= amax / max
    codes = _round_in_place(v, fmt, float(fmt.max))
    return codes.mul_(scale).reshape(w.shape).to(w.dtype)


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """``_calibrate.fake_quantize_static`` (the oracle its tests compare with bit for bit) on one scratch tensor
    updated in place: integers ``clamp(round(x * fl(1 / scale)), qmin, qmax) * scale``, floats
    ``Q_elem(clamp(x / scale, -max, max)) * scale``."""
    xf = x.float()
    if ts.is_int:
        qmin, qmax = int_range(ts.format)
        q = (xf * (1.0 / scale)).round_().clamp_(qmin, qmax).mul_(scale)
        return q.to(x.dtype)
    fmt = formats.get(ts.format)
    v = torch.div(xf, scale).clamp_(-fmt.max, fmt.max)  # inf saturates; NaN stays (measured below)
    return _round_in_place(v, fmt, None).mul_(scale).to(x.dtype)
