"""``jax_train``: the runner's training loop in JAX (``framework = "jax"`` in a run config), recorded in the same
run store, under the same scalar names and with a manifest, so a JAX run is judged against a PyTorch baseline.

What is shared with the PyTorch side, so that the two frameworks train the same experiment:

* **the task**: the zoo task is built exactly as for PyTorch (``build_task``); its freshly initialised torch model
  is the JAX model's initial state (weights copied to numpy), and every batch is the task's ``train_batch(step)``
  converted to numpy.  Same seed, same starting point, same batches.
* **the recipe**: the torch model is ``lowprec.convert``-ed (a copy), and each layer that became an
  ``EmulatedLinear`` runs through ``lowprec.jax.linear`` with that module's ``LinearRecipe``, seed and qualified
  name; a layer ``keep_high_precision`` (or ``keep_types``) left alone stays a float32 ``x @ W^T + b``.
  Delayed-scaling histories are carried as explicit state; stochastic operands draw PyTorch's streams
  (``step`` = the module's ``lp_step``: 1 for the first training step, unchanged by evaluation).
* **the optimizer**: optax's ``adamw`` (or ``sgd`` with momentum) with the config's hyper-parameters, the
  learning rate injected per step from ``config.schedule.lr_at``, wrapped by ``lowprec.jax.LowPrecisionOptimizer``
  (the recipe's weight storage and optimizer-state policies).  Global gradient norm and clipping as PyTorch's
  runner: ``norm = ||(||g_i||)_i||_2``, gradients times ``clip / norm`` when ``norm > clip``.
* **the metrics**: the task's own ``evaluate`` runs on a torch module whose forward calls the jitted JAX forward,
  so ``eval/loss`` and ``eval/accuracy`` are computed by the task's definitions, on the same held-out set.

Not bitwise equal to PyTorch in float32: XLA's GEMMs and reductions sum in another order than PyTorch's BLAS, and
optax's Adam formula rounds differently from ``torch.optim.AdamW`` (docs/jax.md), so curves agree to float32
rounding noise that training then amplifies (measured in ``tests/test_jax_runs.py``).

Supported: the ``mlp-digits`` task (any ``hidden``/``layers``/``activation``), single process.  Not implemented:
checkpoints and ``--resume`` (refused with a ``ValueError``), loss scaling (refused by ``LowPrecisionOptimizer``),
automatic fallback and tensor statistics (refused).  Data-parallel JAX training is ``lowprec.jax.data_parallel``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch import nn

from .. import jax as lj
from ..nn import EmulatedLinear, convert
from ..recipes import LinearRecipe, Recipe
from ._config import OptimizerConfig, RunConfig
from ._manifest import build_manifest
from ._progress import Progress
from ._runner import build_task
from ._store import RunStore
from .zoo import Task
from .zoo._digits import MLP

_ACTIVATIONS = {"ReLU": jax.nn.relu, "GELU": functools.partial(jax.nn.gelu, approximate=False)}


@dataclasses.dataclass(frozen=True)
class MLPPlan:
    """The JAX form of a converted ``mlp-digits`` model: its layers in forward order and the activation."""

    names: tuple[str, ...]
    """Qualified module names (``layers.0``, ..., ``head``): the random streams' names."""
    recipes: tuple[LinearRecipe | None, ...]
    """Each layer's ``LinearRecipe``; None where ``convert`` left a plain float32 ``nn.Linear``."""
    activation: str
    """"ReLU" or "GELU" (exact erf form, as ``torch.nn.GELU()``)."""
    seed: int
    """The recipe's seed (stochastic operand streams)."""


def mlp_plan(model: nn.Module, recipe: Recipe) -> MLPPlan:
    """The plan of ``model`` (an ``mlp-digits`` MLP) under ``recipe``, read off ``lowprec.convert`` of a copy, so
    exactly the layers PyTorch converts are emulated, each with the module's ``LinearRecipe`` (overrides too)."""
    if not isinstance(model, MLP):
        raise ValueError(f"framework = 'jax' supports the mlp-digits task; this task's model is "
                         f"{type(model).__name__}: set framework = \"torch\"")
    act = type(model.act).__name__
    if act not in _ACTIVATIONS or getattr(model.act, "approximate", "none") != "none":
        raise ValueError(f"framework = 'jax': activation {model.act!r} is not supported; use relu or gelu")
    converted = convert(copy.deepcopy(model), recipe)
    mods = [(f"layers.{i}", m) for i, m in enumerate(converted.layers)] + [("head", converted.head)]
    return MLPPlan(names=tuple(n for n, _ in mods),
                   recipes=tuple(m.recipe if isinstance(m, EmulatedLinear) else None for _, m in mods),
                   activation=act, seed=recipe.seed)


