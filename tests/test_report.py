"""The HTML report: one self-contained file whose charts are well-formed SVG, readable, and true to the judge.

Oracles: html.parser (the document parses, every tag is closed, no script/external reference), xml.etree (each
inline SVG is well-formed XML, and its geometry: the plot area, legend and label positions we emit, and data
coordinates recovered from the tick labels), the judge's own numbers (``curve_band``, ``candidate_mean_curve``) for
the lines the charts draw, the synthetic runs of test_judge (names, values and planted manifest and recipe
differences that must appear), and headless Chromium: the real layout of every text, legend and plot area after
rendering, and a screenshot that is not blank.  CI (``.ci/run``) installs Chromium and sets
``LOWPREC_REQUIRE_BROWSER=1``, so there the browser test fails instead of skipping when no browser is found.
"""

from __future__ import annotations

import dataclasses
import html.parser
import json
import os
import re
import shutil
import signal
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_judge import STEPS, make_run

from lowprec import recipes
from lowprec.accuracy._baseline import Baseline, RunData, build_baseline
from lowprec.accuracy._judge import CriterionResult, Verdict, candidate_mean_curve, curve_band, judge
from lowprec.accuracy._report import (
    MEAN_COLOR,
    display_range,
    flatten,
    group_diff,
    manifest_diff,
    recipe_diff,
    write_report,
)
from lowprec.accuracy._stats import smooth
from lowprec.accuracy._svg import PALETTE, fit_text, text_width

HOSTILE = '<script>alert("x")</script> & co'
SVG_NS = "{http://www.w3.org/2000/svg}"
LONG = "fp8-tensorwise with delayed amax history and a rather long descriptive run name"


class _Collector(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.cells: list[tuple[str, str]] = []  # (class, text) of each td

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self.stack and self.stack[-1] == "td":
            cls = next((a.get("class", "") for t, a in reversed(self.tags) if t == "td"), "")
            self.cells.append((cls or "", data))


def _parse(text: str) -> _Collector:
    p = _Collector()
    p.feed(text)
    p.close()
    return p


def _rows(fragment: str) -> list[list[str]]:
    """The text of each table cell of each data row (``<td>``) in an HTML fragment."""
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", fragment, flags=re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, flags=re.S)
        if cells:
            rows.append([html.unescape(re.sub(r"<[^>]+>", "", c)) for c in cells])
    return rows


def _svgs(text: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", text, flags=re.S)]


def _title(svg: ET.Element) -> str:
    return svg.findtext(f"{SVG_NS}title") or ""


def _chart(svgs: list[ET.Element], start: str) -> ET.Element:
    found = [s for s in svgs if _title(s).startswith(start)]
    assert len(found) == 1, (start, [_title(s) for s in svgs])
    return found[0]


def _plot_area(svg: ET.Element) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of the plot area."""
    r = next(r for r in svg.iter(f"{SVG_NS}rect") if r.get("class") == "plot-area")
    x, y, w, h = (float(r.get(k, "0")) for k in ("x", "y", "width", "height"))
    return x, y, x + w, y + h


def _polylines(svg: ET.Element, label: str) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """(x pixels, y pixels, stroke) of each polyline segment whose tooltip is ``label``."""
    out = []
    for p in svg.iter(f"{SVG_NS}polyline"):
        if p.findtext(f"{SVG_NS}title") == label:
            pts = np.array([[float(v) for v in xy.split(",")] for xy in p.get("points", "").split()])
            out.append((pts[:, 0], pts[:, 1], p.get("stroke", "")))
    return out


def _axes(svg: ET.Element, *, log: bool = False) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                          Callable[[np.ndarray], np.ndarray]]:
    """(x pixel -> data, y pixel -> data) of a line chart, fitted to its tick labels (ticks are placed at 0.1 px,
    so the maps are good to about 0.05 px)."""
    left, _, _, bottom = _plot_area(svg)
    xs, ys = [], []
    for t in svg.iter(f"{SVG_NS}text"):
        try:
            v = float(t.text or "")
        except ValueError:
            continue
        x, y = float(t.get("x", "nan")), float(t.get("y", "nan"))
        if t.get("text-anchor") == "end" and abs(x - (left - 4)) < 0.06:
            ys.append((y - 4, np.log10(v) if log else v))
        elif t.get("text-anchor") == "middle" and abs(y - (bottom + 16)) < 0.06:
            xs.append((x, v))
    assert len(xs) >= 2 and len(ys) >= 2, (xs, ys)
    ax, ay = np.array(xs), np.array(ys)
    fx = np.polyfit(ax[:, 0], ax[:, 1], 1)
    fy = np.polyfit(ay[:, 0], ay[:, 1], 1)
    return (lambda px: np.polyval(fx, px)), (lambda py: 10 ** np.polyval(fy, py) if log else np.polyval(fy, py))


def _y_span(svg: ET.Element, *, log: bool = False) -> tuple[float, float]:
    """The data range of the plot area's height."""
    _, top, _, bottom = _plot_area(svg)
    _, fy = _axes(svg, log=log)
    lo, hi = fy(np.array([bottom, top]))
    return float(lo), float(hi)


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, list, object]:
    rng = np.random.default_rng(21)
    base = build_baseline("ref", [make_run(rng, s) for s in range(3)])
    cands = [make_run(rng, 100 + s, recipe="fp8", shift=0.08) for s in range(3)]
    cands[0] = dataclasses.replace(cands[0], name=HOSTILE,
                                   manifest={**cands[0].manifest, "versions": {"torch": "2.14.0"},
                                             "hardware": {"gpu": "H100 <80GB>"}})
    verdict = judge(base, cands)
    path = write_report(tmp_path_factory.mktemp("rep") / "out" / "report.html", baseline=base, runs=cands,
                        verdict=verdict)
    return path, cands, verdict


def _dynamics(run: RunData, rng: np.random.Generator, *, explode_from: int | None = None) -> RunData:
    """``run`` plus eval metrics every 50 steps (ending at its own final values), a gradient norm and a cosine
    learning rate per step, as the runner logs them; ``explode_from``: the loss and the gradient norm grow
    tenfold every 10 steps from that step (a run that blows up but stays finite)."""
    st, loss = run.scalars["train/loss"]
    ev = np.arange(50, STEPS + 1, 50, dtype=np.int64)
    acc_final, eval_final = run.scalars["eval/accuracy"][1][-1], run.scalars["eval/loss"][1][-1]
    frac = ev / STEPS
    acc = acc_final - 0.4 * (1 - frac) ** 2
    evl = eval_final + 2.0 * (1 - frac) ** 2
    gn = 1.0 + 2.0 * np.exp(-st / 80.0) + np.abs(rng.normal(0, 0.1, st.size))
    lr = 3e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * st / STEPS)))
    if explode_from is not None:
        grow = np.where(st >= explode_from, 10.0 ** ((st - explode_from) / 10.0), 1.0)
        loss, gn = loss * grow, gn * grow
    return dataclasses.replace(run, scalars={
        **run.scalars, "train/loss": (st, loss), "train/grad_norm": (st, gn), "train/lr": (st, lr),
        "eval/accuracy": (ev, acc), "eval/loss": (ev, evl)})


