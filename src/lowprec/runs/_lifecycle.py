"""One run's lifecycle, shared by the PyTorch runner (``_runner``) and the JAX runner (``_jax_runner``).

Both runners train the same experiment the same way; only the step itself (and how state is saved and loaded)
is framework code.  Everything around it lives here:

1. **resolve**: ``resolve`` turns a ``RunConfig`` and its task's defaults into a ``ResolvedConfig`` once, where
   every field is concrete (no ``None``: no ``config.steps or 0`` fallbacks in the loops).  The store records
   ``ResolvedConfig.config.to_dict()``, the ``RunConfig`` with those values filled in.
2. **create or resume**: ``RunLifecycle.create`` records a new run (name ``"<label> seed <seed>"``, group, the
   manifest from ``run_manifest``); ``RunLifecycle.resumed`` reopens a stored one from the step its checkpoint
   holds, with a "resumed" event (``warn_resume`` prints what was skipped).  Which checkpoint that is follows the
   rules of ``_resume``; loading it is the runner's.
3. **cadence**: ``ResolvedConfig.evaluates(step)`` and ``ResolvedConfig.checkpoints(step)`` say which completed
   steps (1-based) evaluate and save.  Evaluation: every ``eval_interval`` steps, the last step, and a diverged
   step.  Checkpoints: every ``checkpoint_interval`` steps before the last (0: none), then always at the end of
   the run and at a diverged step.
4. **record**: ``RunLifecycle.drive`` runs the loop from a start step to ``steps``: per step the framework's
   ``step_fn`` (its scalars), the evaluation when due, the scalars logged (rank 0), the progress bar, and at a
   non-finite loss or gradient norm the "nonfinite" (when localised) and "diverged" events.
5. **finish or fail**: inside ``RunLifecycle.running`` an exception, ``KeyboardInterrupt`` and the CLI's
   ``Terminated`` included, marks the run "failed" with the reason (``failure_reason``; another rank than 0 records
   a "rank_failure" event instead) and is re-raised, so the CLI attaches its ``lowprec_resume`` hint;
   ``RunLifecycle.finish`` ends it "completed" or "diverged" (and prints where a diverged run failed).

Nothing here imports jax: ``import lowprec.runs._runner`` stays free of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from ._config import RunConfig
from ._manifest import build_manifest
from ._progress import Progress
from ._resume import RECORDS_KEY
from ._store import RunStore
from .zoo import Task, get_task

FALLBACK_EVERY = 50
"""Sampling interval of the statistics a recipe's ``fallback`` policy reads when ``[stats] every`` is unset (the
observer's cost at 50 is a few % of step time; see docs/numerics.md)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """One seed of a ``RunConfig`` with every value the loop reads made concrete (``resolve``)."""

    config: RunConfig
    """The ``RunConfig`` of this seed with the task's defaults filled in (``RunConfig.resolve``): what the store
    and checkpoints record (``config.to_dict()``)."""
    seed: int
    steps: int
    """Optimizer steps of the whole run."""
    batch_size: int
    """Rows of every training batch (the task's ``samples_per_step`` when the config leaves it out)."""
    eval_interval: int
    """Evaluate every this many steps (and at the last step)."""
    optimizer: str
    """"adamw" or "sgd"."""
    lr: float
    """Peak learning rate (``lr_at`` gives each step's)."""
    warmup_steps: int
    grad_clip: float
    """Clip the global gradient norm to this value; 0.0: no clipping."""
    checkpoint_interval: int
    """Save every this many steps before the last; 0: only at the end."""
    checkpoint_keep: int
    stats_every: int
    """Sample tensor statistics every this many steps (``[stats] every``, or ``FALLBACK_EVERY`` for a recipe with a
    ``fallback`` policy); 0: off."""
    threads: int
    """torch intra-op threads; 0: leave torch's default."""
    label: str
    """``RunConfig.label``."""
    name: str
    """The run's name in the store: ``"<label> seed <seed>"``."""
    group: str
    """The run's group in the store: ``RunConfig.group``, else the label."""

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        return self.config.schedule.lr_at(step, lr=self.lr, steps=self.steps)

    def evaluates(self, step: int, *, diverged: bool = False) -> bool:
        """Whether completed step ``step`` (1-based) evaluates: every ``eval_interval``, the last, a diverged one."""
        return step % self.eval_interval == 0 or step == self.steps or diverged

    def checkpoints(self, step: int) -> bool:
        """Whether completed step ``step`` (1-based) saves a checkpoint on the interval (the end of the run and a
        diverged step always save, see ``RunLifecycle.drive``)."""
        return bool(self.checkpoint_interval) and step % self.checkpoint_interval == 0 and step < self.steps


