"""The accuracy judge's own error rates, measured on real zoo runs (results go into docs/accuracy.md).

For each task: train a bank of fp32 reference runs (seeds 0..B-1) and, for each candidate arm, a bank of candidate
runs (seeds 100..); then draw trials (a baseline of N reference seeds, M candidate seeds, all distinct) for several
(N, M) and count the verdicts' outcomes:

* fp32 with fresh seeds: FAIL is a false FAIL (target <= 5%), PASS the power, INCONCLUSIVE what N + M cannot
  decide;
* known-bad arms: bf16-pure (bf16 weights, nearest-rounded updates), fp8-unscaled (fp8 casts without scaling), and
  fp32 with the learning rate cut by 30%; for each, the bank says whether it is truly worse than each margin (its
  bank mean against the reference bank mean), and PASS on an arm truly worse than a margin is a false PASS
  (target <= 5%);
* fp8-tensorwise, a recipe that should be equivalent.

Prints JSON.  Runs are kept in ``--store`` (default ``lowprec-runs/judge-accuracy.db``) and reused, so the trial
analysis can be re-run cheaply; trials drawn from a finite bank share runs (see ``lowprec.accuracy._calibrate``).

    PYTHONPATH=src python benchmarks/judge_accuracy.py --task mlp-digits --bank 24 --arm-bank 12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time

import numpy as np
import torch

from lowprec import recipes
from lowprec.accuracy._baseline import RunData
from lowprec.accuracy._calibrate import fail_rate
from lowprec.accuracy._stats import Criteria
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import build_task, run_config
from lowprec.runs._store import RunStore


def arms(config: RunConfig) -> dict[str, RunConfig]:
    """Known-bad candidate configs derived from the reference config."""
    lr = (config.optimizer.lr or 1e-3) * 0.7
    return {
        "bf16-pure": dataclasses.replace(config, recipe=recipes.get("bf16-pure")),
        "fp8-unscaled": dataclasses.replace(config, recipe=recipes.get("fp8-unscaled")),
        "lr-x0.7": dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, lr=lr)),
        "fp8-tensorwise": dataclasses.replace(config, recipe=recipes.get("fp8-tensorwise")),
    }


SHAPES = ((3, 2), (3, 3), (5, 5), (8, 8))
"""(baseline seeds, candidate seeds) per trial."""


def truth(ref: list[RunData], cand: list[RunData], criteria: Criteria | None) -> dict[str, float]:
    """How much worse the arm is, from the whole banks, per judged quantity, as a fraction of its margin (> 1:
    truly worse than the margin, so a PASS would be a false PASS)."""
    from lowprec.accuracy._baseline import build_baseline
    from lowprec.accuracy._judge import candidate_mean_curve, metric_margin

    b = build_baseline("bank", ref, criteria=criteria)
    out = {}
    for m, direction in b.metrics.items():
        xs = b.finals[m]
        ys = np.asarray([r.scalars[f"eval/{m}"][1][-1] for r in cand])
        worse = (ys.mean() - xs.mean()) * (1 if direction == "min" else -1)
        out[f"final/{m}"] = round(float(worse / metric_margin(b, m)), 3)
    steps, mean = candidate_mean_curve(b, cand)
    keep = steps > np.ceil(b.criteria.warmup_fraction * b.steps)
    idx = np.searchsorted(b.env_steps, steps[keep])
    rel = (mean[keep] - b.env_mean[idx]) / np.abs(b.env_mean[idx])
    out["curve"] = round(float(np.quantile(rel, 0.5) / b.criteria.curve_margin_rel), 3)
    return out


def bank(store: RunStore, config: RunConfig, group: str, seeds: range) -> list[RunData]:
    """Completed runs of ``config`` in ``group`` for ``seeds``, training the ones the store does not have yet."""
    have = {int(r.manifest["seed"]): r.run_id for r in store.list_runs(group=group, status="completed")}
    todo = tuple(s for s in seeds if s not in have)
    if todo:
        for rid in run_config(dataclasses.replace(config, seeds=todo, group=group), store=store, progress=False):
            have[int(store.get_run(rid).manifest["seed"])] = rid
    return [RunData.from_store(store, have[s]) for s in seeds]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="mlp-digits")
    p.add_argument("--steps", type=int, help="override the task's default steps")
    p.add_argument("--bank", type=int, default=24, help="fp32 reference seeds")
    p.add_argument("--arm-bank", type=int, default=12, help="seeds per candidate arm")
    p.add_argument("--trials", type=int, default=400)
    p.add_argument("--store", default="lowprec-runs/judge-accuracy.db")
    p.add_argument("--criteria", metavar="FILE", help="criteria of every trial's baseline (TOML/JSON, as for "
                                                      "lowprec baseline --criteria; default: Criteria())")
    args = p.parse_args()
    from lowprec.cli._accuracy import _criteria

    criteria = _criteria(args.criteria)
    torch.set_num_threads(1)
    base = RunConfig(model=args.task, steps=args.steps, store=args.store, threads=1)
    task = build_task(base, 0)
    base = base.resolve({**task.defaults, "batch_size": task.samples_per_step})
    t0 = time.perf_counter()
    rng = np.random.default_rng(2026)
    tag = f"{args.task}-{base.steps}"
    results: dict[str, dict] = {}
    truths: dict[str, dict] = {}
    with RunStore(args.store) as store:
        ref = bank(store, base, f"judge/{tag}/fp32", range(args.bank))
        results["fp32 fresh seeds"] = {
            f"N={n} M={m}": fail_rate(ref, ref, n_baseline=n, n_candidate=m, trials=args.trials, rng=rng,
                                      criteria=criteria).to_dict()
            for n, m in SHAPES if n + m <= len(ref)}
        for name, cfg in arms(base).items():
            cand = bank(store, cfg, f"judge/{tag}/{name}", range(100, 100 + args.arm_bank))
            truths[name] = truth(ref, cand, criteria)
            results[name] = {
                f"N={n} M={m}": fail_rate(ref, cand, n_baseline=n, n_candidate=m, trials=args.trials,
                                          rng=rng, criteria=criteria).to_dict()
                for n, m in SHAPES if m <= len(cand)}
    print(json.dumps({
        "task": args.task, "steps": base.steps, "reference_bank": args.bank, "arm_bank": args.arm_bank,
        "trials": args.trials, "criteria": (criteria or Criteria()).to_dict(),
        "worse_by_in_margins": truths, "results": results, "seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__, "python": platform.python_version(),
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
