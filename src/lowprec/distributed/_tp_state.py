"""The full (unsharded) state of a tensor-parallel model, also when FSDP2 shards it further: save and load exactly.

Why not ``DTensor.full_tensor()``.  FSDP2 over a TP parameter (torch 2.13, ``FSDPParam._init_sharded_param``)
chunks the TP-local tensor along dim 0 over the data-parallel ranks and records the 2-D placement as
``(_StridedShard(0, split_factor=T), <TP placement>)``, which is right when the TP placement is a contiguous
``Shard(0)``: rank t's rows are one block of the global rows, and dp chunks of that block interleave with a
split factor of T.  A fused ``[q; k; v]`` projection is ``_StridedShard(0, split_factor=3)`` under TP: rank t holds
``[q_t; k_t; v_t]`` (three blocks of N/(3T) rows), and FSDP2's chunks of that (``[q_t; half of k_t]`` and
``[rest of k_t; v_t]`` for 2 dp ranks) are no strided sharding of the global rows at all, so the global view
(``full_tensor``, the state-dict helpers, DCP) puts q, k and v rows in the wrong places (measured: max |diff| 0.12
from one process's qkv weight after one step), while training, which only all-gathers the chunks back into the
TP-local tensor, is right.

What this module does instead, per mesh dimension in the order the data were split:

    save:  tp_local = cat_r chunk_r over the "dp_shard" group    what FSDP2's own all-gather rebuilds
           full     = DTensor.from_local(tp_local, mesh["tp"], tp placement).full_tensor()   the 1-D TP view,
                                                                   which is exact for _StridedShard
    load:  tp_local = distribute_tensor(full, mesh["tp"], tp placement).to_local()
           chunk    = torch.chunk(tp_local, dp, dim)[dp_rank]     FSDP2's chunking (uneven: the last ones shorter)

A replicated data-parallel dimension (HSDP's ``dp_replicate``) holds the same chunk on every rank.  A DTensor with
no TP dimension (FSDP2 alone) or no sharded data-parallel dimension (TP alone) uses ``full_tensor()`` and
``distribute_tensor``, which are exact there.  Mesh dimensions are recognised by name: "tp" is tensor parallel,
every other one data parallel (the runner's mesh, ``lowprec.runs._mesh.MESH_DIMS``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from .._errors import UsageError


def _split(t: DTensor) -> tuple[int | None, list[int]]:
    """(the sharded data-parallel mesh dimension or None, the TP mesh dimensions) of ``t``'s mesh."""
    names = t.device_mesh.mesh_dim_names or ()
    tp = [i for i, n in enumerate(names) if n == "tp"]
    dp = [i for i, p in enumerate(t.placements) if i not in tp and not isinstance(p, Replicate)]
    if len(dp) > 1:
        raise UsageError(f"a DTensor sharded over {len(dp)} data-parallel mesh dimensions ({t.placements}): only "
                         "one (FSDP2's dp_shard) is supported")
    return (dp[0] if dp and tp else None), tp


def _chunks(size: int, parts: int) -> list[int]:
    """The lengths ``torch.chunk`` (FSDP2's sharding) gives ``parts`` ranks of a dimension of ``size``."""
    got = [len(c) for c in torch.empty(size, device="meta").chunk(parts)]
    return got + [0] * (parts - len(got))


def _tp_shape(t: DTensor, tp: list[int]) -> list[int]:
    """The shape of the TP-local tensor (before FSDP2's chunking): each TP-sharded dim divided by its degree."""
    shape = list(t.shape)
    for i in tp:
        p = t.placements[i]
        if not isinstance(p, Replicate):
            d = p.dim  # type: ignore[attr-defined]
            if shape[d] % t.device_mesh.size(i):
                raise UsageError(f"a TP-sharded dimension of {shape[d]} is not divisible by TP = "
                                 f"{t.device_mesh.size(i)}")
            shape[d] //= t.device_mesh.size(i)
    return shape


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``t`` (a plain tensor as is; collective over its mesh for a DTensor; module docstring)."""
    if not isinstance(t, DTensor):
        return t
    dp, tp = _split(t)
    if dp is None:
        return t.full_tensor()
    dim = t.placements[dp].dim  # type: ignore[attr-defined]
    group, n = t.device_mesh.get_group(dp), t.device_mesh.size(dp)
    shape = _tp_shape(t, tp)
    sizes = _chunks(shape[dim], n)
    local = t.to_local().contiguous()
    pad = list(local.shape)
    pad[dim] = max(sizes)
    buf = local.new_zeros(pad)
    buf.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(parts, buf, group=group)
    tp_local = torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)
    names = t.device_mesh.mesh_dim_names
    assert names is not None  # _split found a "tp" dimension by name
    mesh = t.device_mesh[tuple(names[i] for i in tp)] if len(tp) > 1 else t.device_mesh[names[tp[0]]]
    return DTensor.from_local(tp_local, mesh, [t.placements[i] for i in tp], shape=t.shape,
                              stride=t.stride()).full_tensor()


def distribute_full(full: torch.Tensor, like: DTensor) -> DTensor:
    """``full`` (the whole tensor, identical on every rank) laid out as ``like`` is: this rank's piece, as a
    DTensor with ``like``'s mesh and placements; no communication."""
    if tuple(full.shape) != tuple(like.shape):
        raise UsageError(f"a full tensor of shape {list(full.shape)} does not fit a parameter of shape "
                         f"{list(like.shape)}")
    full = full.to(device=like.to_local().device, dtype=like.dtype)
    dp, tp = _split(like)
    if dp is None:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    names = like.device_mesh.mesh_dim_names
    assert names is not None
    mesh = like.device_mesh[tuple(names[i] for i in tp)] if len(tp) > 1 else like.device_mesh[names[tp[0]]]
    tp_local = distribute_tensor(full, mesh, [like.placements[i] for i in tp], src_data_rank=None).to_local()
    dim = like.placements[dp].dim  # type: ignore[attr-defined]
    n, r = like.device_mesh.size(dp), like.device_mesh.get_local_rank(dp)
    sizes = _chunks(tp_local.shape[dim], n)
    piece = tp_local.narrow(dim, sum(sizes[:r]), sizes[r]).contiguous()
    return DTensor.from_local(piece, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """Collective: ``model.state_dict()`` with every DTensor replaced by its whole tensor (one process's state
    dict: same keys, plain tensors)."""
    return {k: full_tensor(v) for k, v in model.state_dict().items()}


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a one-process state dict into a tensor-parallel (and FSDP2-sharded) model: each DTensor parameter and
    buffer takes its piece (``distribute_full``); no communication.  Strict, as ``load_state_dict``."""
    own = model.state_dict(keep_vars=True)
    local = {k: distribute_full(v, own[k]) if isinstance(own.get(k), DTensor) else v for k, v in state.items()}
    model.load_state_dict(local)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: ``optimizer.state_dict()`` (keyed by parameter index) with every DTensor state whole."""
    sd = optimizer.state_dict()
    state = {i: {k: full_tensor(v) for k, v in s.items()} for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a one-process ``optimizer.state_dict()`` into an optimizer over DTensor parameters: each state tensor
    shaped like its DTensor parameter takes that parameter's piece; no communication."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    local: dict[int, Any] = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        local[int(i)] = {k: distribute_full(v, p) if isinstance(p, DTensor) and isinstance(v, torch.Tensor)
                         and tuple(v.shape) == tuple(p.shape) else v for k, v in s.items()}
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})
