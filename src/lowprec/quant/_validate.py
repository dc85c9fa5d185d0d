"""Argument checks shared by every quantizer (and later by the JAX binding): pure Python, no tensors."""

from __future__ import annotations

from typing import Literal, cast

from .._checks import check_bool, check_literal, literal_values
from .._errors import UsageError

__all__ = ["ROUNDINGS", "Rounding", "check_bool", "check_offset", "check_rounding", "check_seed"]

Rounding = Literal["nearest", "stochastic", "toward_zero"]
ROUNDINGS: tuple[str, ...] = literal_values(Rounding)
_SEED_LIMIT = 1 << 64
_COUNTER_LIMIT = 1 << 32


def check_rounding(rounding: object, field: str = "rounding") -> Rounding:
    """``rounding`` must be a ``Rounding`` ("nearest", "stochastic", "toward_zero"); ``check_literal``'s message."""
    return cast(Rounding, check_literal(rounding, field, Rounding))


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

