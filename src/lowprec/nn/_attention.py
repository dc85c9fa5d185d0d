"""Emulated scaled dot-product attention: ``O = softmax(Q K^T * scale + mask) V`` with recipe-quantized GEMMs.

Per (batch, head), with Q: [L, E], K: [S, E], V: [S, Ev] and ``s = scale`` (default ``1/sqrt(E)``), the order of
operations is PyTorch's math SDPA (``torch.ops.aten._scaled_dot_product_attention_math``), all in float32:

    Q' = Q * sqrt(s)                K' = K * sqrt(s)          (a negative s negates Q' instead)
    S  = Q' @ K'^T                  the *scores* GEMM         [L,E] @ [E,S] -> [L,S]
    S  = S + mask                   float mask added; boolean mask: False -> -inf; causal: keep j <= i
    P  = softmax(S, dim=-1)         float32; a row that is entirely -inf gives zeros (``_safe_softmax``), not NaN
    O  = P @ V                      the *values* GEMM         [L,S] @ [S,Ev] -> [L,Ev]

The two GEMMs, forward and both backward GEMMs each (dQ, dK from the scores GEMM; dP, dV from the values GEMM), are
those of ``lowprec.nn.functional.matmul`` with the ``Attention`` recipe's ``scores`` and ``values``
``LinearRecipe``s (the operand roles are tabulated in ``lowprec.recipes.Attention``).  Operands are quantized with
their reduction dimension last: Q' and K' along E, P and V^T along the key positions S, and in backward dS along S
(for dQ) or along L (for dK), dO along Ev (for dP) or along L (for dV).  The scale is applied before quantization
(Q' and K' are the quantized operands), as in the math kernel's order; the mask, the softmax and its backward are
elementwise or row reductions that attention kernels keep in float32, so they are float32 whatever the recipe.

Hence, bit for bit:

* with an unquantized float32 recipe (``Attention()``, or a recipe without ``attention`` such as "fp32") the
  output and the gradients equal ``torch.ops.aten._scaled_dot_product_attention_math`` (and so
  ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.MATH)``) on float32 inputs;
* with fp8 (or any format) the output equals the same float32 math run on fake-quantized operands:
  ``fake_quantize(P) @ fake_quantize(V)`` with ``P = softmax(fake_quantize(Q') @ fake_quantize(K')^T + mask)``.

GQA (``enable_gqa``) repeats each K/V head ``H_q / H_kv`` times (``repeat_interleave`` on dim -3, as PyTorch does),
so the dK/dV of a shared head is the sum of its query group's.  Dropout is not emulated: ``dropout_p`` must be 0.

Two ways to use it on a model: ``emulate_attention(model, recipe)`` (transformers models: through
``transformers.AttentionInterface`` under the name "lowprec"; other models: every ``F.scaled_dot_product_attention``
call inside ``model.forward``), and the context manager ``attention_mode(recipe)`` that routes every
``F.scaled_dot_product_attention`` call made inside it (a ``torch.overrides.TorchFunctionMode``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import recipes
from .._errors import UsageError
from ..quant import _random
from ..recipes import Attention, Recipe
from ..recipes._recipe import ATTENTION_GEMMS
from .functional import _MatmulFn

IMPLEMENTATION = "lowprec"
"""The name of the emulated attention in transformers' ``AttentionInterface``."""
RECIPE_ATTR = "lowprec_attention"
"""Attribute holding the ``Recipe`` on every module of a model that ``emulate_attention`` converted."""
_PREVIOUS_ATTR = "_lowprec_previous_attention"
_HOOKS_ATTR = "_lowprec_attention_hooks"


def _resolve(recipe: Recipe | Attention | str) -> tuple[Attention, int]:
    """(attention recipe, seed): a Recipe without ``attention`` gives unquantized float32 attention."""
    if isinstance(recipe, Attention):
        return recipe, 0
    if isinstance(recipe, (Recipe, str)):
        r = recipes.get(recipe)
        return (r.attention if r.attention is not None else Attention()), r.seed
    raise UsageError(f"recipe must be a Recipe, a recipe name or an Attention; got {type(recipe).__name__}")


