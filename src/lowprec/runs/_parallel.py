"""The process's place in a data-parallel run: rank, world size, and the few collectives the runner needs.

Single-process runs use ``World()`` (every method is a no-op).  Under torchrun, ``init_world`` reads ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``, initialises the default process group (gloo on CPU, NCCL on GPU) and wraps the
model for the configured strategy.

Data parallelism splits each global batch: the task's batch for a step is the same on every rank (a pure
function of (seed, step)), and rank ``r`` of ``W`` trains on rows ``[r B/W, (r+1) B/W)``.  With equal shards, the
mean of the per-rank mean losses is the global mean loss, so DDP's averaged gradient equals the single-process
gradient up to the order of the floating-point additions.

Under a tensor- or pipeline-parallel layout (``World.layout``, ``_mesh``) ``init_world`` also builds the run's
``DeviceMesh``; the batch is split over the data-parallel ranks only (``dp_rank`` of ``dp_size``), ``wrap_model``
applies tensor parallelism over ``mesh["tp"]`` (then FSDP2 over ``mesh["dp_shard"]``, HSDP over ``mesh["dp_replicate",
"dp_shard"]``, or gradient averaging over ``mesh["dp_replicate"]``), and a pipeline is the runner's
(``_pp_runner``, its replicas' gradients averaged over ``mesh["dp_replicate"]``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import UsageError
from ..recipes import Recipe
from ._mesh import Layout, build_mesh


@dataclasses.dataclass(frozen=True)
class World:
    """Rank and size of the data-parallel world (a single process by default)."""

    rank: int = 0
    size: int = 1
    strategy: str = "single"
    mesh_shape: tuple[int, int] | None = None
    """"hsdp": (replicas, shards)."""
    layout: Layout | None = None
    """A tensor- or pipeline-parallel layout (``_mesh``); None: data parallelism over every rank."""
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The ``DeviceMesh`` of ``layout`` (dimensions ``_mesh.MESH_DIMS``)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which batch shard this rank trains on: TP and PP peers train on the same rows."""
        return self.rank if self.layout is None else self.layout.dp_index(self.rank)

    @property
    def dp_size(self) -> int:
        """How many batch shards there are."""
        return self.size if self.layout is None else self.layout.dp

    @property
    def tp(self) -> int:
        return 1 if self.layout is None else self.layout.tp

    @property
    def pp(self) -> int:
        return 1 if self.layout is None else self.layout.pp

    @property
    def distributed(self) -> bool:
        return self.size > 1 or dist.is_initialized()

    def shard(self, batch: Any, index: int | None = None) -> Any:
        """This rank's rows of a global batch (tensors split along dim 0; tuples/lists/dicts element-wise);
        ``index``: another rank's rows (a rerun computing that rank's shard).  Under a TP or PP layout the batch
        is split over the data-parallel ranks only (``dp_rank`` of ``dp_size``), and ``index`` is a rank."""
        size = self.dp_size
        if size == 1:
            return batch
        index = self.dp_rank if index is None else (index if self.layout is None else self.layout.dp_index(index))
        return _rows(batch, index, size)

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor (the value itself on one process)."""
        v = value.detach().to(torch.float64).reshape(1).clone()
        if self.distributed:
            dist.all_reduce(v)
            v /= self.size
        return float(v)

    def mean_and_any(self, value: torch.Tensor, flag: bool) -> tuple[float, bool]:
        """The mean over ranks of a scalar tensor and whether ``flag`` is set on any rank: one all-reduce."""
        v = torch.cat([value.detach().to(torch.float64).reshape(1), torch.tensor([float(flag)], dtype=torch.float64,
                                                                                 device=value.device)])
        if self.distributed:
            dist.all_reduce(v)
            v[0] /= self.size
        return float(v[0]), bool(v[1] > 0)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

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


def _rows(batch: Any, index: int, size: int) -> Any:
    """Shard ``index`` of ``size`` of a batch: tensors split along dim 0, containers element-wise."""
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0]
        if n % size:
            raise UsageError(f"a batch of {n} rows cannot be split evenly over {size} ranks; "
                             f"choose batch_size divisible by parallel.world_size")
        k = n // size
        return batch[index * k:(index + 1) * k]
    if isinstance(batch, tuple | list):
        return type(batch)(_rows(b, index, size) for b in batch)
    if isinstance(batch, dict):
        return {k: _rows(v, index, size) for k, v in batch.items()}
    return batch


@dataclasses.dataclass
class Wrapped:
    """The model as trained, and the per-step hooks its layout needs."""

    model: torch.nn.Module
    comm_bytes: Callable[[], int] | None = None
    """Bytes this rank sent for gradients (DDP) or received in weight all-gathers (FSDP2) in the last step."""
    after_backward: Callable[[], None] = lambda: None
    """Called after every backward: MAX all-reduce of the delayed-scaling amax histories."""
    hook_state: Any = None
    """DDP's gradient-compression hook state (``CompressState``), whose step counter and error-feedback residuals a
    rerun of a step must restore (``_replay.Snapshot``)."""


def wrap_model(model: torch.nn.Module, recipe: Recipe, world: World) -> Wrapped:
    """Single: the model itself.  "ddp": DistributedDataParallel (buffers not broadcast: amax histories are
    MAX-reduced after each backward instead, so every rank scales with the global amax, as one process would),
    with the recipe's gradient compression hook if it has one.  "fsdp2": ``shard_model`` (fully_shard with the
    recipe's mixed-precision policy)."""
    if world.strategy == "single" or not world.distributed:
        return Wrapped(model)
    if world.layout is not None and world.tp > 1:
        return _tensor_parallel(model, recipe, world)
    if world.layout is not None and world.pp > 1:
        return Wrapped(model)  # the runner builds its Pipeline over the model (``_pp_runner``)
    from ..distributed import allgather_bytes, compress_hook, shard_model, sync_amax_histories
    from ..distributed._compress import ring_allreduce_bytes
    from ..nn import EmulatedLinear

    def amax_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    for m in model.modules():  # first-step delayed scales from the global batch (EmulatedLinear.amax_reduce);
        if isinstance(m, EmulatedLinear):  # every layer: a fallback can move one to delayed scaling later
            m.amax_reduce = amax_max

    def sync() -> None:
        sync_amax_histories(unwrap(wrapped))

    if world.strategy in ("fsdp2", "hsdp"):
        if world.strategy == "hsdp":  # replicate over mesh dim 0, shard over dim 1; float32 gathers
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device, world.mesh_shape or (1, world.size), mesh_dim_names=("replicate", "shard"))
            wrapped = shard_model(model, recipe, mesh=mesh, lowp_all_gather=False)
        else:
            wrapped = shard_model(model, recipe)
        return Wrapped(wrapped, lambda: allgather_bytes(wrapped, reset=True), sync)
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, forward_sync_buffers=False)
    g = recipe.grad_comm
    if g is None:
        nbytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        return Wrapped(wrapped, lambda: ring_allreduce_bytes(nbytes, world.size), sync)
    state, hook = compress_hook(g.spec, rounding=g.rounding, seed=recipe.seed, error_feedback=g.error_feedback)
    wrapped.register_comm_hook(state, hook)
    return Wrapped(wrapped, lambda: state.bytes_sent, sync, hook_state=state)