def _named(run: RunData, *, name: str, group: str, recipe: str, lr: float = 3e-3) -> RunData:
    """``run`` renamed into ``group``, its config carrying the real built-in ``recipe`` (plain data) and an
    optimizer, its manifest a host (two hosts alternate with the seed)."""
    seed = run.manifest["seed"]
    return dataclasses.replace(
        run, name=f"{name} seed {seed}", group=group,
        config={**run.config, "name": name, "recipe": recipes.get(recipe).to_dict(), "optimizer": {"lr": lr}},
        manifest={**run.manifest, "recipe_hash": recipes.get(recipe).hash(), "host": {"hostname": f"node{seed % 2}"}})


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict:
    """Four judged groups against a 3-seed fp32 baseline: fp8-tensorwise (3 seeds, long names), a learning-rate
    cut that is 8% worse (3 seeds), an mxfp8 arm of one seed, and one run that explodes from step 300."""
    rng = np.random.default_rng(31)
    base_runs = [_named(_dynamics(make_run(rng, s), rng), name="baseline", group="baseline/ref", recipe="fp32")
                 for s in range(3)]
    base = build_baseline("ref", base_runs)
    arms = {
        "fp8": [_named(_dynamics(make_run(rng, 100 + s), rng), name=LONG, group="exp-7/fp8",
                       recipe="fp8-tensorwise") for s in range(3)],
        "lr-cut": [_named(_dynamics(make_run(rng, 200 + s, shift=0.08), rng), name="fp32 lr x0.7",
                          group="exp-7/lr-cut", recipe="fp32", lr=2.1e-3) for s in range(3)],
        "one": [_named(_dynamics(make_run(rng, 300), rng), name="mxfp8 one seed", group="exp-7/mxfp8-one",
                       recipe="mxfp8")],
        "boom": [_named(_dynamics(make_run(rng, 400), rng, explode_from=300), name="exploding",
                        group="exp-7/boom", recipe="fp32")],
    }
    verdicts = [judge(base, rs) for rs in arms.values()]
    runs = [r for rs in arms.values() for r in rs]
    path = write_report(tmp_path_factory.mktemp("groups") / "report.html", baseline=base, runs=runs,
                        verdict=verdicts, baseline_runs=base_runs, expectation="lr-cut and boom FAIL <as planned>")
    text = path.read_text(encoding="utf-8")
    return {"path": path, "text": text, "svgs": _svgs(text), "base": base, "base_runs": base_runs, "arms": arms,
            "verdicts": verdicts}


# ------------------------------------------------------------------------------------------ structure
def test_report_is_self_contained_and_parses(report, groups) -> None:
    for path in (report[0], groups["path"]):
        text = path.read_text(encoding="utf-8")
        p = _parse(text)
        assert p.stack == [], f"unclosed tags {p.stack}"
        tags = {t for t, _ in p.tags}
        assert "script" not in tags and "link" not in tags and "img" not in tags
        for _, attrs in p.tags:  # no external reference of any kind
            for k, v in attrs.items():
                assert not (k in ("src", "href") and v and not v.startswith("#")), (k, v)
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)
        assert [f.name for f in path.parent.iterdir()] == [path.name]  # atomic write left no temporary file


def test_svg_charts_are_well_formed_xml(report) -> None:
    svgs = _svgs(report[0].read_text(encoding="utf-8"))
    # loss curves, the group's mean minus the baseline mean, one strip chart per metric (loss, accuracy); the
    # synthetic runs log eval metrics at the last step only, so there is no eval-over-time chart
    assert [_title(s).split(" ")[0] for s in svgs] == ["smoothed", "fp8:", "final", "final"], [_title(s) for s in svgs]
    loss = svgs[0]
    assert loss.find(f".//{SVG_NS}polygon") is not None  # the baseline min/max band
    tips = [p.findtext(f"{SVG_NS}title") for p in loss.iter(f"{SVG_NS}polyline")]
    assert {HOSTILE, "fp8 seed 101", "fp8 seed 102", "baseline mean (3 seeds)", "candidate mean (3)",
            "judge's pass line (mean of 3)", "judge's fail line (mean of 3)"} <= set(tips)
    legend = [t.text for t in loss.iter(f"{SVG_NS}text")]
    assert HOSTILE in legend  # escaped in the file, restored by the XML parser
    dots = svgs[2].findall(f".//{SVG_NS}circle")
    assert len(dots) == 3 + 3  # baseline seeds + candidates


