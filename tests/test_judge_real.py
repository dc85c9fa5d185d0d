"""The judge's error rates on real zoo runs (a small bank; the full measurement is benchmarks/judge_accuracy.py).

Oracle: the null case by construction (fp32 candidates with fresh seeds against an fp32 baseline of the same
config) and a known-bad arm (the learning rate cut by 30%).  Runs are seeded and deterministic, so this test is
deterministic; the bounds are loose on purpose (a bank of 8 reference seeds makes trials share runs) and catch a
judge that is badly calibrated on real curves: >= 15% false FAILs, missing most of the bad arm, or PASSing it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from lowprec.accuracy._baseline import RunData
from lowprec.accuracy._calibrate import fail_rate
from lowprec.runs._config import OptimizerConfig, RunConfig
from lowprec.runs._runner import run_config
from lowprec.runs._store import RunStore


def test_false_alarms_and_detection_on_real_runs(tmp_path: Path) -> None:
    cfg = RunConfig(model="mlp-digits", steps=120, threads=1, store=str(tmp_path / "runs.db"), seeds=tuple(range(8)))
    bad = dataclasses.replace(cfg, seeds=(100, 101, 102, 103), name="lr-cut", optimizer=OptimizerConfig(lr=2.1e-3))
    with RunStore(cfg.store) as store:
        ref = [RunData.from_store(store, i) for i in run_config(cfg, store=store, progress=False)]
        cand = [RunData.from_store(store, i) for i in run_config(bad, store=store, progress=False)]
    rng = np.random.default_rng(0)
    null = fail_rate(ref, ref, n_baseline=3, n_candidate=2, trials=100, rng=rng)
    hit = fail_rate(ref, cand, n_baseline=3, n_candidate=2, trials=100, rng=rng)
    assert null.rate < 0.15, null.to_dict()  # false FAILs
    assert null.passes + null.inconclusive + null.fails == 100
    assert hit.rate >= 0.9 and hit.by_criterion.get("curve", 0) >= 90, hit.to_dict()
    assert hit.passes <= 5, hit.to_dict()  # false PASSes of an arm that is truly worse


def test_clopper_pearson_interval_by_hand() -> None:
    """0 of n: the exact upper bound solves (1 - p)^n = 0.025; n of n mirrors it."""
    from lowprec.accuracy._calibrate import ErrorRate

    lo, hi = ErrorRate(trials=100, fails=0, by_criterion={}).interval()
    assert lo == 0.0 and abs(hi - (1 - 0.025 ** (1 / 100))) < 1e-12
    lo, hi = ErrorRate(trials=100, fails=100, by_criterion={}).interval()
    assert hi == 1.0 and abs(lo - 0.025 ** (1 / 100)) < 1e-12
