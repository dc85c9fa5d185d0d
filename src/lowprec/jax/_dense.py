"""Recipe-emulated linear layers for JAX: ``linear`` and ``dot_general`` with a ``custom_vjp`` whose three GEMMs
follow a ``lowprec.LinearRecipe``, as ``lowprec.nn.EmulatedLinear`` does in PyTorch.

For ``y = x @ W^T + b`` (x: [B, K], W: [N, K] in PyTorch's layout):

    y     = Q(x) @ Q(W)^T           forward      a = input [B,K],          b = weight [N,K]
    dx    = Q(dY) @ Q(W^T)^T        grad_input   a = grad_output [B,N],    b = weight^T [K,N]
    dW    = Q(dY^T) @ Q(x^T)^T      grad_weight  a = grad_output^T [N,B],  b = input^T [K,B]

Each ``Q`` is the recipe's ``Operand`` for that GEMM, applied with the reduction dimension last; each product goes
through the GEMM's ``Accumulator`` and optional output rounding, and the bias is added in float32 afterwards.
Where two GEMMs quantize a tensor identically (``shares_quantization``) it is quantized once, as in PyTorch; the
bits equal those of ``gemm`` run once per GEMM.

Delayed scaling is functional.  The amax histories are an explicit ``state`` (``init_state``): one float32 vector
per tensor role ("input", "weight", "grad_output"), newest first.  A role's scale uses the max (or most recent
entry) of its history, or the current amax while the history is still all zero; then the current amax is pushed
in front.  The grad_output amax is only known in the backward pass, so the updated state comes back the way
Flax's fp8 layers return theirs: **the gradient with respect to ``state`` is the new state** (take
``jax.grad`` with respect to it and use the result in place of the old state; never feed it to an optimizer).
Call a layer once per state per step; a state used twice gets the sum of two new histories.

Stochastic operands draw their random bits exactly as PyTorch's ``EmulatedLinear`` does: from the keys of
``stream_seed(seed, name, gemm, operand)`` derived for the training ``step`` (``convert`` uses the recipe's seed
and the module's qualified name; the module's first training step is step 1), offset 0, row-major over the
operand with its reduction dimension last.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp

from .. import formats
from .._errors import UsageError
from ..quant._random_py import stream_seed
from ..recipes import Gemm, LinearRecipe, Operand
from ..recipes._recipe import GEMMS as GEMMS  # re-exported: tests/test_jax_train.py reads _dense.GEMMS
from ..recipes._recipe import OPERAND_ROLE, shares_quantization
from . import _random
from ._accum import accumulate_matmul
from ._bits import INF, bits, f32
from ._round import quantize_f32
from ._scaled import _amax, fake_quantize_traced

State = dict[str, jax.Array]
Keys = dict[str, jax.Array]

ROLE = OPERAND_ROLE  # (gemm, operand) -> tensor role, shared with lowprec.nn._linear


def delayed_roles(lin: LinearRecipe) -> dict[str, tuple[int, str]]:
    """Per delayed-scaled tensor role: (history length, amax algorithm), as ``EmulatedLinear`` sets them up."""
    out: dict[str, tuple[int, str]] = {}
    for (g, o), op in lin.operands().items():
        if op.scaling.kind != "delayed":
            continue
        role = ROLE[(g, o)]
        n, alg = out.get(role, (0, op.scaling.algorithm))
        if alg != op.scaling.algorithm:
            raise UsageError(
                f"delayed scaling of the {role} uses two amax algorithms ({alg!r} and {op.scaling.algorithm!r}) in "
                "different GEMMs; the history is shared per tensor role, so use one algorithm per role"
            )
        out[role] = (max(n, op.scaling.history_len), alg)
    return out


def init_state(recipe: LinearRecipe) -> State:
    """The delayed-scaling state of one layer: ``{role: zeros(history_len, float32)}`` (empty without delayed
    scaling), PyTorch's ``amax_history_<role>`` buffers."""
    return {role: jnp.zeros((n,), jnp.float32) for role, (n, _) in delayed_roles(recipe).items()}


def is_stochastic(recipe: LinearRecipe) -> bool:
    """Whether some operand rounds stochastically (then ``linear`` needs ``step``)."""
    return any(op.spec is not None and op.spec.rounding == "stochastic" for op in recipe.operands().values())


