"""Low-precision weight all-gather for FSDP2: shards are quantized, codes and scales gathered, then dequantized.

FSDP2 keeps each weight sharded by rows (``Shard(0)``) and all-gathers the full ``[N, K]`` weight before a module
runs.  A parameter whose local shard is a tensor subclass with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
(torch's FSDP2 extension point, the one torchao's float8 all-gather uses) decides what is sent:

    pre  (every rank):  codes_r, scales_r = Q(shard_r)          shard_r = W[r*N/ws : (r+1)*N/ws, :]
    gather:             codes = cat_r codes_r,  scales = cat_r scales_r      (bytes: codes + scales, not fp32)
    post (every rank):  W_hat = dequantize(codes, scales)        [N, K] float32, given to the module

``W_hat`` equals ``dequantize(*quantize_scaled(W, spec), spec)`` bit for bit when every rank quantizes with the
scale it would have for the full weight:

* ``scaling="none"`` (bf16/fp16 elements): elementwise, no scale at all;
* ``scaling="tensor"`` (fp8 tensorwise): one scale from ``amax(W)``, the MAX all-reduce of the shards' amaxes (max
  is exact and order-free); the scale is metadata, identical on every rank, not gathered;
* ``scaling="block"`` along the last dimension (MX: 32 elements of a row share a scale), and ``"axis"`` with
  ``axis=-1`` (one scale per row): the groups lie inside rows, and row sharding never splits a row.

The module then quantizes ``W_hat`` again with its recipe.  That second quantization returns ``W_hat`` unchanged
(the all-gather is lossless for training) only where the recipe quantizes the weight elementwise: for bf16 and
fp16 weights.  For fp8 tensorwise scales, ``fl(max/amax(W_hat))`` differs from ``fl(max/amax(W))`` in the last bit
for about 7% of tensors (measured over 3000 random ones), and MX weights are quantized along the other dimension
in the grad-input GEMM; those recipes gather in low precision only on request (``lowp_all_gather=True``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .._errors import UsageError
from ..quant import QuantSpec, _codec, dequantize, quantize_scaled
from ..quant._round import quantize_f32
from ..quant._scale import group_scale, uses_multiplier

_aten = torch.ops.aten
# FSDP2 chunks, pads, views and copies the parameter into its shard: those results stay wrapped (as in torchao).
_PRESERVE = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten._pin_memory.default,
    _aten.split.Tensor, _aten.clone.default, _aten.detach.default, _aten.alias.default,
}


class GatherStats:
    """Bytes this rank sent in the scale all-reduces of low-precision all-gathers (read by ``allgather_stats``)."""

    def __init__(self) -> None:
        self.scale_allreduce_bytes = 0


def check_gather_spec(spec: QuantSpec, where: str) -> None:
    """Raise ``ValueError`` unless ``spec`` can be applied shard by shard with the full weight's result."""
    if spec.rounding != "nearest":
        raise UsageError(f"{where}: a low-precision all-gather needs rounding='nearest' (shards must round the same "
                         f"on every step); got rounding={spec.rounding!r}; use lowp_all_gather=False")
    if spec.tensor_scale:
        raise UsageError(f"{where}: two-level scales (NVFP4) are not supported by the low-precision all-gather; "
                         "use lowp_all_gather=False")
    if spec.scaling in ("block", "axis") and spec.axis not in (-1, 1):
        raise UsageError(f"{where}: scaling={spec.scaling!r} needs axis=-1 (groups inside a row, which row "
                         f"sharding never splits); got axis={spec.axis}; use lowp_all_gather=False")
    if spec.scaling == "tile":
        raise UsageError(f"{where}: tile scaling spans rows that FSDP shards apart; use lowp_all_gather=False")
    if spec.scaling != "none" and _codec.torch_dtype(spec.scale_spec) is None:
        raise UsageError(f"{where}: scale format {spec.scale_spec.name} has no torch storage dtype; "
                         "use lowp_all_gather=False")


