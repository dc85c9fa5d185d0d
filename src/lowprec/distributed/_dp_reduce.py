"""Data-parallel gradient averaging for models that are already split (tensor- or pipeline-parallel).

DDP wraps a whole module and reduces every parameter over the whole world.  Next to tensor parallelism (DTensor
parameters, a TP group inside each replica) or a pipeline (each rank holds one stage's parameters) the gradients
must be averaged over a sub-group only: the ranks that hold the same piece of the model (the mesh's
``dp_replicate`` dimension: the same TP index and the same stage).  ``GradReducer`` does that after the backward,
on the local tensors (``DTensor.to_local()``), in buckets like DDP's:

    for each bucket b of this rank's local gradients (reverse parameter order, about ``bucket_mb`` each):
        fp32:       g_b = all_reduce(g_b / R)                          float32 sum over the R replicas
        grad_comm:  g_b = (deq(msg_0) + ... + deq(msg_{R-1})) / R      ``_compress``'s codec, rank order

so each replica ends with the same averaged gradient, as DDP gives it: with R = 2 the float32 mean is the DDP mean
bit for bit (``(a + b) / 2`` either way round), and with a recipe's ``grad_comm`` the mean of the decoded messages
equals ``mean_r fake_quantize(g_r)`` (one scale per bucket for fp8, MX blocks along the flat bucket), as under the
DDP hook.  The buckets differ from DDP's (they hold local shards), so a shared fp8 scale or a stochastic-rounding
stream is per this reducer's bucket, not per DDP's.  ``bytes_sent`` counts what a ring implementation sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..recipes import GradComm
from ._compress import CompressState, ring_allreduce_bytes, start_compressed_mean


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same tensor object every call: error-feedback residuals are keyed by it)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class GradReducer:
    """Average the gradients of ``params`` over ``group`` (module docstring); ``grad_comm``: the recipe's wire
    format (None: float32); ``seed``: its stochastic-rounding seed."""

    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, *,
                 grad_comm: GradComm | None = None, seed: int = 0, bucket_mb: float = 25.0) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group)
        self.state = None if grad_comm is None else CompressState(
            grad_comm.spec, rounding=grad_comm.rounding, seed=seed, error_feedback=grad_comm.error_feedback,
            process_group=group)
        self.cap = int(bucket_mb * 2**20)
        self.bytes_sent = 0
        """Bytes this rank sent in the last ``reduce``."""

    def _buckets(self) -> list[list[torch.Tensor]]:
        """The parameters with a gradient, reverse order (the order their gradients are ready), cut into buckets
        of about ``cap`` bytes of one dtype."""
        out: list[list[torch.Tensor]] = []
        size, dtype = 0, None
        for p in reversed(self.params):
            if p.grad is None:
                continue
            g = _local(p.grad)
            if not out or size + g.numel() * g.element_size() > self.cap or g.dtype != dtype:
                out.append([])
                size, dtype = 0, g.dtype
            out[-1].append(p)
            size += g.numel() * g.element_size()
        return out

    def reduce(self) -> None:
        """Average every gradient over the group, in place (collective over ``group``)."""
        if self.world == 1:
            self.bytes_sent = 0
            return
        sent = 0
        buckets = self._buckets()
        for i, bucket in enumerate(buckets):
            grads = [_local(p.grad) for p in bucket]  # type: ignore[arg-type]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.state is None:
                flat.div_(self.world)
                dist.all_reduce(flat, group=self.group)
                sent += ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world)
                mean = flat
            else:
                work, finish = start_compressed_mean(self.state, flat.to(torch.float32), i,
                                                     [_local(p) for p in bucket], i == len(buckets) - 1, flat.dtype)
                work.wait()
                mean = finish()
            with torch.no_grad():
                for g, piece in zip(grads, mean.split([g.numel() for g in grads]), strict=True):
                    g.copy_(piece.view_as(g))
        self.bytes_sent = sent if self.state is None else self.state.bytes_sent  # the codec's count of this step
