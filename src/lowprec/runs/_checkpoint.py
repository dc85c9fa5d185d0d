"""Training checkpoints: written atomically, verified by a SHA-256 checksum when read.

File layout: one header line ``lowprec-checkpoint v1 <sha256 hex of the payload>\\n`` followed by the payload, a
``torch.save`` of the state dict.  A truncated or altered file fails the checksum and is reported, never loaded.
Checkpoints of a run live in ``<store dir>/checkpoints/<run id>/step-<NNNNNNNN>.ckpt``, next to the store file
that holds the run (never where the working directory or the run's saved config points), or for a PostgreSQL
store in its files folder (``RunStore.files_dir``: ``$LOWPREC_FILES_DIR``, else ``./lowprec-runs``); the newest
``keep`` are kept.  The payload is read with ``torch.load(weights_only=True)``, which unpickles only tensors and plain
containers, so a planted file cannot run code; which checkpoints a run may resume from at all is decided by
``_resume`` (the store records the digest of every checkpoint a run writes).
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .._errors import UsageError
from ._atomic import atomic_write_bytes

_MAGIC = b"lowprec-checkpoint v1 "
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")
_PARTIAL = re.compile(r"^(\.step-\d{8}\.ckpt\..+\.tmp|step-\d{8}\.dcp\.tmp)$")
_RUN_ID = re.compile(r"[0-9a-f]{12}")


def checkpoint_dir(store: Any, run_id: str) -> Path:
    """Where the checkpoints of ``run_id`` go: ``checkpoints/<run id>/`` in the store's ``files_dir`` (a
    ``RunStore``: the folder of its SQLite file, or the folder a PostgreSQL store keeps its files in), or in the
    folder of ``store`` given as the path of a store file.

    ``run_id`` must be a run id (12 lowercase hex characters): an id read from an altered store, such as
    ``../..`` or ``/abs/path``, would otherwise put checkpoints outside the store's folder."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"run id {run_id!r} is not a lowprec run id (12 lowercase hex characters); the run store "
                         "may have been altered")
    files_dir = getattr(store, "files_dir", None)
    return Path(files_dir if files_dir is not None else Path(store).parent) / "checkpoints" / run_id


def clean_partial(directory: Path) -> list[Path]:
    """Delete what an interrupted checkpoint write left in ``directory`` (``.step-N.ckpt.*.tmp`` files of
    ``atomic_write_bytes`` and ``step-N.dcp.tmp/`` folders of a sharded save); returns what was removed.  Call it
    only while no process writes checkpoints of this run (when a run is resumed)."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for p in sorted(directory.iterdir()):
        if _PARTIAL.match(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def checkpoint_digest(path: Path) -> str:
    """The SHA-256 (hex) of a checkpoint's payload, as its header records it (read without loading anything);
    ``ValueError`` when the file has no lowprec header."""
    try:
        with open(path, "rb") as f:
            head = f.readline(len(_MAGIC) + 80)
    except OSError as e:
        raise UsageError(f"cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
    if not head.startswith(_MAGIC) or not head.endswith(b"\n"):
        raise UsageError(f"{str(path)!r} is not a lowprec checkpoint (bad header)")
    return head[len(_MAGIC):-1].decode("ascii", "replace")


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` (atomically) and delete all but the newest ``keep`` up to
    ``step``.  Files of later steps, left from before the run was resumed at an earlier step, are left alone (the
    run overwrites them when it gets there): counting them would delete the checkpoints it just wrote."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    path = atomic_write_bytes(directory / f"step-{step:08d}.ckpt", header + payload)
    for old in [c for c in list_checkpoints(directory) if c[0] <= step][:-keep]:
        old[1].unlink(missing_ok=True)  # newer files (left from before a resume) are not counted
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
        raise UsageError(f"cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
    head, sep, payload = data.partition(b"\n")
    if not sep or not head.startswith(_MAGIC):
        raise UsageError(f"{str(path)!r} is not a lowprec checkpoint (bad header)")
    want = head[len(_MAGIC):].decode("ascii", "replace")
    if hashlib.sha256(payload).hexdigest() != want:
        raise UsageError(f"checkpoint {str(path)!r} is corrupted (SHA-256 checksum mismatch)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a payload with a valid checksum that torch cannot (or refuses to) load
        raise UsageError(f"checkpoint {str(path)!r} passes its checksum but cannot be loaded: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, dict):
        raise UsageError(f"checkpoint {str(path)!r} does not hold a state dict")
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
    raise UsageError(f"no usable checkpoint in {str(directory)!r}{detail}; the run cannot be resumed")
