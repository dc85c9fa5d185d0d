"""The judge: PASS, FAIL or INCONCLUSIVE of candidate runs against a baseline, with the evidence for each criterion.

Criteria (parameters in ``Criteria``, declared with the baseline; methodology in ``docs/accuracy.md``):

* ``completion``: every candidate finished (status "completed", or "diverged", which ``divergence`` FAILs) and
  logged the baseline's number of steps.
* ``divergence``: no candidate has a non-finite training loss or eval metric, a "nonfinite"/"diverged" event, or a
  loss spike (``_stats.find_spike``); a FAIL names the run and the first such step, and, when the runner localised
  the failure (a "nonfinite" event), the module, tensor role, step and values of the first non-finite tensor.
* ``curve``: a non-inferiority test of the mean over candidate seeds of the smoothed training loss, step by step
  after the warm-up, against a declared relative margin ``m_t = curve_margin_rel * |mean_t|``.  With ``d_t`` the
  candidate mean minus the baseline mean (positive: worse) and ``se_t = pooled_t * sqrt(1/N + 1/M)``::

      step t is within   iff  d_t + t_{1-pass_alpha, N+M-2} se_t <= m_t      (upper bound inside the margin)
      step t is beyond   iff  d_t - curve_k se_t > m_t                        (lower bound past the margin)

  PASS when at least ``1 - curve_max_outside`` of the judged steps are within; FAIL when more than
  ``curve_max_outside`` are beyond; INCONCLUSIVE otherwise.  A lower loss than the baseline's is never a FAIL.
* ``final/<metric>``: per eval metric, ``_stats.margin_test``: PASS when the one-sided ``1 - pass_alpha`` upper
  bound of how much worse the candidate is lies below the margin; FAIL when the worse-direction Welch test
  rejects "at most the margin worse" at ``metric_alpha / number of metrics`` (Bonferroni: the family-wise
  false-FAIL rate stays <= metric_alpha); INCONCLUSIVE otherwise.

The verdict FAILs when any criterion FAILs, PASSes when every criterion PASSes (an intersection-union test: each
criterion at its own level bounds the false-PASS rate of the whole), and is INCONCLUSIVE otherwise, with the
number of seeds that would decide it (``_plan``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import scipy.stats

from .._errors import UsageError
from .._payloads import describe_payload
from ._baseline import (
    LOSS_KEY,
    Baseline,
    RunData,
    baseline_problems,
    config_digest,
    final_value,
    judged_steps,
    loss_drop,
    planned_steps,
)
from ._stats import find_spike, margin_test, pooled_std, smooth

DIVERGENCE_EVENTS = ("nonfinite", "diverged")


WORDS = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE"}
EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 3}
"""CLI exit status per verdict outcome (2 is a usage error)."""




class _Outcome:
    """``passed`` and ``word`` of anything with an ``outcome``."""

    outcome: str

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    @property
    def word(self) -> str:
        return WORDS[self.outcome]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriterionResult(_Outcome):
    name: str
    outcome: str
    """"pass", "fail" or "inconclusive"."""
    reason: str
    """One sentence with the numbers that decided: the bound, the margin, what the seeds could see."""
    values: dict[str, Any]
    """The numbers behind ``reason`` (JSON-able)."""
    role: str = "primary"
    """"primary": a PASS verdict needs it to PASS; "guard": a PASS verdict only needs it not to FAIL (completion,
    divergence, and the curve unless ``Criteria.curve_role = "primary"``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "outcome": self.outcome, "role": self.role, "passed": self.passed,
                "reason": self.reason, "values": self.values}


def combine_outcomes(outcomes: list[str]) -> str:
    """Of several verdicts (groups): FAIL if any FAILs, PASS if all PASS, INCONCLUSIVE otherwise."""
    return "fail" if "fail" in outcomes else "pass" if all(o == "pass" for o in outcomes) else "inconclusive"


