"""Cost of post-training quantization with lowprec.inference on the zoo GPT, as one JSON object.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_inference.py [--quick] [--threads 1] [--rounds 15]
        [--schemes w8a8-int8 fp8-static ...] [--d-model 128] [--layers 2] [--context 64] [--batch 32]

Model: the zoo task ``gpt-bytes`` (``lowprec.runs.zoo.get_task``) at ``d_model`` 128 (so that every Linear's
``in_features`` is a multiple of 128: groups of 128 and 128x128 blocks fit), 2 layers, context 64, 32 windows a
batch, float32, seed 0, untrained (timing does not depend on the weights' values), eval mode, ``torch.no_grad``.
Its quantized Linears are ``qkv`` [128->384], ``proj`` [128->128], ``fc`` [128->512] and ``out`` [512->128] per
layer; ``lm_head`` is ignored, as the presets do.

What is timed, per scheme (the presets) and algorithm (``max`` for every scheme; ``gptq`` and ``awq`` for
``w4a16-int4``):

* ``quantize_s``: ``quantize_model(copy.deepcopy(model), scheme, calibration, algorithm=...)`` on 4 calibration
  batches (observing, calibrating the static scales, quantizing every weight once), best of ``--repeat``;
  ``deepcopy_s`` (the copy alone) is subtracted;
* ``forward_ms``: one forward pass of the quantized model on one batch, median of ``--rounds`` interleaved rounds
  (every arm once a round, in rotating order, with the fp32 model, so machine load falls on all arms alike);
  ``ratio_to_fp32`` = median of the per-round ratios to the fp32 forward of the same round.

The fake-quantized forward's extra cost is the activation quantizers (weights are quantized once, in
``quantize_model``): ``activation_bytes`` is what they must move at least (read every quantized layer's input, write
the quantized copy, float32) and ``extra_bandwidth_fraction`` = ``activation_bytes / (forward - fp32 forward)``
over the bandwidth of ``torch.clone`` on a tensor of the largest input's size, timed in the same run: 1.0 would
mean the extra time is pure memory traffic at clone speed.

References, measured in the same rounds: torchao's ``quantize_`` with ``Int8DynamicActivationInt8WeightConfig``
(the counterpart of ``w8a8-int8``: its quantize time and forward ratio; torchao runs real int8 matmuls where
available, so it measures a serving kernel, not an emulation) and ``Float8WeightOnlyConfig``; configs that do
not run on this machine are listed under ``references_unavailable`` with torchao's reason (``Float8Dynamic...``
needs CUDA compute capability 8.9, ``Int4WeightOnlyConfig`` the mslk kernels).

``targets`` (issue 18 section 6; reports, never fails): every ``max`` arm's ``ratio_to_fp32`` at most 1.5, and
every ``quantize_s`` at most 10 s ("calibrating and quantizing the zoo GPT takes seconds").

Timings on a shared 2-core machine are noisy: run with ``OMP_NUM_THREADS=1`` / ``--threads 1`` and read the
``machine`` fields.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

MAX_FORWARD_RATIO = 1.5
MAX_QUANTIZE_S = 10.0
WEIGHT_ALGORITHM_SCHEMES = {"w4a16-int4": ("gptq", "awq")}
TORCHAO_CONFIGS = {"torchao-int8-dynamic": "Int8DynamicActivationInt8WeightConfig",
                   "torchao-fp8-weight-only": "Float8WeightOnlyConfig",
                   "torchao-fp8-dynamic": "Float8DynamicActivationFloat8WeightConfig",
                   "torchao-int4-weight-only": "Int4WeightOnlyConfig"}


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _schemes(names: list[str] | None) -> dict[str, Any]:
    from lowprec import inference as inf

    return {n: inf.get(n) for n in names or inf.names()}


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    from lowprec.runs.zoo import get_task

    task = get_task("gpt-bytes", seed=0, batch_size=args.batch, d_model=args.d_model, layers=args.layers,
                    context=args.context)
    model = task.model.eval()
    cal = [task.train_batch(i)[0] for i in range(4)]
    x = task.train_batch(100)[0]
    return model, cal, x


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes the activation quantizers move at least in one forward, the largest quantized input's numel)."""
    from lowprec.inference import QuantizedLinear

    sizes: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda m, a: sizes.append(a[0].numel()))
             for m in model.modules() if isinstance(m, QuantizedLinear) and m.input_activations is not None]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return sum(2 * 4 * s for s in sizes), max(sizes, default=0)