def resolve(config: RunConfig, *, seed: int, defaults: dict[str, Any]) -> ResolvedConfig:
    """``config`` for ``seed`` with every ``None`` field taken from ``defaults`` (a task's ``Task.defaults`` plus
    its ``batch_size``; ``{}`` for a stored config, which is resolved already)."""
    c = config.for_seed(seed).resolve(defaults)
    assert c.steps is not None and c.batch_size is not None and c.eval_interval is not None  # resolve fills them
    assert c.optimizer.name is not None and c.optimizer.lr is not None and c.schedule.warmup_steps is not None
    every = c.stats.every or (FALLBACK_EVERY if c.recipe.fallback is not None else 0)
    return ResolvedConfig(
        config=c, seed=seed, steps=c.steps, batch_size=c.batch_size, eval_interval=c.eval_interval,
        optimizer=c.optimizer.name, lr=c.optimizer.lr, warmup_steps=c.schedule.warmup_steps,
        grad_clip=c.optimizer.grad_clip or 0.0, checkpoint_interval=c.checkpoint.interval,
        checkpoint_keep=c.checkpoint.keep, stats_every=every, threads=c.threads or 0, label=c.label,
        name=f"{c.label} seed {seed}", group=c.group or c.label)


def resolve_for_task(config: RunConfig, task: Task, seed: int) -> ResolvedConfig:
    """``resolve`` against ``task``'s defaults (its ``samples_per_step`` as the default ``batch_size``)."""
    return resolve(config, seed=seed, defaults={**task.defaults, "batch_size": task.samples_per_step})


def import_dir(config: RunConfig) -> str | None:
    """The folder a ``"module:function"`` model is also looked for in: the config file's (``config_dir``), or in a
    torchrun worker the one its launcher passed (``_launch.CONFIG_DIR_ENV``)."""
    from ._launch import CONFIG_DIR_ENV

    return config.config_dir or os.environ.get(CONFIG_DIR_ENV) or None


def build_task(config: RunConfig, seed: int) -> Task:
    """The config's task for ``seed`` (a zoo name, or an entry point ``package.module:function``, looked for on
    ``sys.path`` and in the config's folder)."""
    return get_task(config.model, seed=seed, batch_size=config.batch_size, import_dir=import_dir(config),
                    **config.model_options)


