"""``matmul``: a recipe-emulated ``a @ b`` for matmuls that are not ``nn.Linear`` (attention scores, values).

For ``out = a @ b`` with ``a: [..., M, K]`` and ``b: [..., K, N]`` the recipe's linear GEMMs are used with ``b`` in
the weight's place:

    out  = Q(a) @ Q(b^T)^T            forward      a = a [M,K],             b = b^T [N,K]
    da   = Q(dO) @ Q(b)^T             grad_input   a = dO [M,N],            b = b [K,N]
    db^T = Q(dO^T) @ Q(a^T)^T         grad_weight  a = dO^T [N,M],          b = a^T [K,M]

It is stateless: delayed scaling falls back to current scaling, and stochastic operands use ``seed``.  As in
``EmulatedLinear``, a tensor is quantized once where its two GEMMs quantize it identically (tensorwise scaling).

Emulated attention (``lowprec.nn._attention``) runs its two GEMMs, ``Q K^T`` and ``P V``, through the same autograd
function, optionally with one scale per ``[M, K]`` matrix (per batch and head) for operands whose spec has one
scale per tensor (``per_matrix``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import recipes
from .._errors import UsageError
from ..quant import _random
from ..recipes import Gemm, LinearRecipe, Operand, Recipe, Scaling
from ._linear import Keys, product, quantize_operand, shares_quantization


def _current(g: Gemm) -> Gemm:
    cur = Scaling()
    return dataclasses.replace(g, a=dataclasses.replace(g.a, scaling=cur), b=dataclasses.replace(g.b, scaling=cur))


def _quantize_strided(t: torch.Tensor, g: Gemm, name: str, which: str, keys: Keys, per_matrix: bool
                      ) -> torch.Tensor:
    """``quantize_operand`` (reduction dim last); with ``per_matrix``, an operand whose spec has one scale per tensor
    gets one scale per ``[M, K]`` matrix instead (the amax of each leading index: each batch and head).

    Per-matrix scaling is the spec with ``scaling="axis"`` over the flattened matrix: the same scale rule applied
    to each matrix's amax, so each matrix gets the bits of quantizing it on its own with the tensorwise spec.
    Block, axis and tile specs already scale within a matrix and are used as they are.
    """
    op: Operand = getattr(g, which)
    if per_matrix and op.spec is not None and op.spec.scaling == "tensor" and t.dim() > 2:
        spec = dataclasses.replace(op.spec, scaling="axis", axis=-1)
        new_op = dataclasses.replace(op, spec=spec)
        g = dataclasses.replace(g, a=new_op) if which == "a" else dataclasses.replace(g, b=new_op)
        # A transposed view is quantized in its memory order and transposed back (elementwise with one scale per
        # matrix, so the same values), keeping the layout tensorwise quantization keeps: the GEMMs then see the
        # strides they see with per-tensor scaling.  Stochastic rounding keeps the logical order of its bits.
        flip = (spec.rounding != "stochastic" and not t.is_contiguous()
                and t.transpose(-1, -2).is_contiguous())
        src = t.transpose(-1, -2) if flip else t
        flat = src.reshape(-1, src.shape[-2] * src.shape[-1])
        q = quantize_operand(flat, g, name, which, keys, {}).reshape(src.shape)
        return q.transpose(-1, -2) if flip else q
    return quantize_operand(t, g, name, which, keys, {})


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The permutation ``p`` with ``t.permute(p)`` contiguous, where ``t`` is a non-contiguous permutation of a
    contiguous tensor (a transposed view, or transformers' ``[B, L, H, E] -> [B, H, L, E]`` heads); else None."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    strides = t.stride()
    perm = sorted(range(t.dim()), key=lambda d: -strides[d])
    return perm if t.permute(perm).is_contiguous() else None


def _quantize(t: torch.Tensor, g: Gemm, name: str, which: str, keys: Keys, per_matrix: bool) -> torch.Tensor:
    """``_quantize_strided``: the same values and strides, faster for a permuted operand with one scale per
    tensor (round to nearest): that is elementwise with the amax of all elements, so it is run on ``t`` permuted to
    its memory order (contiguous: the fused native kernel instead of the generic strided path, about 10x slower) and
    permuted back, which gives the layout the elementwise strided path gives (its outputs follow the input's memory
    order).  Q' (rotary output, [B, L, H, E] memory), V^T and dO are such operands.  Stochastic rounding keeps the
    logical order of its random bits, so it takes ``_quantize_strided`` as it is."""
    op = getattr(g, which)
    spec = op.spec
    if spec is not None and spec.scaling == "tensor" and spec.rounding == "nearest" and not (per_matrix
                                                                                              and t.dim() > 2):
        perm = _memory_order(t)
        if perm is not None:
            inverse = [0] * len(perm)
            for i, d in enumerate(perm):
                inverse[d] = i
            return quantize_operand(t.permute(perm), g, name, which, keys, {}).permute(inverse)
    return _quantize_strided(t, g, name, which, keys, per_matrix)


class _MatmulFn(torch.autograd.Function):
    """Quantizes a tensor once where ``shares_quantization`` allows (as ``EmulatedLinear`` does); the bits equal
    those of ``gemm`` run once per GEMM.  ``per_matrix``: see ``_quantize`` (per-matrix amax is transpose-invariant,
    so the sharing rules hold unchanged).  ``bmm_order``: compute ``db = a^T @ dO`` directly, as ``torch.bmm``'s
    backward does, instead of ``(dO^T @ a)^T``; each output element is the same sum in the same order, so an
    emulated accumulator gives the same bits either way, while a float32 BLAS GEMM can differ in the last bit
    (attention uses it to match PyTorch's math SDPA exactly)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, b: torch.Tensor, lin: LinearRecipe, keys: Keys, per_matrix: bool, bmm_order: bool
    ) -> torch.Tensor:
        af, bf = a.to(torch.float32), b.to(torch.float32)
        # out = a @ b   [..,M,K] @ [..,K,N] -> [..,M,N]
        qa = _quantize(af, lin.forward, "forward", "a", keys, per_matrix)
        qb_t = _quantize(bf.transpose(-1, -2), lin.forward, "forward", "b", keys, per_matrix)
        out = product(qa, qb_t, lin.forward)
        ctx.share_a = shares_quantization(lin.forward.a, lin.grad_weight.b)
        ctx.share_b = shares_quantization(lin.forward.b, lin.grad_input.b)
        ctx.save_for_backward(qa if ctx.share_a else af, qb_t.transpose(-1, -2) if ctx.share_b else bf)
        ctx.lin, ctx.keys, ctx.dtypes = lin, keys, (a.dtype, b.dtype)
        ctx.per_matrix, ctx.bmm_order = per_matrix, bmm_order
        return out.to(torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        af, bf = ctx.saved_tensors  # Q(a) / Q(b) where shared with the forward GEMM
        gi, gw, keys, pm = ctx.lin.grad_input, ctx.lin.grad_weight, ctx.keys, ctx.per_matrix
        gf = g.to(torch.float32)
        need_a, need_b = ctx.needs_input_grad[:2]
        share_g = shares_quantization(gi.a, gw.a)
        qg = _quantize(gf, gi, "grad_input", "a", keys, pm) if need_a or (need_b and share_g) else gf
        da = db = None
        if need_a:
            # da = dO @ b^T   [..,M,N] @ [..,N,K] -> [..,M,K]
            qb = bf if ctx.share_b else _quantize(bf, gi, "grad_input", "b", keys, pm)
            da = _unbroadcast(product(qg, qb, gi), af.shape).to(ctx.dtypes[0])
        if need_b:
            # db^T = dO^T @ a   [..,N,M] @ [..,M,K] -> [..,N,K]
            if share_g:
                qg_t = qg.transpose(-1, -2)
            else:
                qg_t = _quantize(gf.transpose(-1, -2), gw, "grad_weight", "a", keys, pm)
            a_t = af.transpose(-1, -2)
            qa_t = a_t if ctx.share_a else _quantize(a_t, gw, "grad_weight", "b", keys, pm)
            db_full = product(qa_t, qg_t, gw) if ctx.bmm_order else product(qg_t, qa_t, gw).transpose(-1, -2)
            db = _unbroadcast(db_full, bf.shape).to(ctx.dtypes[1])
        return da, db, None, None, None, None


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
    return _MatmulFn.apply(a, b, lin, keys, False, False)  # type: ignore[no-any-return]
