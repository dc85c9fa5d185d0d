"""The three GEMMs of a tensor-parallel ``EmulatedLinear``, on local shards with explicit collectives.

Megatron's split of ``y = x @ W^T + b`` (x: [B, K], W: [N, K]) over T ranks, rank r holding a slice of W:

    colwise  W_r = rows of W    [N/T, K]   y_r = Q(x) @ Q(W_r)^T + b_r       [B, N/T]   no collective
             grad_input  dx = sum_r Q(dY_r) @ Q(W_r^T)^T                    [B, K]     all-reduce (or reduce-scatter)
             grad_weight dW_r = Q(dY_r^T) @ Q(x^T)^T                        [N/T, K]   local
    rowwise  W_r = cols of W    [N, K/T]   y = sum_r Q(x_r) @ Q(W_r)^T + b   [B, N]     all-reduce (or reduce-scatter)
             grad_input  dx_r = Q(dY) @ Q(W_r^T)^T                          [B, K/T]   local
             grad_weight dW_r = Q(dY^T) @ Q(x_r^T)^T                        [N, K/T]   local

A colwise layer followed by a rowwise one needs one reduction per pass.  With sequence parallelism the activations
between pairs are split along the sequence: the colwise input is all-gathered first (its backward reduce-scatters
dx) and the rowwise output is reduce-scattered (its backward all-gathers dY).

Every operand is quantized as one process quantizes the whole tensor (``_tp_shard``): tensorwise scales from the
MAX all-reduce of the shards' amaxes (one collective per pass for all operands that need it), per-row scales of
a column shard from the rows' global amaxes (one more), blocks that never straddle a shard, stochastic rounding
with the global element counters.  Delayed scaling uses the module's own
history buffers: ``amax_reduce`` (the TP group's MAX all-reduce) makes the first step global, every amax a
training pass records is the group's (one MAX all-reduce per pass, ``_delayed_amax``: a pipeline's next microbatch
reads it before the step ends), and ``sync_amax_histories(model, group)`` after every backward keeps the histories
equal across data-parallel ranks as with FSDP2.

What is not the arithmetic of one process: a sharded reduction dimension (rowwise forward, colwise grad_input)
sums T partial GEMMs in float32 in rank order (``_tp_comm``) instead of one GEMM over the whole K (or N), and a
GEMM output format (bf16) rounds each partial and the sum.  Everything else (the colwise forward, both
grad_weight GEMMs, the rowwise grad_input) computes the single-process products of the same quantized values.

With ``lowp_gather`` the sequence-parallel input all-gather sends the forward GEMM's quantized input: codes and
the tensorwise scale shared across the group (amax all-reduced first), or MX codes and E8M0 scales (blocks along
K never cross the sequence split), or bf16 codes: the gathered ``Q(x)`` is bit for bit the single-process one.
Where grad_weight quantizes x differently (MX, stochastic), the backward gathers x again in float32 from the
saved shard (as Megatron re-gathers it there instead of keeping the full input).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .. import formats
from ..nn._linear import product
from ..quant import QuantSpec, _codec, dequantize, quantize_scaled
from ..quant import quantize as _quantize
from ..recipes._recipe import OPERAND_ROLE, shares_quantization
from . import _tp_comm as comm
from ._fsdp_gather import _quantize_with_amax
from ._tp_shard import FULL, Piece, ShardLayout, needs_row_amax, quantize_shard

# Which dimension of each GEMM operand (2-D, reduction last) is sharded: None (whole), 0 rows, 1 columns.
_SHARDED: dict[str, dict[tuple[str, str], int | None]] = {
    "colwise": {("forward", "a"): None, ("forward", "b"): 0, ("grad_input", "a"): 1, ("grad_input", "b"): 1,
                ("grad_weight", "a"): 0, ("grad_weight", "b"): None},
    "rowwise": {("forward", "a"): 1, ("forward", "b"): 1, ("grad_input", "a"): None, ("grad_input", "b"): 0,
                ("grad_weight", "a"): None, ("grad_weight", "b"): 0},
}


@dataclasses.dataclass
class TPInfo:
    """A tensor-parallel linear's place in its group (set by the parallel styles on the module as ``lowprec_tp``)."""

    kind: str  # "colwise" | "rowwise"
    group: dist.ProcessGroup
    world: int
    rank: int
    pieces: tuple[Piece, ...]  # this rank's pieces of the sharded weight dimension (N colwise, K rowwise)
    size: int  # the global size of that dimension
    sequence_parallel: bool = False
    lowp_gather: bool = False  # colwise + sequence parallel: gather the input in the forward GEMM's format
    wire: QuantSpec | None = None  # partial sums of colwise grad_input in this wire format (Recipe.grad_comm)
    stats: comm.TPStats = dataclasses.field(default_factory=comm.TPStats)

    def layout(self, gemm: str, which: str) -> ShardLayout:
        dim = _SHARDED[self.kind][(gemm, which)]
        return FULL if dim is None else ShardLayout(dim, self.pieces, self.size)


