"""Declaring task builders: the ``@task`` decorator, ``is_task``, and the ``lowprec.tasks`` entry-point group.

A run config names its model as data (``model = "pkg.mod:make"``), and configs travel: they are shared, checked
into repositories, and stored with every run, from where ``lowprec run --resume`` reads them again.  If such a
name could be any importable callable, a config would be a program: ``model = "logging:basicConfig"`` with
``model_options = {filename = "...", filemode = "w"}`` truncates a file, ``"os:system"`` runs a shell command.
So a name is called only when the function it names was *declared* a task builder, by its author, in one of two
ways:

* the decorator :func:`task` (``@lowprec.runs.zoo.task``), which marks the function with the attribute
  ``__lowprec_task__ = True`` (and with ``name=`` also registers a short name in this process);
* an entry point in the packaging group ``lowprec.tasks`` (``[project.entry-points."lowprec.tasks"]`` in a
  ``pyproject.toml``): an installed distribution declares ``mytask = "mypkg.tasks:make"``, and a config may then
  say ``model = "mytask"`` (or ``model = "mypkg.tasks:make"``).

The declaration is checked before any option is passed to the function and before it is called.  Importing the
module that a ``"module:function"`` name points into still runs that module's top-level code, which no check can
prevent: a config is trusted with choosing which installed or importable code to import (see docs/runs.md,
"What a run config is trusted with").
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar, overload

from ..._errors import UsageError

TASK_ATTR = "__lowprec_task__"
"""The attribute :func:`task` sets to ``True`` on a builder."""
ENTRY_POINT_GROUP = "lowprec.tasks"
"""The packaging entry-point group whose names are task builders by declaration."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""What a registered task name looks like (no colon: a colon means ``module:function``)."""

B = TypeVar("B", bound=Callable[..., Any])

# Names registered with @task(name=...) in this process -> builder.
_NAMED: dict[str, Callable[..., Any]] = {}


def _mark(builder: B, name: str | None) -> B:
    if not callable(builder):
        raise TypeError(f"@lowprec.runs.zoo.task decorates a task builder function; got {type(builder).__name__}")
    try:
        setattr(builder, TASK_ATTR, True)
    except (AttributeError, TypeError):
        raise TypeError(f"@lowprec.runs.zoo.task cannot mark {builder!r} (it takes no attributes): wrap it in a "
                        "function of your own and decorate that") from None
    if name is not None:
        _register(name, builder)
    return builder


def _register(name: str, builder: Callable[..., Any]) -> None:
    from ._registry import _TASKS  # the built-in names (imported here: _registry imports the built-in builders)

    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise UsageError(f"task name must be letters, digits, '_', '.' or '-' (no colon), starting with a letter "
                         f"or digit; got {name!r}")
    if name in _TASKS:
        raise UsageError(f"task name {name!r} is a built-in task; choose another name")
    old = _NAMED.get(name)
    if old is not None and old is not builder and _origin(old) != _origin(builder):
        raise UsageError(f"task name {name!r} is already registered for {_origin(old)}; choose another name")
    _NAMED[name] = builder


def _origin(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


@overload
def task(builder: B, /) -> B: ...


@overload
def task(*, name: str | None = None) -> Callable[[B], B]: ...


def task(builder: Any = None, /, *, name: str | None = None) -> Any:
    """Declare a function a task builder, so that a run config may name it.

    A builder has the signature ``make(*, seed, batch_size=None, **options) -> lowprec.runs.zoo.Task``.  Use it
    bare or with a name::

        from lowprec.runs.zoo import task

        @task
        def make(*, seed, batch_size=None, hidden=64): ...        # model = "mypkg.tasks:make"

        @task(name="my-task")
        def other(*, seed, batch_size=None): ...                  # also model = "my-task", once imported

    The decorator returns the function unchanged apart from the attribute ``__lowprec_task__ = True``.  A name
    given with ``name=`` is known only in a process that has imported the module; for a name that any process
    can resolve, declare an entry point in the ``lowprec.tasks`` group instead.  Names may not shadow a built-in
    task, nor be registered twice for different functions (ValueError).
    """
    if builder is None:
        return lambda fn: _mark(fn, name)
    return _mark(builder, name)


def is_task(obj: Any) -> bool:
    """Whether ``obj`` was declared a task builder with :func:`task`.

    The attribute is read statically (``inspect.getattr_static``: no ``__getattr__``, property or descriptor of
    ``obj`` runs), and only the value ``True`` counts; a bound method counts when its function is declared.
    """
    if inspect.ismethod(obj):
        obj = obj.__func__
    try:
        return inspect.getattr_static(obj, TASK_ATTR, None) is True
    except Exception:  # an object whose type machinery refuses static lookup is not a declared task
        return False


def registered(name: str) -> Callable[..., Any] | None:
    """The builder registered in this process as ``name`` with ``@task(name=...)``, or None."""
    return _NAMED.get(name)


def registered_names() -> list[str]:
    """Names registered in this process with ``@task(name=...)``, in registration order."""
    return list(_NAMED)
