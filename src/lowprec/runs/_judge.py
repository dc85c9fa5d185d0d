"""The judge: PASS or FAIL of candidate runs against a baseline, with the reason for each criterion.

Criteria (parameters in ``Criteria``, declared with the baseline; methodology in ``docs/accuracy.md``):

* ``completion``: every candidate finished (status "completed") and logged the baseline's number of steps.
* ``divergence``: no candidate has a non-finite training loss or eval metric, a "nonfinite"/"diverged" event, or a
  loss spike (``_stats.find_spike``); a FAIL names the run and the first such step, and, when the runner localised
  the failure (a "nonfinite" event), the module, tensor role, step and values of the first non-finite tensor.
* ``curve``: the mean over candidate seeds of the smoothed training loss stays inside the band around the
  baseline mean on all but ``curve_max_outside`` of the post-warm-up steps.  Band half-width at step t::

      h_t = max(k * pooled_t * sqrt(1/N + 1/M),  rtol * |mean_t|)

  widened further to contain the baseline's own min/max.  ``pooled_t * sqrt(1/N + 1/M)`` is the standard
  deviation of (candidate mean - baseline mean) when both come from the same distribution: the band is a band
  for the candidate *mean*, so it narrows as either side adds seeds.
* ``final/<metric>``: per eval metric, the one-sided margin-shifted Welch test of ``_stats.worse_test`` at level
  ``metric_alpha / number of metrics`` (Bonferroni: the family-wise false-failure rate stays <= metric_alpha).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ._baseline import LOSS_KEY, Baseline, RunData, final_value, planned_steps
from ._stats import find_spike, pooled_std, smooth, worse_test

DIVERGENCE_EVENTS = ("nonfinite", "diverged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriterionResult:
    name: str
    passed: bool
    reason: str
    """One sentence with the numbers that decided."""
    values: dict[str, Any]
    """The numbers behind ``reason`` (JSON-able)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "reason": self.reason, "values": self.values}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    passed: bool
    baseline: str
    candidates: tuple[str, ...]
    """Run ids of the judged candidates."""
    results: tuple[CriterionResult, ...]

    def format_table(self) -> str:
        """Plain-text verdict: a PASS/FAIL headline, then one line per criterion with its reason."""
        head = (f"{'PASS' if self.passed else 'FAIL'}: {len(self.candidates)} candidate run(s) against baseline "
                f"{self.baseline!r}")
        w = max([len("criterion")] + [len(r.name) for r in self.results])
        lines = [head, f"{'criterion':<{w}}  result  reason"]
        lines += [f"{r.name:<{w}}  {'PASS' if r.passed else 'FAIL':<6}  {r.reason}" for r in self.results]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "baseline": self.baseline, "candidates": list(self.candidates),
                "results": [r.to_dict() for r in self.results]}


def judge(baseline: Baseline, candidates: list[RunData]) -> Verdict:
    """Judge candidate seed runs (one recipe, M >= 1 distinct seeds) against ``baseline``.

    ValueError when there is no candidate, when two candidates share a seed, or when a candidate is not
    comparable (``Baseline.check_compatible``).  Everything else is a verdict, never an exception."""
    if not candidates:
        raise ValueError("judge needs at least one candidate run")
    seen: dict[Any, str] = {}
    for run in candidates:
        baseline.check_compatible(run)
        seed = run.manifest.get("seed")
        if seed in seen:
            raise ValueError(f"candidate runs {seen[seed]} and {run.label} share seed {seed!r}; seeds must be "
                             f"distinct (repeats of one seed are not independent samples)")
        seen[seed] = run.label
    results = [_completion(baseline, candidates), _divergence(baseline, candidates), _curve(baseline, candidates)]
    results += _finals(baseline, candidates)
    return Verdict(passed=all(r.passed for r in results), baseline=baseline.name,
                   candidates=tuple(r.run_id for r in candidates), results=tuple(results))


