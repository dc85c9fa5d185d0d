"""benchmarks/bench_inference.py --quick runs end to end and reports what it claims to: every requested arm with its
quantize time and forward ratio, the torchao references or why they are missing, and targets computed from the
measured values (the benchmark reports; it is not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_inference_quick() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_inference.py"), "--quick", "--schemes",
                          "w8a8-int8", "fp8-static", "nvfp4", "--d-model", "128", "--layers", "1", "--context", "16",
                          "--batch", "4"], capture_output=True, text=True, timeout=300, check=True, env=env)
    result = json.loads(out.stdout)
    arms = result["arms"]
    assert {"w8a8-int8/max", "fp8-static/max", "nvfp4/max"} <= set(arms)
    for key in ("w8a8-int8/max", "fp8-static/max", "nvfp4/max"):
        row = arms[key]
        assert row["quantize_s"] >= 0 and row["forward_ms"] > 0 and row["ratio_to_fp32"] > 0
        # qkv, proj, fc (128 in) and out (512 in) of one block, on 4 x 16 tokens, read and written in float32
        assert row["activation_bytes"] == 2 * 4 * 4 * 16 * (3 * 128 + 512)
        assert row["largest_input_numel"] == 4 * 16 * 512
    torchao = {k for k in arms if k.startswith("torchao-")} | set(result["references_unavailable"])
    assert torchao == {"torchao-int8-dynamic", "torchao-fp8-weight-only", "torchao-fp8-dynamic",
                       "torchao-int4-weight-only"}
    for name, target in result["targets"].items():
        arm = arms[name.split(" ")[0]]
        value = arm["ratio_to_fp32"] if "forward" in name else arm["quantize_s"]
        assert target["value"] == value and target["met"] == (value <= (1.5 if "forward" in name else 10.0))
    assert result["targets_total"] == len(result["targets"]) == 6
    assert result["model"]["params"] > 0 and result["clone_gbps"] > 0
