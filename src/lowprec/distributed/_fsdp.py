"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models converted with ``lowprec.convert``.

``shard_model(model, recipe)`` applies ``fully_shard`` to every ``EmulatedLinear`` and then to the root, with the
``MixedPrecisionPolicy`` that ``mixed_precision_policy`` derives from the recipe:

* ``param_dtype``: the dtype weights are all-gathered and computed in.  bf16 (fp16) when the recipe rounds the
  weight to bf16 (fp16) in both weight GEMMs and the weight gradient is a bf16 (fp16) GEMM output anyway, so the
  cast loses nothing the recipe keeps; None (the float32 parameter) otherwise: fp8 and MX recipes quantize inside
  the emulated GEMM.  A module's *bias* is all-gathered in ``param_dtype`` too, and lowprec adds the bias in
  float32, so this policy is bitwise equal to DDP only for bias-free linears.  ``shard_model`` therefore reaches
  the same bytes losslessly with a per-weight low-precision all-gather (``_fsdp_gather``) and keeps
  ``param_dtype=None`` whenever that all-gather is on;
* ``reduce_dtype``: float32: gradients are reduced as DDP reduces them (the recipe's gradient quantization is
  the optimizer's business, after the reduction);
* ``output_dtype``: None and ``cast_forward_inputs=False``: activations stay float32, as in the emulated GEMMs.

Delayed-scaling amax histories are buffers (``amax_history_<role>``); FSDP2 does not touch buffers, so every rank
records its own inputs' and gradients' amaxes.  ``sync_amax_histories`` makes them identical with one MAX
all-reduce of all histories (max is exact and order-free, so the result is bitwise the same on every rank and in
DDP).  It is called once per step, after ``backward`` and before the next forward: from the second step on every
rank scales with the same history.  The first step, whose history is empty, scales with each rank's own current
amax, as the single-process code does; making that first step global needs a hook inside ``EmulatedLinear``.

Bytes gathered are counted by a custom FSDP2 all-gather (``set_custom_all_gather``) that records the size of every
all-gather output (what one rank receives, its own shard included): ``allgather_bytes(model)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .. import recipes
from .._errors import UsageError
from ..nn import EmulatedExperts, EmulatedLinear, convert
from ..quant import QuantSpec
from ..recipes import LinearRecipe, Operand, Recipe
from ._fsdp_gather import GatherStats, LowpGatherWeight, check_gather_spec

_TORCH_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class _CountingAllGather(AllGather):
    """FSDP2's default all-gather (``all_gather_into_tensor`` into a fresh buffer), counting the bytes of every
    output: what this rank receives, its own shard included."""

    def __init__(self, counter: dict[str, int]) -> None:
        self.counter = counter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self.counter["bytes"] += output_tensor.numel() * output_tensor.element_size()
        self.counter["calls"] += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _linear_recipe(recipe: Recipe | LinearRecipe | str) -> LinearRecipe:
    if isinstance(recipe, LinearRecipe):
        return recipe
    if isinstance(recipe, (Recipe, str)):
        return recipes.get(recipe).linear
    raise UsageError(f"recipe must be a Recipe, a LinearRecipe or a recipe name; got {type(recipe).__name__}")


def _elementwise_float(op: Operand) -> str | None:
    """The format name when ``op`` rounds elementwise to nearest into bf16/fp16 (what a dtype cast does)."""
    s = op.spec
    if s is None or s.scaling != "none" or s.rounding != "nearest" or s.format.name not in _TORCH_FLOAT:
        return None
    return s.format.name


def mixed_precision_policy(recipe: Recipe | LinearRecipe | str, *, lowp_all_gather: bool = False
                           ) -> MixedPrecisionPolicy:
    """The FSDP2 ``MixedPrecisionPolicy`` of a recipe's linear layers (module docstring: the mapping and why).

    ``lowp_all_gather=True``: the weight is gathered by ``LowpGatherWeight`` instead, so ``param_dtype`` is None.
    """
    lin = _linear_recipe(recipe)
    param_dtype = None
    fmt = _elementwise_float(lin.forward.b)
    if (not lowp_all_gather and fmt is not None and _elementwise_float(lin.grad_input.b) == fmt
            and lin.grad_weight.output_format == fmt):
        param_dtype = _TORCH_FLOAT[fmt]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=None,
                                cast_forward_inputs=False)


