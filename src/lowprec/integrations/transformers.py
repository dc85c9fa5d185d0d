"""``LowprecCallback``: record a Hugging Face ``Trainer`` run in lowprec's run store, for the accuracy judge.

::

    from lowprec.integrations.transformers import LowprecCallback

    args = TrainingArguments(output_dir="out", max_steps=500, logging_steps=1, eval_strategy="steps",
                             eval_steps=100, seed=seed, report_to=[])
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                      compute_metrics=accuracy, callbacks=[LowprecCallback(store="runs.db", group="fp8")])
    trainer.train()

then ``lowprec baseline --from-runs fp32 --name fp32`` and ``lowprec compare --baseline fp32 fp8`` as for any run
(docs/own-loop.md).  Each ``trainer.train()`` call is one run of ``lowprec.runs.track``:

* ``on_train_begin`` opens it: ``config`` holds ``config["model"]`` (the model config's ``_name_or_path``, else its
  ``model_type``), ``model_type``, ``model_params``, ``steps = state.max_steps`` and the ``TrainingArguments``
  fields that shape the training numerics (``TRAINING_ARGS``: learning rate, batch size, accumulation, optimiser,
  schedule, precision flags, logging and eval steps; not ``output_dir``, ``run_name``, ``seed`` or ``data_seed``,
  which may differ between the seeds of one baseline), then the ``config`` you pass on top.  The seed is
  ``args.seed`` unless you pass ``seed``; the device ``args.device``.
* ``on_log``: ``loss`` -> ``train/loss``, ``learning_rate`` -> ``train/lr``, ``grad_norm`` -> ``train/grad_norm``
  at ``state.global_step`` (the values of ``state.log_history``).  The Trainer logs the loss averaged over the
  ``logging_steps`` since its last log: set ``logging_steps=1`` so the judge sees every step (it judges the steps
  logged by every run, and FAILs "completion" with fewer than ``Criteria.min_judged_steps`` = 5 after the warm-up).
* ``on_evaluate``: every ``eval_<name>`` metric whose ``<name>`` is declared in ``metrics`` (``eval_loss`` ->
  ``eval/loss``, ``eval_accuracy`` from your ``compute_metrics`` -> ``eval/accuracy``) at ``state.global_step``;
  other ones (``eval_runtime``, ...) are not recorded.  The judge reads each metric at the last training step, so
  there must be an evaluation then: with ``eval_strategy="steps"`` the callback asks the Trainer for one at the
  final step (``control.should_evaluate``, ``eval_at_end=True``; transformers 5 does so itself) when the step is
  not an eval step anyway (``"epoch"`` evaluates at the end of the last, cut, epoch).  An evaluation after
  ``train()`` returns (``trainer.evaluate()``) is not part of the run.  The run records a metric once per step
  (a second evaluation at one step is left out).
* ``on_train_end`` marks the run "completed" (with a warning and a "missing_final_eval" event when a declared
  metric has no value at the last step).

A run that does not reach ``on_train_end`` is "failed".  The Trainer has no hook for an exception, so:

* the usual script, where an exception in ``trainer.train()`` ends the process: the run is marked failed at exit
  with that exception's text (a finaliser that runs at interpreter exit; a process killed outright is shown
  failed by the store's dead-process rule);
* where the process goes on after the exception (a notebook, a sweep, a test): use the callback as a context
  manager, ``with LowprecCallback(...) as cb: Trainer(..., callbacks=[cb]).train()``, which marks the run failed
  with the exception as it propagates; without it the run is marked failed when the callback is garbage-collected,
  when the next ``train()`` with it begins, or at exit.

Only the main process writes (``state.is_world_process_zero``); the others record nothing.  Resuming
(``train(resume_from_checkpoint=...)``) records a new run that starts at the checkpoint's step.

This module imports ``transformers`` (``pip install 'lowprec[transformers]'``); ``import lowprec`` does not import
it.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from transformers import TrainerCallback

from ..runs._store import RunStore
from ..runs._track import FLUSH_EVERY, FLUSH_SECONDS, TrackedRun
from ._common import TrackingOptions, number

__all__ = ["TRAINING_ARGS", "LOG_KEYS", "LowprecCallback"]

TRAINING_ARGS = (
    "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "lr_scheduler_type", "warmup_steps",
    "warmup_ratio", "label_smoothing_factor", "bf16", "fp16", "tf32", "gradient_checkpointing", "torch_compile",
    "logging_steps", "eval_strategy", "eval_steps",
)
"""The ``TrainingArguments`` fields recorded in the run's config (those a transformers version has)."""

LOG_KEYS = {"loss": "train/loss", "learning_rate": "train/lr", "grad_norm": "train/grad_norm"}
"""Trainer log key -> recorded scalar."""


