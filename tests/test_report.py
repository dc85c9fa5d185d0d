"""The HTML report: one self-contained file whose charts are well-formed SVG and whose content names every run.

Oracles: html.parser (the document parses, every tag is closed, no script/external reference), xml.etree (each
inline SVG is well-formed XML), the synthetic runs of test_judge (names, values and planted manifest differences
that must appear), and headless Chromium (the page renders) when it is installed.
"""

from __future__ import annotations

import dataclasses
import html.parser
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from test_judge import make_run

from lowprec.runs._baseline import build_baseline
from lowprec.runs._judge import judge
from lowprec.runs._report import flatten, manifest_diff, write_report

HOSTILE = '<script>alert("x")</script> & co'
SVG_NS = "{http://www.w3.org/2000/svg}"


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


def test_report_is_self_contained_and_parses(report) -> None:
    path, _, _ = report
    text = path.read_text(encoding="utf-8")
    p = _Collector()
    p.feed(text)
    p.close()
    assert p.stack == [], f"unclosed tags {p.stack}"
    tags = {t for t, _ in p.tags}
    assert "script" not in tags and "link" not in tags and "img" not in tags
    for _, attrs in p.tags:  # no external reference of any kind
        for k, v in attrs.items():
            assert not (k in ("src", "href") and v and not v.startswith("#")), (k, v)
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text)
    assert [f.name for f in path.parent.iterdir()] == ["report.html"]  # atomic write left no temporary file


def test_svg_charts_are_well_formed_xml(report) -> None:
    text = report[0].read_text(encoding="utf-8")
    svgs = re.findall(r"<svg\b.*?</svg>", text, flags=re.S)
    assert len(svgs) == 3  # loss curves + one strip chart per metric (loss, accuracy)
    roots = [ET.fromstring(s) for s in svgs]
    loss = roots[0]
    assert loss.find(f".//{SVG_NS}polygon") is not None  # the baseline min/max band
    assert len(loss.findall(f".//{SVG_NS}polyline")) >= 3 + 1 + 2  # candidates, baseline mean, judge band
    legend = [t.text for t in loss.iter(f"{SVG_NS}text")]
    assert HOSTILE in legend  # escaped in the file, restored by the XML parser
    dots = roots[1].findall(f".//{SVG_NS}circle")
    assert len(dots) == 3 + 3  # baseline seeds + candidates


def test_hostile_names_are_escaped(report) -> None:
    text = report[0].read_text(encoding="utf-8")
    assert "<script>" not in text and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co" in text
    assert "H100 &lt;80GB&gt;" in text


def test_every_run_metric_and_verdict_reason_appears(report) -> None:
    path, cands, verdict = report
    p = _Collector()
    p.feed(path.read_text(encoding="utf-8"))
    body = "".join(p.text)
    for name in ["fp32 seed 0", "fp32 seed 1", "fp32 seed 2", *(c.name for c in cands)]:
        assert name in body, name
    for c in cands:
        assert f"{c.scalars['eval/accuracy'][1][0]:.6g}" in body
    results = {r.name: r for r in verdict.results}
    assert not results["curve"].passed  # the 8% shifted loss (power ~100%: see test_judge)
    for r in verdict.results:
        assert r.reason in body
    marks = [(cls, t) for cls, t in p.cells if t in ("PASS", "FAIL")]
    assert marks == [("pass" if r.passed else "fail", "PASS" if r.passed else "FAIL") for r in verdict.results]


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


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_renders_in_headless_chromium(report, tmp_path) -> None:
    # Oracle: a real browser.  --dump-dom prints the DOM after loading; the SVG elements must be in it (parsed,
    # not shown as text).  The process group is killed if it outlives the timeout, so nothing stays behind.
    path = report[0]
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0
    assert out.count("<svg") == 3 and "polyline" in out and "FAIL" in out
    assert "&lt;script&gt;" in out and "<script>alert" not in out


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
            assert f"{m} {r} step {s}: {unit} {shown}" in tips, (m, r, s, sorted(tips))
        assert tips[f"head grad_output step 10: {unit} not sampled"] == "#dddddd"
    # SQNR colors: the best (inf, green end) differs from the worst (12.75 dB, toward red)
    sq = {r.findtext(f"{SVG_NS}title"): r.get("fill") for r in heat[0].iter(f"{SVG_NS}rect")}
    assert sq["fc1 weight step 20: dB inf"] == "#1a9850"
    assert sq["head grad_output step 20: dB 12.75"] not in ("#1a9850", "#dddddd")
    assert "fallback" in text and "underflow_pct" in text
