"""``jax_train``: the runner's training loop in JAX (``framework = "jax"`` in a run config), recorded in the same
run store, under the same scalar names and with a manifest, so a JAX run is judged against a PyTorch baseline.
The models' JAX forms are in ``_jax_models``; this module is the step, the optimizer and the checkpoints, and
``_lifecycle`` (shared with the PyTorch runner) resolves the config, creates or resumes the run, drives the loop's
cadence and records, and finishes or fails it.

What is shared with the PyTorch side, so that the two frameworks train the same experiment:

* **the task**: the zoo task is built exactly as for PyTorch (``build_task``); its freshly initialised torch model
  is the JAX model's initial state (weights copied to numpy, in ``model.parameters()`` order), and every batch is
  the task's ``train_batch(step)`` converted to numpy (floats as float32, integers as int32).  Same seed, same
  starting point, same batches.
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
  so ``eval/<metric>`` is computed by the task's definitions, on the same held-out set.
* **checkpoints**: the PyTorch runner's files and conventions (``checkpoint.interval`` and ``keep``, checksummed
  atomic files in ``checkpoints/<run id>/``, the newest that verifies on resume, records after its step dropped,
  a "resumed" event).  A JAX checkpoint holds ``framework = "jax"`` and the raw bytes of every leaf of
  ``(params, delayed-scaling states, optax state)``; the step is the only other state (batches and random streams
  are functions of it), so a resumed run logs the uninterrupted run's values bit for bit.  Resuming a PyTorch
  run, or a PyTorch checkpoint, as JAX raises ``ValueError``.

Not bitwise equal to PyTorch in float32: XLA's GEMMs and reductions sum in another order than PyTorch's BLAS, and
optax's Adam formula rounds differently from ``torch.optim.AdamW`` (docs/jax.md), so curves agree to float32
rounding noise that training then amplifies (measured in ``tests/test_jax_runs.py``).

Supported: the ``mlp-digits`` and ``gpt-bytes`` tasks with any of their options (``tie_head`` included), single
process, checkpoints and ``--resume``.  Not implemented: loss scaling (refused by ``LowPrecisionOptimizer``),
automatic fallback and tensor statistics (refused with a ``ValueError``), other zoo tasks (refused by
``model_plan``).  Data-parallel JAX training is ``lowprec.jax.data_parallel``, not wired in here.
"""

from __future__ import annotations

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
from .._errors import UsageError
from ..recipes import Recipe
from ._checkpoint import checkpoint_digest, checkpoint_dir, load_checkpoint, save_checkpoint
from ._config import OptimizerConfig, RunConfig
from ._jax_models import Plan, cross_entropy, forward, initial_params, initial_states, model_plan
from ._lifecycle import ResolvedConfig, RunLifecycle, build_task, resolve_for_task, run_manifest, warn_resume
from ._resume import Candidate, check_resumable, choose, record_checkpoint
from ._store import RunStore
from .zoo import Task


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
def _compile(plan: Plan, recipe_json: str, o: OptimizerConfig) -> _Compiled:
    """The jitted step and forward of one (plan, recipe, optimizer without its ``lr``): shared by every seed, run
    and learning rate of a config, so XLA compiles once per process."""
    opt = lj.LowPrecisionOptimizer(_inner_optimizer(o), Recipe.from_json(recipe_json))
    clip = o.grad_clip

    def train_step(params, states, opt_state, x, y, step, lr, keys):
        def loss_fn(p, s):
            return cross_entropy(forward(plan, p, s, x, step), y)

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


def _logits_at(fns: _Compiled, params: Any, states: Any, step: int) -> Any:
    """The model's logits as a function of the inputs alone, at these parameters and states (for ``evaluate``)."""
    k = jnp.int32(step)
    return lambda v: fns.logits(params, states, v, k)


def _to_jax(t: torch.Tensor) -> jax.Array:
    """A task's torch tensor as a JAX array: floating point as float32, integers (byte tokens, labels) as int32."""
    a = t.numpy()
    return jnp.asarray(a.astype(np.int32) if np.issubdtype(a.dtype, np.integer) else a.astype(np.float32))