def initial_params(model: nn.Module) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """``((W [out,in], b [out]) per layer)`` float32, copied from the torch model: the leaf order is the order of
    ``model.parameters()``, so stochastic weight updates draw the same per-parameter streams as PyTorch."""
    assert isinstance(model, MLP)
    lins = [*model.layers, model.head]
    return tuple((jnp.asarray(m.weight.detach().numpy()), jnp.asarray(m.bias.detach().numpy())) for m in lins)


def forward(plan: MLPPlan, params: Any, states: Any, x: jax.Array, step: jax.Array) -> jax.Array:
    """Logits ``[B, 10]`` float32 of inputs ``x: [B, 64]`` float32; ``step``: the layers' ``lp_step``."""
    h = x
    act = _ACTIVATIONS[plan.activation]
    for i, (name, lin, (w, b), st) in enumerate(zip(plan.names, plan.recipes, params, states, strict=True)):
        if lin is None:
            # y = x @ W^T + b   [B,K] @ [K,N] -> [B,N], float32 (a layer kept in high precision)
            h = jnp.dot(h, w.T, precision=jax.lax.Precision.HIGHEST) + b
        else:
            h = lj.linear(h, w, b, recipe=lin, state=st, step=step, seed=plan.seed, name=name)
        if i < len(plan.names) - 1:
            h = act(h)
    return h


def _cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _inner_optimizer(o: OptimizerConfig) -> optax.GradientTransformation:
    """The config's optimizer with an injectable learning rate (``state.hyperparams["learning_rate"]``, set by
    every step; 0.0 until then), so one compiled step serves every learning rate and schedule."""
    if o.name == "sgd":
        def sgd(learning_rate: float) -> optax.GradientTransformation:
            # torch.optim.SGD: g += wd * w; buf = momentum * buf + g (buf = g at the first step); w -= lr * buf
            return optax.chain(optax.add_decayed_weights(o.weight_decay), optax.sgd(learning_rate, momentum=o.momentum))

        return optax.inject_hyperparams(sgd)(learning_rate=0.0)
    return optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=o.betas[0], b2=o.betas[1], eps=o.eps,
                                                 weight_decay=o.weight_decay)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    opt: lj.LowPrecisionOptimizer
    step: Any
    """jitted ``(params, states, opt_state, x, y, step, lr, keys) -> (params, states, opt_state, loss, norm)``"""
    logits: Any
    """jitted ``(params, states, x, step) -> logits`` (evaluation: the states are read, not advanced)"""


@functools.lru_cache(maxsize=8)
def _compile(plan: MLPPlan, recipe_json: str, o: OptimizerConfig) -> _Compiled:
    """The jitted step and forward of one (plan, recipe, optimizer without its ``lr``): shared by every seed, run
    and learning rate of a config, so XLA compiles once per process."""
    opt = lj.LowPrecisionOptimizer(_inner_optimizer(o), Recipe.from_json(recipe_json))
    clip = o.grad_clip

    def train_step(params, states, opt_state, x, y, step, lr, keys):
        def loss_fn(p, s):
            return _cross_entropy(forward(plan, p, s, x, step), y)

        # the gradient with respect to the delayed-scaling states *is* the new states (lowprec.jax.linear)
        loss, (grads, new_states) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, states)
        leaves = jax.tree_util.tree_leaves(grads)
        norm = jnp.linalg.norm(jnp.stack([jnp.linalg.norm(g.ravel()) for g in leaves]))
        if clip:
            coef = jnp.where(jnp.isfinite(norm) & (norm > clip), clip / norm, jnp.float32(1.0))
            grads = jax.tree_util.tree_map(lambda g: g * coef, grads)
        inner = opt_state.inner
        opt_state = opt_state._replace(inner=inner._replace(
            hyperparams={**inner.hyperparams, "learning_rate": lr}))
        params, opt_state = opt.update(grads, opt_state, params, keys)
        return params, new_states, opt_state, loss, norm

    return _Compiled(opt=opt, step=jax.jit(train_step), logits=jax.jit(functools.partial(forward, plan)))


