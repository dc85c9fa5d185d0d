"""Cost of ``lowprec.runs.track`` in a training loop, as JSON.

    PYTHONPATH=src python benchmarks/bench_track.py [--steps 20000] [--flush-every 50] [--tensor]

Measured in one run, on a fresh store in a temporary folder (``synchronous="normal"``, the default):

* ``log_us``: per ``run.log({...}, step=s)`` call with 1 key and with 4 keys, including the amortised flushes
  (one transaction every ``flush_every`` steps): what a loop pays per step.  Python floats, or 0-d CPU tensors
  with ``--tensor`` (``float()`` of a tensor costs about a microsecond more).
* ``log_no_flush_us``: the same calls with flushing pushed out of the measured loop (``flush_every`` larger than
  the steps): the validate-and-buffer part alone.
* ``flush_us``: one flush of ``flush_every`` steps' rows (4 keys each), median over repeats: what a step that
  writes pays once per batch.
* ``ratio_to_10ms_step``: ``log_us`` / 10 000 us, per key count; the target is <= 0.01 (1% of a 10 ms step).
  ``met`` compares the 1-key ratio with it.

Timings on a shared machine are noisy: medians of 5 repeats are reported, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lowprec.runs import RunStore, track
from lowprec.runs._track import build_track_manifest

STEP_US = 10_000.0
TARGET_RATIO = 0.01
REPEATS = 5


def _values(n_keys: int, tensor: bool) -> list[dict[str, Any]]:
    keys = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"][:n_keys]
    if tensor:
        import torch

        return [{k: torch.tensor(1.0 / (i + 1)) for k in keys} for i in range(64)]
    return [{k: 1.0 / (i + 1) for k in keys} for i in range(64)]


def _log_loop(folder: Path, n_keys: int, steps: int, flush_every: int, tensor: bool) -> float:
    """Microseconds per log() call over ``steps`` calls (flushes included when flush_every <= steps)."""
    values = _values(n_keys, tensor)
    store = RunStore(folder / f"log{n_keys}-{flush_every}-{time.monotonic_ns()}.db")
    with track(store=store, seed=0, config={"model": "bench"}, metrics={"loss": "min"}, flush_every=flush_every,
               flush_seconds=3600.0) as run:
        log = run.log
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            log(values[s & 63], step=s)
        elapsed = time.perf_counter() - t0
    store.close()
    return elapsed / steps * 1e6


def _flush_cost(folder: Path, flush_every: int, batches: int = 40) -> float:
    """Median microseconds of one flush of ``flush_every`` steps x 4 keys."""
    values = _values(4, False)
    store = RunStore(folder / f"flush-{time.monotonic_ns()}.db")
    times = []
    with track(store=store, seed=0, config={"model": "bench"}, metrics={"loss": "min"}, flush_every=10**9,
               flush_seconds=3600.0) as run:
        step = 0
        for _ in range(batches):
            for _ in range(flush_every):
                step += 1
                run.log(values[step & 63], step=step)
            t0 = time.perf_counter()
            run.flush()
            times.append(time.perf_counter() - t0)
    store.close()
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--flush-every", type=int, default=50)
    p.add_argument("--tensor", action="store_true", help="log 0-d torch tensors instead of Python floats")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        log_us, bare_us = {}, {}
        for n in (1, 4):
            print(f"[bench_track] log() with {n} key(s) ...", file=sys.stderr, flush=True)
            log_us[n] = statistics.median(_log_loop(folder, n, args.steps, args.flush_every, args.tensor)
                                          for _ in range(REPEATS))
            bare_us[n] = statistics.median(_log_loop(folder, n, args.steps, args.steps + 1, args.tensor)
                                           for _ in range(REPEATS))
        flush_us = _flush_cost(folder, args.flush_every)
    ratios = {f"{n}_keys": log_us[n] / STEP_US for n in log_us}
    manifest = build_track_manifest(seed=0, metrics={"loss": "min"}, data_hash="none", recipe_hash="none",
                                    framework="torch" if args.tensor else "none", device="cpu", world_size=1)
    report = {
        "benchmark": "track",
        "steps": args.steps,
        "flush_every": args.flush_every,
        "values": "0-d torch tensors" if args.tensor else "python floats",
        "log_us": {f"{n}_keys": round(v, 3) for n, v in log_us.items()},
        "log_no_flush_us": {f"{n}_keys": round(v, 3) for n, v in bare_us.items()},
        "flush_us": round(flush_us, 1),
        "flush_rows": args.flush_every * 4,
        "step_us": STEP_US,
        "ratio_to_10ms_step": {k: round(v, 6) for k, v in ratios.items()},
        "target_ratio": TARGET_RATIO,
        "met": ratios["1_keys"] <= TARGET_RATIO,
        "versions": manifest["versions"],
        "cpu": manifest["hardware"]["cpu"],
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