def combine(results: list[CriterionResult]) -> str:
    """FAIL if any criterion FAILs; PASS if every primary criterion PASSes (guards only need not FAIL);
    INCONCLUSIVE otherwise."""
    if any(r.outcome == "fail" for r in results):
        return "fail"
    return "pass" if all(r.outcome == "pass" for r in results if r.role == "primary") else "inconclusive"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict(_Outcome):
    outcome: str
    baseline: str
    candidates: tuple[str, ...]
    """Run ids of the judged candidates."""
    results: tuple[CriterionResult, ...]
    plan: dict[str, Any] | None = None
    """For an INCONCLUSIVE verdict: the seeds that would decide it (``_plan.plan_for``), else None."""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def format_table(self) -> str:
        """Plain-text verdict: the headline, one line per criterion with its evidence, and for an INCONCLUSIVE
        verdict the seed counts that would decide it."""
        head = f"{self.word}: {len(self.candidates)} candidate run(s) against baseline {self.baseline!r}"
        w = max([len("criterion")] + [len(r.name) for r in self.results])
        lines = [head, f"{'criterion':<{w}}  {'result':<12}  evidence"]
        lines += [f"{r.name:<{w}}  {r.word:<12}  {r.reason}" for r in self.results]
        if self.plan is not None and self.plan.get("advice"):
            lines.append(self.plan["advice"])
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "passed": self.passed, "baseline": self.baseline,
                "candidates": list(self.candidates), "results": [r.to_dict() for r in self.results],
                "plan": self.plan}


def judge(baseline: Baseline, candidates: list[RunData]) -> Verdict:
    """Judge candidate seed runs (one recipe, M >= 1 distinct seeds) against ``baseline``.

    ValueError when there is no candidate, when two candidates share a seed, or when a candidate is not
    comparable (``Baseline.check_compatible``).  Everything else is a verdict, never an exception."""
    if not candidates:
        raise UsageError("judge needs at least one candidate run")
    check_alike(candidates)
    seen: dict[Any, str] = {}
    for run in candidates:
        baseline.check_compatible(run)
        seed = run.manifest.get("seed")
        if seed in seen:
            raise UsageError(f"candidate runs {seen[seed]} and {run.label} share seed {seed!r}; seeds must be "
                             f"distinct (repeats of one seed are not independent samples)")
        seen[seed] = run.label
    results = [_baseline_guard(baseline), _completion(baseline, candidates), _divergence(baseline, candidates),
               _curve(baseline, candidates)]
    results += _finals(baseline, candidates)
    outcome = combine(results)
    plan = None
    if outcome == "inconclusive":
        from ._plan import plan_for

        plan = plan_for(baseline, candidates, results)
    return Verdict(outcome=outcome, baseline=baseline.name, candidates=tuple(r.run_id for r in candidates),
                   results=tuple(results), plan=plan)


def experiment(run: RunData) -> dict[str, Any]:
    """What makes runs different experiments, besides the seed: the framework, the device, the parallel layout,
    the recipe (its hash) and the rest of the config (its digest without run-local keys)."""
    par = run.config.get("parallel") or {}
    return {"framework": run.manifest.get("framework", run.config.get("framework", "torch")),
            "device": (run.manifest.get("hardware") or {}).get("device", "cpu"),
            "parallel": f"{par.get('strategy', 'single')} x{par.get('world_size', 1)}",
            "recipe": run.manifest.get("recipe_hash"),
            "config": config_digest({k: v for k, v in run.config.items() if k not in ("framework", "parallel")})}


def check_alike(candidates: list[RunData]) -> None:
    """``ValueError`` naming the difference when the candidates are not seeds of one experiment (``experiment``):
    pooling, say, JAX and PyTorch runs of one recipe would judge a mixture as one sample."""
    first = candidates[0]
    want = experiment(first)
    for run in candidates[1:]:
        got = experiment(run)
        diff = [f"{k} {got[k]!r} vs {want[k]!r}" for k in want if got[k] != want[k]]
        if diff:
            raise UsageError(f"candidate runs {first.label} and {run.label} are not seeds of one experiment "
                             f"({'; '.join(diff)}): judge them as separate groups (give each config its own "
                             f"name or group) or select the runs of one")


