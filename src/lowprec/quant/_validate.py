"""Argument checks shared by every quantizer (and later by the JAX binding): pure Python, no tensors."""

from __future__ import annotations

from typing import Literal, get_args

from .._errors import UsageError

Rounding = Literal["nearest", "stochastic", "toward_zero"]
ROUNDINGS: tuple[str, ...] = get_args(Rounding)
_SEED_LIMIT = 1 << 64
_COUNTER_LIMIT = 1 << 32


def check_rounding(rounding: object, field: str = "rounding") -> str:
    if rounding not in ROUNDINGS:
        raise UsageError(f"{field} must be one of {', '.join(map(repr, ROUNDINGS))}; got {rounding!r}")
    return str(rounding)


def check_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UsageError(f"seed must be an int in [0, 2**64) or None; got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < _SEED_LIMIT:
        raise UsageError(f"seed must be in [0, 2**64); got {seed} (use a non-negative seed)")
    return seed


def check_offset(offset: object, numel: int) -> int:
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise UsageError(f"offset must be a non-negative int; got {type(offset).__name__} {offset!r}")
    if offset < 0:
        raise UsageError(f"offset must be >= 0; got {offset}")
    if offset + numel > _COUNTER_LIMIT:
        raise UsageError(
            f"offset + number of elements must be <= 2**32 (the random counter is 32-bit); got offset={offset} "
            f"with {numel} elements: derive a new seed per chunk instead of growing the offset"
        )
    return offset


def check_bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{field} must be True or False; got {value!r}")
    return value
