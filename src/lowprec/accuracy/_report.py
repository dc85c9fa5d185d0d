"""One self-contained HTML report: candidate runs against a baseline, with the verdict and what differs.

Sections: the headline (the verdict; with several judged groups, how many PASS, FAIL and are INCONCLUSIVE, a table
of the groups, and the caller's expectation when given); the smoothed training loss of every run over the
baseline envelope (log axis when the loss spans a decade or more; a diverged or exploding run is clipped to a range
set by the baseline and named under the chart), then, per group, the candidate mean minus the baseline mean
(relative to the baseline mean, as the judge measures it) with the judge's pass and fail lines; eval metrics,
gradient norm and learning rate over time (small multiples); the final eval metrics of every run (a table and a
strip chart per metric); the verdict table per group (PASS green, FAIL red, INCONCLUSIVE amber) with the evidence;
per group, the recipe's difference from the baseline's in recipe terms and the other config and manifest keys
that differ (once per group; keys that differ between the group's seeds list each seed's value); the acceptance
criteria; and, for runs that sampled per-layer statistics (``[stats] every``), layer x step heatmaps of SQNR and
underflow plus their fallback / non-finite events.  No external asset, no script: the charts are inline SVG
(``_svg``) and every text taken from a run is escaped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runs._atomic import atomic_write_text
from ._baseline import LOSS_KEY, Baseline, RunData, final_value, identity_config
from ._judge import WORDS, Verdict, candidate_mean_curve, combine_outcomes, curve_band
from ._stats import smooth
from ._svg import PALETTE, Band, Line, Span, Strip, esc, heatmap, line_chart, strip_chart, text_width

BASELINE_COLOR = "#444"
"""The baseline mean (its min..max band is a lighter grey)."""
BASELINE_SEED_COLOR = "#b0b0b0"
MEAN_COLOR = "#000"
"""A candidate mean: black, the colour of no seed (``PALETTE``) and darker than the baseline mean."""
OUTCOME_ORDER = ("fail", "pass", "inconclusive")

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { background: #d8f5d8; color: #0a5d0a; font-weight: bold; }
.fail { background: #fbd5d5; color: #9b0000; font-weight: bold; }
.inconclusive { background: #fdf0c4; color: #6b4e00; font-weight: bold; }
.muted { color: #888; }
.headline { font-size: 20px; padding: 6px 12px; display: inline-block; }
.expectation { border-left: 4px solid #888; padding: 4px 10px; background: #f6f6f6; }
.charts { display: flex; flex-wrap: wrap; gap: 8px 16px; align-items: flex-start; }
.legend { font-size: 12px; margin: 4px 0; }
.legend .item { white-space: nowrap; }
.swatch { display: inline-block; width: 14px; height: 4px; vertical-align: middle; margin: 0 4px 0 10px; }
.note { font-size: 12px; margin: 2px 0 12px; }
.multiple { width: 490px; max-width: 100%; }
svg { max-width: 100%; height: auto; }
code { font-size: 12px; }
"""


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to one level with dotted keys; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _show(v: Any, limit: int = 160) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= limit else s[: limit - 1] + "\u2026"


def _distinct(vals: Sequence[Any]) -> list[Any]:
    return list({json.dumps(v, sort_keys=True, default=str): v for v in vals}.values())


def _baseline_values(baseline: Baseline) -> dict[str, list[Any]]:
    """Flattened key -> the values the baseline's seeds have (config: one value; manifest: one per seed)."""
    base_sets: dict[str, list[Any]] = {}
    for man in baseline.manifests:
        for k, v in flatten({"manifest": man}).items():
            base_sets.setdefault(k, []).append(v)
    for k, v in flatten({"config": baseline.config}).items():
        base_sets[k] = [v]
    return base_sets


def _show_baseline(vals: list[Any]) -> str:
    distinct = _distinct(vals)
    return ("(missing)" if not vals else _show(distinct[0]) if len(distinct) == 1
            else "varies: " + " | ".join(_show(v, 40) for v in distinct))


def manifest_diff(baseline: Baseline, run: RunData) -> list[tuple[str, str, str, bool]]:
    """(key, baseline value, candidate value, varies_within_baseline) for every config/manifest key whose
    candidate value is not one of the baseline seeds' values."""
    base_sets = _baseline_values(baseline)
    cand = flatten({"manifest": run.manifest, "config": identity_config(run.config)})
    rows = []
    for key in sorted(set(base_sets) | set(cand)):
        vals = base_sets.get(key, [])
        if key in cand and cand[key] in vals:  # the candidate has one of the baseline's own values
            continue
        rows.append((key, _show_baseline(vals), _show(cand[key]) if key in cand else "(missing)",
                     len(_distinct(vals)) > 1))
    return rows


