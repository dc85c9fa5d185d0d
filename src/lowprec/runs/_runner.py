"""The runner: train one seed of a ``RunConfig`` and record everything in the run store.

Per step it records ``train/loss``, ``train/grad_norm`` (global L2 norm of the unscaled gradients, before
clipping), ``train/lr``, ``train/step_time_s`` and ``train/samples_per_s``; every ``eval_interval`` steps and at
the last step ``eval/<metric>`` for each of the task's metrics.  Training batches are a pure function of (seed,
step), so a checkpoint needs only the model, the optimizer (with the recipe's loss-scaler, Kahan and step state)
and the RNG state to continue exactly: ``resume`` gives the same curve, bit for bit, as an uninterrupted run.

A non-finite loss, or a non-finite gradient norm that no loss scaler will skip, stops the run at that step: the
values are recorded, with a ``diverged`` event naming the step, and the run ends with status "diverged" (a
result the judge fails, not a crash; ``lowprec run`` prints where the first non-finite value came from).  Both
values are computed every step anyway, so the check is free.  Before the optimizer step (parameters and
optimizer state still those of the step's start) the run then replays the step under
``lowprec.numerics.localize_nonfinite`` and records a ``nonfinite`` event naming the first module,
tensor role and value summary; under data parallelism every rank replays its own shard and the event names the
rank whose replay failed first.  For the replay to be exact, each step starts with a snapshot of what a
forward/backward changes besides gradients: the module buffers (amax histories, stochastic-rounding counters,
batch-norm statistics) and the CPU random generator; the batch is a pure function of (seed, step).  See
``docs/debugging.md`` for the measured cost.  The replay and the snapshot are ``_replay``'s.

Every batch follows the zoo's batch contract (``lowprec.runs.zoo.batch_loss``: a dict calls ``model(**batch)``, a
tuple ``(*inputs, target)`` calls ``model(*inputs)``) and is moved, with the model, to the config's ``device``
(``_parallel.world_device``: "auto" is CUDA when available; under data parallelism the process group's device).

A recipe with a ``fallback`` policy (single process or DDP, where rank 0 decides and every replica follows)
samples the tensor statistics (``[stats] every``, or ``FALLBACK_EVERY``) and moves a layer whose statistics cross
the policy's thresholds to the higher-precision ``LinearRecipe``, with a ``fallback`` event; the decisions and
running counts travel in checkpoints, so a resumed run repeats the same fallbacks at the same steps.  An exception
or Ctrl-C marks the run as failed with the reason, and re-raises.

What is not PyTorch (resolving the config, creating or resuming the store run, which steps evaluate and save,
the records, finishing or failing) is ``_lifecycle``'s, shared with the JAX runner; ``train`` is the one place
that dispatches by framework, importing ``_jax_runner`` (and jax) only for ``framework = "jax"``.  The PyTorch
state a step trains (``State``), saving it in checkpoints and resuming from them are ``_torch_state``'s; this
module is the training loop.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
from typing import Any

import torch

from .._errors import UsageError
from ..nn import convert
from ..optim import LowPrecisionOptimizer
from ..reliability._config import check_rollback
from ._config import ParallelConfig, RunConfig
from ._lifecycle import ResolvedConfig, RunLifecycle, import_dir, resolve, resolve_for_task, run_manifest
from ._lifecycle import build_task as build_task  # re-exported: lowprec.runs, the CLI and the seeds helpers use it
from ._parallel import World, resolve_device, unwrap, world_device, wrap_model
from ._reliable import Guard
from ._replay import gather_localizations, replay_step
from ._resume import check_resumable
from ._store import RunStore
from ._torch_state import SHARDED, State, restore_state, save_state
from .zoo import Task, batch_loss, to_device


def _check_fallback(config: RunConfig, world: World | None = None) -> None:
    """Refuse a recipe ``fallback`` policy under a sharded layout (FSDP2/HSDP)."""
    if config.parallel.strategy in SHARDED or (world is not None and world.strategy in SHARDED):
        raise UsageError(f"recipe.fallback (automatic per-layer fallback) works in single-process and DDP runs, not "
                         f"with parallel.strategy = {config.parallel.strategy!r}: FSDP2 shards each weight for the "
                         f"recipe's all-gather format when the run starts; set parallel.strategy = \"ddp\" or "
                         f"\"single\", or remove the recipe's fallback")


def make_optimizer(r: ResolvedConfig, model: torch.nn.Module, *, pipeline: Any = None) -> LowPrecisionOptimizer:
    """The torch optimizer the config names, wrapped with the recipe's weight/state/loss-scaling policy; with a
    ``pipeline``, over its stage's parameters (keyed by their whole-model index).  Tensor-parallel (DTensor)
    parameters next to plain ones take the per-parameter loop (a foreach kernel cannot mix them)."""
    from torch.distributed.tensor import DTensor

    o = r.config.optimizer
    params = pipeline.parameters() if pipeline is not None else [p for p in model.parameters() if p.requires_grad]
    loop: dict[str, Any] = {"foreach": False} if any(isinstance(p, DTensor) for p in params) else {}
    inner: torch.optim.Optimizer
    if r.optimizer == "sgd":
        inner = torch.optim.SGD(params, lr=r.lr, momentum=o.momentum, weight_decay=o.weight_decay, **loop)
    else:
        inner = torch.optim.AdamW(params, lr=r.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **loop)
    return LowPrecisionOptimizer(inner, r.config.recipe,
                                 param_index=pipeline.param_index if pipeline is not None else None)


def _grad_norm_and_clip(params: list[torch.Tensor], scale: float, clip: float) -> float:
    """Global L2 norm of the gradients divided by the loss scale; clip them (still scaled) to ``clip`` (0: no
    clipping).  A tensor-parallel (DTensor) gradient's norm is its whole tensor's (a reduction over its shards)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(g) for g in grads]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    norm = float(torch.linalg.vector_norm(torch.stack(norms))) / scale
    if clip and math.isfinite(norm) and norm > clip:
        coef = clip / norm
        for g in grads:
            g.mul_(coef)
    return norm


