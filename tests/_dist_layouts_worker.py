"""Under torchrun (2 ranks): the layout runs of tests/test_dist_layouts.py in one launch, and a task for its
resume test.

argv: STORE.  Trains the zoo GPT (``GPT``, ``STEPS`` steps) with ``lowprec.runs._runner.train`` on the meshes
``lowprec run`` builds: groups "tp2/<recipe>" (``parallel.tp = 2``) and "pp2/<recipe>" (``parallel.pp = 2``, 1F1B
over 4 microbatches) for fp8-tensorwise and mxfp8, seed 0.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowprec import recipes
from lowprec.runs import zoo
from lowprec.runs._config import ParallelConfig, RunConfig
from lowprec.runs._mesh import layout_of
from lowprec.runs._parallel import init_world
from lowprec.runs._runner import train
from lowprec.runs._store import RunStore
from lowprec.runs.zoo import Task, get_task

GPT = {"layers": 2, "d_model": 64, "heads": 4, "context": 16}
STEPS, BATCH = 30, 8
RECIPES = ("fp8-tensorwise", "mxfp8")
LAYOUTS = {
    "tp2": ParallelConfig(strategy="ddp", world_size=2, tp=2),
    "pp2": ParallelConfig(strategy="ddp", world_size=2, pp=2, microbatches=4),
}


def config(recipe: str, parallel: ParallelConfig, store: str, **kw: Any) -> RunConfig:
    """The run config every layout of the test trains (the single-process ones too)."""
    base: dict[str, Any] = dict(model="gpt-bytes", model_options=dict(GPT), steps=STEPS, batch_size=BATCH,
                                eval_interval=STEPS // 2, threads=1, recipe=recipes.get(recipe), parallel=parallel,
                                store=store)
    base.update(kw)
    return RunConfig(**base)


@zoo.task
def gpt_crash_at(*, seed: int, batch_size: int | None = None, steps: tuple[int, ...] = (), marker: str = "",
                 **options: Any) -> Task:
    """The zoo GPT whose batch function raises at each of ``steps`` (0-based) once: marker files
    ``<marker>.<step>`` record the failures already injected, so each resume gets past one of them."""
    task = get_task("gpt-bytes", seed=seed, batch_size=batch_size, **options)

    def batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = Path(f"{marker}.{s}")
        if s in steps and not m.exists():
            m.write_text("failed once")
            raise RuntimeError(f"injected failure at step {s}")
        return task.train_batch(s)  # type: ignore[no-any-return]

    return dataclasses.replace(task, name="gpt_crash_at", train_batch=batch)


def main() -> None:
    store_path = sys.argv[1]
    with RunStore(store_path) as store:
        for name, par in LAYOUTS.items():
            world = init_world("ddp", layout=layout_of(par))
            for r in RECIPES:
                train(config(r, par, store_path, group=f"{name}/{r}"), seed=0, store=store, world=world,
                      progress=False)
    dist.barrier()  # no rank tears down gloo while a peer may still talk to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