# ----------------------------------------------------------------------------------------- recipe terms
def _spec_words(spec: Any) -> str:
    """A QuantSpec (as plain data) in words: its element format, how it is scaled, and every non-default field."""
    if spec is None:
        return "float32 (not quantized)"
    if not isinstance(spec, Mapping):
        return _show(spec, 80)
    d = dict(spec)
    elem = d.pop("elem", "?")
    words = [elem if isinstance(elem, str) else _show(elem, 60)]
    scaling, axis = d.pop("scaling", "tensor"), d.pop("axis", -1)
    block, tile = d.pop("block_size", None), d.pop("tile", None)
    sf, sr = d.pop("scale_format", "float32"), d.pop("scale_rounding", "nearest")
    margin, ts = d.pop("margin", 0), d.pop("tensor_scale", False)
    rule = d.pop("two_level_rule", "te")
    rounding, sat = d.pop("rounding", "nearest"), d.pop("saturate", True)
    along = "" if axis == -1 else f" along axis {axis}"
    if scaling == "none":
        words.append("unscaled")
    elif scaling == "tensor":
        words.append("one scale per tensor")
    elif scaling == "axis":
        words.append(f"one scale per row{along or ' (last axis)'}")
    elif scaling == "block":
        words.append(f"blocks of {block}{along}")
    elif scaling == "tile" and isinstance(tile, list | tuple) and len(tile) == 2:
        words.append(f"tiles of {tile[0]}x{tile[1]}")
    else:
        words.append(f"scaling {_show(scaling, 30)}" + (f" {_show(tile, 30)}" if tile is not None else ""))
    if scaling != "none":
        if sf != "float32" or sr != "nearest":
            words.append(f"{sf if isinstance(sf, str) else _show(sf, 40)} scales"
                         + (f" ({sr}-rounded)" if sr != "nearest" else ""))
        if margin:
            words.append(f"scale margin {margin}")
        if ts:
            words.append("plus a per-tensor float32 scale" + ("" if rule == "te" else f" ({_show(rule, 20)} rule)"))
    if rounding != "nearest":
        words.append(f"{rounding} rounding")
    if sat is False:
        words.append("no saturation")
    words += [f"{k} {_show(v, 40)}" for k, v in sorted(d.items())]
    return ", ".join(str(w) for w in words)


def _operand_words(op: Any) -> str:
    if not isinstance(op, Mapping):
        return _show(op, 80)
    words = _spec_words(op.get("spec"))
    sc = op.get("scaling")
    if isinstance(sc, Mapping) and sc.get("kind", "current") != "current":
        words += (f", {sc.get('kind')} scaling (amax history {sc.get('history_len')}, "
                  f"{sc.get('algorithm')})")
    extra = {k: v for k, v in op.items() if k not in ("spec", "scaling")}
    return words + "".join(f", {k} {_show(v, 40)}" for k, v in sorted(extra.items()))


def _accumulator_words(acc: Any) -> str:
    if not isinstance(acc, Mapping):
        return _show(acc, 80)
    fmt, chunk, rounding = acc.get("format"), acc.get("chunk"), acc.get("rounding", "nearest")
    if fmt is None:
        words = "float32 accumulation"
    else:
        words = f"{_show(fmt, 40)} accumulator" + (f" ({rounding})" if rounding != "nearest" else "")
    if chunk is not None:
        words += f", promoted to float32 every {chunk} products"
    extra = {k: v for k, v in acc.items() if k not in ("format", "chunk", "rounding")}
    return words + "".join(f", {k} {_show(v, 40)}" for k, v in sorted(extra.items()))


def recipe_terms(recipe: Any) -> dict[tuple[str, str], str]:
    """A recipe (plain data, ``Recipe.to_dict``) as (section, item) -> words: each GEMM operand of the linear
    recipe, of each override and of a fallback target by its tensor (``forward.a (input)``), each GEMM's
    accumulator and output, optimizer-state and gradient-communication formats, then every other field by its
    dotted key.  Two recipes differ exactly where their terms differ (``recipe_diff``)."""
    from ..recipes._recipe import GEMMS, OPERAND_ROLE

    out: dict[tuple[str, str], str] = {}
    if not isinstance(recipe, Mapping):
        return {("recipe", ""): _show(recipe)}

    def linear(section: str, lin: Any) -> None:
        if not isinstance(lin, Mapping):
            out[(section, "")] = _show(lin)
            return
        for g in GEMMS:
            got = lin.get(g)
            gemm: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
            for o in "ab":
                out[(section, f"{g}.{o} ({OPERAND_ROLE[(g, o)]})")] = _operand_words(gemm.get(o, {}))
            out[(section, f"{g} accumulator")] = _accumulator_words(gemm.get("accumulator", {}))
            fmt = gemm.get("output_format")
            out[(section, f"{g} output")] = "float32 output" if fmt is None else f"output rounded to {_show(fmt)}"
            for k, v in flatten({k: v for k, v in gemm.items() if k not in ("a", "b", "accumulator",
                                                                             "output_format")}).items():
                out[(section, f"{g}.{k}")] = _show(v)
        for k, v in flatten({k: v for k, v in lin.items() if k not in GEMMS}).items():
            out[(section, k)] = _show(v)

    linear("linear", recipe.get("linear", {}))
    for i, ov in enumerate(recipe.get("overrides") or []):
        if isinstance(ov, Mapping) and "linear" in ov:
            linear(f"override {_show(ov.get('pattern'), 60)}", ov["linear"])
        else:
            out[("overrides", f"[{i}]")] = _show(ov)
    got = recipe.get("optimizer")
    opt: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
    for k in ("exp_avg", "exp_avg_sq", "grad"):
        out[("optimizer", k)] = _spec_words(opt.get(k))
    for k, v in flatten({k: v for k, v in opt.items() if k not in ("exp_avg", "exp_avg_sq", "grad")}).items():
        out[("optimizer", k)] = _show(v)
    comm = recipe.get("grad_comm")
    if isinstance(comm, Mapping):
        words = _spec_words(comm.get("spec"))
        if comm.get("rounding"):
            words += f", {comm['rounding']} rounding"
        out[("grad_comm", "")] = words + (", error feedback" if comm.get("error_feedback") else "")
    else:
        out[("grad_comm", "")] = "float32 all-reduce" if comm is None else _show(comm)
    fb = recipe.get("fallback")
    if isinstance(fb, Mapping):
        if isinstance(fb.get("to"), Mapping):
            linear("fallback to", fb["to"])
        for k, v in flatten({k: v for k, v in fb.items() if not isinstance(v, Mapping) or k != "to"}).items():
            out[("fallback", k)] = _show(v)
    else:
        out[("fallback", "")] = "off" if fb is None else _show(fb)
    skip = {"name", "linear", "overrides", "optimizer", "grad_comm", "fallback"}
    for k, v in flatten({k: v for k, v in recipe.items() if k not in skip}).items():
        out[(k, "")] = _show(v)
    return out