def test_hostile_names_are_escaped(report) -> None:
    text = report[0].read_text(encoding="utf-8")
    assert "<script>" not in text and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co" in text
    assert "H100 &lt;80GB&gt;" in text
    # a hostile group, recipe name, recipe field and host: in every section (headline table, chart titles and
    # legends, strip labels, differences) they stay text
    rng = np.random.default_rng(27)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    runs = [dataclasses.replace(make_run(rng, 100 + s), group=f"x/{HOSTILE}", name=f"{HOSTILE} seed {100 + s}",
                                config={**make_run(rng, 1).config, "recipe": {"name": HOSTILE, "weights": HOSTILE}},
                                manifest={**make_run(rng, 1).manifest, "seed": 100 + s, "host": HOSTILE})
            for s in range(2)]
    other = dataclasses.replace(make_run(rng, 200), group="x/other")
    path = write_report(Path(report[0]).parent / "hostile.html", baseline=base, runs=[*runs, other],
                        verdict=[judge(base, runs), judge(base, [other])], expectation=HOSTILE)
    text = path.read_text(encoding="utf-8")
    assert "<script" not in text and text.count("&lt;script&gt;") >= 10
    for svg in _svgs(text):  # still well-formed XML
        assert svg.tag == f"{SVG_NS}svg"


def test_every_run_metric_and_verdict_reason_appears(report) -> None:
    path, cands, verdict = report
    p = _parse(path.read_text(encoding="utf-8"))
    body = "".join(p.text)
    for name in ["fp32 seed 0", "fp32 seed 1", "fp32 seed 2", *(c.name for c in cands)]:
        assert name in body, name
    for c in cands:
        assert f"{c.scalars['eval/accuracy'][1][0]:.6g}" in body
    results = {r.name: r for r in verdict.results}
    assert not results["curve"].passed  # the 8% shifted loss (power ~100%: see test_judge)
    for r in verdict.results:
        assert r.reason in body
    marks = [(cls, t) for cls, t in p.cells if t in ("PASS", "FAIL", "INCONCLUSIVE")]
    assert marks == [(r.outcome, r.word) for r in verdict.results]


def test_manifest_differences_are_flattened_and_only_the_differing_keys(report) -> None:
    path, cands, _ = report
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}}) == {"a.b.c": 1, "a.d": [1, 2], "e": {}}
    rng = np.random.default_rng(22)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    keys = {k: (b, c, varies) for k, b, c, varies in manifest_diff(base, cands[0])}
    assert keys["manifest.versions.torch"][:2] == ("2.13.0", "2.14.0")
    assert keys["manifest.hardware.gpu"][:2] == ("(missing)", "H100 <80GB>")
    assert keys["config.recipe.name"][:2] == ("fp32", "fp8")
    assert keys["manifest.seed"][2] is True  # varies between the baseline seeds themselves
    assert "manifest.data_hash" not in keys and "config.batch_size" not in keys
    assert "manifest.versions.torch" not in {k for k, *_ in manifest_diff(base, cands[1])}
    assert "manifest.versions.torch" in path.read_text(encoding="utf-8")


def test_report_without_verdict_and_with_a_diverged_run(tmp_path) -> None:
    # A NaN in a candidate breaks its line (no "nan" coordinate in any SVG) and the report still renders.
    rng = np.random.default_rng(23)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    c = make_run(rng, 7)
    st, v = c.scalars["train/loss"]
    c = dataclasses.replace(c, scalars={**c.scalars, "train/loss": (st, np.where(st > 300, np.nan, v))})
    text = write_report(tmp_path / "r.html", baseline=base, runs=[c], verdict=None).read_text(encoding="utf-8")
    assert "not judged" in text and "<h2>Verdict</h2>" not in text
    for s in re.findall(r"<svg\b.*?</svg>", text, flags=re.S):
        ET.fromstring(s)
        assert "nan" not in s.lower().replace("nan</text>", "")
    assert "non-finite (nan) from step 301: the line stops there" in text


# ---------------------------------------------------------------------------------------- the headline
def test_headline_counts_every_outcome_and_states_the_expectation(tmp_path) -> None:
    # Oracle: six planted verdicts (1 FAIL, 4 PASS, 1 INCONCLUSIVE); the headline counts them FAIL first, in the
    # combined outcome's colour (FAIL), and the caller's expectation follows, escaped.
    rng = np.random.default_rng(24)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    runs, verdicts = [], []
    for i, outcome in enumerate(["pass", "pass", "fail", "pass", "inconclusive", "pass"]):
        r = dataclasses.replace(make_run(rng, 100 + i), group=f"exp/arm{i}", name=f"arm{i} seed {100 + i}")
        res = CriterionResult(name="final/accuracy", outcome=outcome, reason=f"planted {outcome}", values={})
        runs.append(r)
        verdicts.append(Verdict(outcome=outcome, baseline="ref", candidates=(r.run_id,), results=(res,),
                                plan={"advice": "about 5 seeds would decide it"} if outcome == "inconclusive"
                                else None))
    text = write_report(tmp_path / "r.html", baseline=base, runs=runs, verdict=verdicts,
                        expectation="arm2 FAILs & arm4 is <INCONCLUSIVE>: as expected").read_text(encoding="utf-8")
    assert '<span class="headline fail">1 FAIL, 4 PASS, 1 INCONCLUSIVE of 6 groups</span>' in text
    assert ('<p class="expectation"><b>Expected:</b> arm2 FAILs &amp; arm4 is &lt;INCONCLUSIVE&gt;: as expected'
            "</p>") in text
    summary = text.split('<p class="expectation">')[1].split("</table>")[0]  # the group table under it
    marks = re.findall(r'<td class="(\w+)">(PASS|FAIL|INCONCLUSIVE)</td>', summary)
    assert marks == [(v.outcome, v.word) for v in verdicts]
    assert [r[0] for r in _rows(summary)] == [f"arm{i}" for i in range(6)]  # the common prefix "exp/" is cut
    assert "about 5 seeds would decide it" in text
    one = write_report(tmp_path / "one.html", baseline=base, runs=runs[:1], verdict=verdicts[0]).read_text(
        encoding="utf-8")
    assert 'class="headline pass">PASS</span>' in one and "expectation" not in one.split("<style>")[1].split(
        "</style>")[1]


