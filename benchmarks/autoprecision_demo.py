"""Autoprecision against uniform formats, judged by the accuracy judge (figures in docs/precision.md).

1. Calibrate: train the task once in float32 (seed ``--calib-seed``, not one of the judged seeds) and measure the
   sensitivity table of every linear layer under each candidate spec (``lowprec.numerics.sensitivity_table``).
2. Choose: ``choose_precision`` per budget; uniform arms put every layer in one spec (the same recipe shape:
   every operand of all three GEMMs in the spec, stochastic rounding on sub-8-bit gradients).
3. Judge: an fp32 baseline over ``--seeds`` seeds (``train_baseline``), every arm over the same seeds, one verdict
   per arm (``judge_groups``), and the final eval metrics per seed.

Prints JSON (``--out PATH`` also writes it after every arm, so an interrupted run keeps what it finished).
``--store`` keeps the runs (default: a fresh temporary directory).

    PYTHONPATH=src python benchmarks/autoprecision_demo.py --task mlp-digits --seeds 5

Equal-bits comparisons: ``--candidates`` fixes the auto arms' candidate set for every budget (default: the
legacy rule, nvfp4 added below 5 bits), ``--uniform`` names the uniform arms, ``--no-fp32-head`` drops the
mxfp4-with-float32-head arm, and a budget equal to a uniform format's bits (6.25 = mxfp6) puts the two arms at
equal storage.  For example (docs/precision.md, gpt-bytes section):

    PYTHONPATH=src python benchmarks/autoprecision_demo.py --task gpt-bytes --model-option layers=3 \\
        --steps 100 --seeds 3 --candidates mxfp4 mxfp6_e2m3 mxfp8_e4m3 --budgets 4.5 --uniform nvfp4 mxfp4 \\
        --no-fp32-head

(``--uniform`` with no names: no uniform arms.)  The equal-bits win of docs/precision.md (gpt-bytes at 4.25 bits:
the mix PASSes with 6 and 10 seeds, uniform mxfp4 FAILs), as two processes, one per arm (with mxfp4 the only
candidate the 4.25-bit plan is uniform mxfp4 itself):

    C="--task gpt-bytes --model-option layers=3 --steps 100 --seeds 10 --no-fp32-head --budgets 4.25 --uniform"
    PYTHONPATH=src python benchmarks/autoprecision_demo.py $C --candidates mxfp4/b128 mxfp4/b64 mxfp4 nvfp4 mxfp6_e2m3
    PYTHONPATH=src python benchmarks/autoprecision_demo.py $C --candidates mxfp4

``--metric probe`` chooses with the training probe (``training_probe``: one training run per layer, candidate and
probe seed, seeds from ``--calib-seed`` on); the partial equal-bits win on mlp-digits (docs/precision.md, last
section):

    PYTHONPATH=src python benchmarks/autoprecision_demo.py --task mlp-digits --seeds 5 \\
        --candidates mxfp4/b128 mxfp4/b64 mxfp4 nvfp4 mxfp6_e2m3 --budgets 4.25 --metric sqnr probe \\
        --probe-seeds 2 --uniform mxfp4 nvfp4/b32 nvfp4/b64 mxfp4/b128 nvfp4 --no-fp32-head

``--plan-only`` stops after the table and the planned arms (no baseline, no arms).
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

from lowprec.accuracy import judge_groups
from lowprec.accuracy._baseline import RunData
from lowprec.numerics._autoprecision import (
    PrecisionPlan,
    choose_precision,
    plan_table,
    storage_bits,
    training_probe,
    uniform_plan,
)
from lowprec.numerics._sensitivity import resolve_candidate, sensitivity_table
from lowprec.runs import train_baseline
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import run_config
from lowprec.runs._store import RunStore
from lowprec.runs._trained import calibrate, eval_batches, probe_trainer

CANDIDATES = ["mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bfloat16"]
WITH_NVFP4 = ["mxfp4", "nvfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bfloat16"]


def _plans(table: list[Any], budgets: list[float], candidates: list[str] | None, uniform: list[str],
           fp32_head: bool, metrics: list[str]) -> dict[str, PrecisionPlan]:
    """The arms: a chosen mix per budget and metric (``candidates``, or by default nvfp4 joins the candidates
    below 5 bits), the uniform formats, and optionally mxfp4 with float32 heads."""
    plans = {}
    for metric in metrics:
        suffix = "" if metrics == ["sqnr"] else f"-{metric}"
        for b in budgets:
            plan = choose_precision(table, budget_bits=b, metric=metric,
                                    candidates=candidates or (WITH_NVFP4 if b < 5 else CANDIDATES))
            same = [n for n, p in plans.items() if p.assignment == plan.assignment]
            if same:  # the same mix already is an arm: train it once
                print(f"arm auto-{b:g}{suffix} is the same mix as {same[0]}", file=sys.stderr)
                continue
            plans[f"auto-{b:g}{suffix}"] = plan
    for spec in uniform:
        plans[f"uniform-{spec}"] = uniform_plan(table, spec)
    if fp32_head:
        plans["mxfp4+fp32-head"] = _heads_in_float32(uniform_plan(table, "mxfp4"), table)
    return plans


def _labels(specs: list[str]) -> list[str]:
    return [resolve_candidate(s)[0] for s in specs]


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--model-option takes KEY=VALUE; got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _heads_in_float32(plan: PrecisionPlan, table: list[Any]) -> PrecisionPlan:
    """The named-recipe convention (``*head`` kept in high precision) applied to a uniform plan."""
    assignment = tuple((g, "float32" if g.endswith("head") else s) for g, s in plan.assignment)
    rows = {(r.name, r.spec): r for r in table}
    chosen = [rows[a] for a in assignment]
    bits = sum(storage_bits(resolve_candidate(r.spec)[1], sh) for r in chosen for sh in r.shapes)
    noise = sum(r.noise for r in chosen)
    avg = bits / sum(r.params for r in chosen)
    return dataclasses.replace(plan, assignment=assignment, average_bits=avg, budget_bits=avg,
                               predicted_sqnr_db=math.inf if noise == 0 else -10 * math.log10(noise),
                               predicted_loss_delta=sum(r.probe_delta for r in chosen))


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
        "arm": name, "metric": plan.metric, "average_bits": plan.average_bits,
        "predicted_sqnr_db": _finite(plan.predicted_sqnr_db),
        "predicted_loss_delta": _finite(plan.predicted_loss_delta),
        "assignment": dict(plan.assignment),
        "layers": [{**row, "sqnr_db": _finite(row["sqnr_db"]), "probe_delta": _finite(row["probe_delta"])}
                   for row in plan_table(plan, table)],
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
    ap.add_argument("--model-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                    help="task option (JSON value), e.g. d_model=64; repeatable")
    ap.add_argument("--batch-size", type=int, help="training batch size (default: the task's)")
    ap.add_argument("--candidates", nargs="+", metavar="SPEC",
                    help="candidate specs of every auto arm (default: mxfp4 mxfp6_e2m3 mxfp8_e4m3 bf16, plus nvfp4 "
                         "for budgets below 5)")
    ap.add_argument("--uniform", nargs="*", default=["mxfp4", "nvfp4", "mxfp6_e2m3"], metavar="SPEC",
                    help="uniform arms (default: mxfp4 nvfp4 mxfp6_e2m3)")
    ap.add_argument("--no-fp32-head", dest="fp32_head", action="store_false",
                    help="drop the arm 'mxfp4 with float32 heads'")
    ap.add_argument("--metric", nargs="+", choices=("sqnr", "probe"), default=["sqnr"],
                    help="what the auto arms minimise; one auto arm per (metric, budget) (default: sqnr)")
    ap.add_argument("--probe-steps", type=int, help="steps of each probe run (default: the task's)")
    ap.add_argument("--probe-seeds", type=int, default=1,
                    help="probe seeds: the calibration seed and the next N-1 (default 1)")
    ap.add_argument("--store", help="run store path (default: a temporary directory)")
    ap.add_argument("--out", help="also write the JSON here, rewritten after every arm")
    ap.add_argument("--plan-only", action="store_true",
                    help="stop after the sensitivity table (and probe) and the planned arms: no baseline, no arms")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    candidates = _labels(args.candidates) if args.candidates else None
    uniform = _labels(args.uniform)
    measured = list(dict.fromkeys([*(candidates or WITH_NVFP4), *uniform,
                                   *(["mxfp4", "float32"] if args.fp32_head else [])]))
    store_path = args.store or str(Path(tempfile.mkdtemp(prefix="autoprecision-")) / "runs.db")
    config = RunConfig(model=args.task, threads=1, store=store_path, steps=args.steps, batch_size=args.batch_size,
                       model_options=dict(args.model_option))
    seeds = tuple(range(args.seeds))
    out: dict[str, Any] = {
        "task": args.task, "model_options": dict(args.model_option), "batch_size": args.batch_size,
        "seeds": list(seeds), "calibration_seed": args.calib_seed, "eval_batches": args.batches,
        "budgets": args.budgets, "candidates": candidates, "uniform": uniform, "store": store_path,
        "metrics": args.metric, "probe_steps": args.probe_steps, "probe_seeds": args.probe_seeds,
        "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
    }

    def dump() -> None:
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
            tmp.replace(args.out)

    with RunStore(store_path) as store:
        t0 = time.perf_counter()
        cal = calibrate(config, store=store, seed=args.calib_seed, progress=args.progress)
        table = sensitivity_table(cal.model, eval_batches(cal, args.batches), cal.task.loss_fn, measured)
        if "probe" in args.metric:  # the uniform and head-in-float32 arms are probed too (their predictions)
            t1 = time.perf_counter()
            trainer = probe_trainer(config, store=store, steps=args.probe_steps, progress=args.progress)
            table = training_probe(table, trainer, seeds=[args.calib_seed + i for i in range(args.probe_seeds)])
            out["probe_seconds"] = round(time.perf_counter() - t1, 1)
        plans = _plans(table, args.budgets, candidates, uniform, args.fp32_head, args.metric)
        out.update(calibration_run=cal.run_id, sensitivity=[{**r.to_dict(), "shapes": None} for r in table],
                   planned={n: {"average_bits": p.average_bits, "assignment": dict(p.assignment),
                                "predicted_sqnr_db": _finite(p.predicted_sqnr_db),
                                "predicted_loss_delta": _finite(p.predicted_loss_delta)}
                            for n, p in plans.items()},
                   calibration_seconds=round(time.perf_counter() - t0, 1))
        dump()
        if args.plan_only:
            json.dump(out, sys.stdout, indent=1)
            print()
            return 0
        t0 = time.perf_counter()
        baseline = train_baseline(config, name="fp32", store=store, seeds=seeds, progress=args.progress)
        out.update(steps=baseline.steps, baseline_seconds=round(time.perf_counter() - t0, 1),
                   baseline_final={k: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)),
                                       "per_seed": [float(x) for x in v]} for k, v in baseline.finals.items()},
                   arms=[])
        dump()
        for name, plan in plans.items():
            arm, arm_runs = _arm(store, config, name, plan, table, seeds, args.progress)
            (verdict,) = judge_groups(baseline, arm_runs)
            arm["verdict"] = {"passed": verdict.passed,
                              "failed": {r.name: r.reason for r in verdict.results if not r.passed}}
            out["arms"].append(arm)
            dump()
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
