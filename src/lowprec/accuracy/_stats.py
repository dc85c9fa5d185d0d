"""The statistics behind baselines and the judge (smoothing, pooled spread, a margin-shifted Welch test, loss
spikes) and the ``Criteria`` that set their parameters.

Smoothing.  A training loss logged per step is the loss of one batch: noisy.  The envelope and the curve check use
a trailing moving average of width ``w``::

    smooth(x)_t = mean(x_{max(1, t-w+1)} .. x_t)

(trailing, so step ``t`` only depends on steps ``<= t``, like what an operator watches live; the first ``w-1``
steps average fewer values, which is why the curve check skips a warm-up).

Pooled spread.  The seed-to-seed standard deviation ``s_t`` of the smoothed loss at one step is estimated from N
seeds: ``N - 1`` degrees of freedom, far too few (with N = 2, ``s_t`` is below 10% of the true sigma at about 8% of
steps), and neighbouring steps share their error (smoothing, and seed effects that persist for many steps).  The
spread of a training curve changes slowly with the step, so the curve band uses the root mean square of ``s`` over
a wide centred window of ``p`` steps (default: half the run)::

    pooled_t = sqrt(mean(s_{t-p/2} .. s_{t+p/2} ** 2))

Worse-direction Welch test with a margin.  Baseline seeds ``x_1..x_N``, candidate seeds ``y_1..y_M`` of a metric,
``d = ybar - xbar`` for a metric where lower is better (``xbar - ybar`` where higher is better), margin ``delta >=
0``.  Null hypothesis: the candidate is at most ``delta`` worse.  FAIL when the data show it is worse by more::

    t = (d - delta) / se,   se = sqrt(s_x^2/N + s_y^2/M),
    df = se^4 / ((s_x^2/N)^2/(N-1) + (s_y^2/M)^2/(M-1))      (Welch-Satterthwaite)
    p = P(T_df >= t),  FAIL iff p < alpha

With one candidate seed there is no ``s_y``: the test assumes the candidate's seed-to-seed variance equals the
baseline's (the usual prediction-interval test): ``se = s_x sqrt(1/N + 1)``, ``df = N - 1``.  When ``se`` is zero
(every seed on both sides gave the same value, e.g. identical accuracies of a deterministic model) no test is
possible and none is needed: FAIL iff ``d > delta`` exactly.

Three outcomes (``margin_test``).  A test that can only FAIL passes whatever it cannot see: with few or noisy
seeds, a candidate ten points worse would PASS.  So a PASS needs its own evidence, the mirror test of the one
above (a non-inferiority test): null hypothesis "the candidate is worse by ``delta`` or more", rejected when the
one-sided ``1 - pass_alpha`` upper confidence bound of ``d`` is below the margin::

    upper = d + t_{1-pass_alpha, df} se  <  delta       -> PASS   (evidence: at most ``upper`` worse)
    lower = d - t_{1-fail_alpha, df} se  >  delta       -> FAIL   (evidence: at least ``lower`` worse)
    otherwise                                           -> INCONCLUSIVE (the data cannot tell)

``lower > delta`` is the worse-direction test above (``p < fail_alpha``).  Both bounds cannot hold at once when
the alphas are at most 0.5.  ``pass_alpha`` is the false-PASS rate of a candidate exactly ``delta`` worse (less
for a candidate worse than that); ``fail_alpha`` the false-FAIL rate of one exactly ``delta`` worse.

What the seeds can see.  For a power of ``1 - beta``, a candidate that is truly ``Delta`` worse PASSes with
probability ``1 - beta`` when ``delta - Delta >= (t_{1-pass_alpha} + t_{1-beta}) se``, and FAILs with that
probability when ``Delta - delta >= (t_{1-fail_alpha} + t_{1-beta}) se``.  With ``se`` estimated from the data,
``passable = (t_{1-pass_alpha} + t_{1-beta}) se`` is the smallest margin an equal candidate clears, and
``delta + (t_{1-fail_alpha} + t_{1-beta}) se`` the smallest regression the seeds catch.  ``seeds_needed`` turns
the same inequality around: with seed standard deviation ``sigma`` on both sides, the smallest number of
candidate seeds ``M`` (baseline seeds fixed at ``N``, or ``N = M``) with
``(t_{1-alpha, N+M-2} + t_{1-beta, N+M-2}) sigma sqrt(1/N + 1/M) <= |delta - Delta|``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np
import scipy.stats

from .._checks import check_float, check_int, check_literal, literal_values
from .._errors import UsageError
from .._types import DIRECTIONS as DIRECTIONS  # re-exported: the judge's metric directions
from .._types import Direction as Direction

CurveRole = Literal["guard", "primary"]
"""``Criteria.curve_role``: whether the loss curve can only FAIL a verdict ("guard") or must PASS too ("primary")."""
CURVE_ROLES: tuple[str, ...] = literal_values(CurveRole)
TestMethod = Literal["welch", "prediction", "exact"]
"""How a ``WorseTest`` / ``MarginTest`` got its ``se``: Welch, the one-candidate prediction form, or exact."""


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average of a 1-D float array (length kept); ``window = 1`` returns a copy.

    Non-finite values propagate into every average that contains them (a NaN is never smoothed away)."""
    x = np.asarray(values, dtype=np.float64)
    check_int(window, "window", 1)
    if x.size == 0 or window == 1:
        return x.copy()
    bad = ~np.isfinite(x)
    c = np.concatenate(([0.0], np.cumsum(np.where(bad, 0.0, x))))
    nbad = np.concatenate(([0], np.cumsum(bad)))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - window)
    out = (c[idx] - c[lo]) / (idx - lo)
    out[(nbad[idx] - nbad[lo]) > 0] = np.nan
    return out