def _evaluate(task: Task, model: torch.nn.Module) -> dict[str, float]:
    """The task's metrics of ``model`` (in eval mode, without gradients) as ``eval/<metric>`` scalars."""
    model.eval()
    with torch.no_grad():
        metrics = task.evaluate(model)
    model.train()
    return {f"eval/{k}": float(v) for k, v in metrics.items()}


def _forward_backward(task: Task, st: State, r: ResolvedConfig, batch: int, *, replay: bool = False,
                      shard: int | None = None, rerun: bool = False) -> tuple[torch.Tensor, float]:
    """Forward and backward of batch ``batch`` (0-based), gradient norm and clipping: (local loss, norm).

    ``replay``: the localisation replay of a failed step.  Under DDP it runs the inner module, so no gradient is
    all-reduced (each rank's replay sees its own gradients, and a compression hook's state is not touched); the
    amax histories are not MAX-reduced either.  Every rank replays, so FSDP2's all-gathers still pair up.
    ``shard``: compute another rank's rows of the batch; ``rerun``: the step is computed again (``_reliable``:
    injected transient faults do not fire again)."""
    data = to_device(st.world.shard(task.train_batch(batch), shard), st.device)
    model = unwrap(st.model) if replay else st.model
    guard = st.guard
    step1 = st.step + 1
    guard.before_forward(step1, rerun or replay)
    loss = batch_loss(model, data, task.loss_fn)
    st.optimizer.zero_grad()
    st.optimizer.scale_loss(loss).backward()
    guard.after_backward(step1, rerun or replay)
    if not replay:
        st.wrapped.after_backward()
    params = [p for g in st.optimizer.param_groups for p in g["params"]]
    return loss, _grad_norm_and_clip(params, st.optimizer.scaler.scale, r.grad_clip)


