"""The judge's three outcomes: PASS needs evidence of being within the margin, FAIL evidence of being beyond it,
INCONCLUSIVE otherwise; and the seed counts that decide a comparison (issue 15, section 1).

Oracles: scipy's Welch test and its confidence interval (``ttest_ind(..., equal_var=False).confidence_interval``);
the inequality that defines ``seeds_needed``, checked at the returned count and one below it; Monte Carlo error
rates on normal samples and on the synthetic training-curve model of ``test_judge.py``, each asserted with a
binomial bound whose own false-failure probability is stated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from test_judge import trial

from lowprec.accuracy._judge import judge
from lowprec.accuracy._plan import plan
from lowprec.accuracy._stats import margin_test, seeds_needed


@pytest.mark.parametrize("direction", ["min", "max"])
def test_bounds_equal_scipys_one_sided_welch_confidence_intervals(direction: str) -> None:
    rng = np.random.default_rng(11)
    for n, m in [(3, 2), (5, 4), (8, 8)]:
        x, y = rng.normal(1.0, 0.05, n), rng.normal(1.01, 0.08, m)
        t = margin_test(x, y, direction=direction, margin=0.02, pass_alpha=0.05, fail_alpha=0.02)
        # "worse by" = y - x for "min", x - y for "max"
        a, b = (y, x) if direction == "min" else (x, y)
        up = scipy.stats.ttest_ind(a, b, equal_var=False, alternative="less").confidence_interval(0.95).high
        lo = scipy.stats.ttest_ind(a, b, equal_var=False, alternative="greater").confidence_interval(0.98).low
        assert t.upper == pytest.approx(up, rel=1e-9) and t.lower == pytest.approx(lo, rel=1e-9)
        # p_within: Welch test of "margin or more worse", rejected for small p
        p = scipy.stats.ttest_ind(a, b + 0.02, equal_var=False, alternative="less").pvalue
        assert t.p_within == pytest.approx(p, rel=1e-9)
        assert t.outcome == ("pass" if t.upper < 0.02 else "fail" if t.lower > 0.02 else "inconclusive")


def test_the_reported_example_is_inconclusive_not_pass() -> None:
    """The issue's case: accuracy 0.833 against a 3-seed baseline of 0.941 ± 0.066 used to PASS (p = 0.051)."""
    base = np.array([0.941 - 0.066, 0.941, 0.941 + 0.066])
    t = margin_test(base, np.array([0.833]), direction="max", margin=0.0025 * 0.941, pass_alpha=0.05,
                    fail_alpha=0.02)
    assert t.outcome == "inconclusive" and t.upper > 0.2  # "at most 21+ points worse": no evidence of equivalence


def test_zero_variance_is_decided_exactly() -> None:
    base = np.array([0.9, 0.9, 0.9])
    ok = margin_test(base, np.array([0.899, 0.899]), direction="max", margin=0.002, pass_alpha=0.05, fail_alpha=0.02)
    bad = margin_test(base, np.array([0.89, 0.89]), direction="max", margin=0.002, pass_alpha=0.05, fail_alpha=0.02)
    assert (ok.method, ok.outcome, bad.outcome) == ("exact", "pass", "fail")


@pytest.mark.parametrize(("n", "m"), [(3, 3), (5, 5), (3, 1)])
def test_false_pass_rate_at_the_margin_is_at_most_pass_alpha(n: int, m: int) -> None:
    """Normal samples with the candidate exactly ``margin`` worse: PASS must happen in <= 5% of trials (the test's
    level).  Bound: at most 45 of 600; if the true rate were exactly 5% (30 expected), P(X > 45) < 0.4%."""
    assert scipy.stats.binom.sf(45, 600, 0.05) < 0.004
    rng = np.random.default_rng(100 + n * 10 + m)
    passes = sum(margin_test(rng.normal(0.0, 1.0, n), rng.normal(0.5, 1.0, m), direction="min", margin=0.5,
                             pass_alpha=0.05, fail_alpha=0.02).outcome == "pass" for _ in range(600))
    assert passes <= 45, passes


