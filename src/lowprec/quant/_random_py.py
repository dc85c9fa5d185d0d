"""Counter-based random words in pure Python (no torch, no jax): seeds, keys and the reference hash.

The scheme is described in ``lowprec.quant._random``: the word for counter ``c`` is ``h(h(c + k1) ^ k2)`` with
``h`` Wellons' lowbias32 hash and ``(k1, k2) = seed_keys(seed)``.  The host-side parts (keys from a seed, seeds for
named streams) and the Python-int reference of the hash live here, so that the PyTorch (int32 tensors) and JAX
(uint32 arrays) versions share one definition of them.
"""

from __future__ import annotations

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_SALT = 0x632BE5AB


def _to_i32(v: int) -> int:
    """The signed int32 with the same low 32 bits as ``v``."""
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


def hash32_py(x: int) -> int:
    """lowbias32 on a Python int (the reference the tensor version is tested against)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    x ^= x >> 16
    return x


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys ``(k1, k2)`` derived from a seed in ``[0, 2^64)``."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    k1 = hash32_py(lo ^ hash32_py(hi ^ _SALT) ^ _GOLDEN)
    k2 = hash32_py(k1 ^ _SALT)
    return k1, k2


def random_bits_py(seed: int, counter: int) -> int:
    """The random word for one counter value, in plain Python (reference implementation)."""
    k1, k2 = seed_keys(seed)
    return hash32_py(hash32_py((counter + k1) & _MASK32) ^ k2)


def stream_seed(seed: int, *names: str) -> int:
    """A 64-bit seed for a named random stream (e.g. one GEMM operand of one module) derived from ``seed``.

    Uses SHA-256 of the names, so it does not depend on Python's per-process string hashing.
    """
    import hashlib

    digest = hashlib.sha256("\x00".join((str(seed), *names)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def derive_keys_py(k1: int, k2: int, step: int) -> tuple[int, int]:
    """Reference for ``derive_keys`` on Python ints."""
    lo, hi = step & _MASK32, (step >> 32) & _MASK32
    n1 = hash32_py(k1 ^ hash32_py(lo ^ _SALT) ^ hash32_py(hi))
    return n1, hash32_py(k2 ^ n1)
