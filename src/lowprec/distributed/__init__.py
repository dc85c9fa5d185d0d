"""Distributed low-precision training: DDP gradient compression hooks and FSDP2 integration.

* ``compress_hook(spec, ...)``: a DDP communication hook that averages gradients sent in any lowprec format
  (bf16, fp16, fp8 with one shared scale per bucket, MX, NVFP4), nearest or stochastic rounding, optional error
  feedback, counting the bytes sent; works on gloo and NCCL.
* ``shard_model(model, recipe)``: ``fully_shard`` with the recipe's ``MixedPrecisionPolicy`` and optional
  low-precision weight all-gather (fp8 / MX codes and scales); ``sync_amax_histories`` keeps delayed scaling
  identical on every rank.

Runs launched with ``lowprec run`` (``parallel.strategy = "ddp" | "fsdp2"``) use these for you.
"""

from ._compress import CompressState as CompressState
from ._compress import compress_allreduce_hook as compress_allreduce_hook
from ._compress import compress_hook as compress_hook
from ._compress import rounding_seed as rounding_seed
from ._fsdp import allgather_bytes as allgather_bytes
from ._fsdp import allgather_stats as allgather_stats
from ._fsdp import amax_histories as amax_histories
from ._fsdp import mixed_precision_policy as mixed_precision_policy
from ._fsdp import shard_model as shard_model
from ._fsdp import sync_amax_histories as sync_amax_histories

__all__ = [
    "CompressState",
    "allgather_bytes",
    "allgather_stats",
    "amax_histories",
    "compress_allreduce_hook",
    "compress_hook",
    "mixed_precision_policy",
    "rounding_seed",
    "shard_model",
    "sync_amax_histories",
]