class _JaxModule(nn.Module):
    """A torch module whose forward is the JAX model at its current parameters: lets the task's own
    ``evaluate`` compute the held-out metrics (float32 outputs back as a torch tensor)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.fn(_to_jax(x))).copy())


def _check(config: RunConfig) -> None:
    if config.parallel.strategy != "single":
        raise UsageError("framework = \"jax\" runs in one process: set parallel.strategy = \"single\"")
    if config.recipe.fallback is not None:
        raise UsageError("recipe.fallback is not implemented for framework = \"jax\"; remove it or use torch")
    if config.recipe.attention is not None:
        raise UsageError(f"recipe {config.recipe.name!r} emulates attention (recipe.attention), which "
                         "framework = \"jax\" does not implement; use the recipe without it (drop '+attn') or "
                         "framework = \"torch\"")
    if config.stats.every is not None:
        raise UsageError("[stats] every is not implemented for framework = \"jax\"; remove it or use torch")


def jax_manifest(r: ResolvedConfig, task: Task) -> dict[str, Any]:
    """``run_manifest`` plus ``framework = "jax"``, the jax/jaxlib/optax versions and the XLA backend."""
    m = run_manifest(r, task, device=jax.devices()[0].platform, world_size=1, extra={"framework": "jax"})
    m["versions"].update({k: importlib.metadata.version(k) for k in ("jax", "jaxlib", "optax")})
    m["hardware"]["jax_backend"] = jax.default_backend()
    m["hardware"]["jax_device"] = str(jax.devices()[0].device_kind)
    return m


# -- checkpoints ---------------------------------------------------------------------------------------------------
# The PyTorch runner's files (``_checkpoint``: checksummed, written atomically, the newest ``checkpoint.keep`` kept,
# in ``checkpoints/<run id>/step-<NNNNNNNN>.ckpt`` next to the store), holding ``framework = "jax"`` and the
# training state as the leaves of the pytree ``(params, states, opt_state)``, each leaf's raw bytes (bit-exact
# for every dtype), with its dtype, shape and the tree's structure to check against on load.

TrainState = tuple[Any, Any, Any]
"""``(params, states, opt_state)``: everything a JAX step reads besides the batch, the step and the lr."""


def _pack(tree: TrainState) -> dict[str, Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    return {"treedef": str(treedef), "dtypes": [a.dtype.name for a in arrays],
            "shapes": [list(a.shape) for a in arrays],
            "bytes": [torch.from_numpy(np.frombuffer(a.tobytes(), dtype=np.uint8).copy()) for a in arrays]}


def _unpack(packed: dict[str, Any], like: TrainState, where: str) -> TrainState:
    """The pytree ``_pack`` stored, rebuilt on the structure of ``like`` (a freshly initialised state of the same
    config); ``ValueError`` when the two differ (another model, recipe or optimizer)."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    got = list(zip(packed["dtypes"], packed["shapes"], strict=False))
    want = [(np.asarray(leaf).dtype.name, list(np.shape(leaf))) for leaf in leaves]
    if packed["treedef"] != str(treedef) or got != want:
        raise UsageError(f"{where} does not match this run's model, recipe and optimizer (its state has another "
                         "structure); resume a run with the config it was started with")
    return jax.tree_util.tree_unflatten(treedef, [
        jnp.asarray(np.frombuffer(b.numpy().tobytes(), dtype=np.asarray(leaf).dtype).reshape(shape))
        for b, leaf, (_, shape) in zip(packed["bytes"], leaves, got, strict=True)])


def _save(r: ResolvedConfig, run_id: str, step: int, tree: TrainState, store: RunStore) -> None:
    state = {"framework": "jax", "run_id": run_id, "step": step, "config": r.config.to_dict(), "world_size": 1,
             "jax_state": _pack(tree)}
    path = save_checkpoint(checkpoint_dir(store, run_id), step, state, keep=r.checkpoint_keep)
    record_checkpoint(store, run_id, step, "file", checkpoint_digest(path))


def _restore(life: RunLifecycle, run_id: str, like: TrainState, *, allow_restart: bool) -> tuple[int, TrainState]:
    """Where run ``run_id`` continues, by the PyTorch runner's rules (``_resume``): ``(step, state)`` of its newest
    usable checkpoint (``(0, like)`` when it wrote none), and the store reopened from that step with a "resumed"
    event."""
    store = life.store
    record = store.get_run(run_id)
    framework = record.manifest.get("framework", "torch")
    if framework != "jax" or record.config.get("framework", "torch") != "jax":
        raise UsageError(f"run {run_id} is a {framework} run: its checkpoints cannot be resumed as framework = "
                         f"\"jax\"; resume it with its stored config (lowprec run --resume {run_id})")
    check_resumable(record)

    def usable(c: Candidate) -> TrainState:
        where = f"checkpoint {str(c.path)!r}"
        if c.kind != "file":
            raise UsageError(f"{where} is sharded (written by an FSDP2 run), not a JAX checkpoint")
        state = load_checkpoint(c.path)
        if state.get("framework") != "jax" or "jax_state" not in state:
            raise UsageError(f"{where} was written by the PyTorch runner, not by a JAX run; resume it with "
                             "framework = \"torch\"")
        if state.get("run_id") != run_id or state.get("step") != c.step:
            raise UsageError(f"{where} belongs to run {state.get('run_id')!r} step {state.get('step')!r}, not to "
                             f"run {run_id!r} step {c.step}")
        return _unpack(state["jax_state"], like, where)

    point = choose(store, record, checkpoint_dir(store, run_id), usable, allow_restart=allow_restart)
    warn_resume(run_id, point.problems, point.discarded)
    step, tree = (point.step, point.loaded) if point.candidate is not None else (0, like)
    life.resumed(run_id, step, world_size=1, checkpoint_world_size=1 if step else None,
                 checkpoint="file" if step else "none", skipped=point.problems, discarded_steps=point.discarded)
    return step, tree


