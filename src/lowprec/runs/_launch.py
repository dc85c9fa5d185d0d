"""``lowprec run`` for a data-parallel config: check everything, then launch torchrun on this node.

The parent process validates the layout before any worker starts (batch divisible by the world size, backend
available, rendezvous port free), picks the run id, writes the resolved config next to the store, and runs::

    python -m torch.distributed.run --nproc-per-node W --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        --max-restarts R -m lowprec.train CONFIG.json --seed S --run-id ID --store STORE

Workers (``lowprec.train``) record into that run (rank 0 writes scalars; any rank writes its own failure).  With
``max_restarts``, torchrun restarts a failed worker group and the workers continue the run from its newest
checkpoint.  If torchrun gives up, the parent marks the run failed with the workers' reasons.

Stopping.  torchrun runs in its own session (process group), so a terminal's Ctrl-C reaches only this parent, and
this parent decides: SIGTERM, SIGINT and SIGHUP are forwarded to torchrun's process group (torchrun then stops its
workers: SIGTERM, and SIGKILL after its own timeout), a second signal, or torchrun still alive ``GRACE_S`` after
the first, sends SIGKILL; then the run is marked failed with the reason ("interrupted by SIGTERM").  Workers run
in sessions of their own (torchrun starts them so), so if torchrun itself dies (SIGKILL, OOM killer) they would
keep training: each worker asks Linux to SIGTERM it when its parent dies (``prctl(PR_SET_PDEATHSIG)``, see
``lowprec.train``), and this parent's ``finish_run(status="failed")`` revokes the run's attempt in the store, so a
worker that survives anyway fails at its next write instead of completing the run (see Fencing in ``_store``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from .._errors import UsageError
from ._atomic import atomic_write_text
from ._config import RunConfig
from ._parallel import resolve_backend
from ._store import _RUN_ID, FILES_ENV, RunRecord, RunStore, StoreCorrupt, StoreError

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals this parent forwards to torchrun's process group."""
GRACE_S = 60.0
"""After forwarding a signal, how long torchrun may take to stop its workers before its group gets SIGKILL."""
CONFIG_DIR_ENV = "LOWPREC_CONFIG_DIR"
"""The run config's folder (``RunConfig.config_dir``), passed to the workers: the one import location they add
while resolving ``model`` (``_runner.build_task``), as the parent process does."""


STOPPED = "stopped: "
"""How the error of a run a ``[reliability]`` policy stopped begins (``RunLifecycle.finish``)."""