def _train_step(task: Task, st: State, r: ResolvedConfig, lr: float,
                life: RunLifecycle) -> tuple[dict[str, float], dict | None, str] | None:
    """One optimizer step: (scalars to log, None or the "nonfinite" payload, what ends the run: "" to go on,
    "diverged", or the reason it stops), or None when the step rolled back to a checkpoint (``st.step`` is then
    the checkpoint's)."""
    t0 = time.perf_counter()
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    if st.observer is not None:
        st.observer.step(st.step)
    snap = st.snapshot
    snap.take(unwrap(st.model), st.wrapped.hook_state)
    guard = st.guard
    batch = guard.batch(st.step)
    loss, norm = _forward_backward(task, st, r, batch)
    unskipped_bad = not math.isfinite(norm) and not st.optimizer.scaler.enabled
    # one all-reduce: the mean loss, and whether any rank's gradient norm is non-finite (under DDP each rank
    # computes it from its own copy of the reduced gradients: a fault after the reduction is one rank's alone)
    global_loss, any_bad = st.world.mean_and_any(loss, unskipped_bad)
    comm = None if st.wrapped.comm_bytes is None else float(st.wrapped.comm_bytes())
    bad: dict[str, Any] | None = None
    end = ""
    t1 = time.perf_counter()
    out = guard.check(st, life, st.step + 1, loss, norm, global_loss, any_bad, snap,
                      lambda sh, again: _forward_backward(task, st, r, batch, shard=sh, rerun=again))
    guard.unbucketed = False  # one backward done: DDP's buckets are final (``Guard.unbucketed``)
    if out.action == "rollback":
        return None
    if out.loss is not None:
        global_loss = out.loss
    if out.norm is not None:
        norm = out.norm
    update = out.action == "ok" and not guard.update_skipped(st.step + 1)
    examined = bool(out.reason)
    if out.action == "stop":
        end, update = out.reason, False
    diverge = out.action == "diverge"
    if diverge:
        # every rank takes this branch together (the decision is from the all-reduced values)
        payload = replay_step(st, snap, float(loss.detach()), norm,
                              lambda: _forward_backward(task, st, r, batch, replay=True))
        bad = gather_localizations(st.world, payload)
        if st.wrapped.comm_bytes is not None:
            st.wrapped.comm_bytes()  # drop what the replay's all-gathers added (FSDP2)
        end = "diverged"
    replay_s = time.perf_counter() - t1 if (diverge or examined) else 0.0  # reruns are not the step's time
    if update or diverge:
        st.optimizer.step()
    if st.device.type == "xla":
        from ._xla import mark_step

        mark_step()  # one graph per step (compiled once), launched here
    dt = time.perf_counter() - t0 - replay_s
    out_values = {"train/loss": global_loss, "train/grad_norm": norm, "train/lr": lr, "train/step_time_s": dt,
                  "train/samples_per_s": task.samples_per_step / dt}
    if not update and not diverge:
        out_values["train/update_skipped"] = 1.0
    if comm is not None:
        out_values["comm/bytes_sent"] = comm
    return out_values, bad, end


def _share_fallbacks(st: State) -> None:
    """DDP with a fallback policy, after a sampled step: every replica applies rank 0's decisions (rank 0 samples
    the statistics of its batch shard), so the replicas keep computing the same arithmetic."""
    if st.fallback is None or not st.world.distributed or not st.sample_every or (st.step - 1) % st.sample_every:
        return
    decided = st.world.broadcast(dict(st.fallback.decisions) if st.world.is_main else None)
    if not st.world.is_main:
        st.fallback.apply(decided)


