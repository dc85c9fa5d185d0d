"""Quantizing one rank's shard of a GEMM operand exactly as one process quantizes the whole operand.

Tensor parallelism hands every rank a block of each GEMM operand.  With the operand as the GEMMs see it, a 2-D
``[R, C]`` matrix with the reduction dimension last, a rank holds either all of it, a set of its rows, or a set
of its columns; a ``ShardLayout`` names which (``dim`` 0 or 1) and where the local pieces lie in the global matrix
(``pieces``: ``(local start, global start, length)`` along ``dim``; one piece for a plain Megatron split, three for
a fused ``qkv`` weight whose q, k and v parts are split separately).  ``quantize_shard`` then reproduces, on the
shard, the bits of the single-process quantization of the whole operand:

* one scale per tensor: the scale comes from the amax of the *whole* operand, which the caller passes (``amax``:
  the MAX all-reduce of the shards' amaxes over the TP group, exact and order-free, or the delayed history);
* blocks and tiles: a group must lie inside one piece, so every piece's length and global start along the sharded
  dimension must be multiples of the group's extent along it (``check_operand`` raises ``UsageError`` naming the
  dimension and the block size otherwise); the groups of the shard are then exactly those of the whole;
* one scale per row (``scaling="axis"``, ``axis=-1``) of a column shard: the caller passes the rows' amaxes over
  the whole row (``row_amax``, a MAX all-reduce of the local row amaxes), and the shard is quantized with one more
  element per row holding that amax (a sentinel: the row's amax is then the global one, and the sentinel's own
  code is dropped); elements are rounded with their row's scale, elementwise, so they are the whole row's codes.
  A per-column amax along sharded rows (``axis=0`` on a row shard) and two-level specs (NVFP4's tensor scale) on
  a sharded operand are rejected;
* stochastic rounding: element ``(i, j)`` of the global ``[R, C]`` operand draws the random word of counter
  ``i * C + j`` (``lowprec.quant._random``: counters are row-major indices plus an offset).  A row shard is
  quantized piece by piece with offset ``global_start * C``.  A column shard has no single offset (its rows are
  ``C`` apart in the global counters but ``C_local`` apart locally), so it is embedded into a zero ``[R, C]``
  matrix at its global columns, quantized there with offset 0, and cut out again: every element gets its global
  counter, the zeros form groups of their own (the alignment rule above) and cannot raise an amax.  That costs a
  ``C / C_local``-times larger quantization of the stochastic column-sharded operands only (a colwise layer's
  output gradient in grad_input, a rowwise layer's input and weight in forward); round-to-nearest needs no
  counters and quantizes the shard as it is.

So the bits of a TP run's quantized operands do not depend on the TP degree (tests/test_dist_tp.py compares them
with one process, in process and under torchrun).
"""

from __future__ import annotations

import dataclasses

import torch

from .._errors import UsageError
from ..quant import QuantSpec
from ..quant._random import offset_tensor
from ..quant._scaled import fake_quantize_tensors