def gather_spec(recipe: LinearRecipe, *, lowp_all_gather: bool | None, where: str = "recipe") -> QuantSpec | None:
    """The spec a weight is all-gathered in, or None for a float32 all-gather.

    ``None`` (auto): only where the recipe's own quantization of the weight makes the all-gather lossless, i.e. the
    forward and grad-input GEMMs round the weight elementwise to nearest in the same format (bf16, fp16).
    ``True``: the forward GEMM's weight spec, which must be shardable by rows (``check_gather_spec``).
    """
    fwd, gi = recipe.forward.b, recipe.grad_input.b
    if lowp_all_gather is None:
        fmt = _elementwise_float(fwd)
        return fwd.spec if fmt is not None and gi.spec == fwd.spec else None
    if not lowp_all_gather:
        return None
    if fwd.spec is None:
        raise UsageError(f"{where}: lowp_all_gather=True but forward.b (the weight) is not quantized "
                         "(LinearRecipe.forward.b.spec is None); use lowp_all_gather=None or False")
    check_gather_spec(fwd.spec, f"{where}: LinearRecipe.forward.b.spec")
    return fwd.spec


def _wrap_weight(mod: EmulatedLinear, name: str, spec: QuantSpec, world: int, stats: GatherStats,
                 explicit: bool) -> bool:
    w = mod.weight
    problem = None
    if mod.transposed_weight:
        problem = ("its weight is stored transposed ([in, out], a transformers Conv1D), and the low-precision "
                   "gather shards [out, in] rows")
    elif w.dtype != torch.float32:
        problem = f"its weight is {w.dtype}, not float32 (Recipe.weights.update is not 'master')"
    elif w.dim() != 2 or w.shape[0] % world:
        problem = (f"its {w.shape[0]} rows do not split evenly over {world} ranks (FSDP2 would pad the shard, and "
                   "padded shards cannot carry scales); use out_features divisible by the world size")
    if problem is not None:
        if explicit:
            raise UsageError(f"lowp_all_gather=True cannot gather module {name!r}: {problem}; "
                             "or pass lowp_all_gather=None")
        return False
    mod.weight = nn.Parameter(LowpGatherWeight(w.detach(), spec, stats), requires_grad=w.requires_grad)
    return True


