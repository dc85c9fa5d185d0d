"""Worker entry point for data-parallel runs: ``torchrun --nproc-per-node N -m lowprec.train CONFIG``.

``lowprec run CONFIG`` launches this itself when ``parallel.world_size`` > 1; use it directly to launch your own
jobs (multi-node included: pass torchrun's ``--nnodes``/``--rdzv-endpoint`` as usual).  CONFIG is a run config
(TOML, or the JSON that ``lowprec run`` writes).  Without ``--run-id``, the run id is derived from torchrun's
``--rdzv-id`` and the seed, so an elastic restart continues the same run; with the default rendezvous id
("none"), every launch starts a new run.

A worker never outlives its torchrun agent: torchrun starts each worker in a session of its own, so when torchrun
itself is killed (SIGKILL, the OOM killer) nothing would stop the workers, which would go on training a run whose
launcher has marked it failed.  Under torchrun (``TORCHELASTIC_RUN_ID`` set) a worker therefore asks Linux for
SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and, where prctl is not available, a daemon thread
checks once a second that ``os.getppid()`` is still the agent and sends itself SIGTERM otherwise.  SIGTERM keeps
its default action in workers (the process ends at once, even inside a collective); the launcher, or the store's
dead-process rule, records the run as failed.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence

import torch.distributed as dist

from ._errors import UsageError
from .runs._config import RunConfig, load
from .runs._mesh import layout_of
from .runs._parallel import World, init_world
from .runs._runner import train
from .runs._store import RunStore


def _config(path: str, store: str | None) -> RunConfig:
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                config = RunConfig.from_dict(json.load(f), where=path)
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read config {path!r}: {e}") from None
    else:
        config = load(path)
    if store:
        config = RunConfig.from_dict({**config.to_dict(), "store": store}, where=path)
    if config.parallel.strategy == "single":
        raise UsageError(f"{path}: parallel.strategy is 'single'; set it to 'ddp', 'fsdp2' or 'hsdp' to train "
                         "under torchrun")
    return config


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0


def _set_parent_death_signal(sig: int) -> bool:
    """Linux: deliver ``sig`` to this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """End this process with ``sig`` when its parent (the torchrun agent) dies: ``PR_SET_PDEATHSIG`` on Linux,
    else a daemon thread that polls ``os.getppid()``.  Not covered: a parent that died before this call (the
    first milliseconds of the worker), whose orphan then looks like a child of the reaper."""
    parent = os.getppid()
    if _set_parent_death_signal(sig):
        if os.getppid() != parent:  # pragma: no cover - the parent died during the call
            os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="lowprec-parent-watch", daemon=True).start()


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
    p.add_argument("--allow-restart", action="store_true",
                   help="when the run exists but has no usable checkpoint, start it over from step 0 (deleting its "
                        "recorded steps) instead of refusing; elastic restarts of the same torchrun job always may")
    args = p.parse_args(argv)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by a torchrun agent: stop when it does
        die_with_parent()
    try:
        config = _config(args.config, args.store)
        world = init_world(config.parallel.strategy, config.parallel.backend, config.parallel.mesh_shape,
                           layout=layout_of(config.parallel))
    except ValueError as e:
        print(f"lowprec: error: {e}", file=sys.stderr)
        return 2
    try:
        with RunStore(config.store) as store:
            for seed in [args.seed] if args.seed is not None else list(config.seeds):
                train(config, seed=seed, store=store, world=world, progress=not args.quiet,
                      run_id=args.run_id or _run_id(world, seed), allow_restart=args.allow_restart)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
