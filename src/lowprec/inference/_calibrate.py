"""Static activation scales from calibration data: what each algorithm chooses, and the scale it gives.

A static (``dynamic=False``) per-tensor activation scheme fixes one *clipping value* ``c`` per layer input; the
scale follows the inference convention of ``_affine`` (``c / 448`` for e4m3, ``c / 127.5`` for symmetric int8,
``c / ((qmax - qmin) / 2)`` in general, never below ``2^-126``), and inputs beyond ``+-c`` saturate.  The
algorithms (``ALGORITHMS``) pick ``c`` from every element ``x`` each layer saw over the calibration batches:

* ``"max"``: ``c = max |x|``.  Nothing is clipped; the whole observed range is kept, at the price of coarse steps
  when a few outliers stretch it.  It minimises the largest clipping error (zero) and nothing else.
* ``"percentile"``: ``c`` = the ``p``-th percentile of ``|x|`` (``p = 99.99`` by default): the fraction
  ``1 - p/100`` of largest magnitudes is clipped to buy a finer step for the rest.  Computed reproducibly as
  ``torch.quantile``'s "linear" rule on the sorted float64 values of all ``|x|`` (position ``p/100 * (n - 1)``,
  linear interpolation between its neighbours), rounded to float32; ``p = 100`` gives ``"max"``.
* ``"mse"``: ``c`` minimises the mean squared error ``mean((Q_c(x) - x)^2)`` over all calibration elements,
  where ``Q_c`` is the layer's own fake quantizer with the scale from ``c``: the trade of rounding error
  (smaller with smaller ``c``) against clipping error (larger).  Searched on the grid
  ``c_i = fl32(amax * (0.5 + 0.5 * i / 99))``, ``i = 0 .. 99`` (100 candidates from half the range to the full
  range; ``c_99 = amax``); the error of each is the float64 sum of the squared float32 errors, and the first
  (smallest) ``c`` with the least error wins.

Observed inputs are kept (float32, flattened, on their device) for ``"percentile"`` and ``"mse"``, so the memory
is that of all calibration activations of the quantized layers; ``"max"`` keeps one number per layer.  Every step
is deterministic on CPU: the same data gives the same scales bit for bit.
"""

from __future__ import annotations

from typing import Literal

import torch

from .. import formats
from .._errors import UsageError
from ._affine import _TINY, int_range
from ._scheme import TensorScheme

Algorithm = Literal["max", "percentile", "mse"]
ALGORITHMS: tuple[str, ...] = ("max", "percentile", "mse")
MSE_GRID: tuple[float, ...] = tuple(0.5 + 0.5 * i / 99 for i in range(100))
"""The clipping ratios ``"mse"`` searches (of ``amax``): 100 values from 0.5 to 1.0."""


def check_algorithm(algorithm: object, percentile: object) -> None:
    if algorithm not in ALGORITHMS:
        raise UsageError(f"quantize_model: unknown calibration algorithm {algorithm!r}; valid: "
                         f"{', '.join(ALGORITHMS)}")
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not 0 < percentile <= 100:
        raise UsageError(f"quantize_model: percentile must be a number in (0, 100], e.g. 99.99; got {percentile!r}")


def max_representable(ts: TensorScheme) -> float:
    """The divisor of a clipping value: e4m3 448, symmetric int8 127.5 (``(qmax - qmin) / 2``)."""
    if ts.is_int:
        qmin, qmax = int_range(ts.format)
        return float(qmax - qmin) / 2
    return float(formats.get(ts.format).max)


def scale_from_clip(clip: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """float32 ``max(clip / max_representable(ts), 2^-126)`` (``_affine``'s division and eps); for NVFP4's
    ``dynamic="local"`` the global scale ``448 * 6 / clip`` (``_local``)."""
    if ts.dynamic == "local":
        from ._local import global_scale_from_clip

        return global_scale_from_clip(clip)
    return torch.clamp(clip.float() / max_representable(ts), min=_TINY)


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor, ts: TensorScheme) -> torch.Tensor:
    """Quantize-dequantize ``x`` with the fixed per-tensor ``scale`` (float32 math, ``x``'s dtype out): integers
    ``clamp(round(x * fl(1 / scale)), qmin, qmax) * scale`` (torchao's reciprocal), floats
    ``Q_elem(clamp(x / scale, -max, max)) * scale`` (division, round to nearest even); ``dynamic="local"``:
    ``_local.fake_quantize_local`` with ``scale`` the global scale."""
    if ts.dynamic == "local":
        from ._local import fake_quantize_local

        return fake_quantize_local(x, scale, ts)
    xf = x.float()
    if ts.is_int:
        qmin, qmax = int_range(ts.format)
        q = torch.clamp(torch.round(xf * (1.0 / scale)), qmin, qmax)
        return (q * scale).to(x.dtype)
    from ..quant import quantize

    fmt = formats.get(ts.format)
    codes = quantize(torch.clamp(xf / scale, -fmt.max, fmt.max), fmt, saturate=True)
    return (codes * scale).to(x.dtype)


def percentile_of_abs(values: torch.Tensor, percentile: float) -> torch.Tensor:
    """float32 ``percentile``-th percentile of ``|values|`` (torch.quantile's "linear" rule, in float64)."""
    v = torch.sort(values.detach().abs().double().reshape(-1)).values
    n = v.numel()
    pos = percentile / 100.0 * (n - 1)
    lo = min(int(pos), n - 1)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return (v[lo] + (v[hi] - v[lo]) * frac).float()


def mse_clip(values: torch.Tensor, ts: TensorScheme) -> tuple[torch.Tensor, list[float]]:
    """The ``"mse"`` clipping value for the observed ``values`` and the mean squared error of every grid
    candidate (module docstring)."""
    x = values.detach().float().reshape(-1)
    amax = float(x.abs().max())
    errors: list[float] = []
    clips: list[torch.Tensor] = []
    for r in MSE_GRID:
        clip = torch.tensor(amax * r, dtype=torch.float32, device=x.device)
        err = (fake_quantize_static(x, scale_from_clip(clip, ts), ts) - x).double().square().sum()
        clips.append(clip)
        errors.append(float(err) / x.numel())
    best = min(range(len(errors)), key=lambda i: (errors[i], i))
    return clips[best], errors


def clip_value(observed: list[torch.Tensor] | torch.Tensor, ts: TensorScheme, algorithm: str,
               percentile: float) -> torch.Tensor:
    """The float32 clipping value of one layer: ``observed`` is the running amax (``"max"``) or the list of
    flattened observed inputs (``"percentile"``, ``"mse"``)."""
    if algorithm == "max":
        assert isinstance(observed, torch.Tensor)
        return observed.float()
    assert isinstance(observed, list)
    values = torch.cat(observed)
    if algorithm == "percentile":
        return percentile_of_abs(values, percentile)
    return mse_clip(values, ts)[0]