def _loop(task: Task, st: State, life: RunLifecycle) -> bool:
    """Train to ``steps`` through ``life.drive``; True when the run diverged (stopped at a non-finite loss or
    gradient norm)."""
    r, store = life.r, life.store

    def step_fn(step: int) -> tuple[dict[str, float], dict[str, Any] | None, bool] | None:
        if st.pipeline is not None:
            from ._pp_runner import pp_train_step

            values, _, end = pp_train_step(task, st, r, r.lr_at(step))
            st.step += 1
            return values, None, end == "diverged"
        done = _train_step(task, st, r, r.lr_at(step), life)
        if done is None:  # rolled back: the loop continues from the checkpoint's step
            return None
        values, bad, end = done
        st.step += 1
        if not end:
            end = st.guard.after_step(st, life, st.step) or ""
        if end and end != "diverged":
            life.stop_reason = end
        return values, bad, end == "diverged"

    def before_log(step: int, values: dict[str, float]) -> None:
        for s, stats in (st.observer.pop_scalars() if st.observer is not None else {}).items():
            if s + 1 == step:  # stats of the batch this step trained on: logged with its loss
                values.update(stats)
            else:
                store.log_scalars(life.run_id, s + 1, stats)
            for event in st.fallback.update(s + 1, stats) if st.fallback is not None else []:
                store.add_event(life.run_id, step=step, kind="fallback",
                                payload={**event, "applies_from_step": step + 1})

    def evaluate(step: int) -> dict[str, float]:
        if st.pipeline is None:  # every rank (tensor parallelism: the forward's collectives take all of them)
            return _evaluate(task, unwrap(st.model))
        from ._pp_runner import pp_evaluate  # the whole trained model on every rank; rank 0's TP group evaluates

        return pp_evaluate(st, lambda: _evaluate(task, unwrap(st.model)))

    return life.drive(step_fn, evaluate=evaluate,
                      save=lambda step: save_state(r, life.run_id, st, store), before_log=before_log,
                      after_log=lambda step: _share_fallbacks(st))


def _exists(store: RunStore, run_id: str) -> bool:
    """Whether the store holds exactly ``run_id`` (one indexed lookup: an unrelated corrupt run does not matter)."""
    from ._store import StoreError

    try:
        return store.get_run(run_id, verify=False).run_id == run_id
    except StoreError as e:
        if "no run with id" in str(e):
            return False
        raise


def _open_run(life: RunLifecycle, task: Task, st: State, *, resume: str | None, run_id: str | None,
              allow_restart: bool) -> str:
    """Create the run (rank 0), or continue it from its newest usable checkpoint when resuming or when a restarted
    torchrun worker group finds its run already in the store.  Every rank returns the same run id (a refusal on
    rank 0 is raised on every rank)."""
    w, store = st.world, life.store
    if resume is not None:
        opened: Any = None
        if w.is_main:
            try:
                record = store.get_run(resume)
                framework = record.manifest.get("framework", "torch")
                if framework != "torch":
                    raise UsageError(f"run {record.run_id} is a framework = {framework!r} run: it cannot be resumed "
                                     f"as framework = \"torch\"; resume it with lowprec run --resume {record.run_id}")
                check_resumable(record)
                opened = (record.run_id, False)
            except ValueError as e:
                opened = str(e)
        opened = w.broadcast(opened)
        if isinstance(opened, str):
            raise UsageError(opened)
        rid, create = opened
    else:
        # the run exists: a new launch of the workers (lowprec run --resume of a data-parallel run), or an
        # elastic restart (torchrun restarted the worker group), which continues its run or starts it over when
        # it wrote no usable checkpoint yet: that is what max_restarts asks for
        exists = w.is_main and run_id is not None and _exists(store, run_id)
        rid, create = run_id, not exists
        allow_restart = allow_restart or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    rid, create = w.broadcast((rid, create))
    if create and w.is_main:
        manifest = run_manifest(life.r, task, device=st.device.type, world_size=w.size,
                                config_dir=import_dir(life.r.config))
        if st.device.type == "xla":
            from ._xla import record as record_xla

            record_xla(manifest)  # hardware.torch_xla, hardware.xla_device
        rid = life.create(manifest, run_id=rid)
    rid = w.broadcast(rid)
    if not create:
        restore_state(life, rid, st, allow_restart=allow_restart)
    w.barrier()
    return str(rid)


