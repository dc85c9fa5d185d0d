"""``LowprecCallback``: record a PyTorch Lightning ``Trainer.fit`` in lowprec's run store, for the accuracy judge.

::

    import pytorch_lightning as pl
    from lowprec.integrations.lightning import LowprecCallback

    pl.seed_everything(seed)
    trainer = pl.Trainer(max_steps=500, callbacks=[LowprecCallback(store="runs.db", group="fp8")])
    trainer.fit(module, train_loader, val_loader)

then ``lowprec baseline --from-runs fp32 --name fp32`` and ``lowprec compare --baseline fp32 fp8`` as for any run
(docs/own-loop.md).  Each ``trainer.fit()`` call is one run of ``lowprec.runs.track``:

* ``on_fit_start`` opens it: ``config`` holds ``config["model"]`` (the LightningModule's class name),
  ``model_params``, ``steps`` (``trainer.max_steps`` when set, else ``trainer.estimated_stepping_batches``), the
  Trainer settings that shape the numerics (``TRAINER_FIELDS``: ``max_steps``, ``max_epochs``, ``precision``,
  ``accumulate_grad_batches``, ``gradient_clip_val``, ``world_size``, those that are set) and
  ``config["hparams"]``, the module's ``hparams`` (``save_hyperparameters()``) that are JSON-able, less ``seed``
  (which differs between the seeds of one baseline); then the ``config`` you pass on top.  The seed is ``seed``
  when you pass it, else the one ``seed_everything`` set (its ``PL_GLOBAL_SEED`` environment variable); with
  neither, ``fit`` fails with a UsageError (the runs of a group are told apart by their seeds).
* ``on_train_batch_end``: the batch's loss (``training_step``'s returned loss, times ``accumulate_grad_batches``
  which Lightning divides it by; else ``trainer.callback_metrics``' ``train_loss``) -> ``train/loss`` and the
  learning rate of the first optimizer's first param group when it stepped -> ``train/lr``, at
  ``trainer.global_step`` (the optimizer steps so far).  Under gradient accumulation a step's loss is the mean of
  its batches' losses.
* ``on_validation_end`` (not the sanity check): every ``trainer.callback_metrics`` entry named
  ``<prefix><metric>`` for a prefix of ``eval_prefixes`` (default ``val_`` and ``val/``: ``val_loss`` ->
  ``eval/loss``, ``val/acc`` -> ``eval/acc``) whose ``<metric>`` is declared in ``metrics``, at
  ``trainer.global_step``.  The judge reads each metric at the last training step, so there must be a validation
  then: when ``max_steps`` ends training in the middle of an epoch, the callback sets ``trainer.should_stop`` at
  the last step, which makes Lightning validate there (``eval_at_end=True``).
* ``on_fit_end`` marks the run "completed" (with a warning and a "missing_final_eval" event when a declared metric
  has no value at the last step); ``on_exception`` marks it "failed" with the exception's text (a
  ``KeyboardInterrupt`` included).

Only the global-zero process (``trainer.is_global_zero``) writes; the others record nothing.

This module imports ``pytorch_lightning`` (``pip install 'lowprec[lightning]'``); ``import lowprec`` and
``import lowprec.integrations`` do not import it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError as e:  # tests/test_integrations_lightning.py hides the package to check this message
    raise ImportError(f"lowprec.integrations.lightning needs PyTorch Lightning, which is not installed ({e}); "
                      f"install it with: pip install 'lowprec[lightning]'") from e

from .._errors import UsageError
from ..runs._store import RunStore
from ..runs._track import FLUSH_EVERY, FLUSH_SECONDS, TrackedRun
from ._common import TrackingOptions, number

__all__ = ["TRAINER_FIELDS", "LOSS_METRICS", "LowprecCallback"]

TRAINER_FIELDS = ("max_steps", "max_epochs", "precision", "accumulate_grad_batches", "gradient_clip_val",
                  "world_size")
"""The ``Trainer`` attributes recorded in the run's config (those that are set)."""