def test_seeds_needed_is_the_smallest_count_meeting_its_inequality() -> None:
    for sigma, gap, n in [(1.0, 1.0, 10), (0.02, 0.01, None), (0.5, 0.3, 40)]:
        m = seeds_needed(sigma, gap, alpha=0.05, power=0.8, n_baseline=n)
        assert m is not None

        def lhs(k: int, n: int | None = n, sigma: float = sigma) -> float:
            nb = k if n is None else n
            df = nb + k - 2
            return (scipy.stats.t.ppf(0.95, df) + scipy.stats.t.ppf(0.8, df)) * sigma * math.sqrt(1 / nb + 1 / k)

        assert lhs(m) <= gap and (m == (2 if n is None else 1) or lhs(m - 1) > gap)
    # with 3 baseline seeds, sigma / sqrt(3) * 2.6 > gap: no candidate count is enough
    assert seeds_needed(1.0, 0.5, alpha=0.05, power=0.8, n_baseline=3) is None


def test_planned_seeds_reach_the_planned_power() -> None:
    """Monte Carlo: with the planned number of seeds per side, an equal candidate PASSes in about 80% of trials.
    Bound: at least 215 of 300 (71.7%); at a true 80% (240 expected), P(X < 215) < 0.1%."""
    sigma, margin = 1.0, 1.0
    k = seeds_needed(sigma, margin, alpha=0.05, power=0.8, n_baseline=None)
    assert k is not None
    rng = np.random.default_rng(5)
    passes = sum(margin_test(rng.normal(0, sigma, k), rng.normal(0, sigma, k), direction="min", margin=margin,
                             pass_alpha=0.05, fail_alpha=0.02).outcome == "pass" for _ in range(300))
    assert scipy.stats.binom.cdf(214, 300, 0.8) < 0.001
    assert passes >= 215, (k, passes)


def test_equal_candidates_pass_with_enough_seeds_and_are_inconclusive_with_few() -> None:
    """Synthetic curves (test_judge's model): with 3 + 3 seeds an equal candidate is mostly INCONCLUSIVE (eval loss
    seed sd ~0.9% against a 1% margin); with 12 + 12 it PASSes in most trials (measured 30 of 30), never FAILs."""
    rng = np.random.default_rng(21)
    few = [judge(*trial(rng, 3, 3)).outcome for _ in range(30)]
    many = [judge(*trial(rng, 12, 12)).outcome for _ in range(30)]
    assert few.count("inconclusive") >= 20 and "fail" not in many and many.count("pass") >= 24, (few, many)


def test_inconclusive_verdicts_say_how_many_seeds_would_decide() -> None:
    rng = np.random.default_rng(22)
    b, cands = trial(rng, 3, 3)
    v = judge(b, cands)
    assert v.outcome == "inconclusive" and v.exit_code == 3
    assert v.plan is not None and v.plan["advice"].startswith("INCONCLUSIVE:")
    assert v.plan["advice"] in v.format_table()
    assert set(v.plan["criteria"]) == {r.name for r in v.results if r.outcome == "inconclusive" and r.role == "primary"}
    p = plan(b)
    assert set(p["criteria"]) == {"curve", "final/loss", "final/accuracy"}
    # the planned counts make the criterion's inequality hold
    e = p["criteria"]["final/loss"]
    if e["seeds_per_side"] is not None:
        k = e["seeds_per_side"]
        df = 2 * k - 2
        crit = scipy.stats.t.ppf(0.95, df) + scipy.stats.t.ppf(0.8, df)
        assert crit * e["sigma"] * math.sqrt(2 / k) <= e["margin"]


def test_curve_is_a_guard_by_default_and_primary_on_request() -> None:
    import dataclasses

    rng = np.random.default_rng(23)
    b, cands = trial(rng, 12, 12)
    v = judge(b, cands)
    curve = next(r for r in v.results if r.name == "curve")
    assert curve.role == "guard"
    strict = dataclasses.replace(b, criteria=dataclasses.replace(b.criteria, curve_role="primary",
                                                                 curve_margin_rel=0.0))
    v2 = judge(strict, cands)
    c2 = next(r for r in v2.results if r.name == "curve")
    assert c2.role == "primary" and c2.outcome != "pass" and v2.outcome != "pass"
