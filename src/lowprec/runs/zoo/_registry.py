"""The task registry: ``get_task``, ``names`` and ``load_entry_point`` for user-defined task builders.

A task builder is any callable ``builder(*, seed: int, batch_size: int | None = None, **options) -> Task``.  The
built-in ones are registered by name below; a user's builder is named by an entry-point spec
``"package.module:function"`` (``function`` may be a dotted attribute path, e.g. ``"pkg.mod:Tasks.small"``).
Options are checked against the builder's keyword parameters before it is called, so a misspelt option fails
with the list of options the task accepts instead of a bare ``TypeError``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from ._digits import cnn_digits, mlp_digits
from ._synthetic import synthetic_regression
from ._task import Task, check_seed
from ._text import gpt_bytes

_TASKS: dict[str, Callable[..., Task]] = {
    "mlp-digits": mlp_digits,
    "cnn-digits": cnn_digits,
    "gpt-bytes": gpt_bytes,
    "synthetic-regression": synthetic_regression,
}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def names() -> list[str]:
    """Names of the built-in tasks, in registration order (the demo task ``mlp-digits`` first)."""
    return list(_TASKS)


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


def get_task(name: str, *, seed: int, batch_size: int | None = None, **options: Any) -> Task:
    """Build task ``name`` (a built-in name or ``"package.module:function"``) for ``seed``.

    ``batch_size=None`` takes the task's default.  ``options`` are the task's model/data options (e.g.
    ``hidden=256`` for ``mlp-digits``); each is validated, and a ValueError names the bad option and what is
    allowed.  Unknown names raise ValueError listing :func:`names`.
    """
    if isinstance(name, str) and ":" in name:
        builder = load_entry_point(name)
    elif isinstance(name, str) and name in _TASKS:
        builder = _TASKS[name]
    else:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(names())} "
                         "(or give an entry point 'package.module:function')")
    check_seed(seed)
    allowed = _options_of(builder)
    if allowed is not None:
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"task {name!r} has no option {unknown[0]!r}; its options are: "
                             f"{', '.join(allowed) or '(none)'}")
    task = builder(seed=seed, batch_size=batch_size, **options)
    if not isinstance(task, Task):
        raise ValueError(f"task builder {name!r} returned {type(task).__name__}, not a lowprec.runs.zoo.Task")
    return task


def load_entry_point(spec: str) -> Callable[..., Task]:
    """The callable named by ``"package.module:attribute"`` (attribute may be dotted).

    Raises ValueError for a malformed spec, a module that cannot be found or fails to import, a missing
    attribute, or an attribute that is not callable.  The module is imported (it may run code).
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"entry point must be 'package.module:function' (one colon); got {spec!r}")
    mod_name, attr = spec.split(":")
    if not _DOTTED.fullmatch(mod_name) or not _DOTTED.fullmatch(attr):
        raise ValueError(f"entry point must be 'package.module:function' with dotted Python identifiers on both "
                         f"sides of the colon; got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ValueError(f"entry point {spec!r}: no module named {e.name!r} (is it installed, or on "
                             "PYTHONPATH?)") from None
        raise ValueError(f"entry point {spec!r}: importing module {mod_name!r} failed: {e}") from e
    except Exception as e:
        raise ValueError(f"entry point {spec!r}: importing module {mod_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([mod_name] + attr.split(".")[:i])
            raise ValueError(f"entry point {spec!r}: {where!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"entry point {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]
