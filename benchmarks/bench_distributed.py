"""DDP gradient communication with lowprec compress hooks: step time and bytes per step, as one JSON object.

    PYTHONPATH=src python benchmarks/bench_distributed.py [--nproc 2] [--steps 10] [--warmup 2]
        [--modes fp32 bf16 fp8 mxfp8] [--lowprec-backend eager]

Launches itself under torchrun (``lowprec.testing.torchrun``: gloo on CPU, one thread per rank) and prints what
rank 0 measured.  Model: an MLP 784-512-512-10 with ReLU (~670k parameters, one DDP bucket of 2.7 MB), batch 64
per rank, SGD; each rank gets its own batch.  Modes:

* ``fp32``: DDP without a hook (torch's built-in fp32 all-reduce); its bytes are the ring all-reduce count of the
  bucket buffers (``2 (W-1)/W`` of the buffer per rank), the same rule the hooks use for their uncompressed
  reference (see ``lowprec.distributed._compress``);
* ``fp32-hook``: ``compress_hook("float32")``, the identity through the hook's all_gather path (hook overhead);
* ``bf16``, ``fp8`` (``fp8_e4m3_tensorwise``, one shared scale per bucket), ``mxfp8`` (``mxfp8_e4m3``): the hook's
  own byte count (``state.bytes_sent``) of the last step.

``step_ms`` is the median wall time of forward + backward (with communication) + optimizer step over ``--steps``
timed steps after ``--warmup``; modes are timed interleaved (one step of each per round) so that load from other
processes falls on all of them alike.  ``bytes_ratio_vs_fp32`` = fp32 bytes / mode bytes (fp8 must be >= 3.9).

``fsdp2`` reports FSDP2 weight all-gather bytes per step (``fsdp2_allgather_bytes``): float32 gathers vs fp8 and
MXFP8 low-precision gathers of the same MLP.

``tp_pp`` (``--layouts``, default on; ``_layout_bytes.py``): bytes per step per rank of the zoo GPT under tensor
parallelism (with and without sequence parallelism) and GPipe pipeline parallelism for fp32, bf16, fp8-tensorwise
and MXFP8, measured on the ranks and against the closed-form model of ``_layout_bytes.predict``
(``model_worst_error``: 0 when every count is what the model says), and the model's bytes for TP=8, TP=8 + SP and
PP=16 on a Llama-3-8B-sized decoder (``at_scale``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = {"fp32": None, "fp32-hook": "float32", "bf16": "bfloat16", "fp8": "fp8_e4m3_tensorwise",
         "mxfp8": "mxfp8_e4m3"}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--lowprec-backend", default="eager", choices=["eager", "auto", "compiled"])
    p.add_argument("--no-layouts", action="store_true", help="skip the tensor/pipeline-parallel byte counts")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set by the launcher for the workers
    return p.parse_args(argv)


def fsdp2_allgather_bytes(world_size: int, steps: int = 3) -> dict[str, Any]:
    """FSDP2 weight all-gather bytes received per rank per step and step time, for the same MLP: float32 gathers
    (fp8-tensorwise recipe, the GEMM quantizes) vs low-precision gathers of fp8 codes and MXFP8 codes + scales.

    Bytes come from ``lowprec.distributed.allgather_bytes`` (every byte FSDP2's all-gather hands this rank,
    its own shard included); a step is forward + backward (FSDP2 gathers again in backward after resharding)."""
    import torch

    from lowprec import convert, recipes
    from lowprec.distributed import allgather_bytes, shard_model

    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    out: dict[str, Any] = {}
    for name, recipe, lowp in (("float32 gather (fp8-tensorwise)", "fp8-tensorwise", False),
                               ("fp8 gather (fp8-tensorwise)", "fp8-tensorwise", True),
                               ("mxfp8 gather (mxfp8)", "mxfp8", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        r = recipes.get(recipe)
        model = shard_model(convert(model, r), r, lowp_all_gather=lowp)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times, gathered = [], []
        for _ in range(steps + 1):
            allgather_bytes(model, reset=True)
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            gathered.append(allgather_bytes(model, reset=True))
        out[name] = {"bytes_gathered_per_step": gathered[-1], "step_ms": 1e3 * statistics.median(times[1:])}
    base = out["float32 gather (fp8-tensorwise)"]["bytes_gathered_per_step"]
    for v in out.values():
        v["bytes_ratio_vs_fp32"] = base / v["bytes_gathered_per_step"]
    out["world_size"] = world_size
    return out


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lowprec.quant
    from lowprec.distributed._compress import compress_hook, ring_allreduce_bytes

    lowprec.quant.set_backend(args.lowprec_backend)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    runs: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        ddp = DDP(model)
        state = None
        if MODES[mode] is not None:
            state, hook = compress_hook(MODES[mode])
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        runs[mode] = {"ddp": ddp, "opt": opt, "state": state, "times": [], "param_bytes": nbytes,
                      "fp32_bytes": ring_allreduce_bytes(nbytes, world)}

    def step(r: dict[str, Any]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        r["opt"].zero_grad()
        torch.nn.functional.cross_entropy(r["ddp"](x), y).backward()
        r["opt"].step()
        return time.perf_counter() - t0

    order = list(runs)
    for i in range(args.warmup + args.steps):
        for mode in order[i % len(order):] + order[: i % len(order)]:  # rotating order
            dt = step(runs[mode])
            if i >= args.warmup:
                runs[mode]["times"].append(dt)

    fp32_bytes = runs[order[0]]["fp32_bytes"]
    out: dict[str, Any] = {"world_size": world, "params": runs[order[0]]["param_bytes"] // 4, "modes": {}}
    for mode, r in runs.items():
        st = r["state"]
        sent = r["fp32_bytes"] if st is None else st.bytes_sent
        out["modes"][mode] = {
            "spec": MODES[mode],
            "step_ms": 1e3 * statistics.median(r["times"]),
            "best_ms": 1e3 * min(r["times"]),
            "bytes_per_step": sent,
            "bytes_counted_by": "ring all-reduce formula (no hook)" if st is None else "hook state.bytes_sent",
            "bytes_ratio_vs_fp32": fp32_bytes / sent,
            "buckets": None if st is None else st.buckets,
        }
    base = out["modes"].get("fp32")
    if base:
        for m in out["modes"].values():
            m["step_ratio_vs_fp32"] = m["step_ms"] / base["step_ms"]
    out["fsdp2"] = fsdp2_allgather_bytes(world)
    if not args.no_layouts:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _layout_bytes

        out["tp_pp"] = _layout_bytes.measure(world)
    if "fp8" in out["modes"]:
        out["fp8_at_least_3.9x_fewer_bytes"] = out["modes"]["fp8"]["bytes_ratio_vs_fp32"] >= 3.9
    if rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=2))
    # models in reference cycles (DDP, FSDP2, DTensor modules, pipeline stages) freed while the interpreter and the
    # process group are alive, and no rank tearing down gloo while a peer still talks to it: otherwise a gloo
    # thread can end the rank with "terminate called without an active exception" (runs/_runner.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if "RANK" in os.environ:
        _worker(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lowprec.testing import torchrun

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv_out = [*(argv if argv is not None else sys.argv[1:]), "--out", str(out)]
        torchrun(Path(__file__).resolve(), *argv_out, nproc=args.nproc, timeout=900)
        result = json.loads(out.read_text())
    result["machine"] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