# --------------------------------------------------------------------------------------------- charts
def test_loss_chart_is_not_flattened_by_exploding_or_non_finite_runs(tmp_path) -> None:
    # Oracle: the baseline envelope after the warm-up must fill at least a third of the plot height, however
    # far two exploding runs (loss x10 every 10 steps, to 1e25) and a run with NaN and inf go; each run that
    # leaves the chart is named under it, with how far it went and where it became non-finite.
    rng = np.random.default_rng(25)
    base = build_baseline("ref", [make_run(rng, s) for s in range(3)])
    boom = [_dynamics(make_run(rng, 100 + s), rng, explode_from=150) for s in range(2)]
    bad = make_run(rng, 102)
    st, v = bad.scalars["train/loss"]
    bad = dataclasses.replace(bad, scalars={**bad.scalars, "train/loss": (st, np.where(
        st == 200, np.nan, np.where(st >= 300, np.inf, v)))})
    for runs in ([*boom, bad], [boom[0]], [bad]):
        text = write_report(tmp_path / "r.html", baseline=base, runs=runs, verdict=None).read_text(encoding="utf-8")
        loss = _svgs(text)[0]
        lo, hi = _y_span(loss)
        warm = base.env_steps > base.criteria.warmup_fraction * base.steps
        env_lo, env_hi = float(base.env_min[warm].min()), float(base.env_max[warm].max())
        assert lo <= env_lo and env_hi <= hi
        assert (env_hi - env_lo) / (hi - lo) >= 0.3, ((lo, hi), (env_lo, env_hi))
        assert lo >= 0.0  # a loss: the axis does not go below zero
        if len(runs) == 3:
            notes = text.split("Off the chart:")[1].split("</p>")[0]
            assert "seed 100: above the chart from step 1" in notes and "seed 101: above the chart" in notes
            assert "seed 102: non-finite (nan) from step 200: the line stops there" in notes
            assert re.search(r"seed 100: above the chart from step 1\d\d \(up to \d(\.\d+)?e\+2\d at step 400\)", notes)
    # the clip itself: all of ``ref``, widened by others by at most one span, never below the floor
    assert display_range([np.array([1.0, 2.0])], [np.array([1.5, 1e9, np.inf, np.nan])], floor=0.0) == \
        pytest.approx((1.0 - 0.05 * 2.0, 3.0 + 0.05 * 2.0))
    assert display_range([np.array([1.0, 2.0])], [np.array([-50.0])], floor=0.0)[0] == 0.0
    lo, hi = display_range([np.array([0.1, 1.0])], [np.array([1e12])], log=True)
    assert hi == pytest.approx(10 ** (1 + 0.05 * 2))  # one decade above the reference, plus padding


def test_a_loss_chart_and_band_never_go_below_zero(tmp_path) -> None:
    # Oracle: a non-negative loss near zero with seed noise larger than the loss, so the judge's pass line
    # (mean + margin - t se) is negative at most steps; drawn, it stops at zero, and the axis starts at zero.
    rng = np.random.default_rng(26)

    def tiny(seed: int, level: float) -> RunData:  # seeds differ by as much as the loss itself
        r = make_run(rng, seed)
        st, v = r.scalars["train/loss"]
        return dataclasses.replace(r, scalars={**r.scalars, "train/loss": (st, level * (1 + np.exp(-st / 60)))})

    base = build_baseline("ref", [tiny(0, 0.3), tiny(1, 1.7)])
    cands = [tiny(100, 0.5), tiny(101, 1.2)]
    lo_line, _ = curve_band(base, 2)
    assert (lo_line < 0).mean() > 0.5  # the premise: the judge's pass line is mostly below zero
    svgs = _svgs(write_report(tmp_path / "r.html", baseline=base, runs=cands, verdict=judge(base, cands))
                 .read_text(encoding="utf-8"))
    loss = svgs[0]
    lo, _ = _y_span(loss)
    assert -1e-9 <= lo
    _, fy = _axes(loss)
    (px, py, _), *rest = _polylines(loss, "judge's pass line (mean of 2)")
    ys = np.concatenate([fy(py), *(fy(s[1]) for s in rest)])
    assert ys.min() >= -1e-3 * (_y_span(loss)[1] - lo)


