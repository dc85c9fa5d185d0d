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


def fake_quantize_int(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Integer affine quantize-dequantize of ``w [N, K]`` (float32 math); ``w``'s shape and dtype."""
    qmin, qmax = int_range(ts.format)
    scale, zp = int_qparams(w, ts)
    g = _groups(w.float(), ts)
    q = torch.clamp(torch.round(g * (1.0 / scale)) + zp, qmin, qmax)  # codes, integers held in float32
    return ((q - zp) * scale).reshape(w.shape).to(w.dtype)


def fake_quantize_float(w: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Float element format with float32 scales, divided (module docstring); ``w``'s shape and dtype."""
    from ..quant import quantize

    fmt = formats.get(ts.format)
    g = _groups(_check_weight(w).float(), ts)
    scale = torch.clamp(g.abs().amax(dim=(1, 3), keepdim=True) / fmt.max, min=_TINY)
    codes = quantize(torch.clamp(g / scale, -fmt.max, fmt.max), fmt, saturate=True)
    return (codes * scale).reshape(w.shape).to(w.dtype)
