"""Training checkpoints: written atomically, verified by a SHA-256 checksum when read.

File layout: one header line ``lowprec-checkpoint v1 <sha256 hex of the payload>\\n`` followed by the payload, a
``torch.save`` of the state dict.  A truncated or altered file fails the checksum and is reported, never loaded.
Checkpoints of a run live in ``<store dir>/checkpoints/<run id>/step-<NNNNNNNN>.ckpt``; the newest ``keep`` are
kept.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

import torch

from ._atomic import atomic_write_bytes

_MAGIC = b"lowprec-checkpoint v1 "
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")


def checkpoint_dir(store_path: str | Path, run_id: str) -> Path:
    """Where the checkpoints of ``run_id`` go, next to the run store."""
    return Path(store_path).parent / "checkpoints" / run_id


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` (atomically) and delete all but the newest ``keep``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    path = atomic_write_bytes(directory / f"step-{step:08d}.ckpt", header + payload)
    for old in list_checkpoints(directory)[:-keep]:
        old[1].unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint; ``ValueError`` naming the file when it is unreadable or corrupted."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
    head, sep, payload = data.partition(b"\n")
    if not sep or not head.startswith(_MAGIC):
        raise ValueError(f"{str(path)!r} is not a lowprec checkpoint (bad header)")
    want = head[len(_MAGIC):].decode("ascii", "replace")
    if hashlib.sha256(payload).hexdigest() != want:
        raise ValueError(f"checkpoint {str(path)!r} is corrupted (SHA-256 checksum mismatch)")
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {str(path)!r} does not hold a state dict")
    return state


def latest_valid(directory: Path) -> tuple[int, dict[str, Any], list[str]]:
    """The newest checkpoint that verifies: (step, state, problems with newer files that did not).

    Raises ``ValueError`` when there is none.
    """
    problems: list[str] = []
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return step, load_checkpoint(path), problems
        except ValueError as e:
            problems.append(str(e))
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise ValueError(f"no usable checkpoint in {str(directory)!r}{detail}; the run cannot be resumed")
