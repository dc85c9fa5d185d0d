"""Automatic per-layer fallback: the recipe option, its serialisation, and runs that fall back (or not).

Oracles: arithmetic known before the run (``_faulty_tasks:tiny_input`` scales the digits' pixels, at most 1, by
2^-12, below half the smallest e4m3 subnormal 2^-9, so *every* nonzero input of the first layer underflows under
unscaled fp8 on every sample: the policy must fire at the ``patience``-th sample, step (patience - 1) * every + 1);
the same run without the policy (bitwise-equal losses up to the fallback, and over the whole run when nothing
crosses a threshold); an uninterrupted run (resume must reproduce it bit for bit across the fallback); recipe
hashes and dicts stored before the field existed (unchanged when the field is absent).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lowprec import recipes
from lowprec.recipes import Fallback, Gemm, LinearRecipe, Operand, Recipe
from lowprec.runs._config import CheckpointConfig, RunConfig, StatsConfig
from lowprec.runs._runner import resume_run, run_config
from lowprec.runs._store import RunStore

POLICY = Fallback(underflow_pct=50, sqnr_db=10, patience=2, to="bf16")


def _cfg(tmp_path: Path, *, model: str = "_faulty_tasks:tiny_input", policy: Fallback | None = POLICY,
         **kw) -> RunConfig:
    recipe = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=policy)
    base = dict(model=model, steps=16, eval_interval=8, threads=1, recipe=recipe, stats=StatsConfig(every=5),
                store=str(tmp_path / "runs.db"))
    base.update(kw)
    return RunConfig(**base)


def _loss(store: RunStore, rid: str) -> np.ndarray:
    return store.scalars(rid)["train/loss"][1]


def test_fallback_validation_serialisation_and_unchanged_hashes() -> None:
    """Oracle: the hash of every built-in recipe computed from its dict without a "fallback" key (what was
    stored before the field existed), and the JSON/TOML parsers reading back what was written."""
    for name in recipes.names():
        r = recipes.get(name)
        assert "fallback" not in r.to_dict()
        assert Recipe.from_dict(r.to_dict()).hash() == r.hash()
    custom = LinearRecipe(forward=Gemm(a=Operand(spec=None)))
    for policy in (POLICY, Fallback(overflow_pct=1, patience=3, to=custom)):
        r = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=policy)
        assert Recipe.from_json(r.to_json()) == r and Recipe.from_toml(r.to_toml()) == r
        assert r.hash() != recipes.get("fp8-unscaled").hash()
    assert Fallback(underflow_pct=50).underflow_pct == 50.0 and Fallback(underflow_pct=50) == Fallback(
        underflow_pct=50.0)
    for kw, needle in [({}, "needs a threshold"), ({"underflow_pct": 100}, "Fallback.underflow_pct"),
                       ({"sqnr_db": float("nan")}, "Fallback.sqnr_db"),
                       ({"sqnr_db": 10, "patience": 0}, "Fallback.patience"),
                       ({"sqnr_db": 10, "to": "fp64"}, "Fallback.to must be")]:
        with pytest.raises(ValueError, match=needle):
            Fallback(**kw)
    with pytest.raises(ValueError, match="recipe.fallback: Fallback.patience"):
        Recipe.from_dict({"name": "x", "fallback": {"sqnr_db": 10, "patience": -1}})


def test_layer_falls_back_at_the_expected_step_and_training_continues(tmp_path: Path) -> None:
    """Oracle: the fallback step known in advance (100% underflow on samples 0 and 5, patience 2 -> decided with
    step 6's statistics, applied from step 7), and the same run without the policy (bitwise-equal losses on steps
    1..6, different after)."""
    with RunStore(str(tmp_path / "runs.db")) as store:
        (rid,) = run_config(_cfg(tmp_path), store=store, progress=False)
        (plain,) = run_config(_cfg(tmp_path, policy=None), store=store, progress=False)
        (ev,) = store.events(rid, kind="fallback")
        p = ev["payload"]
        assert ev["step"] == 6 and p["step"] == 6 and p["applies_from_step"] == 7 and p["sampled_steps"] == [1, 6]
        assert (p["module"], p["role"], p["statistic"], p["value"], p["threshold"]) == (
            "layers.0", "input", "underflow_pct", 100.0, 50.0)
        assert (p["from_spec"], p["to_spec"], p["to"]) == ("float8_e4m3fn/none", "bfloat16/none", "bf16")
        loss, ref = _loss(store, rid), _loss(store, plain)
        assert np.array_equal(loss[:6], ref[:6]) and not np.array_equal(loss[6:], ref[6:])
        assert np.isfinite(loss).all() and len(loss) == 16 and store.get_run(rid).status == "completed"
        steps, under = store.scalars(rid)["stats/layers.0/input/underflow_pct"]
        assert np.array_equal(steps, [1, 6, 11, 16]) and np.array_equal(under, [100, 100, 0, 0])  # bf16 after
        assert not store.events(plain, kind="fallback")


def test_no_fallback_when_no_threshold_is_crossed(tmp_path: Path) -> None:
    """Oracle: the same run without the policy: bitwise-equal losses and no event (on the plain digits every
    tensor's underflow stays under 5% and its SQNR above 20 dB, far from the thresholds 50% / 10 dB)."""
    with RunStore(str(tmp_path / "runs.db")) as store:
        (rid,) = run_config(_cfg(tmp_path, model="mlp-digits"), store=store, progress=False)
        (plain,) = run_config(_cfg(tmp_path, model="mlp-digits", policy=None), store=store, progress=False)
        assert not store.events(rid, kind="fallback")
        assert np.array_equal(_loss(store, rid), _loss(store, plain))


@pytest.mark.parametrize("crash", [5, 10])
def test_resume_reproduces_the_curve_across_a_fallback(tmp_path: Path, crash: int) -> None:
    """Oracle: the uninterrupted run.  Crash at batch 5 resumes from the step-4 checkpoint, before the fallback:
    the count of crossing samples (1) must come back from the checkpoint for the fallback to happen at step 6
    again.  Crash at batch 10 resumes from step 8, after it: the swapped layer (and its buffers) must come back."""
    opts = {"crash_step": crash, "marker": str(tmp_path / f"m{crash}")}
    with RunStore(str(tmp_path / "runs.db")) as store:
        (ref,) = run_config(_cfg(tmp_path), store=store, progress=False)
        with pytest.raises(RuntimeError, match=f"injected failure at step {crash}"):
            run_config(_cfg(tmp_path, model_options=opts, checkpoint=CheckpointConfig(interval=4)), store=store,
                       progress=False)
        (failed,) = store.list_runs(status="failed")
        rid = resume_run(failed.run_id, store=store, progress=False)
        assert np.array_equal(_loss(store, rid), _loss(store, ref))
        assert [e["step"] for e in store.events(rid, kind="fallback")] == [6]
