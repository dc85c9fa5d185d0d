"""``device = "xla"`` in run configs: train on torch_xla's lazy XLA device (PJRT: a TPU, or the CPU with
``PJRT_DEVICE=CPU``).

On an XLA tensor every operation is recorded into a graph that XLA compiles (once per distinct graph) and runs
when a value is needed; lowprec's quantizers trace into that graph (``quant._backend.traces_lazily``).  The
runner ends each optimizer step with ``torch_xla.sync`` (``xm.mark_step``), so every step is the same graph and is
compiled once; the step's loss and gradient norm, which the run records, are read back to the host as on any
device.  What differs from eager CPU, and by how much, is docs/xla.md's "PyTorch/XLA" section.

torch_xla is imported only here and only for such a run.  It is checked for before any work (``check``: a
UsageError naming ``device`` and the fix); a run config names ``device = "xla"`` only with one process
(``parallel.world_size = 1``), which ``check_layout`` enforces when the config is built: data parallelism through
torch_xla's own collectives is not wired into the runner.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

from .._errors import UsageError

if TYPE_CHECKING:
    import torch


def check_layout(framework: str, world_size: int, strategy: str) -> None:
    """Refuse what ``device = "xla"`` cannot run with: another framework than torch, or more than one process."""
    if framework != "torch":
        raise UsageError(f"device = \"xla\" is a PyTorch/XLA device; got framework = {framework!r}: set framework = "
                         "\"torch\" (a JAX run uses JAX's own XLA backend with device = \"auto\")")
    if world_size > 1 or strategy != "single":
        raise UsageError(f"device = \"xla\" trains in one process; got parallel.strategy = {strategy!r} with "
                         f"world_size = {world_size}: set parallel.strategy = \"single\" (world_size = 1), or "
                         "device = \"cpu\" / \"cuda\" for data parallelism")


def check() -> None:
    """UsageError unless torch_xla can be imported (without importing it)."""
    if importlib.util.find_spec("torch_xla") is None:
        import torch

        raise UsageError(f"device = \"xla\" needs torch_xla, which is not installed here (torch {torch.__version__}): "
                         "install the torch_xla release matching your torch (pip install torch_xla; lowprec's "
                         "`make test-xla` builds .venv-xla with torch 2.9.0 + torch_xla 2.9.0), or set device = "
                         "\"cpu\" or \"auto\"")


def device() -> torch.device:
    """torch_xla's default device, with its runtime started (``check`` first).  Started before the process's
    first backward: autograd sizes its per-device queues then, and an XLA backward after a CPU one in a process
    whose XLA runtime was not up yet fails inside autograd's engine."""
    check()
    import torch
    import torch_xla

    d = torch_xla.device()
    torch.zeros(1, device=d)
    return d  # type: ignore[no-any-return]


def mark_step() -> None:
    """End of an optimizer step: cut the lazy graph here and launch it (``xm.mark_step``)."""
    import torch_xla

    torch_xla.sync()


def record(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with what an XLA run adds to ``hardware``: the torch_xla version and the PJRT device kind."""
    import torch_xla.runtime as xr

    hw = manifest.setdefault("hardware", {})
    hw["torch_xla"] = importlib.metadata.version("torch_xla")
    hw["xla_device"] = str(xr.device_type())
    return manifest
