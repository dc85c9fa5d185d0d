"""Copy runs and baselines between two run stores of either backend (``lowprec store copy SRC DST``).

Each run is read from the source in one snapshot and verified against its checksums (a damaged or unverified
run is refused, never copied), written to the destination in one transaction (the same record, checksum, scalars
and events; events get the destination's ids and checksums over them), then read back from the destination,
verified there, and compared with what was read: a run is either copied exactly or the copy fails naming it.
Baselines are copied with their seed runs.  A run id or baseline name that already exists in the destination is
refused before anything is written, unless ``overwrite`` (replace it) or ``skip_existing`` (leave it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._errors import UsageError
from ._store import RunStore, StoreCorrupt


@dataclass(frozen=True)
class CopyResult:
    runs: tuple[str, ...]  # copied run ids
    baselines: tuple[str, ...]  # copied baseline names
    skipped: tuple[str, ...]  # run ids and baseline names left as they were (skip_existing)
    rows: int  # scalar and event rows copied


def _plan(src: RunStore, run_ids: Sequence[str], baselines: Sequence[str]) -> tuple[list[str], list[str]]:
    """The full run ids and baseline names to copy: everything when neither is named; a baseline brings its
    seed runs."""
    if not run_ids and not baselines:
        return [r.run_id for r in reversed(src.list_runs(verify=False))], src.list_baselines()
    ids = [src.get_run(r, verify=False).run_id for r in run_ids]
    for name in baselines:
        ids += [src.get_run(r, verify=False).run_id for r in src.get_baseline(name).get("run_ids", ())]
    return list(dict.fromkeys(ids)), list(dict.fromkeys(baselines))


def copy_store(src: RunStore, dst: RunStore, *, run_ids: Sequence[str] = (), baselines: Sequence[str] = (),
               overwrite: bool = False, skip_existing: bool = False,
               progress: Callable[[str], None] | None = None) -> CopyResult:
    """Copy ``run_ids`` (ids or unique prefixes) and ``baselines`` (with their seed runs), or everything when
    neither is given, from ``src`` to ``dst`` (see the module docstring)."""
    if overwrite and skip_existing:
        raise UsageError("overwrite and skip_existing exclude each other: choose one")
    if src.location == dst.location:
        raise UsageError(f"source and destination are the same store ({src.where})")
    ids, names = _plan(src, run_ids, baselines)
    have_runs = {r.run_id for r in dst.list_runs(verify=False)}
    have_baselines = set(dst.list_baselines())
    clash = [r for r in ids if r in have_runs] + [f"baseline {n!r}" for n in names if n in have_baselines]
    if clash and not (overwrite or skip_existing):
        shown = ", ".join(clash[:10]) + (f" and {len(clash) - 10} more" if len(clash) > 10 else "")
        raise UsageError(f"{dst.where} already holds {shown}; nothing was copied: pass --overwrite to replace "
                         "them or --skip-existing to leave them as they are")
    say = progress or (lambda line: None)
    copied, skipped, rows = [], [], 0
    for rid in ids:
        if skip_existing and rid in have_runs:
            skipped.append(rid)
            continue
        dump = src.dump_run(rid)
        dst.load_run(dump, replace=overwrite)
        if dst.dump_run(rid) != dump:
            raise StoreCorrupt(f"run {rid} reads back from {dst.where} different from {src.where}: the copy is "
                               "not exact; `lowprec store check` both stores")
        copied.append(rid)
        rows += len(dump.scalars) + len(dump.events)
        say(f"run {rid} ({dump.row[1]}): {len(dump.scalars)} scalars, {len(dump.events)} events")
    done = []
    for name in names:
        if skip_existing and name in have_baselines:
            skipped.append(f"baseline {name!r}")
            continue
        payload = src.get_baseline(name)
        dst.save_baseline(name, payload, overwrite=overwrite)
        if dst.get_baseline(name) != payload:
            raise StoreCorrupt(f"baseline {name!r} reads back from {dst.where} different from {src.where}")
        done.append(name)
        say(f"baseline {name!r}")
    return CopyResult(runs=tuple(copied), baselines=tuple(done), skipped=tuple(skipped), rows=rows)
