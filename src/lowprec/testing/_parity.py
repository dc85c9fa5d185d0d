"""Parity of a parallel layout against another: train the same config both ways, compare the loss curves.

``check_parity(config, against="single")`` trains ``config`` as written (e.g. DDP on 2 ranks) and again with
``parallel.strategy = against`` (one process by default), then compares ``train/loss`` step by step.  Data
parallelism only changes the order of floating-point additions, so the curves agree within
``TOLERANCES["ddp_vs_single_loss_rel"]`` (bitwise when the arithmetic is the same, e.g. FSDP2 vs DDP on 2 ranks);
anything larger means state that depends on the layout (a per-rank random stream, unsynchronised scales, a
batch split that is not a split).  Tensor- and pipeline-parallel layouts (``parallel.tp`` / ``pp``) change more
than the order of the additions, and are compared within their own measured tolerances.
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
                 progress: bool = False, tp: int = 1, pp: int = 1) -> ParityResult:
    """Train ``config`` (a ``RunConfig``, first seed) and its ``against`` layout; compare ``train/loss``.

    The reference layout is ``parallel.strategy = against`` on ``world_size`` processes (default: the config's;
    one for "single") with tensor- and pipeline-parallel degrees ``tp`` and ``pp`` (default 1: a config with
    ``parallel.tp = 2`` is compared with data parallelism or one process).  The tolerance is that of the farther
    layout: ``pp_vs_single_loss_rel`` when either runs a pipeline (microbatching changes the arithmetic),
    ``tp_vs_single_loss_rel`` with tensor parallelism, ``ddp_vs_single_loss_rel`` otherwise."""
    from ..runs._config import _MESH_FIELDS, ParallelConfig
    from ..runs._runner import run_config

    config = dataclasses.replace(config, seeds=config.seeds[:1])
    size = 1 if against == "single" else (world_size or config.parallel.world_size)
    fields = {**dataclasses.asdict(config.parallel), "strategy": against, "world_size": size}
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig) if f.name in _MESH_FIELDS}
    fields.update(defaults, tp=tp, pp=pp)
    if against != "hsdp":
        fields["mesh_shape"] = None
    if against == "single" and tp * pp > 1:
        raise UsageError(f"--against single is one process; --tp {tp} / --pp {pp} need --against ddp (or fsdp2) "
                         f"with --world-size {tp * pp}")
    ref_par = ParallelConfig(**fields)
    if ref_par == config.parallel:
        raise UsageError(f"--against {against!r} is the config's own layout; pick another strategy or world size")
    key = ("pp" if max(pp, config.parallel.pp) > 1 else "tp" if max(tp, config.parallel.tp) > 1 else "ddp")
    tolerance = TOLERANCES[f"{key}_vs_single_loss_rel"].value
    (rid,) = run_config(config, store=store, progress=progress)
    (ref,) = run_config(dataclasses.replace(config, parallel=ref_par, name=None, group=None), store=store,
                        progress=progress)
    a_steps, a = store.scalars(rid)["train/loss"]
    b_steps, b = store.scalars(ref)["train/loss"]
    if not np.array_equal(a_steps, b_steps):
        raise UsageError(f"runs {rid} and {ref} recorded different steps; parity needs two completed runs")
    rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), np.finfo(np.float64).tiny))) if len(a) else 0.0
    return ParityResult(run_id=rid, reference_id=ref, steps=len(a), bitwise=bool(np.array_equal(a, b)),
                        max_rel_diff=rel, tolerance=tolerance)
