"""Tensor and sequence parallelism for emulated low-precision linears, as ``parallelize_module`` styles.

``EmulatedColwiseParallel`` and ``EmulatedRowwiseParallel`` are ``torch.distributed.tensor.parallel`` styles for
``EmulatedLinear``: the weight (and a colwise bias) become DTensors sharded over the TP mesh (``Shard(0)``
colwise, ``Shard(1)`` rowwise; a fused ``[q; k; v]`` projection ``_StridedShard(0, split_factor=3)``, so that
``full_tensor()`` and distributed checkpoints see the unsharded layout; its ``state_dict`` entries are full
tensors, which DCP can store, ``_strided_checkpoint_hooks``), and the module runs its three GEMMs on
the local shards with explicit collectives (``_tp_linear``: the custom quantizers have no DTensor sharding rules).
A colwise/rowwise pair needs one reduction per pass; with ``sequence_parallel=True`` the activations between pairs
stay split along the sequence (an all-gather before colwise, a reduce-scatter after rowwise).

``SequenceParallelNorm`` runs a norm on the local sequence shard and sums its parameters' gradients over the TP
group; ``SequenceBoundary`` splits the sequence at the first parallel block and gathers it after the last.

Quantization follows one process (``_tp_shard``): tensorwise amax over the unsharded tensor (MAX all-reduce),
per-row scales from the whole rows' amaxes, block scales that never straddle a shard (``UsageError`` naming the
dimension and block size otherwise),
stochastic-rounding draws indexed by global element, delayed-scaling histories kept equal with
``sync_amax_histories(model, group)`` after every backward.

``gpt_plan`` / ``llama_plan`` / ``gpt2_plan`` build the plan for the zoo's TinyGPT, for transformers Llama-style
models and for GPT-2 (``Conv1D`` projections, weights stored [in, out]) by module name, and check every
divisibility rule before any process group exists; ``tensor_parallel(model, mesh)`` applies one.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from .. import recipes
from .._errors import UsageError
from ..nn import EmulatedLinear
from ..recipes import GradComm, Recipe
from . import _tp_comm as comm
from ._fsdp_gather import check_gather_spec
from ._tp_linear import _SHARDED, ColwiseFn, RowwiseFn, TPInfo
from ._tp_shard import ShardLayout, check_operand, split_pieces
from ._tp_state import distribute_full, full_tensor


class TensorParallelLinear(EmulatedLinear):
    """What an ``EmulatedLinear`` becomes under a TP style (its class is swapped, as ``fully_shard`` does): the
    forward runs ``_tp_linear``'s GEMMs on the local shards.  ``lowprec_tp`` holds its place in the group."""

    lowprec_tp: TPInfo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self._step_keys()
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if self.transposed_weight:  # a transformers Conv1D stores [in, out]: the GEMMs take [out, in] (contiguous)
            w = w.t().contiguous()
        b = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
        fn = ColwiseFn if self.lowprec_tp.kind == "colwise" else RowwiseFn
        return fn.apply(x, w, b, self, keys)  # type: ignore[no-any-return]


_CLASSES: dict[type, type] = {}


def _tp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelLinear, cls), {})
    return _CLASSES[cls]


def check_tp_linear(module: nn.Module, kind: str, tp: int, *, chunks: int = 1, name: str = "") -> None:
    """Raise ``UsageError`` unless ``module`` (an ``EmulatedLinear``) can be split ``kind``-wise ("colwise" or
    "rowwise") over ``tp`` ranks with one process's quantization: the sharded dimension divisible by
    ``chunks * tp`` and every operand's scaling groups inside the shards (``_tp_shard.check_operand``), on every
    rank.  Needs no process group."""
    where = f"module {name!r}" if name else type(module).__name__
    if not isinstance(module, EmulatedLinear):
        raise UsageError(f"{where}: tensor-parallel styles need an EmulatedLinear (run lowprec.convert(model, "
                         f"recipe) first); got {type(module).__name__}")
    if kind not in _SHARDED:
        raise UsageError(f"kind must be 'colwise' or 'rowwise'; got {kind!r}")
    if not isinstance(tp, int) or tp < 1:
        raise UsageError(f"the TP degree must be a positive int; got {tp!r}")
    size, dim_name = (module.out_features, "out_features") if kind == "colwise" else (module.in_features,
                                                                                      "in_features")
    if size % (chunks * tp):
        what = f"{chunks} fused parts of {size // chunks}" if chunks > 1 else str(size)
        raise UsageError(f"{where}: {kind} parallelism splits {dim_name} ({what}) over {tp} ranks, which does not "
                         f"divide it; use a TP degree that divides {size // chunks}")
    for rank in range(tp):
        pieces = split_pieces(size, rank, tp, chunks)
        for (gemm, which), dim in _SHARDED[kind].items():
            op = getattr(getattr(module.recipe, gemm), which)
            layout = ShardLayout(dim, pieces, size) if dim is not None else ShardLayout()
            check_operand(op.spec, layout, f"{where} ({kind}, TP={tp}) {gemm}.{which}", dim_name)