def _tensor_parallel(model: torch.nn.Module, recipe: Recipe, world: World) -> Wrapped:
    """TP over the mesh's "tp" dimension (``lowprec.distributed.tensor_parallel``, the model's plan): DTensor
    weights, tensorwise amaxes MAX-reduced over the TP group, delayed histories synchronised after every backward.
    With data-parallel ranks, the replicas and shards of each TP group:

    * "fsdp2" (dp_shard ranks): FSDP2 shards the TP DTensors over the "dp_shard" dimension (2-D parameters,
      float32 all-gathers, float32 reduce-scatters);
    * "hsdp" (dp_replicate x dp_shard): the same over the 2-D ("dp_replicate", "dp_shard") mesh, FSDP2's HSDP;
    * "ddp" (dp_replicate ranks): every parameter replicated; after each backward ``GradReducer`` averages the
      local gradients over the "dp_replicate" group, in the recipe's ``grad_comm`` format (float32 without one).

    and amaxes and histories are MAX-reduced over every rank.  ``comm_bytes``: what the TP collectives sent plus
    what FSDP2 gathered (or the gradient averaging sent) in the last step.  Under a pipeline (``pp`` > 1) only TP
    is applied here; ``_pp_runner.build_pipeline`` adds the replicas' averaging and the amax syncs per stage."""
    from ..distributed import GradReducer, allgather_bytes, shard_model, sync_amax_histories, tensor_parallel, tp_stats
    from ..nn import EmulatedLinear

    assert world.layout is not None and world.mesh is not None
    layout = world.layout
    if layout.pp > 1:  # TP inside pipeline stages: the stages, replicas and amax syncs are _pp_runner's
        tensor_parallel(model, world.mesh["tp"], sequence_parallel=layout.sequence_parallel, recipe=recipe)
        return Wrapped(model)
    data_parallel = layout.dp > 1

    def amax_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    if data_parallel:
        for m in model.modules():  # first-step delayed scales from the global batch, as under FSDP2 alone
            if isinstance(m, EmulatedLinear):
                m.amax_reduce = amax_max
    mesh = world.mesh["tp"]
    tensor_parallel(model, mesh, sequence_parallel=layout.sequence_parallel, recipe=recipe)
    group = None if data_parallel else mesh.get_group()
    reducer = None
    sharded = world.strategy in ("fsdp2", "hsdp") and data_parallel
    if sharded:  # "hsdp": FSDP2 on the 2-D mesh whatever its degrees (a degree of 1 included)
        dp_mesh = world.mesh["dp_replicate", "dp_shard"] if world.strategy == "hsdp" else world.mesh["dp_shard"]
        model = shard_model(model, recipe, mesh=dp_mesh, lowp_all_gather=False)
    elif data_parallel:
        reducer = GradReducer(list(model.parameters()), world.mesh["dp_replicate"].get_group(),
                              grad_comm=recipe.grad_comm, seed=recipe.seed)
    seen = [0]

    def sent() -> int:
        total = sum(tp_stats(model).values())
        step, seen[0] = total - seen[0], total
        if reducer is not None:
            return step + reducer.bytes_sent
        return step + (allgather_bytes(model, reset=True) if sharded else 0)

    def after_backward() -> None:
        if reducer is not None:
            reducer.reduce()
        sync_amax_histories(model, group)

    return Wrapped(model, sent, after_backward)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper."""
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ


def init_world(strategy: str, backend: str = "auto", mesh_shape: tuple[int, int] | None = None, *,
               layout: Layout | None = None) -> World:
    """Initialise the default process group from torchrun's environment (idempotent); with a TP or PP ``layout``
    (``_mesh.layout_of(config.parallel)``) also its ``DeviceMesh``."""
    if not launched_by_torchrun():
        raise UsageError(f"parallel.strategy {strategy!r} needs torchrun: use `lowprec run CONFIG` (it launches "
                         "torchrun itself) or `torchrun --nproc-per-node N -m lowprec.train CONFIG`")
    if not dist.is_initialized():
        chosen = resolve_backend(backend)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # a rank stuck in a collective (e.g. a peer lost during an elastic restart) fails after this many seconds
        # instead of gloo's 30-minute default, so torchrun can restart the group or give up
        timeout = datetime.timedelta(seconds=float(os.environ.get("LOWPREC_DIST_TIMEOUT_S", "600")))
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(chosen, timeout=timeout)
        else:
            dist.init_process_group(chosen, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    if layout is not None and not layout.model_parallel:
        layout = None
    if layout is not None:  # the layout's degrees replace "hsdp"'s (replicas, shards) of the data-parallel ranks
        mesh_shape = None
    world = World(rank=dist.get_rank(), size=dist.get_world_size(), strategy=strategy, mesh_shape=mesh_shape,
                  layout=layout)
    if layout is not None:
        if layout.world_size != world.size:
            raise UsageError(f"the layout {layout.describe()} needs {layout.world_size} processes but torchrun "
                             f"started {world.size}: set parallel.world_size = {layout.world_size}")
        world = dataclasses.replace(world, mesh=build_mesh(layout, "cuda" if dist.get_backend() == "nccl" else "cpu"))
    elif mesh_shape is not None and mesh_shape[0] * mesh_shape[1] != world.size:
        raise UsageError(f"parallel.mesh_shape {list(mesh_shape)} does not match the {world.size} processes "
                         "torchrun started")
    return world


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store under a prefix unique to this restart attempt, when torchrun shares its agent store.

    torchrun's c10d rendezvous keeps one TCP store for all restart rounds and its workers connect to it without a
    per-attempt prefix (torch 2.13, ``_create_c10d_store``): after an elastic restart, gloo's connectFullMesh can
    read the address a killed rank published in the previous attempt and fail with "Connection refused", or wait
    for it until the connect timeout.  Keys under ``lowprec/attempt_<TORCHELASTIC_RESTART_COUNT>`` cannot be stale.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lowprec/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def resolve_device(device: str) -> str:
    """A run config's ``device`` as "cpu" or "cuda": "auto" is CUDA when available, else CPU; "cuda" without a usable
    GPU is a UsageError (raised before any work) saying how to fix the config."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("device = \"cuda\" but this machine has no usable CUDA GPU (torch.cuda.is_available() is "
                         f"False; torch {torch.__version__}, built for CUDA {torch.version.cuda}): set device = "
                         "\"cpu\" or \"auto\", or run on a machine with a GPU and a CUDA build of torch")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be one of 'auto', 'cpu', 'cuda'; got {device!r}")
    return device


