"""NVFP4 activations with ``dynamic = "local"``: a calibrated tensor scale, group scales from each input.

compressed-tensors' NVFP4 preset (what llm-compressor writes and vLLM's W4A4 kernels serve) quantizes a linear
layer's input ``x [..., K]`` in groups of 16 along ``K`` with e2m1 elements, e4m3 group scales and one float32
*global scale* per layer, ``g = 448 * 6 / c``, calibrated once (``c``: the clipping value, ``max |x|`` over the
calibration data for ``"max"``; compressed-tensors' ``static_minmax`` observer and ``generate_gparam``) and
stored as ``input_global_scale``.  Each call then computes, per group ``j`` with ``a_j = max |x_j|``:

    s_j  = e4m3(clamp(g * (a_j / 6), -448, 448)), and 0.125 where that is 0     (the e4m3 group scale)
    e_j  = s_j / g                                                               (float32 effective scale)
    x^   = Q_e2m1(clamp(x / e_j, -6, 6)) * e_j                                   (round to nearest, ties even)

``a_j / 6`` is computed in ``x``'s dtype (bfloat16 inputs round it to bfloat16), everything after in float32,
and the result is cast back to ``x``'s dtype.  An input beyond the calibrated range saturates its group scale at
448 and clips at ``6 * 448 / g = c``.  These are compressed-tensors' ``compute_dynamic_scales_and_zp`` +
``fake_quantize`` operations, which ``tests/test_inference_local.py`` compares with bit for bit.  (Signed zeros
aside: compressed-tensors' e2m1 rounding maps ``-0.0`` to ``+0.0``; lowprec keeps the sign.)

``g`` itself is ``448 * 6 / max(c, 2^-126)`` as torch computes a Python number over a tensor (reciprocal, then
product), non-finite results replaced by 1: ``generate_gparam``'s arithmetic, so the calibrated ``g`` is the one
llm-compressor would store for the same ``c``.
"""

from __future__ import annotations

import torch

from .. import formats
from ._scheme import TensorScheme

E4M3_MAX = 448.0
E2M1_MAX = 6.0
ZERO_SCALE = 0.125
"""compressed-tensors' replacement for an e4m3 group scale of zero (``_get_dtype_eps``)."""


def global_scale_from_clip(clip: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]`` ``g = 448 * 6 / max(c, 2^-126)`` (module docstring); 1 where that is not finite."""
    c = torch.clamp(clip.detach().float().reshape(1), min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(E4M3_MAX * E2M1_MAX / c, nan=1.0, posinf=1.0, neginf=1.0)


def fake_quantize_local(x: torch.Tensor, global_scale: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Quantize-dequantize ``x [..., K]`` (``K`` a multiple of ``ts.group_size``) with the calibrated float32
    ``global_scale`` (module docstring); ``x``'s shape and dtype.

    One float32 scratch tensor: ``|x|`` (for the group maxima), then ``x / e`` written over it, clamped, rounded by
    ``lowprec.quant``'s round-to-nearest route with its bound 6 known, times ``e``."""
    from ._affine import _round_in_place

    k, gs = x.shape[-1], int(ts.group_size or 16)
    xg = x.unflatten(-1, (k // gs, gs))
    scratch = xg.abs() if x.dtype == torch.float32 else xg.float().abs_()
    amax = scratch.amax(dim=-1, keepdim=True).to(x.dtype)  # exact: a max of |x| in x's dtype
    g = global_scale.float().reshape(1)
    s = torch.clamp(g * (amax / E2M1_MAX), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    s.masked_fill_(s == 0, ZERO_SCALE)
    eff = s / g
    v = torch.div(xg, eff, out=scratch).clamp_(-E2M1_MAX, E2M1_MAX)
    finite = bool(torch.isfinite(amax).all())
    q = _round_in_place(v, formats.get(ts.format), E2M1_MAX if finite else None)
    return q.mul_(eff).flatten(-2).to(x.dtype)