def _seq_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else 0


def _needs_global_amax(m: Any, info: TPInfo, gemms: tuple[str, ...]) -> set[str]:
    """Tensor roles whose current tensorwise amax must be MAX-reduced over the group in this pass."""
    roles = set()
    for g in gemms:
        for w in "ab":
            op = getattr(getattr(m.recipe, g), w)
            if (op.spec is not None and op.spec.scaling == "tensor" and op.scaling.kind != "delayed"
                    and info.layout(g, w).dim is not None):
                roles.add(OPERAND_ROLE[(g, w)])
    return roles


def _global_amax(tensors: dict[str, torch.Tensor], roles: set[str], info: TPInfo) -> dict[str, torch.Tensor]:
    names = sorted(roles)
    local = [tensors[r].abs().amax() if tensors[r].numel() else tensors[r].new_zeros(()) for r in names]
    return dict(zip(names, comm.max_all_reduce(local, info.group, info.stats), strict=True))


def _row_amax(m: Any, info: TPInfo, operands: dict[tuple[str, str], torch.Tensor], glob: dict[Any, torch.Tensor]
              ) -> dict[Any, torch.Tensor]:
    """``glob`` plus, for every operand (GEMM, "a" | "b") with one scale per row of a column shard, its rows'
    amaxes over the whole row: one MAX all-reduce of all of them (``_tp_shard.needs_row_amax``)."""
    need = [(key, t) for key, t in operands.items()
            if needs_row_amax(getattr(getattr(m.recipe, key[0]), key[1]).spec, info.layout(*key))]
    if not need:
        return glob
    flat = torch.cat([t.abs().amax(dim=1) for _, t in need])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=info.group)
    info.stats.amax_bytes += flat.numel() * 4
    out = dict(glob)
    for (key, _), part in zip(need, flat.split([t.shape[0] for _, t in need]), strict=True):
        out[key] = part
    return out


def _q(t: torch.Tensor, m: Any, info: TPInfo, gemm: str, which: str, keys: Any, delayed: dict[str, torch.Tensor],
       glob: dict[Any, torch.Tensor]) -> torch.Tensor:
    """Operand ``which`` of GEMM ``gemm`` (local shard ``t``) quantized as one process quantizes the whole
    (``glob``: the tensorwise amaxes of sharded roles and per-row amaxes by (GEMM, operand), ``_row_amax``)."""
    op = getattr(getattr(m.recipe, gemm), which)
    if op.spec is None:
        return t
    role = OPERAND_ROLE[(gemm, which)]
    amax = delayed.get(role) if op.scaling.kind == "delayed" else glob.get(role)
    k = keys.get((gemm, which)) if keys else None
    return quantize_shard(t, op.spec, info.layout(gemm, which), keys=k, amax=amax, row_amax=glob.get((gemm, which)))


def _round_output(t: torch.Tensor, fmt: str | None) -> torch.Tensor:
    return t if fmt is None else _quantize(t, formats.get(fmt))


def gather_quantized(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None, info: TPInfo, dim: int
                     ) -> torch.Tensor:
    """``fake_quantize`` of the all-gather (along ``dim``) of the ranks' float32 ``x``, sending codes and scales
    instead of float32 (``spec`` passed ``_fsdp_gather.check_gather_spec``; ``amax``: the whole tensor's amax for
    tensorwise specs)."""
    if spec.scaling == "tensor":
        assert amax is not None
        codes, scale = _quantize_with_amax(x, spec, amax)
        full = comm.all_gather_cat(codes, info.group, dim)
        info.stats.allgather_bytes += comm._ring_share(full.numel() * full.element_size(), info.world)
        return dequantize(full, scale, spec, shape=full.shape)
    codes, scales = quantize_scaled(x, spec)
    full = comm.all_gather_cat(codes, info.group, dim)
    nbytes = full.numel() * full.element_size()
    if spec.scaling == "none":
        out = _codec.decode(full, spec.format, x.shape[-1])
    else:
        assert isinstance(scales, torch.Tensor)
        sfull = comm.all_gather_cat(scales, info.group, dim)
        nbytes += sfull.numel() * sfull.element_size()
        out = dequantize(full, sfull, spec, shape=full.shape[:-1] + x.shape[-1:])
    info.stats.allgather_bytes += comm._ring_share(nbytes, info.world)
    return out