def world_device(device: str, world: World) -> torch.device:
    """The device this process trains on: ``resolve_device`` in one process; under data parallelism the process
    group's (this rank's GPU with NCCL, the CPU with gloo), with a UsageError when ``device`` says otherwise."""
    if not world.distributed:
        chosen = resolve_device(device)
        return torch.device("cuda", torch.cuda.current_device()) if chosen == "cuda" else torch.device("cpu")
    backend = dist.get_backend()
    if backend == "nccl":
        if device == "cpu":
            raise UsageError("device = \"cpu\" but the process group uses NCCL, which needs CUDA tensors: set "
                             "parallel.backend = \"gloo\" (lowprec run does so itself for device = \"cpu\")")
        return torch.device("cuda", torch.cuda.current_device())
    if device == "cuda":
        raise UsageError(f"device = \"cuda\" under data parallelism needs parallel.backend = \"nccl\" (or "
                         f"\"auto\"); the process group uses {backend!r}")
    return torch.device("cpu")


def resolve_backend(backend: str, device: str | None = None) -> str:
    """"auto" is NCCL when the run trains on CUDA (``device``; None: when CUDA is available), else gloo; an
    unavailable backend, or NCCL for a CPU run, is a clear error."""
    cuda = torch.cuda.is_available() if device is None else resolve_device(device) == "cuda"
    if backend == "auto":
        return "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and device is not None and not cuda and torch.cuda.is_available():
        raise UsageError("parallel.backend 'nccl' needs CUDA tensors but device = \"cpu\": use backend 'gloo' or "
                         "'auto', or device = \"cuda\"")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise UsageError("parallel.backend 'nccl' needs CUDA GPUs and a torch build with NCCL; this machine has "
                         f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}: use 'gloo' or 'auto'")
    if backend == "gloo" and not dist.is_gloo_available():
        raise UsageError("parallel.backend 'gloo' is not available in this torch build; use 'nccl' or 'auto'")
    return backend
