"""The accuracy judge's own error rates, measured on real zoo runs (results go into docs/accuracy.md).

For each task: train a bank of fp32 reference runs (seeds 0..B-1) and, for each known-bad arm, a bank of candidate
runs; then draw trials (baseline of 3 reference seeds, 2 candidate seeds, all distinct) and count FAIL verdicts.

* false alarms: fp32 candidates with fresh seeds (target: PASS in >= 95% of trials);
* detection: bf16-pure (bf16 weights, nearest-rounded updates), fp8-unscaled (fp8 casts without scaling), and
  fp32 with the learning rate cut by 30%.

Prints JSON.  Runs are kept in ``--store`` (default ``lowprec-runs/judge-accuracy.db``) and reused, so the trial
analysis can be re-run cheaply; trials drawn from a finite bank share runs (see ``lowprec.runs._calibrate``).

    PYTHONPATH=src python benchmarks/judge_accuracy.py --task mlp-digits --bank 16 --arm-bank 6
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
from lowprec.runs._baseline import RunData
from lowprec.runs._calibrate import fail_rate
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
    }


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
    p.add_argument("--bank", type=int, default=16, help="fp32 reference seeds")
    p.add_argument("--arm-bank", type=int, default=6, help="seeds per known-bad arm")
    p.add_argument("--trials", type=int, default=400)
    p.add_argument("--store", default="lowprec-runs/judge-accuracy.db")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = RunConfig(model=args.task, steps=args.steps, store=args.store, threads=1)
    task = build_task(base, 0)
    base = base.resolve({**task.defaults, "batch_size": task.samples_per_step})
    t0 = time.perf_counter()
    rng = np.random.default_rng(2026)
    tag = f"{args.task}-{base.steps}"
    with RunStore(args.store) as store:
        ref = bank(store, base, f"judge/{tag}/fp32", range(args.bank))
        results = {"fp32 fresh seeds (false alarms)": fail_rate(ref, ref, n_baseline=3, n_candidate=2,
                                                                 trials=args.trials, rng=rng).to_dict()}
        for name, cfg in arms(base).items():
            cand = bank(store, cfg, f"judge/{tag}/{name}", range(args.arm_bank))
            results[f"{name} (detection)"] = fail_rate(ref, cand, n_baseline=3, n_candidate=2,
                                                       trials=args.trials, rng=rng).to_dict()
    print(json.dumps({
        "task": args.task, "steps": base.steps, "reference_bank": args.bank, "arm_bank": args.arm_bank,
        "baseline_seeds_per_trial": 3, "candidate_seeds_per_trial": 2, "trials": args.trials,
        "results": results, "seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__, "python": platform.python_version(),
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
