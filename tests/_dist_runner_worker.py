"""Under torchrun (2 ranks): train the parity configs of tests/test_dist_runner.py in one launch.

argv: STORE.  Runs go to groups "dup/<recipe>" (duplicated batches: the same arithmetic as one process) and
"plain/fp32" (a normal split batch).
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from lowprec import recipes
from lowprec.runs._config import ParallelConfig, RunConfig
from lowprec.runs._parallel import init_world
from lowprec.runs._runner import train
from lowprec.runs._store import RunStore

RECIPES = ("fp32", "bf16-sr", "fp8-tensorwise", "fp8-delayed")


def main() -> None:
    store_path = sys.argv[1]
    world = init_world("ddp")
    par = ParallelConfig(strategy="ddp", world_size=2)
    with RunStore(store_path) as store:
        for r in RECIPES:
            cfg = RunConfig(model="_faulty_tasks:duplicated", model_options={"copies": 2}, batch_size=64, steps=30,
                            eval_interval=10, threads=1, recipe=recipes.get(r), parallel=par, group=f"dup/{r}",
                            store=store_path)
            train(cfg, seed=0, store=store, world=world, progress=False)
        cfg = RunConfig(model="mlp-digits", steps=30, eval_interval=10, threads=1, parallel=par, group="plain/fp32",
                        store=store_path)
        train(cfg, seed=0, store=store, world=world, progress=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