def _mesh_size(mesh: Any, tp: int | None, what: str) -> int:
    if getattr(mesh, "ndim", 1) != 1:
        raise UsageError(f"{what} needs a 1-D TP mesh (e.g. mesh['tp'] of a 2-D mesh); got {mesh.ndim} dimensions")
    n = int(mesh.size())
    if tp is not None and n != tp:
        raise UsageError(f"{what}: the plan was built for TP={tp} but the mesh has {n} ranks; build the plan with "
                         f"tp={n} or pass a mesh of {tp} ranks")
    return n


def _strided_checkpoint_hooks(module: nn.Module) -> None:
    """Make a fused projection's ``_StridedShard`` parameters checkpointable: torch's distributed checkpoint
    describes a DTensor shard as one contiguous chunk at the shard's offset, which strided q/k/v rows are not (it
    rejects them as overlapping chunks).  ``state_dict`` therefore holds their full tensors (an all-gather; a plain
    replicated tensor, which DCP saves once and reshards freely; ``_tp_state.full_tensor``, also exact when FSDP2
    shards the parameter further), and ``load_state_dict`` of a full tensor keeps this rank's strided rows (no
    communication)."""
    names = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]

    def save(mod: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        for n in names:
            if isinstance(state.get(prefix + n), DTensor):
                state[prefix + n] = full_tensor(state[prefix + n])

    def load(mod: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for n in names:
            t, own = state.get(prefix + n), getattr(mod, n)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and isinstance(own, DTensor):
                state[prefix + n] = distribute_full(t, own)

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def _max_reduce(group: dist.ProcessGroup, previous: Any) -> Any:
    """``EmulatedLinear.amax_reduce`` over the TP group, after any reduction already set (data parallelism)."""
    def reduce(t: torch.Tensor) -> None:
        if previous is not None:
            previous(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return reduce


class _EmulatedParallel(ParallelStyle):
    kind = ""

    def __init__(self, *, sequence_parallel: bool = False, tp: int | None = None, chunks: int = 1,
                 lowp_gather: bool | None = None, grad_comm: GradComm | None = None) -> None:
        super().__init__()
        if not isinstance(chunks, int) or chunks < 1:
            raise UsageError(f"chunks must be a positive int (3 for a fused qkv projection); got {chunks!r}")
        if lowp_gather not in (None, True, False):
            raise UsageError(f"lowp_gather must be None, True or False; got {lowp_gather!r}")
        self.sequence_parallel = bool(sequence_parallel)
        self.tp, self.chunks, self.lowp_gather, self.grad_comm = tp, chunks, lowp_gather, grad_comm

    def _placement(self, dim: int) -> Any:
        return Shard(dim) if self.chunks == 1 else _StridedShard(dim, split_factor=self.chunks)

    def _placements(self, module: EmulatedLinear) -> dict[str, list[Any]]:
        """Parameter name -> placements: the weight's out_features (colwise) or in_features (rowwise) sharded,
        a colwise bias sharded like the output, a rowwise bias replicated."""
        dim = 0 if self.kind == "colwise" else 1
        if module.transposed_weight:  # a transformers Conv1D stores [in, out]
            dim = 1 - dim
        bias = [self._placement(0)] if self.kind == "colwise" else [Replicate()]
        return {"weight": [self._placement(dim)], "bias": bias}

    def _gather_in_format(self, module: EmulatedLinear, name: str) -> bool:
        if self.kind != "colwise" or not self.sequence_parallel or self.lowp_gather is False:
            return False
        spec = module.recipe.forward.a.spec
        if spec is None:
            return False
        try:
            check_gather_spec(spec, f"{name}: LinearRecipe.forward.a.spec (the sequence-parallel input all-gather)")
        except UsageError:
            if self.lowp_gather:
                raise
            return False
        return True

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = getattr(module, "lowprec_name", "") or type(module).__name__
        world = _mesh_size(device_mesh, self.tp, f"{type(self).__name__} on {name!r}")
        if isinstance(module, TensorParallelLinear):
            raise UsageError(f"module {name!r} is already tensor parallel; apply one style once")
        check_tp_linear(module, self.kind, world, chunks=self.chunks, name=name)
        assert isinstance(module, EmulatedLinear)
        if self.chunks > 1 and self.kind == "rowwise":
            raise UsageError("chunks (a fused projection) applies to colwise parallelism only")
        group = device_mesh.get_group()
        rank = device_mesh.get_local_rank()
        size = module.out_features if self.kind == "colwise" else module.in_features
        wire = None
        if self.grad_comm is not None:
            wire = comm.wire_spec(self.grad_comm.spec, self.grad_comm.rounding)
        info = TPInfo(kind=self.kind, group=group, world=world, rank=rank,
                      pieces=split_pieces(size, rank, world, self.chunks), size=size,
                      sequence_parallel=self.sequence_parallel, lowp_gather=self._gather_in_format(module, name),
                      wire=wire)
        placements = self._placements(module)
        for pname, p in list(module.named_parameters(recurse=False)):
            target = placements.get(pname, [Replicate()])
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), device_mesh, target),
                                                          requires_grad=p.requires_grad))
        if self.chunks > 1:
            _strided_checkpoint_hooks(module)
        module.lowprec_tp = info  # type: ignore[assignment]
        # every layer, as the data-parallel wrapper does: a fallback can move one to delayed scaling later
        module.amax_reduce = _max_reduce(group, module.amax_reduce)
        module.__class__ = _tp_class(type(module))
        return module


