"""Counter-based random bits for stochastic rounding, in 32-bit integer arithmetic.

Stochastic rounding needs one uniform 32-bit word per element.  Drawing them from a stateful generator would
tie the result to the order in which elements are visited (threads, devices, how a tensor is split).  Instead the
word for element ``i`` is a pure function of ``(seed, offset + i)``:

    k1, k2 = key(seed)                       # host side, from the 64-bit seed
    bits(c) = h(h(c + k1) ^ k2)              # c = (offset + i) mod 2^32

where ``h`` is Wellons' ``lowbias32`` integer hash (xor-shift / multiply, a bijection on 32-bit words with low
bias).  Only wrapping 32-bit add, xor, multiply and logical right shift are used, so JAX (uint32) and PyTorch
(int32, whose arithmetic wraps; logical shifts are arithmetic shifts followed by a mask) compute identical words.
Quantizing two halves of a tensor with offsets ``0`` and ``n/2`` therefore gives the same bits as the whole.
"""

from __future__ import annotations

import torch

from ._random_py import _M1 as _M1
from ._random_py import _M2 as _M2
from ._random_py import _MASK32 as _MASK32
from ._random_py import _SALT as _SALT
from ._random_py import _to_i32 as _to_i32
from ._random_py import derive_keys_py as derive_keys_py
from ._random_py import hash32_py as hash32_py
from ._random_py import random_bits_py as random_bits_py
from ._random_py import seed_keys as seed_keys
from ._random_py import stream_seed as stream_seed


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor (wrapping arithmetic; ``& mask`` turns >> into a logical shift)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _to_i32(_M1)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _to_i32(_M2)
    x = x ^ ((x >> 16) & 0xFFFF)
    return x


def random_bits(keys: torch.Tensor, offset: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """Random int32 words for counters ``offset .. offset + numel - 1`` (flat, row-major element order).

    ``keys`` is an int32 tensor ``[k1, k2]``, ``offset`` an int32 scalar tensor (both as signed int32 with the
    right low 32 bits), so that compiled code does not specialise on their values.
    """
    c = torch.arange(numel, dtype=torch.int32, device=device) + offset
    return _hash32(_hash32(c + keys[0]) ^ keys[1])


def key_tensor(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``seed_keys(seed)`` as an int32 tensor."""
    k1, k2 = seed_keys(seed)
    return torch.tensor([_to_i32(k1), _to_i32(k2)], dtype=torch.int32, device=device)


def offset_tensor(offset: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An offset in ``[0, 2^32)`` as a wrapped int32 scalar tensor."""
    return torch.tensor(_to_i32(offset), dtype=torch.int32, device=device)


def draw_seed() -> int:
    """A seed drawn from torch's default generator (so ``torch.manual_seed`` makes it reproducible)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def derive_keys(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Keys for step ``step`` of a stream (int32 tensor ops, so compiled code does not specialise on the step).

    ``k1' = h(k1 ^ h(s_lo ^ SALT) ^ h(s_hi))``, ``k2' = h(k2 ^ k1')`` with ``s`` the 64-bit step; the same words as
    ``derive_keys_py``.  Eagerly, for plain CPU tensors, the words are computed on Python ints (one read of each
    tensor instead of some forty small tensor operations, per linear layer and step); the same words.
    """
    if (not torch.compiler.is_compiling() and type(keys) is torch.Tensor and type(step) is torch.Tensor
            and keys.device.type == "cpu" and step.device.type == "cpu"):
        k1, k2 = keys.tolist()
        n1, n2 = derive_keys_py(k1 & _MASK32, k2 & _MASK32, int(step))
        return torch.tensor([_to_i32(n1), _to_i32(n2)], dtype=torch.int32)
    return _derive_keys_tensor(keys, step)


def _derive_keys_tensor(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``derive_keys`` as int32 tensor operations (compiled regions, other devices)."""
    s = step.to(torch.int64)
    lo = (s & _MASK32).to(torch.int64)
    lo = torch.where(lo >= 1 << 31, lo - (1 << 32), lo).to(torch.int32)
    hi = ((s >> 32) & _MASK32).to(torch.int32)
    k1 = _hash32(keys[0] ^ _hash32(lo ^ _to_i32(_SALT)) ^ _hash32(hi))
    k2 = _hash32(keys[1] ^ k1)
    return torch.stack([k1, k2])
