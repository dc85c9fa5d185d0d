"""Calibration on data-parallel ranks: each rank observes its own shard, the statistics are combined.

Under ``torch.distributed`` (``torchrun``), ``quantize_model`` on every rank of a process group, each with its own
calibration batches, gives every rank the same scales and weights, those of one process calibrating on all the
shards: the statistics each algorithm keeps are reduced over the group before anything is computed from them.

* ``"max"``: the running ``max |x|`` of each layer, reduced with MAX: exact, so the scales are those of one process
  over the union of the shards, bit for bit.
* ``"percentile"`` and ``"mse"``: every observed value is needed; the flattened inputs of each layer are gathered
  from every rank and concatenated in rank order (rank 0's batches first).  One process calibrating on rank 0's
  batches, then rank 1's, ... gives the same scales bit for bit.
* ``"gptq"``, ``"awq"``, ``"smoothquant"``: the float64 Gram matrix ``X^T X``, the per-channel ``sum |x|`` and the
  token counts are reduced with SUM, the per-channel ``max |x|`` with MAX.  A float64 sum grouped by rank rounds
  differently from one process's batch-by-batch sum in the last bits (about ``1e-16`` relative), so the weights
  equal one process's bit for bit only where those sums are exact; every rank gets the same bits regardless (the
  reduced tensors are identical on all ranks).

Before observing, the ranks check that they agree on what they calibrate (scheme, algorithm, its options, the
quantized layers and their shapes): a fingerprint differs -> ``UsageError`` on every rank.  After observing, they
agree on failure: a rank whose batch a layer could not take raises its own error, the others raise a
``UsageError`` naming it, so no rank is left waiting in a collective.  A rank with no batches contributes
nothing; calibration fails only when the whole group saw none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._errors import UsageError

T = TypeVar("T")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class Sync:
    """Reductions over a process group, or the identity when there is none (one process)."""

    def __init__(self, group: Any = None, *, active: bool = False) -> None:
        self.group = group
        self.active = active
        dist = _dist() if active else None
        self.world = dist.get_world_size(group) if dist is not None else 1
        self.rank = dist.get_rank(group) if dist is not None else 0
        self.device = torch.device("cpu")
        if dist is not None and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def resolve(cls, distributed_sync: object, process_group: Any) -> Sync:
        """Active when ``distributed_sync`` and ``torch.distributed`` is initialized with more than one rank in
        ``process_group`` (None: the default group)."""
        if not isinstance(distributed_sync, bool):
            raise UsageError(f"quantize_model: distributed_sync must be True or False; got {distributed_sync!r}")
        if not distributed_sync:
            if process_group is not None:
                raise UsageError("quantize_model: process_group is given but distributed_sync=False: drop one")
            return cls()
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise UsageError("quantize_model: process_group is given but torch.distributed is not initialized; "
                                 "call torch.distributed.init_process_group first (torchrun sets it up)")
            return cls()
        if dist.get_world_size(process_group) == 1:
            return cls()
        return cls(process_group, active=True)

    def _on(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
        return t.to(self.device).contiguous(), t.device

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` reduced over the group with ``op`` (``"sum"`` or ``"max"``); the same bits on every rank."""
        if not self.active:
            return t
        dist = _dist()
        x, dev = self._on(t.clone())
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return x.to(dev)

    def cat(self, t: torch.Tensor) -> torch.Tensor:
        """The 1-D tensors ``t`` of every rank (lengths may differ, dtype must agree), concatenated in rank order."""
        if not self.active:
            return t
        dist = _dist()
        x, dev = self._on(t.reshape(-1))
        n = self.all_gather(torch.tensor(x.numel(), dtype=torch.int64))
        longest = int(n.max())
        padded = torch.zeros(longest, dtype=x.dtype, device=self.device)
        padded[: x.numel()] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[: int(k)] for p, k in zip(parts, n.tolist(), strict=True)]).to(dev)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Equal-shape tensors of every rank stacked along a new first dimension (rank order)."""
        if not self.active:
            return t.unsqueeze(0)
        dist = _dist()
        x, dev = self._on(t)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.stack(parts).to(dev)

    def check_same(self, what: str, fingerprint: str) -> None:
        """UsageError on every rank unless all ranks pass the same ``fingerprint`` (a string)."""
        if not self.active:
            return
        code = int.from_bytes(hashlib.sha256(fingerprint.encode()).digest()[:7], "big")
        codes = self.all_gather(torch.tensor([code], dtype=torch.int64)).reshape(-1).tolist()
        if len(set(codes)) > 1:
            odd = [r for r, c in enumerate(codes) if c != codes[0]]
            raise UsageError(f"quantize_model: the ranks disagree on {what} (rank(s) {odd} differ from rank 0): "
                             "every rank of the process group must quantize the same model with the same scheme, "
                             "algorithm and options, each with its own calibration batches")

    def run(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on every rank, then agree on failure: a failing rank re-raises its error, the others raise a
        UsageError naming the failed ranks."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
            if not self.active:
                raise
            error = e
        if self.active:
            flags = torch.zeros(self.world, dtype=torch.int64)
            flags[self.rank] = error is not None
            failed = [r for r, f in enumerate(self.all_reduce(flags, "sum").tolist()) if f]
            if error is not None:
                raise error
            if failed:
                raise UsageError(f"quantize_model: {what} failed on rank(s) {failed} (see their errors); nothing "
                                 "was changed on this rank")
        return result  # type: ignore[no-any-return]
