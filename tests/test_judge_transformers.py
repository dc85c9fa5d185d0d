"""Smoke test of benchmarks/judge_transformers.py (the proof on real transformers families, docs/transformers-proof.md).

Runs the script with ``--quick`` (tiny llama, 40 steps: a 3-seed fp32 baseline, bf16-sr+attn and the known-bad
lr-x0.1 arm with 2 seeds each; about half a minute) in a subprocess and checks the JSON summary, that the
known-bad arm FAILs (its loss is far above the 1% margin even after 40 steps) and that the markdown table parses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "judge_transformers.py"
OUTCOMES = {"pass", "fail", "inconclusive"}
ARM_KEYS = {"outcome", "criteria", "seeds", "eval_loss_mean", "eval_loss_std", "baseline_eval_loss_mean",
            "baseline_eval_loss_std", "worse_by", "margin", "upper", "passable_margin", "detectable",
            "evidence_criterion", "evidence", "advice", "seconds"}


def test_quick_run_judges_arms_and_fails_the_known_bad_one(tmp_path: Path) -> None:
    md, js = tmp_path / "table.md", tmp_path / "verdicts.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--store", str(tmp_path / "runs.db"), "--md", str(md),
         "--json", str(js)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(js.read_text())
    assert json.loads(proc.stdout) == out  # printed and written: the same summary
    assert out["quick"] is True and out["families"] == ["llama"] and out["bad_arm"] == "lr-x0.1"
    fam = out["results"]["llama"]
    assert fam["baseline_seeds"] == [0, 1, 2] and len(fam["baseline_eval_loss"]) == 3
    assert set(fam["arms"]) == {"bf16-sr+attn", "lr-x0.1"}
    for arm, s in fam["arms"].items():
        assert ARM_KEYS <= set(s), arm
        assert s["outcome"] in OUTCOMES and set(s["criteria"].values()) <= OUTCOMES
        assert s["seeds"] == [100, 101]
        assert s["baseline_eval_loss_mean"] == pytest.approx(sum(fam["baseline_eval_loss"]) / 3)
        assert s["margin"] > 0 and isinstance(s["evidence"], str) and s["evidence"]
    bad = fam["arms"]["lr-x0.1"]
    assert bad["outcome"] == "fail", bad["evidence"]
    assert bad["eval_loss_mean"] > bad["baseline_eval_loss_mean"] + bad["margin"]

    lines = md.read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["family", "arm", "verdict"]
    assert set(lines[1].replace("|", "")) == {"-"}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:4]]
    assert all(len(r) == len(header) for r in rows)
    assert {(r[0], r[1], r[2]) for r in rows} == {
        ("llama", arm, s["outcome"].upper()) for arm, s in fam["arms"].items()}
    assert any(line.startswith("- llama / lr-x0.1") for line in lines)