LOSS_METRICS = ("train_loss_step", "train/loss_step", "train_loss", "train/loss", "loss")
"""``trainer.callback_metrics`` keys read (first found) for a batch whose ``training_step`` returned no loss."""


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


class LowprecCallback(TrackingOptions, pl.Callback):
    """Record each ``trainer.fit()`` as a run of ``lowprec.runs.track`` (see the module docstring).

    ``store``: the run store's path (created when missing) or a ``RunStore``.  ``seed``: default the seed of
    ``seed_everything`` (``PL_GLOBAL_SEED``).  ``group``, ``name``: as for ``track`` (runs of one group are the
    seeds of one arm).  ``config``: extra settings, put over the ones read from the Trainer and module (e.g.
    ``{"recipe": "fp8-tensorwise", "dataset": "digits"}``; ``{"model": "my-mlp"}`` names the model).
    ``metrics``: eval metric (without the prefix) -> "min" | "max"; default ``{"loss": "min"}`` (``val_loss``).
    ``eval_prefixes``: the prefixes stripped from ``callback_metrics`` keys to get the metric name.
    ``data_hash``, ``recipe``, ``flush_every``, ``flush_seconds``: passed to ``track``.  ``eval_at_end``: make
    Lightning validate at the last step when ``max_steps`` ends training mid-epoch.

    ``run_id``: the id of the run being recorded, or of the last one; ``run_ids``: every run recorded."""

    def __init__(self, *, store: str | os.PathLike[str] | RunStore, seed: int | None = None,
                 group: str | None = None, name: str | None = None, config: Mapping[str, Any] | None = None,
                 metrics: Mapping[str, str] | None = None, eval_prefixes: Sequence[str] = ("val_", "val/"),
                 data_hash: str | None = None, recipe: Any = None, eval_at_end: bool = True,
                 flush_every: int = FLUSH_EVERY, flush_seconds: float = FLUSH_SECONDS) -> None:
        if isinstance(eval_prefixes, str) or not all(isinstance(p, str) and p for p in eval_prefixes):
            raise UsageError(f"LowprecCallback: eval_prefixes must be a list of non-empty strings such as "
                             f"['val_', 'val/']; got {eval_prefixes!r}")
        self._set_options(store=store, seed=seed, group=group, name=name, config=config, metrics=metrics,
                          data_hash=data_hash, recipe=recipe, eval_at_end=eval_at_end, flush_every=flush_every,
                          flush_seconds=flush_seconds)
        self.eval_prefixes = tuple(eval_prefixes)
        self._cm: AbstractContextManager[TrackedRun] | None = None
        self._run: TrackedRun | None = None
        self._losses: list[float] = []
        self._lr: float | None = None
        self._stepped = -1

    # -- the run ---------------------------------------------------------------------------------------------

    @property
    def run(self) -> TrackedRun | None:
        """The ``TrackedRun`` being recorded (log your own scalars with it), or None outside ``fit()``."""
        return self._run

    def _close(self, exc: BaseException | None) -> None:
        cm, self._cm, self._run = self._cm, None, None
        if cm is None:
            return
        if exc is None:
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(exc), exc, exc.__traceback__)

    def _seed(self) -> int:
        if self.seed is not None:
            return self.seed
        env = os.environ.get("PL_GLOBAL_SEED")
        try:
            return int(env) if env is not None else -1
        except ValueError:
            return -1

    def _config(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        cfg: dict[str, Any] = {"model": type(pl_module).__name__,
                               "model_params": int(sum(p.numel() for p in pl_module.parameters()))}
        max_steps = trainer.max_steps
        if isinstance(max_steps, int) and max_steps > 0:
            cfg["steps"] = max_steps
        else:
            try:
                estimated = trainer.estimated_stepping_batches
            except Exception:  # no train dataloader length: steps are then the last logged step
                estimated = math.inf
            if isinstance(estimated, int) and estimated > 0:
                cfg["steps"] = estimated
        for field in TRAINER_FIELDS:
            value = getattr(trainer, field, None)
            if field in ("max_steps", "max_epochs") and isinstance(value, int) and value < 0:
                continue
            if isinstance(value, (bool, int, float, str)) and _jsonable(value):
                cfg[field] = value
        hparams = getattr(pl_module, "hparams", None)
        if isinstance(hparams, Mapping):
            kept = {str(k): v for k, v in hparams.items() if k != "seed" and _jsonable(v)}
            if kept:
                cfg["hparams"] = kept
        cfg.update(self.config)
        return cfg

    # -- Callback hooks ---------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the run (global-zero process only)."""
        if self._cm is not None:
            self._close(RuntimeError("a new trainer.fit() began before the previous one reached on_fit_end"))
        self._losses, self._lr, self._stepped = [], None, trainer.global_step
        if not trainer.is_global_zero:
            return
        seed = self._seed()
        if seed < 0:
            raise UsageError("LowprecCallback: the run needs a seed: pass LowprecCallback(seed=...) or call "
                             "seed_everything(seed) before trainer.fit()")
        device = getattr(getattr(trainer.strategy, "root_device", None), "type", None) or "cpu"
        cm = self._track(seed=seed, config=self._config(trainer, pl_module), device=str(device))
        self._run = cm.__enter__()
        self._cm = cm
        self._started(self._run)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Note the learning rate the optimizer steps with (the scheduler may change it before the batch ends)."""
        if self._run is None or (trainer.optimizers and optimizer is not trainer.optimizers[0]):
            return
        groups = getattr(optimizer, "param_groups", None)
        if groups:
            self._lr = number(groups[0].get("lr"))

    def _batch_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> float | None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        value = number(loss) if loss is not None else None
        if value is not None:
            if pl_module.automatic_optimization:  # Lightning divides the returned loss by the accumulation
                value *= trainer.accumulate_grad_batches
            return value
        metrics = trainer.callback_metrics
        for key in LOSS_METRICS:
            if key in metrics:
                return number(metrics[key])
        return None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Record the step's loss and learning rate once the optimizer stepped; ask for the final validation."""
        step = trainer.global_step
        # on every process: a validation is collective under data parallelism
        if (self.eval_at_end and isinstance(trainer.max_steps, int) and 0 < trainer.max_steps <= step
                and trainer.enable_validation):
            trainer.should_stop = True
        run = self._run
        if run is None:
            return
        loss = self._batch_loss(trainer, pl_module, outputs)
        if loss is not None:
            self._losses.append(loss)
        if step == 0 or step <= self._stepped:
            return  # accumulating: the optimizer has not stepped since the last record
        self._stepped = step
        values: dict[str, float] = {}
        if self._losses:
            values["train/loss"] = sum(self._losses) / len(self._losses)
        if self._lr is not None:
            values["train/lr"] = self._lr
        self._losses, self._lr = [], None
        values = self._keep(values, step)
        if values:
            run.log(values, step=step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the declared validation metrics at ``trainer.global_step``."""
        run = self._run
        if run is None or trainer.sanity_checking:
            return
        values: dict[str, float] = {}
        for key, value in trainer.callback_metrics.items():
            for prefix in self.eval_prefixes:
                if isinstance(key, str) and key.startswith(prefix) and key[len(prefix):] in self.metrics:
                    got = number(value)
                    if got is not None:
                        values.setdefault(f"eval/{key[len(prefix):]}", got)
        step = trainer.global_step
        values = self._keep(values, step)
        if values:
            run.log_eval({k[5:]: v for k, v in values.items()}, step=step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Mark the run completed (after a warning when a declared metric has no value at the last step)."""
        run = self._run
        if run is None:
            return
        self._check_final_eval(run, trainer.global_step, f"log them in validation_step as "
                               f"{self.eval_prefixes[0]}<metric> and let a validation run at the last step")
        self._close(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Mark the run failed with ``exception``'s text."""
        self._close(exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A run still open here never reached ``on_fit_end``: mark it failed."""
        if stage == "fit" and self._cm is not None:
            self._close(RuntimeError("trainer.fit() ended without reaching on_fit_end"))
