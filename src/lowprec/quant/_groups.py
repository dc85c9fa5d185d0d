"""Views of a tensor as scaling groups (whole tensor, slices along an axis, blocks, tiles) and back.

A grouped view ``g`` has the property that ``g.abs().amax(dims, keepdim=True)`` is the per-group amax and
broadcasts against ``g``.  Dimensions that a block or tile does not divide are zero-padded (zeros never change
an amax) and the padding is cut off again by ``ungroup``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._layout import check_layout as check_layout
from ._layout import reduce_dims as reduce_dims
from ._spec import QuantSpec


def group(t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The grouped (padded) view of ``t``."""
    if spec.scaling in ("none", "tensor", "axis"):
        return t
    if spec.scaling == "block":
        assert spec.block_size is not None
        bs = spec.block_size
        tt = t.movedim(spec.axis, -1)
        k = tt.shape[-1]
        nb = max(1, math.ceil(k / bs))
        if nb * bs != k:
            tt = F.pad(tt, (0, nb * bs - k))
        return tt.unflatten(-1, (nb, bs))
    assert spec.tile is not None
    a, b = spec.tile
    m, k = t.shape[-2:]
    mp, kp = max(1, math.ceil(m / a)) * a, max(1, math.ceil(k / b)) * b
    if (mp, kp) != (m, k):
        t = F.pad(t, (0, kp - k, 0, mp - m))
    return t.unflatten(-1, (kp // b, b)).unflatten(-3, (mp // a, a))


def ungroup(g: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``group`` for a tensor whose original shape was ``shape``."""
    return crop(ungroup_padded(g, spec), shape)


def ungroup_padded(g: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The grouped view back in the original dimension order, padding included (``ungroup`` without the crop)."""
    if spec.scaling in ("none", "tensor", "axis"):
        return g
    if spec.scaling == "block":
        return g.flatten(-2).movedim(-1, spec.axis)
    return g.flatten(-2).flatten(-3, -2)


def crop(t: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``t`` cut down to ``shape`` (the leading part of every dimension): drops the padding of ``group``."""
    if tuple(t.shape) == tuple(shape):
        return t
    return t[tuple(slice(0, n) for n in shape)]


def scales_out(s: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-group scales (broadcastable against the grouped view) in their public shape.

    tensor: ``[]``; axis: the input shape with ``axis`` of size 1; block: the input shape with ``axis`` replaced by
    the number of blocks; tile: ``[..., ceil(M/a), ceil(K/b)]``.
    """
    if spec.scaling == "tensor":
        return s.reshape(())
    if spec.scaling == "block":
        return s.squeeze(-1).movedim(-1, spec.axis)
    if spec.scaling == "tile":
        return s.squeeze(-1).squeeze(-2)
    return s


def scales_in(s: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Inverse of ``scales_out``."""
    if spec.scaling == "block":
        return s.movedim(spec.axis, -1).unsqueeze(-1)
    if spec.scaling == "tile":
        return s.unsqueeze(-1).unsqueeze(-3)
    return s
