"""The JAX forms of the zoo models the JAX runner trains: ``mlp-digits`` (``MLP``) and ``gpt-bytes`` (``TinyGPT``).

A model here is a *plan* (frozen, hashable data read off the torch model: its layer names, which layers
``lowprec.convert`` emulates and with which ``LinearRecipe``, its sizes) plus pure functions of
``(plan, params, states, x, step)``.  The plan is the cache key of the runner's compiled step, so one XLA program
serves every seed and learning rate of a config.

**Parameters** are a flat tuple of float32 arrays in the order of ``model.parameters()`` (shared parameters once,
as PyTorch lists them): the weight-update stochastic streams are numbered by that index, so equal order gives
equal bits.  Each ``nn.Linear`` records the indices of its weight and bias, which is how a tied ``lm_head`` reads
the token embedding (its gradient is then the sum of both uses, as in PyTorch).

**States** are one dict per linear layer: ``lowprec.jax.init_state(recipe)`` (delayed-scaling amax histories) for
an emulated layer, ``{}`` for one ``convert`` left alone.

**GEMMs.** An emulated layer runs ``lowprec.jax.linear`` with its module's recipe, the recipe's seed and the
module's qualified name (``blocks.0.attn.qkv``), so stochastic operands draw PyTorch's streams; ``linear`` takes
``[..., K]`` inputs, flattening the leading dimensions to the GEMM's ``B`` (``[B,T,d] -> [B*T,d]``), which is the
row order PyTorch's ``EmulatedLinear`` quantizes in too.  A layer left alone is ``x @ W^T + b`` in float32
(``Precision.HIGHEST``: XLA on GPU/TPU would otherwise round the operands to bfloat16).

**The GPT's float32 pieces**, written to match PyTorch's definitions (not its bits: summation orders differ):

* LayerNorm: ``(x - mean) / sqrt(var + eps) * w + b``, biased variance over the last axis, the module's ``eps``
  (torch's default 1e-5);
* causal attention, as ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``:
  ``softmax(q k^T / sqrt(head_dim) + M) v`` with ``M = -inf`` above the diagonal;
* GELU in the exact erf form (``F.gelu``'s default), the MLP's hidden width ``4 d``;
* the loss: mean cross-entropy of the ``[B*T, 256]`` logits (``lm_loss``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from torch import nn

from .. import jax as lj
from .._errors import UsageError
from ..nn import EmulatedLinear, convert
from ..recipes import LinearRecipe, Recipe
from .zoo._digits import MLP
from .zoo._text import Block, TinyGPT

Params = tuple[jax.Array, ...]
States = tuple[dict[str, jax.Array], ...]
_HIGHEST = jax.lax.Precision.HIGHEST
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "ReLU": jax.nn.relu, "GELU": functools.partial(jax.nn.gelu, approximate=False)}


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """One ``nn.Linear`` of the torch model."""

    name: str
    """Qualified module name (``layers.0``, ``blocks.1.mlp.fc``, ``lm_head``): the random streams' name."""
    recipe: LinearRecipe | None
    """The module's ``LinearRecipe`` after ``convert`` (overrides included); None where it stays float32."""
    weight: int
    """Index of its weight ``[N, K]`` in the parameter tuple."""
    bias: int | None
    """Index of its bias ``[N]``, or None (``bias=False``)."""


@dataclasses.dataclass(frozen=True)
class _ModelPlan:
    params: tuple[str, ...]
    """Parameter names in ``model.parameters()`` order (no ``lm_head.weight`` when a GPT's head is tied)."""
    linears: tuple[LinearPlan, ...]
    seed: int
    """The recipe's seed (stochastic operand streams)."""


@dataclasses.dataclass(frozen=True)
class MLPPlan(_ModelPlan):
    """``mlp-digits``: ``linears`` in forward order with ``activation`` between them; ``[B,64] -> [B,10]``."""

    activation: str
    """"ReLU" or "GELU" (exact erf form, as ``torch.nn.GELU()``)."""


@dataclasses.dataclass(frozen=True)
class GPTPlan(_ModelPlan):
    """``gpt-bytes``: ``[B,T]`` int32 bytes -> ``[B,T,256]`` float32 logits (module docstring)."""

    layers: int
    heads: int
    context: int
    eps: float
    """LayerNorm epsilon (every LayerNorm of the model has it)."""


Plan = MLPPlan | GPTPlan