def run_manifest(r: ResolvedConfig, task: Task, *, device: str, world_size: int, config_dir: str | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``build_manifest`` of the run, then ``extra`` (e.g. a JAX run's ``framework``), ``world_size`` and the
    ``_resume.RECORDS_KEY`` flag (this lowprec records every checkpoint it writes).  ``config_dir`` (default: the
    run's ``import_dir``) is recorded for both runners, so a resumed run finds a ``"module:function"`` task again."""
    if config_dir is None:
        config_dir = import_dir(r.config)
    m = build_manifest(seed=r.seed, recipe_hash=r.config.recipe.hash(), data_hash=task.data_hash,
                       data_source=task.data_source, metrics=task.metrics, device=device, config_dir=config_dir)
    m.update(extra or {})
    m["world_size"] = world_size
    m[RECORDS_KEY] = True
    return m


def failure_reason(e: BaseException) -> str:
    """The error a failed run records: ``"interrupted (KeyboardInterrupt)"`` for Ctrl-C, else ``"Type: message"``
    (``"Terminated: interrupted by SIGTERM"`` for the CLI's ``Terminated``)."""
    return "interrupted (KeyboardInterrupt)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"


def warn_resume(run_id: str, problems: list[str], discarded: int) -> None:
    """Print the checkpoints a resume skipped, and the recorded steps a restart from step 0 deletes."""
    for p in problems:
        print(f"lowprec: warning: skipping {p}")
    if discarded:
        print(f"lowprec: warning: run {run_id} starts over from step 0; its {discarded} recorded steps are deleted")


def diverged_line(store: RunStore, run_id: str) -> str:
    """What ``lowprec run`` prints at the end of a diverged run: the step, the non-finite values and, from the
    run's "nonfinite" event, where the first non-finite value came from (module, tensor role, step)."""
    from ..numerics._localize import describe_payload

    events = store.events(run_id)
    div = next((e for e in events if e["kind"] == "diverged"), None)
    where = next((e for e in events if e["kind"] == "nonfinite"), None)
    head = f"run {run_id} diverged" + ("" if div is None else
                                       f" at step {div['step']} (loss {div['payload'].get('loss')}, grad norm "
                                       f"{div['payload'].get('grad_norm')})")
    if where is None:
        return head + ": no localisation recorded (JAX runs, and a non-finite value outside the replayed step)"
    try:
        return head + ": first non-finite value in " + describe_payload(where["payload"])
    except (KeyError, TypeError, ValueError) as e:
        return head + f": its localisation event is unreadable ({type(e).__name__}: {e})"


StepFn = Callable[[int], "tuple[dict[str, float], dict[str, Any] | None, bool] | None"]
"""``step_fn(step)``: train 0-based step ``step`` (learning rate ``ResolvedConfig.lr_at(step)``); returns (its
scalars, the "nonfinite" event payload or None, whether it diverged), or None when it rolled the run back to a
checkpoint (``RunLifecycle.step`` is then the checkpoint's).  Setting ``RunLifecycle.stop_reason`` ends the run
after this step, "failed" with that reason."""


class RunLifecycle:
    """The store side of one run: created or resumed, the loop's records, finished or failed.

    ``is_main``: this process records (rank 0 of a data-parallel run; the only process otherwise); another rank
    only records its own failure (``rank``)."""

    def __init__(self, r: ResolvedConfig, store: RunStore, *, progress: bool = True, is_main: bool = True,
                 rank: int = 0) -> None:
        self.r, self.store, self.progress, self.is_main, self.rank = r, store, progress, is_main, rank
        self.run_id = ""
        self.step = 0
        """The last completed step (the start step until the loop runs)."""
        self.bar = Progress(r.name, r.steps, enabled=False)
        self.stop_reason: str | None = None
        """Set by the step function to end the run after the current step (a reliability policy's "stop")."""

    def create(self, manifest: dict[str, Any], *, run_id: str | None = None) -> str:
        """Record a new run (rank 0) and return its id (``run_id``, else a new one)."""
        self.run_id = self.store.create_run(name=self.r.name, config=self.r.config.to_dict(), manifest=manifest,
                                            group=self.r.group, run_id=run_id)
        return self.run_id

    def resumed(self, run_id: str, step: int, **payload: Any) -> None:
        """Run ``run_id`` continues after ``step`` (rank 0): reopen it from there (the records after it go) and
        record a "resumed" event with ``from_step`` and ``payload``."""
        self.run_id, self.step = run_id, step
        self.store.reopen_run(run_id, from_step=step)
        self.store.add_event(run_id, step=step, kind="resumed", payload={"from_step": step, **payload})

    @contextlib.contextmanager
    def running(self, run_id: str, start: int) -> Iterator[Progress]:
        """The training loop of ``run_id`` from step ``start``, with its progress bar; an exception (Ctrl-C and
        ``Terminated`` included) marks the run failed (rank 0; another rank records a "rank_failure" event) and
        propagates."""
        self.run_id, self.step = run_id, start
        self.bar = Progress(self.r.name, self.r.steps, start=start, enabled=self.progress and self.is_main)
        try:
            yield self.bar
        except BaseException as e:
            reason = failure_reason(e)
            if self.is_main:
                self.store.finish_run(run_id, status="failed", error=reason)
            else:
                self.store.add_event(run_id, step=self.step, kind="rank_failure",
                                     payload={"rank": self.rank, "error": reason})
            raise
        finally:
            self.bar.close()

    def drive(self, step_fn: StepFn, *, evaluate: Callable[[int], dict[str, float]], save: Callable[[int], None],
              before_log: Callable[[int, dict[str, float]], None] | None = None,
              after_log: Callable[[int], None] | None = None) -> bool:
        """Train from ``self.step`` to ``steps`` (inside ``running``): ``step_fn``, ``evaluate(step)`` (its
        ``eval/<metric>`` scalars) when ``evaluates``, ``before_log(step, values)`` and the log (rank 0),
        ``after_log(step)`` (every rank), then ``save(step)`` at a diverged step, on the checkpoint interval and at
        the end.  True when the run diverged."""
        r, store = self.r, self.store
        while self.step < r.steps:
            done = step_fn(self.step)
            if done is None:  # rolled back: self.step is the checkpoint's
                self.bar.update(self.step)
                continue
            values, bad, diverged = done
            self.step += 1
            step = self.step
            if r.evaluates(step, diverged=diverged):
                values.update(evaluate(step))
            if self.is_main:
                if before_log is not None:
                    before_log(step, values)
                store.log_scalars(self.run_id, step, values)
                self.bar.update(step, loss=values["train/loss"])
            if after_log is not None:
                after_log(step)
            if diverged:
                if self.is_main and bad:
                    store.add_event(self.run_id, step=step, kind="nonfinite", payload=bad)
                if self.is_main:
                    store.add_event(self.run_id, step=step, kind="diverged",
                                    payload={"loss": repr(values["train/loss"]),
                                             "grad_norm": repr(values["train/grad_norm"])})
                save(step)
                return True
            if self.stop_reason is not None:  # no checkpoint of a step a policy stopped: resume redoes it
                return False
            if r.checkpoints(step):
                save(step)
        save(self.step)
        return False

    def finish(self, *, diverged: bool) -> None:
        """End the run (rank 0): "diverged" or "completed"; a diverged run prints where it failed."""
        if not self.is_main:
            return
        if self.stop_reason is not None:
            from ._launch import STOPPED

            self.store.finish_run(self.run_id, status="failed", error=f"{STOPPED}{self.stop_reason}")
            if self.progress:
                print(f"run {self.run_id} stopped: {self.stop_reason}", flush=True)
            return
        self.store.finish_run(self.run_id, status="diverged" if diverged else "completed")
        if diverged and self.progress:
            print(diverged_line(self.store, self.run_id), flush=True)
