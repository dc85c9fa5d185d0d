"""Autoprecision against uniform formats, judged by the accuracy judge (figures in docs/precision.md).

1. Calibrate: train the task once in float32 (seed ``--calib-seed``, not one of the judged seeds) and measure the
   sensitivity table of every linear layer under each candidate spec (``lowprec.numerics.sensitivity_table``).
2. Choose: ``choose_precision`` per budget; uniform arms put every layer in one spec (the same recipe shape:
   every operand of all three GEMMs in the spec, stochastic rounding on sub-8-bit gradients).
3. Judge: an fp32 baseline over ``--seeds`` seeds (``run_baseline``), every arm over the same seeds, one verdict
   per arm (``judge_groups``), and the final eval metrics per seed.

Prints JSON.  ``--store`` keeps the runs (default: a fresh temporary directory).

    PYTHONPATH=src python benchmarks/autoprecision_demo.py --task mlp-digits --seeds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowprec._cli_precision import calibrate, eval_batches
from lowprec.numerics._autoprecision import PrecisionPlan, choose_precision, plan_table, storage_bits, uniform_plan
from lowprec.numerics._sensitivity import resolve_candidate, sensitivity_table
from lowprec.runs._baseline import RunData
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import run_config
from lowprec.runs._store import RunStore
from lowprec.runs._workflow import judge_groups, run_baseline

CANDIDATES = ["mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bfloat16"]
WITH_NVFP4 = ["mxfp4", "nvfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bfloat16"]


def _plans(table: list[Any], budgets: list[float]) -> dict[str, PrecisionPlan]:
    """The arms: a chosen mix per budget (nvfp4 joins the candidates below 5 bits) and the uniform formats."""
    plans = {f"auto-{b:g}": choose_precision(table, budget_bits=b, candidates=WITH_NVFP4 if b < 5 else CANDIDATES)
             for b in budgets}
    for spec in ("mxfp4", "nvfp4", "mxfp6_e2m3"):
        plans[f"uniform-{spec}"] = uniform_plan(table, spec)
    plans["mxfp4+fp32-head"] = _heads_in_float32(uniform_plan(table, "mxfp4"), table)
    return plans


def _heads_in_float32(plan: PrecisionPlan, table: list[Any]) -> PrecisionPlan:
    """The named-recipe convention (``*head`` kept in high precision) applied to a uniform plan."""
    assignment = tuple((g, "float32" if g.endswith("head") else s) for g, s in plan.assignment)
    rows = {(r.name, r.spec): r for r in table}
    chosen = [rows[a] for a in assignment]
    bits = sum(storage_bits(resolve_candidate(r.spec)[1], sh) for r in chosen for sh in r.shapes)
    noise = sum(r.noise for r in chosen)
    avg = bits / sum(r.params for r in chosen)
    return dataclasses.replace(plan, assignment=assignment, average_bits=avg, budget_bits=avg,
                               predicted_sqnr_db=math.inf if noise == 0 else -10 * math.log10(noise))


def _finite(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)


def _arm(store: RunStore, config: RunConfig, name: str, plan: PrecisionPlan, table: list[Any],
         seeds: tuple[int, ...], progress: bool) -> tuple[dict[str, Any], list[RunData]]:
    cfg = dataclasses.replace(config, recipe=plan.to_recipe(name=name), seeds=seeds, group=name, name=name)
    t0 = time.perf_counter()
    runs = [RunData.from_store(store, rid) for rid in run_config(cfg, store=store, progress=progress)]
    finals: dict[str, list[float]] = {}
    for r in runs:
        sc = store.scalars(r.run_id)
        for key, (_, values) in sc.items():
            if key.startswith("eval/"):
                finals.setdefault(key[5:], []).append(float(values[-1]))
    return {
        "arm": name, "average_bits": plan.average_bits, "predicted_sqnr_db": _finite(plan.predicted_sqnr_db),
        "assignment": dict(plan.assignment),
        "layers": [{**row, "sqnr_db": _finite(row["sqnr_db"])} for row in plan_table(plan, table)],
        "final": {k: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)), "per_seed": v}
                  for k, v in finals.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }, runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="mlp-digits")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 for the baseline and every arm")
    ap.add_argument("--calib-seed", type=int, default=100)
    ap.add_argument("--budgets", type=float, nargs="+", default=[4.6, 5.0, 6.0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--steps", type=int, help="training steps (default: the task's)")
    ap.add_argument("--store", help="run store path (default: a temporary directory)")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store_path = args.store or str(Path(tempfile.mkdtemp(prefix="autoprecision-")) / "runs.db")
    config = RunConfig(model=args.task, threads=1, store=store_path, steps=args.steps)
    seeds = tuple(range(args.seeds))
    with RunStore(store_path) as store:
        cal = calibrate(config, store=store, seed=args.calib_seed, progress=args.progress)
        table = sensitivity_table(cal.model, eval_batches(cal, args.batches), cal.task.loss_fn,
                                  [*WITH_NVFP4, "float32"])
        baseline = run_baseline(config, name="fp32", store=store, seeds=seeds, progress=args.progress)
        arms, runs = [], []
        for name, plan in _plans(table, args.budgets).items():
            arm, arm_runs = _arm(store, config, name, plan, table, seeds, args.progress)
            arms.append(arm)
            runs += arm_runs
        for arm, verdict in zip(arms, judge_groups(baseline, runs), strict=True):
            arm["verdict"] = {"passed": verdict.passed,
                              "failed": {r.name: r.reason for r in verdict.results if not r.passed}}
    out = {
        "task": args.task, "seeds": list(seeds), "steps": baseline.steps, "calibration_seed": args.calib_seed,
        "calibration_run": cal.run_id, "eval_batches": args.batches, "store": store_path,
        "baseline_final": {k: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1))}
                           for k, v in baseline.finals.items()},
        "sensitivity": [{**r.to_dict(), "shapes": None} for r in table],
        "arms": arms, "torch": torch.__version__, "python": platform.python_version(),
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
