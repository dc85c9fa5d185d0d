"""``matmul``: a recipe-emulated ``a @ b`` for matmuls that are not ``nn.Linear`` (attention scores, values).

For ``out = a @ b`` with ``a: [..., M, K]`` and ``b: [..., K, N]`` the recipe's linear GEMMs are used with ``b`` in
the weight's place:

    out  = Q(a) @ Q(b^T)^T            forward      a = a [M,K],             b = b^T [N,K]
    da   = Q(dO) @ Q(b)^T             grad_input   a = dO [M,N],            b = b [K,N]
    db^T = Q(dO^T) @ Q(a^T)^T         grad_weight  a = dO^T [N,M],          b = a^T [K,M]

It is stateless: delayed scaling falls back to current scaling, and stochastic operands use ``seed``.  As in
``EmulatedLinear``, a tensor is quantized once where its two GEMMs quantize it identically (tensorwise scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import recipes
from .._errors import UsageError
from ..quant import _random
from ..recipes import Gemm, LinearRecipe, Recipe, Scaling
from ._linear import Keys, product, quantize_operand, shares_quantization


def _current(g: Gemm) -> Gemm:
    cur = Scaling()
    return dataclasses.replace(g, a=dataclasses.replace(g.a, scaling=cur), b=dataclasses.replace(g.b, scaling=cur))


class _MatmulFn(torch.autograd.Function):
    """Quantizes a tensor once where ``shares_quantization`` allows (as ``EmulatedLinear`` does); the bits equal
    those of ``gemm`` run once per GEMM."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, lin: LinearRecipe, keys: Keys) -> torch.Tensor:  # type: ignore[override]
        af, bf = a.to(torch.float32), b.to(torch.float32)
        # out = a @ b   [..,M,K] @ [..,K,N] -> [..,M,N]
        qa = quantize_operand(af, lin.forward, "forward", "a", keys, {})
        qb_t = quantize_operand(bf.transpose(-1, -2), lin.forward, "forward", "b", keys, {})
        out = product(qa, qb_t, lin.forward)
        ctx.share_a = shares_quantization(lin.forward.a, lin.grad_weight.b)
        ctx.share_b = shares_quantization(lin.forward.b, lin.grad_input.b)
        ctx.save_for_backward(qa if ctx.share_a else af, qb_t.transpose(-1, -2) if ctx.share_b else bf)
        ctx.lin, ctx.keys, ctx.dtypes = lin, keys, (a.dtype, b.dtype)
        return out.to(torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        af, bf = ctx.saved_tensors  # Q(a) / Q(b) where shared with the forward GEMM
        gi, gw, keys = ctx.lin.grad_input, ctx.lin.grad_weight, ctx.keys
        gf = g.to(torch.float32)
        need_a, need_b = ctx.needs_input_grad[:2]
        share_g = shares_quantization(gi.a, gw.a)
        qg = quantize_operand(gf, gi, "grad_input", "a", keys, {}) if need_a or (need_b and share_g) else gf
        da = db = None
        if need_a:
            # da = dO @ b^T   [..,M,N] @ [..,N,K] -> [..,M,K]
            qb = bf if ctx.share_b else quantize_operand(bf, gi, "grad_input", "b", keys, {})
            da = _unbroadcast(product(qg, qb, gi), af.shape).to(ctx.dtypes[0])
        if need_b:
            # db^T = dO^T @ a   [..,N,M] @ [..,M,K] -> [..,N,K]
            if share_g:
                qg_t = qg.transpose(-1, -2)
            else:
                qg_t = quantize_operand(gf.transpose(-1, -2), gw, "grad_weight", "a", keys, {})
            a_t = af.transpose(-1, -2)
            qa_t = a_t if ctx.share_a else quantize_operand(a_t, gw, "grad_weight", "b", keys, {})
            db = _unbroadcast(product(qg_t, qa_t, gw).transpose(-1, -2), bf.shape).to(ctx.dtypes[1])
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
        raise UsageError(f"recipe must be a Recipe, a recipe name or a LinearRecipe; got {type(recipe).__name__}")
    if a.dim() < 2 or b.dim() < 2:
        raise UsageError(f"matmul needs a and b with at least 2 dimensions; got shapes {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise UsageError(f"matmul shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    lin = LinearRecipe(forward=_current(recipe.forward), grad_input=_current(recipe.grad_input),
                       grad_weight=_current(recipe.grad_weight))
    keys = {(g, o): _random.key_tensor(_random.stream_seed(seed, "matmul", g, o), a.device)
            for g in ("forward", "grad_input", "grad_weight") for o in "ab"}
    return _MatmulFn.apply(a, b, lin, keys)  # type: ignore[no-any-return]
