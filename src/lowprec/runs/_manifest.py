"""The manifest of a run: everything besides the config that can change its numbers.

Versions (lowprec, torch, numpy, Python), the hardware (CPU model, GPU model when one is used, thread count),
the host, the git commit of the user's working directory when it is a git checkout (and whether it had
uncommitted changes), the recipe's hash, the data set's hash and description, the seed, and which direction is
better for each eval metric.  Two runs whose manifests differ only in the seed are repeats of one experiment;
anything else that differs is shown by the report as a possible cause.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info() -> dict[str, Any]:
    """What benchmarks record about the host: lowprec and Python versions, CPU model, CPU count and affinity."""
    return {
        "lowprec": __version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def git_state(directory: str | os.PathLike[str] = ".") -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout containing ``directory``, or None when there is none."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def build_manifest(*, seed: int, recipe_hash: str, data_hash: str, data_source: str,
                   metrics: Mapping[str, str], device: str = "cpu", config_dir: str | None = None) -> dict[str, Any]:
    """The manifest of one run (JSON-ready).  ``device``: the device type the run trained on ("cpu", "cuda"; a
    JAX run's platform), recorded as ``hardware.device`` (what the judge tells experiments apart by), with the
    GPU's name as ``hardware.gpu`` on CUDA.  ``config_dir``: the run config's folder (where a ``"module:function"``
    model was also looked for; ``lowprec run --resume`` looks there again), recorded when given."""
    import torch  # here, not at module level: cpu_model and git_state serve torch-free callers (track, benchmarks)

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    extra = {} if config_dir is None else {"config_dir": config_dir}
    return {
        **extra,
        "seed": seed,
        "recipe_hash": recipe_hash,
        "data_hash": data_hash,
        "data_source": data_source,
        "metrics": dict(metrics),
        "versions": {
            "lowprec": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "hardware": {
            "cpu": cpu_model(),
            "gpu": gpu,
            "device": device,
            "torch_threads": torch.get_num_threads(),
        },
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "executable": sys.executable},
        "git": git_state(),
    }
