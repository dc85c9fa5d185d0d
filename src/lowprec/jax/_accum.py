"""A GEMM through a limited-precision accumulator, in JAX: ``lowprec.nn._accum`` with the same roundings.

For ``out[m, n] = sum_k a[m, k] * b[n, k]`` the accumulator model (see ``lowprec.recipes.Accumulator``) is

    part = 0; total = 0
    for k in 0 .. K-1:
        part = Q_acc(fl32(part + a[m,k] * b[n,k]))       # each addition rounded into the accumulator format
        if (k + 1) % chunk == 0: total = fl32(total + part); part = 0     # promotion to float32
    out = fl32(total + part)

The loop is a ``lax.scan`` over k with whole ``[M, N]`` planes, the same elementwise operations in the same order as
PyTorch's loop (products rounded to float32 before they are added: see ``accumulate_matmul``), so the bits agree
as long as no product or partial sum is a float32 subnormal (below 2^-126: XLA on CPU flushes those to zero,
PyTorch keeps them).  ``Q_acc`` is the integer-bit quantizer of
``_round``.

A float32 accumulator (``format=None``) is one ``lax.dot_general`` at HIGHEST precision (no TF32 on GPUs).  Its
summation order is XLA's, not PyTorch's BLAS's: the bits agree with PyTorch whenever every partial sum is exact in
float32 (narrow operands, moderate K; see docs/jax.md), otherwise within the usual float32 GEMM error bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import formats
from .._errors import UsageError
from ..recipes import Accumulator
from ._round import quantize_f32


def matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b^T`` in float32 at HIGHEST precision: ``a: [M, K]``, ``b: [N, K]`` -> ``[M, N]``."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _block(k_len: int, plane: int) -> int:
    """The largest divisor of ``k_len`` whose ``[kb, M, N]`` block of products stays under 2^24 floats."""
    limit = max(1, (1 << 24) // max(plane, 1))
    return max(d for d in range(1, min(k_len, limit) + 1) if k_len % d == 0)


def accumulate_matmul(a: jax.Array, b: jax.Array, acc: Accumulator) -> jax.Array:
    """``a @ b^T`` for float32 ``a: [M, K]``, ``b: [N, K]`` through the accumulator ``acc``; float32 ``[M, N]``.

    The products of a block of k are formed before the loop that adds them: XLA on CPU contracts ``part + a * b``
    inside one loop body into a fused multiply-add (one rounding instead of two), which PyTorch's separate
    multiply and add do not do; products formed outside the adding loop are rounded to float32 first.
    """
    if acc.block is not None:
        raise UsageError("Accumulator.block (the blocked fused multiply-add model) runs in PyTorch only "
                         "(lowprec.nn); the JAX binding emulates the sequential model: leave block and bits out")
    if acc.format is None:
        return matmul_nt(a, b)
    fmt = formats.get(acc.format)
    (m, k_len), n = a.shape, b.shape[0]
    chunk = acc.chunk or k_len
    kb = _block(k_len, m * n)
    zero = jnp.zeros((m, n), jnp.float32)

    def add(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array]):
        part, total = carry
        prod, k = xs
        part = quantize_f32(part + prod, fmt, rounding=acc.rounding, saturate=False, rbits=None)
        promote = (k + 1) % chunk == 0
        total = jnp.where(promote, total + part, total)
        return (jnp.where(promote, zero, part), total), None

    def block(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array, jax.Array]):
        ab, bb, ks = xs  # [kb, M], [kb, N], [kb]
        prods = ab[:, :, None] * bb[:, None, :]  # [kb, M, N], each exact for fp8/bf16/fp16 operands
        return lax.scan(add, carry, (prods, ks))[0], None

    nblk = k_len // kb
    xs = (a.T.reshape(nblk, kb, m), b.T.reshape(nblk, kb, n), jnp.arange(k_len, dtype=jnp.int32).reshape(nblk, kb))
    (part, total), _ = lax.scan(block, (zero, zero), xs)
    return total + part