def recipe_diff(base: Any, cand: Any) -> list[tuple[str, str, str]]:
    """(what, baseline, candidate) for each recipe term that differs (``recipe_terms``); operands, accumulators
    and outputs of one linear recipe with the same change are one row (``linear: forward.a (input), forward.b
    (weight)``)."""
    bt, ct = recipe_terms(base), recipe_terms(cand)
    merged: dict[tuple[str, str, str], list[str]] = {}
    for key in list(dict.fromkeys([*bt, *ct])):
        bv, cv = bt.get(key, "(none)"), ct.get(key, "(none)")
        if bv != cv:
            merged.setdefault((key[0], bv, cv), []).append(key[1])
    rows = []
    for (section, bv, cv), items in merged.items():
        shown = ", ".join(i for i in items if i)
        if section in ("linear", "fallback to") or section.startswith("override "):
            for what, ends in (("every GEMM operand", (".a (", ".b (")), ("every GEMM accumulator", (" accumulator",)),
                               ("every GEMM output", (" output",))):
                if len(items) == (6 if what.endswith("operand") else 3) and all(any(e in i for e in ends)
                                                                                 for i in items):
                    shown = what
        rows.append((f"{section}: {shown}" if shown else section, bv, cv))
    return rows


def _recipe_name(recipe: Any) -> str:
    return str(recipe.get("name", "?")) if isinstance(recipe, Mapping) else _show(recipe, 40)


# ----------------------------------------------------------------------------------------------- groups
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Group:
    key: str
    """The group's name (the runs' ``group``, else their name)."""
    label: str
    """What the report calls it: ``key`` less the prefix every group shares (``demo-2026.../``)."""
    runs: list[RunData]
    verdict: Verdict | None
    color: str

    @property
    def title(self) -> str:
        """``label``, plus the runs' common name (without `` seed N``) when it says more."""
        stems = {re.sub(r" seed \S+$", "", r.name) for r in self.runs}
        stem = stems.pop() if len(stems) == 1 else ""
        if not stem or self.label.endswith(stem):
            return self.label
        return stem if stem == self.label or stem.endswith(" " + self.label) else f"{self.label}: {stem}"


def _groups(runs: list[RunData], verdicts: list[Verdict]) -> list[_Group]:
    """One group per verdict (its candidates), then the runs no verdict judged, grouped by ``group`` or name."""
    by_id = {r.run_id: r for r in runs}
    parts: list[tuple[str, list[RunData], Verdict | None]] = []
    seen: set[str] = set()
    for v in verdicts:
        members = [by_id[c] for c in v.candidates if c in by_id]
        seen.update(r.run_id for r in members)
        key = ", ".join(dict.fromkeys(r.group or r.name for r in members)) or ", ".join(v.candidates)
        parts.append((key, members, v))
    rest: dict[str, list[RunData]] = {}
    for r in runs:
        if r.run_id not in seen:
            rest.setdefault(r.group or r.name, []).append(r)
    parts += [(k, rs, None) for k, rs in rest.items()]
    keys = [k for k, _, _ in parts]
    cut = 0
    if len(keys) > 1:
        common = os.path.commonprefix(keys)
        cut = common.rfind("/") + 1
        if any(len(k) <= cut for k in keys):
            cut = 0
    return [_Group(key=k, label=k[cut:], runs=rs, verdict=v, color=PALETTE[i % len(PALETTE)])
            for i, (k, rs, v) in enumerate(parts)]


