"""Building lowprec's C kernels at first use: one shared library per source version, compiler flags and machine.

``lowprec.quant._native`` (the PyTorch kernels) and ``lowprec.jax._native`` (the XLA FFI kernel) compile their C
sources with the system compiler into ``$LOWPREC_CACHE_DIR/native`` (default ``~/.cache/lowprec/native``).  The
file name carries a hash of the sources, the flags and the machine (``-march=native`` builds for this CPU, so a
cache directory shared between machines never hands one a library built for another).  The build writes a
temporary file and renames it into place, so concurrent first uses in several processes are safe: they write the
same bytes.  No C compiler, or a failed build: None, and the callers take their tensor-operation routes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    root = os.environ.get("LOWPREC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowprec")
    return Path(root) / "native"


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def machine() -> str:
    """What ``-march=native`` compiles for: the architecture and, on Linux, the CPU's model and feature flags."""
    desc = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            desc += sorted({ln.strip() for ln in f if ln.startswith(("model name", "flags"))})
    except OSError:
        pass
    return " ".join(desc)


def build(prefix: str, sources: Sequence[Path], flags: Sequence[str], *, key_extra: bytes = b"",
          extra_args: Sequence[str] = ()) -> Path | None:
    """The path of the shared library built from ``sources`` (cached), or None where it cannot be built.

    ``key_extra``: more bytes that must change the library's name when they change (e.g. a header read by
    ``extra_args``' include path).
    """
    cc = compiler()
    if cc is None or not all(p.exists() for p in sources):
        return None
    src = b"".join(p.read_bytes() for p in sources) + key_extra
    key = hashlib.sha256(src + " ".join((cc, *flags, *extra_args, machine())).encode()).hexdigest()
    out = cache_dir() / f"{prefix}_{key[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [cc, *flags, *extra_args, *map(str, sources), "-o", tmp]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same bytes
        except (OSError, subprocess.SubprocessError):
            Path(tmp).unlink(missing_ok=True)
            return None
    return out


@contextlib.contextmanager
def switch(state: dict[str, Any], on: bool) -> Iterator[None]:
    """Within the block, ``state["off"]`` is ``not on`` (the kernels' ``enabled`` context managers)."""
    old = state.get("off", False)
    state["off"] = not on
    try:
        yield
    finally:
        state["off"] = old