def test_each_group_is_drawn_against_its_own_judge_lines(groups) -> None:
    # Oracle: the judge's curve_band and candidate_mean_curve for each group's own number of seeds (3 or 1):
    # the pass line, the fail line and the candidate mean of a group's chart, read back through its axes, are
    # 100 (line - baseline mean) / |baseline mean| at every drawn step (to the pixel rounding).
    b: Baseline = groups["base"]
    svgs = groups["svgs"]
    for runs in groups["arms"].values():
        label = (runs[0].group or "").split("/")[-1]
        chart = _chart(svgs, f"{label}: ")
        assert "candidate mean minus the baseline mean" in _title(chart)
        verdict = next(v for v in groups["verdicts"] if v.candidates == tuple(r.run_id for r in runs))
        curve = next(r for r in verdict.results if r.name == "curve")
        assert _title(chart).endswith(f"(curve {curve.word})")
        m = len(runs)
        fx, fy = _axes(chart)
        _, top, _, bottom = _plot_area(chart)
        tol = 0.06 * abs(float(fy(np.array([top]))[0] - fy(np.array([bottom]))[0])) / (bottom - top)
        lo, hi = curve_band(b, m)
        lo, hi = np.maximum(lo, 0), np.maximum(hi, 0)
        st, mean = candidate_mean_curve(b, runs)
        want = {f"pass line (mean of {m})": (b.env_steps, lo), f"fail line (mean of {m})": (b.env_steps, hi),
                ("candidate mean (3)" if m > 1 else "candidate"): (st, mean)}
        for name, (steps, y) in want.items():
            segs = _polylines(chart, name)
            assert segs, (label, name)
            idx = np.searchsorted(b.env_steps, steps)
            rel = 100 * (y - b.env_mean[idx]) / np.abs(b.env_mean[idx])
            for px, py, _ in segs:
                x = np.rint(fx(px)).astype(np.int64)
                k = np.searchsorted(steps, x)
                assert np.array_equal(steps[k], x)
                inside = (py > top + 0.2) & (py < bottom - 0.2)  # points clipped to the frame are not data
                np.testing.assert_allclose(fy(py)[inside], rel[k][inside], atol=3 * tol, rtol=0)
    # the overview of several groups draws no judge band (each group has its own, above)
    overview = _chart(svgs, "smoothed train/loss")
    tips = [p.findtext(f"{SVG_NS}title") or "" for p in overview.iter(f"{SVG_NS}polyline")]
    assert tips and not any(t.startswith(("judge's", "pass line", "fail line")) for t in tips)


def test_legends_sit_outside_the_plot_area_and_means_have_their_own_colour(report, groups) -> None:
    # Oracle: the geometry we emit.  Every legend entry (swatch and text, at its measured width) lies right of
    # or below the plot area and inside the svg; a candidate mean is drawn in a colour no seed of its chart has.
    svgs = [*_svgs(report[0].read_text(encoding="utf-8")), *groups["svgs"]]
    checked = 0
    for svg in svgs:
        leg = svg.find(f"{SVG_NS}g[@class='legend']")
        if leg is None:
            continue
        left, top, right, bottom = _plot_area(svg)
        width, height = float(svg.get("width", "0")), float(svg.get("height", "0"))
        for el in leg:
            if el.tag == f"{SVG_NS}text":
                x0, x1 = float(el.get("x", "0")), float(el.get("x", "0")) + text_width(el.text or "")
            elif el.tag == f"{SVG_NS}line":
                x0, x1 = float(el.get("x1", "0")), float(el.get("x2", "0"))
            else:
                x0, x1 = float(el.get("x", "0")), float(el.get("x", "0")) + float(el.get("width", "0"))
            y = float(el.get("y", el.get("y1", "0")))
            assert x0 >= right or y >= bottom, (_title(svg), el.attrib)
            assert x1 <= width and y <= height, (_title(svg), el.attrib, width)
        checked += 1
        means = [s for lbl in ("candidate mean (3)", "candidate mean (2)") for s in _polylines(svg, lbl)]
        seeds = {p.get("stroke") for p in svg.iter(f"{SVG_NS}polyline")
                 if re.search(r"seed \d+$", p.findtext(f"{SVG_NS}title") or "")}
        for *_, stroke in means:
            assert stroke == MEAN_COLOR and stroke not in seeds and stroke not in PALETTE
    assert checked >= 6


def test_strip_chart_labels_fit_or_are_shortened_with_a_tooltip(groups) -> None:
    # Oracle: text_width's measure; every label ends left of the plot area and starts inside the svg; a long
    # group name is shortened with an ellipsis and its <title> keeps it whole.
    assert fit_text("abc", 100) == "abc" and text_width("abc") > 0
    short = fit_text(LONG * 2, 120)
    assert short.endswith("\u2026") and text_width(short) <= 120 and text_width(short + "x") > 0
    strips = [s for s in groups["svgs"] if _title(s).startswith("final eval/")]
    assert len(strips) == 2
    for svg in strips:
        left, *_ = _plot_area(svg)
        labels = [t for t in svg.iter(f"{SVG_NS}text") if t.get("text-anchor") == "end"]
        assert {t.findtext(f"{SVG_NS}title") or t.text for t in labels} >= {"baseline (3)", "fp8", "lr-cut",
                                                                          "mxfp8-one", "boom"}
        for t in labels:
            x = float(t.get("x", "0"))
            assert x <= left - 4 and x - text_width(t.text or "") >= 0, (t.text, x)
    long_svg = _svgs(write_report_for_labels(groups))
    lab = [t for t in _chart(long_svg, "final eval/accuracy").iter(f"{SVG_NS}text")
           if t.findtext(f"{SVG_NS}title") == LONG * 3]
    assert len(lab) == 1 and lab[0].text and lab[0].text.endswith("\u2026")


def write_report_for_labels(groups: dict) -> str:
    """The groups report with one group renamed to a 240-character name (longer than any margin)."""
    runs = [dataclasses.replace(r, group=LONG * 3) for r in groups["arms"]["fp8"]]
    path = groups["path"].parent / "long.html"
    return write_report(path, baseline=groups["base"], runs=runs, verdict=judge(groups["base"], runs)).read_text(
        encoding="utf-8")


