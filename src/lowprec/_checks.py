"""Argument checks shared by the whole library (recipes, quant specs, formats, accuracy criteria, run configs).

Every check raises ``lowprec.UsageError`` (a ``ValueError``) with one message shape, so a user can always tell
which field is wrong, what it may be and what it got::

    {field} must be {what is allowed}; got {value!r}

and returns the value it checked, so a check can stand where the value is used.  Fields are named as the user
writes them (``"QuantSpec.scaling"``, ``"criteria.curve_k"``, ``"recipe.weights.update"``).

Choice fields are typed with a ``typing.Literal`` alias, the single source of their allowed values:
``check_literal(value, field, Alias)`` takes the allowed values from ``typing.get_args(Alias)`` and
``literal_values(Alias)`` gives the same tuple to code that lists them.

Booleans are never accepted as numbers (``True`` is not an integer ``>= 0`` here), and numbers must be finite.
"""

from __future__ import annotations

import math
from typing import Any, get_args

from ._errors import UsageError


def _range(lo: float | None, hi: float | None, open_lo: bool, open_hi: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(("> " if open_lo else ">= ") + repr(lo))
    if hi is not None:
        parts.append(("< " if open_hi else "<= ") + repr(hi))
    return (" " + " and ".join(parts)) if parts else ""


def _with(note: str | None) -> str:
    return f" {note}" if note else ""


def check_int(value: Any, field: str, lo: int | None = None, hi: int | None = None, *,
              note: str | None = None) -> int:
    """``value`` must be an ``int`` (not a bool) with ``lo <= value`` and ``value <= hi`` (bounds that are None
    are not checked).  Returns ``value``.

    Message: ``{field} must be an integer[ >= {lo} | <= {hi} | in [{lo}, {hi}]][ {note}]; got {value!r}``, e.g.
    ``Scaling.history_len must be an integer in [1, 65536]; got 0``.
    """
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        if lo is not None and hi is not None:
            rng = f" in [{lo}, {hi}]"
        else:
            rng = _range(lo, hi, False, False)
        raise UsageError(f"{field} must be an integer{rng}{_with(note)}; got {value!r}")
    return int(value)


def check_positive_int(value: Any, field: str, hi: int | None = None, *, note: str | None = None) -> int:
    """``check_int(value, field, 1, hi)``: an integer ``>= 1`` (and ``<= hi``).

    Message: ``{field} must be an integer >= 1; got {value!r}`` (``in [1, {hi}]`` with ``hi``).
    """
    return check_int(value, field, 1, hi, note=note)


def check_float(value: Any, field: str, lo: float | None = None, hi: float | None = None, *,
                open_lo: bool = False, open_hi: bool = False, note: str | None = None) -> float:
    """``value`` must be a finite ``int`` or ``float`` (not a bool) with ``lo <= value <= hi``; ``open_lo`` /
    ``open_hi`` make the bound strict, bounds that are None are not checked.  Returns ``float(value)``.

    Message: ``{field} must be a finite number[ >= {lo!r} | > {lo!r}][ and <= {hi!r} | and < {hi!r}][ {note}];
    got {value!r}``, e.g. ``criteria.curve_max_outside must be a finite number >= 0.0 and <= 1.0; got 2``.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo is None or (value > lo if open_lo else value >= lo))
    ok = ok and (hi is None or (value < hi if open_hi else value <= hi))
    if not ok:
        raise UsageError(f"{field} must be a finite number{_range(lo, hi, open_lo, open_hi)}{_with(note)}; "
                         f"got {value!r}")
    return float(value)


def check_finite(value: Any, field: str, *, note: str | None = None) -> float:
    """``value`` must be a finite ``int`` or ``float`` (not a bool, NaN or an infinity).  Returns ``float(value)``.

    Message: ``{field} must be a finite number[ {note}]; got {value!r}``.
    """
    return check_float(value, field, note=note)


def check_positive(value: Any, field: str, *, note: str | None = None) -> float:
    """``check_float(value, field, 0.0, open_lo=True)``: a finite number ``> 0``.

    Message: ``{field} must be a finite number > 0.0; got {value!r}``.
    """
    return check_float(value, field, 0.0, open_lo=True, note=note)


def check_bool(value: Any, field: str) -> bool:
    """``value`` must be ``True`` or ``False`` (not 0, 1 or a string).  Returns ``value``.

    Message: ``{field} must be True or False; got {value!r}``.
    """
    if not isinstance(value, bool):
        raise UsageError(f"{field} must be True or False; got {value!r}")
    return value


def check_str(value: Any, field: str, *, empty: bool = False) -> str:
    """``value`` must be a ``str``; unless ``empty``, a non-empty one (whitespace alone counts as empty).
    Returns ``value``.

    Message: ``{field} must be a non-empty string; got {value!r}`` (``a string`` when ``empty``).
    """
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise UsageError(f"{field} must be {'a' if empty else 'a non-empty'} string; got {value!r}")
    return value


def check_choice(value: Any, field: str, allowed: tuple[str, ...]) -> str:
    """``value`` must be one of ``allowed`` (compared with ``==``; ``"Nearest"`` is not ``"nearest"``).
    Returns ``value``.

    Message: ``{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}``, e.g.
    ``Scaling.kind must be one of 'current', 'delayed'; got 'late'``.
    """
    if not isinstance(value, str) or value not in allowed:
        raise UsageError(f"{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def literal_values(alias: Any) -> tuple[str, ...]:
    """The values of a ``typing.Literal`` of strings, in declaration order (``typing.get_args``); nested
    Literals and ``Optional`` are flattened and None is left out.  ``literal_values(Literal["a", "b"]) == ("a",
    "b")``.  Raises ``TypeError`` for anything that is not such a Literal (a programming error, not a user's)."""
    out: list[str] = []
    for arg in get_args(alias):
        if arg is None or arg is type(None):
            continue
        if isinstance(arg, str):
            out.append(arg)
        elif get_args(arg):
            out.extend(literal_values(arg))
        else:
            raise TypeError(f"{alias!r} is not a Literal of strings (it holds {arg!r})")
    if not out:
        raise TypeError(f"{alias!r} is not a Literal of strings")
    return tuple(out)


def check_literal(value: Any, field: str, alias: Any) -> str:
    """``value`` must be one of the values of the ``typing.Literal`` ``alias`` (``literal_values(alias)``).
    Returns ``value``; narrow its type with ``typing.cast(Alias, ...)`` after the check where the value came
    from parsed data.

    Message: that of ``check_choice``: ``{field} must be one of 'a', 'b'; got {value!r}``.
    """
    return check_choice(value, field, literal_values(alias))
