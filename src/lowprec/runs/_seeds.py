"""Training a baseline: the seeds of one config, run by the runner, then handed to ``lowprec.accuracy``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import UsageError
from ._config import RunConfig
from ._store import RunStore

if TYPE_CHECKING:
    from ..accuracy import Baseline, Criteria


def train_baseline(config: RunConfig, *, name: str, store: RunStore, seeds: int | Sequence[int] | None = None,
                   criteria: Criteria | None = None, overwrite: bool = False, progress: bool = True) -> Baseline:
    """Train ``config`` once per seed (``seeds``: a count N for seeds 0..N-1, a list, or None for the config's)
    into group ``baseline/<name>`` and store the baseline ``name`` built from those runs
    (``lowprec.accuracy.baseline_from_runs``).  The criteria are fixed now, before any candidate; a criterion
    naming a metric the task does not record fails before any seed trains."""
    from ..accuracy._workflow import baseline_from_runs, baseline_group, check_criteria_metrics
    from ._runner import build_task, run_config  # torch: only for training

    if isinstance(seeds, int):
        if seeds < 2:
            raise UsageError(f"--seeds must be >= 2 (a baseline measures seed-to-seed noise); got {seeds}")
        seeds = tuple(range(seeds))
    chosen = tuple(seeds) if seeds is not None else config.seeds
    if len(chosen) < 2:
        raise UsageError(f"a baseline needs at least 2 seeds (it measures seed-to-seed noise); got {list(chosen)}")
    if name in store.list_baselines() and not overwrite:
        raise UsageError(f"baseline {name!r} already exists in {store.where}; pass --overwrite to replace it")
    if criteria is not None:  # before any training: the task says which metrics its runs will record
        check_criteria_metrics(criteria, build_task(config, chosen[0]).metrics, model=config.model)
    cfg = dataclasses.replace(config, seeds=chosen, group=baseline_group(name),
                              name=config.name or f"baseline {name}")
    ids = run_config(cfg, store=store, progress=progress)
    return baseline_from_runs(store, name, ids, criteria=criteria, overwrite=overwrite)
