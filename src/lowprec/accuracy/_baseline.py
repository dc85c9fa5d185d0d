"""Baselines: what N seeds of a reference run look like, and the acceptance criteria declared before judging.

A baseline is built from N >= 2 completed runs of one config that differ only in the seed (the reference is fp32
unless the config says otherwise).  It keeps

* the per-step envelope of the smoothed training loss over the seeds: mean, standard deviation (ddof=1), min, max
  (smoothing: trailing moving average of ``criteria.smoothing_window`` steps, see ``_stats.smooth``);
* the final value of each eval metric for each seed (the distribution the final-metric test compares against);
* the ``Criteria``, fixed when the baseline is created, never chosen after seeing a candidate;
* identity: model, data hash, steps, the config without seed (and its digest without recipe), each seed's manifest.

It converts to a readable JSON document (one envelope row per line, so ``git diff`` of two goldens shows the steps
that moved) and back, with strict validation.  Which candidates may be judged against it: ``check_compatible``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import check_finite, check_literal, check_str
from .._errors import UsageError
from .._parse import parse_json, read_text_file
from ..runs._atomic import atomic_write_text
from ._stats import DIRECTIONS, Criteria, Direction, smooth

FORMAT = "lowprec-baseline"
FORMAT_VERSION = 1
LOSS_KEY = "train/loss"
ENVELOPE_COLUMNS = ("step", "mean", "std", "min", "max")
# Config keys that may differ between the seed runs of one baseline (labels and where things are stored).
RUN_LOCAL_KEYS = frozenset({"seed", "seeds", "name", "group", "store", "threads", "checkpoint"})


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class RunData:
    """One stored run as the judge sees it (built by ``from_store`` or, in tests, from synthetic curves)."""

    run_id: str
    name: str
    group: str | None
    status: str
    """"running" | "completed" | "diverged" | "failed"."""
    config: dict
    """Resolved RunConfig as plain data: ``config["model"]``, ``config["steps"]``."""
    manifest: dict
    """``manifest["data_hash"]``, ``manifest["seed"]``, ``manifest["metrics"]`` (metric -> "min" | "max")."""
    scalars: dict[str, tuple[np.ndarray, np.ndarray]]
    """Key (``train/loss``, ``eval/<metric>``) -> (steps int64, values float64)."""
    events: list[dict] = dataclasses.field(default_factory=list)
    """``{"step", "kind", "payload"}``; kind "nonfinite" marks a NaN/inf the runner saw."""

    @classmethod
    def from_store(cls, store: Any, run_id: str) -> RunData:
        """Read one run (``run_id`` or a unique prefix) from a ``RunStore``."""
        rec = store.get_run(run_id)
        return cls(run_id=rec.run_id, name=rec.name, group=rec.group, status=rec.status, config=rec.config,
                   manifest=rec.manifest, scalars=store.scalars(rec.run_id), events=store.events(rec.run_id))

    @property
    def label(self) -> str:
        return f"{self.name!r} ({self.run_id})"


def model_name(run: RunData) -> str:
    m = run.config.get("model")
    if isinstance(m, dict):
        m = m.get("name")
    if not isinstance(m, str) or not m:
        raise UsageError(f"run {run.label}: config['model'] must be the model name; got {m!r}")
    return m


def planned_steps(run: RunData) -> int:
    """``config["steps"]`` when recorded, else the last logged ``train/loss`` step."""
    s = run.config.get("steps")
    if isinstance(s, int) and not isinstance(s, bool) and s >= 1:
        return s
    steps = run.scalars.get(LOSS_KEY, (np.zeros(0, np.int64), None))[0]
    if len(steps) == 0:
        raise UsageError(f"run {run.label}: no config['steps'] and no {LOSS_KEY!r} scalars")
    return int(steps[-1])


def identity_config(config: Mapping[str, Any]) -> dict:
    """The config without the keys that may differ between seeds of one baseline (``RUN_LOCAL_KEYS``)."""
    return {k: v for k, v in config.items() if k not in RUN_LOCAL_KEYS}


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of the canonical JSON of the config without run-local keys and without ``recipe``."""
    body = {k: v for k, v in identity_config(config).items() if k != "recipe"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def final_value(run: RunData, metric: str) -> tuple[int, float] | None:
    """(step, value) of the last logged ``eval/<metric>``, or None."""
    got = run.scalars.get(f"eval/{metric}")
    if got is None or len(got[0]) == 0:
        return None
    return int(got[0][-1]), float(got[1][-1])


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Baseline:
    """N seeds of a reference run, summarised (see the module docstring).  Arrays are float64, one per step."""

    name: str
    model: str
    data_hash: str
    steps: int
    """Planned training steps (every seed ran all of them)."""
    config: dict
    """The reference config without run-local keys (``identity_config``)."""
    config_digest: str
    metrics: dict[str, Direction]
    """Eval metric -> "min" | "max" (lower / higher is better)."""
    criteria: Criteria
    seeds: tuple[int, ...]
    run_ids: tuple[str, ...]
    run_names: tuple[str, ...]
    manifests: tuple[dict, ...]
    finals: dict[str, np.ndarray]
    """Metric -> final value per seed (in ``seeds`` order)."""
    env_steps: np.ndarray
    """int64 steps of the envelope (the logged ``train/loss`` steps)."""
    env_mean: np.ndarray
    env_std: np.ndarray
    env_min: np.ndarray
    env_max: np.ndarray

    @property
    def n_seeds(self) -> int:
        return len(self.seeds)

    # --------------------------------------------------------------------------------------- compatibility
    def check_compatible(self, run: RunData) -> None:
        """ValueError naming every difference when ``run`` cannot be judged against this baseline: a different
        model, data hash or number of steps (a different recipe, hardware or version is what one compares)."""
        diffs = []
        for field, mine, theirs in (
            ("model", self.model, _safe(model_name, run)),
            ("data_hash", self.data_hash, run.manifest.get("data_hash")),
            ("steps", self.steps, _safe(planned_steps, run)),
        ):
            if mine != theirs:
                diffs.append(f"{field} {theirs!r} != baseline's {mine!r}")
        if diffs:
            raise UsageError(f"run {run.label} cannot be judged against baseline {self.name!r}: "
                             + "; ".join(diffs))

    # ------------------------------------------------------------------------------------------ JSON form
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (format ``lowprec-baseline`` version ``FORMAT_VERSION``)."""
        rows = [[int(s), float(a), float(b), float(c), float(d)] for s, a, b, c, d in
                zip(self.env_steps, self.env_mean, self.env_std, self.env_min, self.env_max, strict=True)]
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "name": self.name,
            "model": self.model,
            "data_hash": self.data_hash,
            "steps": self.steps,
            "config_digest": self.config_digest,
            "metrics": dict(self.metrics),
            "criteria": self.criteria.to_dict(),
            "seeds": [
                {"seed": s, "run_id": r, "name": n, "final": {m: float(v[i]) for m, v in self.finals.items()},
                 "manifest": man}
                for i, (s, r, n, man) in enumerate(zip(self.seeds, self.run_ids, self.run_names, self.manifests,
                                                       strict=True))
            ],
            "config": self.config,
            "envelope": {"columns": list(ENVELOPE_COLUMNS), "rows": rows},
        }

    def to_json(self) -> str:
        """Readable JSON: indented, one envelope row per line."""
        d = self.to_dict()
        rows = d["envelope"].pop("rows")
        d["envelope"]["rows"] = "@ROWS@"
        text = json.dumps(d, indent=2, allow_nan=False)
        body = ",\n".join("      " + json.dumps(r, allow_nan=False) for r in rows)
        return text.replace('"@ROWS@"', "[\n" + body + "\n    ]" if rows else "[]") + "\n"

    def save_json(self, path: str | os.PathLike) -> Path:
        """Write ``to_json()`` atomically (temporary file, fsync, rename)."""
        return atomic_write_text(path, self.to_json())

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> Baseline:
        """Read and validate a baseline JSON file (``from_dict``); every problem is a ValueError naming the file:
        a missing or unreadable file, invalid or too deeply nested JSON (``parse_json``), or a bad field."""
        p = Path(path)
        text = read_text_file(p, "baseline")
        data = parse_json(text, where=f"baseline file {str(p)!r}")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise UsageError(f"{p}: {e}") from None

    @classmethod
    def from_dict(cls, data: Any) -> Baseline:
        """Strict inverse of ``to_dict``: errors name the field, the bad value and what is allowed."""
        return _parse(data)


def _safe(fn: Any, run: RunData) -> Any:
    try:
        return fn(run)
    except ValueError:
        return None


def build_baseline(name: str, runs: list[RunData], *, criteria: Criteria | None = None) -> Baseline:
    """Summarise N >= 2 completed seed runs of one config into a named ``Baseline``.

    Every run must be completed, finite, have a distinct seed, the same config apart from run-local keys
    (``RUN_LOCAL_KEYS``), the same data hash, metrics and ``train/loss`` steps, and a final value of each
    metric logged at the last step."""
    check_str(name, "baseline name")
    crit = Criteria() if criteria is None else criteria
    if not isinstance(crit, Criteria):
        raise UsageError(f"criteria must be a Criteria; got {type(crit).__name__}")
    if len(runs) < 2:
        raise UsageError(f"a baseline needs runs of >= 2 seeds (seed-to-seed noise is what it measures); "
                         f"got {len(runs)}")
    first = runs[0]
    seeds: list[int] = []
    finals_rows: list[list[float]] = []
    curves: list[tuple[np.ndarray, np.ndarray]] = []
    metrics = first.manifest.get("metrics")
    if not isinstance(metrics, dict) or not metrics or any(v not in DIRECTIONS for v in metrics.values()):
        raise UsageError(f"run {first.label}: manifest['metrics'] must map metric names to 'min' or 'max'; "
                         f"got {metrics!r}")
    ref_cfg = identity_config(first.config)
    for run in runs:
        if run.status != "completed":
            raise UsageError(f"run {run.label} has status {run.status!r}; a baseline takes completed runs only")
        seed = run.manifest.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UsageError(f"run {run.label}: manifest['seed'] must be an integer; got {seed!r}")
        if seed in seeds:
            raise UsageError(f"run {run.label}: seed {seed} appears twice; baseline seeds must be distinct")
        seeds.append(seed)
        cfg = identity_config(run.config)
        if cfg != ref_cfg:
            keys = sorted(k for k in set(cfg) | set(ref_cfg) if cfg.get(k) != ref_cfg.get(k))
            raise UsageError(f"run {run.label}: config differs from run {first.label} in {keys}; "
                             f"baseline runs must differ only in the seed")
        for field in ("data_hash", "metrics"):
            if run.manifest.get(field) != first.manifest.get(field):
                raise UsageError(f"run {run.label}: manifest[{field!r}] {run.manifest.get(field)!r} differs from "
                                 f"run {first.label}'s {first.manifest.get(field)!r}")
        steps, loss = _loss(run)
        if curves and not np.array_equal(steps, curves[0][0]):
            raise UsageError(f"run {run.label}: {LOSS_KEY!r} steps differ from run {first.label}'s")
        if not np.isfinite(loss).all():
            bad = int(steps[np.flatnonzero(~np.isfinite(loss))[0]])
            raise UsageError(f"run {run.label}: {LOSS_KEY!r} is not finite at step {bad}; a reference run "
                             f"must not diverge")
        curves.append((steps, smooth(loss, crit.smoothing_window)))
        if int(steps[-1]) != planned_steps(run):
            raise UsageError(f"run {run.label}: last {LOSS_KEY!r} step {int(steps[-1])} != steps "
                             f"{planned_steps(run)}")
        row = []
        for m in metrics:
            got = final_value(run, m)
            if got is None or got[0] != int(steps[-1]) or not math.isfinite(got[1]):
                raise UsageError(f"run {run.label}: needs a finite 'eval/{m}' at the last step {int(steps[-1])}; "
                                 f"got {got!r}")
            row.append(got[1])
        finals_rows.append(row)
    if crit.metrics is not None and set(crit.metrics) - set(metrics):
        raise UsageError(f"criteria.metrics {sorted(set(crit.metrics) - set(metrics))} are not metrics of the "
                         f"runs; known: {sorted(metrics)}")
    stack = np.stack([c for _, c in curves])
    fin = np.asarray(finals_rows, dtype=np.float64)
    data_hash = first.manifest.get("data_hash")
    if not isinstance(data_hash, str) or not data_hash:
        raise UsageError(f"run {first.label}: manifest['data_hash'] must be a non-empty string; got {data_hash!r}")
    baseline = Baseline(
        name=name, model=model_name(first), data_hash=data_hash, steps=planned_steps(first), config=ref_cfg,
        config_digest=config_digest(first.config), metrics=dict(metrics), criteria=crit, seeds=tuple(seeds),
        run_ids=tuple(r.run_id for r in runs), run_names=tuple(r.name for r in runs),
        manifests=tuple(r.manifest for r in runs), finals={m: fin[:, i] for i, m in enumerate(metrics)},
        env_steps=curves[0][0], env_mean=stack.mean(axis=0), env_std=stack.std(axis=0, ddof=1),
        env_min=stack.min(axis=0), env_max=stack.max(axis=0),
    )
    problems = baseline_problems(baseline)
    if problems:
        raise UsageError(f"baseline {name!r} from runs {', '.join(r.run_id for r in runs)}: "
                         + "; ".join(problems))
    return baseline


def _early_index(b: Baseline) -> int:
    """Index of the "early" loss: the first full smoothing window, or the first tenth of the steps when that is
    shorter (a 20-step run with a 20-step window would compare its last step with itself)."""
    n = len(b.env_mean)
    return max(min(b.criteria.smoothing_window, math.ceil(n / 10)) - 1, 0)


def loss_drop(b: Baseline) -> tuple[float, float, float]:
    """(early, final, drop): the baseline's mean smoothed loss early (``_early_index``: the first full smoothing
    window, at most a tenth of the run in), at the last step, and ``(early - final) / |early|``, the fraction it
    fell while training."""
    early = float(b.env_mean[_early_index(b)])
    final = float(b.env_mean[-1])
    return early, final, (early - final) / abs(early) if early else (0.0 if final == early else -math.inf)


def judged_steps(b: Baseline, steps: np.ndarray | None = None) -> int:
    """How many of ``steps`` (default: the baseline's logged loss steps) fall after the curve's warm-up."""
    warm = math.ceil(b.criteria.warmup_fraction * b.steps)
    s = b.env_steps if steps is None else np.intersect1d(b.env_steps, steps)
    return int((s > warm).sum())


def baseline_problems(b: Baseline) -> list[str]:
    """Why ``b`` cannot serve as a baseline, one line each (empty: it can): its loss did not fall by
    ``criteria.min_loss_drop`` (the reference did not train), or it logged fewer than
    ``criteria.min_judged_steps`` loss steps after the warm-up."""
    c = b.criteria
    out = []
    early, final, drop = loss_drop(b)
    if c.min_loss_drop > 0 and not drop >= c.min_loss_drop:
        out.append(f"the reference did not train: its mean smoothed {LOSS_KEY} went from {early:.4g} (step "
                   f"{int(b.env_steps[_early_index(b)])}) to {final:.4g} (step "
                   f"{int(b.env_steps[-1])}), a {drop:.1%} drop, below criteria.min_loss_drop {c.min_loss_drop:.0%}: "
                   f"check its learning rate, data and labels, or set min_loss_drop = 0 in the criteria file if a "
                   f"flat loss is expected (a converged model)")
    n = judged_steps(b)
    if n < c.min_judged_steps:
        warm = math.ceil(c.warmup_fraction * b.steps)
        out.append(f"only {n} logged {LOSS_KEY} step(s) after the warm-up ({warm} of {b.steps} steps), fewer than "
                   f"criteria.min_judged_steps {c.min_judged_steps}: log the loss more often or train longer")
    return out


def _loss(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    got = run.scalars.get(LOSS_KEY)
    if got is None or len(got[0]) == 0:
        raise UsageError(f"run {run.label} has no {LOSS_KEY!r} scalars")
    return np.asarray(got[0], dtype=np.int64), np.asarray(got[1], dtype=np.float64)


# ------------------------------------------------------------------------------------------------ parsing
_HEX16 = re.compile(r"[0-9a-f]{16}")
_REGENERATE = "export the baseline again (`lowprec baselines export`, `lowprec baseline ... --export`)"
_KIND = {"str": "a string", "int": "an integer", "dict": "an object", "list": "a list", "int or float": "a number"}


def _get(d: dict, key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise UsageError(f"{where}{key} is missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise UsageError(f"{where}{key} must be {_KIND.get(names, names)}; got {v!r}")
    return v



def _text(d: dict, key: str, where: str, what: str) -> str:
    v = _get(d, key, str, where)
    if not v.strip():
        raise UsageError(f"{where}{key} must be a non-empty string ({what}); got {v!r}")
    return v


def _parse(data: Any) -> Baseline:
    """Validate every field of a baseline document (``to_dict``'s form) and build the ``Baseline``.

    Each error names the field (``seeds[1].final.loss``, ``envelope.rows[3]``), the bad value and what is
    allowed.  Besides each field's type and range, the fields must agree with each other as ``build_baseline``
    makes them: one final value per metric for each seed, distinct seeds and run ids, the envelope ending at
    ``steps``, ``criteria.metrics`` among ``metrics``, and ``config``'s model and steps (when present) equal to
    the top-level ones."""
    if not isinstance(data, dict):
        raise UsageError(f"a baseline must be a JSON object; got {type(data).__name__}")
    top = {"format", "version", "name", "model", "data_hash", "steps", "config_digest", "metrics", "criteria",
           "seeds", "config", "envelope"}
    if set(data) - top:
        raise UsageError(f"unknown key(s) {sorted(set(data) - top)}; allowed: {sorted(top)}")
    if data.get("format") != FORMAT:
        raise UsageError(f"format must be {FORMAT!r}; got {data.get('format')!r}")
    if data.get("version") != FORMAT_VERSION:
        raise UsageError(f"version {data.get('version')!r} is not supported; this lowprec reads {FORMAT_VERSION}")
    name = _text(data, "name", "", "the baseline's name; `lowprec baselines import --name` sets another")
    model = _text(data, "model", "", "the task the seed runs trained, e.g. 'mlp-digits'")
    data_hash = _text(data, "data_hash", "", "the sha256 of the task's data, from the runs' manifests")
    digest = _get(data, "config_digest", str, "")
    if not _HEX16.fullmatch(digest):
        raise UsageError(f"config_digest must be 16 lowercase hex digits (the digest lowprec computes from the "
                         f"config); got {digest!r}: {_REGENERATE}")
    steps = _get(data, "steps", int, "")
    if steps < 1:
        raise UsageError(f"steps must be an integer >= 1 (the number of training steps each seed ran); got "
                         f"{steps!r}")
    metrics = _get(data, "metrics", dict, "")
    if not metrics:
        raise UsageError("metrics must name at least one eval metric and its direction, e.g. "
                         "{\"loss\": \"min\", \"accuracy\": \"max\"}; got {}")
    for m, d in metrics.items():
        if not isinstance(m, str) or not m.strip():
            raise UsageError(f"metrics must be keyed by metric names; got the key {m!r}")
        check_literal(d, f"metrics.{m}", Direction)
    crit = Criteria.from_dict(_get(data, "criteria", dict, ""))
    if crit.metrics is not None and set(crit.metrics) - set(metrics):
        raise UsageError(f"criteria.metrics {sorted(set(crit.metrics) - set(metrics))} are not metrics of the "
                         f"baseline; known: {sorted(metrics)}")
    config = _get(data, "config", dict, "")
    if isinstance(config.get("model"), str) and config["model"] != model:
        raise UsageError(f"config.model {config['model']!r} differs from model {model!r}; they must be equal")
    if isinstance(config.get("steps"), int) and config["steps"] != steps:
        raise UsageError(f"config.steps {config['steps']!r} differs from steps {steps!r}; they must be equal")
    seeds_in = _get(data, "seeds", list, "")
    if len(seeds_in) < 2:
        raise UsageError(f"seeds must list >= 2 seed runs (seed-to-seed noise is what a baseline measures); got "
                         f"{len(seeds_in)}")
    seeds, ids, names, mans, fin = [], [], [], [], []
    for i, s in enumerate(seeds_in):
        w = f"seeds[{i}]."
        if not isinstance(s, dict) or set(s) != {"seed", "run_id", "name", "final", "manifest"}:
            raise UsageError(f"seeds[{i}] must be an object with keys final, manifest, name, run_id, seed; got {s!r}")
        seed = _get(s, "seed", int, w)
        if not 0 <= seed < 2**63:
            raise UsageError(f"{w}seed must be an integer in [0, 2**63); got {seed!r}")
        seeds.append(seed)
        ids.append(_text(s, "run_id", w, "the id of the seed's run in the store it came from"))
        names.append(_text(s, "name", w, "the seed run's name"))
        mans.append(_get(s, "manifest", dict, w))
        final = _get(s, "final", dict, w)
        if set(final) != set(metrics):
            raise UsageError(f"{w}final must have one value per metric {sorted(metrics)}; got {sorted(final)}")
        for m in metrics:
            check_finite(_get(final, m, (int, float), w + "final."), f"{w}final.{m}")
        fin.append([float(final[m]) for m in metrics])
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"seeds must be distinct; got {seeds}")
    if len(set(ids)) != len(ids):
        raise UsageError(f"seeds[*].run_id must be distinct (one run per seed); got {ids}")
    for i, (seed, man) in enumerate(zip(seeds, mans, strict=True)):
        if "seed" in man and man["seed"] != seed:
            raise UsageError(f"seeds[{i}].manifest.seed {man['seed']!r} differs from seeds[{i}].seed {seed!r}; "
                             "they must be equal")
    env = _get(data, "envelope", dict, "")
    if env.get("columns") != list(ENVELOPE_COLUMNS) or set(env) != {"columns", "rows"}:
        raise UsageError(f"envelope must be {{'columns': {list(ENVELOPE_COLUMNS)}, 'rows': [...]}}")
    rows = env["rows"]
    if not isinstance(rows, list) or not rows:
        raise UsageError("envelope.rows must be a non-empty list of [step, mean, std, min, max] rows")
    for i, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != len(ENVELOPE_COLUMNS) or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in r):
            raise UsageError(f"envelope.rows[{i}] must be [step, mean, std, min, max], five finite numbers; "
                             f"got {r!r}")
    arr = np.asarray(rows, dtype=np.float64)
    st = arr[:, 0].astype(np.int64)
    if not np.array_equal(st, arr[:, 0]) or (np.diff(st) <= 0).any() or st[0] < 1:
        raise UsageError("envelope.rows steps must be increasing integers >= 1")
    if int(st[-1]) != steps:
        raise UsageError(f"envelope.rows must end at step {steps} (steps); the last row is step {int(st[-1])}")
    slack = 1e-9 * np.maximum(1.0, np.abs(arr[:, 1]))
    if (arr[:, 2] < 0).any() or (arr[:, 3] > arr[:, 1] + slack).any() or (arr[:, 1] > arr[:, 4] + slack).any():
        raise UsageError("envelope.rows must have std >= 0 and min <= mean <= max")
    f = np.asarray(fin, dtype=np.float64)
    return Baseline(
        name=name, model=model, data_hash=data_hash, steps=steps, config=config, config_digest=digest,
        metrics=dict(metrics), criteria=crit, seeds=tuple(seeds), run_ids=tuple(ids), run_names=tuple(names),
        manifests=tuple(mans), finals={m: f[:, i] for i, m in enumerate(metrics)}, env_steps=st,
        env_mean=arr[:, 1], env_std=arr[:, 2], env_min=arr[:, 3], env_max=arr[:, 4],
    )
