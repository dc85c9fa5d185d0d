"""benchmarks/reduction_scale.py --quick runs and reports what it claims: every configuration at every world size of
the quick grid, the prediction where the analysis applies, and largest-world answers consistent with the points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reduction_scale_quick() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reduction_scale.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, check=True, env=env)
    result = json.loads(out.stdout)
    assert result["grid"] == [2, 8, 64] and len(result["rows"]) == 12
    for row in result["rows"]:
        assert [p["world"] for p in row["points"]] == [2, 8, 64]
        plain = row["payload"] in ("float32", "bfloat16", "float16")
        assert all((p["predicted_rel_l2"] is not None) == plain for p in row["points"]), row["label"]
        for bound, w in row["largest_world_under"].items():
            ok = {p["world"] for p in row["points"] if p["rel_l2"] <= float(bound)}
            assert (w is None) == (2 not in ok) and (w is None or w in ok), (row["label"], bound)
    ring = next(r for r in result["rows"] if r["label"].startswith("bf16 ring"))
    assert ring["points"][-1]["rel_l2"] > 3 * ring["points"][0]["rel_l2"]  # grows with W