def _torchao(model: torch.nn.Module, repeat: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The torchao arms that run here: name -> (quantize seconds, quantized model); and name -> why not."""
    arms: dict[str, Any] = {}
    missing: dict[str, str] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao
            from torchao import quantization as tq
    except ImportError as e:
        return {}, {n: f"torchao not installed ({e})" for n in TORCHAO_CONFIGS}
    for name, cfg_name in TORCHAO_CONFIGS.items():
        cfg = getattr(tq, cfg_name, None)
        if cfg is None:
            missing[name] = f"torchao {torchao.__version__} has no {cfg_name}"
            continue

        def run(cfg: Any = cfg) -> torch.nn.Module:
            m = copy.deepcopy(model)
            tq.quantize_(m, cfg(), filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and
                         not fqn.endswith("lm_head"))
            return m

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t, m = _best(run, repeat)
                with torch.no_grad():
                    m(torch.zeros(1, 4, dtype=torch.int64))
        except Exception as e:  # noqa: BLE001 - a reference that cannot run here is reported, not fatal
            missing[name] = f"{cfg_name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        arms[name] = (t, m)
    return arms, missing


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 schemes, 3 rounds: a smoke run")
    p.add_argument("--schemes", nargs="+", help="presets (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--repeat", type=int, default=2, help="quantize_model repeats (best is kept)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao references")
    args = p.parse_args(argv)
    if args.quick:
        args.schemes = args.schemes or ["w8a8-int8", "fp8-static", "w4a16-int4"]
        args.rounds, args.repeat = min(args.rounds, 3), 1
    torch.set_num_threads(args.threads)
    from lowprec import inference as inf

    load0 = list(os.getloadavg())
    model, cal, x = _model(args)
    schemes = _schemes(args.schemes)
    deepcopy_s, _ = _best(lambda: copy.deepcopy(model), max(args.repeat, 3))

    arms: dict[str, torch.nn.Module] = {"fp32": model}
    rows: dict[str, dict[str, Any]] = {}
    for name, scheme in schemes.items():
        for algo in ("max", *WEIGHT_ALGORITHM_SCHEMES.get(name, ())):
            key = f"{name}/{algo}"
            t, q = _best(lambda s=scheme, a=algo: inf.quantize_model(copy.deepcopy(model), s, cal, algorithm=a),
                         args.repeat)
            abytes, biggest = _activation_bytes(q, x)
            rows[key] = {"scheme": name, "algorithm": algo, "quantize_s": _sig(max(t - deepcopy_s, 0.0)),
                         "activation_bytes": abytes, "largest_input_numel": biggest}
            arms[key] = q
    refs, unavailable = ({}, {}) if args.no_torchao else _torchao(model, args.repeat)
    for name, (t, m) in refs.items():
        rows[name] = {"scheme": name, "algorithm": "torchao quantize_", "quantize_s": _sig(max(t - deepcopy_s, 0.0))}
        arms[name] = m

    # Forward timing: warm-up, then interleaved rounds in rotating order.
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    biggest = max((r.get("largest_input_numel", 0) for r in rows.values()), default=0)
    probe = torch.randn(max(biggest, 1))
    clone_times: list[float] = []
    with torch.no_grad():
        for n in names:
            arms[n](x)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                t0 = time.perf_counter()
                arms[n](x)
                times[n].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.clone(probe)
            clone_times.append(time.perf_counter() - t0)
    clone_gbps = 2 * 4 * probe.numel() / statistics.median(clone_times) / 1e9
    fp32_ms = statistics.median(times["fp32"]) * 1e3
    for n in names[1:]:
        row = rows[n]
        row["forward_ms"] = _sig(statistics.median(times[n]) * 1e3)
        row["ratio_to_fp32"] = _sig(statistics.median([a / b for a, b in zip(times[n], times["fp32"], strict=True)]), 3)
        extra_s = statistics.median(times[n]) - statistics.median(times["fp32"])
        if row.get("activation_bytes"):
            row["extra_bandwidth_fraction"] = (_sig(row["activation_bytes"] / extra_s / 1e9 / clone_gbps, 3)
                                               if extra_s > 0 else None)

    targets = {}
    for key, row in rows.items():
        if row["algorithm"] == "max":
            targets[f"{key} forward <= {MAX_FORWARD_RATIO}x fp32"] = {
                "value": row["ratio_to_fp32"], "met": row["ratio_to_fp32"] <= MAX_FORWARD_RATIO}
        if row["algorithm"] != "torchao quantize_":
            targets[f"{key} quantize <= {MAX_QUANTIZE_S:g} s"] = {
                "value": row["quantize_s"], "met": row["quantize_s"] <= MAX_QUANTIZE_S}
    result = {
        "benchmark": "bench_inference",
        "model": {"task": "gpt-bytes", "d_model": args.d_model, "layers": args.layers, "context": args.context,
                  "batch": args.batch, "params": sum(p.numel() for p in model.parameters())},
        "fp32_forward_ms": _sig(fp32_ms),
        "deepcopy_s": _sig(deepcopy_s),
        "clone_gbps": _sig(clone_gbps, 3),
        "rounds": args.rounds,
        "arms": rows,
        "references_unavailable": unavailable,
        "targets": targets,
        "targets_met": sum(t["met"] for t in targets.values()),
        "targets_total": len(targets),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
                    "cpus": os.cpu_count(), "load_average_start": [round(v, 2) for v in load0],
                    "load_average_end": [round(v, 2) for v in os.getloadavg()]},
    }
    return result


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout, indent=2)
    print()
