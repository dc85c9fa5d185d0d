"""Bitwise comparison with a useful failure message, and SQNR."""

from __future__ import annotations

import torch

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(||x|| / ||x - y||)`` in dB (inf when ``y == x``)."""
    xd, yd = x.detach().double(), y.detach().double()
    noise = (xd - yd).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(xd.norm() / noise))


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor, *, context: str = "") -> None:
    """Raise ``AssertionError`` unless ``got`` and ``expected`` have identical bits (any NaN equals any NaN).

    The message gives the number of differing elements, the max and mean absolute difference, the SQNR and the
    first few differing positions.
    """
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"{context}: shape/dtype differ: got {tuple(got.shape)} {got.dtype}, expected "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    view = _INT_VIEW.get(got.dtype)
    if view is None:
        same = got == expected
    else:
        same = got.view(view) == expected.view(view)
    if got.is_floating_point():
        same |= torch.isnan(got) & torch.isnan(expected)
    if bool(same.all()):
        return
    bad = (~same).nonzero()[:5].tolist()
    g, e = got.double(), expected.double()
    finite = torch.isfinite(g) & torch.isfinite(e)
    diff = (g - e).abs()[finite]
    max_d = float(diff.max()) if diff.numel() else float("nan")
    mean_d = float(diff.mean()) if diff.numel() else float("nan")
    detail = ", ".join(
        f"{tuple(i)}: got {float(got[tuple(i)])!r} expected {float(expected[tuple(i)])!r}" for i in bad
    )
    raise AssertionError(
        f"{context}: {int((~same).sum())} of {same.numel()} elements differ; max |diff| {max_d:.6g}, "
        f"mean |diff| {mean_d:.6g}, SQNR {sqnr_db(e[finite], g[finite]) if finite.any() else float('nan'):.2f} dB; "
        f"first: {detail}"
    )
