"""lowprec.jax's CPU kernel (the tensorwise amax, ``_native_amax.c``) as an XLA FFI target, built at first use.

Why a kernel.  Tensorwise scaling reads the whole tensor once for its amax before it quantizes anything.  XLA on
CPU has no fast exact way to take it: its vectorized float max reduction drops NaN (so a finiteness test needs a
second reduction), and its integer max over the bit patterns is not vectorized (a third of a copy).  The C loop
is one integer max per element (the same bits as ``_scaled._amax``), at about twice the speed of a copy.

Set-up, as ``lowprec.quant._native`` (no torch involved): the shared library is built once per source version,
jaxlib version and machine type with the system C compiler into ``$LOWPREC_CACHE_DIR/native`` (default
``~/.cache/lowprec/native``; written atomically), loaded with ctypes and registered with ``jax.ffi`` for the CPU
platform only.  Where no C compiler is found, the build fails, or ``LOWPREC_NATIVE=0`` is set, ``available()``
is False and callers use XLA reductions instead: the bits are the same either way, only the speed differs.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

TARGET = "lowprec_absmax_bits"
_SOURCE = Path(__file__).with_name("_native_amax.c")
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-fno-strict-aliasing")
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("LOWPREC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lowprec")
    return Path(root) / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _machine() -> str:
    """What ``-march=native`` compiles for (a cache shared between machines never hands one another's build)."""
    desc = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            desc += sorted({ln.strip() for ln in f if ln.startswith(("model name", "flags"))})
    except OSError:
        pass
    return " ".join(desc)


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    include = Path(jax.ffi.include_dir())
    header = include / "xla" / "ffi" / "api" / "c_api.h"
    if cc is None or not _SOURCE.exists() or not header.exists():
        return None
    key_src = _SOURCE.read_bytes() + header.read_bytes() + " ".join((cc, *_FLAGS, _machine())).encode()
    out = _cache_dir() / f"lowprec_jax_native_{hashlib.sha256(key_src).hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [cc, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same bytes
        except (OSError, subprocess.SubprocessError):
            Path(tmp).unlink(missing_ok=True)
            return None
    return ctypes.CDLL(str(out))


def _registered() -> bool:
    if "ok" not in _state:
        ok = False
        if os.environ.get("LOWPREC_NATIVE", "1") != "0":
            try:
                lib = _build()
                if lib is not None:
                    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.lowprec_absmax_bits), platform="cpu")
                    _state["lib"] = lib  # keep the library loaded for as long as the target is registered
                    ok = True
            except (OSError, AttributeError, ValueError, RuntimeError):
                ok = False
        _state["ok"] = ok
    return bool(_state["ok"])


def available() -> bool:
    """Whether the kernel is built, registered and enabled (read when a function is traced)."""
    return not _state.get("off", False) and _registered()


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within the block, trace with the kernel only if ``on`` (and it is available); tests compare both routes
    this way (with a fresh ``jax.jit``: a cached trace keeps the route it was traced with)."""
    old = _state.get("off", False)
    _state["off"] = not on
    try:
        yield
    finally:
        _state["off"] = old


def absmax_bits(xf: jax.Array) -> jax.Array:
    """int32 bits of ``max |x|`` over all of float32 ``xf`` (NaN bits if any element is NaN); CPU only, and only
    when ``available()``.  Under ``vmap`` each mapped slice gets its own amax."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((), jnp.int32), vmap_method="expand_dims")
    return call(xf)
