"""Weight- and activation-aware calibration algorithms for ``quantize_model``: GPTQ, AWQ and SmoothQuant.

All three observe, in one pass of the *original* model over the calibration data, the inputs ``X [T, K]`` (``T``
tokens, all batches) of every quantized ``nn.Linear`` ``y = x W^T + b`` (``W [N, K]``), accumulated in float64
(``LayerStats``): the Gram matrix ``G = X^T X``, the per-input-channel sums ``sum_t |x_tj|`` and the
per-channel maxima ``max_t |x_tj|``.  Nothing else of the inputs is kept.  Every layer is calibrated on the
float model's inputs (llm-compressor's sequential pipeline instead feeds each layer the outputs of the already
quantized layers before it; not done here).  ``Q`` below is exactly the scheme's weight quantizer
(``fake_quantize_weight``: ``_affine``'s scale and zero-point rules).

GPTQ (Frantar et al. 2022) minimises, row by row, the layer's output error on the calibration inputs
``||X W^T - X W'^T||_F^2 = tr((W - W') H (W - W')^T) / 2`` with ``H = 2 G / T`` over weights ``W'`` on the
quantization grid, greedily: the columns ``q = 0 .. K-1`` are quantized in order, and after each the not yet
quantized columns absorb its error by the optimal (OBQ) update ``w_{>q} -= (w_q - Q(w_q)) / [H_F^-1]_qq *
[H_F^-1]_{q,>q}``, where ``H_F^-1`` is the inverse Hessian of the remaining columns (downdated after each column).
As in the reference, the rows of the downdated inverses are read off the upper Cholesky factor ``U`` of
``(H + damp * mean(diag H) I)^-1`` (``U[q, >q] / U[q, q] = [H_F^-1]_{q,>q} / [H_F^-1]_qq``); columns are
processed in blocks of ``block_size`` whose updates to later blocks are applied lazily, once per block (the same
result as the column-by-column loop up to float rounding).  A dead input (``H_jj = 0``) gets ``H_jj = 1`` and a
zero weight column.  Scales: ``"channel"`` and ``"tensor"`` granularity from the original weight; ``"group"`` and
``"block"`` (scales along K) from the current, already updated weights of the group when its first column comes
(the reference GPTQ, IST-DASLab ``gptq.py``; when a group reaches past the block, its columns' pending updates are
applied first, so the result does not depend on ``block_size``), or, with ``static_groups``, every group's from
the original weight (the reference's ``--static-groups``; llm-compressor's ``quantize_weight``, read at commit
0050550, computes all scales up front from the original weight this way).  ``act_order`` quantizes the columns
in order of decreasing ``H_jj`` (stable sort); with group scales it implies static groups (groups stay contiguous
runs of columns, no ``g_idx``).  Computed in float64 (llm-compressor: float32); each column is quantized from its
value rounded to float32, by ``_affine``'s float32 rule (compressed-tensors divides by the scale instead).

AWQ (Lin et al. 2023) protects salient input channels: with ``s_j = mean_t |x_tj|^a`` (clamped to ``1e-4``,
normalised ``s / sqrt(max(s) min(s))``), it quantizes ``W diag(s)`` and divides the scale back out:
``W' = Q(W diag(s)) diag(s)^-1``, the same as folding ``s^-1`` into the op before the layer (a norm or the
previous linear) and quantizing the scaled weight.  ``a`` is searched on ``0, 1/n_grid, .., (n_grid-1)/n_grid``
for the least mean squared output error ``mean((X W'^T - X W^T)^2)`` over the calibration inputs, computed exactly
as ``sum((W' - W) G * (W' - W)) / (T N)`` in float64; the first minimum wins.

SmoothQuant (Xiao et al. 2022) migrates activation outliers into the weights before W8A8 quantization: per input
channel ``s_j = max_t |x_tj|^alpha / max_n |W_nj|^(1 - alpha)`` (``max |W_:j|`` clamped to ``1e-5``, ``s`` to
``1e-5``, as the reference), then ``x' = x / s`` and ``W' = W diag(s)``, so that ``x' W'^T = x W^T`` while the
channel ranges of ``x'`` are evened out.  The activation quantizer then sees ``x'`` and the weight quantizer
``W'``.  It minimises nothing by search: ``alpha`` sets how much of the difficulty moves to the weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .. import formats
from .._errors import UsageError
from . import _affine
from ._scheme import TensorScheme

WEIGHT_ALGORITHMS: tuple[str, ...] = ("gptq", "awq", "smoothquant")
DEFAULTS: dict[str, dict[str, Any]] = {
    "gptq": {"damp": 0.01, "block_size": 128, "act_order": False, "static_groups": False},
    "awq": {"n_grid": 20, "fold": False},
    "smoothquant": {"alpha": 0.5, "fold": False},
}
"""Each algorithm's options and their defaults (``quantize_model(..., options=...)``)."""


