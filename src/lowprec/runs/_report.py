"""One self-contained HTML report: candidate runs against a baseline, with the verdict and what differs.

Sections: the headline verdict; smoothed training loss of each candidate over the baseline envelope (mean line,
min/max band, and the judge's acceptance band for the mean of the candidates, dashed); the final eval metrics of
every run (a table and a strip chart per metric); the verdict table (PASS green, FAIL red) with each reason; the
config and manifest keys whose values differ between the baseline and each candidate (nested dicts flattened to
dotted keys: recipe, versions, hardware, ...); the acceptance criteria; and, for runs that sampled per-layer
statistics (``[stats] every``), layer x step heatmaps of SQNR and underflow plus their fallback / non-finite
events.  No external asset, no script: the charts
are inline SVG (``_svg``) and every text taken from a run is escaped.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._atomic import atomic_write_text
from ._baseline import LOSS_KEY, Baseline, RunData, final_value, identity_config
from ._judge import Verdict, candidate_mean_curve, curve_band
from ._stats import smooth
from ._svg import PALETTE, Band, Line, esc, heatmap, line_chart, strip_chart

_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { background: #d8f5d8; color: #0a5d0a; font-weight: bold; }
.fail { background: #fbd5d5; color: #9b0000; font-weight: bold; }
.muted { color: #888; }
.headline { font-size: 20px; padding: 6px 12px; display: inline-block; }
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


def manifest_diff(baseline: Baseline, run: RunData) -> list[tuple[str, str, str, bool]]:
    """(key, baseline value, candidate value, varies_within_baseline) for every config/manifest key whose
    candidate value is not one of the baseline seeds' values."""
    base_sets: dict[str, list[Any]] = {}
    for man in baseline.manifests:
        for k, v in flatten({"manifest": man}).items():
            base_sets.setdefault(k, []).append(v)
    for k, v in flatten({"config": baseline.config}).items():
        base_sets[k] = [v]
    cand = flatten({"manifest": run.manifest, "config": identity_config(run.config)})
    rows = []
    for key in sorted(set(base_sets) | set(cand)):
        vals = base_sets.get(key, [])
        distinct = list({json.dumps(v, sort_keys=True, default=str): v for v in vals}.values())
        if key in cand and cand[key] in vals:  # the candidate has one of the baseline's own values
            continue
        b = ("(missing)" if not vals else _show(distinct[0]) if len(distinct) == 1
             else "varies: " + " | ".join(_show(v, 40) for v in distinct))
        rows.append((key, b, _show(cand[key]) if key in cand else "(missing)", len(distinct) > 1))
    return rows


