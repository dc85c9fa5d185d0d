"""Throughput of lowprec.jax's jitted quantizers against a native JAX cast and a copy, as one JSON object.

    PYTHONPATH=src python benchmarks/bench_jax.py [--sizes 1048576 16777216] [--repeat 10] [--quick]

Every number is GB/s of float32 *input* (``numel * 4`` bytes over the best of N wall-clock rounds), measured in the
same run on the same array, every function jitted and warmed up once (compile time reported separately):

* references: ``copy`` (``x + 0`` would be folded away; ``jnp.copy`` under jit is a real copy into a new buffer:
  read once, write once, as every quantizer does) and the native round trip through the ml_dtypes type of each
  element format, ``x.astype(jnp.float8_e4m3fn).astype(jnp.float32)`` (and ``bfloat16``, ``float4_e2m1fn``): what
  XLA's own cast costs, without scaling;
* quantizers: ``lowprec.jax.fake_quantize`` for e4m3 tensorwise, MXFP8 (e4m3) and NVFP4, and
  ``lowprec.jax.quantize`` bf16 elementwise (nearest); scaled ones see a 2-D view ``[numel / cols, cols]``.

Rounds are interleaved (every function once per round, best round kept), so all functions see the same machine.
Each quantizer reports ``ratio_to_copy`` and ``ratio_to_native_cast`` (the cast of its own element format).  The
native casts are not bit-equal to lowprec's quantizers (no scaling, and XLA's cast to float8 does not saturate);
they are the cost of the cheapest conversion JAX offers.  ``--quick`` runs 1M floats with 3 rounds.

Targets (``TARGETS``: the least ``ratio_to_copy`` a quantizer should reach, issue 20): each such quantizer's entry
says ``target_ratio_to_copy`` and ``target_met`` per size, and ``targets`` at the top collects them with
``all_met``.  e4m3 tensorwise is two passes (the amax read, then one fused read + write: ``lowprec.jax._fast_tensor``)
against the copy's one, so about 0.5x is the natural target; ``machine.lowprec_jax_native_amax`` says whether its
amax can run in the native CPU kernel (``lowprec.jax._native``) or runs in XLA reductions (no C compiler, or
``LOWPREC_NATIVE=0``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import lowprec.jax as lj
from lowprec.jax import _native
from lowprec.runs._manifest import host_info

# name -> (function of the 2-D float32 input, native dtype its element format casts to)
QUANTIZERS: dict[str, tuple[Callable[[jax.Array], jax.Array], Any]] = {
    "fp8_e4m3_tensorwise": (lambda x: lj.fake_quantize(x, "fp8_e4m3_tensorwise"), jnp.float8_e4m3fn),
    "mxfp8_e4m3": (lambda x: lj.fake_quantize(x, "mxfp8_e4m3"), jnp.float8_e4m3fn),
    "nvfp4": (lambda x: lj.fake_quantize(x, "nvfp4"), jnp.float4_e2m1fn),
    "bf16_elementwise": (lambda x: lj.quantize(x, "bfloat16"), jnp.bfloat16),
}
NATIVE = {"float8_e4m3fn": jnp.float8_e4m3fn, "bfloat16": jnp.bfloat16, "float4_e2m1fn": jnp.float4_e2m1fn}
# name -> the least ratio_to_copy it should reach (issue 20 section 4: e4m3 tensorwise at least half a copy)
TARGETS: dict[str, float] = {"fp8_e4m3_tensorwise": 0.5}


def best_times(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Best wall-clock seconds over ``repeat`` interleaved rounds; each call waits for its result."""
    best = [float("inf")] * len(fns)
    for _ in range(max(1, repeat)):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def sig(v: float, digits: int = 4) -> float:
    return float(f"{v:.{digits}g}")


def machine_info() -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "lowprec_jax_native_amax": _native.available(),
        **host_info(),
    }


def warm(fn: Callable[[], Any]) -> float:
    """Seconds of the first call (compiles)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def measure_size(numel: int, cols: int, repeat: int, only: list[str] | None) -> dict[str, Any]:
    """All references and quantizers at one size, timed in the same interleaved rounds."""
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((numel // cols, cols), np.float32)))
    copy = jax.jit(jnp.copy)
    fns: dict[str, Callable[[], Any]] = {"copy": lambda: copy(x)}
    for name, dt in NATIVE.items():
        cast = jax.jit(lambda v, dt=dt: v.astype(dt).astype(jnp.float32))
        fns[f"native_cast_{name}"] = lambda cast=cast: cast(x)
    for name, (fn, _) in QUANTIZERS.items():
        if not only or name in only:
            fns[name] = lambda fn=fn: fn(x)
    warmup = {k: sig(warm(f), 3) for k, f in fns.items()}
    times = dict(zip(fns, best_times(list(fns.values()), repeat), strict=True))
    nbytes = numel * 4
    gbps = {k: sig(nbytes / t / 1e9) for k, t in times.items()}
    out: dict[str, Any] = {"shape": list(x.shape), "bytes_per_call": nbytes,
                           "references_gbps": {k: gbps[k] for k in fns if k == "copy" or k.startswith("native")},
                           "quantizers": {}}
    for name, (_, dt) in QUANTIZERS.items():
        if name not in gbps:
            continue
        native = f"native_cast_{jnp.dtype(dt).name}"
        out["quantizers"][name] = {
            "gbps": gbps[name],
            "best_s": sig(times[name]),
            "warmup_s": warmup[name],
            "ratio_to_copy": sig(gbps[name] / gbps["copy"], 3),
            "native_reference": native,
            "ratio_to_native_cast": sig(gbps[name] / gbps[native], 3),
        }
        if name in TARGETS:
            ratio = out["quantizers"][name]["ratio_to_copy"]
            out["quantizers"][name] |= {"target_ratio_to_copy": TARGETS[name], "target_met": ratio >= TARGETS[name]}
    return out


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Every measured quantizer with a target, per size: its ratio to a copy, the target and whether it is met."""
    rows = [
        {"quantizer": name, "size": int(size), "ratio_to_copy": q["ratio_to_copy"],
         "target_ratio_to_copy": q["target_ratio_to_copy"], "met": q["target_met"]}
        for size, r in results.items() for name, q in r["quantizers"].items() if "target_met" in q
    ]
    return {"checks": rows, "all_met": all(row["met"] for row in rows)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24], help="float32 elements per input")
    p.add_argument("--cols", type=int, default=4096, help="last dimension of the 2-D view (must divide each size)")
    p.add_argument("--repeat", type=int, default=10, help="interleaved timing rounds (best kept)")
    p.add_argument("--quick", action="store_true", help="1M floats, 3 rounds (a smoke run)")
    p.add_argument("--only", nargs="*", choices=list(QUANTIZERS), help="measure only these quantizers")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat = [1 << 20], 3
    for n in args.sizes:
        if n <= 0 or n % args.cols:
            p.error(f"--cols {args.cols} must divide every size; {n} is not a multiple")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {str(n): measure_size(n, args.cols, args.repeat, args.only) for n in args.sizes}
    report = {
        "machine": machine_info(),
        "config": {
            "sizes": args.sizes,
            "cols": args.cols,
            "repeat": args.repeat,
            "quick": args.quick,
            "timing": "best of N interleaved wall-clock rounds after one warm-up (compile) call; GB/s of float32 "
            "input; ratios divide by references timed in the same rounds",
        },
        "results": results,
        "targets": targets(results),
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
