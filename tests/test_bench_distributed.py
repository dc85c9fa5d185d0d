"""benchmarks/bench_distributed.py: the tensor/pipeline-parallel byte counts of real torchrun ranks agree with the
closed-form model of benchmarks/_layout_bytes.py, and the model's numbers are the textbook ring volumes.

Oracles: the ring collective volumes, worked by hand (an all-reduce sends ``2 (T-1)/T`` of the tensor per rank, an
all-gather or reduce-scatter ``(T-1)/T``; Patarasuk and Yuan 2009), and the ranks' own counters
(``lowprec.distributed.tp_stats``, the stage boundary's tensors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _layout_bytes  # noqa: E402


def test_the_model_is_the_ring_volumes_worked_by_hand() -> None:
    """Llama-3-8B-sized decoder (32 blocks, d 4096, 4096 tokens): TP=8 sends 4 all-reduces of 4096 x 4096 float32
    per block, 2 * 7/8 of 64 MiB each, so 32 * 4 * 112 MiB = 14 GiB per rank and step; with sequence parallelism
    and fp8 gathers the forward input gathers carry 1 byte per element instead of 4; a PP boundary carries
    64 MiB forward and 64 MiB back."""
    mib = 2**20
    big = {"layers": 32, "d": 4096, "tokens": 4096}
    assert _layout_bytes.predict("tp", degree=8, **big) == 32 * 4 * (2 * 7 / 8 * 64 * mib)
    assert _layout_bytes.predict("tp+sp", degree=8, **big) == 32 * 4 * (2 * 7 / 8 * 64 * mib)  # RS + AG = AR
    fp8 = _layout_bytes.predict("tp+sp", degree=8, recipe="fp8-tensorwise", **big)
    assert fp8 == 32 * 2 * (7 / 8) * (16 * mib) * (1 + 12)
    assert _layout_bytes.predict("pp", degree=16, **big) == 2 * 64 * mib
    assert _layout_bytes.predict("tp", degree=1, **big) == 0


@pytest.mark.slow  # make test-slow: torchrun ranks train the zoo GPT in 12 layouts
def test_measured_bytes_match_the_model(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_distributed.py"), "--modes", "fp32", "fp8",
                        "--steps", "1", "--warmup", "1"], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)["tp_pp"]
    want = {f"{layout}/{rec}" for layout in ("tp", "tp+sp", "pp") for rec in _layout_bytes.RECIPES}
    assert set(out["layouts"]) == want
    assert out["model_worst_error"] == 0.0, {k: v for k, v in out["layouts"].items() if v["model_error"]}
    lay = out["layouts"]
    assert lay["tp+sp/fp8-tensorwise"]["bytes_per_step"] < lay["tp+sp/bf16"]["bytes_per_step"] < \
        lay["tp+sp/fp32"]["bytes_per_step"] < lay["tp+sp/mxfp8"]["bytes_per_step"]  # MX gathers x twice
    assert lay["tp/fp8-tensorwise"]["amax_bytes"] > 0 and lay["tp/fp32"]["amax_bytes"] == 0
    assert len(out["at_scale"]["bytes_per_step_per_rank"]) == 9