class EmulatedColwiseParallel(_EmulatedParallel):
    """Column-wise parallel ``EmulatedLinear``: rank r holds rows ``[r N/T, (r+1) N/T)`` of the weight (of each of
    ``chunks`` fused parts: ``chunks=3`` for a ``[q; k; v]`` projection gives every rank whole heads of q, k and v)
    and produces that slice of the output features.  ``sequence_parallel``: the input arrives split along the
    sequence and is all-gathered, in the forward GEMM's input format where ``lowp_gather`` allows (None: where
    the spec can be gathered as codes, ``_fsdp_gather.check_gather_spec``).  ``grad_comm``: the wire format of
    the input gradient's reduction (``Recipe.grad_comm``; None: float32).  ``tp``: the degree the plan was built
    for (checked against the mesh)."""

    kind = "colwise"


class EmulatedRowwiseParallel(_EmulatedParallel):
    """Row-wise parallel ``EmulatedLinear``: rank r holds columns ``[r K/T, (r+1) K/T)`` of the weight, takes that
    slice of the input features and sums the partial outputs over the group (float32, rank order), or with
    ``sequence_parallel`` reduce-scatters them along the sequence.  The bias is replicated and added once."""

    kind = "rowwise"


class SequenceParallelNorm(ParallelStyle):
    """A norm (LayerNorm, RMSNorm) applied to the local sequence shard; each parameter's gradient, a partial sum
    over this rank's tokens, is summed over the TP group (float32, rank order) as it is computed.  Parameters stay
    plain replicated tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_size(device_mesh, None, "SequenceParallelNorm")
        group = device_mesh.get_group()
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, group=group: comm.sum_partials(g, group).to(g.dtype))
        return module


class SequenceBoundary(ParallelStyle):
    """Split the module's input along the sequence (``split_input``) and/or all-gather its output
    (``gather_output``): the first and last blocks of a sequence-parallel stack.  Inputs are [B, T, ...]
    (sequence dimension 1) or [T, ...]."""

    def __init__(self, *, split_input: bool = False, gather_output: bool = False) -> None:
        super().__init__()
        self.split_input, self.gather_output = split_input, gather_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _mesh_size(device_mesh, None, "SequenceBoundary")
        group = device_mesh.get_group()
        if self.split_input:
            def pre(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                x = args[0]
                return (comm.SplitSeq.apply(x, group, 1 if x.dim() >= 3 else 0), *args[1:])
            module.register_forward_pre_hook(pre)
        if self.gather_output:
            def post(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
                return comm.GatherSeq.apply(out, group, 1 if out.dim() >= 3 else 0)  # type: ignore[no-any-return]
            module.register_forward_hook(post)
        return module


def _linear(model: nn.Module, name: str) -> EmulatedLinear:
    mod = model.get_submodule(name)
    if not isinstance(mod, EmulatedLinear):
        raise UsageError(f"module {name!r} is a {type(mod).__name__}, not an EmulatedLinear: run "
                         "lowprec.convert(model, recipe) before building a tensor-parallel plan (and keep the "
                         "projections out of keep_high_precision)")
    return mod


def gpt_plan(model: nn.Module, *, tp: int, sequence_parallel: bool = False, grad_comm: GradComm | None = None,
             lowp_gather: bool | None = None) -> dict[str, ParallelStyle]:
    """The Megatron plan of the zoo's ``TinyGPT`` (task "gpt-bytes") for ``parallelize_module``: in every block
    ``attn.qkv`` colwise with whole heads of q, k and v per rank, ``attn.proj`` rowwise, ``mlp.fc`` colwise,
    ``mlp.out`` rowwise; with ``sequence_parallel`` also ``ln1``/``ln2`` (``SequenceParallelNorm``) and the
    sequence split at the first block and gathered after the last.  Embeddings, ``ln_f`` and ``lm_head`` stay
    replicated.  Every rule (heads divisible by ``tp``, dimensions, block alignment) is checked here, before any
    process group is needed."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise UsageError(f"gpt_plan needs the zoo's TinyGPT (blocks[i].attn.qkv, ...); got {type(model).__name__}")
    plan: dict[str, ParallelStyle] = {}
    opts: dict[str, Any] = {"sequence_parallel": sequence_parallel, "tp": tp}
    for i, block in enumerate(blocks):
        heads = getattr(getattr(block, "attn", None), "heads", None)
        if not isinstance(heads, int):
            raise UsageError(f"gpt_plan: blocks.{i}.attn has no int 'heads'; it needs the zoo's TinyGPT")
        if heads % tp:
            raise UsageError(f"blocks.{i}.attn has {heads} attention heads, which TP={tp} does not divide (each rank "
                             f"needs whole heads of q, k and v); use a TP degree that divides {heads}")
        for sub, kind, chunks in (("attn.qkv", "colwise", 3), ("attn.proj", "rowwise", 1),
                                  ("mlp.fc", "colwise", 1), ("mlp.out", "rowwise", 1)):
            name = f"blocks.{i}.{sub}"
            check_tp_linear(_linear(model, name), kind, tp, chunks=chunks, name=name)
            if kind == "colwise":
                plan[name] = EmulatedColwiseParallel(chunks=chunks, lowp_gather=lowp_gather, grad_comm=grad_comm,
                                                     **opts)
            else:
                plan[name] = EmulatedRowwiseParallel(**opts)
        if sequence_parallel:
            plan[f"blocks.{i}.ln1"] = SequenceParallelNorm()
            plan[f"blocks.{i}.ln2"] = SequenceParallelNorm()
    if sequence_parallel:
        last = len(blocks) - 1
        plan["blocks.0"] = SequenceBoundary(split_input=True, gather_output=last == 0)
        if last:
            plan[f"blocks.{last}"] = SequenceBoundary(gather_output=True)
    return plan


