"""Parity of a parallel layout against another: train the same config both ways, compare the loss curves.

``check_parity(config, against="single")`` trains ``config`` as written (e.g. DDP on 2 ranks) and again with
``parallel.strategy = against`` (one process by default), then compares ``train/loss`` step by step.  Data
parallelism only changes the order of floating-point additions, so the curves agree within
``TOLERANCES["ddp_vs_single_loss_rel"]`` (bitwise when the arithmetic is the same, e.g. FSDP2 vs DDP on 2 ranks);
anything larger means state that depends on the layout (a per-rank random stream, unsynchronised scales, a
batch split that is not a split).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._errors import UsageError
from .tolerances import TOLERANCES


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """Outcome of ``check_parity``: the two runs and how far apart their loss curves are."""

    run_id: str
    reference_id: str
    steps: int
    bitwise: bool
    max_rel_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.bitwise or self.max_rel_diff <= self.tolerance

    def summary(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        how = "bit for bit" if self.bitwise else f"max relative difference {self.max_rel_diff:.3g}"
        return (f"{word}: run {self.run_id} vs {self.reference_id} over {self.steps} steps: {how} "
                f"(tolerance {self.tolerance:g})")


def check_parity(config: Any, *, store: Any, against: str = "single", world_size: int | None = None,
                 progress: bool = False) -> ParityResult:
    """Train ``config`` (a ``RunConfig``, first seed) and its ``against`` layout; compare ``train/loss``."""
    from ..runs._config import ParallelConfig
    from ..runs._runner import run_config

    config = dataclasses.replace(config, seeds=config.seeds[:1])
    size = 1 if against == "single" else (world_size or config.parallel.world_size)
    fields = {**dataclasses.asdict(config.parallel), "strategy": against, "world_size": size}
    if against != "hsdp":
        fields["mesh_shape"] = None
    ref_par = ParallelConfig(**fields)
    if ref_par == config.parallel:
        raise UsageError(f"--against {against!r} is the config's own layout; pick another strategy or world size")
    (rid,) = run_config(config, store=store, progress=progress)
    (ref,) = run_config(dataclasses.replace(config, parallel=ref_par, name=None, group=None), store=store,
                        progress=progress)
    a_steps, a = store.scalars(rid)["train/loss"]
    b_steps, b = store.scalars(ref)["train/loss"]
    if not np.array_equal(a_steps, b_steps):
        raise UsageError(f"runs {rid} and {ref} recorded different steps; parity needs two completed runs")
    rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny))) if len(a) else 0.0
    return ParityResult(run_id=rid, reference_id=ref, steps=len(a), bitwise=bool(np.array_equal(a, b)),
                        max_rel_diff=rel, tolerance=TOLERANCES["ddp_vs_single_loss_rel"].value)