def _loss(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    steps, vals = run.scalars.get(LOSS_KEY, (np.zeros(0, np.int64), np.zeros(0)))
    return np.asarray(steps, dtype=np.int64), np.asarray(vals, dtype=np.float64)


def _completion(b: Baseline, runs: list[RunData]) -> CriterionResult:
    bad = {}
    for r in runs:
        steps, _ = _loss(r)
        last = int(steps[-1]) if len(steps) else 0
        if r.status != "completed" or last < b.steps:
            bad[r.run_id] = f"{r.name!r} ({r.run_id}) status {r.status}, last step {last} of {b.steps}"
    if bad:
        return CriterionResult(name="completion", passed=False, values={"incomplete": bad},
                               reason="not finished: " + "; ".join(bad.values()))
    return CriterionResult(name="completion", passed=True, values={"runs": len(runs), "steps": b.steps},
                           reason=f"all {len(runs)} run(s) completed {b.steps} steps")


def _first_divergence(b: Baseline, run: RunData) -> tuple[int, str] | None:
    """(step, what) of the first divergence sign in one run."""
    found: list[tuple[int, str]] = []
    steps, loss = _loss(run)
    nonfin = np.flatnonzero(~np.isfinite(loss))
    if nonfin.size:
        found.append((int(steps[nonfin[0]]), f"{LOSS_KEY} = {loss[nonfin[0]]!r}"))
    c = b.criteria
    i = find_spike(loss, window=c.spike_window, factor=c.spike_factor, mad_k=c.spike_mad)
    if i is not None:
        prev = loss[max(0, i - c.spike_window):i]
        found.append((int(steps[i]), f"loss spike {loss[i]:.4g} (median of the previous {prev.size} steps "
                                     f"{float(np.median(prev)):.4g})"))
    for key, (st, v) in run.scalars.items():
        if key.startswith("eval/"):
            bad = np.flatnonzero(~np.isfinite(np.asarray(v, dtype=np.float64)))
            if bad.size:
                found.append((int(st[bad[0]]), f"{key} = {float(v[bad[0]])!r}"))
    located = None
    for e in run.events:
        if e.get("kind") == "nonfinite":  # its payload is described below
            found.append((int(e.get("step", 0)), "nonfinite event"))
        elif e.get("kind") in DIVERGENCE_EVENTS:
            found.append((int(e.get("step", 0)), f"{e.get('kind')} event {e.get('payload', {})}"))
        if e.get("kind") == "nonfinite" and located is None and (e.get("payload") or {}).get("found"):
            from ..numerics._localize import describe_payload

            located = f"; first non-finite value: {describe_payload(e['payload'])}"
    if not found:
        return None
    step, what = min(found, key=lambda f: f[0])
    return step, what + (located or "")


def _divergence(b: Baseline, runs: list[RunData]) -> CriterionResult:
    hits = {}
    for r in runs:
        got = _first_divergence(b, r)
        if got is not None:
            hits[r.run_id] = {"run": r.name, "step": got[0], "what": got[1]}
    if hits:
        first = min(hits.values(), key=lambda h: int(h["step"]))  # type: ignore[call-overload]
        reason = "; ".join(f"{h['run']!r} ({rid}) at step {h['step']}: {h['what']}" for rid, h in hits.items())
        return CriterionResult(name="divergence", passed=False, reason="diverged: " + reason,
                               values={"step": first["step"], "runs": hits})
    return CriterionResult(name="divergence", passed=True, values={},
                           reason="all losses and eval metrics finite, no loss spike")


def curve_band(b: Baseline, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) acceptance band per envelope step for the mean of ``m`` candidate seeds."""
    c = b.criteria
    pool = max(1, round(c.curve_pool_fraction * b.env_steps.size))
    sd = pooled_std(b.env_std, pool) * math.sqrt(1.0 / b.n_seeds + 1.0 / m)
    h = np.maximum(c.curve_k * sd, c.curve_rtol * np.abs(b.env_mean))
    return np.minimum(b.env_mean - h, b.env_min), np.maximum(b.env_mean + h, b.env_max)


def candidate_mean_curve(b: Baseline, runs: list[RunData]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, mean over runs of the smoothed train loss) on the envelope steps every run logged."""
    steps = b.env_steps
    curves = []
    for r in runs:
        st, v = _loss(r)
        sm = smooth(v, b.criteria.smoothing_window)
        steps = np.intersect1d(steps, st)
        curves.append((st, sm))
    vals = [sm[np.searchsorted(st, steps)] for st, sm in curves]
    return steps, np.mean(vals, axis=0) if vals else np.zeros(0)


def _curve(b: Baseline, runs: list[RunData]) -> CriterionResult:
    c = b.criteria
    warm = math.ceil(c.warmup_fraction * b.steps)
    steps, cand = candidate_mean_curve(b, runs)
    keep = steps > warm
    steps, cand = steps[keep], cand[keep]
    if steps.size == 0:
        return CriterionResult(name="curve", passed=False, values={"warmup_steps": warm},
                               reason=f"no step after the warm-up ({warm} steps) logged by every candidate")
    lo, hi = curve_band(b, len(runs))
    idx = np.searchsorted(b.env_steps, steps)
    above = ~(cand <= hi[idx])  # NaN counts as outside
    below = cand < lo[idx]
    out = above | below
    frac = float(out.mean())
    passed = frac <= c.curve_max_outside
    vals = {"judged_steps": int(steps.size), "outside": int(out.sum()), "above": int(above.sum()),
            "below": int(below.sum()), "fraction_outside": frac, "allowed": c.curve_max_outside,
            "warmup_steps": warm, "first_outside_step": int(steps[out][0]) if out.any() else None}
    if out.any():
        i = int(np.argmax(np.where(out, np.abs(cand - b.env_mean[idx]), -1.0)))
        vals["worst_step"] = int(steps[i])
        vals["worst_rel_diff"] = float((cand[i] - b.env_mean[idx][i]) / abs(b.env_mean[idx][i]))
    detail = (f"{int(out.sum())} of {steps.size} steps after warm-up outside the band ({frac:.1%}; "
              f"{int(above.sum())} above, {int(below.sum())} below; allowed {c.curve_max_outside:.1%})")
    if out.any():
        detail += (f", first at step {vals['first_outside_step']}, worst at step {vals['worst_step']} "
                   f"({vals['worst_rel_diff']:+.2%} vs baseline mean)")
    return CriterionResult(name="curve", passed=passed, reason=detail, values=vals)


def _finals(b: Baseline, runs: list[RunData]) -> list[CriterionResult]:
    c = b.criteria
    names = list(c.metrics) if c.metrics is not None else list(b.metrics)
    alpha = c.metric_alpha / len(names)
    out = []
    for m in names:
        name = f"final/{m}"
        direction = b.metrics[m]
        base = b.finals[m]
        got = {r.run_id: final_value(r, m) for r in runs}
        missing = [r.run_id for r in runs if (g := got[r.run_id]) is None or g[0] != planned_steps(r)]
        ys = np.asarray([g[1] for g in got.values() if g is not None], dtype=np.float64)
        if missing or not np.isfinite(ys).all():
            out.append(CriterionResult(name=name, passed=False, values={"missing": missing},
                                       reason=f"no finite final eval/{m} at the last step for run(s) "
                                              f"{', '.join(missing) or 'with non-finite values'}"))
            continue
        xbar = float(base.mean())
        sx = float(base.std(ddof=1))
        margin = max(c.metric_margin_rel * abs(xbar), c.metric_margin_std * sx)
        t = worse_test(base, ys, direction=direction, margin=margin)
        passed = not t.p < alpha
        vals = {"direction": direction, "baseline_mean": xbar, "baseline_std": sx, "n_baseline": int(base.size),
                "candidate_mean": float(ys.mean()), "candidate_std": float(ys.std(ddof=1)) if ys.size > 1 else None,
                "n_candidate": int(ys.size), "worse_by": t.diff, "margin": margin, "se": t.se,
                "df": t.df if math.isfinite(t.df) else None, "t": t.t if math.isfinite(t.t) else None,
                "p": t.p, "alpha": alpha, "method": t.method}
        better = "lower" if direction == "min" else "higher"
        head = (f"candidate mean {ys.mean():.6g} vs baseline {xbar:.6g} ± {sx:.3g} ({better} is better): "
                f"worse by {t.diff:.4g}, margin {margin:.4g}")
        if t.method == "exact":
            why = f"; every value equal on each side, so compared exactly: {'above' if not passed else 'within'} margin"
        else:
            why = (f"; {t.method} t = {t.t:.3f}, df = {t.df:.1f}, p = {t.p:.3g} "
                   f"{'<' if not passed else '>='} alpha {alpha:.3g}")
        out.append(CriterionResult(name=name, passed=passed, reason=head + why, values=vals))
    return out

