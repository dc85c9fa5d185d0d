"""Distributed low-precision training: DDP gradient compression hooks and FSDP2 integration.

* ``compress_hook(spec, ...)``: a DDP communication hook that averages gradients sent in any lowprec format
  (bf16, fp16, fp8 with one shared scale per bucket, MX, NVFP4), nearest or stochastic rounding, optional error
  feedback, counting the bytes sent; works on gloo and NCCL.
* ``shard_model(model, recipe)``: ``fully_shard`` with the recipe's ``MixedPrecisionPolicy`` and optional
  low-precision weight all-gather (fp8 / MX codes and scales); ``sync_amax_histories`` keeps delayed scaling
  identical on every rank.
* ``simulate_reduction(world, algorithm=..., payload=..., accumulate=...)``: the exact result of all-reducing
  ``world`` ranks' gradients (ring, tree, recursive halving, all-to-all, gradient accumulation) for up to 10^6
  ranks on one machine, against the float64 sum and the rounding-error analysis (``docs/reductions.md``).
* ``Pipeline(model, loss_fn=..., microbatches=M, schedule="gpipe" | "1f1b")``: pipeline parallelism on
  ``torch.distributed.pipelining``, stage r of ``split_stages(model, ...)`` on rank r, emulated numerics equal to
  one process accumulating gradients over the same microbatches (``accumulate_step``).
* ``tensor_parallel(model, mesh, sequence_parallel=...)``: Megatron tensor (and sequence) parallelism with
  ``parallelize_module`` styles for ``EmulatedLinear`` (``EmulatedColwiseParallel``, ``EmulatedRowwiseParallel``;
  plans ``gpt_plan``, ``llama_plan``, ``gpt2_plan``): DTensor parameters, local emulated GEMMs, scales and
  stochastic-rounding draws as one process computes them.  ``full_model_state`` / ``full_optimizer_state`` (and
  their ``load_*``): one process's state dicts of a TP model, exact also when FSDP2 shards it further.
* ``GradReducer(params, group, grad_comm=...)``: data-parallel gradient averaging over a sub-group (the replicas of
  a TP group or of a pipeline stage), in the recipe's communication format.

Runs launched with ``lowprec run`` (``parallel.strategy = "ddp" | "fsdp2"``) use these for you.
"""

from ._compress import CompressState as CompressState
from ._compress import compress_allreduce_hook as compress_allreduce_hook
from ._compress import compress_hook as compress_hook
from ._compress import rounding_seed as rounding_seed
from ._dp_reduce import GradReducer as GradReducer
from ._fsdp import allgather_bytes as allgather_bytes
from ._fsdp import allgather_stats as allgather_stats
from ._fsdp import amax_histories as amax_histories
from ._fsdp import mixed_precision_policy as mixed_precision_policy
from ._fsdp import shard_model as shard_model
from ._fsdp import sync_amax_histories as sync_amax_histories
from ._pipeline import Pipeline as Pipeline
from ._pipeline import accumulate_step as accumulate_step
from ._pp_split import StageModule as StageModule
from ._pp_split import pipeline_pieces as pipeline_pieces
from ._pp_split import split_microbatches as split_microbatches
from ._pp_split import split_stages as split_stages
from ._simulate import ReductionResult as ReductionResult
from ._simulate import gaussian_gradients as gaussian_gradients
from ._simulate import predicted_rel_l2 as predicted_rel_l2
from ._simulate import simulate_reduction as simulate_reduction
from ._tensor_parallel import EmulatedColwiseParallel as EmulatedColwiseParallel
from ._tensor_parallel import EmulatedRowwiseParallel as EmulatedRowwiseParallel
from ._tensor_parallel import SequenceBoundary as SequenceBoundary
from ._tensor_parallel import SequenceParallelNorm as SequenceParallelNorm
from ._tensor_parallel import check_tp_linear as check_tp_linear
from ._tensor_parallel import gpt2_plan as gpt2_plan
from ._tensor_parallel import gpt_plan as gpt_plan
from ._tensor_parallel import llama_plan as llama_plan
from ._tensor_parallel import tensor_parallel as tensor_parallel
from ._tensor_parallel import tp_stats as tp_stats
from ._tp_state import distribute_full as distribute_full
from ._tp_state import full_model_state as full_model_state
from ._tp_state import full_optimizer_state as full_optimizer_state
from ._tp_state import full_tensor as full_tensor
from ._tp_state import load_full_model_state as load_full_model_state
from ._tp_state import load_full_optimizer_state as load_full_optimizer_state

__all__ = [
    "CompressState",
    "EmulatedColwiseParallel",
    "EmulatedRowwiseParallel",
    "GradReducer",
    "Pipeline",
    "ReductionResult",
    "SequenceBoundary",
    "SequenceParallelNorm",
    "StageModule",
    "allgather_bytes",
    "allgather_stats",
    "check_tp_linear",
    "accumulate_step",
    "amax_histories",
    "compress_allreduce_hook",
    "compress_hook",
    "distribute_full",
    "full_model_state",
    "full_optimizer_state",
    "full_tensor",
    "gaussian_gradients",
    "gpt2_plan",
    "gpt_plan",
    "llama_plan",
    "load_full_model_state",
    "load_full_optimizer_state",
    "mixed_precision_policy",
    "pipeline_pieces",
    "predicted_rel_l2",
    "rounding_seed",
    "shard_model",
    "simulate_reduction",
    "split_microbatches",
    "split_stages",
    "sync_amax_histories",
    "tensor_parallel",
    "tp_stats",
]
