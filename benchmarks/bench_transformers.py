"""Eager training-step time of lowprec recipes on the transformers Llama and Mixtral tasks, as one JSON object.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_transformers.py [--quick] [--families llama mixtral]
        [--sizes tiny gemm] [--arms fp32 fp32+attn fp8-tensorwise fp8-tensorwise+attn mxfp8+attn] [--threads 1]
        [--rounds 15] [--no-breakdown]

What is timed: one training step of the zoo task ``hf-causal-lm`` (``lowprec.runs.zoo``, transformers'
``AutoModelForCausalLM.from_config``, sdpa attention, float32) = ``model(**batch).loss``, backward, AdamW step
(``torch.optim.AdamW``, wrapped in ``LowPrecisionOptimizer`` for lowprec recipes) and ``zero_grad``, eager, on
the CPU, on one fixed batch.  Arms (every one a fresh model from seed 0):

* ``fp32``: the unconverted model (transformers' sdpa, i.e. PyTorch's fused CPU attention kernel);
* ``fp32+attn``: linears unconverted (the fp32 recipe), attention emulated unquantized: PyTorch's *math* SDPA order,
  which is what every emulated-attention arm computes; it separates the cost of leaving the fused attention kernel
  from the cost of quantizing;
* ``fp8-tensorwise``: ``lowprec.convert`` with fp8-tensorwise (linears and, for Mixtral, the experts);
* ``fp8-tensorwise+attn``: the same plus emulated fp8 attention (Q K^T and P V);
* ``mxfp8+attn``: MX blocks of 32 for the linears, experts and attention.

Sizes (task options; ``heads`` 4, 2 key/value heads, Mixtral 4 experts, top-2, byte tokens, vocabulary 256):

* ``tiny``: the task's default (hidden 64, layers 2, context 64, batch 32): every GEMM is small, so per-call
  overhead (Python, autograd, one quantizer launch per operand) dominates;
* ``gemm``: hidden 256, layers 2, context 128, batch 8 (1024 tokens a step): the linears are [1024, 256] x
  [256, 256..512] GEMMs and attention is [32 heads, 128, 128] per layer, big enough that the fp32 step is mostly
  GEMM time (about 60-70 %), as in real training, yet a step still takes ~0.1-0.3 s on one core, so the whole
  run fits in a few minutes.

Timing: ``--warmup`` steps per arm, then ``--rounds`` rounds of one step per arm in a rotating order (interleaved,
so load from other processes falls on all arms alike); ``step_ms`` is the median, ``ratio_to_fp32`` the ratio of
medians (``ratio_to_fp32_paired``: the median of the per-round ratios).  The ``targets`` section checks issue 17's
"eager fp8-tensorwise step, attention emulation included, at most 1.3x the fp32 step" (arm ``fp8-tensorwise+attn``)
per family and size; it reports, it never fails.

``breakdown`` (skip with ``--no-breakdown``): for the fp32 and fp8-tensorwise+attn arms of each family at the
largest size, interleaved step by step, per step: the wall time inside lowprec's operand quantizer
(``fake_quantize_tensors``) and its GEMM (``accumulate_matmul``), measured by wrapping the two functions, and
torch.profiler's self CPU time of the GEMM operators (``aten::mm``/``bmm``/``addmm``/the fused SDPA kernels), of
all other aten operators and of the rest (Python, autograd and the native quantizer kernels, which the profiler
does not see as aten operators), with the top operators; ``fp8-tensorwise+attn_minus_fp32_ms`` splits the extra
time of the emulation into those parts (``operand_quantization_ms`` of the fp8 arm is the wall time of its
quantizer calls, most of its ``non_aten_ms``) and ``fp32_gemm_share`` is the share of the fp32 step spent in GEMMs.

Where the time goes (2-core shared CPU, one thread, torch 2.13, transformers 5.24; ratios move by +-0.05-0.1 between
runs): at size ``gemm`` fp8-tensorwise+attn is about 1.15-1.25x fp32 (Llama) and 1.1-1.2x (Mixtral), met; at
``tiny`` Mixtral is 1.13-1.25x and Llama 1.28-1.55x, borderline (met in one of three full runs). The floor there is
attention: the emulation computes PyTorch's math SDPA (two batched GEMMs over every head, a full-size mask add,
softmax and its backward, scale multiplies), which is what its bits are defined by, while the fp32 baseline runs the
fused flash kernel; ``fp32+attn`` alone is 1.1-1.25x at ``tiny`` (head dim 16: 128 tiny [64, 16] x [16, 64] GEMMs a
call) and 1.05-1.15x at ``gemm``. The quantizers themselves are ~5 % of the fp8 step at ``gemm``
(``operand_quantization_ms``). mxfp8 (2.2-4.1x) is dominated by the MX block quantizer: ~0.3 ms fixed cost a call
and up to 5x slower on transposed operands (the backward's W^T, dY^T, X^T), which ``lowprec.quant`` would have to
fix.

Numbers on a shared 2-core machine are noisy: run with ``OMP_NUM_THREADS=1`` / ``--threads 1`` and read the
``load_average`` fields.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import lowprec
from lowprec.optim import LowPrecisionOptimizer

ARMS = ["fp32", "fp32+attn", "fp8-tensorwise", "fp8-tensorwise+attn", "mxfp8+attn"]
TARGET_ARM = "fp8-tensorwise+attn"
TARGET_MAX_RATIO_TO_FP32 = 1.3
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"options": {}, "batch_size": None},  # the task's defaults
    "gemm": {"options": {"hidden": 256, "layers": 2, "context": 128}, "batch_size": 8},
}
FAMILIES = ["llama", "mixtral"]
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings and library chatter on stdout (stdout carries only the JSON)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        yield


class Step:
    """A task's model, its optimizer and one fixed batch; ``__call__`` runs one training step (seconds)."""

    def __init__(self, family: str, size: str, arm: str) -> None:
        from lowprec.runs.zoo import get_task

        spec = SIZES[size]
        task = get_task("hf-causal-lm", seed=0, batch_size=spec["batch_size"], family=family, **spec["options"])
        self.model = model = task.model
        self.info = task.info
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if arm != "fp32":
            lowprec.convert(model, arm)
            opt = LowPrecisionOptimizer(opt, arm)
        self.opt = opt
        self.batch = task.train_batch(0)
        self.last_loss = float("nan")

    def __call__(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(**self.batch).loss
        if isinstance(self.opt, LowPrecisionOptimizer):
            self.opt.scale_loss(loss).backward()
        else:
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.last_loss = float(loss.detach())
        return dt


def measure(family: str, size: str, arms: list[str], *, warmup: int, rounds: int) -> dict[str, Any]:
    steps: dict[str, Step] = {}
    out: dict[str, Any] = {}
    for arm in arms:
        print(f"[bench_transformers] {family}/{size} {arm}: build and warm up", file=sys.stderr, flush=True)
        try:
            steps[arm] = Step(family, size, arm)
            for _ in range(warmup):
                steps[arm]()
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the others
            out[arm] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            steps.pop(arm, None)
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    live = list(steps)
    for r in range(rounds):
        for arm in live[r % len(live):] + live[:r % len(live)]:
            times[arm].append(steps[arm]())
    for arm in arms:
        if arm in steps:
            ts = times[arm]
            out[arm] = {"step_ms": round(1e3 * statistics.median(ts), 2), "best_ms": round(1e3 * min(ts), 2),
                        "steps": len(ts), "last_loss": round(steps[arm].last_loss, 4)}
    base = out.get("fp32", {}).get("step_ms")
    for arm, res in out.items():
        if base and arm != "fp32" and "step_ms" in res:
            res["ratio_to_fp32"] = round(res["step_ms"] / base, 3)
            # the same rounds paired: robust to load that drifts during the run
            res["ratio_to_fp32_paired"] = round(statistics.median(
                a / b for a, b in zip(times[arm], times["fp32"], strict=True)), 3)
    info = next(iter(steps.values())).info if steps else {}
    opts = info.get("options", {})
    sz = {k: opts.get(k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "experts", "top_k",
                                   "context") if opts.get(k) is not None}
    sz["batch_size"] = (info.get("tokens_per_step") or 0) // max(1, opts.get("context") or 1)
    return {"size": sz, "params": info.get("params"), "tokens_per_step": info.get("tokens_per_step"),
            "arms": {arm: out[arm] for arm in arms}}


def _time_parts(step: Step, acc: dict[str, float]) -> None:
    """One step, adding to ``acc`` its wall seconds and those inside lowprec's operand quantizer and emulated GEMM
    (wrapping the two functions that ``EmulatedLinear``, ``EmulatedExperts`` and emulated attention all call
    through ``lowprec.nn._linear``)."""
    import lowprec.nn._linear as lin_mod

    orig_q, orig_g = lin_mod.fake_quantize_tensors, lin_mod.accumulate_matmul

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
            acc[key + "_calls"] = acc.get(key + "_calls", 0.0) + 1
            return out

        return wrapper

    lin_mod.fake_quantize_tensors = timed(orig_q, "quantize")  # type: ignore[assignment]
    lin_mod.accumulate_matmul = timed(orig_g, "gemm")  # type: ignore[assignment]
    try:
        acc["step"] = acc.get("step", 0.0) + step()
    finally:
        lin_mod.fake_quantize_tensors = orig_q  # type: ignore[assignment]
        lin_mod.accumulate_matmul = orig_g  # type: ignore[assignment]


def _profile(step: Step, acc: dict[str, list[float]]) -> None:
    """One step under torch.profiler, adding each operator's self CPU microseconds and calls to ``acc``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    for e in prof.key_averages():
        row = acc.setdefault(e.key, [0.0, 0.0])
        row[0] += e.self_cpu_time_total
        row[1] += e.count


def _summary(events: dict[str, list[float]], steps: int) -> dict[str, Any]:
    total = sum(v[0] for v in events.values())
    gemm = sum(v[0] for k, v in events.items() if k in GEMM_OPS)
    aten = sum(v[0] for k, v in events.items() if k.startswith("aten::"))
    top = sorted(events.items(), key=lambda kv: -kv[1][0])[:10]
    ms = 1e3 * steps  # profiler times are microseconds
    return {
        "profiled_ms_per_step": round(total / ms, 2),
        "gemm_ms": round(gemm / ms, 2),
        "other_aten_ms": round((aten - gemm) / ms, 2),
        "non_aten_ms": round((total - aten) / ms, 2),
        "top_ops": [{"op": k, "self_ms_per_step": round(v[0] / ms, 2), "calls_per_step": int(v[1]) // steps}
                    for k, v in top],
    }


def breakdown(family: str, size: str, arms: list[str], steps: int) -> dict[str, Any]:
    """Profiled and wrapped steps of ``arms``, interleaved step by step (as the timing rounds are)."""
    live: dict[str, Step] = {}
    for arm in arms:
        print(f"[bench_transformers] breakdown {family}/{size} {arm}", file=sys.stderr, flush=True)
        live[arm] = Step(family, size, arm)
        live[arm]()
        live[arm]()
    events: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}
    parts: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for r in range(steps):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            _profile(live[arm], events[arm])
            if arm != "fp32":
                _time_parts(live[arm], parts[arm])
    out: dict[str, Any] = {}
    for arm in arms:
        p = parts[arm]
        wrapped = {"step_ms": round(1e3 * p["step"] / steps, 2),
                   "operand_quantization_ms": round(1e3 * p.get("quantize", 0.0) / steps, 2),
                   "emulated_gemm_ms": round(1e3 * p.get("gemm", 0.0) / steps, 2),
                   "quantize_calls_per_step": int(p.get("quantize_calls", 0.0)) // steps} if p else {}
        out[arm] = {**wrapped, **_summary(events[arm], steps)}
    if "fp32" in out and TARGET_ARM in out:
        a, b = out["fp32"], out[TARGET_ARM]
        out[f"{TARGET_ARM}_minus_fp32_ms"] = {k: round(b[k] - a[k], 2) for k in
                                               ("profiled_ms_per_step", "gemm_ms", "other_aten_ms", "non_aten_ms")}
        out["fp32_gemm_share"] = round(a["gemm_ms"] / a["profiled_ms_per_step"], 3)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="7 rounds, size gemm only, breakdown of 2 steps")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--arms", nargs="+", default=ARMS, help=f"recipes to time (fp32 is always included); default {ARMS}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds (one step of every arm each)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--breakdown-steps", type=int, default=4)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.sizes, args.breakdown_steps = 7, ["gemm"], 2
    if "fp32" not in args.arms:
        args.arms = ["fp32", *args.arms]
    bad = [a for a in args.arms if a not in lowprec.recipes.names() and not lowprec.recipes.is_named(a)]
    if bad:
        p.error(f"unknown recipe(s) {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers

    report: dict[str, Any] = {
        "benchmark": "bench_transformers",
        "machine": {"torch": torch.__version__, "transformers": transformers.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "cpu_count": os.cpu_count(), "torch_num_threads": torch.get_num_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "lowprec_backend": lowprec.quant.get_backend(), "load_average_start": load_average()},
        "step": "model(**batch).loss, backward, AdamW step, zero_grad; eager, CPU, float32",
        "timing": {"warmup": args.warmup, "rounds": args.rounds, "interleaved": True, "statistic": "median"},
        "results": {},
    }
    t0 = time.perf_counter()
    with quiet():
        for family in args.families:
            report["results"][family] = {size: measure(family, size, args.arms, warmup=args.warmup,
                                                       rounds=args.rounds) for size in args.sizes}
        targets: dict[str, Any] = {"arm": TARGET_ARM, "max_ratio_to_fp32": TARGET_MAX_RATIO_TO_FP32, "checks": {}}
        for family, by_size in report["results"].items():
            for size, res in by_size.items():
                r = res["arms"].get(TARGET_ARM, {}).get("ratio_to_fp32")
                if r is not None:
                    targets["checks"][f"{family}/{size}"] = {"ratio_to_fp32": r,
                                                             "met": r <= TARGET_MAX_RATIO_TO_FP32}
        targets["met"] = bool(targets["checks"]) and all(c["met"] for c in targets["checks"].values())
        report["targets"] = targets
        if not args.no_breakdown:
            size = args.sizes[-1]
            arms = [a for a in ("fp32", TARGET_ARM) if a in args.arms]
            report["breakdown"] = {f"{family}/{size}": breakdown(family, size, arms, args.breakdown_steps)
                                   for family in args.families}
    report["machine"]["load_average_end"] = load_average()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
