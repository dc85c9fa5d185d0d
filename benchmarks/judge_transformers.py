"""The accuracy judge on real transformers families (issue 17): tiny Llama, GPT-2 and Mixtral from ``hf-causal-lm``.

For each family: train a fp32 baseline (``train_baseline``, seeds 0..N-1, default criteria), then each candidate
arm with fresh seeds (100..), and judge every arm against the baseline (``accuracy.judge_groups``):

* ``bf16-sr+attn``, ``fp8-tensorwise+attn``, ``mxfp8+attn``: the recipes with attention emulated (Q K^T and P V
  in the recipe's format as well as every linear layer and expert), expected to be as accurate as fp32;
* ``lr-x0.1`` (known-bad): fp32 with the learning rate cut tenfold.  It is worse for a reason unrelated to
  precision, by far more than the 1% margin at these step counts, so a judge that does not FAIL it is broken; the
  low-precision "bad" recipes (bf16-pure, fp8-unscaled) are not used because whether they are worse than a 1%
  margin on a given task is itself a measurement (docs/accuracy.md), not a known fact.

Prints JSON (per family and arm: the outcome, the final eval loss of the arm and of the baseline, the margin, what
the sample could pass and detect, and the evidence line of the deciding criterion), and with ``--md`` writes the
markdown verdict table shown in docs/transformers-proof.md.  Runs and baselines are kept in ``--store`` and
reused when the script is re-run with the same settings.

    PYTHONPATH=src python benchmarks/judge_transformers.py --md /tmp/table.md --json /tmp/verdicts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from typing import Any

import numpy as np
import torch

from lowprec import accuracy, recipes
from lowprec.accuracy import Criteria, RunData
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import build_task, run_config
from lowprec.runs._seeds import train_baseline
from lowprec.runs._store import RunStore

FAMILIES = ("llama", "gpt2", "mixtral")
RECIPE_ARMS = ("bf16-sr+attn", "fp8-tensorwise+attn", "mxfp8+attn")
BAD_ARM = "lr-x0.1"
BAD_LR_FACTOR = 0.1
SIZES = {"hidden": 64, "layers": 2, "heads": 4, "context": 64}
QUICK = {"families": ("llama",), "steps": 40, "sizes": {"hidden": 32, "layers": 1, "heads": 2, "context": 32},
         "arms": ("bf16-sr+attn",)}
CANDIDATE_SEED0 = 100


def arm_config(base: RunConfig, arm: str) -> RunConfig:
    """The candidate config of ``arm`` derived from the resolved fp32 reference config."""
    if arm == BAD_ARM:
        lr = (base.optimizer.lr or 1e-3) * BAD_LR_FACTOR
        return dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, lr=lr))
    return dataclasses.replace(base, recipe=recipes.get(arm))


def bank(store: RunStore, config: RunConfig, group: str, seeds: range) -> list[RunData]:
    """Completed runs of ``config`` in ``group`` for ``seeds``, training the ones the store does not have yet."""
    have = {int(r.manifest["seed"]): r.run_id for r in store.list_runs(group=group, status="completed")}
    todo = tuple(s for s in seeds if s not in have)
    if todo:
        for rid in run_config(dataclasses.replace(config, seeds=todo, group=group), store=store, progress=False):
            have[int(store.get_run(rid).manifest["seed"])] = rid
    return [RunData.from_store(store, have[s]) for s in seeds]


def evidence(verdict: accuracy.Verdict) -> tuple[str, str]:
    """(criterion name, reason) of the criterion that decided ``verdict``: the first FAIL; for a PASS the final
    eval loss; otherwise the first primary criterion that did not PASS."""
    res = list(verdict.results)
    by_name = {r.name: r for r in res}
    if verdict.outcome == "fail":
        r = next(r for r in res if r.outcome == "fail")
    elif verdict.outcome == "pass":
        r = by_name.get("final/loss", res[-1])
    else:
        r = next((r for r in res if r.role == "primary" and r.outcome != "pass"), res[-1])
    return r.name, r.reason


def summarise(verdict: accuracy.Verdict, cand: list[RunData], seconds: float) -> dict[str, Any]:
    loss = next(r for r in verdict.results if r.name == "final/loss").values
    name, reason = evidence(verdict)
    return {
        "outcome": verdict.outcome,
        "criteria": {r.name: r.outcome for r in verdict.results},
        "seeds": [int(r.manifest["seed"]) for r in cand],
        "eval_loss_mean": loss.get("candidate_mean"), "eval_loss_std": loss.get("candidate_std"),
        "baseline_eval_loss_mean": loss.get("baseline_mean"), "baseline_eval_loss_std": loss.get("baseline_std"),
        "worse_by": loss.get("worse_by"), "margin": loss.get("margin"), "upper": loss.get("upper"),
        "passable_margin": loss.get("passable_margin"), "detectable": loss.get("detectable"),
        "evidence_criterion": name, "evidence": reason,
        "advice": (verdict.plan or {}).get("advice"),
        "seconds": round(seconds, 1),
    }


def _f(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The verdict table (one row per family and arm) and the evidence line of each row below it."""
    head = ("| family | arm | verdict | eval loss (arm) | eval loss (fp32) | worse by | margin | 95% upper bound "
            "| passable | detectable | curve |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    notes = []
    for fam, per in results.items():
        for arm, s in per["arms"].items():
            arm_loss = f"{_f(s['eval_loss_mean'])} ± {_f(s['eval_loss_std'], '.3f')}"
            base_loss = f"{_f(s['baseline_eval_loss_mean'])} ± {_f(s['baseline_eval_loss_std'], '.3f')}"
            lines.append(f"| {fam} | {arm} | {s['outcome'].upper()} | {arm_loss} | {base_loss} | "
                         f"{_f(s['worse_by'], '+.4f')} | {_f(s['margin'])} | {_f(s['upper'], '+.4f')} | "
                         f"{_f(s['passable_margin'])} | {_f(s['detectable'])} | "
                         f"{s['criteria'].get('curve', '-').upper()} |")
            notes.append(f"- {fam} / {arm} ({s['evidence_criterion']}): {s['evidence']}")
    return "\n".join(lines) + "\n\nEvidence (the criterion that decided each verdict):\n\n" + "\n".join(notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated hf-causal-lm families")
    p.add_argument("--arms", default=",".join(RECIPE_ARMS) + "," + BAD_ARM,
                   help=f"comma-separated arms: recipe names (NAME+attn allowed) and {BAD_ARM}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--baseline-seeds", type=int, default=3, help="fp32 baseline seeds (0..N-1)")
    p.add_argument("--seeds", type=int, default=2, help="fresh seeds per candidate arm (100..)")
    p.add_argument("--store", default="lowprec-runs/judge-transformers.db")
    p.add_argument("--md", metavar="PATH", help="write the markdown verdict table here")
    p.add_argument("--json", metavar="PATH", help="write the JSON summary here (it is printed either way)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK['families'][0]} only, {QUICK['steps']} steps, width "
                        f"{QUICK['sizes']['hidden']}, arms {', '.join(QUICK['arms'])} and {BAD_ARM}")
    args = p.parse_args(argv)
    families = tuple(f for f in args.families.split(",") if f)
    arms = tuple(a for a in args.arms.split(",") if a)
    steps, sizes = args.steps, dict(SIZES)
    if args.quick:
        families, steps, sizes = QUICK["families"], QUICK["steps"], dict(QUICK["sizes"])
        arms = (*QUICK["arms"], BAD_ARM)
    for a in arms:
        if a != BAD_ARM and not recipes.is_named(a):
            p.error(f"unknown arm {a!r}: not a recipe name nor {BAD_ARM}")

    torch.set_num_threads(1)
    criteria = Criteria()
    t_all = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with RunStore(args.store) as store:
        for fam in families:
            opts = {"family": fam, **sizes}
            base = RunConfig(model="hf-causal-lm", model_options=opts, steps=steps, store=args.store, threads=1)
            task = build_task(base, 0)
            base = base.resolve({**task.defaults, "batch_size": task.samples_per_step})
            name = (f"tf-{fam}-h{sizes['hidden']}l{sizes['layers']}c{sizes['context']}-{steps}"
                    f"-s{args.baseline_seeds}")
            t0 = time.perf_counter()
            if name in store.list_baselines():
                baseline = accuracy.load_baseline(store, name)
            else:
                baseline = train_baseline(base, name=name, store=store, seeds=args.baseline_seeds,
                                          criteria=criteria, progress=False)
            t_base = time.perf_counter() - t0
            plan = accuracy.plan(baseline)
            fam_out: dict[str, Any] = {
                "options": opts, "steps": base.steps, "batch_size": base.batch_size, "lr": base.optimizer.lr,
                "baseline": name, "baseline_seeds": [int(s) for s in baseline.seeds],
                "baseline_eval_loss": [float(x) for x in baseline.finals["loss"]],
                "baseline_seconds": round(t_base, 1), "plan_advice": plan.get("advice"),
                "plan": {k: {f: e[f] for f in ("sigma", "margin", "candidate_seeds", "seeds_per_side")}
                         for k, e in plan["criteria"].items()},
                "arms": {},
            }
            for arm in arms:
                t0 = time.perf_counter()
                cand = bank(store, arm_config(base, arm), f"judge-tf/{name}/{arm}",
                            range(CANDIDATE_SEED0, CANDIDATE_SEED0 + args.seeds))
                (verdict,) = accuracy.judge_groups(baseline, cand)
                fam_out["arms"][arm] = summarise(verdict, cand, time.perf_counter() - t0)
                print(f"[judge_transformers] {fam} {arm}: {verdict.word} "
                      f"({fam_out['arms'][arm]['seconds']} s)", file=sys.stderr, flush=True)
            results[fam] = fam_out
    import transformers

    import lowprec

    out = {
        "families": list(families), "arms": list(arms), "steps": steps, "sizes": sizes,
        "baseline_seeds": args.baseline_seeds, "candidate_seeds": args.seeds, "bad_arm": BAD_ARM,
        "criteria": criteria.to_dict(), "results": results, "seconds": round(time.perf_counter() - t_all, 1),
        "lowprec": lowprec.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "quick": args.quick,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