def test_eval_metrics_grad_norm_and_lr_are_plotted_over_time(groups) -> None:
    # Oracle: the planted scalars.  One small chart per eval metric, the gradient norm and the learning rate,
    # each with one line per run (baseline seeds and candidates, named by their tooltips); the learning rate
    # read back through the chart's axes is the planted schedule; the exploding gradient norm is clipped and
    # named under its chart instead of flattening the others.
    svgs = groups["svgs"]
    runs = [*groups["base_runs"], *(r for rs in groups["arms"].values() for r in rs)]
    for title in ("eval/loss", "eval/accuracy", "train/grad_norm (smoothed", "train/lr"):
        chart = _chart(svgs, title)
        for r in runs:
            assert _polylines(chart, r.name), (title, r.name)
    lr = _chart(svgs, "train/lr")
    fx, fy = _axes(lr)
    r = groups["arms"]["lr-cut"][0]
    (px, py, _), = _polylines(lr, r.name)
    st, want = r.scalars["train/lr"]
    x = np.rint(fx(px)).astype(np.int64)
    np.testing.assert_allclose(fy(py), want[np.searchsorted(st, x)], atol=2e-6)
    gn = _chart(svgs, "train/grad_norm")
    log = _title(gn).endswith("log scale")
    assert log  # the exploding run spans ten decades
    lo, hi = _y_span(gn, log=log)
    assert hi < 20, (lo, hi)  # the baseline's stays below 3 (one span above it on a log axis: x3); the run: 1e10
    text = groups["text"]
    note = text.split(_title(gn))[-1].split('<p class="muted note">')[1].split("</p>")[0]
    assert "exploding seed 400" in note
    smoothed = smooth(groups["base_runs"][0].scalars["train/grad_norm"][1], groups["base"].criteria.smoothing_window)
    (px, py, _), = _polylines(gn, groups["base_runs"][0].name)
    gfx, gfy = _axes(gn, log=log)
    np.testing.assert_allclose(gfy(py), smoothed[np.rint(gfx(px)).astype(int) - 1], rtol=0.005)


# ------------------------------------------------------------------------------------------ differences
def test_recipe_differences_are_shown_once_per_group_in_recipe_terms(groups) -> None:
    # Oracle: the built-in recipes' definitions (fp8-tensorwise: e4m3 forward operands, e5m2 gradients, one
    # scale per tensor, the head kept in high precision) and the planted config/manifest differences.
    text = groups["text"]
    diff = text.split("<h2>Differences from the baseline</h2>")[1].split("<h2>")[0]
    assert diff.count("<b>recipe</b>: fp32 \u2192 fp8-tensorwise") == 1
    assert diff.count("<b>recipe</b>: fp32 \u2192 mxfp8") == 1
    assert diff.count("<b>recipe</b>: the baseline's (fp32)") == 2  # lr-cut and boom
    assert "config.recipe" not in diff  # no dotted recipe keys: recipe terms only
    rows = _rows(diff.split("fp8: ")[1].split("<h3>")[0])
    assert ["linear: forward.a (input), forward.b (weight), grad_input.b (weight), grad_weight.b (input)",
            "float32 (not quantized)", "float8_e4m3fn, one scale per tensor"] in rows
    assert ["linear: grad_input.a (grad_output), grad_weight.a (grad_output)", "float32 (not quantized)",
            "float8_e5m2, one scale per tensor"] in rows
    assert ["keep_high_precision", "[]", '["*lm_head*", "*embed*", "*head"]'] in rows
    assert len(rows) <= 3 + 3  # three recipe rows, the recipe hash, seed and host: nothing per seed
    assert ["manifest.seed", "varies: 0 | 1 | 2", "100 | 101 | 102"] in rows
    assert ["manifest.host.hostname", "varies: node0 | node1", "seed 100: node0; seed 101: node1; seed 102: node0"
            ] not in rows  # node0 and node1 are both baseline values: nothing differs
    lr = diff.split("lr-cut: ")[1].split("<h3>")[0]
    assert "<code>config.optimizer.lr</code></td><td>0.003</td><td>0.0021</td>" in lr
    assert lr.count("config.optimizer.lr") == 1
    # group_diff lists a key that differs between the group's seeds once, with each seed's value
    b = groups["base"]
    runs = [dataclasses.replace(r, manifest={**r.manifest, "host": {"hostname": f"gpu{i}"}})
            for i, r in enumerate(groups["arms"]["fp8"])]
    got = {k: (bv, cv, varies) for k, bv, cv, varies in group_diff(b, runs)}
    assert got["manifest.host.hostname"] == ("varies: node0 | node1", "seed 100: gpu0; seed 101: gpu1; seed 102: gpu2",
                                             True)
    assert got["manifest.recipe_hash"][1] == recipes.get("fp8-tensorwise").hash()


def test_recipe_diff_names_every_difference_between_built_in_recipes() -> None:
    # Oracle: the recipes' own data.  A recipe never differs from itself; any two built-ins whose data differ
    # (besides the name) differ in at least one recipe term; and the words say what the definitions say.
    names = recipes.names()
    for a in names:
        da = recipes.get(a).to_dict()
        assert recipe_diff(da, da) == []
        for c in names:
            dc = recipes.get(c).to_dict()
            if {**da, "name": ""} != {**dc, "name": ""}:
                assert recipe_diff(da, dc), (a, c)
    fp32 = recipes.get("fp32").to_dict()

    def row(other: str, what: str) -> tuple[str, str]:
        rows = {k: (b, c) for k, b, c in recipe_diff(fp32, recipes.get(other).to_dict())}
        return rows[what]

    assert row("mxfp8", "linear: every GEMM operand")[1].startswith(
        "float8_e4m3fn, blocks of 32, float8_e8m0fnu scales (floor-rounded)")
    fwd = "linear: forward.a (input), forward.b (weight), grad_input.b (weight), grad_weight.b (input)"
    grads = "linear: grad_input.a (grad_output), grad_weight.a (grad_output)"
    assert row("fp8-delayed", fwd) == ("float32 (not quantized)", "float8_e4m3fn, one scale per tensor, delayed "
                                                                  "scaling (amax history 16, max)")
    assert row("h100-fp8", "linear: every GEMM accumulator")[1].startswith("e8m13 accumulator (toward_zero), "
                                                                           "promoted to float32 every 128")
    assert row("fp16-dynamic-loss-scale", "loss_scaling.kind") == ("none", "dynamic")
    assert row("bf16-sr", "weights.update") == ("master", "stochastic")
    assert row("nvfp4", fwd)[1] == "float4_e2m1fn, blocks of 16, float8_e4m3fn scales, plus a per-tensor float32 scale"
    assert row("nvfp4", grads)[1].endswith(", stochastic rounding")
    blocks = row("fp8-blockwise", "linear: forward.b (weight), grad_input.b (weight)")
    assert blocks == ("float32 (not quantized)", "float8_e4m3fn, tiles of 128x128")


