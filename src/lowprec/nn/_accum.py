"""Emulating a GEMM accumulator of limited precision.

Tensor cores multiply low-precision operands exactly but may add the products into an accumulator narrower than
float32 (DeepSeek-V3 measured about 14 significant bits for fp8 on H800) and periodically promote the partial sum
to a float32 register.  The model here, for ``out[m, n] = sum_k a[m, k] * b[n, k]``:

    part = 0; total = 0
    for k in 0 .. K-1:
        part = Q_acc(fl32(part + a[m,k] * b[n,k]))       # each addition rounded into the accumulator format
        if (k + 1) % chunk == 0: total = fl32(total + part); part = 0     # promotion
    out = fl32(total + part)

Products of fp8/bf16/fp16 operands are exact in float32, so the only roundings are the ones written above.  The
loop runs over k with whole ``[M, N]`` planes at a time: one elementwise pass per reduction index, which is slow
for large K but exact.  A float32 accumulator (``format=None``) is a plain float32 matmul.
"""

from __future__ import annotations

import torch

from .. import formats
from ..quant import quantize
from ..recipes import Accumulator


def accumulate_matmul(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """``a @ b^T`` for ``a: [..., M, K]``, ``b: [..., N, K]`` (float32) with the accumulator model; ``[..., M, N]``."""
    if acc.format is None:
        return a @ b.transpose(-1, -2)
    fmt = formats.get(acc.format)
    k_len = a.shape[-1]
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-2])
    total = torch.zeros(shape, dtype=torch.float32, device=a.device)
    part = torch.zeros_like(total)
    chunk = acc.chunk or k_len
    for k in range(k_len):
        prod = a[..., :, k].unsqueeze(-1) * b[..., :, k].unsqueeze(-2)  # [.., M, 1] * [.., 1, N], exact for fp8/bf16
        part = quantize(part + prod, fmt, rounding=acc.rounding)
        if (k + 1) % chunk == 0:
            total = total + part
            part = torch.zeros_like(total)
    return total + part
