"""The task registry: ``get_task``, ``names`` and ``load_entry_point`` for user-defined task builders.

A task builder is a callable ``builder(*, seed: int, batch_size: int | None = None, **options) -> Task``.  The
built-in ones are registered by name below.  A user's builder is named in one of three ways, each a declaration
by the builder's author (see ``_declare``):

* ``"package.module:function"`` (``function`` may be a dotted attribute path, e.g. ``"pkg.mod:Tasks.small"``),
  where the function is decorated with ``@lowprec.runs.zoo.task`` or is the target of a ``lowprec.tasks`` entry
  point;
* the name of an entry point in the packaging group ``lowprec.tasks`` (``model = "mytask"``);
* a name registered in this process with ``@task(name="...")``.

A config may not call anything else: an undeclared function is refused (ValueError naming the ``model`` field
and the fix) before any option is passed to it and before it is called.  Options of a declared builder are
checked against its keyword parameters before it is called, so a misspelt option fails with the list of
options the task accepts instead of a bare ``TypeError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..._errors import UsageError
from ._declare import ENTRY_POINT_GROUP, is_task, registered, registered_names
from ._digits import cnn_digits, mlp_digits
from ._hf import hf_causal_lm
from ._synthetic import synthetic_regression
from ._task import Task, check_seed
from ._text import gpt_bytes

_TASKS: dict[str, Callable[..., Task]] = {
    "mlp-digits": mlp_digits,
    "cnn-digits": cnn_digits,
    "gpt-bytes": gpt_bytes,
    "synthetic-regression": synthetic_regression,
    "hf-causal-lm": hf_causal_lm,
}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_FIX = (f"decorate it with @lowprec.runs.zoo.task, or declare it in the {ENTRY_POINT_GROUP!r} entry-point group "
        "of an installed package")


def names() -> list[str]:
    """Names of the built-in tasks, in registration order (the demo task ``mlp-digits`` first)."""
    return list(_TASKS)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed ``lowprec.tasks`` entry points, one per (name, value) (a distribution found twice on
    ``sys.path`` counts once)."""
    seen: dict[tuple[str, str], importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault((ep.name, ep.value.replace(" ", "")), ep)
    return list(seen.values())


def entry_point_names() -> list[str]:
    """Names declared by installed packages in the ``lowprec.tasks`` entry-point group, sorted."""
    return sorted({ep.name for ep in _entry_points()})


def _dist_of(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"distribution {dist.name!r}" if dist is not None and getattr(dist, "name", None) else "a distribution"


def _load_named_entry_point(name: str) -> Callable[..., Task] | None:
    """The builder of the ``lowprec.tasks`` entry point ``name``, or None when no package declares it."""
    found = [ep for ep in _entry_points() if ep.name == name]
    if not found:
        return None
    if len(found) > 1:
        raise UsageError(f"model {name!r} is declared by several {ENTRY_POINT_GROUP!r} entry points: "
                         + ", ".join(f"{ep.value!r} ({_dist_of(ep)})" for ep in found)
                         + "; name the one you mean as 'package.module:function'")
    (ep,) = found
    where = f"model {name!r} (entry point {ep.value!r} of {_dist_of(ep)})"
    try:
        obj = ep.load()
    except Exception as e:
        raise UsageError(f"{where}: loading it failed: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise UsageError(f"{where} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


def _declared_by_entry_point(spec: str) -> bool:
    """Whether ``spec`` (``"module:attr"``) is the target of an installed ``lowprec.tasks`` entry point."""
    return any(ep.value.replace(" ", "") == spec for ep in _entry_points())


def _options_of(builder: Callable[..., Task]) -> list[str] | None:
    """The builder's option names (keyword parameters other than seed/batch_size); None if it takes **kwargs."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.name not in ("seed", "batch_size")]


@contextlib.contextmanager
def _on_path(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """``folder`` appended to ``sys.path`` for the block (at the end: it never shadows an installed module), unless
    it is there already."""
    entry = None if folder is None else os.fspath(folder)
    if entry is None or entry in sys.path:
        yield
        return
    sys.path.append(entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def resolve_builder(name: str, *, import_dir: str | os.PathLike[str] | None = None) -> Callable[..., Task]:
    """The declared builder that ``name`` (a run config's ``model``) names; nothing is called.

    Looked up in this order: ``"package.module:function"`` (:func:`load_entry_point`: the module is imported and
    the function must be declared), a built-in task, a name registered with ``@task(name=...)`` in this process,
    a ``lowprec.tasks`` entry point.  ValueError when ``name`` is none of these, listing the known names.
    ``import_dir`` (a run config's folder) is on ``sys.path``, after every other entry, while the module is
    imported, so ``"mytask:make"`` finds ``mytask.py`` next to the config.
    """
    if isinstance(name, str) and ":" in name:
        with _on_path(import_dir):
            return load_entry_point(name)
    if isinstance(name, str) and name in _TASKS:
        return _TASKS[name]
    if isinstance(name, str):
        builder = registered(name) or _load_named_entry_point(name)
        if builder is not None:
            return builder
    extra = registered_names() + entry_point_names()
    raise UsageError(f"unknown task {name!r}; built-in tasks: {', '.join(names())}"
                     + (f"; declared tasks: {', '.join(extra)}" if extra else "")
                     + " (or give an entry point 'package.module:function' of a function decorated with "
                       "@lowprec.runs.zoo.task)")


def get_task(name: str, *, seed: int, batch_size: int | None = None,
             import_dir: str | os.PathLike[str] | None = None, **options: Any) -> Task:
    """Build task ``name`` for ``seed``: a built-in name, a declared name, or ``"package.module:function"``.

    ``batch_size=None`` takes the task's default.  ``options`` are the task's model/data options (e.g.
    ``hidden=256`` for ``mlp-digits``); each is validated, and a ValueError names the bad option and what is
    allowed.  Unknown names raise UsageError listing :func:`names`; a ``module:function`` whose function is not
    declared a task (``@lowprec.runs.zoo.task`` or a ``lowprec.tasks`` entry point) raises ValueError before
    any option is looked at and before the function is called.  ``import_dir``: as in :func:`resolve_builder`.
    A task built with an empty ``name`` gets ``name``.
    """
    builder = resolve_builder(name, import_dir=import_dir)
    check_seed(seed)
    allowed = _options_of(builder)
    if allowed is not None:
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise UsageError(f"task {name!r} has no option {unknown[0]!r}; its options are: "
                             f"{', '.join(allowed) or '(none)'}")
    task = builder(seed=seed, batch_size=batch_size, **options)
    if not isinstance(task, Task):
        raise UsageError(f"task builder {name!r} returned {type(task).__name__}, not a lowprec.runs.zoo.Task")
    return task if task.name else dataclasses.replace(task, name=name)


def load_entry_point(spec: str) -> Callable[..., Task]:
    """The declared task builder named by ``"package.module:attribute"`` (attribute may be dotted).

    The module is imported (which runs its top-level code: only name modules you trust), the attribute looked
    up, and the result returned only when it is declared a task: decorated with ``@lowprec.runs.zoo.task``, or
    the target of an installed ``lowprec.tasks`` entry point.  Raises ValueError for a malformed spec, a module
    that cannot be found or fails to import, a missing attribute, an attribute that is not callable, or one
    that is not declared (the message names the ``model`` field and how to declare it).
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise UsageError(f"entry point must be 'package.module:function' (one colon); got {spec!r}")
    mod_name, attr = spec.split(":")
    if not _DOTTED.fullmatch(mod_name) or not _DOTTED.fullmatch(attr):
        raise UsageError(f"entry point must be 'package.module:function' with dotted Python identifiers on both "
                         f"sides of the colon; got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise UsageError(f"entry point {spec!r}: no module named {e.name!r} (is it installed, on PYTHONPATH, "
                             "or a file next to the run config?)") from None
        raise UsageError(f"entry point {spec!r}: importing module {mod_name!r} failed: {e}") from e
    except Exception as e:
        raise UsageError(f"entry point {spec!r}: importing module {mod_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([mod_name] + attr.split(".")[:i])
            raise UsageError(f"entry point {spec!r}: {where!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"entry point {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    if not is_task(obj) and not _declared_by_entry_point(spec):
        raise UsageError(f"model = {spec!r}: {mod_name}.{attr} is not declared a lowprec task, so a run config "
                         f"may not call it; if it builds a lowprec.runs.zoo.Task, {_FIX}")
    return obj  # type: ignore[no-any-return]