# ---------------------------------------------------------------------------------------------- browser
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

_MEASURE = """<script>
(function () {
  var out = [];
  document.querySelectorAll("svg").forEach(function (svg) {
    // every box in the svg's own units (its viewBox), after transforms (the rotated y label) and CSS scaling
    var vb = svg.viewBox.baseVal, s = svg.getBoundingClientRect(), k = vb.width / s.width;
    function box(el) { var r = el.getBoundingClientRect();
                       return [(r.x - s.x) * k, (r.y - s.y) * k, r.width * k, r.height * k]; }
    var area = svg.querySelector("rect.plot-area"), leg = svg.querySelector("g.legend");
    var texts = [];
    svg.querySelectorAll("text").forEach(function (t) {
      var tip = t.querySelector("title");
      texts.push({text: t.textContent.replace(tip ? tip.textContent : "", ""), box: box(t),
                  legend: !!t.closest("g.legend")});
    });
    out.push({title: svg.querySelector("title").textContent, svg: svg instanceof SVGSVGElement,
              view: [vb.width, vb.height], area: area ? box(area) : null,
              legend: leg ? box(leg) : null, texts: texts});
  });
  var pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify({svgs: out, scripts: document.scripts.length});
  document.body.appendChild(pre);
})();
</script>"""


def _browser() -> str | None:
    found = os.environ.get("LOWPREC_CHROMIUM") or next((b for b in _BROWSERS if shutil.which(b)), None)
    if found is None and os.environ.get("LOWPREC_REQUIRE_BROWSER") == "1":
        pytest.fail("LOWPREC_REQUIRE_BROWSER=1 but no Chromium found (apt-get install chromium)")
    return found


def _run_browser(args: list[str], tmp_path: Path) -> str:
    """Run headless Chromium (no network: file:// only) and return its stdout; the process group is killed if it
    outlives the timeout, so nothing stays behind."""
    browser = _browser()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-component-update", "--no-default-browser-check",
           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, cmd
    return out


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[0] + b[2] - 0.5 and b[0] < a[0] + a[2] - 0.5 and a[1] < b[1] + b[3] - 0.5 and \
        b[1] < a[1] + a[3] - 0.5


