"""Exported programs: lowprec's JAX numerics as serialized StableHLO that any PJRT backend can load and run.

``jax.export`` turns a jitted function into an ``Exported``: a StableHLO module plus its calling convention,
serializable to bytes (``Exported.serialize()``) and reloadable in another process, another machine or another
JAX release within StableHLO's compatibility window (``jax.export.deserialize(blob).call(*args)``).  Because
lowprec computes every rounding, scale and random draw with integer and float32 operations that XLA executes
exactly (no fused multiply-add contraction of the rounding steps: the tests compare bits after a reload), the
exported program gives the same bits wherever it runs, so a recipe travels with the model to TPU, GPU or Trainium
backends that never see lowprec's Python code.

One thing stands between lowprec code and ``jax.export``: on the CPU, lowprec traces the tensorwise amax as an XLA
FFI custom call to its own C kernel (``lowprec.jax._native``), and ``jax.export`` refuses custom calls without a
compatibility guarantee (a loading process would not have the kernel anyway).  ``export`` and ``portable()`` trace
with the kernel off: the program then holds XLA's own reductions, the same bits at a lower speed, and no custom
call at all (``custom_call_targets`` lists them; the tests check that lowprec's programs have none).

    exported = lowprec.jax.export(step_fn, params, batch, platforms=("cpu", "cuda", "tpu"))
    blob = exported.serialize()                  # bytes: ship them
    later = jax.export.deserialize(blob)        # anywhere, no lowprec needed
    new_params = later.call(params, batch)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from jax import export as jax_export

from .._errors import UsageError
from . import _native

# A custom call in StableHLO text, generic or pretty-printed form (jax.export itself accepts only targets with a
# compatibility guarantee, e.g. sharding annotations or LAPACK calls; lowprec's programs need none).
_UNREGISTERED = re.compile(r"unregistered type `([A-Za-z0-9_.]+:[A-Za-z0-9_.]+)`")
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call\s+@([A-Za-z0-9_.$-]+)|call_target_name\s*=\s*"([^"]+)"')


@contextlib.contextmanager
def portable() -> Iterator[None]:
    """Within the block, lowprec traces without its CPU FFI kernel: what a ``jax.export.export`` call of your own
    needs around it.  ``jax.jit`` caches traces without knowing which route they took, so the block clears JAX's
    caches on entry and on exit (``jax.clear_caches()``): the exported trace cannot come from a cache holding the
    kernel, and later calls outside do not reuse the slower portable traces (they trace again, once)."""
    jax.clear_caches()
    try:
        with _native.enabled(False):
            yield
    finally:
        jax.clear_caches()


def custom_call_targets(exported: jax_export.Exported) -> list[str]:
    """The custom-call targets in ``exported``'s StableHLO module, sorted (none for lowprec's own functions)."""
    text = exported.mlir_module()
    return sorted({a or b for a, b in _CUSTOM_CALL.findall(text)})


def _is_namedtuple(t: object) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def _serial_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register_containers(*trees: Any) -> list[str]:
    """Make the NamedTuple containers in ``trees`` (pytrees, or ``PyTreeDef``s) serializable with an exported
    program's signature (``jax.export.register_namedtuple_serialization``, named ``"module:QualName"``); returns
    the names newly registered.  Optimizer states are such trees (optax's ``ScaleByAdamState``, lowprec's
    ``LowPrecisionState``); ``export`` calls this for its arguments and results and ``load`` registers what a
    program names by importing the class's module, so neither side needs to call it."""
    new: list[str] = []
    todo = [t if isinstance(t, jax.tree_util.PyTreeDef) else jax.tree_util.tree_structure(t) for t in trees]
    while todo:
        node = todo.pop()
        kind = node.node_data()
        if kind is not None and _is_namedtuple(kind[0]) and kind[0] not in _registered:
            name = _serial_name(kind[0])
            try:
                jax_export.register_namedtuple_serialization(kind[0], serialized_name=name)
            except ValueError:  # registered before, elsewhere (under this or another name)
                pass
            else:
                new.append(name)
            _registered.add(kind[0])
        todo.extend(node.children())
    return new


_registered: set[type] = set()


def _register_by_name(name: str) -> bool:
    """Import ``"module:QualName"`` and register that NamedTuple class (``load``); False where that fails."""
    module, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        return False
    if not _is_namedtuple(obj) or obj in _registered:
        return False
    register_containers(obj(*[None] * len(obj._fields)))
    return True


def export(fn: Callable[..., Any], *args: Any, platforms: Sequence[str] | None = None,
           **kwargs: Any) -> jax_export.Exported:
    """``jax.export.export(jax.jit(fn), platforms=platforms)(*args, **kwargs)`` traced ``portable()``.

    ``args`` / ``kwargs``: arrays or ``jax.ShapeDtypeStruct``s (pytrees of them) giving the shapes and dtypes of
    the program's inputs.  ``platforms``: the backends the program is lowered for, e.g. ``("cpu", "cuda", "tpu")``
    (default: this process's backend); lowering for a platform needs no device of it.  Keyword arguments that are
    not arrays (a recipe, a spec, a seed) must be baked in with ``functools.partial`` or a closure: exported
    programs take arrays only."""
    if not callable(fn):
        raise UsageError(f"export needs a function to export; got {type(fn).__name__}")
    with portable():
        exported = jax_export.export(jax.jit(fn), platforms=platforms)(*args, **kwargs)
    register_containers(exported.in_tree, exported.out_tree)
    return exported


def save(exported: jax_export.Exported, path: str | os.PathLike[str]) -> Path:
    """Write ``exported.serialize()`` to ``path`` atomically (a temporary file in the same folder, then a rename);
    returns the path.  Read it back with ``load``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(exported.serialize())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out


def load(path: str | os.PathLike[str]) -> jax_export.Exported:
    """The ``Exported`` that ``save`` wrote (``jax.export.deserialize`` of the file's bytes); call it with
    ``.call(*args)``.  A file that is not a serialized program is a ``UsageError`` naming the path."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"no exported program at {p}: pass the path that lowprec.jax.save wrote")
    blob = bytearray(p.read_bytes())
    tried: set[str] = set()
    while True:
        try:
            return jax_export.deserialize(blob)
        except ValueError as e:  # a container of the signature not registered in this process: import it
            m = _UNREGISTERED.search(str(e))
            if m is None or m.group(1) in tried or not _register_by_name(m.group(1)):
                raise UsageError(f"{p} cannot be loaded here: {e}; import and register that container "
                                 "(lowprec.jax.register_containers) before loading") from None
            tried.add(m.group(1))
        except Exception as e:  # flatbuffer / MLIR parse errors have no common type
            raise UsageError(f"{p} is not a serialized JAX program ({type(e).__name__}: {e}); export it with "
                             "lowprec.jax.export(...) and lowprec.jax.save(...)") from None