def pooled_std(std: np.ndarray, window: int) -> np.ndarray:
    """Root mean square of ``std`` over a centred window of ``window`` steps (shrunk at the ends)."""
    s2 = np.asarray(std, dtype=np.float64) ** 2
    n = s2.size
    half = window // 2
    c = np.concatenate(([0.0], np.cumsum(s2)))
    i = np.arange(n)
    lo = np.maximum(0, i - half)
    hi = np.minimum(n, i + half + 1)
    return np.sqrt((c[hi] - c[lo]) / (hi - lo))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorseTest:
    """Result of :func:`worse_test`."""

    diff: float
    """How much worse the candidate mean is (positive: worse)."""
    margin: float
    se: float
    """Standard error of ``diff`` (0 when every value on both sides is equal)."""
    df: float
    """Degrees of freedom of the t reference (inf in the zero-variance fall-back)."""
    t: float
    p: float
    """One-sided p-value of ``diff <= margin``; 0 or 1 in the zero-variance fall-back."""
    method: TestMethod
    """"welch", "prediction" (one candidate seed) or "exact" (zero variance)."""


def worse_test(base: np.ndarray, cand: np.ndarray, *, direction: Direction, margin: float) -> WorseTest:
    """One-sided, margin-shifted Welch t test that ``cand`` is worse than ``base`` by more than ``margin``.

    ``base``: N >= 2 finite values; ``cand``: M >= 1 finite values; ``direction``: "min" (lower is better) or
    "max".  See the module docstring for the formulas and fall-backs."""
    x = np.asarray(base, dtype=np.float64)
    y = np.asarray(cand, dtype=np.float64)
    n, m = x.size, y.size
    if n < 2 or m < 1:
        raise UsageError(f"worse_test needs >= 2 baseline and >= 1 candidate values; got {n} and {m}")
    check_literal(direction, "direction", Direction)
    sign = 1.0 if direction == "min" else -1.0
    diff = sign * (float(y.mean()) - float(x.mean()))
    vx = float(x.var(ddof=1))
    scale = max(float(np.abs(x).max()), float(np.abs(y).max()), 1e-300)
    method: TestMethod
    if m == 1:
        se = math.sqrt(vx * (1.0 / n + 1.0))
        df, method = float(n - 1), "prediction"
    else:
        vy = float(y.var(ddof=1))
        a, b = vx / n, vy / m
        se = math.sqrt(a + b)
        den = (a * a / (n - 1) if a else 0.0) + (b * b / (m - 1) if b else 0.0)
        df = (a + b) ** 2 / den if den > 0 else math.inf
        method = "welch"
    if se <= 1e-12 * scale:  # every value equal on both sides (to rounding): compare exactly
        worse = diff > margin
        return WorseTest(diff=diff, margin=margin, se=0.0, df=math.inf, t=math.inf if worse else -math.inf,
                         p=0.0 if worse else 1.0, method="exact")
    t = (diff - margin) / se
    p = float(scipy.stats.t.sf(t, df))
    return WorseTest(diff=diff, margin=margin, se=se, df=df, t=t, p=p, method=method)


