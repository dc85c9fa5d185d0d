"""Sharded checkpoints for FSDP2/HSDP runs with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of the model and optimizer state (no rank ever holds the full state), into
``step-<NNNNNNNN>.dcp.tmp/``; rank 0 adds ``extra.pt`` (loss scaler, optimizer-wrapper state, RNG, run id) and a
``MANIFEST.json`` with the SHA-256 of every file, then renames the directory to ``step-<NNNNNNNN>.dcp``: a
checkpoint directory without the ``.tmp`` suffix is complete, and one whose files do not match their checksums
is reported and skipped.  Loading goes through DCP's resharding, so a run saved on W ranks resumes on any other
number of ranks.

Loading never unpickles arbitrary objects.  DCP itself reads ``.metadata`` with ``pickle.load`` and the non-tensor
entries of a state dict (optimizer hyper-parameters) with ``torch.load(weights_only=False)``: either would run code
planted in a crafted checkpoint.  Here ``.metadata`` is read by an unpickler that admits only the classes DCP's
metadata is made of (``_MetadataUnpickler``), and the non-tensor entries with ``weights_only=True``
(``_SafeLoadPlanner``).  Before any of that, ``verify`` checks that ``MANIFEST.json`` lists every file of the
directory and that each matches its SHA-256, and the runner loads only a checkpoint whose manifest digest the run
store recorded when the run wrote it (``_resume``).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .._errors import UsageError
from ._atomic import atomic_write_text

_NAME = re.compile(r"^step-(\d{8})\.dcp$")
_MANIFEST = "MANIFEST.json"

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: a global outside the classes its metadata is built from
    (dataclasses of ``torch.distributed.checkpoint``, ``torch.Size``, dtypes, layouts, paths) is refused, so a
    crafted file cannot name ``os.system`` or any other callable."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UsageError(f"{path} does not hold checkpoint metadata")
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads the non-tensor entries (saved with ``torch.save``) with
    ``weights_only=True``: plain numbers, strings and containers, never an arbitrary object."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: Path) -> Metadata:
    """The ``.metadata`` of a sharded checkpoint, read without running code (``ValueError`` when it cannot be)."""
    try:
        return _SafeReader(str(path)).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise UsageError(f"checkpoint {str(path)!r} has unreadable or unsafe metadata ({e})") from None


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
        atomic_write_text(tmp / _MANIFEST, json.dumps({"step": step, "sha256": files}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in [c for c in list_sharded(directory) if c[0] <= step][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def manifest_digest(path: Path) -> str:
    """SHA-256 (hex) of a sharded checkpoint's ``MANIFEST.json``: what the run store records for it (the manifest
    holds every file's SHA-256, so this one digest pins the whole directory)."""
    try:
        return _sha256(path / _MANIFEST)
    except OSError as e:
        raise UsageError(f"checkpoint {str(path)!r} has no readable {_MANIFEST} ({e.strerror or e})") from None


def verify(path: Path) -> None:
    """ValueError naming the file when a sharded checkpoint is incomplete or altered: its manifest must list
    every file of the directory (``.metadata``, the shards, ``extra.pt``), each with a matching SHA-256, and its
    metadata must read without running code."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
        listed = manifest["sha256"]
        if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
            raise TypeError("sha256 must map file names to hex digests")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
        raise UsageError(f"checkpoint {str(path)!r} has no readable {_MANIFEST} ({e})") from None
    present = {p.name for p in path.iterdir()} - {_MANIFEST}
    for name in sorted(present - set(listed)):
        raise UsageError(f"checkpoint {str(path)!r} holds {name!r}, which its {_MANIFEST} does not list")
    for name in (".metadata", "extra.pt"):
        if name not in listed:
            raise UsageError(f"checkpoint {str(path)!r} is incomplete ({_MANIFEST} lists no {name})")
    for name, want in listed.items():
        f = path / name
        if "/" in name or name in ("", ".", "..") or not f.is_file() or f.is_symlink() or _sha256(f) != want:
            raise UsageError(f"checkpoint {str(path)!r} is corrupted ({name}: SHA-256 checksum mismatch)")
    read_metadata(path)


def load_sharded(path: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Collective: load ``path`` into the (sharded) ``model`` and ``optimizer``; returns the extra state."""
    state: dict[str, Any] = {"model": get_model_state_dict(model),
                             "optim": get_optimizer_state_dict(model, optimizer.optimizer)}
    single = not dist.is_initialized()
    with warnings.catch_warnings():  # DCP warns on every single-process load, which is what resuming 2 -> 1 is
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafeLoadPlanner(), no_dist=single)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer.optimizer, state["optim"])
    extra: dict[str, Any] = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(extra["optimizer_wrapper"])
    return extra
