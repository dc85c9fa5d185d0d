"""``quantize`` for JAX arrays: elementwise rounding onto a format's grid, PyTorch's ``lowprec.quantize`` bit for bit.

Same arguments and semantics as ``lowprec.quant.quantize`` (see its docstring): the result keeps the input's
shape and dtype; ``rounding`` is "nearest" (ties to even), "stochastic" or "toward_zero"; ``saturate`` clamps
out-of-range finite values to +-max.  Stochastic rounding draws the word for the row-major element ``i`` from
``(seed, offset + i)``, so the same seed and offset give the same bits as PyTorch.  One difference: JAX has no
global random state, so stochastic rounding needs an explicit ``seed``.

Everything is integer arithmetic on float32 bit patterns (``_round``), so the bits do not depend on whether the
backend flushes subnormals.  The function traces under ``jax.jit`` and ``jax.vmap`` (format, rounding, seed and
offset are Python values fixed at trace time; under ``vmap`` each mapped slice counts its elements from 0).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import formats
from .._errors import UsageError
from ..formats import FormatSpec
from ..quant._validate import Rounding, check_bool, check_offset, check_rounding, check_seed
from . import _random
from ._round import quantize_f32

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_array(x: object, name: str = "x") -> jax.Array:
    """Raise a clear ``ValueError`` unless ``x`` is a float32/bfloat16/float16 JAX (or NumPy) array."""
    if isinstance(x, np.ndarray):
        x = jnp.asarray(x)
    if not isinstance(x, jax.Array):
        raise UsageError(f"{name} must be a jax.Array; got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        hint = "; call .astype(jnp.float32) first" if x.dtype == jnp.float64 else ""
        raise UsageError(f"{name} must be a float32, bfloat16 or float16 array; got dtype {x.dtype}{hint}")
    return x


def stochastic_args(
    rounding: str, seed: int | None, offset: int, numel: int
) -> tuple[jax.Array | None, jax.Array | None]:
    """Validated (keys, offset) uint32 arrays for stochastic rounding, or (None, None)."""
    seed = check_seed(seed)
    offset = check_offset(offset, numel)
    if rounding != "stochastic":
        return None, None
    if seed is None:
        raise UsageError(
            "rounding='stochastic' in lowprec.jax needs seed=<int in [0, 2**64)>: JAX has no global random state "
            "to draw one from"
        )
    return _random.key_array(seed), jnp.asarray(offset, dtype=jnp.uint32)


@partial(jax.jit, static_argnames=("fmt", "rounding", "saturate"))
def _kernel(
    x: jax.Array, keys: jax.Array | None, off: jax.Array | None, *, fmt: FormatSpec, rounding: str, saturate: bool
) -> jax.Array:
    rbits = None
    if keys is not None:
        assert off is not None  # stochastic_args returns keys and offset together
        rbits = _random.random_bits(keys, off, x.shape)
    y = quantize_f32(x.astype(jnp.float32), fmt, rounding=rounding, saturate=saturate, rbits=rbits)
    return y.astype(x.dtype)


def quantize(
    x: jax.Array,
    fmt: str | FormatSpec,
    *,
    rounding: Rounding = "nearest",
    seed: int | None = None,
    offset: int = 0,
    saturate: bool = False,
) -> jax.Array:
    """Round every element of ``x`` onto the grid of ``fmt``; same shape and dtype as ``x``.

    Args:
        x: float32, bfloat16 or float16 array, any shape.
        fmt: a format name (``lowprec.formats.names()``) or a ``FormatSpec``.
        rounding: "nearest" (ties to even), "stochastic" (round up with probability distance / step), or
            "toward_zero".
        seed: stochastic rounding only (required there); the random bits are a function of
            ``(seed, offset + i)`` for the row-major element index ``i``, the same as in PyTorch.
        offset: added to the element index (quantizing a slice with ``offset=start`` equals quantizing the whole).
        saturate: clamp finite out-of-range values to +-max instead of the format's overflow value.
    """
    x = check_array(x)
    spec = formats.get(fmt)
    mode = check_rounding(rounding)
    saturate = check_bool(saturate, "saturate")
    keys, off = stochastic_args(mode, seed, offset, x.size)
    return _kernel(x, keys, off, fmt=spec, rounding=mode, saturate=saturate)