Outcome = Literal["pass", "fail", "inconclusive"]
"""The outcome of a test: ``"pass"``, ``"fail"`` or ``"inconclusive"``."""
OUTCOMES: tuple[str, ...] = literal_values(Outcome)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarginTest:
    """Result of :func:`margin_test`: both one-sided bounds of how much worse the candidate is, and the outcome."""

    diff: float
    """How much worse the candidate mean is (positive: worse)."""
    margin: float
    se: float
    df: float
    method: TestMethod
    """"welch", "prediction" (one candidate seed) or "exact" (zero variance)."""
    upper: float
    """One-sided ``1 - pass_alpha`` upper confidence bound of ``diff``: the candidate is at most this much worse."""
    lower: float
    """One-sided ``1 - fail_alpha`` lower confidence bound of ``diff``: the candidate is at least this much worse."""
    p_worse: float
    """p-value of "at most ``margin`` worse" (small: evidence of a FAIL)."""
    p_within: float
    """p-value of "``margin`` or more worse" (small: evidence of a PASS)."""
    outcome: Outcome
    passable: float
    """Smallest margin a candidate equal to the baseline would clear with the requested power at this ``se``."""
    detectable: float
    """Smallest regression (``diff``) these seeds FAIL with the requested power: ``margin + (t + t_power) se``."""


def margin_test(base: np.ndarray, cand: np.ndarray, *, direction: Direction, margin: float, pass_alpha: float,
                fail_alpha: float, power: float = 0.8) -> MarginTest:
    """PASS / FAIL / INCONCLUSIVE of ``cand`` against ``base`` with a declared ``margin`` (module docstring).

    ``se`` and ``df`` are those of :func:`worse_test` (Welch; the prediction form for one candidate seed; exact
    comparison when every value is equal)."""
    w = worse_test(base, cand, direction=direction, margin=margin)
    if w.method == "exact":
        out: Outcome = "pass" if w.diff <= margin else "fail"
        return MarginTest(diff=w.diff, margin=margin, se=0.0, df=math.inf, method="exact", upper=w.diff,
                          lower=w.diff, p_worse=w.p, p_within=1.0 - w.p, outcome=out, passable=0.0,
                          detectable=margin)
    tp = float(scipy.stats.t.ppf(1.0 - pass_alpha, w.df))
    tf = float(scipy.stats.t.ppf(1.0 - fail_alpha, w.df))
    tb = float(scipy.stats.t.ppf(power, w.df))
    upper, lower = w.diff + tp * w.se, w.diff - tf * w.se
    outcome: Outcome = "pass" if upper < margin else "fail" if lower > margin else "inconclusive"
    return MarginTest(diff=w.diff, margin=margin, se=w.se, df=w.df, method=w.method, upper=upper, lower=lower,
                      p_worse=w.p, p_within=float(scipy.stats.t.cdf(w.t, w.df)), outcome=outcome,
                      passable=(tp + tb) * w.se, detectable=margin + (tf + tb) * w.se)


def seeds_needed(sigma: float, gap: float, *, alpha: float, power: float, n_baseline: int | None,
                 limit: int = 10_000) -> int | None:
    """Smallest candidate seed count ``M`` whose test reaches ``power`` for a true distance ``gap`` (> 0) between
    the candidate's difference and the margin (module docstring), with ``n_baseline`` baseline seeds; with
    ``n_baseline=None`` both sides get ``M`` seeds.  None when no ``M <= limit`` does (then the baseline needs more
    seeds: ``sigma sqrt(1/N)`` alone is too large).  ``sigma = 0`` needs one seed."""
    if gap <= 0:
        return None
    if sigma <= 0:
        return 1

    def enough(m: int) -> bool:
        n = m if n_baseline is None else n_baseline
        df = max(n + m - 2, 1)
        crit = float(scipy.stats.t.ppf(1.0 - alpha, df)) + float(scipy.stats.t.ppf(power, df))
        return crit * sigma * math.sqrt(1.0 / n + 1.0 / m) <= gap

    lo = 2 if n_baseline is None else 1
    if not enough(limit):
        return None
    hi = limit
    while lo < hi:  # the left side decreases in m: bisect for the first m that is enough
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_spike(values: np.ndarray, *, window: int, factor: float, mad_k: float) -> int | None:
    """Index of the first loss spike, or None.

    Only values before the first non-finite one are searched (that one is reported by itself).  Index ``t`` is a
    spike when it exceeds the median ``med`` of the previous ``window`` values (at least ``min(window, 5)`` of
    them) both relatively and robustly::

        x_t - med > (factor - 1) |med|   and   x_t - med > mad_k * 1.4826 * MAD

    (MAD: median absolute deviation of that window; ``1.4826 MAD`` estimates a normal sigma).  Both must hold, so
    neither a noisy-but-healthy loss nor a tiny rise of a very flat loss counts."""
    x = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:  # only finite values before the first non-finite one can be spikes worth naming
        x = x[: bad[0]]
    need = min(window, 5)
    for i in range(need, min(window, x.size)):  # short history at the start
        if is_spike(x[i], x[:i], factor, mad_k):
            return i
    if x.size <= window:
        return None
    w = np.lib.stride_tricks.sliding_window_view(x[:-1], window)  # w[j] = x[j : j + window], precedes x[j+window]
    med = np.median(w, axis=1)
    mad = np.median(np.abs(w - med[:, None]), axis=1)
    v = x[window:]
    hit = (v - med > (factor - 1.0) * np.abs(med)) & (v - med > mad_k * 1.4826 * mad)
    j = np.flatnonzero(hit)
    return int(j[0]) + window if j.size else None


