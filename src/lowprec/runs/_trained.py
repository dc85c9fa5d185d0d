"""Trained float32 models for precision analysis: calibration runs, loading a stored run's model, training probes.

``lowprec sensitivity`` and ``lowprec autoprecision`` start from a *trained* float32 model: ``calibrate`` trains
the config with the float32 recipe (recorded in the run store in group ``calibration/<model>``) and
``load_trained`` reads any stored run's final checkpoint back as a plain float32 module.  The evaluation batches
(``eval_batches``) are the task's training batches right after that run's last step: a pure function of seed and
step, so the same every time.  ``probe_trainer`` gives ``lowprec.numerics.training_probe`` its ``train_loss``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import UsageError
from ._config import RunConfig


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A trained float32 model with the task it was trained on and the run that recorded it."""

    model: Any
    task: Any
    run_id: str
    steps: int
    seed: int
    config: RunConfig | None = None
    """The run config the model was trained with (for training probes)."""


def calibrate(config: RunConfig, *, store: Any, seed: int, steps: int | None = None,
              progress: bool = False) -> Calibrated:
    """Train ``config`` for ``seed`` with the float32 recipe (``steps`` overrides the config's) and return the
    trained model, unconverted, from the run's final checkpoint."""
    from .. import recipes
    from ._runner import train

    cfg = dataclasses.replace(config, recipe=recipes.get("fp32"), steps=steps or config.steps, seeds=(seed,),
                              group=f"calibration/{config.model}",
                              name=f"{config.model} fp32 calibration")
    run_id = train(cfg, seed=seed, store=store, progress=progress)
    return load_trained(store, run_id)


def load_trained(store: Any, run_id: str) -> Calibrated:
    """The model of a stored run at its final checkpoint, as a plain float32 module (no EmulatedLinear)."""
    import torch

    from ..nn import EmulatedLinear, convert, unconvert
    from ._checkpoint import checkpoint_dir, load_checkpoint
    from ._resume import choose
    from ._runner import build_task

    rec = store.get_run(run_id)
    config = RunConfig.from_dict(rec.config, where=f"run {rec.run_id}'s stored config")
    seed = int(rec.manifest["seed"])
    task = build_task(config, seed)
    point = choose(store, rec, checkpoint_dir(store, rec.run_id), lambda c: load_checkpoint(c.path),
                   allow_restart=True, clean=False)  # resume's rules: only a checkpoint recorded for this run
    if point.candidate is None:
        raise UsageError(f"run {rec.run_id} has no usable checkpoint to load its model from"
                         + (f" ({'; '.join(point.problems)})" if point.problems else ""))
    step, state = point.step, point.loaded
    model = task.model
    try:
        convert(model, config.recipe)
    except ValueError:
        pass  # nothing to convert: the state dict is the plain model's
    model.load_state_dict(state["model"])
    if any(isinstance(m, EmulatedLinear) for m in model.modules()):
        unconvert(model)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.float32)
    return Calibrated(model=model, task=task, run_id=rec.run_id, steps=step, seed=seed, config=config)


def eval_batches(cal: Calibrated, n: int) -> list[Any]:
    """The task's training batches of steps ``cal.steps .. cal.steps + n - 1`` (not yet trained on in order)."""
    return [cal.task.train_batch(cal.steps + i) for i in range(n)]


def final_loss(store: Any, run_id: str) -> float:
    """The last ``eval/loss`` of a stored run (the task's final evaluation loss)."""
    scalars = store.scalars(run_id)
    if "eval/loss" not in scalars:
        raise UsageError(f"run {run_id} recorded no eval/loss: the training probe needs a task with an evaluation")
    return float(scalars["eval/loss"][1][-1])


def probe_trainer(config: RunConfig, *, store: Any, steps: int | None = None,
                  progress: bool = False) -> Any:
    """``train_loss(recipe, seed) -> float`` for ``lowprec.numerics.training_probe``: train ``config`` from
    initialisation with ``recipe`` (None: float32) for ``steps`` (default: the config's) with ``seed``, recorded in
    the store in group ``probe/<model>``, and return the final eval loss."""
    from .. import recipes
    from ._runner import train

    def train_loss(recipe: Any, seed: int) -> float:
        rec = recipe if recipe is not None else recipes.get("fp32")
        cfg = dataclasses.replace(config, recipe=rec, steps=steps or config.steps, seeds=(seed,),
                                  group=f"probe/{config.model}", name=f"{config.model} {rec.name}")
        return final_loss(store, train(cfg, seed=seed, store=store, progress=progress))

    return train_loss
