"""The HTML report of inference verdicts: one self-contained page a person reads.

Sections: the headline (the combined outcome; several candidates: how many PASS, FAIL, INCONCLUSIVE); a summary
table (one row per candidate: verdict, mean KL, top-1 agreement, perplexity ratio, the bf16 ratio, greedy
agreement, each with its bounds); the distribution of the per-token KL (a cumulative chart on a log axis, every
candidate and the bf16 noise floor when the three-way mode ran); then per candidate the verdict table (PASS
green, FAIL red, INCONCLUSIVE amber) with its evidence, every statistic with its interval, the logit-tolerance
checks with their worst token, the greedy comparison per prompt, and the criteria it was judged by.  Inline SVG
only, no script; every text from a verdict is escaped.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..accuracy._report import _CSS, _headline, _table
from ..accuracy._svg import PALETTE, Line, esc, line_chart
from ..runs._atomic import atomic_write_text
from ._judge import _KL_FLOOR, InferenceVerdict

BF16_COLOR = "#888"


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float | int) and not isinstance(v, bool):
        return format(v, spec)
    return str(v)


def _est(d: Any, spec: str = ".4g") -> str:
    if not isinstance(d, dict) or "value" not in d:
        return "-"
    return f"{_fmt(d['value'], spec)} <span class=\"muted\">[{_fmt(d['lower'], spec)}, {_fmt(d['upper'], spec)}]</span>"


def _greedy_cell(v: InferenceVerdict) -> str:
    g = v.metrics.get("greedy")
    if not isinstance(g, dict):
        return "-"
    return f"{g['full_match']}/{g['prompts']} (mean {g['mean_matched']:.3g} of {g['max_new_tokens']} tokens)"


def _summary(verdicts: Sequence[InferenceVerdict]) -> str:
    rows, classes = [], []
    for v in verdicts:
        m = v.metrics
        rows.append([esc(v.candidate), v.word, _est(m.get("kl_mean")), _est(m.get("top1")), _est(m.get("ppl_ratio")),
                     _est(m.get("bf16_ratio"), ".3g"), esc(_greedy_cell(v)), esc(v.n_examples), esc(v.n_tokens)])
        classes.append(["", v.outcome, "num", "num", "num", "num", "", "num", "num"])
    head = ["candidate", "verdict", "mean KL (nats)", "top-1 agreement", "perplexity ratio", "KL / bf16 KL",
            "greedy matches", "examples", "tokens"]
    return (_table(head, rows, classes) + '<p class="muted note">Brackets: the one-sided bounds of the paired '
            "bootstrap (together a 90% interval at the default 95% confidence).</p>")


def _cdf_chart(verdicts: Sequence[InferenceVerdict]) -> str:
    lines: list[Line] = []
    bf16_done = False
    for i, v in enumerate(verdicts):
        for key, samples in v.kl_hist.items():
            if key == "bf16":
                if bf16_done:
                    continue
                bf16_done = True
                label, color, dash = "bf16 copy of the reference", BF16_COLOR, "5,3"
            else:
                label, color, dash = v.candidate, PALETTE[i % len(PALETTE)], None
            x = np.log10(np.maximum(np.asarray(samples, dtype=np.float64), _KL_FLOOR))
            if x.size == 0:
                continue
            y = np.arange(1, x.size + 1) / x.size
            lines.append(Line(label=label, x=x, y=y, color=color, dash=dash))
    if not lines:
        return ""
    return line_chart(lines=lines, title="per-token KL(reference || model), cumulative", x_label="log10 KL (nats)",
                      y_label="fraction of tokens", y_range=(0.0, 1.0), legend="below")


def _verdict(v: InferenceVerdict) -> str:
    rows = [[esc(r.name), r.word, esc(r.reason)] for r in v.results]
    classes = [["", r.outcome, ""] for r in v.results]
    parts = [f'<h3><span class="{v.outcome}">{v.word}</span> {esc(v.candidate)} '
             f'<span class="muted">against {esc(v.reference)}</span></h3>',
             _table(["criterion", "result", "evidence"], rows, classes)]
    stats = [[esc(k), _est(d, ".5g"), _fmt(d.get("se"), ".3g")] for k, d in v.metrics.items()
             if isinstance(d, dict) and "value" in d]
    stats += [[esc(k), _fmt(d, ".5g"), "-"] for k, d in v.metrics.items() if isinstance(d, float | int)]
    parts += ["<h4>Statistics</h4>", _table(["statistic", "value [bounds]", "bootstrap SE"], stats,
                                            [["", "num", "num"]] * len(stats))]
    tol = v.metrics.get("tolerances")
    if tol:
        trows = []
        for t in tol:
            w = t.get("worst") or {}
            where = (f"example {w.get('example')}, position {w.get('position')}, class {w.get('class')}: "
                     f"{_fmt(w.get('reference'))} vs {_fmt(w.get('candidate'))}") if w else "-"
            trows.append([esc("top-" + str(t["key"]) if t["key"] != "all" else "all"),
                          esc(f"{t['atol']:g} + {t['rtol']:g}|r|"), esc(t["tokens"]), esc(t["violations"]),
                          _fmt(t["worst_ratio"], ".3g"), esc(where)])
        parts += ["<h4>Logit tolerances</h4>",
                  _table(["logits checked", "allowance", "tokens", "violations", "worst / allowance", "worst at"],
                         trows)]
    if v.greedy:
        grows, gcls = [], []
        for g in v.greedy:
            div = "-" if g["divergence"] is None else str(g["divergence"])
            grows.append([esc(g["prompt"]), esc(f"{g['matched']} / {g['max_new_tokens']}"), esc(div),
                          _fmt(g["gap"]), _fmt(g["reference_margin"]), esc(g["tolerated"])])
            gcls.append(["num", "pass" if g["divergence"] is None else "fail", "num", "num", "num", "num"])
        parts += ["<h4>Greedy generation</h4>",
                  _table(["prompt", "tokens before divergence", "divergence at", "gap (candidate logits)",
                          "reference top-2 margin", "near ties tolerated"], grows, gcls)]
    crit = [[esc(k), f"<code>{esc(json.dumps(val))}</code>"] for k, val in v.criteria.items()]
    parts += [f"<h4>Criteria <code>{esc(v.criteria_hash)}</code></h4>", _table(["criterion", "value"], crit)]
    return "\n".join(parts)


def write_inference_report(path: str | os.PathLike[str], verdicts: Sequence[InferenceVerdict], *,
                           title: str = "lowprec inference accuracy report", expectation: str | None = None) -> Path:
    """Write the HTML report of ``verdicts`` atomically to ``path`` (directories created) and return the path."""
    vs = list(verdicts)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"/>', f"<title>{esc(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>",
             f"<p>{_headline(vs, 'candidates')} {len(vs)} quantized candidate(s) against their reference</p>"]
    if expectation:
        parts.append(f'<p class="expectation"><b>Expected:</b> {esc(expectation)}</p>')
    if vs:
        parts += ["<h2>Summary</h2>", _summary(vs)]
        chart = _cdf_chart(vs)
        if chart:
            parts += ["<h2>Per-token KL divergence</h2>", f'<div class="charts">{chart}</div>']
        parts += ["<h2>Verdicts</h2>", *(_verdict(v) for v in vs)]
    parts += [f'<p class="muted">Written {esc(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))}'
              " by lowprec; method: docs/inference.md.</p>", "</body></html>"]
    return atomic_write_text(path, "\n".join(parts) + "\n")