# -- the loop ------------------------------------------------------------------------------------------------------


def _step_values(task: Task, loss: float, norm: float, lr: float, dt: float) -> dict[str, float]:
    return {"train/loss": loss, "train/grad_norm": norm, "train/lr": lr, "train/step_time_s": dt,
            "train/samples_per_s": task.samples_per_step / dt}


_ANNOUNCED: set[int] = set()
"""``id`` of each ``_compile`` result whose first-step compilation was announced (they live in its cache)."""


def _loop(life: RunLifecycle, task: Task, fns: _Compiled, tree: TrainState) -> bool:
    """Train from ``life.step`` (the state ``tree`` after it) to ``steps`` through ``life.drive``, logging and
    checkpointing; True when the run diverged (stopped at a non-finite loss or gradient norm)."""
    r = life.r
    state = list(tree)  # (params, states, opt_state), advanced by each step
    if life.step < r.steps and id(fns) not in _ANNOUNCED:  # XLA compiles the step on its first call: say so, once
        _ANNOUNCED.add(id(fns))
        life.bar.note("compiling the JAX step (first step)...")

    def step_fn(step: int) -> tuple[dict[str, float], None, bool]:
        lr = r.lr_at(step)
        t0 = time.perf_counter()
        x, y = _np_batch(task, step)
        params, states, opt_state, loss, norm = fns.step(
            *state, x, y, jnp.int32(step + 1), jnp.float32(lr), fns.opt.step_keys(step))
        state[:] = params, states, opt_state
        loss_f, norm_f = float(loss), float(norm)  # blocks until the step is done
        values = _step_values(task, loss_f, norm_f, lr, time.perf_counter() - t0)
        return values, None, not (math.isfinite(loss_f) and math.isfinite(norm_f))

    def evaluate(step: int) -> dict[str, float]:
        metrics = task.evaluate(_JaxModule(_logits_at(fns, state[0], state[1], step)))
        return {f"eval/{m}": float(v) for m, v in metrics.items()}

    def save(step: int) -> None:
        _save(r, life.run_id, step, (state[0], state[1], state[2]), life.store)

    return life.drive(step_fn, evaluate=evaluate, save=save)


def _np_batch(task: Task, step: int) -> tuple[jax.Array, jax.Array]:
    x, y = task.train_batch(step)
    return _to_jax(x), _to_jax(y)


def jax_train(config: RunConfig, *, seed: int, store: RunStore, resume: str | None = None, progress: bool = True,
              run_id: str | None = None, allow_restart: bool = False) -> str:
    """Train ``config`` (``framework = "jax"``) with ``seed`` in JAX and record it in ``store``, or continue run
    ``resume`` (a JAX run) from its newest valid checkpoint; returns the run id.

    Records what the PyTorch runner records (``train/loss``, ``train/grad_norm``, ``train/lr``,
    ``train/step_time_s``, ``train/samples_per_s`` per step; ``eval/<metric>`` every ``eval_interval`` steps and at
    the last), a ``diverged`` event and status "diverged" when the loss or gradient norm is non-finite, and
    checkpoints every ``checkpoint.interval`` steps and at the end.  A resumed run logs the same values, bit for
    bit, as an uninterrupted one.  Raises ``ValueError`` for what JAX runs do not implement (module docstring) and for a
    ``resume`` of a PyTorch run.
    """
    _check(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    task = build_task(config, seed)
    r = resolve_for_task(config, task, seed)
    plan = model_plan(task.model, r.config.recipe)
    fns = _compile(plan, r.config.recipe.to_json(), dataclasses.replace(r.config.optimizer, lr=None))
    params = fns.opt.to_storage(initial_params(task.model))
    tree: TrainState = (params, initial_states(plan), fns.opt.init(params))
    life = RunLifecycle(r, store, progress=progress)
    step = 0
    if resume is not None:
        rid = store.get_run(resume).run_id
        step, tree = _restore(life, rid, tree, allow_restart=allow_restart)
    else:
        rid = life.create(jax_manifest(r, task), run_id=run_id)
    with life.running(rid, step):
        diverged = _loop(life, task, fns, tree)
    life.finish(diverged=diverged)
    return rid