_LLAMA = (("*.q_proj", "colwise"), ("*.k_proj", "colwise"), ("*.v_proj", "colwise"), ("*.o_proj", "rowwise"),
          ("*.gate_proj", "colwise"), ("*.up_proj", "colwise"), ("*.down_proj", "rowwise"))


def llama_plan(model: nn.Module, *, tp: int, grad_comm: GradComm | None = None) -> dict[str, ParallelStyle]:
    """The Megatron plan of a transformers Llama-style model by module name: ``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj`` colwise, ``o_proj``/``down_proj`` rowwise (transformers' attention infers the local
    head count from the projection's width).  Attention and key-value head counts (``model.config``) must be
    divisible by ``tp``.  Sequence parallelism is not offered: the attention reshapes with the input's (local)
    sequence length."""
    cfg = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, field, None)
        if isinstance(n, int) and n % tp:
            raise UsageError(f"config.{field} = {n} is not divisible by TP={tp} (each rank needs whole heads); use "
                             f"a TP degree that divides {n}")
    plan: dict[str, ParallelStyle] = {}
    for name, _ in model.named_modules():
        for pattern, kind in _LLAMA:
            if fnmatch.fnmatchcase(name, pattern):
                check_tp_linear(_linear(model, name), kind, tp, name=name)
                plan[name] = (EmulatedColwiseParallel(tp=tp, grad_comm=grad_comm) if kind == "colwise"
                              else EmulatedRowwiseParallel(tp=tp))
    if not plan:
        raise UsageError("llama_plan found no q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj modules; "
                         "pass your own plan to tensor_parallel")
    return plan