def step_keys(recipe: LinearRecipe, step: jax.Array | int, *, seed: int, name: str) -> Keys | None:
    """Per stochastic operand ``"gemm.operand"``: uint32 ``[k1, k2]`` for ``step`` (traceable in ``step``)."""
    out: Keys = {}
    for (g, o), op in recipe.operands().items():
        if op.spec is not None and op.spec.rounding == "stochastic":
            base = _random.key_array(stream_seed(seed, name, g, o))
            out[f"{g}.{o}"] = _random.derive_keys(base, jnp.asarray(step))
    return out or None


def roll_history(t: jax.Array, hist: jax.Array, algorithm: str) -> tuple[jax.Array, jax.Array]:
    """(bits of the amax to scale ``t`` with, the history with ``amax(|t|)`` pushed in front).

    Integer max of magnitude bits (exact, NaN above inf, no subnormal flush); a NaN or zero history entry does not
    count, so the first step scales with the current amax, as PyTorch's ``torch.where(past > 0, past, current)``.
    """
    cur = _amax(t, tuple(range(t.ndim))).reshape(())
    hb = bits(hist)
    past = jnp.max(hb) if algorithm == "max" else hb[0]
    use = jnp.where((past > 0) & (past <= INF), past, cur)
    return use, jnp.concatenate([f32(cur)[None], hist[:-1]])


def quantize_operand(t: jax.Array, spec: Gemm, name: str, which: str, keys: Keys | None,
                     amax: Mapping[str, jax.Array]) -> jax.Array:
    """Operand ``which`` ("a" or "b") of GEMM ``name`` quantized per ``spec`` (float32, reduction dim last);
    ``amax``: role -> amax bits for delayed operands."""
    op: Operand = getattr(spec, which)
    if op.spec is None:
        return t
    role_amax = amax.get(ROLE[(name, which)]) if op.scaling.kind == "delayed" else None
    k = keys.get(f"{name}.{which}") if keys else None
    return fake_quantize_traced(t, op.spec, keys=k, amax=role_amax)


def product(qa: jax.Array, qb: jax.Array, spec: Gemm) -> jax.Array:
    """``qa @ qb^T`` of already quantized operands through the GEMM's accumulator and output rounding."""
    out = accumulate_matmul(qa, qb, spec.accumulator)
    if spec.output_format is not None:
        out = quantize_f32(out, formats.get(spec.output_format), rounding="nearest", saturate=False, rbits=None)
    return out


def gemm(a: jax.Array, b: jax.Array, spec: Gemm, name: str, keys: Keys | None,
         amax: Mapping[str, jax.Array]) -> jax.Array:
    """One emulated GEMM ``Q(a) @ Q(b)^T`` (reduction dim last in both): ``[M, K], [N, K] -> [M, N]``."""
    qa = quantize_operand(a, spec, name, "a", keys, amax)
    return product(qa, quantize_operand(b, spec, name, "b", keys, amax), spec)


def _forward(lin: LinearRecipe, x2: jax.Array, w: jax.Array, state: State, keys: Keys | None):
    roles = delayed_roles(lin)
    amax, new = {}, dict(state)
    for role, t in (("input", x2), ("weight", w)):
        if role in roles:
            amax[role], new[role] = roll_history(t, state[role], roles[role][1])
    fwd = lin.forward
    # y = x @ W^T   [B,K] @ [K,N] -> [B,N]
    qx = quantize_operand(x2, fwd, "forward", "a", keys, amax)
    qw = quantize_operand(w, fwd, "forward", "b", keys, amax)
    y = product(qx, qw, fwd)
    # where the backward GEMM quantizes x (or W) identically, save Q(x) (Q(W)) for it instead of x (W)
    x_saved = qx if shares_quantization(fwd.a, lin.grad_weight.b) else x2
    w_saved = qw if shares_quantization(fwd.b, lin.grad_input.b) else w
    return y, (x_saved, w_saved, amax, new, keys)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear2d(lin: LinearRecipe, x2: jax.Array, w: jax.Array, state: State, keys: Keys | None) -> jax.Array:
    return _forward(lin, x2, w, state, keys)[0]


def _linear2d_fwd(lin: LinearRecipe, x2: jax.Array, w: jax.Array, state: State, keys: Keys | None):
    y, res = _forward(lin, x2, w, state, keys)
    return y, res + (state,)