def _plain(value: Any) -> Any:
    """A JSON-able form of a TrainingArguments value (enums by value), or None to leave it out."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


class _OpenRun:
    """The ``track`` context of a run between ``on_train_begin`` and ``on_train_end`` (kept apart from the
    callback, so that a finaliser can close it without keeping the callback alive)."""

    def __init__(self, cm: AbstractContextManager[TrackedRun]) -> None:
        self.cm: AbstractContextManager[TrackedRun] | None = cm
        self.run: TrackedRun = cm.__enter__()
        self.last_uncaught = getattr(sys, "last_value", None)  # an uncaught exception from before this run

    def close(self, exc: BaseException | None) -> None:
        cm, self.cm = self.cm, None
        if cm is None:
            return
        if exc is None:
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(exc), exc, exc.__traceback__)

    def abandon(self, why: str) -> None:
        """Mark the run failed: it never reached ``on_train_end``."""
        uncaught = getattr(sys, "last_value", None)
        if uncaught is not None and uncaught is not self.last_uncaught:
            why += f"; uncaught {type(uncaught).__name__}: {uncaught}"
        try:
            self.close(RuntimeError(why))
        except Exception as e:  # a finaliser must not raise; the dead-process rule still marks the run failed
            print(f"lowprec: could not mark run {self.run.run_id} failed: {e}", file=sys.stderr)


def _abandoned(open_run: _OpenRun) -> None:
    open_run.abandon("training did not reach on_train_end (trainer.train() raised, or the process ended during "
                     "training)")


class LowprecCallback(TrackingOptions, TrainerCallback):  # type: ignore[misc]
    """Record each ``trainer.train()`` as a run of ``lowprec.runs.track`` (see the module docstring).

    ``store``: the run store's path (created when missing) or a ``RunStore``.  ``seed``: default ``args.seed``.
    ``group``, ``name``: as for ``track`` (runs of one group are the seeds of one arm).  ``config``: extra settings,
    put over the ones read from the Trainer (e.g. ``{"recipe": "fp8-tensorwise", "dataset": "sst2"}``).
    ``metrics``: eval metric (without ``eval_``) -> "min" | "max"; default ``{"loss": "min"}`` (the Trainer reports
    ``eval_loss`` when the eval set has labels), add e.g. ``"accuracy": "max"`` for what ``compute_metrics``
    returns.  ``data_hash``, ``recipe``, ``flush_every``, ``flush_seconds``: passed to ``track``.
    ``eval_at_end``: ask for an evaluation at the last step under a step-wise ``eval_strategy``.

    ``run_id``: the id of the run being recorded, or of the last one; ``run_ids``: every run recorded."""

    def __init__(self, *, store: str | os.PathLike[str] | RunStore, seed: int | None = None,
                 group: str | None = None, name: str | None = None, config: Mapping[str, Any] | None = None,
                 metrics: Mapping[str, str] | None = None, data_hash: str | None = None, recipe: Any = None,
                 eval_at_end: bool = True, flush_every: int = FLUSH_EVERY,
                 flush_seconds: float = FLUSH_SECONDS) -> None:
        self._set_options(store=store, seed=seed, group=group, name=name, config=config, metrics=metrics,
                          data_hash=data_hash, recipe=recipe, eval_at_end=eval_at_end, flush_every=flush_every,
                          flush_seconds=flush_seconds)
        self._open: _OpenRun | None = None
        self._finalizer: weakref.finalize | None = None

    # -- the run ---------------------------------------------------------------------------------------------

    @property
    def run(self) -> TrackedRun | None:
        """The ``TrackedRun`` being recorded (log your own scalars with it), or None outside ``train()``."""
        return None if self._open is None else self._open.run

    def _close(self, exc: BaseException | None = None, *, why: str | None = None) -> None:
        open_run, self._open = self._open, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if open_run is None:
            return
        if why is not None:
            open_run.abandon(why)
        else:
            open_run.close(exc)

    def __enter__(self) -> LowprecCallback:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Mark a run still open failed: with the exception that ends the block, or (none) as not finished."""
        if self._open is not None:
            if exc is not None:
                self._close(exc)
            else:
                self._close(why="the `with LowprecCallback(...)` block ended before on_train_end")

    def _config(self, args: Any, state: Any, model: Any) -> dict[str, Any]:
        mcfg = getattr(model, "config", None)
        model_type = getattr(mcfg, "model_type", None) or type(model).__name__
        cfg: dict[str, Any] = {"model": getattr(mcfg, "_name_or_path", None) or model_type,
                               "model_type": model_type}
        if model is not None and hasattr(model, "parameters"):
            cfg["model_params"] = int(sum(p.numel() for p in model.parameters()))
        if isinstance(state.max_steps, int) and state.max_steps > 0:
            cfg["steps"] = state.max_steps
        for field in TRAINING_ARGS:
            try:
                value = _plain(getattr(args, field))
            except AttributeError:
                continue
            if value is not None:
                cfg[field] = value
        cfg.update(self.config)
        return cfg

    # -- TrainerCallback --------------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._open is not None:
            self._close(why="a new trainer.train() began before the previous one reached on_train_end")
        if not state.is_world_process_zero:
            return
        seed = args.seed if self.seed is None else self.seed
        device = getattr(getattr(args, "device", None), "type", None) or "cpu"
        self._open = _OpenRun(self._track(seed=seed, config=self._config(args, state, model), device=str(device)))
        self._started(self._open.run)
        self._finalizer = weakref.finalize(self, _abandoned, self._open)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        run = self.run
        if run is None or not logs:
            return
        values = {}
        for key, scalar in LOG_KEYS.items():
            value = number(logs.get(key))
            if value is not None:
                values[scalar] = value
        values = self._keep(values, state.global_step)
        if values:
            run.log(values, step=state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> None:
        run = self.run
        if run is None or not metrics:
            return
        values = {}
        for key, value in metrics.items():
            if isinstance(key, str) and key.startswith("eval_") and key[5:] in self.metrics:
                got = number(value)
                if got is not None:
                    values[f"eval/{key[5:]}"] = got
        values = self._keep(values, state.global_step)
        if values:
            run.log_eval({k[5:]: v for k, v in values.items()}, step=state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # on every process: an evaluation is collective under data parallelism
        strategy = _plain(getattr(args, "eval_strategy", "no"))
        if self.eval_at_end and strategy == "steps" and state.max_steps and state.global_step >= state.max_steps:
            control.should_evaluate = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run
        if run is None:
            return
        self._check_final_eval(run, state.global_step, "set eval_strategy='steps' (the callback then asks for a "
                               "final evaluation) and check that compute_metrics returns them")
        self._close(None)
