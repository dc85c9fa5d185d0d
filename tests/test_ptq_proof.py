"""benchmarks/ptq_proof.py --quick runs end to end (slow: it trains gpt-bytes twice for 40 steps): every preset
appears, refusals carry the error, verdicts are stored and the report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec import inference as inf
from lowprec.runs import RunStore

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ptq_proof_quick(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ptq_proof.py"), "--quick", "--store",
                          str(tmp_path / "runs.db"), "--report", str(tmp_path / "r.html")],
                         capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout)
    rows = result["gpt"]["rows"]
    assert {r["scheme"] for r in rows} >= set(inf.names())
    judged = [r for r in rows if "refused" not in r]
    assert judged and all(r["outcome"] in ("pass", "fail", "inconclusive") for r in judged)
    assert any("does not divide in_features=64" in r["refused"] for r in rows if "refused" in r)
    assert {r["algorithm"] for r in judged} == {"max", "gptq", "awq"}
    assert set(result["gpt"]["qat_perplexity"]) == {"fp32", "fp32 + PTQ fp8-dynamic", "fp8-tensorwise trained",
                                                   "fp8-tensorwise trained + fp8-dynamic"}
    with RunStore(tmp_path / "runs.db") as store:
        stored = inf.load_verdicts(store)
    n_minilm = sum("refused" not in r for r in result["minilm"]["rows"])
    assert len(stored) == len(judged) + n_minilm
    assert "lowprec PTQ proof" in (tmp_path / "r.html").read_text()