class _LocalSplit(ParallelStyle):
    """GPT-2's attention splits its fused ``c_attn`` output with ``split(self.split_size)``, the full width; under
    colwise ``c_attn`` each rank holds ``split_size / T`` of each of q, k and v, so the attribute is divided by
    the mesh size (the head count is then inferred from ``head_dim``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = _mesh_size(device_mesh, None, "GPT-2 attention")
        size = getattr(module, "split_size", None)
        if not isinstance(size, int) or size % tp:
            raise UsageError(f"GPT-2 attention split_size {size!r} is not divisible by TP={tp}")
        setattr(module, "split_size", size // tp)  # noqa: B010 (an int attribute of a transformers module)
        return module


_GPT2 = (("*.attn.c_attn", "colwise", 3), ("*.attn.c_proj", "rowwise", 1), ("*.mlp.c_fc", "colwise", 1),
         ("*.mlp.c_proj", "rowwise", 1))


def gpt2_plan(model: nn.Module, *, tp: int, grad_comm: GradComm | None = None) -> dict[str, ParallelStyle]:
    """The Megatron plan of a transformers GPT-2 (``Conv1D`` projections, weights stored [in, out]): ``c_attn``
    colwise with whole heads of q, k and v per rank, ``attn.c_proj`` rowwise, ``mlp.c_fc`` colwise, ``mlp.c_proj``
    rowwise; each attention's ``split_size`` becomes the local width.  ``config.n_head`` must be divisible by
    ``tp``; no sequence parallelism (as ``llama_plan``)."""
    heads = getattr(getattr(model, "config", None), "n_head", None)
    if isinstance(heads, int) and heads % tp:
        raise UsageError(f"config.n_head = {heads} is not divisible by TP={tp} (each rank needs whole heads); use a "
                         f"TP degree that divides {heads}")
    plan: dict[str, ParallelStyle] = {}
    for name, _ in model.named_modules():
        for pattern, kind, chunks in _GPT2:
            if fnmatch.fnmatchcase(name, pattern):
                check_tp_linear(_linear(model, name), kind, tp, chunks=chunks, name=name)
                plan[name] = (EmulatedColwiseParallel(tp=tp, chunks=chunks, grad_comm=grad_comm)
                              if kind == "colwise" else EmulatedRowwiseParallel(tp=tp))
                if chunks > 1:
                    plan[name.rsplit(".", 1)[0]] = _LocalSplit()
    if not plan:
        raise UsageError("gpt2_plan found no attn.c_attn/attn.c_proj/mlp.c_fc/mlp.c_proj modules; pass your own "
                         "plan to tensor_parallel")
    return plan


def _is_gpt2(model: nn.Module) -> bool:
    return any(fnmatch.fnmatchcase(n, "*.attn.c_attn") for n, _ in model.named_modules())


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, plan: dict[str, ParallelStyle] | None = None,
                    sequence_parallel: bool = False, grad_comm: GradComm | None = None,
                    recipe: Recipe | str | None = None) -> nn.Module:
    """Apply ``plan`` (default: ``gpt_plan`` for a TinyGPT, ``gpt2_plan`` for a transformers GPT-2,
    ``llama_plan`` for a model with Llama projection names) over the 1-D TP ``mesh`` with ``parallelize_module``;
    returns ``model``.  ``grad_comm``: the wire format of the input-gradient partial sums (default:
    ``recipe.grad_comm`` where a recipe is given, else float32).  After every backward call
    ``sync_amax_histories(model, mesh.get_group())`` when the recipe uses delayed scaling."""
    tp = _mesh_size(mesh, None, "tensor_parallel")
    if grad_comm is None and recipe is not None:
        grad_comm = recipes.get(recipe).grad_comm
    if plan is None:
        if isinstance(getattr(model, "blocks", None), nn.ModuleList):
            plan = gpt_plan(model, tp=tp, sequence_parallel=sequence_parallel, grad_comm=grad_comm)
        else:
            if sequence_parallel:
                raise UsageError("sequence_parallel=True needs a plan that supports it (gpt_plan); llama_plan and "
                                 "gpt2_plan do not")
            plan = (gpt2_plan if _is_gpt2(model) else llama_plan)(model, tp=tp, grad_comm=grad_comm)
    parallelize_module(model, mesh, plan)
    return model


def tp_stats(model: nn.Module) -> dict[str, int]:
    """Bytes this rank has sent in the tensor-parallel collectives of ``model``'s linears (``_tp_comm.TPStats``:
    as a ring implementation sends them), summed over modules."""
    out = comm.TPStats().as_dict()
    for m in model.modules():
        if isinstance(m, TensorParallelLinear):
            for k, v in m.lowprec_tp.stats.as_dict().items():
                out[k] += v
    return out
