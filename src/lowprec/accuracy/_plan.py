"""How many seeds decide a comparison: the planning side of the judge's margin tests.

A criterion can PASS only when its upper confidence bound falls below the margin, which needs
``(t_{1-pass_alpha} + t_{power}) * sigma * sqrt(1/N + 1/M) <= margin - Delta`` (``_stats.seeds_needed``), with
``sigma`` the seed-to-seed standard deviation and ``Delta`` the true difference (0: the candidate is as good as
the baseline).  From the baseline's own seed spread this gives, before any candidate is trained:

* the candidate seeds ``M`` that reach the requested power against the baseline's ``N`` seeds (None when even
  infinitely many cannot: the baseline's own uncertainty ``sigma / sqrt(N)`` is too large for the margin), and
* the seeds per side when both are trained anew (``N = M``).

For the final metrics ``sigma`` is the baseline seeds' standard deviation of the metric (pooled with the
candidates' when an INCONCLUSIVE verdict asks); for the curve it is the median over the judged steps of the pooled
spread of the smoothed loss relative to the baseline mean, against the relative curve margin.  The estimates use a
handful of seeds and are themselves uncertain: treat the counts as the order of magnitude to plan for.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._errors import UsageError
from ._baseline import Baseline, RunData, final_value
from ._stats import pooled_std, seeds_needed


def _curve_sigma_rel(b: Baseline) -> float:
    """Median over the post-warm-up envelope steps of the pooled seed spread of the smoothed loss, relative to the
    baseline mean."""
    c = b.criteria
    pool = max(1, round(c.curve_pool_fraction * b.env_steps.size))
    rel = pooled_std(b.env_std, pool) / np.maximum(np.abs(b.env_mean), 1e-300)
    keep = b.env_steps > math.ceil(c.warmup_fraction * b.steps)
    return float(np.median(rel[keep] if keep.any() else rel))


def _entry(sigma: float, margin: float, delta: float, b: Baseline, *, scale: float,
           role: str = "primary") -> dict[str, Any]:
    c = b.criteria
    gap = margin - delta
    return {"sigma": sigma, "margin": margin, "assumed_worse_by": delta, "relative_to": scale, "role": role,
            "candidate_seeds": seeds_needed(sigma, gap, alpha=c.pass_alpha, power=c.power, n_baseline=b.n_seeds),
            "seeds_per_side": seeds_needed(sigma, gap, alpha=c.pass_alpha, power=c.power, n_baseline=None)}


def plan(b: Baseline, *, worse_by_fraction: float = 0.0) -> dict[str, Any]:
    """Seeds needed to PASS each criterion of ``b`` with ``b.criteria.power``, assuming the candidate is worse by
    ``worse_by_fraction`` of each margin (0: as good as the baseline; must be < 1)."""
    if not 0.0 <= worse_by_fraction < 1.0:
        raise UsageError(f"worse_by_fraction must be >= 0 and < 1 (a candidate at the margin cannot be shown "
                         f"within it); got {worse_by_fraction!r}")
    from ._judge import metric_margin

    c = b.criteria
    out: dict[str, Any] = {}
    sig = _curve_sigma_rel(b)
    out["curve"] = _entry(sig, c.curve_margin_rel, worse_by_fraction * c.curve_margin_rel, b, scale=1.0,
                          role=c.curve_role)
    for m in (list(c.metrics) if c.metrics is not None else list(b.metrics)):
        base = b.finals[m]
        margin = metric_margin(b, m)
        out[f"final/{m}"] = _entry(float(base.std(ddof=1)), margin, worse_by_fraction * margin, b,
                                   scale=abs(float(base.mean())) or 1.0)
    return _summarise(b, out)


def _summarise(b: Baseline, per: dict[str, Any]) -> dict[str, Any]:
    # A guard criterion (the loss curve under curve_role = "guard") can only FAIL a verdict, never hold back a
    # PASS, so the seeds that decide the verdict are those of the primary criteria.
    deciding = [e for e in per.values() if e.get("role", "primary") == "primary"] or list(per.values())

    def worst(key: str) -> int | None:
        got = [e[key] for e in deciding]
        return None if any(g is None for g in got) else max(got)

    m, k = worst("candidate_seeds"), worst("seeds_per_side")
    power = f"{b.criteria.power:.0%}"
    if m is not None:
        advice = (f"about {m} candidate seed(s) against the baseline's {b.n_seeds} would decide it "
                  f"({power} power for a candidate as good as the baseline)")
    else:
        advice = (f"the baseline's {b.n_seeds} seeds are too few for these margins: "
                  + (f"about {k} seeds on each side (a new baseline) would decide it" if k is not None else
                     "no seed count within 10,000 would; widen the margins"))
    if m is not None and k is not None and k < m:
        advice += f", or about {k} on each side with a new baseline"
    return {"criteria": per, "candidate_seeds": m, "seeds_per_side": k, "power": b.criteria.power,
            "advice": advice}


def plan_for(b: Baseline, candidates: list[RunData], results: list[Any]) -> dict[str, Any]:
    """The seeds that would decide an INCONCLUSIVE verdict: ``plan`` restricted to the inconclusive criteria, with
    each metric's spread pooled over the baseline and candidate seeds, for a candidate as good as the baseline."""
    from ._judge import metric_margin

    full = plan(b)
    per: dict[str, Any] = {}
    for r in results:
        if r.outcome != "inconclusive" or r.role != "primary":
            continue
        entry = dict(full["criteria"].get(r.name, {}))
        if r.name.startswith("final/") and entry:
            m = r.name[len("final/"):]
            ys = np.asarray([g[1] for run in candidates if (g := final_value(run, m)) is not None], dtype=float)
            xs = b.finals[m]
            if ys.size > 1:
                pooled = math.sqrt(((xs.size - 1) * xs.var(ddof=1) + (ys.size - 1) * ys.var(ddof=1))
                                   / (xs.size + ys.size - 2))
                entry = _entry(pooled, metric_margin(b, m), 0.0, b, scale=entry["relative_to"])
        if entry:
            per[r.name] = entry
    out = _summarise(b, per) if per else {"criteria": {}, "candidate_seeds": None, "seeds_per_side": None,
                                          "power": b.criteria.power, "advice": None}
    if out["advice"]:
        out["advice"] = "INCONCLUSIVE: " + out["advice"]
    return out


