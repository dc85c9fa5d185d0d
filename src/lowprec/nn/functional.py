"""``matmul``: a recipe-emulated ``a @ b`` for matmuls that are not ``nn.Linear`` (attention scores, values).

For ``out = a @ b`` with ``a: [..., M, K]`` and ``b: [..., K, N]`` the recipe's linear GEMMs are used with ``b`` in
the weight's place:

    out  = Q(a) @ Q(b^T)^T            forward      a = a [M,K],             b = b^T [N,K]
    da   = Q(dO) @ Q(b)^T             grad_input   a = dO [M,N],            b = b [K,N]
    db^T = Q(dO^T) @ Q(a^T)^T         grad_weight  a = dO^T [N,M],          b = a^T [K,M]

It is stateless: delayed scaling falls back to current scaling, and stochastic operands use ``seed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import recipes
from ..quant import _random
from ..recipes import Gemm, LinearRecipe, Recipe, Scaling
from ._linear import Keys, gemm


def _current(g: Gemm) -> Gemm:
    cur = Scaling()
    return dataclasses.replace(g, a=dataclasses.replace(g.a, scaling=cur), b=dataclasses.replace(g.b, scaling=cur))


class _MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, lin: LinearRecipe, keys: Keys) -> torch.Tensor:  # type: ignore[override]
        af, bf = a.to(torch.float32), b.to(torch.float32)
        ctx.save_for_backward(af, bf)
        ctx.lin, ctx.keys, ctx.dtypes = lin, keys, (a.dtype, b.dtype)
        # out = a @ b   [..,M,K] @ [..,K,N] -> [..,M,N]
        out = gemm(af, bf.transpose(-1, -2), lin.forward, "forward", keys, {})
        return out.to(torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        af, bf = ctx.saved_tensors
        gf = g.to(torch.float32)
        # da = dO @ b^T   [..,M,N] @ [..,N,K] -> [..,M,K]
        da = gemm(gf, bf, ctx.lin.grad_input, "grad_input", ctx.keys, {})
        # db^T = dO^T @ a   [..,N,M] @ [..,M,K] -> [..,N,K]
        db_t = gemm(gf.transpose(-1, -2), af.transpose(-1, -2), ctx.lin.grad_weight, "grad_weight", ctx.keys, {})
        da = _unbroadcast(da, af.shape).to(ctx.dtypes[0])
        db = _unbroadcast(db_t.transpose(-1, -2), bf.shape).to(ctx.dtypes[1])
        return da, db, None, None


def _unbroadcast(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    while t.dim() > len(shape):
        t = t.sum(0)
    for i, n in enumerate(shape[:-2]):
        if n == 1 and t.shape[i] != 1:
            t = t.sum(i, keepdim=True)
    return t


def matmul(a: torch.Tensor, b: torch.Tensor, recipe: Recipe | LinearRecipe | str, *, seed: int = 0) -> torch.Tensor:
    """``a @ b`` with the recipe's GEMM numerics (forward and backward); dtype is the promotion of the inputs."""
    if isinstance(recipe, (Recipe, str)):
        recipe = recipes.get(recipe).linear
    if not isinstance(recipe, LinearRecipe):
        raise ValueError(f"recipe must be a Recipe, a recipe name or a LinearRecipe; got {type(recipe).__name__}")
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"matmul needs a and b with at least 2 dimensions; got shapes {tuple(a.shape)}, {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    lin = LinearRecipe(forward=_current(recipe.forward), grad_input=_current(recipe.grad_input),
                       grad_weight=_current(recipe.grad_weight))
    keys = {(g, o): _random.key_tensor(_random.stream_seed(seed, "matmul", g, o), a.device)
            for g in ("forward", "grad_input", "grad_weight") for o in "ab"}
    return _MatmulFn.apply(a, b, lin, keys)  # type: ignore[no-any-return]
