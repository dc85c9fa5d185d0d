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
import os
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

from .. import _native_build

TARGET = "lowprec_absmax_bits"
_SOURCE = Path(__file__).with_name("_native_amax.c")
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-fno-strict-aliasing")
_state: dict[str, object] = {}


def _build() -> ctypes.CDLL | None:
    include = Path(jax.ffi.include_dir())
    header = include / "xla" / "ffi" / "api" / "c_api.h"
    if not header.exists():
        return None
    out = _native_build.build("lowprec_jax_native", [_SOURCE], _FLAGS, key_extra=header.read_bytes(),
                              extra_args=[f"-I{include}"])
    return None if out is None else ctypes.CDLL(str(out))


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
    with _native_build.switch(_state, on):
        yield


def absmax_bits(xf: jax.Array) -> jax.Array:
    """int32 bits of ``max |x|`` over all of float32 ``xf`` (NaN bits if any element is NaN); CPU only, and only
    when ``available()``.  Under ``vmap`` each mapped slice gets its own amax."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((), jnp.int32), vmap_method="expand_dims")
    return call(xf)
