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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import scipy.stats

from ._checks import check_float, check_int


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average of a 1-D float array (length kept); ``window = 1`` returns a copy.

    Non-finite values propagate into every average that contains them (a NaN is never smoothed away)."""
    x = np.asarray(values, dtype=np.float64)
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
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
    method: str
    """"welch", "prediction" (one candidate seed) or "exact" (zero variance)."""


def worse_test(base: np.ndarray, cand: np.ndarray, *, direction: str, margin: float) -> WorseTest:
    """One-sided, margin-shifted Welch t test that ``cand`` is worse than ``base`` by more than ``margin``.

    ``base``: N >= 2 finite values; ``cand``: M >= 1 finite values; ``direction``: "min" (lower is better) or
    "max".  See the module docstring for the formulas and fall-backs."""
    x = np.asarray(base, dtype=np.float64)
    y = np.asarray(cand, dtype=np.float64)
    n, m = x.size, y.size
    if n < 2 or m < 1:
        raise ValueError(f"worse_test needs >= 2 baseline and >= 1 candidate values; got {n} and {m}")
    sign = 1.0 if direction == "min" else -1.0
    diff = sign * (float(y.mean()) - float(x.mean()))
    vx = float(x.var(ddof=1))
    scale = max(float(np.abs(x).max()), float(np.abs(y).max()), 1e-300)
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
        if _is_spike(x[i], x[:i], factor, mad_k):
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


def _is_spike(v: float, hist: np.ndarray, factor: float, mad_k: float) -> bool:
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
    curve_k: float = 5.0
    """Band half-width in pooled standard deviations of the difference of two means: ``k s sqrt(1/N + 1/M)``."""
    curve_rtol: float = 0.005
    """Floor of the band half-width, relative to the baseline mean loss (covers N = 2 and zero variance)."""
    curve_pool_fraction: float = 0.5
    """Width, as a fraction of the logged steps, of the centred window over which the per-step seed standard
    deviation is pooled (root mean square)."""
    curve_max_outside: float = 0.05
    """Allowance: the curve check fails when more than this fraction of judged steps are outside the band."""
    metric_alpha: float = 0.04
    """Family-wise false-failure rate of the final-metric tests (Bonferroni: alpha / number of metrics each)."""
    metric_margin_rel: float = 0.0025
    """Margin: a candidate may be worse by this fraction of the baseline mean (0.25%) ..."""
    metric_margin_std: float = 0.0
    """... or by this many baseline seed standard deviations, whichever is larger."""
    spike_factor: float = 1.5
    """A loss spike is a step whose raw loss exceeds the median of the previous ``spike_window`` steps by this
    factor ..."""
    spike_mad: float = 10.0
    """... and by this many robust standard deviations (1.4826 MAD) of that window."""
    spike_window: int = 20
    metrics: tuple[str, ...] | None = None
    """Eval metrics to judge (names without ``eval/``); None: every metric of the baseline."""

    def __post_init__(self) -> None:
        check_int(self.smoothing_window, "criteria.smoothing_window", 1)
        check_float(self.warmup_fraction, "criteria.warmup_fraction", 0.0, 0.9)
        check_float(self.curve_k, "criteria.curve_k", 0.0, open_lo=True)
        check_float(self.curve_rtol, "criteria.curve_rtol", 0.0)
        check_float(self.curve_pool_fraction, "criteria.curve_pool_fraction", 0.0, 1.0)
        check_float(self.curve_max_outside, "criteria.curve_max_outside", 0.0, 1.0)
        check_float(self.metric_alpha, "criteria.metric_alpha", 0.0, 0.5, open_lo=True)
        check_float(self.metric_margin_rel, "criteria.metric_margin_rel", 0.0)
        check_float(self.metric_margin_std, "criteria.metric_margin_std", 0.0)
        check_float(self.spike_factor, "criteria.spike_factor", 1.0, open_lo=True)
        check_float(self.spike_mad, "criteria.spike_mad", 0.0)
        check_int(self.spike_window, "criteria.spike_window", 2)
        if self.metrics is not None:
            ok = isinstance(self.metrics, tuple) and self.metrics and all(
                isinstance(m, str) and m for m in self.metrics)
            if not ok or len(set(self.metrics)) != len(self.metrics):
                raise ValueError(f"criteria.metrics must be None or a non-empty tuple of distinct metric names; "
                                 f"got {self.metrics!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["metrics"] = None if self.metrics is None else list(self.metrics)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Criteria:
        """Strict: unknown keys are an error; missing keys take the defaults of the current version."""
        if not isinstance(data, dict):
            raise ValueError(f"criteria must be an object; got {type(data).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - allowed)
        if extra:
            raise ValueError(f"criteria: unknown key(s) {extra}; allowed: {sorted(allowed)}")
        kw = dict(data)
        if isinstance(kw.get("metrics"), list):
            kw["metrics"] = tuple(kw["metrics"])
        return cls(**kw)
