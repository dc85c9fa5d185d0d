"""A recipe's weight-update policy around any optax optimizer: ``lowprec.optim.LowPrecisionOptimizer`` for JAX.

The wrapped optax transformation computes each update ``u`` in float32 as usual; the wrapper decides what is
stored (``Weights.update``), with the same arithmetic as PyTorch:

* "master": ``w <- w + u`` (float32 master weights; the GEMMs quantize their own copies).
* "nearest": ``w <- Q_nearest(w + u)`` on the ``Weights.format`` grid; updates below half a step are lost.
* "stochastic": ``w <- Q_sr(w + u)``, unbiased (``E[w_new] = w + u``).  Leaf ``i`` of the parameter pytree at step
  ``s`` (0 for the first) draws from ``stream_seed(recipe.seed, "weight-update", str(s), str(i))``, offset 0: the
  words PyTorch draws for its ``i``-th parameter, so equal leaf order gives equal bits.
* "kahan": ``a = fl(w + u); y = (a - w) - c; t = Q(w + y); c = Q((t - w) - y); w = t`` with a compensation ``c`` in
  the same format, so each step's rounding error is carried into the next.

``OptimizerState.grad`` fake-quantizes gradients before the inner step; ``exp_avg``/``exp_avg_sq`` fake-quantize the
first/second moments of optax's Adam-family states (``mu``/``nu``) and SGD's momentum (``trace``) after it.

Why a wrapper and not a plain ``optax.GradientTransformation``: optax applies updates with ``w + u'`` in float32,
and no ``u'`` makes ``fl(w + u')`` equal a target ``t`` on the weight grid when the update cancels most of ``w``
(``w = 1 + 2^-7``, ``t = 2^-30``: the neighbours of ``-w`` are ``2^-23`` apart), so the weights would leave the grid.
``update`` therefore returns the new parameters themselves.  Any object with optax's ``init``/``update``
protocol works as ``inner``; optax itself is not imported here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import formats, recipes
from .._errors import UsageError
from ..quant._random_py import stream_seed
from ..quant._spec import QuantSpec
from ..recipes import Recipe
from . import _random
from ._round import quantize_f32
from ._scaled import fake_quantize_traced

_STATE_FIELDS = {"mu": "exp_avg", "trace": "exp_avg", "nu": "exp_avg_sq"}


class LowPrecisionState(NamedTuple):
    """State of ``LowPrecisionOptimizer``."""

    inner: Any
    """The wrapped optax transformation's state."""
    compensation: Any
    """Kahan compensation per parameter (a pytree like the parameters), or None."""
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count on purpose: optax's state field name
    """Steps taken (int32), PyTorch's ``LowPrecisionOptimizer.steps``."""


def _quantize_tree(tree: Any, spec: QuantSpec) -> Any:
    return jax.tree_util.tree_map(lambda t: fake_quantize_traced(t.astype(jnp.float32), spec).astype(t.dtype), tree)


