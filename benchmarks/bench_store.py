"""Run-store write throughput, SQLite against PostgreSQL, measured in the same run (docs/runs.md), as one JSON object.

    PYTHONPATH=src python benchmarks/bench_store.py [--postgres URL] [--steps N] [--writers W]

``log_scalars``: one process logs ``--steps`` steps of 4 scalars (one transaction each, as the runner does at every
step) into one run.  ``writers``: W processes at once, each logging the same steps into its own run and into one
run they share, every row then counted and ``check()``ed.  PostgreSQL is ``--postgres`` (a database that may be
written), else a throwaway server started from the local PostgreSQL binaries (``tests/_postgres.py``, Unix socket,
``fsync=off``: the numbers then measure lowprec and the round trips, not a disk).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lowprec.runs import RunStore

KEYS = ("train/loss", "train/lr", "train/grad_norm", "eval/loss")


def _log(location: str, rid: str, steps: int, offset: int = 0) -> None:
    with RunStore(location) as s:
        for step in range(steps):
            s.log_scalars(rid, step, {k: offset + step + i / 8 for i, k in enumerate(KEYS)})


def _writer(location: str, own: str, shared: str, steps: int, worker: int, barrier: Any) -> None:
    with RunStore(location) as s:
        barrier.wait()
        for step in range(steps):
            s.log_scalars(own, step, {k: step + i / 8 for i, k in enumerate(KEYS)})
            s.log_scalars(shared, step, {f"w{worker}": float(step)})


def measure(location: str, steps: int, writers: int) -> dict[str, Any]:
    with RunStore(location) as s:
        rid = s.create_run(name="bench", config={}, manifest={})
        t0 = time.perf_counter()
        _log(location, rid, steps)
        single = time.perf_counter() - t0
        own = [s.create_run(name=f"w{w}", config={}, manifest={}) for w in range(writers)]
        shared = s.create_run(name="shared", config={}, manifest={})
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(writers + 1)
    procs = [ctx.Process(target=_writer, args=(location, own[w], shared, steps, w, barrier)) for w in range(writers)]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    for p in procs:
        p.join()
    both = time.perf_counter() - t0
    with RunStore(location) as s:
        rows = sum(len(v[0]) for r in (*own, shared) for v in s.scalars(r).values())
        ok = s.check().ok
    return {"log_scalars_steps_per_s": round(steps / single), "log_scalars_ms_per_step": round(1e3 * single / steps, 3),
            "writers": writers, "writer_transactions_per_s": round(2 * writers * steps / both),
            "rows_expected": writers * steps * (len(KEYS) + 1), "rows_found": rows, "check_ok": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--postgres", help="postgresql:// URL of a database to write (default: a throwaway server)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--writers", type=int, default=4)
    args = p.parse_args()
    url = args.postgres
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import _postgres

        server = _postgres.postgres_url()
        if server is None:
            raise SystemExit("no PostgreSQL: pass --postgres URL or apt-get install postgresql")
        url = _postgres.fresh_database(server)
    with tempfile.TemporaryDirectory() as d:
        out = {"sqlite": measure(str(Path(d) / "runs.db"), args.steps, args.writers),
               "postgresql": measure(url, args.steps, args.writers)}
    out["postgresql_vs_sqlite_log_scalars"] = round(out["postgresql"]["log_scalars_steps_per_s"]
                                                    / out["sqlite"]["log_scalars_steps_per_s"], 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
