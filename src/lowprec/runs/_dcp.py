"""Sharded checkpoints for FSDP2/HSDP runs with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state (no rank ever holds the full state), into
``step-<NNNNNNNN>.dcp.tmp/``; rank 0 adds ``extra.pt`` (loss scaler, optimizer-wrapper state, RNG, run id) and a
``MANIFEST.json`` with the SHA-256 of every file, then renames the directory to ``step-<NNNNNNNN>.dcp``: a
checkpoint directory without the ``.tmp`` suffix is complete, and one whose files do not match their checksums
is reported and skipped.  Loading goes through DCP's resharding, so a run saved on W ranks resumes on any other
number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ._atomic import atomic_write_text

_NAME = re.compile(r"^step-(\d{8})\.dcp$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def list_sharded(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete sharded checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def save_sharded(directory: Path, step: int, model: torch.nn.Module, optimizer: Any, extra: dict[str, Any], *,
                 keep: int, is_main: bool) -> Path:
    """Collective: every rank calls it.  ``optimizer`` is the ``LowPrecisionOptimizer``; its wrapped optimizer's
    state goes through DCP, the wrapper's own state into ``extra``."""
    final = directory / f"step-{step:08d}.dcp"
    tmp = directory / f"step-{step:08d}.dcp.tmp"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer.optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    if is_main:
        wrapper = {**optimizer.state_dict(), "optimizer": None}
        torch.save({**extra, "optimizer_wrapper": wrapper}, tmp / "extra.pt")
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_text(tmp / "MANIFEST.json", json.dumps({"step": step, "sha256": files}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in list_sharded(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def verify(path: Path) -> None:
    """ValueError naming the file when a sharded checkpoint is incomplete or altered."""
    try:
        manifest = json.loads((path / "MANIFEST.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {str(path)!r} has no readable MANIFEST.json ({e})") from None
    for name, want in manifest["sha256"].items():
        f = path / name
        if not f.is_file() or _sha256(f) != want:
            raise ValueError(f"checkpoint {str(path)!r} is corrupted ({name}: SHA-256 checksum mismatch)")


def load_sharded(path: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Collective: load ``path`` into the (sharded) ``model`` and ``optimizer``; returns the extra state."""
    state: dict[str, Any] = {"model": get_model_state_dict(model),
                             "optim": get_optimizer_state_dict(model, optimizer.optimizer)}
    single = not dist.is_initialized()
    with warnings.catch_warnings():  # DCP warns on every single-process load, which is what resuming 2 -> 1 is
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=single)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer.optimizer, state["optim"])
    extra: dict[str, Any] = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(extra["optimizer_wrapper"])
    return extra