def is_spike(v: float, hist: np.ndarray, factor: float, mad_k: float) -> bool:
    """Whether ``v`` is a spike against the history ``hist`` (``find_spike``'s rule; also the training-time
    detector's, ``lowprec.reliability``)."""
    med = float(np.median(hist))
    mad = float(np.median(np.abs(hist - med)))
    return bool(v - med > (factor - 1.0) * abs(med) and v - med > mad_k * 1.4826 * mad)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Criteria:
    """Acceptance criteria, declared when the baseline is created and stored with it.

    Defaults and why: ``docs/accuracy.md`` (the synthetic false-alarm and detection rates are measured by
    ``tests/test_judge.py``)."""

    smoothing_window: int = 20
    """Trailing moving-average width (steps) applied to ``train/loss`` before the envelope and the curve check."""
    warmup_fraction: float = 0.1
    """The first ``ceil(warmup_fraction * steps)`` steps are not curve-checked (fast early drop, short windows)."""
    curve_margin_rel: float = 0.02
    """The curve's margin: how much higher than the baseline mean the candidates' mean smoothed loss may be, as a
    fraction of the baseline mean (2%), at each judged step."""
    curve_role: CurveRole = "guard"
    """"guard": the curve can FAIL a verdict (evidence that the trajectory is worse than its margin) but need not
    show equivalence for a PASS, which rests on the final metrics; the smoothed training loss varies much more
    between seeds than a final eval metric (±11% against ±2% of the eval loss on mlp-digits), so with a few seeds
    it could rarely show it.  "primary": a PASS needs the curve to PASS too."""
    curve_k: float = 5.0
    """A step is beyond the margin when the candidate mean is above ``margin + k se_t`` (``se_t = s_t sqrt(1/N +
    1/M)`` with the pooled seed spread): the FAIL side's critical value, large because the pooled spread from a
    few seeds has few effective degrees of freedom (calibrated on real runs, docs/accuracy.md)."""
    curve_pool_fraction: float = 0.5
    """Width, as a fraction of the logged steps, of the centred window over which the per-step seed standard
    deviation is pooled (root mean square)."""
    curve_max_outside: float = 0.05
    """Allowance: the curve PASSes when at least ``1 - curve_max_outside`` of the judged steps are shown within the
    margin, and FAILs when more than this fraction are shown beyond it."""
    metric_alpha: float = 0.04
    """Family-wise false-FAIL rate of the final-metric tests (Bonferroni: alpha / number of metrics each)."""
    pass_alpha: float = 0.05
    """False-PASS rate of each criterion for a candidate exactly at its margin (the upper bounds are one-sided
    ``1 - pass_alpha`` bounds); no correction over criteria is needed: a PASS needs every criterion to pass."""
    power: float = 0.8
    """The power that the seed counts of ``lowprec plan`` and of an INCONCLUSIVE verdict's advice aim for."""
    metric_margin_rel: float = 0.01
    """Margin: a candidate may be worse by this fraction of the baseline mean (1%) ..."""
    metric_margin_std: float = 0.0
    """... or by this many baseline seed standard deviations, whichever is larger."""
    metric_margins: tuple[tuple[str, float], ...] | None = None
    """Per-metric relative margins that replace ``metric_margin_rel`` for the metrics they name, e.g.
    ``{"loss": 0.05, "accuracy": 0.01}`` in TOML/JSON (``[criteria.metric_margins]``): what matters differs per
    metric (1% of an accuracy is a point; 1% of a loss is often below the seed noise)."""
    spike_factor: float = 1.5
    """A loss spike is a step whose raw loss exceeds the median of the previous ``spike_window`` steps by this
    factor ..."""
    spike_mad: float = 10.0
    """... and by this many robust standard deviations (1.4826 MAD) of that window."""
    spike_window: int = 20
    metrics: tuple[str, ...] | None = None
    """Eval metrics to judge (names without ``eval/``); None: every metric of the baseline."""
    min_loss_drop: float = 0.05
    """A reference that did not train is not a baseline: its mean smoothed training loss at the last step must be
    at least this fraction (5%) below its early value (the first full smoothing window, at most a tenth of the
    run in), ``(early - final) / |early| >= min_loss_drop``.  A flat reference (a learning rate of 0, frozen weights,
    shuffled labels) is refused by ``build_baseline`` and FAILs the judge's "baseline" guard; 0 turns it off
    (fine-tuning a converged model, say)."""
    min_judged_steps: int = 5
    """Fewest logged ``train/loss`` steps after the warm-up, common to the baseline and every candidate, that the
    curve is judged on: a baseline with fewer is refused, a candidate with fewer FAILs "completion" (a run that
    logs its loss every 100 steps of 500 leaves 4 points after a 10% warm-up: too few to tell a trajectory from
    noise)."""

    def __post_init__(self) -> None:
        check_int(self.smoothing_window, "criteria.smoothing_window", 1)
        check_float(self.warmup_fraction, "criteria.warmup_fraction", 0.0, 0.9)
        check_float(self.curve_margin_rel, "criteria.curve_margin_rel", 0.0)
        check_float(self.curve_k, "criteria.curve_k", 0.0, open_lo=True)
        check_literal(self.curve_role, "criteria.curve_role", CurveRole)
        check_float(self.curve_pool_fraction, "criteria.curve_pool_fraction", 0.0, 1.0)
        check_float(self.curve_max_outside, "criteria.curve_max_outside", 0.0, 1.0)
        check_float(self.metric_alpha, "criteria.metric_alpha", 0.0, 0.5, open_lo=True)
        check_float(self.pass_alpha, "criteria.pass_alpha", 0.0, 0.5, open_lo=True)
        check_float(self.power, "criteria.power", 0.5, 0.999, open_lo=True)
        check_float(self.metric_margin_rel, "criteria.metric_margin_rel", 0.0)
        check_float(self.metric_margin_std, "criteria.metric_margin_std", 0.0)
        check_float(self.spike_factor, "criteria.spike_factor", 1.0, open_lo=True)
        check_float(self.spike_mad, "criteria.spike_mad", 0.0)
        check_int(self.spike_window, "criteria.spike_window", 2)
        check_float(self.min_loss_drop, "criteria.min_loss_drop", 0.0, 1.0)
        check_int(self.min_judged_steps, "criteria.min_judged_steps", 1)
        if self.metric_margins is not None:
            pairs = isinstance(self.metric_margins, tuple) and all(
                isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) and kv[0] for kv in
                self.metric_margins)
            if not pairs:
                raise UsageError("criteria.metric_margins must map metric names to relative margins, e.g. "
                                 f"{{\"loss\": 0.05}}; got {self.metric_margins!r}")
            for name, value in self.metric_margins:
                check_float(value, f"criteria.metric_margins.{name}", 0.0)
        if self.metrics is not None:
            ok = isinstance(self.metrics, tuple) and self.metrics and all(
                isinstance(m, str) and m for m in self.metrics)
            if not ok or len(set(self.metrics)) != len(self.metrics):
                raise UsageError(f"criteria.metrics must be None or a non-empty tuple of distinct metric names; "
                                 f"got {self.metrics!r}")

    def margin_rel(self, metric: str) -> float:
        """The relative margin of ``metric``: its ``metric_margins`` entry, else ``metric_margin_rel``."""
        return dict(self.metric_margins or ()).get(metric, self.metric_margin_rel)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metrics"] = None if self.metrics is None else list(self.metrics)
        d["metric_margins"] = None if self.metric_margins is None else dict(self.metric_margins)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Criteria:
        """Strict: unknown keys are an error; missing keys take the defaults of the current version."""
        if not isinstance(data, dict):
            raise UsageError(f"criteria must be an object; got {type(data).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - allowed - {"curve_rtol"})
        if extra:
            raise UsageError(f"criteria: unknown key(s) {extra}; allowed: {sorted(allowed)}")
        kw = dict(data)
        if "curve_rtol" in kw:  # the band floor of baselines made before the margin test: it was the curve margin
            legacy = kw.pop("curve_rtol")
            kw.setdefault("curve_margin_rel", legacy)
        if isinstance(kw.get("metric_margins"), dict):
            kw["metric_margins"] = tuple(sorted(kw["metric_margins"].items()))
        if isinstance(kw.get("metrics"), list):
            kw["metrics"] = tuple(kw["metrics"])
        return cls(**kw)
