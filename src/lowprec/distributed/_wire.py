"""Wire format of a compressed gradient bucket: one flat ``uint8`` buffer per rank.

A DDP bucket is a flat 1-D gradient buffer of ``n`` elements.  ``BucketCodec`` turns it into bytes and back for
one ``QuantSpec``; every rank's buffer has the same ``n`` and the same spec, so every rank's message has the same
length and the same layout, which ``all_gather`` needs:

    [ codes | group scales | tensor scale ]

* codes: the element format's storage from ``lowprec.quant.quantize_scaled`` viewed as bytes (float32 4 bytes,
  bfloat16/float16 2, float8 1; float6 packs four codes into three bytes and float4/int4 two codes into one byte);
* group scales (``scaling="block"`` only, e.g. MX): ``ceil(n / block_size)`` scales in the scale format's dtype
  (one ``float8_e8m0fnu`` byte per 32 elements for MX);
* tensor scale (two-level specs such as NVFP4 only): one float32.

``scaling="tensor"`` (fp8 with one scale per bucket) sends no scale: every rank derives the same scale from the
bucket's global amax, which the hook agrees on first with a MAX all-reduce of one float32 per rank.  ``scaling=
"none"`` (bfloat16, float16, float32, unscaled fp8) sends codes only.  ``wire_nbytes(n, spec)`` is the length by
formula; ``pack`` produces exactly that many bytes (tested).

Dequantization is ``lowprec.quant``'s own: ``dequantize(codes, scales, spec)`` for scaled groups, and for the shared
tensor scale ``codes * fl(1/m)`` with ``m = max_elem / amax`` (the float32 TransformerEngine/torchao rule of
``QuantSpec``), so a decoded message equals ``fake_quantize`` of the sender's gradient with that amax, bit for bit.
"""

from __future__ import annotations

import math

import torch

from .._errors import UsageError
from ..quant import QuantSpec, _codec, dequantize, quantize, quantize_scaled
from ..quant._scale import group_scale, uses_multiplier
from ..quant._scaled import TwoLevelScales
from ..quant._spec_args import resolve_spec as resolve_spec


def codes_nbytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the codes of ``numel`` elements (the layout of ``lowprec.quant._codec``)."""
    fmt = spec.format
    if _codec.torch_dtype(fmt) is not None:
        return numel * (fmt.bits // 8)
    if fmt.bits == 4:
        return math.ceil(numel / 2)
    if fmt.bits == 6:
        return 3 * math.ceil(numel / 4)
    return numel  # int8, MXINT8 and other 8-bit codes: one byte each


def scales_nbytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the scales sent with ``numel`` elements (0 for unscaled and shared-scale specs)."""
    if spec.scaling != "block":
        return 0
    assert spec.block_size is not None  # resolve_spec checked it (QuantSpec validates block specs)
    n = math.ceil(numel / spec.block_size) * (spec.scale_spec.bits // 8)
    return n + (4 if spec.tensor_scale else 0)


def wire_nbytes(numel: int, spec: QuantSpec) -> int:
    """Length in bytes of one rank's message for a bucket of ``numel`` elements."""
    return codes_nbytes(numel, spec) + scales_nbytes(numel, spec)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(codes: torch.Tensor, scales: torch.Tensor | TwoLevelScales | None) -> torch.Tensor:
    """``[codes | group scales | tensor scale]`` as one flat uint8 tensor."""
    parts = [_bytes(codes)]
    if isinstance(scales, TwoLevelScales):
        parts += [_bytes(scales.group), _bytes(scales.tensor.to(torch.float32))]
    elif scales is not None:
        parts.append(_bytes(scales))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack(
    buf: torch.Tensor, numel: int, spec: QuantSpec, codes_dtype: torch.dtype, scale_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | TwoLevelScales | None]:
    """Inverse of ``pack`` for a bucket of ``numel`` elements: ``(codes, scales)`` (views or small copies)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != wire_nbytes(numel, spec):
        raise UsageError(
            f"a message for {numel} elements of {spec.format.name} must be {wire_nbytes(numel, spec)} uint8 bytes; "
            f"got {buf.numel()} {buf.dtype} in {buf.dim()} dimension(s)"
        )
    nc = codes_nbytes(numel, spec)
    codes = buf[:nc].view(codes_dtype)  # offset 0: aligned for any dtype
    if spec.scaling != "block" or scale_dtype is None:
        return codes, None
    ns = scales_nbytes(numel, spec) - (4 if spec.tensor_scale else 0)
    group = buf[nc : nc + ns].clone().view(scale_dtype)  # a copy: the dtype view needs an aligned offset
    if spec.tensor_scale:
        return codes, TwoLevelScales(group, buf[nc + ns :].clone().view(torch.float32).reshape(()))
    return codes, group


class BucketCodec:
    """Encode a flat float32 gradient into one rank's message and decode any rank's message (see module doc)."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = resolve_spec(spec)
        fmt = self.spec.format
        packed = torch.int8 if fmt.kind == "int" and fmt.bits == 8 else torch.uint8  # _codec.encode's storage
        self.codes_dtype = _codec.torch_dtype(fmt) or packed
        self.scale_dtype = _codec.torch_dtype(self.spec.scale_spec) if self.spec.scaling == "block" else None

    @property
    def shared_scale(self) -> bool:
        """True when the hook must agree on the bucket's amax (MAX all-reduce) before encoding."""
        return self.spec.scaling == "tensor"

    def _tensor_scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """From the shared amax: (quantization factor, dequantization scale, whether to multiply)."""
        s = group_scale(amax.to(torch.float32).reshape(1), self.spec, None)
        if uses_multiplier(self.spec):  # float32 scales: codes = Q(x * m), x_hat = codes * fl(1/m)
            return s, 1.0 / s, True
        return s, s, False  # other scale formats: codes = Q(x / s), x_hat = codes * s

    def encode(self, g: torch.Tensor, *, seed: int | None, amax: torch.Tensor | None = None) -> torch.Tensor:
        """One rank's message for the flat float32 gradient ``g``.

        ``seed``: stochastic rounding's seed (element ``i`` uses counter ``i``); ``amax``: the shared amax
        (``scaling="tensor"`` only).
        """
        spec = self.spec
        if spec.scaling == "block":
            return pack(*quantize_scaled(g, spec, seed=seed))
        v = g
        if spec.scaling == "tensor":
            if amax is None:
                raise UsageError("a shared-scale spec needs the bucket's global amax")
            f, _, mul = self._tensor_scales(amax)
            v = g * f if mul else g / f
        # ``quantize`` (not ``quantize_scaled``): the same bits, and it has the eager round-to-nearest fast path
        q = quantize(v, spec.format, rounding=spec.rounding, seed=seed, saturate=spec.saturate)
        return pack(_codec.encode(q, spec.format), None)

    def decode(self, buf: torch.Tensor, numel: int, *, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 values (``numel`` elements) a message stands for."""
        spec = self.spec
        codes, scales = unpack(buf, numel, spec, self.codes_dtype, self.scale_dtype)
        if spec.scaling == "block":
            assert scales is not None
            return dequantize(codes, scales, spec, shape=(numel,))
        q = _codec.decode(codes, spec.format, numel)
        if spec.scaling == "none":
            return q
        if amax is None:
            raise UsageError("a shared-scale spec needs the bucket's global amax")
        return q * self._tensor_scales(amax)[1]
