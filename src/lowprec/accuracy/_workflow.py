"""The accuracy workflow as library calls: build a baseline from seed runs, select candidate runs, judge them.

These are what ``lowprec baseline``, ``lowprec compare`` and ``lowprec report`` call; Python users call them the
same way.  Candidates are judged per group (one group = one experiment arm: one recipe over several seeds), so
``compare`` over several groups gives one verdict per arm.

Nothing here trains (training a baseline's seeds is ``lowprec.runs.train_baseline``, which ends in
``baseline_from_runs``) and nothing imports torch, so the commands that only read the store start fast.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .._errors import UsageError
from ..runs._store import RunRecord, RunStore
from ._baseline import Baseline, RunData, build_baseline
from ._judge import Verdict, judge
from ._stats import Criteria


def baseline_group(name: str) -> str:
    """The run-store group that holds the seed runs of baseline ``name``."""
    return f"baseline/{name}"


def baseline_from_runs(store: RunStore, name: str, selectors: Sequence[str], *, criteria: Criteria | None = None,
                       overwrite: bool = False, latest: bool = False,
                       left_out: list[str] | None = None) -> Baseline:
    """Build baseline ``name`` from runs already in the store (groups or run ids, as ``select_runs`` takes them:
    runs of ``lowprec run``, of ``lowprec.runs.track`` in your own loop, or imported) and save it in the store.
    Nothing trains.  The criteria are fixed now, before any candidate is seen.  ``left_out``: a list that gets one
    line per run ``latest`` dropped (an older run of a seed recorded twice), as ``select_runs`` gives it."""
    if name in store.list_baselines() and not overwrite:
        raise UsageError(f"baseline {name!r} already exists in {store.where}; pass --overwrite to replace it")
    runs = select_runs(store, selectors, latest=latest, left_out=left_out)
    if criteria is not None:
        check_criteria_metrics(criteria, runs[0].manifest.get("metrics") or {}, model=str(runs[0].config.get(
            "model", runs[0].run_id)))
    baseline = build_baseline(name, runs, criteria=criteria)
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
            raise UsageError(f"criteria.{field} names {unknown}, which task {model!r} does not record; its eval "
                             f"metrics are {known} (names without 'eval/'): fix the criteria file")


def load_baseline(store: RunStore, ref: str) -> Baseline:
    """A baseline by name from the store, or from a JSON file when ``ref`` is the path of one."""
    p = Path(ref)
    if p.suffix == ".json" or p.is_file():
        if not p.is_file():
            raise UsageError(f"baseline file {ref!r} does not exist")
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
        raise UsageError("name at least one run id or group to judge")
    records: dict[str, RunRecord] = {}
    for sel in selectors:
        group = store.list_runs(group=sel)
        for rec in reversed(group) if group else [store.get_run(sel)]:
            records.setdefault(rec.run_id, rec)
    clashes = _seed_clashes(list(records.values()))
    if clashes and not latest:
        raise UsageError(_clash_message(clashes))
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
        raise UsageError(_clash_message(clashes))
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group or r.run_id, []).append(r)
    return [judge(baseline, members) for members in groups.values()]