class RunFailed(RuntimeError):
    """A run (or a worker of it) failed; the reason is recorded in the run store."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preflight(config: RunConfig, batch_size: int) -> int:
    """Raise ValueError for a layout that cannot work (a ``device`` this machine lacks included); returns the
    rendezvous port to use."""
    p = config.parallel
    if p.tp * p.pp == 1 and batch_size % p.world_size:  # TP/PP layouts: _mesh.check_model_layout
        raise UsageError(f"batch_size {batch_size} is not divisible by parallel.world_size {p.world_size}; each "
                         f"rank trains on batch_size / world_size rows: use a multiple of {p.world_size}")
    resolve_backend(p.backend, config.device)
    if p.master_port is None:
        return _free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", p.master_port))
        except OSError:
            raise UsageError(f"parallel.master_port {p.master_port} is in use on this machine; pick another port "
                             "or leave master_port unset to use a free one") from None
    return p.master_port


def launch(config: RunConfig, *, seed: int, batch_size: int, store: RunStore, resume: str | None = None,
           quiet: bool = False, allow_restart: bool = False) -> str:
    """Train one seed of ``config`` on ``parallel.world_size`` torchrun workers; returns the run id."""
    port = preflight(config, batch_size)
    if resume is not None and not _RUN_ID.fullmatch(resume):
        raise UsageError(f"resume must be a full run id (12 lowercase hex characters), got {resume!r}")
    run_id = resume or uuid.uuid4().hex[:12]
    cfg_path = store.files_dir / "launch" / f"{run_id}.json"  # next to the store, whatever the cwd
    atomic_write_text(cfg_path, json.dumps(worker_config(config), indent=2))
    p = config.parallel
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={p.world_size}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           f"--max-restarts={p.max_restarts}", "-m", "lowprec.train", str(cfg_path), "--seed", str(seed),
           "--run-id", run_id, "--store", store.location] + (["--quiet"] if quiet else []) + (
               ["--allow-restart"] if allow_restart else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads or os.environ.get("OMP_NUM_THREADS", "1")))
    env.pop(CONFIG_DIR_ENV, None)
    if store.path is None:  # a PostgreSQL store: the workers keep checkpoints in this store's files folder
        env[FILES_ENV] = str(store.files_dir)
    if config.config_dir:
        env[CONFIG_DIR_ENV] = config.config_dir
    rc, received = run_torchrun(cmd, env)
    rec = _find(store, run_id)
    stopped = rec is not None and rec.status == "failed" and (rec.error or "").startswith(STOPPED)
    if rec is not None and (rec.status in ("completed", "diverged") or stopped) and (rc == 0 or received):
        return run_id  # finished (a diverged run, or one a reliability policy stopped, is a result too)
    interrupted = (f"interrupted by {signal.Signals(received[0]).name} (forwarded to torchrun's process group)"
                   if received else None)
    if rec is None:
        raise RunFailed(f"run {run_id} failed: " + (interrupted or f"torchrun exited with status {rc}") +
                        " before the run was recorded (see the workers' output above)")
    reason = interrupted or _failure_reason(store, run_id, rec.error, rc)
    if rec.status not in ("completed", "diverged"):
        store.finish_run(run_id, status="failed", error=reason)  # not this object's claim: revokes the attempt
    raise RunFailed(f"run {run_id} failed: {reason}")


def worker_config(config: RunConfig) -> dict[str, Any]:
    """The config the workers read: ``config.to_dict()``, with ``parallel.backend = "auto"`` made "gloo" for a
    CPU run on a machine with CUDA (a worker's own "auto" would pick NCCL, which cannot train CPU tensors)."""
    data = config.to_dict()
    if config.parallel.backend == "auto" and resolve_backend("auto", config.device) != resolve_backend("auto"):
        data["parallel"] = {**data["parallel"], "backend": resolve_backend("auto", config.device)}
    return data


def _find(store: RunStore, run_id: str) -> RunRecord | None:
    """The run, or None when the workers never recorded it (a corrupt record is still an error)."""
    try:
        return store.get_run(run_id)
    except StoreCorrupt:
        raise
    except StoreError:
        return None


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: torchrun leads its own group
        except (ProcessLookupError, PermissionError):
            pass


def run_torchrun(cmd: list[str], env: dict[str, str], *, grace_s: float | None = None) -> tuple[int, list[int]]:
    """Run torchrun (``cmd``) in its own session and wait for it; (exit status, the signals forwarded to it).

    In the main thread, SIGTERM/SIGINT/SIGHUP (those not ignored) are forwarded to torchrun's process group while
    it runs; a second one, or ``grace_s`` (``GRACE_S``) without torchrun exiting, sends SIGKILL.  An exception in
    this process (or a signal it cannot forward) never leaves torchrun behind: its group is stopped first."""
    grace = GRACE_S if grace_s is None else grace_s
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        _signal_group(proc, signum if len(received) == 1 else signal.SIGKILL)

    saved: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED:
            previous = signal.getsignal(sig)
            if previous is not signal.SIG_IGN:  # e.g. SIGHUP under nohup stays ignored
                saved.append((sig, previous))
                signal.signal(sig, forward)
    try:
        deadline: float | None = None
        while True:
            try:
                return proc.wait(timeout=0.5), received
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + grace
                if deadline is not None and time.monotonic() > deadline:
                    _signal_group(proc, signal.SIGKILL)
    except BaseException:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        raise
    finally:
        for signum, previous in saved:
            signal.signal(signum, previous)


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
