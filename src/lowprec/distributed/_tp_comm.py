"""The collectives of tensor and sequence parallelism, in float32 or in a recipe's wire format, on gloo and NCCL.

Every reduction here is an all-gather followed by a float32 sum in rank order on every rank:

    out = ((p_0 + p_1) + p_2) + ... + p_{T-1}          the same bits on every rank, for any backend

gloo has no bf16 or fp8 reductions, and an all-reduce's summation order is the library's business; gathering the
partials (as float32, or as the bytes of a low-precision wire format, ``_wire.BucketCodec``) and summing them in
rank order gives one documented order that every rank shares.  For T = 2 it is the single addition ``p_0 + p_1``,
which is what a ring all-reduce computes too.  A reduce-scatter is the same sum, of which each rank keeps its own
chunk (the bytes moved are then T times those of a real reduce-scatter: an emulation of the numerics, not of the
traffic; ``TPStats`` counts what a ring implementation would send).

Wire formats of a partial sum (``Recipe.grad_comm``): the codec's own rules, i.e. one shared scale from the MAX
all-reduce of the ranks' amaxes for tensorwise specs, codes and E8M0 scales for MX; the decoded partials are
summed in float32.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .._errors import UsageError
from ..quant import QuantSpec
from ._wire import BucketCodec, resolve_spec


@dataclasses.dataclass
class TPStats:
    """Bytes one rank sends in tensor-parallel collectives (as a ring implementation would send them): activation
    all-gathers, partial-sum reductions, amax all-reduces."""

    allgather_bytes: int = 0
    reduce_bytes: int = 0
    amax_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _ring_share(nbytes: int, world: int) -> int:
    return nbytes * (world - 1) // world


def all_gather_cat(t: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The ranks' ``t`` concatenated along ``dim`` in rank order (any dtype: gathered as bytes)."""
    world = dist.get_world_size(group)
    src = t.contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat, group=group)
    parts = [o.view(src.dtype).view(src.shape) for o in out]
    return torch.cat(parts, dim=dim)


def max_all_reduce(values: list[torch.Tensor], group: dist.ProcessGroup, stats: TPStats | None = None
                   ) -> list[torch.Tensor]:
    """Each float32 scalar of ``values`` replaced by its maximum over the group (one collective for all)."""
    if not values:
        return []
    flat = torch.stack([v.reshape(()).to(torch.float32) for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    if stats is not None:
        stats.amax_bytes += flat.numel() * 4
    return list(flat.unbind())


def wire_spec(spec: QuantSpec | None, rounding: str | None = None, where: str = "Recipe.grad_comm"
              ) -> QuantSpec | None:
    """The resolved wire spec of a partial-sum reduction; stochastic rounding is not supported here."""
    if spec is None:
        return None
    out = resolve_spec(spec, rounding)
    if out.rounding != "nearest":
        raise UsageError(f"{where}: tensor-parallel partial sums are sent with rounding='nearest' only; got "
                         f"{out.rounding!r}; set GradComm.rounding='nearest'")
    return out


def _partials(p: torch.Tensor, group: dist.ProcessGroup, spec: QuantSpec | None, stats: TPStats | None
              ) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``p`` as float32 (decoded from ``spec``'s wire format where given) and one message's bytes."""
    pf = p.to(torch.float32).contiguous()
    if spec is None:
        return list(all_gather_cat(pf.unsqueeze(0), group, 0).unbind(0)), pf.numel() * 4
    codec = BucketCodec(spec)
    flat = pf.reshape(-1)
    amax = None
    if codec.shared_scale:
        amax = max_all_reduce([flat.abs().amax() if flat.numel() else flat.new_zeros(())], group, stats)[0]
    msgs = all_gather_cat(codec.encode(flat, seed=None, amax=amax).unsqueeze(0), group, 0).unbind(0)
    return [codec.decode(m, flat.numel(), amax=amax).view(pf.shape) for m in msgs], msgs[0].numel()


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for q in parts[1:]:
        out.add_(q)
    return out


def sum_partials(p: torch.Tensor, group: dist.ProcessGroup, *, spec: QuantSpec | None = None,
                 stats: TPStats | None = None) -> torch.Tensor:
    """``sum_r p_r`` (float32, rank order; module docstring), ``p`` sent as float32 or in ``spec``'s wire format."""
    parts, nbytes = _partials(p, group, spec, stats)
    if stats is not None:  # a ring all-reduce: reduce-scatter + all-gather
        stats.reduce_bytes += 2 * _ring_share(nbytes, len(parts))
    return _rank_order_sum(parts)


def reduce_scatter_dim(p: torch.Tensor, group: dist.ProcessGroup, dim: int, *, spec: QuantSpec | None = None,
                       stats: TPStats | None = None) -> torch.Tensor:
    """This rank's chunk along ``dim`` of ``sum_partials(p)``."""
    parts, nbytes = _partials(p, group, spec, stats)
    if stats is not None:
        stats.reduce_bytes += _ring_share(nbytes, len(parts))
    return chunk(_rank_order_sum(parts), group, dim)


def chunk(t: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's equal chunk of ``t`` along ``dim`` (``t.shape[dim]`` divisible by the group size, checked)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = t.shape[dim]
    if n % world:
        raise UsageError(f"sequence parallelism splits dimension {dim} of size {n} over {world} ranks; use a "
                         f"sequence length divisible by the TP degree {world}")
    return t.narrow(dim, rank * (n // world), n // world).contiguous()


class SplitSeq(torch.autograd.Function):
    """Forward: this rank's chunk of a replicated activation along ``dim``; backward: the all-gather of the
    chunks' gradients (the full gradient, the same on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return chunk(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return all_gather_cat(g, ctx.group, ctx.dim), None, None


class GatherSeq(torch.autograd.Function):
    """Forward: the all-gather of sequence chunks along ``dim``; backward: this rank's chunk of the gradient
    (which is replicated: everything after the gather runs identically on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return chunk(g, ctx.group, ctx.dim), None, None
