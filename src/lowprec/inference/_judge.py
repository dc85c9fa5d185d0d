"""The inference-accuracy judge: does the quantized model still answer like its reference, with evidence?

``judge_inference(reference, candidate, data, criteria)`` compares the two models on held-out inputs, paired
(``_compare``: per-token KL in both directions, top-1 agreement, negative log-likelihoods, logit errors per
top-k; ``_greedy``: greedy generation), and decides each criterion of ``InferenceCriteria`` (declared before the
candidate is seen; its ``hash()`` is recorded with the verdict) as the training judge does:

* **PASS** when the one-sided ``confidence`` bound on the *worse* side is inside the threshold (e.g. the upper
  bound of the mean KL is <= ``kl_mean``): evidence that the population value is within it, a non-inferiority
  test with a false-PASS rate of ``1 - confidence`` at the threshold;
* **FAIL** when the bound on the *better* side is beyond it, at ``fail_alpha`` shared (Bonferroni) over the
  criteria: evidence that it is worse;
* **INCONCLUSIVE** otherwise, with the number of examples that would decide it.

Uncertainty comes from a paired percentile bootstrap (``bootstrap`` resamples, seeded by ``seed``, so a verdict
is reproducible bit for bit) over the ``unit``: examples by default (a row of a batch; the tokens of one sequence
are correlated, so resampling tokens overstates the evidence), or tokens.  Every statistic is a ratio of sums
over the resampled units (mean KL = sum KL / tokens; the perplexity ratio ``exp(sum (NLL_cand - NLL_ref) /
targets)``; the three-way error ratio ``sum KL_cand / sum KL_bf16``), so the pairing is kept: both models'
errors on the same resampled inputs.  Median and 99th percentile of the per-token KL are weighted quantiles
under the same resampling.

A proportion at its boundary (every token agrees) has a degenerate bootstrap (the interval is the point), so the
bound of top-1 agreement is the lower of the bootstrap's and a Clopper-Pearson bound with the effective sample size
``n_tokens / design effect`` (the design effect from the bootstrap variance; at the boundary, where it cannot be
estimated, one token per example: the conservative limit); greedy agreement over independent prompts uses the
exact Clopper-Pearson bound.  What the sample could detect: ``(z_confidence + z_power) * SE`` (SE: the bootstrap
standard error), the smallest distance between the true value and the threshold that this sample resolves with
probability ``power``.  Logit tolerances and greedy divergences are worst cases, not means: they PASS when no
token (prompt) violates them, and the reason states the violation rate the sample rules out (the Clopper-Pearson
upper bound for zero violations: about ``3 / n`` at 95%).

Three-way mode (``bf16="auto"`` or a model): the candidate's KL from the fp32 reference against that of the
reference run in bfloat16, the noise every bf16 deployment accepts.  ``bf16_ratio`` PASSes when the upper bound of
``KL_cand / KL_bf16`` is <= it, or when the two per-token KL distributions overlap (Bhattacharyya coefficient of
their histograms, 40 bins on log10 KL, >= ``bf16_overlap``: vLLM-Neuron's rule); it FAILs when the lower bound is
beyond it and they do not overlap.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
import scipy.stats
from torch import nn

from .._checks import check_float, check_int, check_literal
from .._errors import UsageError
from ..accuracy._judge import EXIT_CODES, CriterionResult, _Outcome, combine
from ._compare import Comparison, TolKey, check_tolerances, compare
from ._greedy import GreedyResult, greedy_divergence

Unit = Literal["example", "token"]
OVERLAP_BINS = 40
"""Histogram bins (on log10 KL) of the Bhattacharyya coefficient."""
_KL_FLOOR = 1e-12
"""KL values below this are put at it on the log axis (an exactly matching token has KL 0)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferenceCriteria:
    """What a quantized model must show, declared before it is judged.  A threshold of None is not judged.

    Defaults: tight, W8A8-level figures (llama.cpp reports mean KL about 0.001-0.01 nats for 8-bit weights and
    0.02-0.1 for 4-bit); loosen them for 4-bit schemes, or judge those relative to bf16 (``bf16_ratio``)."""

    kl_mean: float | None = 0.01
    """Largest mean KL(reference || candidate) per token, nats."""
    kl_p99: float | None = None
    """Largest 99th percentile of the per-token KL, nats."""
    top1: float | None = 0.97
    """Smallest top-1 agreement (fraction of tokens whose argmax is the reference's)."""
    ppl_ratio: float | None = 1.02
    """Largest perplexity ratio ``PPL_candidate / PPL_reference`` (tokens with targets only)."""
    logit_tolerances: Mapping[TolKey, tuple[float, float]] | None = None
    """``{5: (atol, rtol), 50: ..., "all": ...}``: every token's logits at the reference's top-k classes within
    ``atol + rtol |reference|`` (``_compare``).  vLLM-Neuron uses 5: (1e-5, 0.011) ... all: (1e-5, 0.05)."""
    bf16_ratio: float | None = None
    """Three-way mode: largest ``mean KL_candidate / mean KL_bf16`` (1.0: "as close as bf16 is")."""
    bf16_overlap: float = 0.99
    """... or the Bhattacharyya coefficient of the two per-token KL distributions at least this."""
    cosine: float | None = None
    """Embedding outputs: smallest mean cosine similarity of candidate and reference vectors."""
    rel_error: float | None = None
    """Embedding outputs: largest relative L2 error ``sqrt(sum |c - r|^2 / sum |r|^2)``."""
    greedy_agreement: float | None = None
    """Smallest fraction of prompts whose greedy continuation of ``max_new_tokens`` matches the reference's up to
    divergences within ``greedy_gap`` (needs prompts)."""
    greedy_gap: float = 1e-3
    """A divergence whose logit gap is at most this is a near tie, not a failure (AWS NxDI's default 0.001; one
    bf16 unit at logits near 18 is 0.125)."""
    max_new_tokens: int = 16
    unit: Unit = "example"
    """What the bootstrap resamples: "example" (a batch row) or "token"."""
    confidence: float = 0.95
    """One-sided confidence of the PASS bounds (false-PASS rate ``1 - confidence`` at a threshold)."""
    fail_alpha: float = 0.05
    """Family-wise false-FAIL rate, split evenly (Bonferroni) over the judged criteria."""
    power: float = 0.8
    """The power that "could detect" and the examples-needed advice aim for."""
    bootstrap: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("kl_mean", "kl_p99", "bf16_ratio", "rel_error"):
            v = getattr(self, name)
            if v is not None:
                check_float(v, f"InferenceCriteria.{name}", 0.0, open_lo=True)
        if self.ppl_ratio is not None:
            check_float(self.ppl_ratio, "InferenceCriteria.ppl_ratio", 1.0, note="(1.02: at most 2% higher)")
        for name in ("top1", "greedy_agreement", "cosine"):
            v = getattr(self, name)
            if v is not None:
                check_float(v, f"InferenceCriteria.{name}", 0.0, 1.0, open_lo=True)
        object.__setattr__(self, "logit_tolerances", check_tolerances(
            self.logit_tolerances, "InferenceCriteria.logit_tolerances") or None)
        check_float(self.bf16_overlap, "InferenceCriteria.bf16_overlap", 0.0, 1.0, open_lo=True)
        check_float(self.greedy_gap, "InferenceCriteria.greedy_gap", 0.0)
        check_int(self.max_new_tokens, "InferenceCriteria.max_new_tokens", 1, 4096)
        check_literal(self.unit, "InferenceCriteria.unit", Unit)
        for name in ("confidence", "power"):
            check_float(getattr(self, name), f"InferenceCriteria.{name}", 0.5, 1.0, open_hi=True)
        check_float(self.fail_alpha, "InferenceCriteria.fail_alpha", 0.0, 0.5, open_lo=True)
        check_int(self.bootstrap, "InferenceCriteria.bootstrap", 100, 1_000_000)
        check_int(self.seed, "InferenceCriteria.seed", 0)
        if self.judged() == 0:
            raise UsageError("InferenceCriteria judges nothing: set at least one of kl_mean, kl_p99, top1, "
                             "ppl_ratio, logit_tolerances, bf16_ratio, cosine, rel_error, greedy_agreement")

    @classmethod
    def for_embeddings(cls, *, cosine: float | None = 0.99, rel_error: float | None = None,
                       bf16_ratio: float | None = None, **kwargs: Any) -> InferenceCriteria:
        """Criteria for models whose outputs are vectors (``output="embedding"``): the distribution criteria off,
        ``cosine`` / ``rel_error`` / ``bf16_ratio`` (then the ratio of relative L2 errors) judged."""
        return cls(kl_mean=None, top1=None, ppl_ratio=None, cosine=cosine, rel_error=rel_error,
                   bf16_ratio=bf16_ratio, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.logit_tolerances is not None:
            d["logit_tolerances"] = {str(k): list(v) for k, v in self.logit_tolerances.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InferenceCriteria:
        if not isinstance(d, Mapping):
            raise UsageError(f"InferenceCriteria.from_dict needs a mapping; got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise UsageError(f"InferenceCriteria: unknown field(s) {unknown}; valid: {sorted(fields)}")
        return cls(**dict(d))

    def hash(self) -> str:
        """SHA-256 (16 hex digits) of the canonical JSON: which criteria a verdict was judged by."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def judged(self) -> int:
        """The number of criteria that are judged (the Bonferroni split of ``fail_alpha``)."""
        return sum(v is not None for v in (self.kl_mean, self.kl_p99, self.top1, self.ppl_ratio,
                                           self.logit_tolerances, self.bf16_ratio, self.greedy_agreement,
                                           self.cosine, self.rel_error))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A statistic with its bootstrap bounds: ``lower``/``upper`` are the one-sided ``confidence`` bounds (together
    a ``2 confidence - 1`` interval), ``se`` the bootstrap standard error."""

    value: float
    lower: float
    upper: float
    se: float

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "lower": self.lower, "upper": self.upper, "se": self.se}


class _Bootstrap:
    """Resampling weights of the units, drawn once and shared by every statistic (the pairing)."""

    def __init__(self, units: np.ndarray, n_units: int, criteria: InferenceCriteria) -> None:
        self.units = units
        self.n = n_units
        rng = np.random.default_rng(criteria.seed)
        self.weights = rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=criteria.bootstrap
                                       ).astype(np.float64)
        self.lo_q, self.hi_q = 1.0 - criteria.confidence, criteria.confidence

    def sums(self, per_token: np.ndarray, mask: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """(sum over the sample, sums over each resample) of ``per_token`` (masked tokens count 0)."""
        v = per_token if mask is None else np.where(mask, per_token, 0.0)
        per_unit = np.bincount(self.units, weights=v, minlength=self.n)
        return float(per_unit.sum()), self.weights @ per_unit

    def estimate(self, value: float, draws: np.ndarray, levels: tuple[float, float] | None = None) -> Estimate:
        """The percentile bounds of ``draws`` at ``levels`` (default: this bootstrap's two one-sided levels)."""
        finite = draws[np.isfinite(draws)]
        if finite.size < draws.size:  # a resample without any target or with a zero denominator
            draws = np.where(np.isfinite(draws), draws, np.nan)
        q = levels or (self.lo_q, self.hi_q)
        lo, hi = np.nanquantile(draws, list(q)) if finite.size else (math.nan, math.nan)
        se = float(np.nanstd(draws, ddof=1)) if finite.size > 1 else math.nan
        return Estimate(float(value), float(lo), float(hi), se)

    def ratio(self, num: np.ndarray, den: np.ndarray, num_mask: np.ndarray | None = None,
              den_mask: np.ndarray | None = None) -> Estimate:
        """``sum num / sum den`` with bias-corrected and accelerated (BCa) bounds: the percentile levels are moved
        by the bootstrap's median bias ``z0 = Phi^-1(P*(theta* < theta))`` and the jackknife acceleration
        ``a = sum d^3 / (6 (sum d^2)^1.5)`` (``d``: leave-one-unit-out deviations), ``level' = Phi(z0 + (z0 + z) /
        (1 - a (z0 + z)))`` (Efron 1987), with ``z`` expanded for small samples (Hesterberg 2015: the ``t_{n-1}``
        quantile times ``sqrt(n / (n - 1))``, ``n`` units).  Measured on clustered log-normal per-token KL with the
        population mean at the threshold (30 or 100 examples of 20 tokens, 600 samples each): the plain percentile
        bound PASSed 9.5% of them where 5% was asked; these bounds 6.3% (+-1%)."""
        v = num if num_mask is None else np.where(num_mask, num, 0.0)
        w = den if den_mask is None else np.where(den_mask, den, 0.0)
        pn = np.bincount(self.units, weights=v, minlength=self.n)
        pd = np.bincount(self.units, weights=w, minlength=self.n)
        n0, d0 = float(pn.sum()), float(pd.sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            value = n0 / d0 if d0 else math.nan
            draws = (self.weights @ pn) / (self.weights @ pd)
            jack = (n0 - pn) / (d0 - pd)
        return self.estimate(value, draws, self._bca_levels(value, draws, jack))

    def _bca_levels(self, value: float, draws: np.ndarray, jack: np.ndarray) -> tuple[float, float] | None:
        ok = draws[np.isfinite(draws)]
        jack = jack[np.isfinite(jack)]
        if not math.isfinite(value) or ok.size < 2 or jack.size < 3:
            return None
        b = ok.size
        frac = (np.sum(ok < value) + 0.5 * np.sum(ok == value)) / b
        z0 = float(scipy.stats.norm.ppf(min(max(frac, 1.0 / (b + 1)), b / (b + 1.0))))
        d = jack.mean() - jack
        den = 6.0 * float(np.sum(d * d)) ** 1.5
        a = float(np.sum(d ** 3)) / den if den > 0 else 0.0

        n = jack.size

        def level(p: float) -> float:
            # expanded for small samples (Hesterberg 2015): the t quantile, times sqrt(n / (n - 1))
            z = float(scipy.stats.t.ppf(p, n - 1)) * math.sqrt(n / (n - 1))
            t = 1.0 - a * (z0 + z)
            return float(scipy.stats.norm.cdf(z0 + (z0 + z) / t)) if t > 0 else (1.0 if z > 0 else 0.0)

        return level(self.lo_q), level(self.hi_q)

    def quantile(self, values: np.ndarray, q: float) -> Estimate:
        """Weighted ``q``-quantile of the per-token ``values`` under each resample (each token weighted by its
        unit's multiplicity), the lower of the two middle values ("inverted CDF")."""
        order = np.argsort(values, kind="stable")
        v, u = values[order], self.units[order]
        value = float(np.quantile(values, q, method="inverted_cdf"))
        draws = np.empty(self.weights.shape[0])
        for start in range(0, self.weights.shape[0], 64):
            w = self.weights[start:start + 64][:, u]
            c = np.cumsum(w, axis=1)
            idx = np.minimum((c < q * c[:, -1:]).sum(axis=1), v.size - 1)
            draws[start:start + 64] = v[idx]
        return self.estimate(value, draws)


def _cp_bounds(k: float, n: float, alpha: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds ``(lower, upper)`` at level ``1 - alpha`` for ``k`` successes of ``n``."""
    lo = 0.0 if k <= 0 else float(scipy.stats.beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k >= n else float(scipy.stats.beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi


def overlap(a: np.ndarray, b: np.ndarray, bins: int = OVERLAP_BINS) -> float:
    """Bhattacharyya coefficient ``sum_i sqrt(p_i q_i)`` of the histograms of ``log10(max(x, 1e-12))`` of two
    samples on shared equal-width bins (1: identical distributions, 0: disjoint)."""
    la, lb = np.log10(np.maximum(a, _KL_FLOOR)), np.log10(np.maximum(b, _KL_FLOOR))
    lo, hi = min(la.min(), lb.min()), max(la.max(), lb.max())
    if hi - lo < 1e-9:
        return 1.0
    edges = np.linspace(lo, hi, bins + 1)
    p = np.histogram(la, edges)[0] / la.size
    q = np.histogram(lb, edges)[0] / lb.size
    return float(np.sqrt(p * q).sum())


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferenceVerdict(_Outcome):
    """The judge's decision on one candidate, with its evidence."""

    outcome: str
    reference: str
    candidate: str
    results: tuple[CriterionResult, ...]
    metrics: dict[str, Any]
    """Every statistic (``Estimate.to_dict``), judged or not; ``"tolerances"`` per top-k key."""
    n_examples: int
    n_tokens: int
    unit: str
    criteria: dict[str, Any]
    criteria_hash: str
    greedy: tuple[dict[str, Any], ...] = ()
    """``GreedyResult.to_dict`` per prompt (empty without prompts)."""
    output: str = "logits"
    """"logits" or "embedding" (what the statistics describe)."""
    kl_hist: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Sorted per-token KL samples (at most 2000 quantiles) of the candidate and, three-way, of bf16: the
    report's distribution chart."""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def format_table(self) -> str:
        head = (f"{self.word}: {self.candidate!r} against {self.reference!r} on {self.n_examples} examples, "
                f"{self.n_tokens} tokens (unit: {self.unit}; criteria {self.criteria_hash})")
        w = max([len("criterion")] + [len(r.name) for r in self.results])
        lines = [head, f"{'criterion':<{w}}  {'result':<12}  evidence"]
        lines += [f"{r.name:<{w}}  {r.word:<12}  {r.reason}" for r in self.results]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "passed": self.passed, "reference": self.reference,
                "candidate": self.candidate, "results": [r.to_dict() for r in self.results],
                "metrics": self.metrics, "n_examples": self.n_examples, "n_tokens": self.n_tokens,
                "unit": self.unit, "criteria": self.criteria, "criteria_hash": self.criteria_hash,
                "greedy": list(self.greedy), "kl_hist": self.kl_hist, "output": self.output}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InferenceVerdict:
        results = tuple(CriterionResult(name=r["name"], outcome=r["outcome"], reason=r["reason"],
                                        values=r["values"], role=r.get("role", "primary")) for r in d["results"])
        return cls(outcome=d["outcome"], reference=d["reference"], candidate=d["candidate"], results=results,
                   metrics=d["metrics"], n_examples=d["n_examples"], n_tokens=d["n_tokens"], unit=d["unit"],
                   criteria=d["criteria"], criteria_hash=d["criteria_hash"], greedy=tuple(d.get("greedy", ())),
                   kl_hist=d.get("kl_hist", {}), output=d.get("output", "logits"))


def _z(p: float) -> float:
    return float(scipy.stats.norm.ppf(p))


def _needed(n: int, est: Estimate, threshold: float, c: InferenceCriteria) -> int | None:
    """Units that would decide an INCONCLUSIVE criterion: SE scales as 1/sqrt(n)."""
    gap = abs(threshold - est.value)
    if not (gap > 0 and math.isfinite(est.se) and est.se > 0):
        return None
    return math.ceil(n * ((_z(c.confidence) + _z(c.power)) * est.se / gap) ** 2)


def _bound_result(name: str, est: Estimate, threshold: float, *, larger_is_worse: bool, n: int, unit: str,
                  c: InferenceCriteria, fail_alpha: float, what: str, fmt: str = ".4g",
                  fail_bound: float | None = None) -> CriterionResult:
    """PASS / FAIL / INCONCLUSIVE of ``est`` against ``threshold`` (module docstring)."""
    worse_bound = est.upper if larger_is_worse else est.lower
    better_bound = fail_bound if fail_bound is not None else (est.lower if larger_is_worse else est.upper)
    if not math.isfinite(worse_bound) and math.isfinite(est.value) and est.se == 0:
        worse_bound = est.value
    inside = worse_bound <= threshold if larger_is_worse else worse_bound >= threshold
    beyond = better_bound > threshold if larger_is_worse else better_bound < threshold
    if not math.isfinite(est.value):
        beyond, inside = True, False
    outcome = "pass" if inside else "fail" if beyond else "inconclusive"
    op = "<=" if larger_is_worse else ">="
    side = "upper" if larger_is_worse else "lower"
    detect = (_z(c.confidence) + _z(c.power)) * est.se if math.isfinite(est.se) else math.nan
    reason = (f"{what} {est.value:{fmt}} ({c.confidence:.0%} {side} bound {worse_bound:{fmt}}) vs {op} "
              f"{threshold:{fmt}}; {n} {unit}s resolve a distance of {detect:{fmt}} from the threshold "
              f"({c.power:.0%} power)")
    values: dict[str, Any] = {**est.to_dict(), "threshold": threshold, "detectable": detect, "n": n,
                              "fail_alpha": fail_alpha}
    if outcome == "inconclusive":
        need = _needed(n, est, threshold, c)
        values["units_needed"] = need
        if need is not None:
            reason += f"; about {need} {unit}s would decide it"
    return CriterionResult(name=name, outcome=outcome, reason=reason, values=values)


def _sample(values: np.ndarray, k: int = 2000) -> list[float]:
    if values.size <= k:
        return [float(v) for v in np.sort(values)]
    return [float(v) for v in np.quantile(values, np.linspace(0, 1, k))]


def judge_comparison(comp: Comparison, criteria: InferenceCriteria | None = None, *,
                     greedy: list[GreedyResult] | None = None, reference: str = "reference",
                     candidate: str = "candidate") -> InferenceVerdict:
    """Decide ``criteria`` on a ``Comparison`` (and greedy results) already computed (module docstring)."""
    c = criteria or InferenceCriteria()
    if comp.kind == "embedding" and any(v is not None for v in (c.kl_mean, c.kl_p99, c.top1, c.ppl_ratio,
                                                                c.logit_tolerances)):
        raise UsageError("the outputs are embeddings (output='embedding'): KL, top-1, perplexity and logit "
                         "criteria do not apply; use InferenceCriteria.for_embeddings(cosine=..., rel_error=...)")
    if c.bf16_ratio is not None and comp.kl_bf16 is None and comp.sq_err_bf16 is None:
        raise UsageError("InferenceCriteria.bf16_ratio needs the three-way mode: pass bf16='auto' (or a bf16 "
                         "model) to judge_inference / compare")
    if c.greedy_agreement is not None and greedy is None:
        raise UsageError("InferenceCriteria.greedy_agreement needs prompts: pass prompts=[token tensors] to "
                         "judge_inference")
    if c.ppl_ratio is not None and not comp.has_target.any():
        raise UsageError("InferenceCriteria.ppl_ratio needs targets: the held-out batches carry none (a dict with "
                         "'labels' or a tuple (*inputs, target) of token ids); set ppl_ratio=None")
    if c.unit == "example":
        uniq, units = np.unique(comp.example, return_inverse=True)
        n_units = int(uniq.size)
    else:
        units, n_units = np.arange(comp.n_tokens), comp.n_tokens
    boot = _Bootstrap(units.astype(np.int64), n_units, c)
    ones = np.ones(comp.n_tokens)
    fail_alpha = c.fail_alpha / c.judged()
    fb = copy.copy(boot)  # the same resamples, read at the FAIL side's level
    fb.lo_q, fb.hi_q = fail_alpha, 1 - fail_alpha

    def both(f: Any) -> tuple[Estimate, Estimate]:
        return f(boot), f(fb)

    metrics: dict[str, Any] = {}
    results: list[CriterionResult] = []
    kw: dict[str, Any] = {"n": n_units, "unit": c.unit, "c": c, "fail_alpha": fail_alpha}

    if comp.kind == "embedding":
        results, metrics, hist = _judge_embedding(comp, c, boot, fb, kw)
        return InferenceVerdict(outcome=combine(results), reference=reference, candidate=candidate,
                                results=tuple(results), metrics=metrics, n_examples=comp.n_examples,
                                n_tokens=comp.n_tokens, unit=c.unit, criteria=c.to_dict(), criteria_hash=c.hash(),
                                kl_hist=hist, output="embedding")
    if c.cosine is not None or c.rel_error is not None:
        raise UsageError("InferenceCriteria.cosine / rel_error judge vector outputs: pass output='embedding' (or "
                         "set them to None for logits)")

    kl, kl_f = both(lambda b: b.ratio(comp.kl, ones))
    metrics["kl_mean"] = kl.to_dict()
    metrics["kl_reverse_mean"] = boot.ratio(comp.kl_reverse, ones).to_dict()
    med = boot.quantile(comp.kl, 0.5)
    metrics["kl_median"] = med.to_dict()
    p99, p99_f = both(lambda b: b.quantile(comp.kl, 0.99))
    metrics["kl_p99"] = p99.to_dict()
    metrics["kl_reverse_p99"] = boot.quantile(comp.kl_reverse, 0.99).to_dict()
    if c.kl_mean is not None:
        results.append(_bound_result("kl_mean", kl, c.kl_mean, larger_is_worse=True, what="mean KL (nats)",
                                     fail_bound=kl_f.lower, **kw))
    if c.kl_p99 is not None:
        results.append(_bound_result("kl_p99", p99, c.kl_p99, larger_is_worse=True, what="p99 KL (nats)",
                                     fail_bound=p99_f.lower, **kw))

    agree = comp.agree.astype(np.float64)
    top1, top1_f = both(lambda b: b.ratio(agree, ones))
    top1 = _proportion_bound(top1, comp, n_units, 1 - c.confidence)
    top1_f = _proportion_bound(top1_f, comp, n_units, fail_alpha)
    metrics["top1"] = top1.to_dict()
    if c.top1 is not None:
        results.append(_bound_result("top1", top1, c.top1, larger_is_worse=False, what="top-1 agreement",
                                     fail_bound=top1_f.upper, **kw))

    if comp.has_target.any():
        dnll = comp.nll_cand - comp.nll_ref
        targets = comp.has_target.astype(np.float64)

        def ppl(b: _Bootstrap) -> Estimate:
            e = b.ratio(dnll, targets, num_mask=comp.has_target)
            return Estimate(math.exp(e.value), math.exp(e.lower), math.exp(e.upper), math.exp(e.value) * e.se)

        pr, pr_f = both(ppl)
        metrics["ppl_ratio"] = pr.to_dict()
        n_t = float(comp.has_target.sum())
        metrics["ppl_reference"] = math.exp(float(np.where(comp.has_target, comp.nll_ref, 0).sum()) / n_t)
        metrics["ppl_candidate"] = math.exp(float(np.where(comp.has_target, comp.nll_cand, 0).sum()) / n_t)
        if c.ppl_ratio is not None:
            results.append(_bound_result("ppl_ratio", pr, c.ppl_ratio, larger_is_worse=True,
                                         what="perplexity ratio", fail_bound=pr_f.lower, **kw))

    if comp.tolerances:
        metrics["tolerances"] = [t.to_dict() for t in comp.tolerances]
    if c.logit_tolerances is not None:
        results.append(_tolerance_result(comp, c, fail_alpha))

    hist = {"candidate": _sample(comp.kl)}
    if comp.kl_bf16 is not None:
        hist["bf16"] = _sample(comp.kl_bf16)
        ratio, ratio_f = both(lambda b: b.ratio(comp.kl, comp.kl_bf16))  # type: ignore[arg-type]
        bc = overlap(comp.kl, comp.kl_bf16)
        metrics["bf16_kl_mean"] = boot.ratio(comp.kl_bf16, ones).to_dict()
        metrics["bf16_ratio"] = ratio.to_dict()
        metrics["bf16_overlap"] = bc
        if c.bf16_ratio is not None:
            results.append(_bf16_result(ratio, ratio_f, bc, c, kw))

    if greedy is not None:
        metrics["greedy"] = _greedy_metrics(greedy)
        if c.greedy_agreement is not None:
            results.append(_greedy_result(greedy, c, fail_alpha))

    return InferenceVerdict(outcome=combine(results), reference=reference, candidate=candidate,
                            results=tuple(results), metrics=metrics, n_examples=comp.n_examples,
                            n_tokens=comp.n_tokens, unit=c.unit, criteria=c.to_dict(), criteria_hash=c.hash(),
                            greedy=tuple(g.to_dict() for g in greedy or ()), kl_hist=hist)


def _judge_embedding(comp: Comparison, c: InferenceCriteria, boot: _Bootstrap, fb: _Bootstrap,
                     kw: dict[str, Any]) -> tuple[list[CriterionResult], dict[str, Any], dict[str, list[float]]]:
    """The vector-output statistics: mean and 1st percentile of the cosine similarity, relative L2 error,
    three-way ratio of relative L2 errors (the square root of the ratio of squared-error sums) and overlap of
    the per-row relative squared errors."""
    if any(v is not None for v in (c.kl_mean, c.kl_p99, c.top1, c.ppl_ratio, c.logit_tolerances)):
        raise UsageError("the outputs are embeddings (output='embedding'): KL, top-1, perplexity and logit "
                         "criteria do not apply; use InferenceCriteria.for_embeddings(cosine=..., rel_error=...)")
    assert comp.cosine is not None and comp.sq_err is not None and comp.sq_ref is not None
    ones = np.ones(comp.n_tokens)
    results: list[CriterionResult] = []
    metrics: dict[str, Any] = {}

    def sqrt_est(e: Estimate) -> Estimate:
        root = math.sqrt(e.value)
        return Estimate(root, math.sqrt(max(e.lower, 0.0)), math.sqrt(max(e.upper, 0.0)),
                        e.se / (2 * root) if root > 0 else 0.0)

    cos, cos_f = boot.ratio(comp.cosine, ones), fb.ratio(comp.cosine, ones)
    metrics["cosine"] = cos.to_dict()
    metrics["cosine_p01"] = boot.quantile(comp.cosine, 0.01).to_dict()
    metrics["cosine_min"] = float(comp.cosine.min())
    rel, rel_f = sqrt_est(boot.ratio(comp.sq_err, comp.sq_ref)), sqrt_est(fb.ratio(comp.sq_err, comp.sq_ref))
    metrics["rel_error"] = rel.to_dict()
    if c.cosine is not None:
        results.append(_bound_result("cosine", cos, c.cosine, larger_is_worse=False, what="mean cosine similarity",
                                     fail_bound=cos_f.upper, fmt=".6g", **kw))
    if c.rel_error is not None:
        results.append(_bound_result("rel_error", rel, c.rel_error, larger_is_worse=True,
                                     what="relative L2 error", fail_bound=rel_f.lower, **kw))
    rel_rows = comp.sq_err / np.maximum(comp.sq_ref, 1e-300)
    hist = {"candidate": _sample(rel_rows)}
    if comp.sq_err_bf16 is not None:
        hist["bf16"] = _sample(comp.sq_err_bf16 / np.maximum(comp.sq_ref, 1e-300))
        ratio = sqrt_est(boot.ratio(comp.sq_err, comp.sq_err_bf16))
        ratio_f = sqrt_est(fb.ratio(comp.sq_err, comp.sq_err_bf16))
        bc = overlap(rel_rows, comp.sq_err_bf16 / np.maximum(comp.sq_ref, 1e-300))
        metrics["bf16_rel_error"] = sqrt_est(boot.ratio(comp.sq_err_bf16, comp.sq_ref)).to_dict()
        metrics["bf16_ratio"] = ratio.to_dict()
        metrics["bf16_overlap"] = bc
        if c.bf16_ratio is not None:
            results.append(_bf16_result(ratio, ratio_f, bc, c, kw, what="L2 error ratio candidate / bf16"))
    return results, metrics, hist


def _proportion_bound(est: Estimate, comp: Comparison, n_units: int, alpha: float) -> Estimate:
    """The bootstrap bounds of a token proportion widened to Clopper-Pearson's with the effective sample size
    (module docstring)."""
    n_tok = comp.n_tokens
    p = est.value
    if 0 < p < 1 and math.isfinite(est.se) and est.se > 0:
        deff = min(max(est.se ** 2 / (p * (1 - p) / n_tok), 1.0), float(n_tok))
        n_eff = n_tok / deff
    else:
        n_eff = float(n_units)
    lo, hi = _cp_bounds(p * n_eff, n_eff, alpha)
    return Estimate(p, min(est.lower, lo), max(est.upper, hi), est.se)


def _tolerance_result(comp: Comparison, c: InferenceCriteria, fail_alpha: float) -> CriterionResult:
    checks = comp.tolerances
    bad = [t for t in checks if t.violations]
    worst = max(checks, key=lambda t: t.worst_ratio)
    n = checks[0].tokens
    _, rate_hi = _cp_bounds(0, n, 1 - c.confidence)
    keys = ", ".join(f"top-{t.key}" if t.key != "all" else "all" for t in checks)
    if bad:
        b = max(bad, key=lambda t: t.worst_ratio)
        w = b.worst
        key = f"top-{b.key}" if b.key != "all" else "all"
        reason = (f"{sum(t.violations for t in bad)} token check(s) beyond tolerance; worst {key}: |c - r| = "
                  f"{abs(w['candidate'] - w['reference']):.4g} is {b.worst_ratio:.3g}x the allowance "
                  f"{b.atol:g} + {b.rtol:g}|r| (example {w['example']}, position {w['position']}, class "
                  f"{w['class']}, reference {w['reference']:.5g}, candidate {w['candidate']:.5g})")
        outcome = "fail"
    else:
        reason = (f"every one of {n} tokens within tolerance ({keys}); worst {worst.worst_ratio:.3g}x the allowance;"
                  f" a violation rate above {rate_hi:.2g} per token would likely ({c.confidence:.0%}) have shown")
        outcome = "pass"
    values = {"checks": [t.to_dict() for t in checks], "rate_upper": rate_hi, "fail_alpha": fail_alpha}
    return CriterionResult(name="logit_tolerances", outcome=outcome, reason=reason, values=values)


def _bf16_result(ratio: Estimate, ratio_f: Estimate, bc: float, c: InferenceCriteria,
                 kw: dict[str, Any], what: str = "KL ratio candidate / bf16") -> CriterionResult:
    assert c.bf16_ratio is not None
    r = _bound_result("bf16_ratio", ratio, c.bf16_ratio, larger_is_worse=True, what=what,
                      fail_bound=ratio_f.lower, **kw)
    values = {**r.values, "overlap": bc, "overlap_threshold": c.bf16_overlap}
    if bc >= c.bf16_overlap and r.outcome != "pass":
        return CriterionResult(name=r.name, outcome="pass", values=values,
                               reason=f"per-token KL distributions overlap (Bhattacharyya {bc:.4f} >= "
                                      f"{c.bf16_overlap}); {r.reason}")
    return CriterionResult(name=r.name, outcome=r.outcome, values=values,
                           reason=f"{r.reason}; Bhattacharyya overlap {bc:.4f} (>= {c.bf16_overlap} passes)")


def _greedy_metrics(greedy: list[GreedyResult]) -> dict[str, Any]:
    matched = np.array([g.matched for g in greedy], dtype=np.float64)
    gaps = [g.gap for g in greedy if g.gap is not None]
    return {"prompts": len(greedy), "full_match": sum(g.full_match for g in greedy),
            "mean_matched": float(matched.mean()), "min_matched": int(matched.min()),
            "max_new_tokens": greedy[0].max_new_tokens, "tolerated": sum(g.tolerated for g in greedy),
            "max_gap": max(gaps) if gaps else None}


def _greedy_result(greedy: list[GreedyResult], c: InferenceCriteria, fail_alpha: float) -> CriterionResult:
    assert c.greedy_agreement is not None
    n = len(greedy)
    k = sum(g.full_match for g in greedy)
    lo, _ = _cp_bounds(k, n, 1 - c.confidence)
    _, hi_f = _cp_bounds(k, n, fail_alpha)
    p = k / n
    outcome = "pass" if lo >= c.greedy_agreement else "fail" if hi_f < c.greedy_agreement else "inconclusive"
    tol = sum(g.tolerated for g in greedy)
    first = [g for g in greedy if not g.full_match]
    detail = ""
    if first:
        g = min(first, key=lambda g: g.matched)
        detail = (f"; earliest divergence at token {g.matched} of prompt {g.prompt} (gap {g.gap:.4g} > "
                  f"{c.greedy_gap:g}; the reference's own top-2 margin there {g.reference_margin:.4g})")
    reason = (f"{k} of {n} prompts match the reference's {greedy[0].max_new_tokens} greedy tokens ({p:.0%}; "
              f"{c.confidence:.0%} lower bound {lo:.3g}) vs >= {c.greedy_agreement:g}; {tol} near-tie "
              f"divergence(s) within {c.greedy_gap:g} tolerated{detail}")
    if outcome == "inconclusive":
        need = next((m for m in range(n + 1, 100 * n + 2) if _cp_bounds(p * m, m, 1 - c.confidence)[0]
                     >= c.greedy_agreement), None) if p > c.greedy_agreement else None
        if need:
            reason += f"; about {need} prompts at this match rate would decide it"
    return CriterionResult(name="greedy_agreement", outcome=outcome, reason=reason,
                           values={"k": k, "n": n, "lower": lo, "upper_fail": hi_f, "fail_alpha": fail_alpha,
                                   "threshold": c.greedy_agreement})


def judge_inference(reference: nn.Module, candidate: nn.Module, data: Iterable[Any],
                    criteria: InferenceCriteria | None = None, *, bf16: nn.Module | str | None = None,
                    prompts: Any = None, batches: int | None = None, reference_name: str = "reference",
                    candidate_name: str = "candidate", output: str = "logits") -> InferenceVerdict:
    """Judge ``candidate`` (e.g. ``quantize_model(copy.deepcopy(model), scheme, ...)``) against ``reference`` on
    the held-out ``data`` (lowprec's batch contract) by ``criteria`` (module docstring).

    ``bf16``: ``"auto"`` (a bfloat16 copy of ``reference``) or a model, for the three-way criterion;
    ``prompts``: 1-D token tensors for greedy generation (language models); ``output``: ``"logits"`` or
    ``"embedding"`` (vector outputs, ``InferenceCriteria.for_embeddings``).  The criteria are checked before
    any model runs."""
    c = criteria or InferenceCriteria()
    if not isinstance(c, InferenceCriteria):
        raise UsageError(f"judge_inference: criteria must be an InferenceCriteria; got {type(c).__name__}")
    if c.bf16_ratio is not None and bf16 is None:
        raise UsageError("InferenceCriteria.bf16_ratio needs the three-way mode: pass bf16='auto'")
    if c.greedy_agreement is not None and prompts is None:
        raise UsageError("InferenceCriteria.greedy_agreement needs prompts=[1-D token tensors]")
    logit_criteria = [c.kl_mean, c.kl_p99, c.top1, c.ppl_ratio, c.logit_tolerances]
    if output == "embedding" and any(v is not None for v in logit_criteria):
        raise UsageError("output='embedding': KL, top-1, perplexity and logit criteria do not apply; use "
                         "InferenceCriteria.for_embeddings(cosine=..., rel_error=...)")
    if output != "embedding" and (c.cosine is not None or c.rel_error is not None):
        raise UsageError("InferenceCriteria.cosine / rel_error judge vector outputs: pass output='embedding'")
    comp = compare(reference, candidate, data, bf16=bf16, logit_tolerances=c.logit_tolerances, batches=batches,
                   output=output)
    greedy = None if prompts is None else greedy_divergence(
        reference, candidate, prompts, max_new_tokens=c.max_new_tokens, gap_tolerance=c.greedy_gap)
    return judge_comparison(comp, c, greedy=greedy, reference=reference_name, candidate=candidate_name)