def _quantize_with_amax(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_scaled(W, spec)`` for a tensor-scaled spec, applied to a shard ``x`` of ``W`` with ``amax(W)``.

    The same operations as ``quantize_scaled`` (``group_scale`` of the amax, ``x * m`` or ``x / s``, the element
    rounding, the stored scale ``1/m`` or ``s``), so the codes are the rows of the full weight's codes."""
    xf = x.to(torch.float32)
    s = group_scale(amax.to(torch.float32).reshape([1] * xf.dim()), spec, None)
    v = xf * s if uses_multiplier(spec) else xf / s
    q = quantize_f32(v, spec.format, rounding="nearest", saturate=spec.saturate, rbits=None)
    stored = (1.0 / s) if uses_multiplier(spec) else s
    scale_dtype = _codec.torch_dtype(spec.scale_spec)  # checked not None by check_gather_spec
    return _codec.encode(q, spec.format), stored.reshape(()).to(scale_dtype)  # type: ignore[arg-type]


class LowpGatherWeight(torch.Tensor):
    """A float32 weight (``_tensor``) that FSDP2 all-gathers as ``spec``'s codes and scales.

    Every other operation unwraps to ``_tensor`` (optimizers update the float32 shard in place); the operations
    FSDP2 uses to shard the parameter keep the wrapper.
    """

    _tensor: torch.Tensor
    _spec: QuantSpec
    _stats: GatherStats

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, spec: QuantSpec, stats: GatherStats) -> LowpGatherWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, spec: QuantSpec, stats: GatherStats) -> None:
        self._tensor = tensor
        self._spec = spec
        self._stats = stats

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LowpGatherWeight({self._spec.format.name}, scaling={self._spec.scaling}, {self._tensor!r})"

    # torch's stub declares Tensor.__torch_dispatch__ as a plain function attribute (mypy binds ``func`` as self);
    # the documented protocol for subclasses is this classmethod.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        meta: list[tuple[QuantSpec, GatherStats]] = []

        def unwrap(t: LowpGatherWeight) -> torch.Tensor:
            meta.append((t._spec, t._stats))
            return t._tensor

        args, kwargs = pytree.tree_map_only(LowpGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        spec, stats = meta[0]
        return pytree.tree_map_only(torch.Tensor, lambda t: LowpGatherWeight(t, spec, stats), out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_tensor"], {"spec": self._spec, "stats": self._stats}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> LowpGatherWeight:
        return LowpGatherWeight(inner["_tensor"], meta["spec"], meta["stats"])

    # ------------------------------------------------------------------------------------ FSDP2 extension
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: torch.nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this rank's shard ``[N/ws, K]``: returns (codes[, scales]) as uint8 byte views and metadata."""
        spec, x = self._spec, self._tensor
        with torch.no_grad():
            if spec.scaling == "tensor":
                amax = x.abs().amax().to(torch.float32) if x.numel() else x.new_zeros((), dtype=torch.float32)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())  # amax(W): exact, order-free
                self._stats.scale_allreduce_bytes += amax.numel() * amax.element_size()
                codes, scale = _quantize_with_amax(x, spec, amax)
                return (codes.view(torch.uint8),), (codes.dtype, scale)
            codes, scales = quantize_scaled(x, spec)
            if spec.scaling == "none":
                return (codes.view(torch.uint8),), (codes.dtype, None)
            if not isinstance(scales, torch.Tensor):  # two-level scales are rejected by check_gather_spec
                raise TypeError(f"unexpected scales of type {type(scales).__name__}")
            return (codes.view(torch.uint8), scales.view(torch.uint8)), (codes.dtype, scales.dtype)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        """Dequantize the gathered ``[N, K]`` codes (and scales) into a float32 weight."""
        spec = self._spec
        code_dtype, extra = metadata
        codes = outputs[0].view(code_dtype)
        n_rows = codes.shape[0]
        shape = (n_rows, self._tensor.shape[1]) if self._tensor.dim() == 2 else None
        with torch.no_grad():
            if spec.scaling == "none":
                w = _codec.decode(codes, spec.format, shape[-1] if shape else None)
            elif spec.scaling == "tensor":
                w = dequantize(codes, extra, spec, shape=shape)
            else:
                w = dequantize(codes, outputs[1].view(extra), spec, shape=shape)
            w = w.to(param_dtype)
            if out is not None:
                # Refill the unsharded parameter in place.  Its version counter must not move: autograd may have
                # saved it in the forward (FSDP's own path refills the all-gather buffer the same way, untracked).
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(w)
                return None
        return w, (w,)
