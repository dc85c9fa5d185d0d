"""Measuring the judge's own error rates on real runs.

From a bank of reference runs (one config, many seeds) and a bank of candidate runs, draw trials: each trial
builds a baseline from ``n_baseline`` reference seeds and judges ``n_candidate`` candidate seeds, all seeds of a
trial distinct, and counts the verdicts' outcomes.  With candidates from the reference config itself (fresh seeds)
the FAIL rate is the false-FAIL rate and the PASS rate the power; with a known-bad arm (truly worse than the
margin) the FAIL rate is the detection rate and the PASS rate the false-PASS rate; INCONCLUSIVE is what the seeds
could not decide.  Trials drawn from a finite bank share runs, so they are not
independent: the binomial interval reported is for the trials, and the bank size bounds what it can say (report
both).  Used by ``benchmarks/judge_accuracy.py`` and by the tests.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from .._errors import UsageError
from ._baseline import RunData, build_baseline
from ._judge import judge
from ._stats import Criteria


def _interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval of a binomial proportion ``k / n``."""
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


@dataclasses.dataclass(frozen=True)
class ErrorRate:
    """Verdict outcomes over trials, with two-sided 95% Clopper-Pearson intervals and the FAILing criteria."""

    trials: int
    fails: int
    by_criterion: dict[str, int]
    passes: int = 0
    inconclusive: int = 0

    @property
    def rate(self) -> float:
        """The FAIL rate."""
        return self.fails / self.trials

    @property
    def pass_rate(self) -> float:
        return self.passes / self.trials

    @property
    def inconclusive_rate(self) -> float:
        return self.inconclusive / self.trials

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        """Interval of the FAIL rate."""
        return _interval(self.fails, self.trials, level)

    def to_dict(self) -> dict[str, Any]:
        def r(x: tuple[float, float]) -> list[float]:
            return [round(x[0], 4), round(x[1], 4)]

        return {"trials": self.trials,
                "fail": self.fails, "fail_rate": round(self.rate, 4), "fail_ci95": r(self.interval()),
                "pass": self.passes, "pass_rate": round(self.pass_rate, 4),
                "pass_ci95": r(_interval(self.passes, self.trials)),
                "inconclusive": self.inconclusive, "inconclusive_rate": round(self.inconclusive_rate, 4),
                "inconclusive_ci95": r(_interval(self.inconclusive, self.trials)),
                "failing_criteria": dict(self.by_criterion)}


def _seed(run: RunData) -> int:
    return int(run.manifest["seed"])


def fail_rate(reference: Sequence[RunData], candidates: Sequence[RunData], *, n_baseline: int, n_candidate: int,
              trials: int, rng: np.random.Generator, criteria: Criteria | None = None) -> ErrorRate:
    """Judge ``trials`` random (baseline, candidate) draws and count their outcomes; seeds never repeat within a
    trial.

    ``candidates`` may be ``reference`` itself (the null case: each trial then splits one draw of distinct seeds).
    """
    same = candidates is reference
    if same and len(reference) < n_baseline + n_candidate:
        raise UsageError(f"need >= {n_baseline + n_candidate} reference runs; got {len(reference)}")
    counts, why = Counter[str](), Counter[str]()
    for _ in range(trials):
        if same:
            pick = rng.choice(len(reference), n_baseline + n_candidate, replace=False)
            base = [reference[i] for i in pick[:n_baseline]]
            cand = [reference[i] for i in pick[n_baseline:]]
        else:
            base = [reference[i] for i in rng.choice(len(reference), n_baseline, replace=False)]
            used = {_seed(r) for r in base}
            pool = [r for r in candidates if _seed(r) not in used]
            cand = [pool[i] for i in rng.choice(len(pool), n_candidate, replace=False)]
        verdict = judge(build_baseline("trial", base, criteria=criteria), cand)
        counts[verdict.outcome] += 1
        why.update(r.name for r in verdict.results if r.outcome == "fail")
    return ErrorRate(trials=trials, fails=counts["fail"], by_criterion=dict(why), passes=counts["pass"],
                     inconclusive=counts["inconclusive"])
