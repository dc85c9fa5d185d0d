"""Accuracy judgement: is a low-precision run as accurate as its baseline, with evidence?

A **baseline** is fixed before any candidate is seen: the per-step seed statistics of the reference's smoothed
training loss, its final eval metrics per seed, and the ``Criteria`` (margins, error rates, power) the candidate
will be judged by.  ``judge`` gives each criterion one of three outcomes (PASS with evidence that the candidate is
within the margin, a one-sided Welch upper bound below it; FAIL with evidence that it is worse than the margin;
INCONCLUSIVE otherwise, with the seeds that would decide it) and combines them into a ``Verdict``.  ``plan`` says
how many seeds a comparison needs; ``write_report`` renders the HTML report a person reads.

This package reads runs (from ``lowprec.runs.RunStore``, whichever loop or tool wrote them) and never trains;
nothing in it imports torch.  A CI gate in pytest::

    from lowprec import accuracy
    from lowprec.runs import RunStore

    with RunStore("runs.db") as store:
        baseline = accuracy.load_baseline(store, "fp32")
        verdicts = accuracy.judge_groups(baseline, accuracy.select_runs(store, ["fp8-arm"]))
    assert all(v.outcome == "pass" for v in verdicts), "\\n".join(v.format_table() for v in verdicts)
"""

from ._baseline import Baseline as Baseline
from ._baseline import RunData as RunData
from ._baseline import build_baseline as build_baseline
from ._calibrate import ErrorRate as ErrorRate
from ._calibrate import fail_rate as fail_rate
from ._judge import EXIT_CODES as EXIT_CODES
from ._judge import CriterionResult as CriterionResult
from ._judge import Verdict as Verdict
from ._judge import check_alike as check_alike
from ._judge import judge as judge
from ._plan import format_plan as format_plan
from ._plan import plan as plan
from ._report import write_report as write_report
from ._stats import Criteria as Criteria
from ._stats import MarginTest as MarginTest
from ._stats import margin_test as margin_test
from ._stats import seeds_needed as seeds_needed
from ._workflow import baseline_from_runs as baseline_from_runs
from ._workflow import judge_groups as judge_groups
from ._workflow import load_baseline as load_baseline
from ._workflow import select_runs as select_runs

__all__ = [
    "EXIT_CODES",
    "Baseline",
    "Criteria",
    "CriterionResult",
    "ErrorRate",
    "MarginTest",
    "RunData",
    "Verdict",
    "baseline_from_runs",
    "build_baseline",
    "check_alike",
    "fail_rate",
    "format_plan",
    "judge",
    "judge_groups",
    "load_baseline",
    "margin_test",
    "plan",
    "seeds_needed",
    "select_runs",
    "write_report",
]
