"""Throughput of lowprec's quantizers against memory bandwidth and native casts, as one JSON object.

    PYTHONPATH=src python benchmarks/bench_quant.py [--numel 16777216] [--repeat 10] [--eager-repeat 4]
        [--threads N] [--no-eager] [--no-compiled] [--only NAME ...]

Every number is GB/s of float32 *input* (``numel * 4`` bytes divided by the best of N wall-clock times), all
measured in the same run on the same tensor:

* references: ``torch.clone`` (memory bandwidth: read once, write once into newly allocated memory, as every
  quantizer does; ``copy_into_existing`` is the same copy into a preallocated tensor, which shows how much of the
  clone time is allocation and first-touch page faults), torch's native round trips
  ``x.to(float8_e4m3fn).float()`` and ``x.to(bfloat16).float()``, and the ml_dtypes casts
  ``x.numpy().astype(float8_e4m3fn / float4_e2m1fn).astype(float32)``;
* every named ``QuantSpec`` (fake-quant), NVFP4 with stochastic rounding (the b200-nvfp4 recipe's gradients), bf16
  stochastic rounding and elementwise e4m3, each under the library's default backend ("default": "auto", where
  large CPU tensors take the native kernels split across threads), compiled (``lowprec.quant.backend("compiled")``,
  after one warm-up call that compiles it) and eager.  Scaled quantizers see a 2-D view ``[numel / cols, cols]``.

Timings are interleaved rounds (every function once per round, best round kept), and each quantizer's
``ratio_to_clone`` divides by a ``torch.clone`` timed in the same rounds: on a shared machine the cost of
allocating and first touching 64 MB drifts by several times, and it is part of both.  Each quantizer also reports
ratios to the native casts of the same element format.  The ``targets`` section says whether each named spec and
stochastic rounding reaches ``MIN_RATIO`` of ``torch.clone`` under the default backend (the compiled ratio next
to it), and ``compiled_targets`` the earlier floors for the compiled kernels; they only report, they never fail.
``--threads`` sets ``torch.set_num_threads`` (clone and the split native calls use that many threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import torch

import lowprec
from lowprec.quant import QuantSpec, fake_quantize, quantize
from lowprec.runs._manifest import host_info


def _fake(name: str, **changes: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    spec = dataclasses.replace(QuantSpec.named(name), **changes) if changes else QuantSpec.named(name)
    return lambda x: fake_quantize(x, spec, seed=1 if spec.rounding == "stochastic" else None)


_ELEM = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1",
         "mxint8": "int8", "nvfp4": "e2m1", "nvfp4_div": "e2m1", "fp8_e4m3_tensorwise": "e4m3",
         "fp8_e5m2_tensorwise": "e5m2", "fp8_e4m3_rowwise": "e4m3", "fp8_e5m2_rowwise": "e5m2",
         "fp8_e4m3_1x128": "e4m3", "fp8_e4m3_128x128": "e4m3"}

# name -> (function of the 2-D input, element format for the native comparisons): every named spec, then the
# stochastic-rounding cases and an elementwise cast
QUANTIZERS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    **{name: (_fake(name), _ELEM.get(name, "e4m3")) for name in QuantSpec.names()},
    "nvfp4_stochastic": (_fake("nvfp4", rounding="stochastic"), "e2m1"),
    "bf16_stochastic": (lambda x: quantize(x, "bfloat16", rounding="stochastic", seed=1), "bf16"),
    "e4m3_nearest_elementwise": (lambda x: quantize(x, "float8_e4m3fn"), "e4m3"),
}

MIN_RATIO = 0.7
"""Each named spec and stochastic rounding, under the default backend, at least this fraction of clone."""
TARGETED = [*QuantSpec.names(), "nvfp4_stochastic", "bf16_stochastic"]

# (quantizer, minimum fraction of clone bandwidth for its compiled kernel): the floors set before the native route
COMPILED_TARGETS = [("fp8_e4m3_tensorwise", 0.5), ("bf16_stochastic", 0.4), ("mxfp8_e4m3", 0.3), ("mxfp4", 0.3)]

# which reference each element format is compared with: (torch native key or None, ml_dtypes key or None)
COMPARE = {
    "e4m3": ("torch_native_e4m3", "ml_dtypes_e4m3"),
    "e2m1": (None, "ml_dtypes_e2m1"),
    "bf16": ("torch_native_bf16", None),
    "e5m2": (None, None),
    "e3m2": (None, None),
    "e2m3": (None, None),
    "int8": (None, None),
}


def best_times(fns: list[Callable[[], Any]], repeat: int) -> list[float]:
    """Best wall-clock seconds of ``repeat`` rounds, each calling every function once (interleaved, so that all of
    them see the same machine: allocation and page-fault costs on a shared machine change over time)."""
    best = [float("inf")] * len(fns)
    for _ in range(max(1, repeat)):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def sig(v: float, digits: int = 4) -> float:
    """``v`` rounded to ``digits`` significant digits (for printing)."""
    return float(f"{v:.{digits}g}")


def gbps(nbytes: int, seconds: float) -> float:
    return sig(nbytes / seconds / 1e9)


def machine_info() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        **host_info(),
        "torch_num_threads": torch.get_num_threads(),
    }


def reference_gbps(x: torch.Tensor, repeat: int) -> dict[str, float]:
    """Bandwidth of the reference operations (each warmed up once)."""
    dst = torch.empty_like(x)
    refs: dict[str, Callable[[], Any]] = {
        "clone": lambda: torch.clone(x),
        "copy_into_existing": lambda: dst.copy_(x),
        "torch_native_e4m3": lambda: x.to(torch.float8_e4m3fn).float(),
        "torch_native_bf16": lambda: x.to(torch.bfloat16).float(),
        "ml_dtypes_e4m3": lambda: x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
        "ml_dtypes_e2m1": lambda: x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32),
    }
    nbytes = x.numel() * 4
    for fn in refs.values():
        fn()
    times = best_times(list(refs.values()), repeat)
    return {name: gbps(nbytes, t) for name, t in zip(refs, times, strict=True)}


BACKENDS = {"default": "auto", "compiled": "compiled", "eager": "eager"}
"""Result key -> lowprec backend ("default" is the library's default, "auto")."""


def measure_quantizer(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backend: str, repeat: int
) -> dict[str, float]:
    """GB/s of one quantizer under one backend, and of ``torch.clone`` timed in the same rounds.

    The first (warm-up) call compiles in "compiled" mode.
    """
    with lowprec.quant.backend(BACKENDS[backend]):  # type: ignore[arg-type]
        t0 = time.perf_counter()
        fn(x)
        warmup = time.perf_counter() - t0
        t_clone, t = best_times([lambda: torch.clone(x), lambda: fn(x)], repeat)
    nbytes = x.numel() * 4
    res = {"gbps": gbps(nbytes, t), "best_s": sig(t), "clone_gbps_same_rounds": gbps(nbytes, t_clone)}
    if backend == "compiled":
        res["warmup_s"] = sig(warmup, 3)
    return res


def add_ratios(res: dict[str, float], refs: dict[str, float], fmt: str) -> None:
    res["ratio_to_clone"] = sig(res["gbps"] / res["clone_gbps_same_rounds"], 3)
    native, ml = COMPARE[fmt]
    res["ratio_to_torch_native_e4m3"] = sig(res["gbps"] / refs["torch_native_e4m3"], 3)
    if native and native != "torch_native_e4m3":
        res[f"ratio_to_{native}"] = sig(res["gbps"] / refs[native], 3)
    if ml:
        res["ratio_to_ml_dtypes"] = sig(res["gbps"] / refs[ml], 3)
        res["ml_dtypes_reference"] = ml


def evaluate_targets(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Each targeted quantizer's default-backend ratio against ``MIN_RATIO`` (and its compiled ratio, if measured)."""
    out: dict[str, dict[str, Any]] = {}
    for name in TARGETED:
        if name not in results or "default" not in results[name]:
            continue
        got = results[name]["default"]["ratio_to_clone"]
        out[name] = {"backend": "default", "min_ratio_to_clone": MIN_RATIO, "ratio_to_clone": got,
                     "met": got >= MIN_RATIO}
        if "compiled" in results[name]:
            out[name]["compiled_ratio_to_clone"] = results[name]["compiled"]["ratio_to_clone"]
    return out


def evaluate_compiled_targets(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, need in COMPILED_TARGETS:
        if name not in results or "compiled" not in results[name]:
            continue
        got = results[name]["compiled"]["ratio_to_clone"]
        out[name] = {"backend": "compiled", "min_ratio_to_clone": need, "ratio_to_clone": got, "met": got >= need}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=16 * 1024 * 1024, help="elements of the float32 input")
    p.add_argument("--cols", type=int, default=4096, help="last dimension of the 2-D view (must divide numel)")
    p.add_argument("--repeat", type=int, default=10,
                   help="timed calls per reference and per quantizer under the default and compiled backends (best)")
    p.add_argument("--eager-repeat", type=int, default=4, help="timed calls per quantizer under the eager backend")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    p.add_argument("--no-eager", action="store_true", help="skip the eager-backend measurements")
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled-backend measurements")
    p.add_argument("--only", nargs="*", choices=list(QUANTIZERS), help="measure only these quantizers")
    args = p.parse_args(argv)
    if args.numel <= 0 or args.cols <= 0 or args.numel % args.cols:
        p.error(f"--cols {args.cols} must divide --numel {args.numel}")
    if args.threads is not None and args.threads <= 0:
        p.error(f"--threads must be positive; got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).view(-1, args.cols)
    refs = reference_gbps(x, args.repeat)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, (fn, _) in QUANTIZERS.items():
        if args.only and name not in args.only:
            continue
        results[name] = {"default": measure_quantizer(fn, x, "default", args.repeat)}
        if not args.no_compiled:
            results[name]["compiled"] = measure_quantizer(fn, x, "compiled", args.repeat)
        if not args.no_eager:
            results[name]["eager"] = measure_quantizer(fn, x, "eager", args.eager_repeat)
    # how far clone's own bandwidth moved during the run (allocation and page-fault cost drift)
    paired = [r["clone_gbps_same_rounds"] for b in results.values() for r in b.values()]
    refs["clone_min_any_rounds"] = min([refs["clone"], *paired])
    refs["clone_max_any_rounds"] = max([refs["clone"], *paired])
    for name, by_backend in results.items():
        for res in by_backend.values():
            add_ratios(res, refs, QUANTIZERS[name][1])
    report = {
        "machine": machine_info(),
        "config": {
            "numel": args.numel,
            "shape": list(x.shape),
            "bytes_per_call": args.numel * 4,
            "repeat": args.repeat,
            "eager_repeat": None if args.no_eager else args.eager_repeat,
            "backends": {k: v for k, v in BACKENDS.items()
                         if not (k == "eager" and args.no_eager or k == "compiled" and args.no_compiled)},
            "timing": (
                "best of N wall-clock rounds; GB/s of float32 input; each quantizer's ratio_to_clone divides by the "
                "clone timed in the same rounds (clone_gbps_same_rounds); references_gbps.clone: timed with the other "
                "references"
            ),
        },
        "references_gbps": refs,
        "quantizers": results,
        "targets": evaluate_targets(results),
        "compiled_targets": evaluate_compiled_targets(results),
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
