"""Localising a diverged step: replay it under ``lowprec.numerics.localize_nonfinite`` to find the first non-finite
value (module, tensor role, step) for the "nonfinite" event.

The runner (``_runner``) stops a run at the first step whose loss, or whose gradient norm that no loss scaler
will skip, is non-finite.  Before that step's optimizer step (parameters and optimizer state are still those of the
step's start) it replays the step here:

1. ``Snapshot``: taken at the start of every step, what a forward/backward changes besides gradients (the module
   buffers, the CPU random state, which delayed-scaling roles have started), so the replay starts where the step
   did; the batch is a pure function of (seed, step).
2. ``replay_step``: restore the snapshot, run the step again under ``localize_nonfinite`` and put the original
   step's gradients, buffers and random state back; returns this rank's event payload, with ``replay_exact``.
3. ``gather_localizations``: under data parallelism every rank replays its own shard; rank 0 reports the rank
   whose replay failed first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..nn import EmulatedLinear
from ._parallel import World, unwrap

if TYPE_CHECKING:
    from ._torch_state import State


class Snapshot:
    """What a forward/backward changes besides gradients: the module buffers (copied into storage kept between
    steps: one ``_foreach_copy_``), the CPU random state, and which delayed-scaling roles of each
    ``EmulatedLinear`` have started (a Python set: on a role's first training step a data-parallel run MAX-reduces
    its current amax, so a replay of that step must do so again).  Parameters and optimizer state need no copy: the
    check runs before the optimizer step."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.rng = torch.empty(0, dtype=torch.uint8)
        self.started: list[tuple[EmulatedLinear, frozenset[str]]] = []
        self.hook: Any = None
        self.hook_saved: Any = None

    def take(self, model: torch.nn.Module, hook: Any = None) -> None:
        """Record ``model``'s state at the start of a step (and ``hook``'s: DDP's compression state, whose
        ``snapshot()`` this keeps)."""
        bufs = [b.detach() for b in model.buffers()]
        if len(bufs) != len(self.buffers) or any(a.shape != b.shape or a.dtype != b.dtype
                                                 for a, b in zip(bufs, self.buffers, strict=True)):
            self.buffers = [b.clone() for b in bufs]  # first step, or buffers changed (a fallback)
        elif bufs:
            torch._foreach_copy_(self.buffers, bufs)
        self.rng = torch.get_rng_state()
        self.started = [(m, frozenset(m._amax_started)) for m in model.modules()
                        if isinstance(m, EmulatedLinear) and m._delayed]
        self.hook = hook
        self.hook_saved = hook.snapshot() if hook is not None else None

    def restore(self, model: torch.nn.Module) -> None:
        """Put ``model``'s buffers, the CPU random state and the started roles back as ``take`` recorded them."""
        with torch.no_grad():
            for b, saved in zip(model.buffers(), self.buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(self.rng)
        for m, started in self.started:
            m._amax_started = set(started)
        if self.hook is not None:
            self.hook.restore(self.hook_saved)


def _same(a: float, b: float) -> bool:
    """Equal, counting NaN as equal to NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


def replay_step(st: State, snap: Snapshot, loss: float, norm: float,
                forward_backward: Callable[[], tuple[torch.Tensor, float]]) -> dict[str, Any]:
    """Restore the step's start (``snap``; parameters and optimizer state are untouched before the optimizer step)
    and run it again under ``localize_nonfinite``: the "nonfinite" event payload of this rank.  Afterwards the
    original step's gradients, buffers and random state are put back, so the replay changes nothing that follows.

    ``forward_backward`` runs the step's forward and backward again (the runner's, in its replay mode) and returns
    (local loss, gradient norm); ``loss`` and ``norm`` are the original step's.

    ``replay_exact`` says whether the replay reproduced the step: the same loss and gradient norm in one process;
    under data parallelism this rank's loss (the replay's gradients are this rank's own, not all-reduced)."""
    from ..numerics import localize_nonfinite

    model = unwrap(st.model)
    after = Snapshot()
    after.take(model)
    params = [p for g in st.optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    snap.restore(model)
    got: list[tuple[torch.Tensor, float]] = []

    def run_step() -> torch.Tensor:
        got.append(forward_backward())
        return got[-1][0]

    try:
        loc = localize_nonfinite(model, run_step, step=st.step + 1)
    finally:
        after.restore(model)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    r_loss, r_norm = float(got[0][0].detach()), got[0][1]
    payload: dict[str, Any] = loc.to_dict() if loc is not None else {
        "module": None, "role": None, "step": st.step + 1,
        "detail": "no tensor of the step was non-finite (e.g. the gradient norm overflowed from finite gradients)"}
    exact = _same(loss, r_loss) and (st.world.distributed or _same(norm, r_norm))
    payload.update(found=loc is not None, loss=repr(loss), grad_norm=repr(norm), replay_exact=exact)
    return payload


def gather_localizations(world: World, payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the event payload of a data-parallel replay, from every rank's own.  A fault on one rank spreads to
    all (the mean loss, the all-reduced gradients), so the ranks' replays are compared: the reported hit is the
    earliest by phase (forward, then the loss, then backward), the lowest rank on a tie; ``rank`` names it and
    ``ranks`` lists every rank whose replay found a non-finite tensor, with its one-line description."""
    if not world.distributed:
        return payload
    import torch.distributed as dist

    from ..numerics._localize import describe_payload

    payload = {**payload, "rank": world.rank}
    everyone: list[Any] = [None] * world.size
    dist.all_gather_object(everyone, payload)
    found = [p for p in everyone if p["found"]]
    order = {"forward": 0, "loss": 1, "backward": 2}
    best = min(found, key=lambda p: (order.get(p["phase"], 3), p["rank"])) if found else everyone[0]
    return {**best, "world_size": world.size, "ranks": {str(p["rank"]): describe_payload(p) for p in found}}
