"""Under torchrun (2 ranks): train the parity configs of tests/test_dist_runner.py in one launch.

argv: STORE.  Groups: "dup/<recipe>" (DDP on duplicated batches: the same arithmetic as one process),
"plain/<recipe>" and "fsdp2/<recipe>" (DDP and FSDP2 on normally split batches), and "comm/<name>" (DDP with a
gradient compression hook, COMM_SEEDS seeds of COMM_STEPS steps each, judged against a one-process baseline).
"""

from __future__ import annotations

import dataclasses
import sys

import torch.distributed as dist

from lowprec import recipes
from lowprec.quant import QuantSpec
from lowprec.recipes import GradComm
from lowprec.runs._config import ParallelConfig, RunConfig
from lowprec.runs._parallel import init_world
from lowprec.runs._runner import train
from lowprec.runs._store import RunStore

RECIPES = ("fp32", "bf16-sr", "fp8-tensorwise", "fp8-delayed")
COMM_STEPS, COMM_SEEDS = 120, (10, 11)
COMM = {
    "bf16": GradComm(spec=QuantSpec(elem="bfloat16")),
    "fp8": GradComm(spec=QuantSpec.named("fp8_e4m3_tensorwise")),
    "fp8-ef": GradComm(spec=QuantSpec.named("fp8_e4m3_tensorwise"), error_feedback=True),
}


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
        for strategy in ("ddp", "fsdp2"):
            for r in ("fp32", "fp8-delayed", "bf16-sr", "bf16-kahan"):
                cfg = RunConfig(model="mlp-digits", steps=30, eval_interval=10, threads=1, recipe=recipes.get(r),
                                parallel=ParallelConfig(strategy=strategy, world_size=2), store=store_path,
                                group=f"{'plain' if strategy == 'ddp' else strategy}/{r}")
                train(cfg, seed=0, store=store, world=dataclasses.replace(world, strategy=strategy), progress=False)
        for name, comm in COMM.items():
            recipe = dataclasses.replace(recipes.get("fp32"), grad_comm=comm)
            cfg = RunConfig(model="mlp-digits", steps=COMM_STEPS, eval_interval=COMM_STEPS // 4, threads=1,
                            recipe=recipe, parallel=par, group=f"comm/{name}", store=store_path)
            for seed in COMM_SEEDS:
                train(cfg, seed=seed, store=store, world=world, progress=False)
    dist.barrier()  # no rank tears down gloo while a peer may still talk to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
