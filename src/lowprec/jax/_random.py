"""Counter-based random bits for stochastic rounding in JAX: the same words as ``lowprec.quant._random``.

The word for element ``i`` is ``h(h(c + k1) ^ k2)`` with ``c = (offset + i) mod 2^32``, ``h`` Wellons' lowbias32
hash and ``(k1, k2) = seed_keys(seed)`` (see ``lowprec.quant._random``, whose pure-Python ``seed_keys`` is used
here).  JAX has native ``uint32`` with wrapping multiplication and logical shifts, so the hash is written directly;
PyTorch computes the same words in int32.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..quant._random_py import seed_keys as seed_keys

_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def hash32(x: jnp.ndarray) -> jnp.ndarray:
    """lowbias32 on a uint32 array."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_M2)
    x = x ^ (x >> 16)
    return x


def random_bits(keys: jnp.ndarray, offset: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Random uint32 words for the row-major elements of an array of ``shape``; ``keys``: uint32 ``[k1, k2]``,
    ``offset``: uint32 scalar (counters wrap mod 2^32)."""
    n = 1
    for s in shape:
        n *= s
    c = jnp.arange(n, dtype=jnp.uint32) + offset
    return hash32(hash32(c + keys[0]) ^ keys[1]).reshape(shape)


def key_array(seed: int) -> jnp.ndarray:
    """``seed_keys(seed)`` as a uint32 array ``[k1, k2]``."""
    return jnp.array(seed_keys(seed), dtype=jnp.uint32)


_SALT = 0x632BE5AB


def derive_keys(keys: jnp.ndarray, step: jnp.ndarray) -> jnp.ndarray:
    """Keys of step ``step`` of a stream, ``lowprec.quant._random.derive_keys`` in uint32 (traceable, so a jitted
    training step does not recompile per step): ``k1' = h(k1 ^ h(s_lo ^ SALT) ^ h(s_hi))``, ``k2' = h(k2 ^ k1')``.

    ``keys``: uint32 ``[k1, k2]``; ``step``: an integer scalar below 2^32 (so ``s_hi = 0``).
    """
    lo = jnp.asarray(step).astype(jnp.uint32)
    k1 = hash32(keys[0] ^ hash32(lo ^ jnp.uint32(_SALT)) ^ hash32(jnp.uint32(0)))
    k2 = hash32(keys[1] ^ k1)
    return jnp.stack([k1, k2])