def format_plan(b: Baseline, p: dict[str, Any]) -> str:
    """The table ``lowprec plan`` prints."""
    lines = [f"baseline {b.name!r}: {b.n_seeds} seeds, pass_alpha {b.criteria.pass_alpha:g}, power "
             f"{p['power']:.0%}",
             f"{'criterion':<22} {'seed sd':>11} {'margin':>11} {'cand. seeds':>12} {'per side':>9}"]
    for name, e in p["criteria"].items():
        rel = e["relative_to"]
        sd = f"{e['sigma'] / rel:.3%}" if name != "curve" else f"{e['sigma']:.3%}"
        mg = f"{e['margin'] / rel:.3%}" if name != "curve" else f"{e['margin']:.3%}"
        cs = "-" if e["candidate_seeds"] is None else str(e["candidate_seeds"])
        ps = "-" if e["seeds_per_side"] is None else str(e["seeds_per_side"])
        label = f"{name} (guard)" if e.get("role") == "guard" else name
        lines.append(f"{label:<22} {sd:>11} {mg:>11} {cs:>12} {ps:>9}")
    lines.append("(seed sd and margin relative to the baseline mean; '-': not reachable: "
                 "the baseline's own uncertainty is too large; a guard can only FAIL, so the advice leaves it out)")
    lines.append(p["advice"])
    return "\n".join(lines)