def train(config: RunConfig, *, seed: int, store: RunStore, resume: str | None = None, progress: bool = True,
          world: World | None = None, run_id: str | None = None, allow_restart: bool = False) -> str:
    """Train ``config`` with ``seed`` (or continue run ``resume`` from its last usable checkpoint); returns the run
    id.  Checkpoints go next to ``store``'s file, whatever ``config.store`` says.

    Under torchrun pass the ``world`` from ``init_world``: rank 0 records, every rank trains its batch shard.
    ``run_id`` names the run to create, or to continue when it already exists (elastic restarts).
    ``allow_restart``: when resuming finds no usable checkpoint that the store's records reach, start the run over
    from step 0 (deleting its recorded steps) instead of refusing (see ``_resume``)."""
    if config.framework == "jax":
        from ._jax_runner import jax_train

        return jax_train(config, seed=seed, store=store, resume=resume, progress=progress, run_id=run_id,
                         allow_restart=allow_restart)
    world = world or World()
    if world.distributed and world.strategy != config.parallel.strategy:
        raise UsageError(f"parallel.strategy is {config.parallel.strategy!r} but the process group was set up for "
                         f"{world.strategy!r}: pass init_world(config.parallel.strategy, ...) as world")
    if world.distributed:
        from ._mesh import layout_of

        want = layout_of(config.parallel)
        if (want if want.model_parallel else None) != world.layout:
            raise UsageError(f"parallel describes the layout {want.describe()} but the process group was set up for "
                             f"{world.layout.describe() if world.layout else 'data parallelism'}: pass "
                             "init_world(..., layout=layout_of(config.parallel)) as world")
    try:
        return _train_torch(config, seed=seed, store=store, resume=resume, progress=progress, world=world,
                            run_id=run_id, allow_restart=allow_restart)
    finally:
        if world.distributed:
            # The wrapped model (FSDP2's and DDP's state included) sits in reference cycles, which only the
            # cyclic collector frees: left to it, it can outlive destroy_process_group and be freed while the
            # interpreter shuts down, when a C++ thread that has to take the GIL to drop a Python reference is
            # ended with pthread_exit, which aborts the rank with "terminate called without an active exception"
            # (the likely cause of such an abort in one CI run).  Free it now, while both are alive.
            gc.collect()


def _device(config: RunConfig, world: World) -> torch.device:
    """The device this process trains on: torch_xla's for ``device = "xla"`` (``_xla``), else ``world_device``."""
    if config.device == "xla":
        from ._xla import device

        return device()
    return world_device(config.device, world)


def _train_torch(config: RunConfig, *, seed: int, store: RunStore, resume: str | None, progress: bool,
                 world: World, run_id: str | None, allow_restart: bool) -> str:
    """``train`` for ``framework = "torch"``, once ``world`` is checked against the config."""
    device = _device(config, world)  # a missing GPU, or torch_xla, is refused before any work
    if config.threads:
        torch.set_num_threads(config.threads)
    task = build_task(config, seed)
    r = resolve_for_task(config, task, seed)
    recipe = r.config.recipe
    if world.layout is not None:
        from ._mesh import check_supported

        check_supported(r.config)
    wrapped = wrap_model(convert(task.model, recipe).to(device), recipe, world)
    pipeline = None
    if world.pp > 1:
        from ._pp_runner import build_pipeline

        pipeline = build_pipeline(task, wrapped, world, recipe)
    st = State(model=wrapped.model, optimizer=make_optimizer(r, wrapped.model, pipeline=pipeline), world=world,
               wrapped=wrapped, device=device, pipeline=pipeline)
    if recipe.fallback is not None:
        _check_fallback(r.config, world)
        from ..numerics import FallbackController

        st.fallback = FallbackController(unwrap(st.model), recipe.fallback, seed=recipe.seed)
    life = RunLifecycle(r, store, progress=progress, is_main=world.is_main, rank=world.rank)
    check_rollback(r.config.reliability, r.checkpoint_interval)
    st.guard = Guard(r, st)
    rid = _open_run(life, task, st, resume=resume, run_id=run_id, allow_restart=allow_restart)
    st.guard.load(life, st)
    st.sample_every = r.stats_every
    if r.stats_every and world.is_main:
        from ..numerics import StatsObserver

        st.observer = StatsObserver(unwrap(st.model), every=r.stats_every, what_if=r.config.stats.what_if)
    try:
        with life.running(rid, st.step):
            diverged = _loop(task, st, life)
    finally:
        if st.observer is not None:
            st.observer.close()
        st.guard.close()
    world.barrier()
    life.finish(diverged=diverged)
    return rid


