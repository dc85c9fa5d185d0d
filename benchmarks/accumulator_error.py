"""GEMM error of the accumulator models against a float64 GEMM as K grows, and the kernels' speed, as one JSON object.

    PYTHONPATH=src python benchmarks/accumulator_error.py [--quick] [--md]

Operands: ``[64, K]`` and ``[64, K]`` standard normal matrices fake-quantized to fp8 e4m3 with one tensorwise scale
(seed 0), the GEMM ``a @ b^T`` of their dequantized values.  The reference is the float64 GEMM of the same values
(exact to far below every error reported).  For each model and K (128 ... 16384) the JSON gives

* ``max_rel_err``: the largest ``|C - C_64| / |C_64|`` over the outputs with ``|C_64|`` at least the median (the
  outputs near zero, where any relative error is unbounded, are left out), and
* ``norm_rel_err``: ``||C - C_64||_F / ||C_64||_F``.

DeepSeek-V3 (arXiv 2412.19437, section 3.3.2) reports "a maximum relative error of nearly 2%" for K = 4096 on
H800 with about 14 bits of accumulation and no promotion, for "two random matrices"; it gives neither the metric
nor the distribution.  ``deepseek_check`` says where the models fall against that number.  ``speed`` times one
``[512, 128] x [512, 128]`` GEMM (the benchmark GPT's q/k/v/o shape, single thread) through the C kernel, the
reference loop and a float32 ``torch.mm``.  ``--md`` prints the docs table instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from lowprec.nn import _accum
from lowprec.quant import fake_quantize
from lowprec.recipes import Accumulator

KS = (128, 512, 1024, 4096, 16384)
QUICK_KS = (128, 1024, 4096)
MODELS: dict[str, tuple[Accumulator, str]] = {
    "float32 (sequential, nearest)": (Accumulator(format="e8m23"), "float32 addition in order"),
    "e8m13 toward zero, no promotion": (Accumulator(format="e8m13", rounding="toward_zero"),
                                        "DeepSeek-V3's 14 bits, truncated after every addition"),
    "e8m13 toward zero, promoted every 128 (h100-fp8)": (
        Accumulator(format="e8m13", rounding="toward_zero", chunk=128), "h100-fp8's accumulator"),
    "e8m13 nearest, no promotion": (Accumulator(format="e8m13"), "14 bits rounded to nearest"),
    "blocked n=16, 14 bits, toward zero, no promotion": (
        Accumulator(block=16, bits=14, format="e8m13", rounding="toward_zero"),
        "Fasi et al.'s blocked FMA with 14-bit alignment and an e8m13 result"),
    "blocked n=4, 24 bits, toward zero (V100 fp16)": (
        Accumulator(block=4, bits=24, rounding="toward_zero"), "Fasi et al. 2021, V100/T4"),
}
DEEPSEEK = {"k": 4096, "max_rel_err": 0.02}


def operands(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, k, generator=g), torch.randn(64, k, generator=g)
    return fake_quantize(a, "fp8_e4m3_tensorwise"), fake_quantize(b, "fp8_e4m3_tensorwise")


def errors(acc: Accumulator, k: int) -> dict[str, float]:
    a, b = operands(k)
    exact = a.double() @ b.double().t()
    err = (_accum.accumulate_matmul(a, b, acc).double() - exact).abs()
    big = exact.abs() >= exact.abs().median()
    return {"max_rel_err": float((err / exact.abs())[big].max()), "norm_rel_err": float(err.norm() / exact.norm())}


def speed(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(512, 128, generator=g).to(torch.bfloat16).float()
    b = torch.randn(512, 128, generator=g).to(torch.bfloat16).float()
    acc = Accumulator(format="e8m13", chunk=128, rounding="toward_zero")
    blocked = Accumulator(block=16, bits=14, format="e8m13", rounding="toward_zero")

    def best(fn: Any, n: int) -> float:
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    mm = best(lambda: a @ b.t(), repeats)
    kernel = best(lambda: _accum.accumulate_matmul(a, b, acc), repeats)
    blk = best(lambda: _accum.accumulate_matmul(a, b, blocked), max(1, repeats // 4))
    loop = best(lambda: _accum.reference_loop(a, b, acc), 1)
    return {"shape": "[512, 128] x [512, 128]^T, 1 thread, best of repeats", "float32_mm_ms": round(1e3 * mm, 3),
            "sequential_kernel_ms": round(1e3 * kernel, 3), "blocked_kernel_ms": round(1e3 * blk, 3),
            "reference_loop_ms": round(1e3 * loop, 2), "sequential_kernel_over_mm": round(kernel / mm, 2),
            "blocked_kernel_over_mm": round(blk / mm, 2), "reference_loop_over_kernel": round(loop / kernel, 1)}


def run(ks: tuple[int, ...], repeats: int) -> dict[str, Any]:
    table = {name: {"model": str(acc), "what": what, "by_k": {str(k): errors(acc, k) for k in ks}}
             for name, (acc, what) in MODELS.items()}
    check: dict[str, Any] = {"published": DEEPSEEK}
    if DEEPSEEK["k"] in ks:
        at = {name: row["by_k"][str(DEEPSEEK["k"])]["max_rel_err"] for name, row in table.items()}
        check["max_rel_err_at_k"] = {n: round(v, 5) for n, v in at.items()}
        check["within_factor_2"] = [n for n, v in at.items() if 0.5 <= v / DEEPSEEK["max_rel_err"] <= 2.0]
    return {"operands": "64 x K standard normal, fp8 e4m3 tensorwise fake-quantized, seed 0", "ks": list(ks),
            "models": table, "deepseek_check": check, "speed": speed(repeats)}


def markdown(res: dict[str, Any]) -> str:
    ks = res["ks"]
    lines = ["| model | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for name, row in res["models"].items():
        cells = [f"{100 * row['by_k'][str(k)]['max_rel_err']:.3g}% ({100 * row['by_k'][str(k)]['norm_rel_err']:.2g}%)"
                 for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"K in {QUICK_KS} only")
    p.add_argument("--md", action="store_true", help="print the docs table (max (norm) relative error)")
    args = p.parse_args(argv)
    res = run(QUICK_KS if args.quick else KS, 5 if args.quick else 20)
    if args.md:
        print(markdown(res))
    else:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