class _JaxModule(nn.Module):
    """A torch module whose forward is the JAX model at its current parameters: lets the task's own
    ``evaluate`` compute the held-out metrics (float32 logits back as a torch tensor)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.fn(jnp.asarray(x.numpy()))).copy())


def _check(config: RunConfig, resume: str | None) -> None:
    if resume is not None:
        raise ValueError(f"run {resume} is a JAX run (framework = \"jax\"): checkpoint/resume is not implemented for "
                         "JAX runs; start a new run instead")
    if config.parallel.strategy != "single":
        raise ValueError("framework = \"jax\" runs in one process: set parallel.strategy = \"single\"")
    if config.recipe.fallback is not None:
        raise ValueError("recipe.fallback is not implemented for framework = \"jax\"; remove it or use torch")
    if config.stats.every is not None:
        raise ValueError("[stats] every is not implemented for framework = \"jax\"; remove it or use torch")
    if config.checkpoint.interval:
        raise ValueError("checkpoint.interval: JAX runs write no checkpoints; set it to 0 or use torch")


def jax_manifest(config: RunConfig, task: Task, seed: int) -> dict[str, Any]:
    """``build_manifest`` plus ``framework = "jax"``, the jax/jaxlib/optax versions and the XLA backend."""
    m = build_manifest(seed=seed, recipe_hash=config.recipe.hash(), data_hash=task.data_hash,
                       data_source=task.data_source, metrics=task.metrics, device=jax.devices()[0].platform)
    m["framework"] = "jax"
    m["versions"].update({k: importlib.metadata.version(k) for k in ("jax", "jaxlib", "optax")})
    m["hardware"]["jax_backend"] = jax.default_backend()
    m["hardware"]["jax_device"] = str(jax.devices()[0].device_kind)
    m["world_size"] = 1
    return m


def _np_batch(task: Task, step: int) -> tuple[jax.Array, jax.Array]:
    x, y = task.train_batch(step)
    return jnp.asarray(x.numpy()), jnp.asarray(y.numpy().astype(np.int32))


def jax_train(config: RunConfig, *, seed: int, store: RunStore, resume: str | None = None, progress: bool = True,
              run_id: str | None = None) -> str:
    """Train ``config`` (``framework = "jax"``) with ``seed`` in JAX and record it in ``store``; returns the run id.

    Records what the PyTorch runner records (``train/loss``, ``train/grad_norm``, ``train/lr``,
    ``train/step_time_s``, ``train/samples_per_s`` per step; ``eval/<metric>`` every ``eval_interval`` steps and at
    the last), and a ``diverged`` event when the loss or gradient norm is non-finite.  Raises ``ValueError`` for
    what JAX runs do not implement (module docstring).
    """
    _check(config, resume)
    if config.threads:
        torch.set_num_threads(config.threads)
    task = build_task(config, seed)
    config = config.for_seed(seed).resolve({**task.defaults, "batch_size": task.samples_per_step})
    plan = mlp_plan(task.model, config.recipe)
    fns = _compile(plan, config.recipe.to_json(), dataclasses.replace(config.optimizer, lr=None))
    params = fns.opt.to_storage(initial_params(task.model))
    states = tuple(lj.init_state(r) if r is not None else {} for r in plan.recipes)
    opt_state = fns.opt.init(params)
    rid = store.create_run(name=f"{config.label} seed {seed}", config=config.to_dict(),
                           manifest=jax_manifest(config, task, seed), group=config.group or config.label,
                           run_id=run_id)
    steps, every, lr0 = config.steps or 0, config.eval_interval or 1, config.optimizer.lr or 0.0
    bar = Progress(f"{config.label} seed {seed}", steps, enabled=progress)
    step = 0
    try:
        while step < steps:
            lr = config.schedule.lr_at(step, lr=lr0, steps=steps)
            t0 = time.perf_counter()
            x, y = _np_batch(task, step)
            params, states, opt_state, loss, norm = fns.step(
                params, states, opt_state, x, y, jnp.int32(step + 1), jnp.float32(lr), fns.opt.step_keys(step))
            loss_f, norm_f = float(loss), float(norm)  # blocks until the step is done
            dt = time.perf_counter() - t0
            step += 1
            values = {"train/loss": loss_f, "train/grad_norm": norm_f, "train/lr": lr, "train/step_time_s": dt,
                      "train/samples_per_s": task.samples_per_step / dt}
            diverged = not (math.isfinite(loss_f) and math.isfinite(norm_f))
            if step % every == 0 or step == steps or diverged:
                p, s, k = params, states, jnp.int32(step)
                metrics = task.evaluate(_JaxModule(lambda v: fns.logits(p, s, v, k)))
                values.update({f"eval/{m}": float(v) for m, v in metrics.items()})
            store.log_scalars(rid, step, values)
            bar.update(step, loss=loss_f)
            if diverged:
                store.add_event(rid, step=step, kind="diverged",
                                payload={"loss": repr(loss_f), "grad_norm": repr(norm_f)})
                break
    except BaseException as e:
        reason = "interrupted (KeyboardInterrupt)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        store.finish_run(rid, status="failed", error=reason)
        raise
    finally:
        bar.close()
    store.finish_run(rid, status="completed")
    return rid
