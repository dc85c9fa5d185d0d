"""The process's place in a data-parallel run: rank, world size, and the few collectives the runner needs.

Single-process runs use ``World()`` (every method is a no-op).  Under torchrun, ``init_world`` reads ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``, initialises the default process group (gloo on CPU, NCCL on GPU) and wraps the
model for the configured strategy.

Data parallelism splits each global batch: the task's batch for a step is the same on every rank (a pure
function of (seed, step)), and rank ``r`` of ``W`` trains on rows ``[r B/W, (r+1) B/W)``.  With equal shards, the
mean of the per-rank mean losses is the global mean loss, so DDP's averaged gradient equals the single-process
gradient up to the order of the floating-point additions.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class World:
    """Rank and size of the data-parallel world (a single process by default)."""

    rank: int = 0
    size: int = 1
    strategy: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1 or dist.is_initialized()

    def shard(self, batch: Any) -> Any:
        """This rank's rows of a global batch (tensors split along dim 0; tuples/lists/dicts element-wise)."""
        if self.size == 1:
            return batch
        if isinstance(batch, torch.Tensor):
            n = batch.shape[0]
            if n % self.size:
                raise ValueError(f"a batch of {n} rows cannot be split evenly over {self.size} ranks; "
                                 f"choose batch_size divisible by parallel.world_size")
            k = n // self.size
            return batch[self.rank * k:(self.rank + 1) * k]
        if isinstance(batch, tuple | list):
            return type(batch)(self.shard(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.shard(v) for k, v in batch.items()}
        return batch

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor (the value itself on one process)."""
        v = value.detach().to(torch.float64).reshape(1).clone()
        if self.distributed:
            dist.all_reduce(v)
            v /= self.size
        return float(v)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as trained: itself for one process, DistributedDataParallel for "ddp"."""
        if self.strategy == "ddp" and self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper."""
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ


def init_world(strategy: str, backend: str = "auto") -> World:
    """Initialise the default process group from torchrun's environment (idempotent)."""
    if not launched_by_torchrun():
        raise ValueError(f"parallel.strategy {strategy!r} needs torchrun: use `lowprec run CONFIG` (it launches "
                         "torchrun itself) or `torchrun --nproc-per-node N -m lowprec.train CONFIG`")
    if not dist.is_initialized():
        chosen = resolve_backend(backend)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), strategy=strategy)


def resolve_backend(backend: str) -> str:
    """"auto" is NCCL when CUDA is available, else gloo; an unavailable backend is a clear error."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("parallel.backend 'nccl' needs CUDA GPUs and a torch build with NCCL; this machine has "
                         f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}: use 'gloo' or 'auto'")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("parallel.backend 'gloo' is not available in this torch build; use 'nccl' or 'auto'")
    return backend