def test_renders_in_headless_chromium(groups, report, tmp_path) -> None:
    # Oracle: a real browser's layout.  The report plus a measuring script (added to a copy here: the report has
    # none) is loaded with --dump-dom; every inline SVG is an SVG element (parsed, not shown as text); every text
    # of every chart, at the size the browser gives it, lies inside its svg (nothing clipped: strip labels,
    # legend, titles); no legend overlaps its plot area; and a screenshot of the untouched report is not blank
    # and shows the three outcome colours.
    for path, hostile in ((groups["path"], False), (report[0], True)):
        text = path.read_text(encoding="utf-8")
        assert "<script" not in text
        probe = tmp_path / f"probe-{path.name}"
        probe.write_text(text.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
        dom = _run_browser(["--dump-dom", probe.as_uri()], tmp_path)
        got = re.search(r'<pre id="measured">(.*?)</pre>', dom, flags=re.S)
        assert got, dom[-2000:]
        m = json.loads(html.unescape(got.group(1)))
        assert m["scripts"] == 1  # ours; the report's hostile names stayed text
        assert len(m["svgs"]) == text.count("<svg") and all(s["svg"] for s in m["svgs"])
        assert "<script>alert" not in dom and ("&lt;script&gt;" in dom) == hostile
        for s in m["svgs"]:
            w, h = s["view"]
            for t in s["texts"]:
                x, y, tw, th = t["box"]
                if not t["text"].strip():
                    continue
                assert x >= -0.5 and y >= -0.5 and x + tw <= w + 0.5 and y + th <= h + 0.5, (s["title"], t, w, h)
                if s["area"] and t["legend"]:
                    assert not _overlap(t["box"], s["area"]), (s["title"], t, s["area"])
            if s["area"] and s["legend"]:
                assert not _overlap(s["legend"], s["area"]), (s["title"], s["legend"], s["area"])
            if s["title"].startswith("final eval/"):  # row labels end left of the plot area
                labels = [t for t in s["texts"] if t["box"][1] > s["area"][1] and t["box"][0] < s["area"][0]]
                assert labels and all(t["box"][0] + t["box"][2] <= s["area"][0] + 0.5 for t in labels), s["title"]
    from PIL import Image

    shot = tmp_path / "shot.png"
    _run_browser(["--window-size=1200,2400", f"--screenshot={shot}", groups["path"].as_uri()], tmp_path)
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape[:2] == (2400, 1200)
    assert (np.abs(img - 255).sum(axis=2) > 30).mean() > 0.05  # not blank: ink on more than 5% of the page

    def has(color: str) -> bool:
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        return bool((np.abs(img - rgb).sum(axis=2) <= 6).sum() > 200)

    colors = {"fail": "#fbd5d5", "pass": "#d8f5d8", "inconclusive": "#fdf0c4"}  # the outcome backgrounds
    outcomes = {v.outcome for v in groups["verdicts"]}
    assert len(outcomes) >= 2 and all(has(colors[o]) for o in outcomes), outcomes


# ---------------------------------------------------------------------------------------- numerics
def _with_stats(run, planted: dict[tuple[str, str, int], tuple[float, float]]):  # type: ignore[no-untyped-def]
    """``run`` plus per-layer statistics scalars as the runner logs them (``stats/<module>/<role>/<stat>``)."""
    scalars = dict(run.scalars)
    for stat, k in (("sqnr_db", 0), ("underflow_pct", 1)):
        for (module, role) in {(m, r) for m, r, _ in planted}:
            pts = sorted((s, v[k]) for (m, r, s), v in planted.items() if (m, r) == (module, role))
            scalars[f"stats/{module}/{role}/{stat}"] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    return dataclasses.replace(run, scalars=scalars)


def test_numerics_heatmaps_show_each_planted_statistic(tmp_path) -> None:
    # Oracle: the planted per-layer values; each heatmap cell's tooltip must carry exactly its (layer, step)
    # value, an unsampled (layer, step) is a grey "not sampled" cell, and a fallback event is listed.
    rng = np.random.default_rng(5)
    base = build_baseline("ref", [make_run(rng, s) for s in range(2)])
    planted = {("fc1", "input", 10): (31.5, 0.0), ("fc1", "input", 20): (28.25, 0.5),
               ("fc1", "weight", 10): (35.0, 0.0), ("fc1", "weight", 20): (float("inf"), 0.0),
               ("head", "grad_output", 20): (12.75, 42.0)}  # head not sampled at step 10
    cand = _with_stats(make_run(rng, 9), planted)
    cand = dataclasses.replace(cand, events=[{"step": 20, "kind": "fallback",
                                              "payload": {"module": "head", "statistic": "underflow_pct"}}])
    text = write_report(tmp_path / "r.html", baseline=base, runs=[cand], verdict=None).read_text(encoding="utf-8")
    assert "<h2>Per-layer numerics</h2>" in text
    svgs = [ET.fromstring(s) for s in re.findall(r"<svg\b.*?</svg>", text, flags=re.S)]
    heat = [s for s in svgs if "SQNR of each" in (s.findtext(f"{SVG_NS}title") or "")
            or "underflow" in (s.findtext(f"{SVG_NS}title") or "")]
    assert len(heat) == 2
    for svg, k, unit in ((heat[0], 0, "dB"), (heat[1], 1, "%")):
        tips = {r.findtext(f"{SVG_NS}title"): r.get("fill") for r in svg.iter(f"{SVG_NS}rect")
                if r.findtext(f"{SVG_NS}title")}
        assert len(tips) == 6  # 3 tensors x 2 sampled steps
        for (m, r, s), v in planted.items():
            shown = "inf" if v[k] == float("inf") else f"{v[k]:.4g}"
            assert f"{m} {r} step {s}: {unit} {shown}" in tips, (m, r, s, sorted(map(str, tips)))
        assert tips[f"head grad_output step 10: {unit} not sampled"] == "#dddddd"
    # SQNR colors: the best (inf, green end) differs from the worst (12.75 dB, toward red)
    sq = {r.findtext(f"{SVG_NS}title"): r.get("fill") for r in heat[0].iter(f"{SVG_NS}rect")}
    assert sq["fc1 weight step 20: dB inf"] == "#1a9850"
    assert sq["head grad_output step 20: dB 12.75"] not in ("#1a9850", "#dddddd")
    assert "fallback" in text and "underflow_pct" in text


def test_inference_report_renders_in_headless_chromium(tmp_path) -> None:
    # The inference judge's report (lowprec.inference.write_inference_report) through the same browser oracle:
    # every chart is a parsed SVG element, every chart text lies inside its svg, a hostile candidate name stays
    # text, and the outcome colours are drawn.
    import copy

    import torch

    from lowprec import inference as inf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 16, (16,), generator=g)) for _ in range(4)]
    verdicts = []
    for preset, name in (("w8a8-int8", "<script>alert(1)</script>"), ("mxfp4", "mxfp4")):
        q = inf.quantize_model(copy.deepcopy(model), inf.get(preset))
        verdicts.append(inf.judge_inference(model, q, data, inf.InferenceCriteria(top1=0.9, bf16_ratio=2.0),
                                            bf16="auto", candidate_name=name))
    path = inf.write_inference_report(tmp_path / "inference.html", verdicts)
    text = path.read_text(encoding="utf-8")
    assert "<script" not in text
    probe = tmp_path / "probe-inference.html"
    probe.write_text(text.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = _run_browser(["--dump-dom", probe.as_uri()], tmp_path)
    got = re.search(r'<pre id="measured">(.*?)</pre>', dom, flags=re.S)
    assert got, dom[-2000:]
    m = json.loads(html.unescape(got.group(1)))
    assert m["scripts"] == 1 and "&lt;script&gt;" in dom
    assert len(m["svgs"]) == text.count("<svg") == 1 and all(s["svg"] for s in m["svgs"])
    for s in m["svgs"]:
        w, h = s["view"]
        for t in s["texts"]:
            x, y, tw, th = t["box"]
            if t["text"].strip():
                assert x >= -0.5 and y >= -0.5 and x + tw <= w + 0.5 and y + th <= h + 0.5, (s["title"], t, w, h)
