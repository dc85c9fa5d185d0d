"""The accuracy workflow as library calls: build a baseline from seed runs, select candidate runs, judge them.

These are what ``lowprec baseline``, ``lowprec compare`` and ``lowprec report`` call; Python users call them the
same way.  Candidates are judged per group (one group = one experiment arm: one recipe over several seeds), so
``compare`` over several groups gives one verdict per arm.

Only ``run_baseline`` trains: it imports the runner (and so torch) when called, so ``compare`` and ``plan``, which
only read the store, do not import torch (``report`` still does, through ``lowprec.numerics`` in
``_report.stats_grid``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ._baseline import Baseline, RunData, build_baseline
from ._config import RunConfig
from ._judge import Verdict, judge
from ._stats import Criteria
from ._store import RunRecord, RunStore


def baseline_group(name: str) -> str:
    """The run-store group that holds the seed runs of baseline ``name``."""
    return f"baseline/{name}"


def run_baseline(config: RunConfig, *, name: str, store: RunStore, seeds: int | Sequence[int] | None = None,
                 criteria: Criteria | None = None, overwrite: bool = False, progress: bool = True) -> Baseline:
    """Train ``config`` once per seed (``seeds``: a count N for seeds 0..N-1, a list, or None for the config's)
    and store the baseline ``name`` built from those runs.  The criteria are fixed now, before any candidate."""
    from ._runner import build_task, run_config  # torch: only for training

    if isinstance(seeds, int):
        if seeds < 2:
            raise ValueError(f"--seeds must be >= 2 (a baseline measures seed-to-seed noise); got {seeds}")
        seeds = tuple(range(seeds))
    chosen = tuple(seeds) if seeds is not None else config.seeds
    if len(chosen) < 2:
        raise ValueError(f"a baseline needs at least 2 seeds (it measures seed-to-seed noise); got {list(chosen)}")
    if name in store.list_baselines() and not overwrite:
        raise ValueError(f"baseline {name!r} already exists in {store.path}; pass --overwrite to replace it")
    if criteria is not None:  # before any training: the task says which metrics its runs will record
        check_criteria_metrics(criteria, build_task(config, chosen[0]).metrics, model=config.model)
    cfg = dataclasses.replace(config, seeds=chosen, group=baseline_group(name),
                              name=config.name or f"baseline {name}")
    ids = run_config(cfg, store=store, progress=progress)
    baseline = build_baseline(name, [RunData.from_store(store, i) for i in ids], criteria=criteria)
    store.save_baseline(name, baseline.to_dict(), overwrite=overwrite)
    return baseline


def check_criteria_metrics(criteria: Criteria, metrics: Mapping[str, str], *, model: str) -> None:
    """ValueError naming the field when ``criteria.metrics`` or ``criteria.metric_margins`` name a metric that the
    task (``Task.metrics``: its eval metrics) does not have; called before a baseline's seeds are trained."""
    known = sorted(metrics)
    for field, names in (("metrics", criteria.metrics or ()),
                         ("metric_margins", [m for m, _ in criteria.metric_margins or ()])):
        unknown = [m for m in names if m not in metrics]
        if unknown:
            raise ValueError(f"criteria.{field} names {unknown}, which task {model!r} does not record; its eval "
                             f"metrics are {known} (names without 'eval/'): fix the criteria file")


def load_baseline(store: RunStore, ref: str) -> Baseline:
    """A baseline by name from the store, or from a JSON file when ``ref`` is the path of one."""
    p = Path(ref)
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise ValueError(f"baseline file {ref!r} does not exist")
        return Baseline.load_json(p)
    return Baseline.from_dict(store.get_baseline(ref))


def select_runs(store: RunStore, selectors: Sequence[str], *, latest: bool = False,
                left_out: list[str] | None = None) -> list[RunData]:
    """Runs named by group (every run of the group) or by run id / unique id prefix, without duplicates.

    A group must hold each seed once (the same command run twice gives two runs of one seed: one sample, not
    two).  Otherwise ``ValueError`` names every clashing run with its creation time and status and the two ways
    out: ``lowprec runs delete RUN_ID...``, or ``latest=True`` (``--latest``), which keeps the newest completed
    run of each seed (the newest run when none completed) and appends to ``left_out`` a line per run left out."""
    if not selectors:
        raise ValueError("name at least one run id or group to judge")
    records: dict[str, RunRecord] = {}
    for sel in selectors:
        group = store.list_runs(group=sel)
        for rec in reversed(group) if group else [store.get_run(sel)]:
            records.setdefault(rec.run_id, rec)
    clashes = _seed_clashes(list(records.values()))
    if clashes and not latest:
        raise ValueError(_clash_message(clashes))
    for runs in clashes:
        keep = max(runs, key=lambda r: (r.status == "completed", r.created_at))
        for r in runs:
            if r is not keep:
                del records[r.run_id]
                if left_out is not None:
                    left_out.append(f"--latest: left out run {r.run_id} ({_when(r.created_at)}, {r.status}): "
                                    f"seed {_seed(r)!r} of group {r.group or r.run_id!r} is judged from run "
                                    f"{keep.run_id} ({_when(keep.created_at)}, {keep.status})")
    return [RunData.from_store(store, rid) for rid in records]


def _seed(run: RunRecord | RunData) -> Any:
    return run.manifest.get("seed")


def _when(t: float | None) -> str:
    return "created ?" if t is None else "created " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


_Run = TypeVar("_Run", RunRecord, RunData)


def _seed_clashes(runs: Sequence[_Run]) -> list[list[_Run]]:
    """Runs of one group that share a seed, per (group, seed), in order of first appearance."""
    by_seed: dict[tuple[str, str], list[_Run]] = {}
    for r in runs:
        by_seed.setdefault((r.group or r.run_id, repr(_seed(r))), []).append(r)
    return [rs for rs in by_seed.values() if len(rs) > 1]


def _clash_message(clashes: Sequence[Sequence[RunRecord | RunData]]) -> str:
    parts = []
    for runs in clashes:
        shown = ", ".join(f"{r.run_id} ({_when(r.created_at)}, {r.status})" if
                          isinstance(r, RunRecord) else f"{r.run_id} ({r.status})" for r in runs)
        parts.append(f"group {runs[0].group or runs[0].run_id!r} has {len(runs)} runs of seed {_seed(runs[0])!r}: "
                     f"{shown}")
    return ("; ".join(parts) + "; one seed run twice is one sample, not two: delete the runs you do not want "
            "(lowprec runs delete RUN_ID...) or pass --latest to judge the newest completed run of each seed")


def judge_groups(baseline: Baseline, runs: Sequence[RunData]) -> list[Verdict]:
    """One verdict per group of ``runs`` (in order of first appearance); ``ValueError`` naming the runs when a
    group holds one seed twice (``select_runs(latest=True)`` keeps the newest completed run of each)."""
    clashes = _seed_clashes(list(runs))
    if clashes:
        raise ValueError(_clash_message(clashes))
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group or r.run_id, []).append(r)
    return [judge(baseline, members) for members in groups.values()]
