"""Under torchrun (2 ranks): the data-parallel runs of tests/test_dist_numerics.py in one launch.

argv: STORE.  Groups: "loc/<strategy>/<fault>" (a fault injected on rank 1 only at batch 3: ``overflow_at``, a
forward overflow, or ``nan_grad_at``, a NaN in one backward gradient; DDP and FSDP2), "loc/ddp/first_step"
(``nan_grad_at`` at batch 0 under fp8-delayed, whose first step scales with the global amax) and "fallback/ddp" (the
``tiny_input`` run of tests/test_fallback.py under DDP, with the same fallback policy, each rank training on the
same rows: ``copies = 2``).  Each rank then writes how many ``nn.Module`` objects are still alive to
``STORE.rank<r>.alive``.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lowprec import recipes
from lowprec.recipes import Fallback
from lowprec.runs._config import ParallelConfig, RunConfig, StatsConfig
from lowprec.runs._parallel import init_world
from lowprec.runs._runner import train
from lowprec.runs._store import RunStore

FAULT_STEP = 3
POLICY = Fallback(underflow_pct=50, sqnr_db=10, patience=2, to="bf16")


def main() -> None:
    store_path = sys.argv[1]
    world = init_world("ddp")
    with RunStore(store_path) as store:
        for strategy in ("ddp", "fsdp2"):
            for fault in ("overflow_at", "nan_grad_at"):
                cfg = RunConfig(model=f"_faulty_tasks:{fault}", model_options={"step": FAULT_STEP, "rank": 1},
                                steps=8, eval_interval=4, threads=1, recipe=recipes.get("fp8-tensorwise"),
                                parallel=ParallelConfig(strategy=strategy, world_size=2), store=store_path,
                                group=f"loc/{strategy}/{fault}")
                train(cfg, seed=0, store=store, world=dataclasses.replace(world, strategy=strategy), progress=False)
                print(f"rank {world.rank}: {cfg.group} done", flush=True)
        cfg = RunConfig(model="_faulty_tasks:nan_grad_at", model_options={"step": 0, "rank": 1}, steps=4,
                        eval_interval=4, threads=1, recipe=recipes.get("fp8-delayed"),
                        parallel=ParallelConfig(strategy="ddp", world_size=2), store=store_path,
                        group="loc/ddp/first_step")
        train(cfg, seed=0, store=store, world=world, progress=False)
        print(f"rank {world.rank}: {cfg.group} done", flush=True)
        recipe = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=POLICY)
        cfg = RunConfig(model="_faulty_tasks:tiny_input", model_options={"copies": 2}, batch_size=64, steps=16,
                        eval_interval=8, threads=1, recipe=recipe,
                        stats=StatsConfig(every=5), parallel=ParallelConfig(strategy="ddp", world_size=2),
                        store=store_path, group="fallback/ddp")
        train(cfg, seed=0, store=store, world=world, progress=False)
        print(f"rank {world.rank}: {cfg.group} done", flush=True)
    # train() frees its run's modules (they sit in reference cycles) before it returns: none is left to be freed
    # during interpreter shutdown, after the process group is gone
    alive = sum(isinstance(o, torch.nn.Module) for o in gc.get_objects())
    Path(f"{store_path}.rank{world.rank}.alive").write_text(str(alive))
    dist.barrier()  # no rank tears down gloo while a peer may still talk to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
