"""The layout of a run on a device mesh: pipeline, data (replicate and shard) and tensor parallel degrees.

A run config's ``[parallel]`` table names torchtitan's four degrees (``pipeline_parallel_degree``,
``data_parallel_replicate_degree``, ``data_parallel_shard_degree``, ``tensor_parallel_degree``) as ``pp``,
``dp_replicate``, ``dp_shard`` and ``tp``; ``Layout`` is their resolved form, with

    world_size = pp * dp_replicate * dp_shard * tp

and the processes arranged on a 4-D ``DeviceMesh`` with named dimensions ``("pp", "dp_replicate", "dp_shard",
"tp")``, tensor parallelism innermost (the ranks of a TP group are adjacent, as on one node's NVLink):

    rank = ((pp_index * dp_replicate + replicate_index) * dp_shard + shard_index) * tp + tp_index

Data is sharded over the data-parallel dimensions only: the ``dp = dp_replicate * dp_shard`` data-parallel ranks
each train on ``batch_size / dp`` rows (``dp_index = replicate_index * dp_shard + shard_index``), and every rank of
a TP group and of a pipeline sees the same rows.  A pipeline cuts those rows into ``microbatches`` equal pieces.

The older form stays valid and means what it meant: ``strategy = "ddp" | "fsdp2"`` with ``world_size = W`` is
``dp_replicate = W`` or ``dp_shard = W``; ``strategy = "hsdp"`` with ``mesh_shape = [R, S]`` is ``dp_replicate =
R, dp_shard = S``.  With ``tp`` or ``pp`` the strategy says what the data-parallel ranks do (replicate or shard),
and ``dp_replicate`` / ``dp_shard``, when given, must agree with it.

``check_model_layout`` runs the checks that need the model (TP divisibility and block alignment through the TP
plan, the number of pipeline pieces, the batch size) in the launching process, before any worker starts.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from .._errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._config import ParallelConfig, RunConfig
    from .zoo import Task

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The device mesh's dimension names, outermost first."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """The resolved degrees of a run (``layout_of``); every degree >= 1, their product the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    microbatches: int = 1
    """Microbatches per step of a pipeline (1 without one)."""
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel ranks (batch shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's shape, in ``MESH_DIMS`` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def model_parallel(self) -> bool:
        """Whether the model itself is split (TP or PP), not only the batch."""
        return self.tp > 1 or self.pp > 1

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each mesh dimension (the module docstring's rank formula, inverted)."""
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        out = {}
        for name, size in zip(reversed(MESH_DIMS), reversed(self.shape), strict=True):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def dp_index(self, rank: int) -> int:
        """Which batch shard ``rank`` trains on (0 .. dp-1)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        """E.g. ``"pp2 x dp_shard2 x tp2"`` (degrees above 1; ``"1 process"`` for none)."""
        parts = [f"{n}{s}" for n, s in zip(MESH_DIMS, self.shape, strict=True) if s > 1]
        return " x ".join(parts) or "1 process"


def layout_of(p: ParallelConfig) -> Layout:
    """The ``Layout`` a (validated) ``ParallelConfig`` describes (module docstring)."""
    tp, pp = p.tp, p.pp
    dp = p.world_size // (tp * pp)
    if p.strategy == "hsdp":
        rep, shard = p.mesh_shape if p.mesh_shape is not None else (p.dp_replicate or 1, p.dp_shard or dp)
    elif p.strategy == "fsdp2":
        rep, shard = 1, dp
    else:  # "single", "ddp"
        rep, shard = dp, 1
    return Layout(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, microbatches=(p.microbatches or pp) if pp > 1 else 1,
                  pp_schedule=p.pp_schedule, sequence_parallel=p.sequence_parallel)


def check_degrees(p: ParallelConfig) -> None:
    """The checks of ``[parallel]``'s degrees that need no model (``ParallelConfig.__post_init__`` calls this):
    ``UsageError`` naming the field and the fix."""
    tp, pp = p.tp, p.pp
    if tp * pp > 1 and p.strategy == "single":
        raise UsageError(f"parallel.tp = {tp} and parallel.pp = {pp} need several processes: set parallel.strategy "
                         f"= \"ddp\" (or \"fsdp2\": what the data-parallel ranks do) and parallel.world_size = "
                         f"{tp * pp} (x the data-parallel degree)")
    if p.world_size % (tp * pp):
        raise UsageError(f"parallel.world_size = {p.world_size} is not divisible by parallel.tp x parallel.pp = "
                         f"{tp} x {pp}: world_size = pp x dp_replicate x dp_shard x tp; use a multiple of {tp * pp}")
    if pp == 1 and p.microbatches is not None:
        raise UsageError(f"parallel.microbatches = {p.microbatches} is for pipeline parallelism; set parallel.pp "
                         "> 1 or leave microbatches out")
    if tp == 1 and p.sequence_parallel:
        raise UsageError("parallel.sequence_parallel = true needs tensor parallelism: set parallel.tp > 1 or "
                         "leave sequence_parallel out")
    if pp > 1 and p.pp_schedule == "1f1b" and (p.microbatches or pp) < pp:
        raise UsageError(f"parallel.pp_schedule \"1f1b\" needs at least as many microbatches as stages ({pp}); got "
                         f"parallel.microbatches = {p.microbatches}: raise it or use pp_schedule = \"gpipe\"")
    _check_dp(p, p.world_size // (tp * pp))


def _check_dp(p: ParallelConfig, dp: int) -> None:
    """``dp_replicate`` / ``dp_shard`` / ``mesh_shape`` against the strategy and the data-parallel degree."""
    rep, shard = p.dp_replicate, p.dp_shard
    where = f"(parallel.world_size {p.world_size} / (tp {p.tp} x pp {p.pp}))"
    if p.strategy == "hsdp" and p.mesh_shape is not None:
        m = p.mesh_shape
        if m[0] * m[1] != dp:
            raise UsageError(f"parallel.mesh_shape {list(m)} has {m[0] * m[1]} ranks but the data-parallel degree "
                             f"is {dp} {where}: make replicas x shards equal it")
        for field, v, want in (("dp_replicate", rep, m[0]), ("dp_shard", shard, m[1])):
            if v is not None and v != want:
                raise UsageError(f"parallel.{field} = {v} but parallel.mesh_shape says {want}; give one of them")
    elif p.strategy == "hsdp":
        if rep is None or shard is None or rep * shard != dp:
            raise UsageError(f"parallel.strategy \"hsdp\" needs parallel.mesh_shape = [replicas, shards] (or "
                             f"dp_replicate and dp_shard) whose product is the data-parallel degree {dp} {where}; "
                             f"got dp_replicate = {rep}, dp_shard = {shard}")
    else:
        want_rep, want_shard = (1, dp) if p.strategy == "fsdp2" else (dp, 1)
        for field, v, want in (("dp_replicate", rep, want_rep), ("dp_shard", shard, want_shard)):
            if v is not None and v != want:
                other = "fsdp2" if field == "dp_shard" else "ddp"
                fix = (f"set parallel.strategy = \"{other}\" (or \"hsdp\" to replicate and shard)"
                       if v > 1 and want == 1 else f"leave it out (it follows from the world size: {want})")
                raise UsageError(f"parallel.{field} = {v} does not fit parallel.strategy {p.strategy!r} with "
                                 f"world_size {p.world_size}, tp {p.tp}, pp {p.pp} (which makes {field} = {want}): "
                                 f"{fix}")


def check_supported(config: RunConfig) -> None:
    """``UsageError`` for layouts the runner does not train (yet): each names the field and what to change.

    Trained: TP alone, or with data-parallel replicas ("ddp": gradients averaged over ``dp_replicate``), shards
    ("fsdp2") or both ("hsdp"); PP alone, with TP inside its stages, and either with replicas ("ddp").  Refused:
    FSDP2 shards inside pipeline stages, and what a split model cannot do (below)."""
    p, layout = config.parallel, layout_of(config.parallel)
    if not layout.model_parallel:
        return
    what = " and ".join(f"parallel.{k} = {v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1)
    if p.pp > 1 and layout.dp_shard > 1:
        raise UsageError(f"{what} with parallel.strategy {p.strategy!r} (dp_shard = {layout.dp_shard}): the runner "
                         "composes pipelines with replicated data parallelism only (each stage's gradients averaged "
                         "over its replicas), not FSDP2 shards inside the stages; set parallel.strategy = \"ddp\"")
    r = config.recipe
    if r.fallback is not None:
        raise UsageError(f"{what}: recipe.fallback swaps layers while training, which a split model cannot "
                         "follow; remove the recipe's fallback or use a data-parallel layout")
    if r.weights.update == "kahan":
        raise UsageError(f"{what}: recipe.weights.update = 'kahan' keeps a compensation buffer per local shard, "
                         "which the split model's checkpoints (one process's full state) do not gather; use "
                         "\"stochastic\" (bf16-sr: draws by global element, tested against one process), master or "
                         "nearest weight updates, or a data-parallel layout")
    from ..reliability._config import ReliabilityConfig

    if config.faults or config.reliability != ReliabilityConfig() or config.stats.every is not None:
        raise UsageError(f"{what}: [reliability], [[faults]] and [stats] rerun, replay and observe whole-model "
                         "steps and tensors, which a split model does not have on any one rank; remove them or use "
                         "a data-parallel layout")


def check_model_layout(config: RunConfig, task: Task, batch_size: int) -> None:
    """The checks that need the model, in the launching process before any worker starts: the batch divisible by
    dp x microbatches, the TP plan's rules (heads, linear dimensions, MX blocks inside shards) on a converted copy
    of the model, and the pipeline's stages (at most as many as the model has pieces, no tied weights across
    stages, a batch of (inputs, targets))."""
    layout = layout_of(config.parallel)
    if not layout.model_parallel:
        return  # data parallelism: _launch.preflight checks the batch
    check_supported(config)
    n = layout.dp * layout.microbatches
    if batch_size % n:
        per = f"dp {layout.dp} x microbatches {layout.microbatches}" if layout.pp > 1 else f"dp {layout.dp}"
        raise UsageError(f"batch_size {batch_size} is not divisible by {per} = {n}: each data-parallel rank trains "
                         f"on batch_size / dp rows{', cut into microbatches' if layout.pp > 1 else ''}; use a "
                         f"multiple of {n}")
    from ..nn import convert

    model = convert(copy.deepcopy(task.model), config.recipe)
    if layout.tp > 1:
        _check_tp(model, layout)
    if layout.pp > 1:
        _check_pp(model, task, layout)


def _check_tp(model: Any, layout: Layout) -> None:
    """The plan ``tensor_parallel`` would apply, built (and so checked) without a process group: ``gpt_plan`` for
    the zoo GPT, ``gpt2_plan`` for a transformers GPT-2 (``*.attn.c_attn``), ``llama_plan`` otherwise."""
    import fnmatch

    from torch import nn

    from ..distributed import gpt2_plan, gpt_plan, llama_plan

    try:
        if isinstance(getattr(model, "blocks", None), nn.ModuleList):
            gpt_plan(model, tp=layout.tp, sequence_parallel=layout.sequence_parallel)
            return
        if layout.sequence_parallel:
            raise UsageError("sequence parallelism needs the zoo GPT's plan (gpt_plan); set "
                             "sequence_parallel = false")
        gpt2 = any(fnmatch.fnmatchcase(n, "*.attn.c_attn") for n, _ in model.named_modules())
        (gpt2_plan if gpt2 else llama_plan)(model, tp=layout.tp)
    except UsageError as e:
        raise UsageError(f"parallel.tp = {layout.tp}: {e}") from None


def _check_pp(model: Any, task: Task, layout: Layout) -> None:
    import torch

    from ..distributed import split_stages

    batch = task.train_batch(0)
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(b, torch.Tensor) for b in batch)):
        raise UsageError(f"parallel.pp = {layout.pp}: a pipeline feeds one input tensor to stage 0 and the target "
                         f"to the last stage; task {task.name!r} gives batches of {type(batch).__name__}, not "
                         "(inputs, targets)")
    try:
        split_stages(model, n_stages=layout.pp)
    except UsageError as e:
        raise UsageError(f"parallel.pp = {layout.pp}: {e}") from None


def build_mesh(layout: Layout, device: str) -> DeviceMesh:
    """The run's ``DeviceMesh`` (collective: every rank calls it), dimensions ``MESH_DIMS``."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, layout.shape, mesh_dim_names=MESH_DIMS)