def _linear2d_bwd(lin: LinearRecipe, res, dy: jax.Array):
    x2, w, amax, new, keys, state = res
    roles = delayed_roles(lin)
    amax = dict(amax)
    if "grad_output" in roles:
        amax["grad_output"], new["grad_output"] = roll_history(dy, state["grad_output"], roles["grad_output"][1])
    gi, gw_spec = lin.grad_input, lin.grad_weight
    share_x = shares_quantization(lin.forward.a, gw_spec.b)  # then x2 is Q(x), w is Q(W) (see _forward)
    share_w = shares_quantization(lin.forward.b, gi.b)
    qg = quantize_operand(dy, gi, "grad_input", "a", keys, amax)
    # grad_input = dY @ W   [B,N] @ [N,K] -> [B,K]   (b = W^T [K,N], reduction dim N last)
    qw_t = w.T if share_w else quantize_operand(w.T, gi, "grad_input", "b", keys, amax)
    gx = product(qg, qw_t, gi)
    # grad_weight = dY^T @ x   [N,B] @ [B,K] -> [N,K]   (a = dY^T [N,B], b = x^T [K,B])
    share_g = shares_quantization(gi.a, gw_spec.a)
    qg_t = qg.T if share_g else quantize_operand(dy.T, gw_spec, "grad_weight", "a", keys, amax)
    qx_t = x2.T if share_x else quantize_operand(x2.T, gw_spec, "grad_weight", "b", keys, amax)
    gw = product(qg_t, qx_t, gw_spec)
    no_keys = None if keys is None else jax.tree_util.tree_map(lambda _: None, keys)
    return gx, gw, new, no_keys


_linear2d.defvjp(_linear2d_fwd, _linear2d_bwd)


def _check_call(recipe: object, state: State | None, step: object) -> tuple[LinearRecipe, State]:
    if not isinstance(recipe, LinearRecipe):
        raise UsageError(f"recipe must be a lowprec.LinearRecipe (e.g. Recipe.linear); got {type(recipe).__name__}")
    roles = delayed_roles(recipe)
    state = {} if state is None else dict(state)
    if set(state) != set(roles):
        raise UsageError(
            f"state must hold the amax histories {sorted(roles)} of this recipe; got {sorted(state)}: "
            "create it with lowprec.jax.init_state(recipe)"
        )
    if step is None and is_stochastic(recipe):
        raise UsageError("this recipe rounds some operand stochastically: pass step=<training step, from 1>")
    return recipe, state


def linear(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    recipe: LinearRecipe,
    state: State | None = None,
    step: jax.Array | int | None = None,
    seed: int = 0,
    name: str = "",
) -> jax.Array:
    """``y = x @ weight^T + bias`` with the recipe's emulated forward and backward GEMMs (module docstring).

    Args:
        x: float32/bfloat16/float16 ``[..., K]``.
        weight: ``[N, K]`` (PyTorch's ``nn.Linear`` layout); bias: ``[N]`` or None.
        recipe: a ``LinearRecipe`` (``Recipe.linear``, or a per-module override).
        state: ``init_state(recipe)`` or the previous step's (needed for delayed scaling); its gradient is the
            updated state.
        step: the training step (1 for the first, as PyTorch's ``lp_step``); needed for stochastic operands.
        seed, name: the random streams: the recipe's ``seed`` and the layer's name (PyTorch: its qualified name).
    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    lin, state = _check_call(recipe, state, step)
    keys = step_keys(lin, step, seed=seed, name=name) if step is not None else None
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = _linear2d(lin, x2, weight.astype(jnp.float32), state, keys)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    recipe: LinearRecipe,
    state: State | None = None,
    step: jax.Array | int | None = None,
    seed: int = 0,
    name: str = "",
) -> jax.Array:
    """``lax.dot_general`` without batch dimensions, as the recipe's emulated GEMM: ``lhs`` plays the input (its
    free dimensions flattened to B), ``rhs`` the weight (its free dimensions flattened to N), the contracting
    dimensions (flattened to K) the reduction.  Output: lhs free dims + rhs free dims, as ``lax.dot_general``.
    For batch dimensions, ``jax.vmap`` over them."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise UsageError("lowprec.jax.dot_general has no batch dimensions; jax.vmap over them instead")
    lc = tuple(d % lhs.ndim for d in lc)
    rc = tuple(d % rhs.ndim for d in rc)
    lf = [d for d in range(lhs.ndim) if d not in lc]
    rf = [d for d in range(rhs.ndim) if d not in rc]
    k = 1
    for d in lc:
        k *= lhs.shape[d]
    x = jnp.transpose(lhs, lf + list(lc)).reshape(-1, k)
    w = jnp.transpose(rhs, rf + list(rc)).reshape(-1, k)
    y = linear(x, w, recipe=recipe, state=state, step=step, seed=seed, name=name)
    return y.reshape([lhs.shape[d] for d in lf] + [rhs.shape[d] for d in rf])