def _keys(att: Attention, seed: int, device: torch.device) -> dict[str, dict[tuple[str, str], torch.Tensor]]:
    """Random keys of the stochastic operands per attention GEMM (stateless, as ``functional.matmul``)."""
    out: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
    for name in ATTENTION_GEMMS:
        lin = getattr(att, name)
        out[name] = {
            (g, o): _random.key_tensor(_random.stream_seed(seed, "attention", name, g, o), device)
            for (g, o), op in lin.operands().items() if op.spec is not None and op.spec.rounding == "stochastic"
        }
    return out


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2:
            raise UsageError(f"scaled_dot_product_attention: {name} must be a floating-point tensor [..., L, E]; "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if dropout_p != 0.0:
        raise UsageError(f"scaled_dot_product_attention: dropout_p={dropout_p} is not emulated; lowprec's attention "
                         "needs dropout_p=0.0 (turn attention dropout off, or call model.eval())")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise UsageError(f"scaled_dot_product_attention: shapes do not match: query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}")
    if enable_gqa and (query.dim() < 3 or key.shape[-3] == 0 or query.shape[-3] % key.shape[-3]
                       or key.shape[-3] != value.shape[-3]):
        raise UsageError(f"scaled_dot_product_attention: enable_gqa needs the query heads to be a multiple of the "
                         f"key/value heads; got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """``aten._safe_softmax(scores, -1)`` (the math kernel's softmax: a row that is entirely -inf gives zeros).

    It equals ``softmax`` on every other row, forward and backward (both save the output and differentiate with
    ``_softmax_backward_data``), so eagerly on the CPU, where the check costs one small reduction and no device
    sync, a tensor with no row maximum at -inf (a NaN maximum is not -inf: both give NaN there) takes the plain
    softmax and skips ``_safe_softmax``'s three full-size passes (``== -inf``, ``all``, ``where``), about 4x the
    softmax itself.
    """
    if scores.device.type == "cpu" and scores.numel() and not torch.compiler.is_compiling():
        if not bool(torch.isneginf(scores.amax(-1)).any()):
            return torch.softmax(scores, -1)
    return torch.ops.aten._safe_softmax(scores, -1)  # type: ignore[no-any-return]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    recipe: Recipe | Attention | str,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the recipe's attention numerics (module docstring).

    Shapes as PyTorch's: query [..., H_q, L, E], key [..., H_kv, S, E], value [..., H_kv, S, Ev]; ``attn_mask``
    broadcastable to [..., L, S] (boolean: True takes part in attention; float: added to the scores);
    ``is_causal`` keeps key j for query i when j <= i (top-left aligned, no ``attn_mask`` allowed with it);
    ``scale`` defaults to ``1/sqrt(E)``; ``enable_gqa`` repeats key/value heads for grouped-query attention.

    ``recipe``: a ``Recipe`` (its ``attention``, or float32 attention when that is None, and its ``seed`` for
    stochastic operands), a built-in recipe name, or an ``Attention``.  Everything runs in float32 and the output
    has ``query``'s dtype.  ``dropout_p`` must be 0 (dropout is not emulated).
    """
    att, seed = _resolve(recipe)
    _check(query, key, value, dropout_p, enable_gqa)
    out_dtype = query.dtype
    q, k, v = (t.to(torch.float32) for t in (query, key, value))
    # Scale q and k by sqrt(scale) each before the GEMM, as the math kernel does (its double-precision scalars).
    negative = scale is not None and scale < 0.0
    sqrt_scale = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    q = q * (0.0 - sqrt_scale if negative else sqrt_scale)
    mask: torch.Tensor | None = attn_mask
    if is_causal:
        if attn_mask is not None:
            raise UsageError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
        length, source = q.shape[-2], k.shape[-2]
        mask = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:  # True keeps the score, False sends it to -inf
        mask = torch.where(mask, 0.0, torch.tensor(-math.inf, dtype=torch.float32, device=mask.device))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    per_head = att.granularity == "head"
    keys = _keys(att, seed, q.device)
    # scores GEMM: S = Q' @ K'^T, reduction over E (forward), L (dK) and S (dQ)
    scores = _MatmulFn.apply(q, k.transpose(-2, -1) * sqrt_scale, att.scores, keys["scores"], per_head, True)
    if mask is not None:
        scores = scores + mask
    probs = _safe_softmax(scores)  # float32; fully masked rows give 0, not NaN
    # values GEMM: O = P @ V, reduction over S (forward), L (dV) and Ev (dP)
    out = _MatmulFn.apply(probs, v, att.values, keys["values"], per_head, True)
    return out.to(out_dtype)  # type: ignore[no-any-return]


class attention_mode(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Inside ``with attention_mode(recipe):`` every ``F.scaled_dot_product_attention`` call runs the emulated
    ``scaled_dot_product_attention`` with ``recipe``; every other function runs unchanged.

    For plain PyTorch models that call ``F.scaled_dot_product_attention``.  Only the forward call needs to be
    inside the block: the backward GEMMs are recorded then.  A ``torch.overrides.TorchFunctionMode``, which
    torch.compile traces when the mode is entered outside the compiled function.
    """

    def __init__(self, recipe: Recipe | Attention | str) -> None:
        super().__init__()
        _resolve(recipe)  # a bad recipe fails here, not at the first attention call
        self.recipe = recipe

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return scaled_dot_product_attention(*args, **kwargs, recipe=self.recipe)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ transformers
def lowprec_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function "lowprec": its ``sdpa_attention_forward`` (the same mask, GQA and causal
    handling; query/key/value [B, H, L, E] in, attention output [B, L, H, E] out) with its
    ``F.scaled_dot_product_attention`` call emulated with the ``Recipe`` in ``module.lowprec_attention``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recipe = getattr(module, RECIPE_ATTR, None)
    if recipe is None:
        raise UsageError(f"attention implementation {IMPLEMENTATION!r} needs the recipe in "
                         f"{type(module).__name__}.{RECIPE_ATTR}; install it with lowprec.nn.emulate_attention")
    with attention_mode(recipe):
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs)
    return out


def register_transformers() -> None:
    """Register "lowprec" in transformers' ``AttentionInterface`` (and its mask as sdpa's); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, lowprec_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def _is_transformers(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return hasattr(model, "set_attn_implementation") and hasattr(config, "_attn_implementation")


def _set_recipe(model: nn.Module, recipe: Recipe | None) -> None:
    for m in model.modules():
        if recipe is None:
            m.__dict__.pop(RECIPE_ATTR, None)
        else:
            m.__dict__[RECIPE_ATTR] = recipe


def emulate_attention(model: nn.Module, recipe: Recipe | str) -> bool:
    """Run ``model``'s attention with ``recipe.attention``; False (and nothing changed) when that is None.

    A transformers model (one with ``set_attn_implementation``) switches to the attention implementation
    "lowprec" (registered on first use), which is transformers' own sdpa path with the emulated
    ``scaled_dot_product_attention``; its previous implementation is remembered for ``restore_attention``.  The
    recipe is stored in ``module.lowprec_attention`` on every submodule, where the attention function finds it.
    Any other model gets forward hooks that run its forward inside ``attention_mode(recipe)``, so every
    ``F.scaled_dot_product_attention`` call it makes is emulated.  Calling it again replaces the recipe.
    """
    rec = recipes.get(recipe)
    if not isinstance(model, nn.Module):
        raise UsageError(f"emulate_attention needs an nn.Module; got {type(model).__name__}")
    if rec.attention is None:
        return False
    if _is_transformers(model):
        register_transformers()
        previous = model.__dict__.get(_PREVIOUS_ATTR, model.config._attn_implementation)  # type: ignore[union-attr]
        _set_recipe(model, rec)
        model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
        if model.config._attn_implementation != IMPLEMENTATION:  # type: ignore[union-attr]
            _set_recipe(model, None)
            raise UsageError(f"{type(model).__name__} cannot switch its attention implementation (it does not use "
                             "transformers' AttentionInterface); lowprec cannot emulate its attention")
        model.__dict__[_PREVIOUS_ATTR] = previous
        return True
    _remove_hooks(model)
    mode: list[attention_mode] = []

    def enter(module: nn.Module, args: Any) -> None:
        m = attention_mode(rec)
        m.__enter__()
        mode.append(m)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if mode:
            mode.pop().__exit__(None, None, None)

    handles = (model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True))
    model.__dict__[_HOOKS_ATTR] = handles
    _set_recipe(model, rec)
    return True


def _remove_hooks(model: nn.Module) -> bool:
    handles = model.__dict__.pop(_HOOKS_ATTR, None)
    for h in handles or ():
        h.remove()
    return handles is not None


def restore_attention(model: nn.Module) -> bool:
    """Undo ``emulate_attention``: the previous attention implementation (transformers) or no hooks; False when
    ``model`` was not emulating attention."""
    done = _remove_hooks(model)
    previous = model.__dict__.pop(_PREVIOUS_ATTR, None)
    if previous is not None:
        model.set_attn_implementation(previous)  # type: ignore[operator]
        done = True
    _set_recipe(model, None)
    return done


__all__ = ["attention_mode", "emulate_attention", "lowprec_attention_forward", "register_transformers",
           "restore_attention", "scaled_dot_product_attention"]
