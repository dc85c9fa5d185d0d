"""Measuring the judge's own error rates on real runs.

From a bank of reference runs (one config, many seeds) and a bank of candidate runs, draw trials: each trial
builds a baseline from ``n_baseline`` reference seeds and judges ``n_candidate`` candidate seeds, all seeds of a
trial distinct.  With candidates from the reference config itself (fresh seeds) the FAIL rate is the false-alarm
rate; with a known-bad arm it is the detection rate.  Trials drawn from a finite bank share runs, so they are not
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

from ._baseline import RunData, build_baseline
from ._judge import judge
from ._stats import Criteria


@dataclasses.dataclass(frozen=True)
class ErrorRate:
    """FAIL count over trials, with a two-sided 95% Clopper-Pearson interval and the failing criteria."""

    trials: int
    fails: int
    by_criterion: dict[str, int]

    @property
    def rate(self) -> float:
        return self.fails / self.trials

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        a = (1 - level) / 2
        lo = 0.0 if self.fails == 0 else float(stats.beta.ppf(a, self.fails, self.trials - self.fails + 1))
        hi = 1.0 if self.fails == self.trials else float(stats.beta.ppf(1 - a, self.fails + 1,
                                                                       self.trials - self.fails))
        return lo, hi

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.interval()
        return {"trials": self.trials, "fails": self.fails, "fail_rate": round(self.rate, 4),
                "ci95": [round(lo, 4), round(hi, 4)], "by_criterion": dict(self.by_criterion)}


def _seed(run: RunData) -> int:
    return int(run.manifest["seed"])


def fail_rate(reference: Sequence[RunData], candidates: Sequence[RunData], *, n_baseline: int, n_candidate: int,
              trials: int, rng: np.random.Generator, criteria: Criteria | None = None) -> ErrorRate:
    """Judge ``trials`` random (baseline, candidate) draws; seeds never repeat within a trial.

    ``candidates`` may be ``reference`` itself (the null case: each trial then splits one draw of distinct seeds).
    """
    same = candidates is reference
    if same and len(reference) < n_baseline + n_candidate:
        raise ValueError(f"need >= {n_baseline + n_candidate} reference runs; got {len(reference)}")
    fails, why = 0, Counter[str]()
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
        if not verdict.passed:
            fails += 1
            why.update(r.name for r in verdict.results if not r.passed)
    return ErrorRate(trials=trials, fails=fails, by_criterion=dict(why))
