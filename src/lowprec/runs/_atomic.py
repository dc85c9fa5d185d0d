"""Atomic file writes: a reader sees the old file or the new one, never a torn mix, even after a crash.

The bytes go to a temporary file in the same directory (same file system), are flushed and fsync'ed, and the
temporary file is renamed over the target with ``os.replace`` (atomic on POSIX); the directory is fsync'ed so the
rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from .._errors import UsageError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path.  Raises ``ValueError`` when it cannot be written."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise UsageError(f"cannot write {str(target)!r}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the mode open() would have
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise UsageError(f"cannot write {str(target)!r}: {e.strerror or e}") from None
        raise
    with contextlib.suppress(OSError):  # some file systems refuse O_RDONLY directory fsync
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """``atomic_write_bytes`` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))
