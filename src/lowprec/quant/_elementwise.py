"""``quantize``: elementwise rounding of a tensor onto a format's grid (no scaling).

The result stays in the input's dtype; only its values change.  It equals, bit for bit, a cast to the format and
back (``x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(float32)``) for ``rounding="nearest"`` and
``saturate=False``, with one deliberate difference: NaN stays NaN for formats that have no NaN encoding (float6,
float4), where ml_dtypes returns -0 and would hide the NaN.

Overflow follows the format's own rule unless ``saturate=True``.  PyTorch's ``x.to(torch.float8_e4m3fn)`` differs:
it saturates out-of-range values (even inf) to +-448; ``quantize(x, "float8_e4m3fn", saturate=True)`` matches it
on finite values, while inf stays visible (as NaN, e4m3fn has no inf).
"""

from __future__ import annotations

import torch

from .. import formats
from ..formats import FormatSpec
from . import _backend, _random
from ._round import quantize_f32
from ._validate import Rounding, check_bool, check_offset, check_rounding, check_seed

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(x: object, name: str = "x") -> torch.Tensor:
    """Raise a clear ``ValueError`` unless ``x`` is a float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        hint = "; call .float() first" if x.dtype == torch.float64 else ""
        raise ValueError(
            f"{name} must be a float32, bfloat16 or float16 tensor; got dtype {x.dtype}{hint}"
        )
    return x


def stochastic_args(
    rounding: str, seed: int | None, offset: int, numel: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validated (keys, offset) tensors for stochastic rounding, or (None, None)."""
    seed = check_seed(seed)
    offset = check_offset(offset, numel)
    if rounding != "stochastic":
        return None, None
    if seed is None:
        seed = _random.draw_seed()
    return _random.key_tensor(seed, device), _random.offset_tensor(offset, device)


def _kernel(
    x: torch.Tensor,
    keys: torch.Tensor | None,
    off: torch.Tensor | None,
    *,
    fmt: FormatSpec,
    rounding: str,
    saturate: bool,
) -> torch.Tensor:
    xf = x.to(torch.float32)
    rbits = None
    if keys is not None and off is not None:
        rbits = _random.random_bits(keys, off, x.numel(), x.device).view(x.shape)
    return quantize_f32(xf, fmt, rounding=rounding, saturate=saturate, rbits=rbits).to(x.dtype)


def quantize(
    x: torch.Tensor,
    fmt: str | FormatSpec,
    *,
    rounding: Rounding = "nearest",
    seed: int | None = None,
    offset: int = 0,
    saturate: bool = False,
) -> torch.Tensor:
    """Round every element of ``x`` onto the grid of ``fmt``; same shape and dtype as ``x``.

    Args:
        x: float32, bfloat16 or float16 tensor, any shape.
        fmt: a format name (``lowprec.formats.names()``) or a ``FormatSpec``.
        rounding: "nearest" (ties to even), "stochastic" (round up with probability distance / step), or
            "toward_zero".
        seed: stochastic rounding only; the random bits are a function of ``(seed, offset + i)`` for the
            row-major element index ``i``.  ``None`` draws a seed from torch's default generator.
        offset: added to the element index (quantizing a slice with ``offset=start`` equals quantizing the whole).
        saturate: clamp finite out-of-range values to +-max instead of the format's overflow value.

    If ``fmt`` has more mantissa bits than ``x``'s dtype, the result is rounded back into ``x``'s dtype.
    """
    x = check_tensor(x)
    spec = formats.get(fmt)
    mode = check_rounding(rounding)
    saturate = check_bool(saturate, "saturate")
    keys, off = stochastic_args(mode, seed, offset, x.numel(), x.device)
    return _backend.run(_kernel, x.numel(), x, keys, off, fmt=spec, rounding=mode, saturate=saturate)
