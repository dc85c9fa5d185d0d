"""Grouped views of a JAX array for scaling (whole tensor, axis, blocks, tiles): ``lowprec.quant._groups`` in jnp.

Same layout and padding rules (zero padding where a block or tile does not divide a dimension, cut off again by
``crop``); the shape-only helpers ``check_layout`` and ``reduce_dims`` are the PyTorch module's own.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..quant._layout import check_layout as check_layout
from ..quant._layout import reduce_dims as reduce_dims
from ..quant._spec import QuantSpec


def group(t: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """The grouped (padded) view of ``t``."""
    if spec.scaling in ("none", "tensor", "axis"):
        return t
    if spec.scaling == "block":
        bs = spec.block_size
        assert bs is not None
        tt = jnp.moveaxis(t, spec.axis, -1)
        k = tt.shape[-1]
        nb = max(1, math.ceil(k / bs))
        if nb * bs != k:
            tt = jnp.pad(tt, [(0, 0)] * (tt.ndim - 1) + [(0, nb * bs - k)])
        return tt.reshape(*tt.shape[:-1], nb, bs)
    assert spec.tile is not None
    a, b = spec.tile
    m, k = t.shape[-2:]
    mp, kp = max(1, math.ceil(m / a)) * a, max(1, math.ceil(k / b)) * b
    if (mp, kp) != (m, k):
        t = jnp.pad(t, [(0, 0)] * (t.ndim - 2) + [(0, mp - m), (0, kp - k)])
    return t.reshape(*t.shape[:-2], mp // a, a, kp // b, b)


def ungroup_padded(g: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """The grouped view back in the original dimension order, padding included."""
    if spec.scaling in ("none", "tensor", "axis"):
        return g
    if spec.scaling == "block":
        return jnp.moveaxis(g.reshape(*g.shape[:-2], -1), -1, spec.axis)
    return g.reshape(*g.shape[:-4], g.shape[-4] * g.shape[-3], g.shape[-2] * g.shape[-1])


def crop(t: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """``t`` cut down to ``shape`` (drops the padding of ``group``)."""
    if tuple(t.shape) == tuple(shape):
        return t
    return t[tuple(slice(0, n) for n in shape)]


def ungroup(g: jnp.ndarray, spec: QuantSpec, shape: tuple[int, ...]) -> jnp.ndarray:
    return crop(ungroup_padded(g, spec), shape)


def scales_out(s: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """Grouped scales in their public shape (see ``lowprec.quant._groups.scales_out``)."""
    if spec.scaling == "tensor":
        return s.reshape(())
    if spec.scaling == "block":
        return jnp.moveaxis(jnp.squeeze(s, -1), -1, spec.axis)
    if spec.scaling == "tile":
        return jnp.squeeze(jnp.squeeze(s, -1), -2)
    return s


def scales_in(s: jnp.ndarray, spec: QuantSpec) -> jnp.ndarray:
    """Inverse of ``scales_out``."""
    if spec.scaling == "block":
        return jnp.expand_dims(jnp.moveaxis(s, spec.axis, -1), -1)
    if spec.scaling == "tile":
        return jnp.expand_dims(jnp.expand_dims(s, -1), -3)
    return s
