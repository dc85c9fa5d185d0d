"""benchmarks/reliability_cost.py --quick runs under torchrun and reports what it claims (bookkeeping, not speed:
speed goals live in the benchmark's output, docs/debugging.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_reliability_cost_quick() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reliability_cost.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, check=True, env=env)
    r = json.loads(out.stdout)
    assert r["world_size"] == 2 and r["intervals"] == {"weights": 100, "grads": 100, "replay": 500}
    t = r["tasks"]["mlp-digits"]
    assert set(t["check_ms"]) == {"weights", "grads", "replay"} and t["step_ms"] > 0
    assert set(t["end_to_end_spread"]) == {"off", "weights@1", "grads@1", "replay@1", "default"}
    expected = 100 * sum(t["check_ms"][k] / r["intervals"][k] for k in t["check_ms"]) / t["step_ms"]
    assert abs(t["overhead_at_defaults_pct"] - expected) <= 0.01 + 1e-3 * abs(expected)
    assert t["param_bytes"] == 4 * (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10) and t["digest_GBps"] > 0