def run_config(config: RunConfig, *, store: RunStore, progress: bool = True) -> list[str]:
    """Train every seed of ``config`` in turn (on torchrun workers for a data-parallel layout); returns the run
    ids."""
    if config.framework == "torch" and config.device == "xla":
        from . import _xla

        _xla.check()  # torch_xla not installed: refused before the first seed
    elif config.framework == "torch":
        resolve_device(config.device)  # "cuda" without a GPU: refused before the first seed
    if config.parallel.strategy == "single":
        return [train(config, seed=s, store=store, progress=progress) for s in config.seeds]
    if config.recipe.fallback is not None:
        _check_fallback(config)
    from ._launch import launch
    from ._mesh import check_model_layout

    ids = []
    for s in config.seeds:
        task = build_task(config, s)
        resolved = resolve_for_task(config, task, s)
        check_model_layout(resolved.config, task, task.samples_per_step)  # TP/PP rules, before any process
        ids.append(launch(resolved.config, seed=s, batch_size=task.samples_per_step, store=store,
                          quiet=not progress))
    return ids


def resume_run(run_id: str, *, store: RunStore, progress: bool = True, world_size: int | None = None,
               allow_restart: bool = False, parallel: ParallelConfig | None = None) -> str:
    """Continue a stored run from its newest usable checkpoint, with the config it was started with (optionally
    on another number of data-parallel processes: checkpoints hold the full state, so 2 -> 1 and 1 -> 2 work;
    ``world_size`` makes the layout pure data parallelism, dropping a stored run's ``tp`` / ``pp``), or in another
    ``parallel`` layout (e.g. a TP=2 run continued on one process and back: tensor- and pipeline-parallel runs
    write full-state checkpoints, which any layout loads).

    The run's checkpoints are those next to ``store``'s file: the config's saved ``store`` path (relative to the
    working directory it was started from) is not used.  A completed run, or one still running on this host, is
    refused; ``allow_restart`` as in ``train``."""
    record = store.get_run(run_id)
    check_resumable(record)
    stored = {**record.config, "store": store.location, "config_dir": record.manifest.get("config_dir")}
    config = RunConfig.from_dict(stored, where=f"run {record.run_id}'s stored config")
    if world_size is not None and parallel is not None:
        raise UsageError("give either world_size or parallel, not both")
    if world_size is not None:
        from ._config import _MESH_FIELDS

        layout = {"strategy": "single" if world_size == 1 else "ddp", "world_size": world_size}
        kept = {k: v for k, v in config.to_dict()["parallel"].items() if k not in (*_MESH_FIELDS, "mesh_shape")}
        config = RunConfig.from_dict({**config.to_dict(), "parallel": {**kept, **layout},
                                      "config_dir": config.config_dir}, where="--world-size")
    if parallel is not None:
        config = dataclasses.replace(config, parallel=parallel)
    seed = int(record.manifest["seed"])
    if config.parallel.strategy != "single":
        from ._launch import launch
        from ._mesh import check_model_layout

        task = build_task(config, seed)
        check_model_layout(config, task, int(config.batch_size or task.samples_per_step))

        stored_run = resolve(config, seed=seed, defaults={})  # a stored config is resolved: nothing to fill in
        return launch(config, seed=seed, batch_size=stored_run.batch_size, store=store,
                      resume=record.run_id, quiet=not progress, allow_restart=allow_restart)
    return train(config, seed=seed, store=store, resume=record.run_id, progress=progress,
                 allow_restart=allow_restart)
