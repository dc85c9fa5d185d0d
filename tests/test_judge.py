"""Baselines and the judge, on synthetic runs.

Synthetic run (the null model): training loss ``L(t) = (2 + 3 exp(-t/60)) (1 + shift)`` plus a seed effect that
persists over many steps (AR(1), phi = 0.97, stationary sd 0.03) plus per-batch noise (sd 0.1); eval loss and
accuracy are draws correlated with the seed effect (see ``make_run``).  Oracles: scipy.stats.ttest_ind (Welch and
pooled, one-sided) and a hand formula for the test statistic; naive loops for smoothing; binomial bounds (stated at
each test) for the false-alarm and detection rates over seeded simulated trials.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import scipy.signal
import scipy.stats

from lowprec.accuracy._baseline import Baseline, RunData, build_baseline
from lowprec.accuracy._judge import judge
from lowprec.accuracy._stats import Criteria, find_spike, pooled_std, smooth, worse_test

STEPS = 400
METRICS = {"loss": "min", "accuracy": "max"}


def make_run(rng: np.random.Generator, seed: int, *, shift: float = 0.0, acc_shift: float = 0.0,
             status: str = "completed", model: str = "mlp", data_hash: str = "d" * 64, steps: int = STEPS,
             recipe: str = "fp32") -> RunData:
    t = np.arange(1, steps + 1, dtype=np.int64)
    phi, sd_ar = 0.97, 0.03
    ar = scipy.signal.lfilter([1.0], [1.0, -phi], rng.normal(0.0, sd_ar * math.sqrt(1 - phi**2), steps + 200))[200:]
    loss = (2.0 + 3.0 * np.exp(-t / 60.0)) * (1.0 + shift) + ar + rng.normal(0.0, 0.1, steps)
    eval_loss = 2.0 * (1.0 + shift) + 0.5 * ar[-1] + rng.normal(0.0, 0.01)
    acc = 0.8 - 0.1 * (eval_loss - 2.0) + rng.normal(0.0, 0.004) - acc_shift
    last = np.array([steps], dtype=np.int64)
    return RunData(
        run_id=f"{seed:012x}", name=f"{recipe} seed {seed}", group=recipe, status=status,
        config={"model": model, "steps": steps, "seeds": [seed], "name": f"{recipe} seed {seed}",
                "recipe": {"name": recipe}, "batch_size": 32},
        manifest={"seed": seed, "data_hash": data_hash, "metrics": dict(METRICS), "recipe_hash": recipe,
                  "versions": {"torch": "2.13.0"}},
        scalars={"train/loss": (t, loss), "eval/loss": (last, np.array([eval_loss])),
                 "eval/accuracy": (last, np.array([acc]))},
        events=[],
    )


def trial(rng: np.random.Generator, n: int, m: int, **cand: float) -> tuple[Baseline, list[RunData]]:
    base = build_baseline("ref", [make_run(rng, s) for s in range(n)])
    return base, [make_run(rng, 100 + s, recipe="fp8", **cand) for s in range(m)]


def failed(verdict) -> set[str]:
    return {r.name for r in verdict.results if r.outcome == "fail"}


# ------------------------------------------------------------------------------------------- statistics
def test_smooth_matches_a_naive_trailing_mean_and_keeps_nan() -> None:
    # Oracle: the definition, one window at a time.
    x = np.random.default_rng(1).normal(size=50)
    for w in (1, 3, 7, 60):
        want = [x[max(0, i - w + 1): i + 1].mean() for i in range(x.size)]
        np.testing.assert_allclose(smooth(x, w), want, rtol=1e-12, atol=1e-12)
    x[10] = np.nan
    s = smooth(x, 4)
    assert np.isnan(s[10:14]).all() and np.isfinite(s[:10]).all() and np.isfinite(s[14:]).all()


def test_pooled_std_is_rms_over_the_centred_window() -> None:
    s = np.random.default_rng(2).uniform(0.0, 1.0, 30)
    want = [math.sqrt(np.mean(s[max(0, i - 2): i + 3] ** 2)) for i in range(30)]
    np.testing.assert_allclose(pooled_std(s, 5), want, rtol=1e-12)


@pytest.mark.parametrize("direction", ["min", "max"])
@pytest.mark.parametrize(("n", "m"), [(2, 2), (3, 5), (5, 3)])
def test_worse_test_equals_scipy_welch_with_shifted_baseline(direction: str, n: int, m: int) -> None:
    # Oracle: scipy.stats.ttest_ind(equal_var=False) of the candidate against the baseline moved by the margin
    # in the worse direction, one-sided; plus the Welch t statistic written out by hand.
    rng = np.random.default_rng(n * 10 + m)
    for _ in range(5):
        x, y = rng.normal(1.0, 0.1, n), rng.normal(1.05, 0.2, m)
        margin = 0.01
        got = worse_test(x, y, direction=direction, margin=margin)
        if direction == "min":
            ref = scipy.stats.ttest_ind(y, x + margin, equal_var=False, alternative="greater")
        else:
            ref = scipy.stats.ttest_ind(y, x - margin, equal_var=False, alternative="less")
        assert got.method == "welch"
        assert got.p == pytest.approx(ref.pvalue, rel=1e-9)
        sign = 1.0 if direction == "min" else -1.0
        hand_t = (sign * (y.mean() - x.mean()) - margin) / math.sqrt(x.var(ddof=1) / n + y.var(ddof=1) / m)
        assert got.t == pytest.approx(hand_t, rel=1e-12)


def test_one_candidate_seed_uses_the_baseline_variance() -> None:
    # Oracle: with one candidate value, Student's pooled t test (equal_var=True) has exactly the
    # prediction-interval form se = s_x sqrt(1/N + 1), df = N - 1.
    rng = np.random.default_rng(3)
    x, y = rng.normal(0.8, 0.01, 4), np.array([0.79])
    got = worse_test(x, y, direction="max", margin=0.0)
    ref = scipy.stats.ttest_ind(y, x, equal_var=True, alternative="less")
    assert got.method == "prediction" and got.df == 3
    assert got.p == pytest.approx(ref.pvalue, rel=1e-9)


def test_zero_variance_compares_means_exactly() -> None:
    # Oracle: with identical values on both sides there is no noise: FAIL iff worse by more than the margin.
    base = np.array([0.9, 0.9, 0.9])
    assert worse_test(base, np.array([0.9, 0.9]), direction="max", margin=0.0).p == 1.0
    assert worse_test(base, np.array([0.899, 0.899]), direction="max", margin=0.002).p == 1.0
    t = worse_test(base, np.array([0.89, 0.89]), direction="max", margin=0.002)
    assert t.method == "exact" and t.p == 0.0 and t.diff == pytest.approx(0.01)
    # zero baseline variance but noisy candidates: Welch still works (se from the candidates alone)
    assert worse_test(base, np.array([0.88, 0.9]), direction="max", margin=0.0).method == "welch"


def test_find_spike_names_the_first_spike_only() -> None:
    # Oracle: a planted 3x value in a smooth noisy curve; noise alone (sd 2%) never reaches 1.5x.
    rng = np.random.default_rng(4)
    x = 2.0 + 0.04 * rng.normal(size=300)
    assert find_spike(x, window=20, factor=1.5, mad_k=10.0) is None
    x[150], x[200] = 6.0, 7.0
    assert find_spike(x, window=20, factor=1.5, mad_k=10.0) == 150


# --------------------------------------------------------------------------------- false alarms / power
@pytest.mark.parametrize(("n", "m"), [(3, 3), (2, 2), (3, 1)])
def test_false_alarm_rate_over_200_null_trials(n: int, m: int) -> None:
    # Null: candidates drawn from the baseline's own distribution.  The judge should FAIL at most 5% of them.
    # Bound: at most 21 of 200; if the true false-alarm rate were exactly 5%, P(X > 21) = 0.1% (binomial), so
    # this test's own false-failure rate is <= 0.1% per parametrisation (the trials are seeded: it is fixed).
    assert scipy.stats.binom.sf(21, 200, 0.05) < 0.0012
    rng = np.random.default_rng(1000 + 10 * n + m)
    fails = sum(judge(*trial(rng, n, m)).outcome == "fail" for _ in range(200))
    assert fails <= 21, f"{fails} false alarms in 200 null trials (N={n}, M={m})"


@pytest.mark.parametrize(
    ("cand", "criterion", "min_rate"),
    [({"shift": 0.09}, "curve", 0.9), ({"acc_shift": 0.03}, "final/accuracy", 0.9)],
)
def test_clearly_worse_candidates_fail_on_the_right_criterion(cand: dict, criterion: str, min_rate: float) -> None:
    # A loss curve 9% higher (7 points beyond the 2% curve margin, about 4 seed sd of the smoothed loss), or
    # accuracy 7 seed sd (0.03) lower, with N = M = 3.  Measured detection is 100% (40/40) for both; asserting
    # >= 90% of 40 trials: if the true rate were 99%, P(X < 36) < 1e-3.
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(40):
        v = judge(*trial(rng, 3, 3, **cand))
        hits += criterion in failed(v)
        assert v.outcome == "fail" or criterion not in failed(v)
    assert hits >= min_rate * 40, f"{criterion} caught {hits} of 40"


def test_nan_at_step_k_fails_divergence_naming_the_step() -> None:
    # Oracle: the planted step.
    rng = np.random.default_rng(8)
    base, cands = trial(rng, 3, 2)
    st, v = cands[1].scalars["train/loss"]
    v = v.copy()
    v[236:] = np.nan  # steps are 1-based: index 236 is step 237
    cands[1] = dataclasses.replace(cands[1], scalars={**cands[1].scalars, "train/loss": (st, v)}, status="failed")
    verdict = judge(base, cands)
    div = next(r for r in verdict.results if r.name == "divergence")
    assert div.outcome == "fail" and div.values["step"] == 237 and "step 237" in div.reason
    assert {"divergence", "completion"} <= failed(verdict)


def test_loss_spike_fails_divergence_naming_the_step() -> None:
    rng = np.random.default_rng(9)
    base, cands = trial(rng, 3, 3)
    st, v = cands[0].scalars["train/loss"]
    v = v.copy()
    v[299] *= 3.0  # step 300
    cands[0] = dataclasses.replace(cands[0], scalars={**cands[0].scalars, "train/loss": (st, v)})
    verdict = judge(base, cands)
    assert failed(verdict) == {"divergence"}
    div = next(r for r in verdict.results if r.name == "divergence")
    assert div.values["step"] == 300 and "spike" in div.reason


def test_divergence_event_and_nonfinite_eval_metric_are_failures() -> None:
    rng = np.random.default_rng(10)
    base, cands = trial(rng, 2, 2)
    cands[0] = dataclasses.replace(cands[0], events=[{"step": 55, "kind": "diverged", "payload": {"loss": "nan"}}])
    last = np.array([STEPS])
    cands[1] = dataclasses.replace(cands[1], scalars={**cands[1].scalars, "eval/loss": (last, np.array([np.inf]))})
    verdict = judge(base, cands)
    div = next(r for r in verdict.results if r.name == "divergence")
    assert div.outcome == "fail" and div.values["step"] == 55
    assert div.values["runs"][cands[1].run_id]["step"] == STEPS
    assert "final/loss" in failed(verdict)


def test_verdict_table_and_dict() -> None:
    rng = np.random.default_rng(11)
    verdict = judge(*trial(rng, 3, 3))
    text = verdict.format_table()
    assert text.splitlines()[0].startswith(verdict.word)
    for r in verdict.results:
        assert r.name in text and r.reason in text
    assert json.loads(json.dumps(verdict.to_dict(), allow_nan=False))["results"][0]["name"] == "baseline"
    assert [r.name for r in verdict.results] == ["baseline", "completion", "divergence", "curve", "final/loss",
                                                  "final/accuracy"]


# ---------------------------------------------------------------------------------------- baselines
def test_baseline_envelope_is_the_seed_statistics_of_the_smoothed_loss() -> None:
    # Oracle: numpy over the smoothed curves computed by the naive definition.
    rng = np.random.default_rng(12)
    runs = [make_run(rng, s) for s in range(4)]
    b = build_baseline("ref", runs, criteria=Criteria(smoothing_window=5))
    curves = np.stack([[r.scalars["train/loss"][1][max(0, i - 4): i + 1].mean() for i in range(STEPS)]
                       for r in runs])
    np.testing.assert_allclose(b.env_mean, curves.mean(0), rtol=1e-12)
    np.testing.assert_allclose(b.env_std, curves.std(0, ddof=1), rtol=1e-9)
    np.testing.assert_allclose(b.env_max, curves.max(0), rtol=1e-12)
    assert b.finals["accuracy"].tolist() == [r.scalars["eval/accuracy"][1][0] for r in runs]
    assert (b.seeds, b.model, b.steps) == ((0, 1, 2, 3), "mlp", STEPS)
    assert "seeds" not in b.config and "name" not in b.config


def test_baseline_json_round_trip_is_exact_and_line_per_step(tmp_path) -> None:
    rng = np.random.default_rng(13)
    b = build_baseline("ref", [make_run(rng, s) for s in range(3)], criteria=Criteria(metrics=("loss",)))
    path = b.save_json(tmp_path / "golden" / "ref.json")
    assert [p.name for p in path.parent.iterdir()] == ["ref.json"]  # no temporary file left behind
    text = path.read_text()
    assert text.count("\n") > STEPS and '"version": 1' in text
    again = Baseline.load_json(path)
    assert again.to_json() == text
    np.testing.assert_array_equal(again.env_std, b.env_std)
    assert again.criteria == b.criteria and again.finals.keys() == b.finals.keys()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.pop("data_hash"), "data_hash"),
        (lambda d: d["metrics"].update(loss="lower"), "metrics.loss"),
        (lambda d: d["criteria"].update(curve_k=-1), "criteria.curve_k"),
        (lambda d: d["seeds"][1].update(seed=0), "distinct"),
        (lambda d: d["seeds"][0]["final"].update(loss="x"), "seeds[0].final.loss"),
        (lambda d: d["envelope"]["rows"][3].__setitem__(2, -1.0), "std >= 0"),
        (lambda d: d["envelope"]["rows"].reverse(), "increasing"),
    ],
)
def test_baseline_from_dict_is_strict_and_names_the_field(edit, field: str) -> None:
    rng = np.random.default_rng(14)
    d = json.loads(build_baseline("ref", [make_run(rng, s) for s in range(2)]).to_json())
    edit(d)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Baseline.from_dict(d)


def test_build_baseline_rejects_runs_that_are_not_seeds_of_one_config() -> None:
    rng = np.random.default_rng(15)
    a, b = make_run(rng, 0), make_run(rng, 1)
    cases = [
        ([a], ">= 2 seeds"),
        ([a, make_run(rng, 0)], "seed 0 appears twice"),
        ([a, make_run(rng, 1, status="failed")], "status 'failed'"),
        ([a, dataclasses.replace(b, config={**b.config, "batch_size": 64})], r"\['batch_size'\]"),
        ([a, make_run(rng, 1, data_hash="e" * 64)], "data_hash"),
    ]
    st, v = b.scalars["train/loss"]
    cases.append(([a, dataclasses.replace(b, scalars={**b.scalars, "train/loss": (st, np.where(st == 9, np.nan, v))})],
                  "not finite at step 9"))
    for runs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build_baseline("ref", runs)
    with pytest.raises(ValueError, match="criteria.metrics"):
        build_baseline("ref", [a, b], criteria=Criteria(metrics=("bleu",)))


def test_incompatible_candidate_is_an_error_naming_each_difference() -> None:
    rng = np.random.default_rng(16)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    other = make_run(rng, 5, model="cnn", data_hash="f" * 64, steps=200)
    with pytest.raises(ValueError, match="model 'cnn'.*data_hash.*steps 200") as e:
        judge(base, [other])
    assert "ref" in str(e.value)
    with pytest.raises(ValueError, match="share seed"):
        judge(base, [make_run(rng, 5), make_run(rng, 5)])


def test_criteria_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"criteria.curve_max_outside .*<= 1.0; got 2"):
        Criteria(curve_max_outside=2)
    with pytest.raises(ValueError, match="criteria.smoothing_window"):
        Criteria(smoothing_window=0)
    with pytest.raises(ValueError, match="unknown key"):
        Criteria.from_dict({"smoothing": 3})


def test_run_data_from_store_uses_only_the_contract_calls() -> None:
    # Oracle: a stand-in store that implements exactly get_run, scalars and events.
    rec = type("Rec", (), dict(run_id="abcdef123456", name="n", group="g", status="completed",
                               config={"model": "mlp"}, manifest={"seed": 1}))()

    class Store:
        def get_run(self, rid: str):
            assert rid == "abcd"
            return rec

        def scalars(self, rid: str):
            return {"train/loss": (np.array([1]), np.array([2.0]))}

        def events(self, rid: str):
            return [{"step": 1, "kind": "x", "payload": {}}]

    run = RunData.from_store(Store(), "abcd")
    assert run.run_id == "abcdef123456" and run.events[0]["kind"] == "x" and run.scalars["train/loss"][1][0] == 2.0


def test_candidates_of_different_experiments_are_not_pooled() -> None:
    """A JAX run and a PyTorch run of one model and recipe (or two parallel layouts) are different experiments:
    judging them as one sample is an error naming the difference (issue 15, section 3)."""
    import dataclasses

    rng = np.random.default_rng(31)
    base, cands = trial(rng, 3, 2)
    jax = dataclasses.replace(cands[1], manifest={**cands[1].manifest, "framework": "jax"})
    with pytest.raises(ValueError, match="not seeds of one experiment.*framework 'jax' vs 'torch'"):
        judge(base, [cands[0], jax])
    ddp = dataclasses.replace(cands[1], config={**cands[1].config, "parallel": {"strategy": "ddp", "world_size": 2}})
    with pytest.raises(ValueError, match="parallel 'ddp x2' vs 'single x1'"):
        judge(base, [cands[0], ddp])
    judge(base, cands)  # seeds of one experiment: judged


def test_jax_configs_get_their_own_default_group() -> None:
    from lowprec.runs._config import RunConfig

    assert RunConfig(model="gpt-bytes").label == "gpt-bytes fp32"
    assert RunConfig(model="gpt-bytes", framework="jax").label == "gpt-bytes fp32 [jax]"


def test_fail_reason_states_the_per_metric_level_as_the_family_alpha_split() -> None:
    """Oracle: the Bonferroni split by hand.  Two judged metrics (loss, accuracy) with the default metric_alpha
    0.02: each final metric fails at 0.01, and the reason says where 0.01 comes from, so it reads against the
    criteria table (which shows the family's 0.02)."""
    rng = np.random.default_rng(12)
    base, cands = trial(rng, 4, 4, acc_shift=0.05)
    v = judge(base, cands)
    acc = next(r for r in v.results if r.name == "final/accuracy")
    assert acc.outcome == "fail"
    alpha = base.criteria.metric_alpha
    assert acc.values["fail_alpha"] == pytest.approx(alpha / 2)
    assert f"< {alpha / 2:.3g} = metric_alpha {alpha:g} / 2 metrics" in acc.reason, acc.reason
    assert "better" not in acc.reason.split(":")[-1] and "worse by -" not in acc.reason


# ------------------------------------------------------------------- a reference that did not train (section 6)
def _flat(run: RunData) -> RunData:
    """The run with a training loss that does not fall: the same noise around a constant 2.0."""
    st, v = run.scalars["train/loss"]
    t = st.astype(np.float64)
    flat = v - 3.0 * np.exp(-t / 60.0)
    return dataclasses.replace(run, scalars={**run.scalars, "train/loss": (st, flat)})


def test_a_reference_whose_loss_did_not_fall_is_refused_naming_the_numbers() -> None:
    """Oracle: the drop by hand.  The synthetic loss falls from about 5 to 2 (a 50%+ drop, accepted); with the
    decay removed it stays at 2.0 +- noise (a drop near 0%, refused with the criterion's name and the fix);
    min_loss_drop = 0 accepts it (a converged model)."""
    rng = np.random.default_rng(20)
    runs = [make_run(rng, s) for s in range(3)]
    ok = build_baseline("ref", runs)
    st, _ = runs[0].scalars["train/loss"]
    w = ok.criteria.smoothing_window
    early = np.mean([smooth(r.scalars["train/loss"][1], w)[w - 1] for r in runs])
    final = np.mean([smooth(r.scalars["train/loss"][1], w)[-1] for r in runs])
    from lowprec.accuracy._baseline import loss_drop

    assert loss_drop(ok) == pytest.approx((early, final, (early - final) / early))
    assert (early - final) / early > 0.4
    flat = [_flat(r) for r in runs]
    with pytest.raises(ValueError, match=r"did not train: .* drop, below criteria\.min_loss_drop 5%") as e:
        build_baseline("ref", flat)
    assert "min_loss_drop = 0" in str(e.value)
    assert build_baseline("ref", flat, criteria=Criteria(min_loss_drop=0.0)).steps == STEPS


def test_the_judge_fails_a_stored_baseline_that_did_not_train() -> None:
    """Oracle: a baseline built before the check (criteria without it) then judged under the current criteria:
    the "baseline" guard FAILs and so does the verdict, whatever the candidates; a trained baseline passes it."""
    rng = np.random.default_rng(21)
    flat = build_baseline("old", [_flat(make_run(rng, s)) for s in range(3)], criteria=Criteria(min_loss_drop=0.0))
    stale = dataclasses.replace(flat, criteria=Criteria())
    cands = [_flat(make_run(rng, 100 + s, recipe="fp8")) for s in range(3)]
    v = judge(stale, cands)
    guard = next(r for r in v.results if r.name == "baseline")
    assert guard.outcome == "fail" and v.outcome == "fail" and "did not train" in guard.reason
    base, good = trial(rng, 3, 3)
    assert next(r for r in judge(base, good).results if r.name == "baseline").outcome == "pass"


def test_a_candidate_with_too_few_logged_steps_fails_completion() -> None:
    """Oracle: counting by hand.  400 steps, warm-up 40: a candidate that logs its loss every 100 steps has 4
    points after the warm-up (100, 200, 300, 400) < min_judged_steps 5, so completion FAILs saying so; every 50
    steps gives 8 points, which is enough for completion."""
    rng = np.random.default_rng(22)
    base, cands = trial(rng, 3, 2)

    def every(run: RunData, k: int) -> RunData:
        st, v = run.scalars["train/loss"]
        keep = st % k == 0
        return dataclasses.replace(run, scalars={**run.scalars, "train/loss": (st[keep], v[keep])})

    sparse = judge(base, [every(r, 100) for r in cands])
    comp = next(r for r in sparse.results if r.name == "completion")
    assert comp.outcome == "fail" and "logged 4 train/loss step(s) after the warm-up" in comp.reason
    ok = judge(base, [every(r, 50) for r in cands])
    assert next(r for r in ok.results if r.name == "completion").outcome == "pass"


def test_a_baseline_with_too_few_logged_steps_is_refused() -> None:
    rng = np.random.default_rng(23)
    runs = [make_run(rng, s, steps=6) for s in range(3)]
    with pytest.raises(ValueError, match=r"only 5 logged train/loss step\(s\) after the warm-up \(1 of 6 steps\)"):
        build_baseline("ref", runs, criteria=Criteria(min_judged_steps=6, min_loss_drop=0.0))
    assert build_baseline("ref", runs, criteria=Criteria(min_loss_drop=0.0)).steps == 6
