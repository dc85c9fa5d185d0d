"""Under torchrun (2, 3 or 4 ranks): the fault matrix (``_fault_matrix.SCENARIOS`` of this world size) and the clean
zoo runs, in one launch.  argv: STORE MODE ("matrix" or "clean")."""

from __future__ import annotations

import dataclasses
import sys

import torch.distributed as dist

from lowprec.reliability import Fault
from lowprec.reliability._config import ReliabilityConfig
from lowprec.runs._config import ParallelConfig, RunConfig
from lowprec.runs._parallel import init_world
from lowprec.runs._runner import train
from lowprec.runs._store import RunStore

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _fault_matrix import CHECKSUM_ONLY, CLEAN_TASKS, SCENARIOS  # noqa: E402

CHECKS = ReliabilityConfig(fingerprints=True, replay_every=1, grad_check_every=1, checksum_every=1,
                           on_persistent="stop", on_sdc="stop")
CHECKSUMS = dataclasses.replace(CHECKS, replay_every=0, grad_check_every=0)


def main() -> None:
    store_path, mode = sys.argv[1], sys.argv[2]
    world = init_world("ddp")
    with RunStore(store_path) as store:
        if mode == "matrix":
            for sc in SCENARIOS:
                if sc.world != world.size:
                    continue
                checks = CHECKSUMS if sc.reason == CHECKSUM_ONLY else CHECKS
                cfg = RunConfig(model="mlp-digits", steps=10, eval_interval=10, threads=1, batch_size=60,
                                parallel=ParallelConfig(strategy=sc.strategy, world_size=world.size,
                                                        mesh_shape=sc.mesh),
                                faults=(Fault.from_dict(sc.fault),), reliability=checks, group=f"matrix/{sc.name}",
                                store=store_path)
                train(cfg, seed=0, store=store, world=dataclasses.replace(world, strategy=sc.strategy,
                                                                           mesh_shape=sc.mesh), progress=False)
        else:
            clean = dataclasses.replace(CHECKS, spike="robust", on_spike="continue")
            for name, (task, options) in CLEAN_TASKS.items():
                cfg = RunConfig(model=task, model_options=options, steps=8, eval_interval=8, threads=1,
                                parallel=ParallelConfig(strategy="ddp", world_size=world.size), reliability=clean,
                                group=f"clean/{name}", store=store_path)
                train(cfg, seed=0, store=store, world=world, progress=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
