"""The skip ledger: batches a rollback skips and steps whose update was skipped, kept in the run store.

Training batches are a pure function of (seed, batch index), so skipping batches is a map from the optimizer step
``t`` (0-based) to the batch it trains on: the ``t``-th index not in ``batches``.  With ``batches = {5, 6}`` steps
0-4 train on batches 0-4 and step 5 on batch 7: the data after a skipped range is the data that followed it, as in
PaLM's restarts.  ``steps`` are steps that consumed their batch without updating the weights (the "skip" policy).

The ledger is the run's ``"skip"`` events (payload ``{"batches": [...]}`` or ``{"step": t}``), which the store
keeps when a rollback or a resume truncates the run (``runs._store.DURABLE_EVENTS``): a resumed run reads them
back (``from_events``) and maps every step exactly as the run it continues.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any


class SkipLedger:
    """Skipped batch indices and skipped-update steps (module docstring)."""

    def __init__(self, batches: Iterable[int] = (), steps: Iterable[int] = ()) -> None:
        self._batches = sorted(set(batches))
        self.steps = set(steps)

    @property
    def batches(self) -> list[int]:
        return list(self._batches)

    def batch_for(self, step: int) -> int:
        """The batch index optimizer step ``step`` trains on."""
        b = step
        for s in self._batches:
            if s <= b:
                b += 1
            else:
                break
        return b

    def skip_batches(self, indices: Iterable[int]) -> list[int]:
        """Add batch indices to skip; returns those that were new."""
        new = sorted(set(indices) - set(self._batches))
        for i in new:
            bisect.insort(self._batches, i)
        return new

    def skip_update(self, step: int) -> None:
        self.steps.add(step)

    @classmethod
    def from_events(cls, events: Iterable[dict[str, Any]]) -> SkipLedger:
        """The ledger of a run's ``"skip"`` events (``RunStore.events(run_id, "skip")``)."""
        led = cls()
        for e in events:
            p = e.get("payload", {})
            if "batches" in p:
                led.skip_batches(int(b) for b in p["batches"])
            if "step" in p and p.get("update_skipped"):
                led.skip_update(int(p["step"]))
        return led