Piece = tuple[int, int, int]
"""``(local start, global start, length)`` of one contiguous run of a shard along its sharded dimension."""


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where a local 2-D operand lies in the global one: ``dim`` None (the whole operand), 0 (rows) or 1
    (columns), the ``pieces`` along ``dim`` and the global size ``size`` along ``dim``."""

    dim: int | None = None
    pieces: tuple[Piece, ...] = ()
    size: int = 0

    def transposed(self) -> ShardLayout:
        """The layout of the transposed operand (rows become columns)."""
        return self if self.dim is None else dataclasses.replace(self, dim=1 - self.dim)


FULL = ShardLayout()


def split_pieces(size: int, rank: int, world: int, chunks: int = 1) -> tuple[Piece, ...]:
    """Rank ``rank``'s pieces of a dimension of ``size`` split over ``world`` ranks, each of ``chunks`` equal parts
    (q, k, v of a fused projection: ``chunks=3``) split separately: part ``c`` contributes its ``rank``-th slice.
    ``size`` must be divisible by ``chunks * world`` (checked by the callers, with the module's name)."""
    part = size // chunks
    n = part // world
    return tuple((c * n, c * part + rank * n, n) for c in range(chunks))


def _extent(spec: QuantSpec, dim: int) -> int | None:
    """How many consecutive elements along ``dim`` (0 or 1 of a 2-D operand) one scaling group spans: None for
    no constraint (elementwise, one scale per tensor, or groups across the other dimension), -1 for the whole
    dimension (axis scaling along it)."""
    if spec.scaling == "axis":
        return -1 if spec.axis % 2 == dim else None
    if spec.scaling == "block":
        assert spec.block_size is not None  # QuantSpec validates block specs
        return spec.block_size if spec.axis % 2 == dim else None
    if spec.scaling == "tile":
        assert spec.tile is not None
        return spec.tile[dim]
    return None


def check_operand(spec: QuantSpec | None, layout: ShardLayout, where: str, dim_name: str) -> None:
    """Raise ``UsageError`` unless ``spec`` can quantize a shard with ``layout`` as one process quantizes the
    whole operand (module docstring).  ``where`` names the module and GEMM operand, ``dim_name`` the sharded
    dimension (e.g. "in_features") for the message."""
    if spec is None or layout.dim is None:
        return
    if spec.tensor_scale:
        raise UsageError(f"{where}: a two-level spec ({spec.format.name} with a tensor scale) on an operand sharded "
                         f"along {dim_name} is not supported by tensor parallelism; keep this module unsharded "
                         "(leave it out of the plan) or use a one-level spec (mxfp8, fp8 tensorwise)")
    ext = _extent(spec, layout.dim)
    if ext == -1 and layout.dim == 0:
        raise UsageError(f"{where}: scaling='axis' with axis={spec.axis} takes one amax along {dim_name}, which "
                         "tensor parallelism shards by rows; use axis=-1, tensorwise or block scaling for this "
                         "operand, or leave the module out of the plan")
    if ext is None or ext == -1:  # -1 on a column shard: per-row amaxes from the caller (row_amax)
        return
    for _, start, n in layout.pieces:
        if n % ext or start % ext:
            kind = "block" if spec.scaling == "block" else f"tile {spec.tile}"
            raise UsageError(
                f"{where}: a {kind} of {ext} elements along {dim_name} would straddle a shard boundary: this "
                f"rank holds {n} of {layout.size} {dim_name} starting at {start}, which is not a multiple of "
                f"{ext}; use a TP degree (or model width) that gives shards of a multiple of {ext} {dim_name}"
            )


def _rows(t: torch.Tensor, spec: QuantSpec, layout: ShardLayout, keys: torch.Tensor,
          amax: torch.Tensor | None) -> torch.Tensor:
    """Stochastic rounding of a row shard: each piece with the counter offset of its first global row."""
    width = t.shape[1]
    outs = []
    for local, start, n in layout.pieces:
        off = offset_tensor((start * width) % (1 << 32), t.device)
        outs.append(fake_quantize_tensors(t[local:local + n], spec, keys=keys, offset=off, amax=amax))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def needs_row_amax(spec: QuantSpec | None, layout: ShardLayout) -> bool:
    """Whether quantizing a shard with ``layout`` needs the global per-row amaxes (``quantize_shard``'s
    ``row_amax``): one scale per row of a column shard."""
    return spec is not None and spec.scaling == "axis" and spec.axis % 2 == 1 and layout.dim == 1


def _free_column(layout: ShardLayout) -> int:
    """A global column outside this shard's pieces (the sentinel's place in the embedded matrix)."""
    mine = sorted((start, start + n) for _, start, n in layout.pieces)
    col = 0
    for a, b in mine:
        if col < a:
            return col
        col = max(col, b)
    if col >= layout.size:
        raise UsageError("a column shard that holds every column needs no per-row amax; use ShardLayout()")
    return col


def _with_sentinel(t: torch.Tensor, spec: QuantSpec, row_amax: torch.Tensor) -> torch.Tensor:
    """Round to nearest with per-row scales from ``row_amax``: one extra column holding it, dropped afterwards."""
    q = fake_quantize_tensors(torch.cat([t, row_amax.reshape(-1, 1).to(t.dtype)], dim=1), spec)
    return q[:, :-1].contiguous()


def _columns(t: torch.Tensor, spec: QuantSpec, layout: ShardLayout, keys: torch.Tensor,
             amax: torch.Tensor | None, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic rounding of a column shard: embedded at its global columns in a zero matrix (module docstring);
    per-row scales get the rows' global amaxes at a column of another rank."""
    full = t.new_zeros(t.shape[0], layout.size)
    for local, start, n in layout.pieces:
        full[:, start:start + n] = t[:, local:local + n]
    if row_amax is not None:
        full[:, _free_column(layout)] = row_amax.to(t.dtype)
    zero = torch.zeros((), dtype=torch.int32, device=t.device)
    q = fake_quantize_tensors(full, spec, keys=keys, offset=zero, amax=amax)
    parts = [q[:, start:start + n] for _, start, n in layout.pieces]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)


def quantize_shard(t: torch.Tensor, spec: QuantSpec | None, layout: ShardLayout, *, keys: torch.Tensor | None,
                   amax: torch.Tensor | None, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (float32 ``[R, C]`` local operand, reduction dim last) fake-quantized with ``spec`` as the rows or
    columns ``layout`` names of the single-process result (module docstring).

    ``keys``: the GEMM operand's random keys (stochastic specs); ``amax``: the whole operand's amax for
    one-scale-per-tensor specs of a sharded operand (or the delayed history's), else None; ``row_amax``: ``[R]``,
    each row's amax over the whole row where ``needs_row_amax(spec, layout)``.
    """
    if spec is None:
        return t
    if needs_row_amax(spec, layout) and row_amax is None:
        raise UsageError("a column shard with one scale per row needs the rows' global amaxes (row_amax)")
    if not needs_row_amax(spec, layout):
        row_amax = None
    if spec.rounding != "stochastic":
        return fake_quantize_tensors(t, spec, amax=amax) if row_amax is None else _with_sentinel(t, spec, row_amax)
    if keys is None:
        raise UsageError("a stochastic-rounding operand needs random keys")
    if layout.dim == 0:
        return _rows(t, spec, layout, keys, amax)
    if layout.dim == 1:
        return _columns(t, spec, layout, keys, amax, row_amax)
    zero = torch.zeros((), dtype=torch.int32, device=t.device)
    return fake_quantize_tensors(t, spec, keys=keys, offset=zero, amax=amax)
