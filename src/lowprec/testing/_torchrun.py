"""Launch a script under torchrun (real processes, gloo on CPU) and collect what every rank printed.

Used by lowprec's distributed tests and shipped so users can run the same parity checks on their own models.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: str | os.PathLike[str], *args: str, nproc: int = 2, timeout: float = 300,
             env: Mapping[str, str] | None = None, extra: Sequence[str] = (), check: bool = True,
             cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc ... script args`` on this machine.

    Every rank gets ``OMP_NUM_THREADS=1`` (2 processes on 2 cores) unless ``env`` says otherwise, and
    ``PYTHONFAULTHANDLER=1``: a rank killed by a signal (a C++ abort in a collective library, a segfault) prints
    the Python stack of every thread, so the failure says where it happened.  ``extra`` are additional torchrun
    options (e.g. ``--max-restarts 1``).  With ``check``, a non-zero exit raises ``AssertionError`` carrying the
    output of every rank.
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    src = str(Path(__file__).resolve().parents[2])  # make this lowprec importable in the workers
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, full_env.get("PYTHONPATH", "")) if p)
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *extra, str(script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun exited with {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n"
                             f"--- stderr\n{p.stderr[-12000:]}")
    return p
