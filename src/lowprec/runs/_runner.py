"""The runner: train one seed of a ``RunConfig`` and record everything in the run store.

Per step it records ``train/loss``, ``train/grad_norm`` (global L2 norm of the unscaled gradients, before
clipping), ``train/lr``, ``train/step_time_s`` and ``train/samples_per_s``; every ``eval_interval`` steps and at
the last step ``eval/<metric>`` for each of the task's metrics.  Training batches are a pure function of (seed,
step), so a checkpoint needs only the model, the optimizer (with the recipe's loss-scaler, Kahan and step state)
and the RNG state to continue exactly: ``resume`` gives the same curve, bit for bit, as an uninterrupted run.

A non-finite loss stops the run at that step: the value is recorded, with a ``diverged`` event naming the step,
and the run is completed (a diverged run is a result the judge fails, not a crash).  An exception or Ctrl-C marks
the run as failed with the reason, and re-raises.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ..nn import convert
from ..optim import LowPrecisionOptimizer
from ._checkpoint import checkpoint_dir, latest_valid, list_checkpoints, save_checkpoint
from ._config import RunConfig
from ._manifest import build_manifest
from ._progress import Progress
from ._store import RunStore
from .zoo import Task, get_task


def build_task(config: RunConfig, seed: int) -> Task:
    """The config's task for ``seed`` (a zoo name, or an entry point ``package.module:function``)."""
    return get_task(config.model, seed=seed, batch_size=config.batch_size, **config.model_options)


def make_optimizer(config: RunConfig, model: torch.nn.Module) -> LowPrecisionOptimizer:
    """The torch optimizer the config names, wrapped with the recipe's weight/state/loss-scaling policy."""
    o = config.optimizer
    assert o.lr is not None, "resolve() the config first"
    params = [p for p in model.parameters() if p.requires_grad]
    inner: torch.optim.Optimizer
    if o.name == "sgd":
        inner = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    else:
        inner = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return LowPrecisionOptimizer(inner, config.recipe)


def _grad_norm_and_clip(params: list[torch.Tensor], scale: float, clip: float | None) -> float:
    """Global L2 norm of the gradients divided by the loss scale; clip them (still scaled) to ``clip``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) / scale
    if clip and math.isfinite(norm) and norm > clip:
        coef = clip / norm
        for g in grads:
            g.mul_(coef)
    return norm


@dataclasses.dataclass
class _State:
    model: torch.nn.Module
    optimizer: LowPrecisionOptimizer
    step: int = 0


def _checkpoint(config: RunConfig, run_id: str, st: _State) -> None:
    state = {
        "run_id": run_id,
        "step": st.step,
        "model": st.model.state_dict(),
        "optimizer": st.optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "config": config.to_dict(),
    }
    save_checkpoint(checkpoint_dir(config.store, run_id), st.step, state, keep=config.checkpoint.keep)


def _restore(config: RunConfig, run_id: str, st: _State, store: RunStore) -> None:
    directory = checkpoint_dir(config.store, run_id)
    if not list_checkpoints(directory):  # stopped before its first checkpoint: start it again
        store.reopen_run(run_id, from_step=0)
        return
    step, state, problems = latest_valid(directory)
    for p in problems:
        print(f"lowprec: warning: skipping {p}")
    if state.get("run_id") != run_id:
        raise ValueError(f"checkpoint of step {step} belongs to run {state.get('run_id')!r}, not {run_id!r}")
    st.model.load_state_dict(state["model"])
    st.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    st.step = int(state["step"])
    store.reopen_run(run_id, from_step=st.step)


def _evaluate(task: Task, model: torch.nn.Module) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        metrics = task.evaluate(model)
    model.train()
    return {f"eval/{k}": float(v) for k, v in metrics.items()}


def _train_step(task: Task, st: _State, config: RunConfig, lr: float) -> dict[str, float]:
    t0 = time.perf_counter()
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = task.train_batch(st.step)
    loss = task.loss_fn(st.model(inputs), targets)
    st.optimizer.zero_grad()
    st.optimizer.scale_loss(loss).backward()
    params = [p for g in st.optimizer.param_groups for p in g["params"]]
    norm = _grad_norm_and_clip(params, st.optimizer.scaler.scale, config.optimizer.grad_clip)
    st.optimizer.step()
    dt = time.perf_counter() - t0
    return {"train/loss": float(loss.detach()), "train/grad_norm": norm, "train/lr": lr, "train/step_time_s": dt,
            "train/samples_per_s": task.samples_per_step / dt}


def _loop(task: Task, st: _State, config: RunConfig, store: RunStore, run_id: str, progress: Progress) -> None:
    steps, every = config.steps or 0, config.eval_interval or 1
    interval = config.checkpoint.interval
    while st.step < steps:
        values = _train_step(task, st, config, config.schedule.lr_at(st.step, lr=config.optimizer.lr or 0.0,
                                                                     steps=steps))
        st.step += 1
        diverged = not math.isfinite(values["train/loss"])
        if st.step % every == 0 or st.step == steps or diverged:
            values.update(_evaluate(task, st.model))
        store.log_scalars(run_id, st.step, values)
        progress.update(st.step, loss=values["train/loss"])
        if diverged:
            store.add_event(run_id, step=st.step, kind="diverged",
                            payload={"loss": repr(values["train/loss"]), "grad_norm": repr(values["train/grad_norm"])})
            break
        if interval and st.step % interval == 0 and st.step < steps:
            _checkpoint(config, run_id, st)
    _checkpoint(config, run_id, st)


def train(config: RunConfig, *, seed: int, store: RunStore, resume: str | None = None,
          progress: bool = True) -> str:
    """Train ``config`` with ``seed`` (or continue run ``resume`` from its last checkpoint); returns the run id."""
    if config.threads:
        torch.set_num_threads(config.threads)
    task = build_task(config, seed)
    config = config.for_seed(seed).resolve({**task.defaults, "batch_size": task.samples_per_step})
    model = convert(task.model, config.recipe)
    st = _State(model=model, optimizer=make_optimizer(config, model))
    name = f"{config.label} seed {seed}"
    if resume is None:
        manifest = build_manifest(seed=seed, recipe_hash=config.recipe.hash(), data_hash=task.data_hash,
                                  data_source=task.data_source, metrics=task.metrics)
        run_id = store.create_run(name=name, config=config.to_dict(), manifest=manifest,
                                  group=config.group or config.label)
    else:
        run_id = store.get_run(resume).run_id
        _restore(config, run_id, st, store)
    bar = Progress(name, config.steps or 0, start=st.step, enabled=progress)
    try:
        _loop(task, st, config, store, run_id, bar)
    except BaseException as e:
        reason = "interrupted (KeyboardInterrupt)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        store.finish_run(run_id, status="failed", error=reason)
        raise
    finally:
        bar.close()
    store.finish_run(run_id, status="completed")
    return run_id


def run_config(config: RunConfig, *, store: RunStore, progress: bool = True) -> list[str]:
    """Train every seed of ``config`` in turn; returns the run ids."""
    return [train(config, seed=s, store=store, progress=progress) for s in config.seeds]


def resume_run(run_id: str, *, store: RunStore, progress: bool = True) -> str:
    """Continue a stored run from its newest valid checkpoint, with the config it was started with."""
    record = store.get_run(run_id)
    config = RunConfig.from_dict(record.config, where=f"run {record.run_id}'s stored config")
    return train(config, seed=int(record.manifest["seed"]), store=store, resume=record.run_id,
                 progress=progress)

