"""Choice types shared across packages that must not import each other (``runs`` records runs, ``accuracy`` reads
them): each is a ``typing.Literal``, the single source of its allowed values (``_checks.literal_values``)."""

from __future__ import annotations

from typing import Literal

from ._checks import literal_values

Direction = Literal["min", "max"]
"""Which way a metric is better: "min" (lower is better, a loss) or "max" (higher is better, an accuracy)."""
DIRECTIONS: tuple[str, ...] = literal_values(Direction)

RunStatus = Literal["running", "completed", "diverged", "failed"]
"""A stored run's status: "running" until it ends, then one of the final statuses."""
FinalStatus = Literal["completed", "diverged", "failed"]
"""How a run ended: trained all its steps, stopped on a non-finite loss, or stopped by an error or a kill."""
STATUSES: tuple[str, ...] = literal_values(RunStatus)
FINAL_STATUSES: tuple[str, ...] = literal_values(FinalStatus)