def _delayed_amax(m: Any, info: TPInfo, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``m._delayed_amax`` (the amaxes to scale with now, from the history), and in training the amax it records
    made the group's at once: one MAX all-reduce of the new history entries over the TP group.  A shard's own
    amax would otherwise stand in the history until ``sync_amax_histories`` after the backward, and a later
    forward before it (the next microbatch of a pipeline step) would scale with it: per-shard scales, different
    on each TP rank.  With one pass per step this changes no value (the sync takes the same MAX)."""
    out = m._delayed_amax(tensors)
    roles = [r for r in tensors if r in m._delayed] if m.training else []
    if roles:
        hists = [getattr(m, f"amax_history_{r}") for r in roles]
        with torch.no_grad():
            for h, v in zip(hists, comm.max_all_reduce([h[0] for h in hists], info.group, info.stats),
                            strict=True):
                h[0] = v
    return out


def _gather_input(x: torch.Tensor, m: Any, info: TPInfo, amax_d: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, bool]:
    """The colwise layer's whole input as [B, K] float32 and whether it is already ``Q(x)`` of the forward GEMM."""
    xf = x.to(torch.float32)
    if not info.sequence_parallel:
        return xf.reshape(-1, x.shape[-1]), False
    dim = _seq_dim(x)
    op = m.recipe.forward.a
    if info.lowp_gather and op.spec is not None:
        amax = amax_d.get("input") if op.scaling.kind == "delayed" else None
        if amax is None and op.spec.scaling == "tensor":
            amax = comm.max_all_reduce([xf.abs().amax() if xf.numel() else xf.new_zeros(())], info.group,
                                       info.stats)[0]
        q = gather_quantized(xf, op.spec, amax, info, dim)
        return q.reshape(-1, x.shape[-1]), True
    full = comm.all_gather_cat(xf, info.group, dim)
    info.stats.allgather_bytes += comm._ring_share(full.numel() * 4, info.world)
    return full.reshape(-1, x.shape[-1]), False


class ColwiseFn(torch.autograd.Function):
    """Colwise (and sequence-parallel colwise) GEMMs of the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, m: Any, keys: Any
    ) -> torch.Tensor:
        info: TPInfo = m.lowprec_tp
        rec = m.recipe
        wf = w.to(torch.float32)
        xl = x.to(torch.float32)
        amax_d = (_delayed_amax(m, info, {"input": xl.reshape(-1, x.shape[-1]), "weight": wf}) if m._delayed
                  else {})
        x2, pre_quantized = _gather_input(x, m, info, amax_d)
        glob = _global_amax({"weight": wf}, _needs_global_amax(m, info, ("forward",)), info)
        if rec.forward.a.spec is None and rec.forward.b.spec is None and rec.forward.accumulator.format is None \
                and rec.forward.output_format is None:  # plain: nn.Linear's own float32 addmm, as EmulatedLinear
            y = torch.nn.functional.linear(x2, wf, None if b is None else b.to(torch.float32))
        else:
            # y_r = x @ W_r^T   [B,K] @ [K,N/T] -> [B,N/T]
            qx = x2 if pre_quantized else _q(x2, m, info, "forward", "a", keys, amax_d, {})
            y = product(qx, _q(wf, m, info, "forward", "b", keys, amax_d, glob), rec.forward)
            if b is not None:
                y = y + b.to(torch.float32)
        share_x = pre_quantized and shares_quantization(rec.forward.a, rec.grad_weight.b)
        ctx.save_for_backward(x2 if (share_x or not pre_quantized) else xl, wf)
        ctx.m, ctx.keys, ctx.amax_d, ctx.has_bias = m, keys, amax_d, b is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.share_x = x.shape, x.dtype, w.dtype, share_x
        ctx.regather = pre_quantized and not share_x
        out = y  # [B, N/T]; B counts the gathered sequence under sequence parallelism
        if x.dim() != 2:
            shape = list(x.shape[:-1])
            if info.sequence_parallel:
                shape[_seq_dim(x)] *= info.world
            out = y.reshape(*shape, y.shape[-1])
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        m, keys = ctx.m, ctx.keys
        info: TPInfo = m.lowprec_tp
        rec = m.recipe
        saved_x, wf = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).to(torch.float32)
        amax_d = dict(ctx.amax_d)
        if m._delayed:
            amax_d.update(_delayed_amax(m, info, {"grad_output": g2}))
        glob: dict[Any, torch.Tensor] = _global_amax({"grad_output": g2, "weight": wf},
                                                     _needs_global_amax(m, info, ("grad_input", "grad_weight")), info)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if need_x:
            glob = _row_amax(m, info, {("grad_input", "a"): g2, ("grad_input", "b"): wf.t()}, glob)
        gx = gw = gb = None
        if need_x:
            # dx = sum_r dY_r @ W_r   [B,N/T] @ [N/T,K] -> [B,K], summed over the group
            part = product(_q(g2, m, info, "grad_input", "a", keys, amax_d, glob),
                           _q(wf.t(), m, info, "grad_input", "b", keys, amax_d, glob), rec.grad_input)
            if info.sequence_parallel:
                full_shape = list(ctx.x_shape)
                full_shape[_seq_dim(grad)] *= info.world
                part = part.reshape(full_shape)
                gx = comm.reduce_scatter_dim(part, info.group, _seq_dim(grad), spec=info.wire, stats=info.stats)
            else:
                gx = comm.sum_partials(part, info.group, spec=info.wire, stats=info.stats).reshape(ctx.x_shape)
            gx = _round_output(gx, rec.grad_input.output_format).to(ctx.x_dtype)
        if need_w:
            if ctx.share_x:
                qx_t = saved_x.t()  # Q(x) of the forward GEMM, gathered in its format
            else:
                x2 = saved_x
                if ctx.regather:
                    x2 = comm.all_gather_cat(saved_x, info.group, _seq_dim(saved_x)).reshape(-1, saved_x.shape[-1])
                    info.stats.allgather_bytes += comm._ring_share(x2.numel() * 4, info.world)
                qx_t = _q(x2.t(), m, info, "grad_weight", "b", keys, amax_d, glob)
            # dW_r = dY_r^T @ x   [N/T,B] @ [B,K] -> [N/T,K]
            gw = product(_q(g2.t(), m, info, "grad_weight", "a", keys, amax_d, glob), qx_t,
                         rec.grad_weight).to(ctx.w_dtype)
        if ctx.has_bias and need_b:
            gb = g2.sum(0)
        return gx, gw, gb, None, None


class RowwiseFn(torch.autograd.Function):
    """Rowwise (and sequence-parallel rowwise) GEMMs of the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, m: Any, keys: Any
    ) -> torch.Tensor:
        info: TPInfo = m.lowprec_tp
        rec = m.recipe
        wf = w.to(torch.float32)
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        amax_d = _delayed_amax(m, info, {"input": x2, "weight": wf}) if m._delayed else {}
        glob: dict[Any, torch.Tensor] = _global_amax({"input": x2, "weight": wf},
                                                     _needs_global_amax(m, info, ("forward",)), info)
        glob = _row_amax(m, info, {("forward", "a"): x2, ("forward", "b"): wf}, glob)
        # partial y_r = x_r @ W_r^T   [B,K/T] @ [K/T,N] -> [B,N], summed over the group; the bias is added once
        part = product(_q(x2, m, info, "forward", "a", keys, amax_d, glob),
                       _q(wf, m, info, "forward", "b", keys, amax_d, glob), rec.forward)
        part = part.reshape(*x.shape[:-1], part.shape[-1])
        if info.sequence_parallel:
            y = comm.reduce_scatter_dim(part, info.group, _seq_dim(x), stats=info.stats)
        else:
            y = comm.sum_partials(part, info.group, stats=info.stats)
        y = _round_output(y, rec.forward.output_format)
        if b is not None:
            y = y + b.to(torch.float32)
        ctx.save_for_backward(x2, wf)
        ctx.m, ctx.keys, ctx.amax_d, ctx.has_bias = m, keys, amax_d, b is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        m, keys = ctx.m, ctx.keys
        info: TPInfo = m.lowprec_tp
        rec = m.recipe
        x2, wf = ctx.saved_tensors
        if info.sequence_parallel:
            grad = comm.all_gather_cat(grad.contiguous(), info.group, _seq_dim(grad))
            info.stats.allgather_bytes += comm._ring_share(grad.numel() * grad.element_size(), info.world)
        g2 = grad.reshape(-1, grad.shape[-1]).to(torch.float32)
        amax_d = dict(ctx.amax_d)
        if m._delayed:
            amax_d.update(_delayed_amax(m, info, {"grad_output": g2}))
        glob = _global_amax({"input": x2, "weight": wf},
                            _needs_global_amax(m, info, ("grad_input", "grad_weight")), info)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            # dx_r = dY @ W_r   [B,N] @ [N,K/T] -> [B,K/T]
            gx = product(_q(g2, m, info, "grad_input", "a", keys, amax_d, glob),
                         _q(wf.t(), m, info, "grad_input", "b", keys, amax_d, glob), rec.grad_input)
            gx = gx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if need_w:
            # dW_r = dY^T @ x_r   [N,B] @ [B,K/T] -> [N,K/T]
            gw = product(_q(g2.t(), m, info, "grad_weight", "a", keys, amax_d, glob),
                         _q(x2.t(), m, info, "grad_weight", "b", keys, amax_d, glob), rec.grad_weight).to(ctx.w_dtype)
        if ctx.has_bias and need_b:
            gb = g2.sum(0)
        return gx, gw, gb, None, None