def _quantize_state(state: Any, specs: dict[str, QuantSpec | None]) -> Any:
    """``state`` with the fields ``mu``/``trace``/``nu`` of every optax NamedTuple state fake-quantized."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        changes = {}
        for f in state._fields:
            spec = specs.get(_STATE_FIELDS.get(f, ""))
            value = getattr(state, f)
            changes[f] = _quantize_tree(value, spec) if spec is not None else _quantize_state(value, specs)
        return type(state)(**changes)
    if isinstance(state, (tuple, list)):
        return type(state)(_quantize_state(s, specs) for s in state)
    return state


class LowPrecisionOptimizer:
    """``recipe``'s weight, optimizer-state and gradient policies around the optax transformation ``inner``.

    ``params = opt.to_storage(params)`` once (weights start on the storage grid), ``state = opt.init(params)``, then
    per step ``params, state = opt.update(grads, state, params, keys=opt.step_keys(step))`` (``update`` is
    jit-able; ``step_keys`` runs on the host and is needed only for "stochastic").
    """

    def __init__(self, inner: Any, recipe: Recipe | str) -> None:
        if not hasattr(inner, "init") or not hasattr(inner, "update"):
            raise UsageError(f"inner must be an optax.GradientTransformation; got {type(inner).__name__}")
        self.inner = inner
        self.recipe = recipes.get(recipe)
        if self.recipe.loss_scaling.kind != "none":
            raise UsageError(
                f"recipe {self.recipe.name!r} uses loss scaling, which lowprec.jax does not implement; "
                "use a recipe with loss_scaling kind='none' (or scale the loss yourself)"
            )
        grad = self.recipe.optimizer.grad
        if grad is not None and grad.rounding == "stochastic":
            raise UsageError("OptimizerState.grad with stochastic rounding is not supported in lowprec.jax")
        self.update_kind = self.recipe.weights.update
        self.format = formats.get(self.recipe.weights.format)

    def _round(self, t: jax.Array) -> jax.Array:
        return quantize_f32(t.astype(jnp.float32), self.format, rounding="nearest", saturate=False, rbits=None)

    def to_storage(self, params: Any) -> Any:
        """``params`` rounded (nearest) onto the weight format's grid; unchanged for "master"."""
        if self.update_kind == "master":
            return params
        return jax.tree_util.tree_map(lambda p: self._round(p).astype(p.dtype), params)

    def init(self, params: Any) -> LowPrecisionState:
        """The state for ``params`` (float32 arrays, any pytree; its leaf order numbers the random streams)."""
        self._leaves = len(jax.tree_util.tree_leaves(params))
        comp = None
        if self.update_kind == "kahan":
            comp = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return LowPrecisionState(self.inner.init(params), comp, jnp.zeros((), jnp.int32))

    def step_keys(self, step: int) -> jax.Array | None:
        """uint32 ``[leaves, 2]`` random keys of step ``step`` (0 for the first; "stochastic" only, else None).

        Needs the number of leaves, so call ``init`` first; a host-side function (SHA-256 of the stream name).
        """
        if self.update_kind != "stochastic":
            return None
        n = getattr(self, "_leaves", None)
        if n is None:
            raise UsageError("call init(params) before step_keys(step)")
        seeds = [stream_seed(self.recipe.seed, "weight-update", str(step), str(i)) for i in range(n)]
        return jnp.stack([_random.key_array(s) for s in seeds])

    def update(
        self, grads: Any, state: LowPrecisionState, params: Any, keys: jax.Array | None = None
    ) -> tuple[Any, LowPrecisionState]:
        """One step: ``(new_params, new_state)``.  ``keys``: ``step_keys(step)`` for "stochastic"."""
        opt = self.recipe.optimizer
        if opt.grad is not None:
            grads = _quantize_tree(grads, opt.grad)
        updates, inner = self.inner.update(grads, state.inner, params)
        inner = _quantize_state(inner, {"exp_avg": opt.exp_avg, "exp_avg_sq": opt.exp_avg_sq})
        # w + u in float32 (optax.apply_updates): PyTorch's optimizer result
        after = jax.tree_util.tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        comp = state.compensation
        if self.update_kind == "nearest":
            new = jax.tree_util.tree_map(lambda a: self._round(a).astype(a.dtype), after)
        elif self.update_kind == "stochastic":
            if keys is None:
                raise UsageError("Weights.update='stochastic' needs keys=opt.step_keys(step)")
            leaves, tree = jax.tree_util.tree_flatten(after)
            new = jax.tree_util.tree_unflatten(tree, [self._stochastic(a, keys[i]) for i, a in enumerate(leaves)])
        elif self.update_kind == "kahan":
            pairs = jax.tree_util.tree_map(self._kahan, params, after, comp)
            new = jax.tree_util.tree_map(lambda _, pr: pr[0], params, pairs)
            comp = jax.tree_util.tree_map(lambda _, pr: pr[1], params, pairs)
        else:
            new = after
        return new, LowPrecisionState(inner, comp, state.count + 1)

    def _stochastic(self, a: jax.Array, key: jax.Array) -> jax.Array:
        rbits = _random.random_bits(key, jnp.uint32(0), a.shape)
        return quantize_f32(a.astype(jnp.float32), self.format, rounding="stochastic", saturate=False,
                            rbits=rbits).astype(a.dtype)

    def _kahan(self, old: jax.Array, after: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = (after - old) - c  # the update, minus the error carried from the last step
        t = self._round(old + y)
        return t.astype(old.dtype), self._round((t - old) - y)
