"""Parsing user-supplied TOML and JSON (run configs, recipes, criteria, baselines): every failure is a ``ValueError``
naming the file, never a traceback.

Python's ``json`` and ``tomllib`` parse nesting by recursion, so a document such as ``"[" * 100_000`` ends in a
``RecursionError`` (and later recursive code, ``json.dumps`` included, can fail the same way on deep data).  The
nesting is therefore counted before parsing, on the brackets outside strings and comments, and again on the parsed
data (TOML's dotted keys nest without brackets), and anything deeper than ``MAX_NESTING`` is refused.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from ._errors import UsageError

__all__ = ["MAX_NESTING", "parse_json", "parse_toml"]

MAX_NESTING = 64
"""Most levels of nested arrays/tables (objects) a user-supplied TOML or JSON document may have; the document
itself is level 1.  A run config, a recipe, criteria or a baseline needs fewer than ten."""

# Tokens that matter for nesting, strings first so that brackets inside them are skipped.  An unterminated
# string just leaves its brackets counted; the parser reports the real error unless the count is already deep.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_TOML_TOKENS = re.compile(
    r'"""(?:[^\\]|\\.)*?"""'  # multi-line basic string
    r"|'''.*?'''"  # multi-line literal string
    r'|"(?:[^"\\\n]|\\.)*"'  # basic string
    r"|'[^'\n]*'"  # literal string
    r"|#[^\n]*"  # comment
    r"|[\[\]{}]",
    re.S,
)


def read_text_file(path: str | os.PathLike[str], what: str) -> str:
    """The UTF-8 text of the user's ``what`` file (``"config"``, ``"criteria"``, ``"baseline"``): a missing or
    unreadable file is a ``UsageError`` naming it (``config file 'x.toml' does not exist``)."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {what} file {str(p)!r}: {e}") from None


def _too_deep(where: str) -> UsageError:
    return UsageError(f"{where} is nested too deeply (more than {MAX_NESTING} levels of arrays or tables); a "
                      f"config, recipe, criteria or baseline file needs only a few")


def _check_text_nesting(text: str, tokens: re.Pattern[str], where: str, *, base: int) -> None:
    """ValueError when brackets/braces outside strings (and TOML comments) nest deeper than ``MAX_NESTING``
    (``base`` levels are implied: TOML's top-level table).  Run before parsing: Python's json and tomllib parse
    nesting by recursion, and a deep enough document would end in RecursionError instead."""
    depth = base
    for m in tokens.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise _too_deep(where)
        elif c in "]}":
            depth -= 1


def _check_data_nesting(data: Any, where: str) -> None:
    """ValueError when parsed data nests dicts/lists deeper than ``MAX_NESTING`` (iteratively: TOML's dotted keys
    ``a.b.c = 1`` nest without brackets, and deep data would make later recursive code, json.dumps included,
    fail with RecursionError)."""
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _too_deep(where)
        children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def parse_toml(text: str, *, where: str) -> dict[str, Any]:
    """Parse user-supplied TOML; every failure is a ValueError starting with ``where``: not valid TOML, or
    nested deeper than ``MAX_NESTING`` levels (checked before and after parsing, never a RecursionError)."""
    _check_text_nesting(text, _TOML_TOKENS, where, base=1)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where}: not valid TOML: {e}") from None
    except RecursionError:
        raise _too_deep(where) from None
    _check_data_nesting(data, where)
    return data


def parse_json(text: str, *, where: str) -> Any:
    """Parse user-supplied JSON; every failure is a ValueError starting with ``where``: not valid JSON, or nested
    deeper than ``MAX_NESTING`` levels (checked before and after parsing, never a RecursionError)."""
    _check_text_nesting(text, _JSON_TOKENS, where, base=0)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise _too_deep(where) from None
    _check_data_nesting(data, where)
    return data
