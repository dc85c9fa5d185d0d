"""Cost of the silent-data-corruption checks (issue 19 section 3; docs/debugging.md), as one JSON object.

    PYTHONPATH=src python benchmarks/reliability_cost.py [--quick] [--steps N] [--repeats R]

Launches itself under torchrun (2 gloo ranks, 1 thread each) and trains zoo tasks under DDP with each check alone
on every step (weight checksums, reduced-gradient checksums, sampled replay), with all of them off, and with the
defaults (``[reliability]``: checksums every 100 steps, replay every 500).  Each variant is timed end to end
(``train()`` wall clock, median of the repeats) so a check's cost is ``(t_check@1 - t_off) / steps`` per check; the
overhead at the defaults is ``sum(cost_i / interval_i) / step``, reported next to the measured end-to-end ratio of
the default run to the unchecked one (which also carries the timing noise: its spread is the repeats' min-max).
A digest's throughput (bytes of weights hashed per second) is compared with this machine's memory copy
bandwidth, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("mlp-digits", "gpt-bytes")


def _variants() -> dict[str, Any]:
    from lowprec.reliability._config import ReliabilityConfig

    off = ReliabilityConfig(checksum_every=0, grad_check_every=0, replay_every=0)
    return {"off": off, "weights@1": ReliabilityConfig(checksum_every=1, grad_check_every=0, replay_every=0),
            "grads@1": ReliabilityConfig(checksum_every=0, grad_check_every=1, replay_every=0),
            "replay@1": ReliabilityConfig(checksum_every=0, grad_check_every=0, replay_every=1),
            "default": ReliabilityConfig()}


def _bandwidth() -> float:
    """Memory copy bandwidth of one thread (GB/s: bytes read + written), 64 MiB float32."""
    a = torch.empty(16 * 2**20)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def worker(store_dir: str, steps: int, repeats: int, tasks: tuple[str, ...]) -> None:
    import torch.distributed as dist

    from lowprec.reliability._config import DEFAULT_CHECK_EVERY, DEFAULT_REPLAY_EVERY
    from lowprec.reliability._digest import digests
    from lowprec.runs._config import ParallelConfig, RunConfig
    from lowprec.runs._parallel import init_world
    from lowprec.runs._runner import train
    from lowprec.runs._store import RunStore
    from lowprec.runs.zoo import get_task

    world = init_world("ddp")
    torch.set_num_threads(1)
    out: dict[str, Any] = {"world_size": world.size, "steps": steps, "repeats": repeats,
                           "intervals": {"weights": DEFAULT_CHECK_EVERY, "grads": DEFAULT_CHECK_EVERY,
                                         "replay": DEFAULT_REPLAY_EVERY}, "tasks": {}}
    with RunStore(Path(store_dir) / "runs.db") as store:
        for task in tasks:
            times: dict[str, list[float]] = {}
            warm = RunConfig(model=task, steps=min(steps, 20), eval_interval=min(steps, 20), threads=1,
                             parallel=ParallelConfig(strategy="ddp", world_size=world.size), group="warm-up",
                             store=str(store.path))
            train(warm, seed=99, store=store, world=world, progress=False)  # imports, allocations, first steps
            for rep in range(repeats):
                for name, rel in _variants().items():
                    cfg = RunConfig(model=task, steps=steps, eval_interval=steps, threads=1, reliability=rel,
                                    parallel=ParallelConfig(strategy="ddp", world_size=world.size),
                                    group=f"{task}/{name}", store=str(store.path))
                    dist.barrier()
                    t = time.perf_counter()
                    train(cfg, seed=rep, store=store, world=world, progress=False)
                    dist.barrier()
                    times.setdefault(name, []).append(time.perf_counter() - t)
            med = {k: statistics.median(v) for k, v in times.items()}
            step_ms = 1e3 * med["off"] / steps
            cost = {k: 1e3 * (med[f"{k}@1"] - med["off"]) / steps for k in ("weights", "grads", "replay")}
            overhead = sum(cost[k] / out["intervals"][k] for k in cost) / step_ms
            params = [p for p in get_task(task, seed=0).model.parameters()]
            nbytes = sum(p.numel() * p.element_size() for p in params)
            dt = min(_timed(lambda ps=params: digests(ps)) for _ in range(5))
            out["tasks"][task] = {
                "step_ms": round(step_ms, 3), "check_ms": {k: round(v, 3) for k, v in cost.items()},
                "check_over_step": {k: round(v / step_ms, 4) for k, v in cost.items()},
                "overhead_at_defaults_pct": round(100 * overhead, 3),
                "end_to_end_default_over_off": round(med["default"] / med["off"], 4),
                "end_to_end_spread": {k: [round(min(v), 3), round(max(v), 3)] for k, v in times.items()},
                "param_bytes": nbytes, "digest_GBps": round(nbytes / dt / 1e9, 3)}
    out["memcpy_GBps"] = round(_bandwidth(), 2)
    for t in out["tasks"].values():
        t["digest_over_memcpy"] = round(t["digest_GBps"] / out["memcpy_GBps"], 4)
    if world.is_main:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="mlp-digits only, 10 steps, 1 repeat (a smoke test)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("STORE_DIR", "TASKS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.steps, a.repeats, tuple(a.worker[1].split(",")))
        return
    from lowprec.testing import torchrun

    steps, repeats, tasks = (10, 1, ("mlp-digits",)) if a.quick else (a.steps, a.repeats, TASKS)
    with tempfile.TemporaryDirectory() as d:
        p = torchrun(__file__, "--steps", str(steps), "--repeats", str(repeats), "--worker", d, ",".join(tasks),
                     nproc=2, timeout=3600, env={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                                               os.environ.get("PYTHONPATH", "")])})
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    print(json.dumps(json.loads(line[len("RESULT "):]), indent=2))


if __name__ == "__main__":
    sys.exit(main())
