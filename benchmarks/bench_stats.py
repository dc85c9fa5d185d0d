"""Overhead of per-layer tensor statistics (``lowprec.numerics.StatsObserver``) on training-step time, as JSON.

    PYTHONPATH=src python benchmarks/bench_stats.py [--quick] [--models mlp-digits gpt-bytes]
        [--recipes fp8-tensorwise mxfp8] [--every 50] [--steps 300] [--threads 1]

For each zoo model and recipe, two identical trainings (same seed, same batches: ``Task.train_batch(step)``) run
side by side, one step of each per round in alternating order, so that load from other processes falls on both
alike: ``plain`` (no observer) and ``observed`` (``StatsObserver(model, every=N)``, the default sampling of
``[stats] every`` when a user turns statistics on).  Reported per configuration:

* ``overhead_pct``: (mean observed step / mean plain step - 1) * 100 over all rounds; the sampled steps' cost
  averaged over the ``every`` steps around them, which is what a run pays.  Target: <= 5% at the default sampling.
* ``overhead_pct_from_medians``: the same from medians, robust to load spikes on a shared machine: (median
  unsampled observed step + (median sampled observed step - median unsampled one) / every) / median plain step - 1.
  ``met`` compares this one with the target.
* ``sampled_step_ratio``: median observed sampled step / median plain step of the same rounds (what one sampled
  step costs; it is amortised over ``every`` steps).
* ``losses_equal``: the two runs' losses are bitwise equal (the observer must not change training).

A warm-up of 3 steps per run is excluded.  Timings on a shared 2-core machine are noisy; ``load_average`` is
recorded.  ``--quick``: mlp-digits only, fp8-tensorwise, 150 steps (about 10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

import lowprec
from lowprec.numerics import StatsObserver
from lowprec.optim import LowPrecisionOptimizer
from lowprec.runs._manifest import cpu_model
from lowprec.runs.zoo import get_task

TARGET_PCT = 5.0


class _Trainer:
    def __init__(self, model_name: str, recipe: str, every: int | None) -> None:
        self.task = get_task(model_name, seed=0)
        self.model = lowprec.convert(self.task.model, recipe)
        lr = float(self.task.defaults.get("lr", 1e-3))
        self.opt = LowPrecisionOptimizer(torch.optim.AdamW(self.model.parameters(), lr=lr), recipe)
        self.observer = StatsObserver(self.model, every=every) if every else None
        self.losses: list[float] = []

    def step(self, step: int) -> float:
        t0 = time.perf_counter()
        if self.observer is not None:
            self.observer.step(step)
        inputs, targets = self.task.train_batch(step)
        loss = self.task.loss_fn(self.model(inputs), targets)
        self.opt.zero_grad(set_to_none=True)
        self.opt.scale_loss(loss).backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach()))
        return dt


def measure(model_name: str, recipe: str, every: int, steps: int, warmup: int = 3) -> dict[str, Any]:
    plain, observed = _Trainer(model_name, recipe, None), _Trainer(model_name, recipe, every)
    tp: list[float] = []
    to: list[float] = []
    sampled: list[tuple[float, float]] = []
    for s in range(steps + warmup):
        pair = (plain, observed) if s % 2 == 0 else (observed, plain)
        times = {id(t): t.step(s) for t in pair}
        if s < warmup:
            continue
        tp.append(times[id(plain)])
        to.append(times[id(observed)])
        if s % every == 0:
            sampled.append((times[id(observed)], times[id(plain)]))
    mean_p, mean_o = statistics.fmean(tp), statistics.fmean(to)
    med_p = statistics.median(tp)
    unsampled = [o for i, o in enumerate(to) if (i + warmup) % every]
    med_u = statistics.median(unsampled)
    med_s = statistics.median(o for o, _ in sampled) if sampled else med_u
    robust = ((med_u + (med_s - med_u) / every) / med_p - 1.0) * 100.0
    assert observed.observer is not None
    return {
        "model": model_name, "recipe": recipe, "every": every, "timed_steps": len(tp),
        "plain_step_ms": round(mean_p * 1e3, 3), "observed_step_ms": round(mean_o * 1e3, 3),
        "overhead_pct": round((mean_o / mean_p - 1.0) * 100.0, 2),
        "overhead_pct_from_medians": round(robust, 2),
        "sampled_steps": len(sampled),
        "sampled_step_ratio": (round(statistics.median(o for o, _ in sampled)
                                     / statistics.median(p for _, p in sampled), 2) if sampled else None),
        "records": len(observed.observer.records()),
        "losses_equal": plain.losses == observed.losses,
        "met": robust <= TARGET_PCT,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", nargs="+", default=["mlp-digits", "gpt-bytes"])
    p.add_argument("--recipes", nargs="+", default=["fp8-tensorwise", "mxfp8"])
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.recipes, args.steps = ["mlp-digits"], ["fp8-tensorwise"], 150
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for m in args.models:
        for r in args.recipes:
            print(f"[bench_stats] {m} {r} ...", file=sys.stderr, flush=True)
            results.append(measure(m, r, args.every, args.steps))
    report = {
        "machine": {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
                    "lowprec": lowprec.__version__, "threads": args.threads,
                    "load_average_start": [round(x, 2) for x in load0],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "target": {"max_overhead_pct": TARGET_PCT, "every": args.every},
        "results": results,
        "met": all(r["met"] for r in results),
        "total_wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