def _table(head: list[str], rows: list[list[str]], classes: list[list[str]] | None = None) -> str:
    """``rows`` are already-escaped HTML cells."""
    out = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = classes[i] if classes else [""] * len(r)
        out.append("<tr>" + "".join(f'<td class="{c}">{x}</td>' if c else f"<td>{x}</td>"
                                     for x, c in zip(r, cls, strict=True)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- ranges
def _finite(arrays: Sequence[np.ndarray], *, positive: bool = False) -> np.ndarray:
    vals = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    v = np.concatenate(vals) if vals else np.zeros(0)
    v = v[np.isfinite(v)]
    return v[v > 0] if positive else v


def display_range(ref: Sequence[np.ndarray], others: Sequence[np.ndarray], *, log: bool = False,
                  floor: float | None = None, spread: float = 1.0) -> tuple[float, float]:
    """The y range of a chart: all of ``ref`` (what must be read: the baseline, the judge's lines), widened to
    ``others`` (candidates) by at most ``spread`` times ``ref``'s span on each side (on a log axis: in decades,
    at most one decade), so a diverged or exploding run cannot flatten the other curves (``ref`` keeps at least
    a third of the height); never below ``floor`` (0 for a loss).  Non-finite values are ignored; padded by 5%.
    What leaves the range is clipped at the plot area and named under the chart."""
    r = _finite(ref, positive=log)
    o = _finite(others, positive=log)
    if log:
        r, o = np.log10(r), np.log10(o)
    if not r.size:
        r = o if o.size else np.zeros(1)
    y0, y1 = float(r.min()), float(r.max())
    span = y1 - y0 or abs(y1) or 1.0
    reach = min(spread * span, 1.0) if log else spread * span
    if o.size:
        y0, y1 = max(min(y0, float(o.min())), y0 - reach), min(max(y1, float(o.max())), y1 + reach)
    pad = 0.05 * (y1 - y0 or (0.5 if log else abs(y1) or 1.0))
    lo, hi = y0 - pad, y1 + pad
    if log:
        lo, hi = 10.0 ** lo, 10.0 ** hi
    if floor is not None and lo < floor:
        lo = floor if not log else lo
    return lo, hi


def _nonnegative(b: Baseline) -> bool:
    """Is the training loss a non-negative quantity?  By its name, or when every baseline value is >= 0."""
    mins = b.env_min[np.isfinite(b.env_min)]
    return "loss" in LOSS_KEY and bool(mins.size) and bool((mins >= 0).all())


def _off_scale(name: str, x: np.ndarray, y: np.ndarray, raw: np.ndarray, y_range: tuple[float, float]) -> str:
    """A sentence when a run's curve leaves the chart (beyond the y range, or non-finite), else ''."""
    bits = []
    fin = np.isfinite(y)
    hi = fin & (y > y_range[1])
    lo = fin & (y < y_range[0])
    if hi.any():
        k = int(np.argmax(np.where(hi, y, -np.inf)))
        bits.append(f"above the chart from step {int(x[hi][0])} (up to {y[k]:.4g} at step {int(x[k])})")
    if lo.any():
        bits.append(f"below the chart from step {int(x[lo][0])} (down to {float(y[lo].min()):.4g})")
    bad = ~np.isfinite(raw)
    if bad.any():
        bits.append(f"non-finite ({float(raw[bad][0])!r}) from step {int(x[bad][0])}: the line stops there")
    return f"{name}: " + "; ".join(bits) if bits else ""


def _loss(r: RunData) -> tuple[np.ndarray, np.ndarray]:
    st, v = r.scalars.get(LOSS_KEY, (np.zeros(0), np.zeros(0)))
    return np.asarray(st, dtype=np.float64), np.asarray(v, dtype=np.float64)


def _notes(lines: list[str]) -> str:
    lines = [x for x in lines if x]
    if not lines:
        return ""
    return '<p class="muted note">Off the chart: ' + "; ".join(esc(x) for x in lines) + ".</p>"


# ----------------------------------------------------------------------------------------------- charts
def _loss_chart(b: Baseline, groups: list[_Group]) -> str:
    """Every run's smoothed loss over the baseline envelope: one colour per group (per seed when there is one
    group, with that group's mean and the judge's lines)."""
    w = b.criteria.smoothing_window
    warm = math.ceil(b.criteria.warmup_fraction * b.steps)
    nonneg = _nonnegative(b)
    after = b.env_steps > warm
    single = len(groups) == 1
    lines, notes, curves = [], [], []
    for g in groups:
        for k, r in enumerate(g.runs):
            st, v = _loss(r)
            sm = smooth(v, w)
            curves.append((r.name, st, sm, v))
            lines.append(Line(label=r.name if single else g.title, x=st, y=sm, width=1.2, in_legend=single or k == 0,
                              color=PALETTE[k % len(PALETTE)] if single else g.color, opacity=1.0 if single else 0.8))
    ref = [b.env_min[after], b.env_max[after]]
    extra: list[Line] = []
    if single and groups[0].runs:
        m = len(groups[0].runs)
        lo, hi = curve_band(b, m)
        if nonneg:  # the displayed lines never ask for a loss below zero
            lo, hi = np.maximum(lo, 0.0), np.maximum(hi, 0.0)
        ref += [lo[after], hi[after]]
        extra += [Line(label=f"judge's {word} line (mean of {m})", x=b.env_steps, y=y, color="#555", width=1.0,
                       dash=dash) for word, y, dash in (("pass", lo, "4 3"), ("fail", hi, "1 2"))]
        st, mean = candidate_mean_curve(b, groups[0].runs)
        if st.size and m > 1:
            extra.append(Line(label=f"candidate mean ({m})", x=st, y=mean, color=MEAN_COLOR, width=2.4))
    finite_mean = b.env_mean[np.isfinite(b.env_mean)]
    log = bool(finite_mean.size) and float(finite_mean.min()) > 0 and (
        float(finite_mean.max()) / float(finite_mean.min()) >= 10.0)
    if log:  # a log axis shows the whole run, warm-up included
        ref = [b.env_min, b.env_max] + ref[2:]
    cand_after = [c[2][c[1] > warm] if not log else c[2] for c in curves]
    y_range = display_range(ref, cand_after, log=log, floor=0.0 if nonneg else None)
    for name, st, sm, raw in curves:
        notes.append(_off_scale(name, st, sm, raw, y_range))
    base = [Line(label=f"baseline mean ({b.n_seeds} seeds)", x=b.env_steps, y=b.env_mean, color=BASELINE_COLOR,
                 width=1.8)]
    band = Band(label="baseline min..max", x=b.env_steps, lo=b.env_min, hi=b.env_max, color="#888", opacity=0.35)
    spans = [Span(label=f"warm-up ({warm} steps, not judged)", x0=0.0, x1=float(warm))] if warm else []
    svg = line_chart(lines=lines + base + extra, bands=[band], spans=spans, y_log=log, y_range=y_range,
                     title=f"smoothed {LOSS_KEY} (window {w}){', log scale' if log else ''}", x_label="step",
                     y_label="loss" + (" (log)" if log else ""), width=1000, height=360)
    return svg + _notes(notes)


def _group_curve_chart(b: Baseline, g: _Group, legend_width: float | None = None) -> str:
    """One group's candidate mean minus the baseline mean, in % of the baseline mean (the judge's scale), with
    each seed, the judge's pass and fail lines for the mean of this many seeds and the declared margin."""
    c = b.criteria
    w = c.smoothing_window
    warm = math.ceil(c.warmup_fraction * b.steps)
    m = len(g.runs)
    lo_abs, hi_abs = curve_band(b, m)
    if _nonnegative(b):
        lo_abs, hi_abs = np.maximum(lo_abs, 0.0), np.maximum(hi_abs, 0.0)
    steps = b.env_steps.astype(np.float64)
    scale = np.abs(b.env_mean)

    def rel(st: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = np.isin(st, b.env_steps)
        idx = np.searchsorted(b.env_steps, st[keep])
        with np.errstate(divide="ignore", invalid="ignore"):
            return st[keep].astype(np.float64), 100.0 * (y[keep] - b.env_mean[idx]) / scale[idx]

    _, pass_rel = rel(b.env_steps, lo_abs)
    _, fail_rel = rel(b.env_steps, hi_abs)
    after = steps > warm
    seeds = []
    notes = []
    for r in g.runs:
        st, v = _loss(r)
        x, y = rel(st.astype(np.int64), smooth(v, w))
        seed = r.manifest.get("seed")
        seeds.append((f"seed {seed}" if seed is not None and len(g.runs) > 1 else r.name, x, y,
                      v[np.isin(st, b.env_steps)]))
    mx, my = np.zeros(0), np.zeros(0)
    if g.runs:
        st, mean = candidate_mean_curve(b, g.runs)
        mx, my = rel(st, mean)
    margin = 100.0 * c.curve_margin_rel
    ref = [pass_rel[after], fail_rel[after], np.array([0.0, margin])]
    others = [my[mx > warm]] + [y[x > warm] for _, x, y, _ in seeds]
    y_range = display_range(ref, others)
    for name, x, y, raw in seeds:
        notes.append(_off_scale(name, x, y, raw, y_range))
    lo_edge, hi_edge = np.full(steps.shape, y_range[0]), np.full(steps.shape, y_range[1])
    bands = [Band(label="below the pass line: within the margin", x=steps, lo=lo_edge,
                  hi=np.minimum(np.maximum(pass_rel, y_range[0]), y_range[1]), color="#2ca02c", opacity=0.10),
             Band(label="above the fail line: beyond the margin", x=steps,
                  lo=np.maximum(np.minimum(fail_rel, y_range[1]), y_range[0]), hi=hi_edge, color="#d62728",
                  opacity=0.10)]
    lines = [Line(label=r_name, x=x, y=y, color=PALETTE[k % len(PALETTE)], width=1.0, opacity=0.75)
             for k, (r_name, x, y, _) in enumerate(seeds)] if m > 1 else []  # one seed: it is the mean
    lines += [Line(label="baseline mean (0)", x=steps[[0, -1]] if steps.size else steps, y=np.zeros(min(2, steps.size)),
                   color=BASELINE_COLOR, width=1.2),
              Line(label=f"declared margin (+{margin:.3g}%)", x=steps[[0, -1]] if steps.size else steps,
                   y=np.full(min(2, steps.size), margin), color="#555", width=1.0, dash="6 2 1 2"),
              Line(label=f"pass line (mean of {m})", x=steps, y=pass_rel, color="#2a7a2a", width=1.2, dash="4 3"),
              Line(label=f"fail line (mean of {m})", x=steps, y=fail_rel, color="#b22222", width=1.2, dash="1 2")]
    if mx.size:
        lines.append(Line(label=f"candidate mean ({m})" if m > 1 else "candidate", x=mx, y=my, color=MEAN_COLOR,
                          width=2.4))
    spans = [Span(label=f"warm-up ({warm} steps, not judged)", x0=0.0, x1=float(warm))] if warm else []
    curve = next((r for r in (g.verdict.results if g.verdict else ()) if r.name == "curve"), None)
    title = f"{g.title}: candidate mean minus the baseline mean" + (f" (curve {curve.word})" if curve else "")
    svg = line_chart(lines=lines, bands=bands, spans=spans, title=title, x_label="step", y_range=y_range,
                     y_label="% of the baseline mean", width=1000, height=300, legend_width=legend_width)
    return svg + _notes(notes)


def _html_legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span class="item"><span class="swatch" style="background:{esc(c)}"></span>{esc(label)}</span>'
        for label, c in items) + "</div>"


_DYNAMICS = ("train/grad_norm", "train/lr")


def _dynamics_section(b: Baseline, groups: list[_Group], baseline_runs: Sequence[RunData]) -> str:
    """Small multiples over steps: each eval metric, the (smoothed) gradient norm and the learning rate, for the
    baseline's seeds (grey, when given) and every candidate (its group's colour)."""
    w = b.criteria.smoothing_window
    keys = [f"eval/{m}" for m in b.metrics]
    for r in [*baseline_runs, *(r for g in groups for r in g.runs)]:
        keys += [k for k in r.scalars if k.startswith("eval/") and k not in keys]
    keys += list(_DYNAMICS)
    charts = []
    for key in keys:
        series: list[tuple[str, str, np.ndarray, np.ndarray, bool]] = []
        for r in baseline_runs:
            if key in r.scalars:
                x, y = r.scalars[key]
                series.append((r.name, BASELINE_SEED_COLOR, np.asarray(x), np.asarray(y), True))
        for g in groups:
            for r in g.runs:
                if key in r.scalars:
                    x, y = r.scalars[key]
                    series.append((r.name, g.color, np.asarray(x), np.asarray(y), False))
        if not any(np.isfinite(np.asarray(y, dtype=np.float64)).sum() >= 2 for *_, y, _ in series):
            continue  # a single point per run is the final-metrics chart's job
        smoothed = key == "train/grad_norm"
        lines = []
        for name, color, x, y, is_base in series:
            yy = np.asarray(y, dtype=np.float64)
            yy = smooth(yy, w) if smoothed else yy
            lines.append(Line(label=name, x=np.asarray(x, dtype=np.float64), y=yy, color=color,
                              width=1.0 if is_base else 1.2, markers=key.startswith("eval/"), in_legend=False))
        ref = [ln.y for ln, s in zip(lines, series, strict=True) if s[4]]
        if not ref:  # no baseline runs: the middle 96% of every value sets the range
            allv = _finite([ln.y for ln in lines])
            ref = [np.quantile(allv, [0.02, 0.98])] if allv.size else []
        pos = _finite([ln.y for ln in lines], positive=True)
        fin = _finite([ln.y for ln in lines])
        log = key == "train/grad_norm" and pos.size == fin.size and pos.size > 0 and (
            float(pos.max()) / float(pos.min()) >= 100.0)
        nonneg = bool(fin.size) and float(fin.min()) >= 0
        y_range = display_range(ref, [ln.y for ln in lines], log=log, floor=0.0 if nonneg else None)
        if key == "train/lr":
            y_range = display_range([ln.y for ln in lines], [], floor=0.0)
        title = key + (f" (smoothed, window {w})" if smoothed else "") + (", log scale" if log else "")
        svg = line_chart(lines=lines, title=title, x_label="step", y_label=key.split("/")[-1], y_range=y_range,
                         y_log=log, width=490, height=230, legend=None)
        off = [ln.label for ln, s in zip(lines, series, strict=True)
               if _off_scale(ln.label, np.asarray(ln.x), np.asarray(ln.y), np.asarray(s[3], dtype=np.float64),
                             y_range)]
        note = (f'<p class="muted note">Partly off the chart ({len(off)}): {esc(", ".join(off))}</p>'
                if off else "")
        charts.append(f'<div class="multiple">{svg}{note}</div>')
    if not charts:
        return ""
    items = ([(f"baseline seeds ({len(baseline_runs)})", BASELINE_SEED_COLOR)] if baseline_runs else [])
    items += [(g.title, g.color) for g in groups]
    return _html_legend(items) + '<div class="charts">' + "\n".join(charts) + "</div>"


def _metrics_section(b: Baseline, groups: list[_Group]) -> str:
    metrics = list(b.metrics)
    head = ["run", "run id", "seed", "group"] + [f"{m} ({'lower' if b.metrics[m] == 'min' else 'higher'} is better)"
                                                 for m in metrics]
    rows = []
    for i, (s, n) in enumerate(zip(b.seeds, b.run_names, strict=True)):
        rid = b.run_ids[i] if i < len(b.run_ids) else ""
        rows.append([esc(n), f"<code>{esc(rid)}</code>", esc(s), "baseline"]
                    + [f"{b.finals[m][i]:.6g}" for m in metrics])
    for g in groups:
        for r in g.runs:
            vals = [final_value(r, m) for m in metrics]
            rows.append([esc(r.name), f"<code>{esc(r.run_id)}</code>", esc(r.manifest.get("seed")), esc(g.label)]
                        + ["(none)" if v is None else esc(f"{v[1]:.6g}") for v in vals])
    classes = [["", "", "num", ""] + ["num"] * len(metrics) for _ in rows]
    charts = []
    for m in metrics:
        base = list(b.finals[m])
        strip = [Strip(label=f"baseline ({b.n_seeds})", values=base, color="#555", names=list(b.run_names),
                       mark=float(np.mean(base)) if base else None)]
        for g in groups:
            got = [(r.name, fv[1]) for r in g.runs if (fv := final_value(r, m)) is not None]
            ys = [val for _, val in got]
            fin = [val for val in ys if math.isfinite(val)]
            strip.append(Strip(label=g.label, values=ys, color=g.color, names=[n for n, _ in got],
                               mark=float(np.mean(fin)) if len(fin) > 1 else None))
        charts.append(strip_chart(rows=strip, title=f"final eval/{m}", x_label=m))
    note = '<p class="muted note">Dots: runs (hover for the run); black ticks: means.</p>'
    return _table(head, rows, classes) + '<div class="charts">' + "\n".join(charts) + "</div>" + note


def _headline(verdicts: Sequence[Any], noun: str = "groups") -> str:
    """The verdict; with several groups (``noun``), the count of each outcome (FAIL first), in the combined
    outcome's colour (FAIL when any group FAILs).  Anything with an ``outcome`` is a verdict here."""
    if not verdicts:
        return '<span class="headline muted">not judged</span>'
    else:
        cls = combine_outcomes([v.outcome for v in verdicts])
        if len(verdicts) == 1:
            word = WORDS[cls]
        else:
            counts = {o: sum(v.outcome == o for v in verdicts) for o in OUTCOME_ORDER}
            word = ", ".join(f"{n} {WORDS[o]}" for o, n in counts.items() if n) + f" of {len(verdicts)} {noun}"
        return f'<span class="headline {cls}">{word}</span>'


def _summary_table(groups: list[_Group]) -> str:
    rows, classes = [], []
    for g in groups:
        v = g.verdict
        open_ = ", ".join(f"{r.name} {r.word}" for r in v.results if not r.passed) if v else ""
        rows.append([esc(g.title), v.word if v else "not judged", esc(len(g.runs)), esc(open_ or "-")])
        classes.append(["", v.outcome if v else "muted", "num", ""])
    return _table(["group", "verdict", "runs", "criteria not passed"], rows, classes)


def _verdicts_section(groups: list[_Group]) -> str:
    """One verdict table per judged group, headed by the group's name and its verdict."""
    out = []
    for g in groups:
        v = g.verdict
        if v is None:
            continue
        out.append(f'<h3><span class="{v.outcome}">{v.word}</span> {esc(g.title)} '
                   f'<span class="muted">({len(v.candidates)} run(s))</span></h3>')
        out.append(_verdict_section(v))
        if v.plan is not None and v.plan.get("advice"):
            out.append(f'<p class="inconclusive">{esc(v.plan["advice"])}</p>')
    return "\n".join(out)


def _verdict_section(v: Verdict) -> str:
    rows, classes = [], []
    for r in v.results:
        rows.append([esc(r.name) + (' <span class="muted">(guard)</span>' if r.role == "guard" else ""), r.word,
                     esc(r.reason)])
        classes.append(["", r.outcome, ""])
    return _table(["criterion", "result", "evidence"], rows, classes)


def group_diff(baseline: Baseline, runs: list[RunData]) -> list[tuple[str, str, str, bool]]:
    """(key, baseline value, the group's value, varies) for each config/manifest key, recipe excluded
    (``recipe_diff``), where some run of the group has a value none of the baseline's seeds has: once per group;
    a key whose value differs between the group's runs lists each run's value (by seed).  ``varies``: the key
    varies within the baseline or within the group (seed, host, ...)."""
    base_sets = {k: v for k, v in _baseline_values(baseline).items() if not k.startswith("config.recipe.")}
    missing = object()
    flats = [{k: v for k, v in flatten({"manifest": r.manifest, "config": identity_config(r.config)}).items()
              if not k.startswith("config.recipe.") and k != "config.recipe"} for r in runs]
    keys = sorted(set(base_sets).union(*flats)) if flats else []
    rows = []
    for key in keys:
        vals = base_sets.get(key, [])
        per = [f.get(key, missing) for f in flats]
        if all(p is not missing and p in vals for p in per):
            continue
        shown = ["(missing)" if p is missing else _show(p, 60) for p in per]
        in_group = len(set(shown)) > 1
        if not in_group:
            cell = shown[0]
        elif key == "manifest.seed":
            cell = " | ".join(shown)
        else:
            cell = "; ".join(f"seed {r.manifest.get('seed')}: {s}" for r, s in zip(runs, shown, strict=True))
        rows.append((key, _show_baseline(vals), cell, in_group or len(_distinct(vals)) > 1))
    return rows


def _diff_section(b: Baseline, groups: list[_Group]) -> str:
    out = []
    base_recipe = b.config.get("recipe")
    for g in groups:
        out.append(f"<h3>{esc(g.title)} <span class=\"muted\">({len(g.runs)} run(s))</span></h3>")
        recipes: dict[str, tuple[Any, list[RunData]]] = {}
        for r in g.runs:
            rec = r.config.get("recipe")
            recipes.setdefault(json.dumps(rec, sort_keys=True, default=str), (rec, []))[1].append(r)
        for rec, members in recipes.values():
            who = "" if len(recipes) == 1 else " (" + ", ".join(r.name for r in members) + ")"
            rows = recipe_diff(base_recipe, rec)
            bn, cn = _recipe_name(base_recipe), _recipe_name(rec)
            if not rows:
                out.append(f"<p><b>recipe</b>: the baseline's ({esc(bn)}){esc(who)}</p>")
                continue
            head = f"{bn} \u2192 {cn}" if bn != cn else f"{bn}, changed"
            out.append(f"<p><b>recipe</b>: {esc(head)}{esc(who)}</p>")
            out.append(_table(["recipe element", "baseline", "candidate"],
                              [[esc(k), esc(bv), esc(cv)] for k, bv, cv in rows]))
        rows2 = group_diff(b, g.runs)
        if not rows2:
            out.append("<p>No other config or manifest differences.</p>")
            continue
        cells = [[f"<code>{esc(k)}</code>", esc(bv), esc(cv)] for k, bv, cv, _ in rows2]
        cls = [["muted" if varies else ""] * 3 for *_, varies in rows2]
        out.append(_table(["key", "baseline", "candidate"], cells, cls))
    out.append('<p class="muted">Recipes compared in recipe terms (each GEMM operand by the tensor it is); other '
               "config and manifest keys once per group.  Grey rows: keys that vary between seeds (seed, host, "
               "...), each seed's value listed.</p>")
    return "\n".join(out)


_HEAT_MAX_COLS = 120
_HEAT_MAX_ROWS = 60


def stats_grid(run: RunData, stat: str) -> tuple[list[str], list[int], np.ndarray]:
    """Rows ("module role"), sampled steps and the ``rows x steps`` values of per-layer statistic ``stat`` of the
    recipe's own specs (what-if specs left out) from a run's ``stats/<module>/<role>/<stat>`` scalars."""
    from .._layer_stats import records_from_scalars

    recs = [r for r in records_from_scalars(run.scalars) if r["what_if"] is None and stat in r["stats"]]
    rows = sorted({(r["module"], r["role"]) for r in recs})
    steps = sorted({int(r["step"]) for r in recs})
    grid = np.full((len(rows), len(steps)), np.nan)
    ri = {k: i for i, k in enumerate(rows)}
    si = {s: j for j, s in enumerate(steps)}
    for r in recs:
        grid[ri[(r["module"], r["role"])], si[int(r["step"])]] = r["stats"][stat]
    return [f"{m} {role}" for m, role in rows], steps, grid


REPORTED_EVENTS = ("fallback", "nonfinite", "diverged", "spike", "rerun", "rollback", "skip", "sdc")
"""Events the report lists per run: numerics (fallbacks, non-finite values) and reliability (spikes, reruns and
their diagnosis, rollbacks, the skip ledger, replica mismatches)."""


def _numerics_section(runs: list[RunData]) -> str:
    """Per run with sampled statistics: layer x step heatmaps of SQNR and underflow, and its numerics events."""
    out = []
    for r in runs:
        events = [e for e in r.events if e.get("kind") in REPORTED_EVENTS]
        labels, steps, sqnr = stats_grid(r, "sqnr_db")
        if not labels and not events:
            continue
        out.append(f"<h3>{esc(r.name)} <span class=\"muted\">({esc(r.run_id)})</span></h3>")
        if labels:
            cols = np.linspace(0, len(steps) - 1, min(len(steps), _HEAT_MAX_COLS)).round().astype(int)
            cols = np.unique(cols)
            shown = [steps[j] for j in cols]
            keep = slice(0, _HEAT_MAX_ROWS)
            out.append(heatmap(rows=labels[keep], cols=shown, values=sqnr[keep][:, cols],
                               title="SQNR of each quantized tensor (dB; higher is better)", value_label="dB",
                               value_range=(0.0, 40.0), higher_is_better=True))
            ul, us, under = stats_grid(r, "underflow_pct")
            if ul:
                finite = under[np.isfinite(under)]
                top = max(1.0, float(finite.max()) if finite.size else 1.0)
                out.append(heatmap(rows=ul[keep], cols=[us[j] for j in cols], values=under[keep][:, cols],
                                   title="underflow: nonzero values that quantize to zero (%; lower is better)",
                                   value_label="%", value_range=(0.0, top), higher_is_better=False))
            if len(labels) > _HEAT_MAX_ROWS:
                out.append(f'<p class="muted">First {_HEAT_MAX_ROWS} of {len(labels)} tensors shown; '
                           "`lowprec stats RUN` lists the worst.</p>")
        if events:
            rows = [[esc(e.get("step")), esc(e.get("kind")), f"<code>{esc(_show(e.get('payload')))}</code>"]
                    for e in events]
            out.append(_table(["step", "event", "details"], rows))
    return "\n".join(out)


def write_report(path: str | os.PathLike, *, baseline: Baseline, runs: list[RunData],
                 verdict: Verdict | Sequence[Verdict] | None, title: str = "lowprec accuracy report",
                 expectation: str | None = None, baseline_runs: Sequence[RunData] = ()) -> Path:
    """Write the HTML report atomically to ``path`` (directories created) and return the path.

    ``verdict``: one verdict, one per judged group (e.g. per recipe), or None (curves and metrics only).
    ``expectation``: what the caller expected of the verdicts and whether it came true (e.g. a demo with a
    negative control that must FAIL), shown under the headline.  ``baseline_runs``: the baseline's own seed runs
    (``RunData.from_store`` of ``baseline.run_ids``), for the eval / gradient-norm / learning-rate charts over
    time; without them those charts show the candidates only."""
    b = baseline
    verdicts = [] if verdict is None else [verdict] if isinstance(verdict, Verdict) else list(verdict)
    groups = _groups(runs, verdicts)
    ident = _table(["baseline", "model", "data hash", "steps", "seeds", "config digest"], [[
        esc(b.name), esc(b.model), f"<code>{esc(b.data_hash)}</code>", esc(b.steps),
        esc(", ".join(map(str, b.seeds))), f"<code>{esc(b.config_digest)}</code>"]])
    n_groups = f" in {len(groups)} groups" if len(groups) > 1 else ""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"/>', f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>{_headline(verdicts)} {len(runs)} candidate run(s){n_groups} against baseline "
        f"<b>{esc(b.name)}</b></p>",
    ]
    if expectation:
        parts.append(f'<p class="expectation"><b>Expected:</b> {esc(expectation)}</p>')
    if len(groups) > 1:
        parts.append(_summary_table(groups))
    parts += [ident, "<h2>Training loss</h2>", _loss_chart(b, groups)]
    if any(g.runs for g in groups):
        parts.append("<h3>Each group against the baseline</h3>")
        parts.append('<p class="muted note">The judge\'s view: the mean of the group\'s smoothed loss minus the '
                     "baseline mean, in % of the baseline mean.  A step is within the margin when the mean is "
                     "below the pass line and beyond it when above the fail line (both for this number of "
                     "seeds); steps in the warm-up are not judged.</p>")
        warm = math.ceil(b.criteria.warmup_fraction * b.steps)
        longest = max(text_width(lbl) for g in groups for lbl in [  # the legend labels of _group_curve_chart
            "above the fail line: beyond the margin", f"warm-up ({warm} steps, not judged)",
            *(f"seed {r.manifest.get('seed')}" for r in g.runs)])
        parts += [_group_curve_chart(b, g, legend_width=min(longest + 30, 260.0)) for g in groups if g.runs]
    dynamics = _dynamics_section(b, groups, baseline_runs)
    if dynamics:
        parts += ["<h2>Eval metrics, gradient norm and learning rate over time</h2>", dynamics]
    parts += ["<h2>Final eval metrics</h2>", _metrics_section(b, groups)]
    if verdicts:
        parts += ["<h2>Verdict</h2>", _verdicts_section(groups)]
    numerics = _numerics_section(runs)
    if numerics:
        parts += ["<h2>Per-layer numerics</h2>", numerics]
    parts += ["<h2>Differences from the baseline</h2>", _diff_section(b, groups),
              "<h2>Acceptance criteria</h2>",
              _table(["criterion", "value"], [[esc(k), f"<code>{esc(json.dumps(v))}</code>"]
                                              for k, v in b.criteria.to_dict().items()]),
              f'<p class="muted">Written {esc(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))}'
              " by lowprec; method: docs/accuracy.md.</p>", "</body></html>"]
    return atomic_write_text(path, "\n".join(parts) + "\n")