def check_options(algorithm: str, options: Any) -> dict[str, Any]:
    """The full options of ``algorithm`` (defaults overridden by ``options``); UsageError for a bad field."""
    if algorithm not in DEFAULTS:
        if options:
            raise UsageError(f"quantize_model: options are for the algorithms {', '.join(WEIGHT_ALGORITHMS)}; "
                             f"algorithm={algorithm!r} takes none: remove options (percentile has its own argument)")
        return {}
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise UsageError(f"quantize_model: options must be a dict such as {DEFAULTS[algorithm]}; got "
                         f"{type(options).__name__}")
    out = dict(DEFAULTS[algorithm])
    for key, value in options.items():
        if key not in out:
            raise UsageError(f"quantize_model: unknown option {key!r} for algorithm={algorithm!r}; valid: "
                             f"{', '.join(out)}")
        out[key] = value
    where = f"quantize_model: options[{{!r}}] (algorithm={algorithm!r})"
    for key, value in out.items():
        if key in ("act_order", "static_groups", "fold"):
            if not isinstance(value, bool):
                raise UsageError(f"{where.format(key)} must be True or False; got {value!r}")
        elif key in ("block_size", "n_grid"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{where.format(key)} must be a positive int (default {DEFAULTS[algorithm][key]});"
                                 f" got {value!r}")
        else:
            lo_ok = key == "alpha"
            bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            if key == "damp" and (bad or value < 0):
                raise UsageError(f"{where.format(key)} (the dampening fraction of mean(diag(H))) must be a number "
                                 f">= 0, e.g. 0.01; got {value!r}")
            if lo_ok and (bad or not 0 <= value <= 1):
                raise UsageError(f"{where.format(key)} (the migration strength) must be in [0, 1], e.g. 0.5; got "
                                 f"{value!r}")
    return out


def check_weights(algorithm: str, name: str, ts: TensorScheme | None) -> None:
    """GPTQ needs a float32-scaled weight quantizer (integers, fp8); MX / NVFP4 are refused."""
    if algorithm == "gptq" and ts is not None and (ts.scale_format != "float32" or ts.granularity == "tensor_group"):
        raise UsageError(f"quantize_model: algorithm='gptq' on layer {name!r}: weights {ts.format} with "
                         f"{ts.scale_format} scales (MX / NVFP4) are not supported; use an int or fp8 scheme with "
                         "float32 scales, or algorithm='max' / 'awq'")


@dataclasses.dataclass
class LayerStats:
    """float64 running statistics of one layer's inputs ``x [..., K]`` (module docstring)."""

    gram: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    tokens: int = 0
    dtype: torch.dtype = torch.float32
    need_gram: bool = True

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])
        xd = x2.double()
        amax = x2.float().abs().amax(dim=0)
        if self.tokens == 0:
            self.abs_sum = xd.abs().sum(dim=0)
            self.amax = amax
            self.gram = xd.T @ xd if self.need_gram else None
        else:
            assert self.abs_sum is not None and self.amax is not None
            self.abs_sum += xd.abs().sum(dim=0)
            self.amax = torch.maximum(self.amax, amax)
            if self.gram is not None:
                self.gram += xd.T @ xd
        self.tokens += x2.shape[0]
        self.dtype = x.dtype


_STAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reduce_stats(stats: LayerStats, in_features: int, device: torch.device, sync: Any) -> None:
    """Combine ``stats`` over the ranks of ``sync`` (``_sync.Sync``), in place: sums (Gram, ``sum |x|``, tokens)
    by SUM, ``max |x|`` by MAX; a rank that saw no token contributes zeros (neutral: ``|x| >= 0``)."""
    k = in_features
    seen = stats.tokens > 0
    tokens = int(sync.all_reduce(torch.tensor([stats.tokens], dtype=torch.int64), "sum"))
    code = _STAT_DTYPES.index(stats.dtype) if seen and stats.dtype in _STAT_DTYPES else -1
    code = int(sync.all_reduce(torch.tensor([code], dtype=torch.int64), "max"))
    abs_sum = stats.abs_sum if seen else torch.zeros(k, dtype=torch.float64, device=device)
    amax = stats.amax if seen else torch.zeros(k, dtype=torch.float32, device=device)
    assert abs_sum is not None and amax is not None
    stats.abs_sum = sync.all_reduce(abs_sum, "sum")
    stats.amax = sync.all_reduce(amax, "max")
    if stats.need_gram:
        gram = stats.gram if seen else torch.zeros(k, k, dtype=torch.float64, device=device)
        assert gram is not None
        stats.gram = sync.all_reduce(gram, "sum")
    stats.tokens = tokens
    if code >= 0:
        stats.dtype = _STAT_DTYPES[code]
    if tokens == 0:
        stats.gram = stats.abs_sum = stats.amax = None


