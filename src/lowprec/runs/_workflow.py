"""The accuracy workflow as library calls: build a baseline from seed runs, select candidate runs, judge them.

These are what ``lowprec baseline``, ``lowprec compare`` and ``lowprec report`` call; Python users call them the
same way.  Candidates are judged per group (one group = one experiment arm: one recipe over several seeds), so
``compare`` over several groups gives one verdict per arm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from ._baseline import Baseline, RunData, build_baseline
from ._config import RunConfig
from ._judge import Verdict, judge
from ._runner import run_config
from ._stats import Criteria
from ._store import RunStore


def baseline_group(name: str) -> str:
    """The run-store group that holds the seed runs of baseline ``name``."""
    return f"baseline/{name}"


def run_baseline(config: RunConfig, *, name: str, store: RunStore, seeds: int | Sequence[int] | None = None,
                 criteria: Criteria | None = None, overwrite: bool = False, progress: bool = True) -> Baseline:
    """Train ``config`` once per seed (``seeds``: a count N for seeds 0..N-1, a list, or None for the config's)
    and store the baseline ``name`` built from those runs.  The criteria are fixed now, before any candidate."""
    if isinstance(seeds, int):
        if seeds < 2:
            raise ValueError(f"--seeds must be >= 2 (a baseline measures seed-to-seed noise); got {seeds}")
        seeds = tuple(range(seeds))
    chosen = tuple(seeds) if seeds is not None else config.seeds
    if name in store.list_baselines() and not overwrite:
        raise ValueError(f"baseline {name!r} already exists in {store.path}; pass --overwrite to replace it")
    cfg = dataclasses.replace(config, seeds=chosen, group=baseline_group(name),
                              name=config.name or f"baseline {name}")
    ids = run_config(cfg, store=store, progress=progress)
    baseline = build_baseline(name, [RunData.from_store(store, i) for i in ids], criteria=criteria)
    store.save_baseline(name, baseline.to_dict(), overwrite=overwrite)
    return baseline


def load_baseline(store: RunStore, ref: str) -> Baseline:
    """A baseline by name from the store, or from a JSON file when ``ref`` is the path of one."""
    p = Path(ref)
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise ValueError(f"baseline file {ref!r} does not exist")
        return Baseline.load_json(p)
    return Baseline.from_dict(store.get_baseline(ref))


def select_runs(store: RunStore, selectors: Sequence[str]) -> list[RunData]:
    """Runs named by group (every run of the group) or by run id / unique id prefix, without duplicates."""
    if not selectors:
        raise ValueError("name at least one run id or group to judge")
    seen: dict[str, RunData] = {}
    for sel in selectors:
        group = store.list_runs(group=sel)
        ids = [r.run_id for r in reversed(group)] if group else [store.get_run(sel).run_id]
        for rid in ids:
            seen.setdefault(rid, RunData.from_store(store, rid))
    return list(seen.values())


def judge_groups(baseline: Baseline, runs: Sequence[RunData]) -> list[Verdict]:
    """One verdict per group of ``runs`` (in order of first appearance)."""
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group or r.run_id, []).append(r)
    return [judge(baseline, members) for members in groups.values()]
