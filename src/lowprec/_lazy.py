"""Lazy attributes (PEP 562) for the torch-based names of torch-free packages.

``import lowprec`` and ``import lowprec.quant`` import only pure-Python modules (formats, ``QuantSpec``, recipes),
so JAX users can use them, and ``lowprec.jax``, without PyTorch installed.  The torch-based names (``convert``,
``fake_quantize``, ``lowprec.nn``, ...) are imported the first time they are used, through the package's module
``__getattr__``, which calls ``load``; without torch that raises an ``ImportError`` saying torch is needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# name -> (module to import, relative to the package; attribute of it, or None for the module itself)
LazyTable = dict[str, tuple[str, str | None]]


def load(package: str, name: str, table: LazyTable, namespace: dict[str, Any]) -> Any:
    """The value of the lazy attribute ``name`` of ``package`` (cached in ``namespace``, the package's globals).

    Raises ``AttributeError`` for a name not in ``table`` (as a module without ``__getattr__`` would) and
    ``ImportError`` naming PyTorch when the name needs torch and torch cannot be imported.
    """
    entry = table.get(name)
    if entry is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module_name, attr = entry
    try:
        module = importlib.import_module(module_name, package)
    except ImportError as err:
        if err.name is None or err.name.split(".")[0] != "torch":
            raise
        raise ImportError(
            f"{package}.{name} needs PyTorch, which could not be imported ({err}); install torch "
            f"(pip install torch), or use lowprec.jax, lowprec.formats, lowprec.QuantSpec and lowprec.recipes, "
            f"which work without it",
            name="torch",
        ) from err
    value = module if attr is None else getattr(module, attr)
    namespace[name] = value
    return value


def names(namespace: dict[str, Any], table: LazyTable) -> list[str]:
    """``dir()`` of a package with lazy attributes: what it holds now and every lazy name."""
    return sorted(set(namespace) | set(table))


def attach(package: str, table: LazyTable, namespace: dict[str, Any]) -> tuple[Callable[[str], Any],
                                                                              Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``, whose globals are ``namespace``."""

    def getattr_(name: str) -> Any:
        return load(package, name, table, namespace)

    def dir_() -> list[str]:
        return names(namespace, table)

    return getattr_, dir_
