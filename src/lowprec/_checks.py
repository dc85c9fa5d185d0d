"""Validation helpers shared by the runs configs: each error names the field, the allowed range and the value."""

from __future__ import annotations

import math
from typing import Any

from ._errors import UsageError


def check_int(value: Any, field: str, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{field} must be an integer {rng}; got {value!r}")


def check_float(value: Any, field: str, lo: float, hi: float | None = None, *, open_lo: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if open_lo else value >= lo) and (hi is None or value <= hi)
    if not ok:
        rng = ("> " if open_lo else ">= ") + repr(lo) + ("" if hi is None else f" and <= {hi!r}")
        raise UsageError(f"{field} must be a finite number {rng}; got {value!r}")


def check_choice(value: Any, field: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