def _linears(model: nn.Module, recipe: Recipe) -> tuple[LinearPlan, ...]:
    """Every ``nn.Linear`` of ``model`` in module order, with the recipe ``convert`` gives it (read off a copy)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    converted = dict(convert(copy.deepcopy(model), recipe).named_modules())
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            c = converted[name]
            out.append(LinearPlan(name=name, recipe=c.recipe if isinstance(c, EmulatedLinear) else None,
                                  weight=index[id(m.weight)], bias=None if m.bias is None else index[id(m.bias)]))
    return tuple(out)


def model_plan(model: nn.Module, recipe: Recipe) -> Plan:
    """The plan of a zoo model under ``recipe``.  Raises ``ValueError`` for a model this module has no JAX form
    of (only the zoo's ``mlp-digits`` and ``gpt-bytes`` models, with any of their task options)."""
    names = tuple(n for n, _ in model.named_parameters())
    if type(model) is MLP:
        act = type(model.act).__name__
        if act not in _ACTIVATIONS or getattr(model.act, "approximate", "none") != "none":
            raise UsageError(f"framework = 'jax': activation {model.act!r} is not supported; use relu or gelu")
        return MLPPlan(params=names, linears=_linears(model, recipe), seed=recipe.seed, activation=act)
    if type(model) is TinyGPT:
        eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
        if len(eps) != 1:
            raise UsageError(f"framework = 'jax': the GPT's LayerNorms must share one eps; got {sorted(eps)}")
        heads = {b.attn.heads for b in model.blocks if isinstance(b, Block)}
        return GPTPlan(params=names, linears=_linears(model, recipe), seed=recipe.seed, layers=len(model.blocks),
                       heads=heads.pop(), context=model.context, eps=eps.pop())
    raise UsageError(f"framework = 'jax' supports the mlp-digits and gpt-bytes tasks; this task's model is "
                     f"{type(model).__name__}: set framework = \"torch\"")


def initial_params(model: nn.Module) -> Params:
    """The torch model's parameters as float32 JAX arrays, in ``model.parameters()`` order."""
    return tuple(jnp.asarray(p.detach().numpy()) for p in model.parameters())


def initial_states(plan: Plan) -> States:
    """Per linear layer: ``lowprec.jax.init_state`` of its recipe, ``{}`` where it stays float32."""
    return tuple(lj.init_state(lin.recipe) if lin.recipe is not None else {} for lin in plan.linears)


def _dense(plan: Plan, i: int, params: Params, states: States, h: jax.Array, step: jax.Array) -> jax.Array:
    """Linear layer ``i`` of the plan on ``h: [..., K]`` -> ``[..., N]`` float32."""
    lin = plan.linears[i]
    w = params[lin.weight]
    b = params[lin.bias] if lin.bias is not None else None
    if lin.recipe is None:
        # y = x @ W^T + b   [..., K] @ [K, N] -> [..., N], float32 (a layer kept in high precision)
        y = jnp.dot(h, w.T, precision=_HIGHEST)
        return y + b if b is not None else y
    return lj.linear(h, w, b, recipe=lin.recipe, state=states[i], step=step, seed=plan.seed, name=lin.name)


def _mlp_forward(plan: MLPPlan, params: Params, states: States, x: jax.Array, step: jax.Array) -> jax.Array:
    h = x
    act = _ACTIVATIONS[plan.activation]
    for i in range(len(plan.linears)):
        h = _dense(plan, i, params, states, h, step)
        if i < len(plan.linears) - 1:
            h = act(h)
    return h


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """``nn.LayerNorm`` over the last axis: biased variance, float32."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` in float32: q, k, v ``[B,H,T,D]`` -> same."""
    t, d = q.shape[-2], q.shape[-1]
    # scores = q @ k^T / sqrt(D)   [B,H,T,D] @ [B,H,D,T] -> [B,H,T,T]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=_HIGHEST) * (1.0 / math.sqrt(d))
    s = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), s, -jnp.inf)  # position i sees 0..i (never empty)
    # y = softmax(scores) @ v   [B,H,T,T] @ [B,H,T,D] -> [B,H,T,D]
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision=_HIGHEST)


def _gpt_forward(plan: GPTPlan, params: Params, states: States, idx: jax.Array, step: jax.Array) -> jax.Array:
    def p(name: str) -> jax.Array:
        return params[plan.params.index(name)]

    lin = {lp.name: i for i, lp in enumerate(plan.linears)}

    def dense(name: str, h: jax.Array) -> jax.Array:
        return _dense(plan, lin[name], params, states, h, step)

    b, t = idx.shape
    x = p("tok_embed.weight")[idx] + p("pos_embed.weight")[:t]  # [B,T,d]
    d = x.shape[-1]
    for layer in range(plan.layers):
        pre = f"blocks.{layer}."
        h = _layer_norm(x, p(pre + "ln1.weight"), p(pre + "ln1.bias"), plan.eps)
        qkv = dense(pre + "attn.qkv", h).reshape(b, t, 3, plan.heads, d // plan.heads)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # 3 x [B,H,T,d/H]
        y = causal_attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + dense(pre + "attn.proj", y)
        h = _layer_norm(x, p(pre + "ln2.weight"), p(pre + "ln2.bias"), plan.eps)
        x = x + dense(pre + "mlp.out", jax.nn.gelu(dense(pre + "mlp.fc", h), approximate=False))
    return dense("lm_head", _layer_norm(x, p("ln_f.weight"), p("ln_f.bias"), plan.eps))


def forward(plan: Plan, params: Params, states: States, x: jax.Array, step: jax.Array) -> jax.Array:
    """The model's float32 output (``mlp-digits``: ``[B,64]`` float32 -> logits ``[B,10]``; ``gpt-bytes``:
    ``[B,T]`` int32 -> logits ``[B,T,256]``).  ``step``: the layers' ``lp_step`` (1 for the first training step);
    ``states`` are read here, and their gradient is the advanced state (``lowprec.jax.linear``)."""
    if isinstance(plan, GPTPlan):
        if x.ndim != 2 or x.shape[1] > plan.context:
            raise UsageError(f"gpt-bytes input must be [B, T] with T <= context ({plan.context}); got {x.shape}")
        return _gpt_forward(plan, params, states, x, step)
    return _mlp_forward(plan, params, states, x, step)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Both tasks' training loss: mean cross-entropy over every prediction (``[..., C]`` float32 logits, ``[...]``
    int32 targets) -> 0-d float32, as ``F.cross_entropy`` (``mlp-digits``) and ``lm_loss`` (``gpt-bytes``)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return optax.softmax_cross_entropy_with_integer_labels(flat, targets.reshape(-1)).mean()