def shard_model(model: nn.Module, recipe: Recipe | str, *, mesh: Any = None, reshard_after_forward: bool = True,
                lowp_all_gather: bool | None = None) -> nn.Module:
    """Apply FSDP2 to a lowprec model: ``fully_shard`` on every ``EmulatedLinear``, then on the root.

    Args:
        model: a module converted with ``lowprec.convert(model, recipe)`` (converted here, in place, when it holds
            no ``EmulatedLinear`` yet).  Parameters must not have been handed to an optimizer yet.
        recipe: the recipe it was converted with (its per-module ``LinearRecipe`` is read from each module).
        mesh: a 1-D ``DeviceMesh``; default: all ranks of the default process group on its device type
            ("cpu" for gloo).
        reshard_after_forward: passed to ``fully_shard``.
        lowp_all_gather: None: gather weights in low precision where lossless (bf16/fp16 weights); True: gather
            every converted weight in its forward spec (fp8 tensorwise, MX, ...) and raise ``ValueError`` naming
            the module and field where that is not possible; False: gather float32 (or ``param_dtype``).

    Returns ``model`` (now an ``FSDPModule``).  Read bytes gathered with ``allgather_bytes(model)``.
    """
    rec = recipes.get(recipe)
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("shard_model needs an initialised process group: call "
                         "torch.distributed.init_process_group('gloo') first (e.g. under torchrun)")
    if lowp_all_gather not in (None, True, False):
        raise UsageError(f"lowp_all_gather must be None, True or False; got {lowp_all_gather!r}")
    if isinstance(model, FSDPModule):
        raise UsageError("model is already sharded (an FSDPModule); call shard_model once, on the unsharded model")
    if not any(isinstance(m, EmulatedLinear) for m in model.modules()):
        convert(model, rec)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        backend = dist.get_backend()
        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (dist.get_world_size(),))
    world = mesh.size()
    counter = {"bytes": 0, "calls": 0}
    stats = GatherStats()
    wrapped: list[str] = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, EmulatedLinear):
            continue
        spec = gather_spec(mod.recipe, lowp_all_gather=lowp_all_gather, where=f"module {name!r}")
        lowp = spec is not None and _wrap_weight(mod, name, spec, world, stats, lowp_all_gather is True)
        if lowp:
            wrapped.append(name)
        policy = mixed_precision_policy(mod.recipe, lowp_all_gather=lowp)
        fully_shard(mod, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    root_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_policy)
    comm = _CountingAllGather(counter)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(comm)
    model._lowprec_fsdp = _State(counter=counter, stats=stats, lowp_modules=tuple(wrapped))  # type: ignore[assignment]
    return model


@dataclasses.dataclass
class _State:
    counter: dict[str, int]
    stats: GatherStats
    lowp_modules: tuple[str, ...]


def _state(model: nn.Module) -> _State:
    st = getattr(model, "_lowprec_fsdp", None)
    if not isinstance(st, _State):
        raise UsageError("model was not sharded with lowprec.distributed.shard_model")
    return st


def allgather_bytes(model: nn.Module, *, reset: bool = False) -> int:
    """Bytes this rank has received in FSDP2 parameter all-gathers of ``model`` since ``shard_model`` (or the last
    ``reset=True``), its own shard included.  Per full gather of an ``[N, K]`` float32 weight: 4NK bytes; bf16
    2NK; fp8 tensorwise NK (the scale is all-reduced, not gathered); MXFP8 NK + N*ceil(K/32)."""
    st = _state(model)
    out = st.counter["bytes"]
    if reset:
        st.counter.update(bytes=0, calls=0)
        st.stats.scale_allreduce_bytes = 0
    return out


def allgather_stats(model: nn.Module) -> dict[str, Any]:
    """``allgather_bytes`` with its detail: all-gather calls, bytes of the fp8 scale all-reduces, and the modules
    whose weights are gathered in low precision."""
    st = _state(model)
    return {"allgather_bytes": st.counter["bytes"], "allgather_calls": st.counter["calls"],
            "scale_allreduce_bytes": st.stats.scale_allreduce_bytes, "lowp_modules": list(st.lowp_modules)}


def amax_histories(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every delayed-scaling amax history of ``model``'s ``EmulatedLinear`` modules, by ``module.buffer`` name."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, EmulatedLinear | EmulatedExperts):
            for bname, buf in mod.named_buffers(recurse=False):
                if bname.startswith("amax_history_") and buf is not None:
                    out[f"{name}.{bname}" if name else bname] = buf
    return out


@torch.no_grad()
def sync_amax_histories(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """MAX all-reduce of every amax history of ``model`` (one collective for all), in place; returns the number
    of values reduced (0: nothing to do, no collective).  Call after ``backward`` on every rank, every step."""
    hists = list(amax_histories(model).values())
    if not hists:
        return 0
    if not dist.is_initialized():
        raise UsageError("sync_amax_histories needs an initialised process group")
    flat = torch.cat([h.reshape(-1) for h in hists])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    i = 0
    for h in hists:
        h.copy_(flat[i:i + h.numel()].view_as(h))
        i += h.numel()
    return int(flat.numel())
