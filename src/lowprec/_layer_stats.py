"""Per-layer statistics as the run store holds them: the scalar-key schema, records rebuilt from it, the ranking.

Shared by the observer, the fallback monitor, ``lowprec stats`` and the report.

A statistic of layer ``module``, tensor role ``role`` (``x``, ``w``, ``grad_out``, ...) under the run's recipe is
stored as the scalar ``stats/<module>/<role>/<stat>``; under what-if spec ``name`` as
``stats/<module>/<role>@<name>/<stat>``.  Module names may contain "/" (they are split from the right).  This module
is pure Python and numpy so the commands that only read the store (``report``, ``compare``) do not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ._errors import UsageError

PREFIX = "stats/"


class StatKey(NamedTuple):
    """One parsed ``stats/...`` key."""

    module: str
    role: str
    stat: str
    what_if: str | None


def stat_key(module: str, role: str, stat: str, what_if: str | None = None) -> str:
    """The scalar key of ``stat`` of (``module``, ``role``), under what-if ``what_if`` when given."""
    return f"{PREFIX}{module}/{role if what_if is None else f'{role}@{what_if}'}/{stat}"


def parse_stat_key(key: str) -> StatKey | None:
    """``key`` split into its parts, or None when it is not a per-layer statistic (``loss``, ``stats`` alone)."""
    if not key.startswith(PREFIX) or key.count("/") < 3:
        return None
    module, role, stat = key[len(PREFIX):].rsplit("/", 2)
    role, _, what_if = role.partition("@")
    return StatKey(module, role, stat, what_if or None)


def records_from_scalars(scalars: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
    """Records (as ``StatsObserver.records``, with ``spec`` "recipe" or the what-if name) rebuilt from a run's
    scalars as ``RunStore.scalars(run_id)`` returns them (key -> (steps, values)); other keys are ignored."""
    grouped: dict[tuple[int, str, str, str | None], dict[str, float]] = {}
    for key, (steps, values) in scalars.items():
        parsed = parse_stat_key(key)
        if parsed is None:
            continue
        module, role, stat, what_if = parsed
        for s, v in zip(np.asarray(steps).tolist(), np.asarray(values).tolist(), strict=True):
            grouped.setdefault((int(s), module, role, what_if), {})[stat] = float(v)
    return [{"step": s, "module": m, "role": r, "spec": w or "recipe", "what_if": w, "stats": st}
            for (s, m, r, w), st in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                              kv[0][3] or ""))]


class LayerStat(NamedTuple):
    """One row of ``worst_layers``."""

    module: str
    role: str
    value: float
    """Mean of the statistic over the sampled steps (NaN when any step gave NaN)."""
    steps: int
    """Number of sampled steps averaged."""


_LOWER_IS_WORSE = frozenset({"sqnr_db"})


def worst_layers(records: list[dict[str, Any]], *, key: str = "sqnr_db", n: int = 10,
                 what_if: str | None = None) -> list[LayerStat]:
    """The ``n`` (module, role) pairs worst on ``key``, averaged over steps: lowest mean SQNR for "sqnr_db",
    highest mean for every other statistic (underflow_pct, overflow_pct, ...).  NaN ranks worst.  Only records of
    the recipe's spec are ranked, or those of what-if ``what_if``; for "sqnr_db" unquantized tensors (SQNR inf at
    every step) are left out."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"n must be a positive int; got {n!r}")
    values: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r.get("what_if") != what_if:
            continue
        if key not in r["stats"]:
            raise UsageError(f"key {key!r} is not a statistic of the records; they have {sorted(r['stats'])}")
        values.setdefault((r["module"], r["role"]), []).append(float(r["stats"][key]))
    lower = key in _LOWER_IS_WORSE
    rows = [LayerStat(m, role, float(np.mean(v)), len(v)) for (m, role), v in values.items()]
    if lower:
        rows = [row for row in rows if row.value != math.inf]

    def badness(row: LayerStat) -> tuple[int, float, str, str]:
        if math.isnan(row.value):
            return (0, 0.0, row.module, row.role)
        return (1, row.value if lower else -row.value, row.module, row.role)

    return sorted(rows, key=badness)[:n]
