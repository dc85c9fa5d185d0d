"""Worker entry point for data-parallel runs: ``torchrun --nproc-per-node N -m lowprec.train CONFIG``.

``lowprec run CONFIG`` launches this itself when ``parallel.world_size`` > 1; use it directly to launch your own
jobs (multi-node included: pass torchrun's ``--nnodes``/``--rdzv-endpoint`` as usual).  CONFIG is a run config
(TOML, or the JSON that ``lowprec run`` writes).  Without ``--run-id``, the run id is derived from torchrun's
``--rdzv-id`` and the seed, so an elastic restart continues the same run; with the default rendezvous id
("none"), every launch starts a new run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import uuid
from collections.abc import Sequence

import torch.distributed as dist

from .runs._config import RunConfig, load
from .runs._parallel import World, init_world
from .runs._runner import train
from .runs._store import RunStore


def _config(path: str, store: str | None) -> RunConfig:
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                config = RunConfig.from_dict(json.load(f), where=path)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read config {path!r}: {e}") from None
    else:
        config = load(path)
    if store:
        config = RunConfig.from_dict({**config.to_dict(), "store": store}, where=path)
    if config.parallel.strategy == "single":
        raise ValueError(f"{path}: parallel.strategy is 'single'; set it to 'ddp', 'fsdp2' or 'hsdp' to train "
                         "under torchrun")
    return config


def _run_id(world: World, seed: int) -> str:
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if rdzv and rdzv != "none":
        return hashlib.sha256(f"{rdzv}/{seed}".encode()).hexdigest()[:12]
    return str(world.broadcast(uuid.uuid4().hex[:12]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowprec.train", description=__doc__.split("\n\n")[0])
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--seed", type=int, help="train this seed only (default: every seed of the config)")
    p.add_argument("--run-id", help="the run to create, or to continue when it exists")
    p.add_argument("--store", help="run store path (default: the config's)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        config = _config(args.config, args.store)
        world = init_world(config.parallel.strategy, config.parallel.backend, config.parallel.mesh_shape)
    except ValueError as e:
        print(f"lowprec: error: {e}", file=sys.stderr)
        return 2
    try:
        with RunStore(config.store) as store:
            for seed in [args.seed] if args.seed is not None else list(config.seeds):
                train(config, seed=seed, store=store, world=world, progress=not args.quiet,
                      run_id=args.run_id or _run_id(world, seed))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