# ---------------------------------------------------------------------------------------------- GPTQ
def _row_qparams(w: torch.Tensor, ts: TensorScheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's qparams for the columns ``w [N, b]`` (float32), by ``_affine``'s rules, as per-row vectors
    ``scale [N]``, ``zero_point [N]``, and the compact ``[N', 1]`` scale (one per row block)."""
    n, b = w.shape
    g = ts.granularity
    if g in ("group", "tensor_group"):
        view = dataclasses.replace(ts, granularity="group", group_size=b)
    elif g == "block":
        view = dataclasses.replace(ts, block=((ts.block or (1, 1))[0], b))
    else:
        view = ts
    if ts.is_int:
        scale, zp = _affine.int_qparams(w, view)
    else:
        fmt = formats.get(ts.format)
        scale = torch.clamp(_affine._groups(w, view).abs().amax(dim=(1, 3), keepdim=True) / fmt.max,
                            min=_affine._TINY)
        zp = torch.zeros_like(scale)
    rows = scale.shape[0]
    s = scale.reshape(rows, 1).expand(rows, n // rows).reshape(n)
    z = zp.reshape(rows, 1).expand(rows, n // rows).reshape(n)
    return s, z, torch.stack([scale.reshape(rows), zp.reshape(rows)])


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """``w [N]`` (float32) quantized-dequantized with the per-row ``scale``/``zero_point``: ``_affine``'s float32
    rule (integers: ``(clamp(round(w * (1/s)) + z, qmin, qmax) - z) * s``; floats: ``Q_elem(clamp(w / s)) * s``)."""
    if ts.is_int:
        qmin, qmax = _affine.int_range(ts.format)
        q = torch.clamp(torch.round(w * (1.0 / scale)) + zero_point, qmin, qmax)
        return (q - zero_point) * scale
    from ..quant import quantize

    fmt = formats.get(ts.format)
    return quantize(torch.clamp(w / scale, -fmt.max, fmt.max), fmt, saturate=True) * scale


def _group_width(ts: TensorScheme, k: int) -> int:
    if ts.granularity in ("group", "tensor_group"):
        return int(ts.group_size or k)
    if ts.granularity == "block":
        return (ts.block or (1, k))[1]
    return 0


def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, ts: TensorScheme, *, damp: float = 0.01,
                block_size: int = 128, act_order: bool = False, static_groups: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of ``weight [N, K]`` against ``hessian [K, K]`` (module docstring): ``(W', scale, zero_point)`` with
    ``W'`` in ``weight``'s dtype and the float32 scales / zero points it used, shaped ``[N', groups]``
    (``"group"``: ``[N, K / group_size]``, ``"block"``: ``[N / a, K / b]``, ``"channel"``: ``[N, 1]``,
    ``"tensor"``: ``[1, 1]``).  ``W'`` is ``_affine``'s quantizer applied to ``W'`` itself with those scales."""
    n, k = weight.shape
    W = weight.detach().double().clone()
    H = hessian.detach().double().clone()
    if H.shape != (k, k):
        raise UsageError(f"gptq: the Hessian must be [{k}, {k}] for a weight {list(weight.shape)}; got {list(H.shape)}")
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    width = _group_width(ts, k)
    w32 = weight.detach().float()
    perm: torch.Tensor | None = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    idx = torch.arange(k)
    H[idx, idx] += damp * torch.mean(torch.diagonal(H))
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except RuntimeError as e:
        raise UsageError(f"gptq: the damped Hessian is not positive definite ({e}); raise options['damp']") from None
    # Fixed qparams: channel / tensor from the original weight; static groups: every group's from the original.
    fixed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    static_groups = static_groups or act_order
    if width == 0:
        fixed = [_row_qparams(w32, ts)]
    elif static_groups:
        fixed = [_row_qparams(w32[:, c:c + width].contiguous(), ts) for c in range(0, k, width)]
    compact: list[torch.Tensor] = [fixed[0][2]] if width == 0 else [f[2] for f in fixed]
    Q = torch.zeros_like(W)
    s = z = torch.empty(0)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if width == 0:
                s, z, _ = fixed[0]
            elif static_groups:
                s, z, _ = fixed[(c if perm is None else int(perm[c])) // width]
            elif c % width == 0:
                cur = W1[:, i:min(c + width, i2) - i1]
                if c + width > i2:  # the group reaches into later blocks: apply their pending updates first
                    cur = torch.cat([cur, W[:, i2:c + width] - E1[:, :i] @ U[i1:c, i2:c + width]], dim=1)
                s, z, cq = _row_qparams(cur.float(), ts)
                compact.append(cq)
            w = W1[:, i]
            q = quantize_column(w.float(), s, z, ts).double()
            Q[:, c] = q
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ U1[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    qp = torch.stack(compact, dim=-1)  # [2, N', groups]
    return Q.float().to(weight.dtype), qp[0].contiguous(), qp[1].contiguous()


def hessian(stats: LayerStats) -> torch.Tensor:
    """``H = 2 X^T X / T`` (float64) from the accumulated Gram matrix (``T`` tokens)."""
    assert stats.gram is not None
    return 2.0 * stats.gram / max(stats.tokens, 1)


# ---------------------------------------------------------------------------------------------- AWQ
def awq_grid(n_grid: int) -> list[float]:
    """The exponents AWQ searches: ``r / n_grid`` for ``r = 0 .. n_grid - 1``."""
    return [r / n_grid for r in range(n_grid)]


def awq_channel_scale(abs_mean: torch.Tensor, a: float) -> torch.Tensor:
    """float32 ``s = mean|x|^a`` clamped to 1e-4, normalised ``s / sqrt(max(s) min(s))`` (the reference)."""
    s = abs_mean.float().pow(a).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_weight(weight: torch.Tensor, s: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """float32 ``Q(W diag(s))`` (the scaled weight, on the quantization grid)."""
    from ._plan import fake_quantize_weight

    return fake_quantize_weight(weight.detach().float() * s, ts)


def awq_search(weight: torch.Tensor, stats: LayerStats, ts: TensorScheme, n_grid: int = 20
               ) -> tuple[torch.Tensor, float, list[float]]:
    """AWQ's ``(s, a, errors)``: the chosen per-input-channel float32 scale, its exponent and the mean squared
    output error of every grid point (module docstring): ``awq_search_group`` of the one layer."""
    return awq_search_group([weight], stats, [ts], n_grid)


def awq_search_group(weights: list[torch.Tensor], stats: LayerStats, schemes: list[TensorScheme], n_grid: int = 20
                     ) -> tuple[torch.Tensor, float, list[float]]:
    """``awq_search`` for layers reading the same input (one ``s`` for all, to fold into the norm before them):
    the error is the mean squared output error over all their outputs, ``sum_l ||X (W'_l - W_l)^T||^2 /
    (T sum_l N_l)``."""
    assert stats.gram is not None and stats.abs_sum is not None
    abs_mean = stats.abs_sum / max(stats.tokens, 1)
    n = sum(w.shape[0] for w in weights)
    errors: list[float] = []
    scales: list[torch.Tensor] = []
    for a in awq_grid(n_grid):
        s = awq_channel_scale(abs_mean, a)
        total = 0.0
        for w, ts in zip(weights, schemes, strict=True):
            d = (awq_weight(w, s, ts) / s).double() - w.detach().double()
            total += float(((d @ stats.gram) * d).sum())
        errors.append(total / (max(stats.tokens, 1) * n))
        scales.append(s)
    best = min(range(len(errors)), key=lambda i: (errors[i], i))
    return scales[best], awq_grid(n_grid)[best], errors


# ---------------------------------------------------------------------------------------------- SmoothQuant
def smoothquant_scale(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """float32 ``s = max|X_j|^alpha / max|W_:j|^(1-alpha)``, ``max|W_:j|`` and ``s`` clamped to 1e-5 (the
    reference's ``smooth_ln_fcs``)."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_amax.float().pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)