def _table(head: list[str], rows: list[list[str]], classes: list[list[str]] | None = None) -> str:
    """``rows`` are already-escaped HTML cells."""
    out = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = classes[i] if classes else [""] * len(r)
        out.append("<tr>" + "".join(f'<td class="{c}">{x}</td>' if c else f"<td>{x}</td>"
                                     for x, c in zip(r, cls, strict=True)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _loss_chart(b: Baseline, runs: list[RunData]) -> str:
    w = b.criteria.smoothing_window
    warm = math.ceil(b.criteria.warmup_fraction * b.steps)
    lines, after = [], b.env_steps > warm
    for i, r in enumerate(runs):
        st, v = r.scalars.get(LOSS_KEY, (np.zeros(0), np.zeros(0)))
        lines.append(Line(label=r.name, x=np.asarray(st), y=smooth(np.asarray(v, dtype=np.float64), w),
                          color=PALETTE[i % len(PALETTE)], width=1.3))
    lo, hi = curve_band(b, max(1, len(runs)))
    lines.append(Line(label=f"baseline mean ({b.n_seeds} seeds)", x=b.env_steps, y=b.env_mean, color="#000",
                      width=1.8))
    lines += [Line(label=f"judge band, mean of {len(runs)}" if k == 0 else "", x=b.env_steps, y=y, color="#555",
                   width=1.0, dash="4 3") for k, y in enumerate((lo, hi))]
    band = Band(label="baseline min..max", x=b.env_steps, lo=b.env_min, hi=b.env_max, color="#666", opacity=0.35)
    if runs:
        st, mean = candidate_mean_curve(b, runs)
        if st.size and len(runs) > 1:
            lines.append(Line(label=f"candidate mean ({len(runs)})", x=st, y=mean, color="#d62728", width=2.2))
    vis = [b.env_min[after], b.env_max[after], lo[after], hi[after]]
    fin = np.concatenate([v for v in vis if v.size]) if any(v.size for v in vis) else np.zeros(1)
    y0, y1 = float(np.min(fin)), float(np.max(fin))
    for ln in lines[: len(runs)]:
        y = ln.y[(ln.x > warm) & np.isfinite(ln.y)]
        if y.size:  # include candidates, but not beyond 3x the band's span (a diverged run would flatten all)
            span = y1 - y0 or abs(y1) or 1.0
            y0, y1 = max(min(y0, float(y.min())), y0 - 3 * span), min(max(y1, float(y.max())), y1 + 3 * span)
    pad = 0.05 * (y1 - y0 or 1.0)
    return line_chart(lines=lines, bands=[band], title=f"smoothed {LOSS_KEY} (window {w})", x_label="step",
                      y_label="loss", y_range=(y0 - pad, y1 + pad))


def _metrics_section(b: Baseline, runs: list[RunData]) -> str:
    metrics = list(b.metrics)
    head = ["run", "seed", "role"] + [f"{m} ({'lower' if b.metrics[m] == 'min' else 'higher'} is better)"
                                      for m in metrics]
    rows = []
    for i, (s, n) in enumerate(zip(b.seeds, b.run_names, strict=True)):
        rows.append([esc(n), esc(s), "baseline"] + [f"{b.finals[m][i]:.6g}" for m in metrics])
    for r in runs:
        vals = [final_value(r, m) for m in metrics]
        rows.append([esc(r.name), esc(r.manifest.get("seed")), "candidate"]
                    + ["(none)" if v is None else esc(f"{v[1]:.6g}") for v in vals])
    classes = [["", "num", ""] + ["num"] * len(metrics) for _ in rows]
    charts = []
    for m in metrics:
        strip = [(f"baseline ({b.n_seeds})", list(b.finals[m]), "#555")]
        strip += [(r.name, [v[1]] if (v := final_value(r, m)) else [], PALETTE[i % len(PALETTE)])
                  for i, r in enumerate(runs)]
        charts.append(strip_chart(rows=strip, title=f"final eval/{m}", x_label=m))
    return _table(head, rows, classes) + '<div class="charts">' + "\n".join(charts) + "</div>"


def _verdicts_section(verdicts: list[Verdict], runs: list[RunData]) -> str:
    """One verdict table per judged group, headed by the group's name and its PASS/FAIL."""
    names = {r.run_id: (r.group or r.name) for r in runs}
    out = []
    for v in verdicts:
        label = ", ".join(dict.fromkeys(names.get(c, c) for c in v.candidates))
        cls, word = ("pass", "PASS") if v.passed else ("fail", "FAIL")
        out.append(f'<h3><span class="{cls}">{word}</span> {esc(label)} '
                   f'<span class="muted">({len(v.candidates)} run(s))</span></h3>')
        out.append(_verdict_section(v))
    return "\n".join(out)


def _verdict_section(v: Verdict) -> str:
    rows, classes = [], []
    for r in v.results:
        rows.append([esc(r.name), "PASS" if r.passed else "FAIL", esc(r.reason)])
        classes.append(["", "pass" if r.passed else "fail", ""])
    return _table(["criterion", "result", "reason"], rows, classes)


def _diff_section(b: Baseline, runs: list[RunData]) -> str:
    out = []
    for r in runs:
        rows = manifest_diff(b, r)
        out.append(f"<h3>{esc(r.name)} <span class=\"muted\">({esc(r.run_id)})</span></h3>")
        if not rows:
            out.append("<p>No differences.</p>")
            continue
        cells = [[f"<code>{esc(k)}</code>", esc(bv), esc(cv)] for k, bv, cv, _ in rows]
        cls = [["muted" if varies else ""] * 3 for *_, varies in rows]
        out.append(_table(["key", "baseline", "candidate"], cells, cls))
    out.append('<p class="muted">Grey rows: keys that already vary between the baseline seeds (seed, host, '
               "...).</p>")
    return "\n".join(out)


_HEAT_MAX_COLS = 120
_HEAT_MAX_ROWS = 60


def stats_grid(run: RunData, stat: str) -> tuple[list[str], list[int], np.ndarray]:
    """Rows ("module role"), sampled steps and the ``rows x steps`` values of per-layer statistic ``stat`` of the
    recipe's own specs (what-if specs left out) from a run's ``stats/<module>/<role>/<stat>`` scalars."""
    from ..numerics import records_from_scalars

    recs = [r for r in records_from_scalars(run.scalars) if r["what_if"] is None and stat in r["stats"]]
    rows = sorted({(r["module"], r["role"]) for r in recs})
    steps = sorted({int(r["step"]) for r in recs})
    grid = np.full((len(rows), len(steps)), np.nan)
    ri = {k: i for i, k in enumerate(rows)}
    si = {s: j for j, s in enumerate(steps)}
    for r in recs:
        grid[ri[(r["module"], r["role"])], si[int(r["step"])]] = r["stats"][stat]
    return [f"{m} {role}" for m, role in rows], steps, grid


def _numerics_section(runs: list[RunData]) -> str:
    """Per run with sampled statistics: layer x step heatmaps of SQNR and underflow, and its numerics events."""
    out = []
    for r in runs:
        events = [e for e in r.events if e.get("kind") in ("fallback", "nonfinite", "diverged")]
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
                 verdict: Verdict | Sequence[Verdict] | None, title: str = "lowprec accuracy report") -> Path:
    """Write the HTML report atomically to ``path`` (directories created) and return the path.

    ``verdict``: one verdict, one per judged group (e.g. per recipe), or None (curves and metrics only)."""
    b = baseline
    verdicts = [] if verdict is None else [verdict] if isinstance(verdict, Verdict) else list(verdict)
    if not verdicts:
        headline = '<span class="headline muted">not judged</span>'
    else:
        passed = sum(v.passed for v in verdicts)
        cls, word = ("pass", "PASS") if passed == len(verdicts) else ("fail", "FAIL")
        word = word if len(verdicts) == 1 else f"{word}: {passed} of {len(verdicts)} groups pass"
        headline = f'<span class="headline {cls}">{word}</span>'
    ident = _table(["baseline", "model", "data hash", "steps", "seeds", "config digest"], [[
        esc(b.name), esc(b.model), f"<code>{esc(b.data_hash)}</code>", esc(b.steps),
        esc(", ".join(map(str, b.seeds))), f"<code>{esc(b.config_digest)}</code>"]])
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"/>', f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>", f"<p>{headline} {len(runs)} candidate run(s) against baseline "
                                  f"<b>{esc(b.name)}</b></p>", ident,
        "<h2>Training loss</h2>", _loss_chart(b, runs),
        "<h2>Final eval metrics</h2>", _metrics_section(b, runs),
    ]
    if verdicts:
        parts += ["<h2>Verdict</h2>", _verdicts_section(verdicts, runs)]
    numerics = _numerics_section(runs)
    if numerics:
        parts += ["<h2>Per-layer numerics</h2>", numerics]
    parts += ["<h2>Differences from the baseline</h2>", _diff_section(b, runs),
              "<h2>Acceptance criteria</h2>",
              _table(["criterion", "value"], [[esc(k), f"<code>{esc(json.dumps(v))}</code>"]
                                              for k, v in b.criteria.to_dict().items()]),
              f'<p class="muted">Written {esc(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))}'
              " by lowprec; method: docs/accuracy.md.</p>", "</body></html>"]
    return atomic_write_text(path, "\n".join(parts) + "\n")
