"""``lowprec run`` for a data-parallel config: check everything, then launch torchrun on this node.

The parent process validates the layout before any worker starts (batch divisible by the world size, backend
available, rendezvous port free), picks the run id, writes the resolved config next to the store, and runs::

    python -m torch.distributed.run --nproc-per-node W --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        --max-restarts R -m lowprec.train CONFIG.json --seed S --run-id ID --store STORE

Workers (``lowprec.train``) record into that run (rank 0 writes scalars; any rank writes its own failure).  With
``max_restarts``, torchrun restarts a failed worker group and the workers continue the run from its newest
checkpoint.  If torchrun gives up, the parent marks the run failed with the workers' reasons.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from ._atomic import atomic_write_text
from ._config import RunConfig
from ._parallel import resolve_backend
from ._store import RunStore


class RunFailed(RuntimeError):
    """A run (or a worker of it) failed; the reason is recorded in the run store."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preflight(config: RunConfig, batch_size: int) -> int:
    """Raise ValueError for a layout that cannot work; returns the rendezvous port to use."""
    p = config.parallel
    if batch_size % p.world_size:
        raise ValueError(f"batch_size {batch_size} is not divisible by parallel.world_size {p.world_size}; each "
                         f"rank trains on batch_size / world_size rows: use a multiple of {p.world_size}")
    resolve_backend(p.backend)
    if p.master_port is None:
        return _free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", p.master_port))
        except OSError:
            raise ValueError(f"parallel.master_port {p.master_port} is in use on this machine; pick another port "
                             "or leave master_port unset to use a free one") from None
    return p.master_port


def launch(config: RunConfig, *, seed: int, batch_size: int, store: RunStore, resume: str | None = None,
           quiet: bool = False) -> str:
    """Train one seed of ``config`` on ``parallel.world_size`` torchrun workers; returns the run id."""
    port = preflight(config, batch_size)
    run_id = resume or uuid.uuid4().hex[:12]
    cfg_path = Path(config.store).parent / "launch" / f"{run_id}.json"
    atomic_write_text(cfg_path, json.dumps(config.to_dict(), indent=2))
    p = config.parallel
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={p.world_size}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           f"--max-restarts={p.max_restarts}", "-m", "lowprec.train", str(cfg_path), "--seed", str(seed),
           "--run-id", run_id, "--store", str(store.path)] + (["--quiet"] if quiet else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads or os.environ.get("OMP_NUM_THREADS", "1")))
    rc = subprocess.run(cmd, env=env).returncode
    known = {r.run_id: r for r in store.list_runs()}
    if rc == 0 and run_id in known and known[run_id].status == "completed":
        return run_id
    if run_id not in known:
        raise RunFailed(f"run {run_id} failed: torchrun exited with status {rc} before the run was recorded "
                        "(see the workers' output above)")
    reason = _failure_reason(store, run_id, known[run_id].error, rc)
    if known[run_id].status != "completed":
        store.finish_run(run_id, status="failed", error=reason)
    raise RunFailed(f"run {run_id} failed: {reason}")


def _failure_reason(store: RunStore, run_id: str, main_error: str | None, rc: int) -> str:
    """Every rank's recorded reason, root causes first: a rank that lost its peer ("Connection closed by peer",
    a consequence of another rank's crash) is listed after the ranks that failed on their own."""
    found = [(e["payload"].get("rank"), e["payload"].get("error")) for e in store.events(run_id, kind="rank_failure")]
    if main_error:
        found.append((0, main_error))
    consequence = ("Connection closed by peer", "remote worker crashing", "Connection reset")
    found.sort(key=lambda re: any(c in str(re[1]) for c in consequence))
    parts = [f"rank {r}: {e}" for r, e in found]
    return "; ".join(parts) if parts else f"torchrun exited with status {rc}"
