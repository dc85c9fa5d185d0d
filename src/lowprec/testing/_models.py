"""Tiny reference models for numerics tests (shipped so users can run the same checks)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn import functional as lpF
from ..recipes import Recipe


class TinyBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention (q, k, v, o linears; scores and values through
    ``lowprec.nn.functional.matmul`` when a recipe is set) and a GELU MLP."""

    def __init__(self, d_model: int = 64, n_heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.matmul_recipe: Recipe | None = None

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b if self.matmul_recipe is None else lpF.matmul(a, b, self.matmul_recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        # scores = q @ k^T   [B,H,T,Dh] @ [B,H,Dh,T] -> [B,H,T,T]
        scores = self._mm(q, k.transpose(-1, -2)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        # out = attn @ v   [B,H,T,T] @ [B,H,T,Dh] -> [B,H,T,Dh]
        out = self._mm(attn, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(out)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