def _loss(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    steps, vals = run.scalars.get(LOSS_KEY, (np.zeros(0, np.int64), np.zeros(0)))
    return np.asarray(steps, dtype=np.int64), np.asarray(vals, dtype=np.float64)


def _baseline_guard(b: Baseline) -> CriterionResult:
    """FAIL when the baseline cannot serve as one (``baseline_problems``): ``build_baseline`` refuses such a
    baseline, but one stored or exported before that check (or built with other criteria) can still arrive."""
    problems = baseline_problems(b)
    early, final, drop = loss_drop(b)
    vals = {"early_loss": early, "final_loss": final, "loss_drop": drop if math.isfinite(drop) else None,
            "min_loss_drop": b.criteria.min_loss_drop, "judged_steps": judged_steps(b)}
    if problems:
        return CriterionResult(name="baseline", outcome="fail", role="guard", values=vals,
                               reason="not a usable baseline: " + "; ".join(problems))
    return CriterionResult(name="baseline", outcome="pass", role="guard", values=vals,
                           reason=f"the reference trained: mean smoothed loss {early:.4g} -> {final:.4g} "
                                  f"({drop:.1%} drop), {vals['judged_steps']} judged steps")


def _completion(b: Baseline, runs: list[RunData]) -> CriterionResult:
    bad = {}
    need = b.criteria.min_judged_steps
    for r in runs:
        steps, _ = _loss(r)
        last = int(steps[-1]) if len(steps) else 0
        if r.status not in ("completed", "diverged") or last < b.steps:  # diverged: finished, fails divergence
            bad[r.run_id] = f"{r.name!r} ({r.run_id}) status {r.status}, last step {last} of {b.steps}"
        elif r.status == "completed" and (n := judged_steps(b, steps)) < need:
            bad[r.run_id] = (f"{r.name!r} ({r.run_id}) logged {n} {LOSS_KEY} step(s) after the warm-up at the "
                             f"baseline's steps, too few to judge (criteria.min_judged_steps {need}): log the "
                             f"loss at the steps the baseline did")
    if bad:
        return CriterionResult(name="completion", outcome="fail", role="guard", values={"incomplete": bad},
                               reason="incomplete: " + "; ".join(bad.values()))
    return CriterionResult(name="completion", outcome="pass", role="guard",
                           values={"runs": len(runs), "steps": b.steps},
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
    device = {e.get("step") for e in run.events if e.get("kind") == "rerun"
              and (e.get("payload") or {}).get("verdict") in ("transient", "persistent")}
    for e in run.events:
        p = e.get("payload") or {}
        if e.get("kind") == "spike" and e.get("step") not in device:  # a spike the run rolled back or skipped is
            # no longer in its curve; one a rerun put on a device fault is not the recipe's
            found.append((int(e.get("step", 0)), f"loss spike {p.get('loss')!r} ({p.get('rule')} rule; handled "
                                                 "during training: see the run's rerun/rollback events)"))
        elif e.get("kind") == "rerun" and p.get("reason") == "nonfinite" and p.get("verdict") == "reproducible":
            found.append((int(e.get("step", 0)), f"non-finite step, reproducible ({p.get('action')})"))
        if e.get("kind") == "nonfinite":  # its payload is described below
            found.append((int(e.get("step", 0)), "nonfinite event"))
        elif e.get("kind") in DIVERGENCE_EVENTS:
            found.append((int(e.get("step", 0)), f"{e.get('kind')} event {e.get('payload', {})}"))
        if e.get("kind") == "nonfinite" and located is None and (e.get("payload") or {}).get("found"):
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
    faults = [f"{e['payload'].get('verdict')} fault on rank(s) {e['payload'].get('ranks')} at step {e.get('step')} "
              f"({e['payload'].get('action')})" for r in runs for e in r.events
              if e.get("kind") == "rerun" and e.get("payload", {}).get("verdict") in ("transient", "persistent")]
    faults += [f"replicas disagreed at step {e.get('step')} ({e['payload'].get('detail')})" for r in runs
               for e in r.events if e.get("kind") == "sdc"]
    noted = f"; device faults found and handled in training (not the recipe's): {'; '.join(faults)}" if faults else ""
    if hits:
        first = min(hits.values(), key=lambda h: int(h["step"]))  # type: ignore[call-overload]
        reason = "; ".join(f"{h['run']!r} ({rid}) at step {h['step']}: {h['what']}" for rid, h in hits.items())
        return CriterionResult(name="divergence", outcome="fail", role="guard",
                               reason="diverged: " + reason + noted, values={"step": first["step"], "runs": hits})
    return CriterionResult(name="divergence", outcome="pass", role="guard",
                           values={"faults": faults} if faults else {},
                           reason="all losses and eval metrics finite, no loss spike" + noted)


def curve_se(b: Baseline, m: int) -> np.ndarray:
    """Per envelope step: the standard deviation of (mean of ``m`` candidate seeds - baseline mean) when both come
    from one distribution, ``pooled_t * sqrt(1/N + 1/M)``."""
    pool = max(1, round(b.criteria.curve_pool_fraction * b.env_steps.size))
    return pooled_std(b.env_std, pool) * math.sqrt(1.0 / b.n_seeds + 1.0 / m)


def curve_t(b: Baseline, m: int) -> float:
    """The pass-side critical value of the curve test: ``t_{1-pass_alpha}`` with ``N + M - 2`` degrees of
    freedom (the seed effect persists over the run, so the pooled spread has about that many)."""
    return float(scipy.stats.t.ppf(1.0 - b.criteria.pass_alpha, max(b.n_seeds + m - 2, 1)))


def curve_band(b: Baseline, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(pass line, fail line) per envelope step for the mean of ``m`` candidate seeds: a step is within when the
    candidate mean is at or below the pass line ``mean + m_t - t se_t`` and beyond the margin when it is above the
    fail line ``mean + m_t + curve_k se_t``."""
    c = b.criteria
    se = curve_se(b, m)
    margin = c.curve_margin_rel * np.abs(b.env_mean)
    return b.env_mean + margin - curve_t(b, m) * se, b.env_mean + margin + c.curve_k * se


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
        return CriterionResult(name="curve", outcome="fail", role=c.curve_role, values={"warmup_steps": warm},
                               reason=f"no step after the warm-up ({warm} steps) logged by every candidate")
    idx = np.searchsorted(b.env_steps, steps)
    mean = b.env_mean[idx]
    scale = np.abs(mean)
    se = curve_se(b, len(runs))[idx]
    diff = cand - mean  # positive: the candidate's loss is higher (worse)
    upper = np.where(np.isfinite(diff), (diff + curve_t(b, len(runs)) * se) / scale, np.inf)
    lower = np.where(np.isfinite(diff), (diff - c.curve_k * se) / scale, np.inf)
    within = upper <= c.curve_margin_rel
    beyond = lower > c.curve_margin_rel
    allowed = c.curve_max_outside
    n = int(steps.size)
    frac_within, frac_beyond = float(within.mean()), float(beyond.mean())
    outcome = "fail" if frac_beyond > allowed else "pass" if frac_within >= 1.0 - allowed else "inconclusive"
    # the bound a reader wants: the candidate's smoothed loss is at most this much above the baseline's on all but
    # the allowed fraction of judged steps (the (1 - allowed) quantile of the per-step upper bounds)
    bound = float(np.quantile(upper, 1.0 - allowed, method="higher"))
    rel = diff / scale
    vals = {"judged_steps": n, "within": int(within.sum()), "beyond": int(beyond.sum()),
            "fraction_within": frac_within, "fraction_beyond": frac_beyond, "allowed": allowed,
            "margin_rel": c.curve_margin_rel, "upper_bound_rel": bound if math.isfinite(bound) else None,
            "mean_rel_diff": float(np.nanmean(rel)) if np.isfinite(rel).any() else None,
            "warmup_steps": warm, "first_beyond_step": int(steps[beyond][0]) if beyond.any() else None,
            "passable_margin_rel": float(np.quantile((curve_t(b, len(runs)) + _t_power(b, len(runs))) * se / scale,
                                                     1.0 - allowed, method="higher"))}
    level = f"{1 - c.pass_alpha:.0%}"
    shown = f"{bound:+.2%}" if math.isfinite(bound) else "unbounded (non-finite loss)"
    detail = (f"smoothed loss at most {shown} vs the baseline mean ({level} upper bound) on "
              f"{1 - allowed:.0%} of {n} steps after warm-up, margin {c.curve_margin_rel:.2%}; "
              f"within the margin on {frac_within:.1%}, beyond it on {frac_beyond:.1%} (FAIL above "
              f"{allowed:.1%})")
    if beyond.any():
        detail += f", first beyond at step {vals['first_beyond_step']}"
    if outcome == "inconclusive":
        detail += (f"; these seeds can show equivalence only for a margin of about "
                   f"{vals['passable_margin_rel']:.2%} or more")
        if c.curve_role == "guard":
            detail += " (a guard: this does not stand in the way of a PASS)"
    return CriterionResult(name="curve", outcome=outcome, role=c.curve_role, reason=detail, values=vals)


def _t_power(b: Baseline, m: int) -> float:
    return float(scipy.stats.t.ppf(b.criteria.power, max(b.n_seeds + m - 2, 1)))


def metric_margin(b: Baseline, metric: str) -> float:
    """The declared margin of a final metric: ``max(margin_rel |xbar|, metric_margin_std s_x)`` with the metric's
    own relative margin (``Criteria.margin_rel``)."""
    base = b.finals[metric]
    c = b.criteria
    return max(c.margin_rel(metric) * abs(float(base.mean())), c.metric_margin_std * float(base.std(ddof=1)))


def _finals(b: Baseline, runs: list[RunData]) -> list[CriterionResult]:
    c = b.criteria
    names = list(c.metrics) if c.metrics is not None else list(b.metrics)
    fail_alpha = c.metric_alpha / len(names)
    out = []
    for m in names:
        name = f"final/{m}"
        direction = b.metrics[m]
        base = b.finals[m]
        got = {r.run_id: final_value(r, m) for r in runs}
        missing = [r.run_id for r in runs if (g := got[r.run_id]) is None or g[0] != planned_steps(r)]
        ys = np.asarray([g[1] for g in got.values() if g is not None], dtype=np.float64)
        if missing or not np.isfinite(ys).all():
            out.append(CriterionResult(name=name, outcome="fail", values={"missing": missing},
                                       reason=f"no finite final eval/{m} at the last step for run(s) "
                                              f"{', '.join(missing) or 'with non-finite values'}"))
            continue
        xbar = float(base.mean())
        sx = float(base.std(ddof=1))
        margin = metric_margin(b, m)
        t = margin_test(base, ys, direction=direction, margin=margin, pass_alpha=c.pass_alpha,
                        fail_alpha=fail_alpha, power=c.power)
        scale = abs(xbar) if xbar else 1.0
        vals = {"direction": direction, "baseline_mean": xbar, "baseline_std": sx, "n_baseline": int(base.size),
                "candidate_mean": float(ys.mean()), "candidate_std": float(ys.std(ddof=1)) if ys.size > 1 else None,
                "n_candidate": int(ys.size), "worse_by": t.diff, "margin": margin, "se": t.se,
                "df": t.df if math.isfinite(t.df) else None, "upper": t.upper, "lower": t.lower,
                "p_worse": t.p_worse, "p_within": t.p_within, "pass_alpha": c.pass_alpha, "fail_alpha": fail_alpha,
                "method": t.method, "passable_margin": t.passable, "detectable": t.detectable}
        better = "lower" if direction == "min" else "higher"
        diff_word = f"{abs(t.diff):.4g} {'worse' if t.diff > 0 else 'better'}"
        head = (f"candidate {ys.mean():.6g} vs baseline {xbar:.6g} ± {sx:.3g} ({better} is better, "
                f"{ys.size} vs {base.size} seeds): {diff_word}")
        if t.method == "exact":
            why = (f"; every value equal on each side, so compared exactly: "
                   f"{'within' if t.outcome == 'pass' else 'beyond'} the margin {margin:.4g}")
        else:
            level = f"{1 - c.pass_alpha:.0%}"
            bound = (f"at most {t.upper:.4g} worse ({t.upper / scale:.2%})" if t.upper >= 0 else
                     f"at least {-t.upper:.4g} better ({-t.upper / scale:.2%})")
            why = f"; {bound} ({level} bound), margin {margin:.4g} ({margin / scale:.2%})"
            if t.outcome == "fail":
                level_f = (f"{fail_alpha:.3g}" if len(names) == 1 else
                           f"{fail_alpha:.3g} = metric_alpha {c.metric_alpha:g} / {len(names)} metrics")
                why += (f"; at least {t.lower:.4g} worse (p = {t.p_worse:.3g} < {level_f}, "
                        f"Welch df {t.df:.1f})")
            elif t.outcome == "inconclusive":
                why += (f"; cannot tell: these seeds show equivalence only for a margin >= {t.passable:.3g} and "
                        f"catch a regression only beyond {t.detectable:.3g} (power {c.power:.0%})")
        out.append(CriterionResult(name=name, outcome=t.outcome, reason=head + why, values=vals))
    return out
