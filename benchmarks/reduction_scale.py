"""Gradient all-reduce error against world size (issue 19 section 5; docs/reductions.md), as one JSON object.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/reduction_scale.py [--quick] [--md]

For each configuration (algorithm x payload x accumulation format) and world size W in the grid, the relative L2
error of ``lowprec.distributed.simulate_reduction`` (4 chunks of 1024 elements, counter-based N(0, 1) gradients,
seed 0) against the float64 sum, next to the analysis' prediction; then, per configuration and bound, the largest
W of the grid whose error stays under the bound, and the recipes' own gradient reductions (every named recipe
reduces in float32: ``mixed_precision_policy(recipe).reduce_dtype``, DDP's float32 all-reduce; ``grad_comm`` is
opt-in and goes through ``compress_hook``, which quantizes once and sums the decoded values in float32: the
``alltoall`` rows).  ``--md`` prints the docs page's tables instead of JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from lowprec.distributed import simulate_reduction

GRID = (2, 8, 64, 512, 4096, 32768, 100_000)
QUICK_GRID = (2, 8, 64)
BOUNDS = (5e-2, 1e-2, 1e-3)
CONFIGS: tuple[tuple[str, str, str, str], ...] = (
    # (label, algorithm, payload, accumulate)
    ("float32 ring (NCCL, DDP default)", "ring", "float32", "float32"),
    ("float32 tree", "tree", "float32", "float32"),
    ("bf16 ring", "ring", "bfloat16", "float32"),
    ("bf16 tree", "tree", "bfloat16", "float32"),
    ("bf16 all-to-all + float32 sum", "alltoall", "bfloat16", "float32"),
    ("fp16 ring", "ring", "float16", "float32"),
    ("fp8 e4m3 (one scale a message) ring", "ring", "fp8_e4m3_rowwise", "float32"),
    ("fp8 e4m3 (one scale a message) all-to-all", "alltoall", "fp8_e4m3_rowwise", "float32"),
    ("mxfp8 e4m3 ring", "ring", "mxfp8_e4m3", "float32"),
    ("mxfp8 e4m3 all-to-all", "alltoall", "mxfp8_e4m3", "float32"),
    ("accumulate micro-batches in bf16", "sequential", "bfloat16", "bfloat16"),
    ("accumulate micro-batches in float32", "sequential", "float32", "float32"),
)


def _sig(x: float | None, d: int = 3) -> float | None:
    return None if x is None else float(f"{x:.{d}g}")


def run(grid: tuple[int, ...]) -> dict[str, Any]:
    rows = []
    for label, algorithm, payload, accumulate in CONFIGS:
        points = []
        for w in grid:
            if algorithm == "halving" and w & (w - 1):
                continue
            t0 = time.perf_counter()
            r = simulate_reduction(w, algorithm=algorithm, payload=payload, accumulate=accumulate)  # type: ignore[arg-type]
            points.append({"world": w, "rel_l2": _sig(r.rel_l2), "predicted_rel_l2": _sig(r.predicted_rel_l2),
                           "seconds": _sig(time.perf_counter() - t0, 2)})
        largest = {}
        for b in BOUNDS:
            ok = [p["world"] for p in points if p["rel_l2"] is not None and p["rel_l2"] <= b]
            under = [p["world"] for p in points if p["rel_l2"] is not None and p["rel_l2"] > b]
            first_bad = min(under) if under else None
            largest[f"{b:g}"] = max((w for w in ok if first_bad is None or w < first_bad), default=None)
        rows.append({"label": label, "algorithm": algorithm, "payload": payload, "accumulate": accumulate,
                     "points": points, "largest_world_under": largest})
    return {"benchmark": "reduction_scale", "elements": 4096, "grid": list(grid), "bounds": list(BOUNDS),
            "rows": rows, "torch": torch.__version__}


def _md(result: dict[str, Any]) -> str:
    grid = result["grid"]
    out = ["| configuration | " + " | ".join(f"W={w:,}" for w in grid) + " |",
           "|---|" + "---|" * len(grid)]
    for row in result["rows"]:
        by_w = {p["world"]: p for p in row["points"]}
        cells = []
        for w in grid:
            p = by_w.get(w)
            cells.append("" if p is None else f"{p['rel_l2']:.3g}" + (
                f" ({p['rel_l2'] / p['predicted_rel_l2']:.2f})" if p["predicted_rel_l2"] else ""))
        out.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    out += ["", "| configuration | " + " | ".join(f"error <= {b:g}" for b in result["bounds"]) + " |",
            "|---|" + "---|" * len(result["bounds"])]
    for row in result["rows"]:
        cells = []
        for b in result["bounds"]:
            w = row["largest_world_under"][f"{b:g}"]
            top = max(p["world"] for p in row["points"])
            cells.append("none" if w is None else (f">= {w:,}" if w == top else f"{w:,}"))
        out.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"world sizes {QUICK_GRID} only")
    p.add_argument("--md", action="store_true", help="print the markdown tables")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(QUICK_GRID if args.quick else GRID)
    print(_md(result) if args.md else json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
