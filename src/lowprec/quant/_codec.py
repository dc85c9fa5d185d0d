"""Real low-bit storage: element values <-> codes, and packing of 4- and 6-bit codes into bytes.

Storage per element format:

* formats torch has a dtype for (float8_e4m3fn, float8_e5m2, the fnuz pair, float8_e8m0fnu, bfloat16, float16):
  that dtype;
* float6 and float4: unsigned 8-bit codes packed along the last dimension.  float4: two codes per byte, the first
  element in the low nibble.  float6: four codes per three bytes, a little-endian bit stream (element ``j`` of a
  group of four occupies bits ``6j .. 6j+5`` of the 24-bit word ``b0 | b1 << 8 | b2 << 16``);
* int8 and MXINT8: ``torch.int8``; int4: two's-complement nibbles packed as float4.

A code is ``sign << (E+M) | exponent_field << M | mantissa_field``; ``decode_table`` gives the value of every code
of a format of 8 bits or fewer, derived from the ``FormatSpec`` fields alone.
"""

from __future__ import annotations

import torch

from .._errors import UsageError
from ..formats import FormatSpec
from ._storage import TORCH_DTYPE_NAMES, has_torch_dtype
from ._storage import code_value as code_value

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in TORCH_DTYPE_NAMES}


def torch_dtype(fmt: FormatSpec) -> torch.dtype | None:
    """The torch dtype that stores ``fmt`` exactly, if there is one."""
    return _TORCH_DTYPES[fmt.name] if has_torch_dtype(fmt) else None


def decode_table(fmt: FormatSpec) -> torch.Tensor:
    """float32 values of all ``2^bits`` codes (formats of 8 bits or fewer)."""
    if fmt.bits > 8:
        raise UsageError(f"decode_table is for formats of at most 8 bits; {fmt.name} has {fmt.bits}")
    return torch.tensor([code_value(fmt, c) for c in range(1 << fmt.bits)], dtype=torch.float32)


def encode_float(q: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """Codes (int32) of float32 values ``q`` that lie on ``fmt``'s grid (float formats up to 8 bits).

    NaN encodes as the format's NaN code (the sign is kept where the format has a signed NaN); for formats
    without NaN it encodes as 0 (scaled storage marks NaN groups through a NaN scale instead).
    """
    bits = q.view(torch.int32)
    a = bits & 0x7FFFFFFF
    m, e_bits = fmt.mbits, fmt.ebits
    normal = a >= (fmt.emin + 127) << 23
    field = torch.where(normal, (a >> 23) - 127 + fmt.bias, 0)
    mant_normal = (a >> (23 - m)) & ((1 << m) - 1)
    mant_sub = (q.abs() / fmt.min_subnormal).to(torch.int32) if fmt.has_subnormals else torch.zeros_like(a)
    code = (field << m) | torch.where(normal, mant_normal, mant_sub)
    sign_shift = e_bits + m
    if fmt.signed:
        negative = (bits < 0) & (code != 0) if not fmt.has_negative_zero else bits < 0
        code = code | (negative.to(torch.int32) << sign_shift)
    nan = torch.isnan(q)
    sign_bit = (bits < 0).to(torch.int32) << sign_shift if fmt.signed else torch.zeros_like(bits)
    if fmt.special == "ieee":
        inf_code = sign_bit | (((1 << e_bits) - 1) << m)
        code = torch.where(torch.isinf(q), inf_code, code)
        code = torch.where(nan, inf_code | (1 << (m - 1)), code)  # quiet NaN, sign kept
    elif fmt.special == "fn":
        code = torch.where(nan, sign_bit | ((1 << sign_shift) - 1), code)  # S.1111.111 (E8M0: 0xFF)
    elif fmt.special == "fnuz":
        code = torch.where(nan, 1 << sign_shift, code)
    else:
        code = torch.where(nan, 0, code)
    return code


def encode(q: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """Storage tensor for on-grid float32 values ``q`` (see the module docstring for the layout)."""
    if fmt.kind == "int":
        k = torch.nan_to_num(q * float(2**fmt.frac_bits), nan=0.0).to(torch.int32)
        return k.to(torch.int8) if fmt.bits == 8 else pack_4bit(k & 0xF)
    dt = torch_dtype(fmt)
    if dt is not None:
        return q.to(dt)
    codes = encode_float(q, fmt)
    if fmt.bits == 4:
        return pack_4bit(codes)
    if fmt.bits == 6:
        return pack_6bit(codes)
    if fmt.bits <= 8:
        return codes.to(torch.uint8)
    raise UsageError(f"no storage layout for the {fmt.bits}-bit format {fmt.name}; use fake_quantize")


def decode(codes: torch.Tensor, fmt: FormatSpec, last_dim: int | None) -> torch.Tensor:
    """float32 values from storage produced by ``encode``; ``last_dim`` unpacks 4/6-bit codes to that length."""
    if fmt.kind == "int" and fmt.bits == 8:
        return codes.to(torch.float32) * float(2.0**-fmt.frac_bits)
    dt = torch_dtype(fmt)
    if dt is not None:
        if codes.dtype != dt:
            raise UsageError(f"codes for {fmt.name} must have dtype {dt}; got {codes.dtype}")
        return codes.to(torch.float32)
    if codes.dtype != torch.uint8:
        raise UsageError(f"codes for {fmt.name} must be packed torch.uint8; got {codes.dtype}")
    if fmt.bits == 4:
        unpacked = unpack_4bit(codes, last_dim)
    elif fmt.bits == 6:
        unpacked = unpack_6bit(codes, last_dim)
    else:
        unpacked = codes.to(torch.int64)
    table = decode_table(fmt).to(codes.device)
    return table[unpacked]


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (int, ``[..., K]``) into ``[..., ceil(K/2)]`` uint8, first element in the low nibble."""
    k = codes.shape[-1] if codes.dim() else 1
    codes = codes.reshape(*codes.shape[:-1], k) if codes.dim() else codes.reshape(1)
    if k % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_4bit(packed: torch.Tensor, last_dim: int | None) -> torch.Tensor:
    p = packed.to(torch.int64)
    out = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    return out[..., : last_dim if last_dim is not None else out.shape[-1]]


def pack_6bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack 6-bit codes ``[..., K]`` into ``[..., 3 * ceil(K/4)]`` uint8 (little-endian 24-bit groups)."""
    k = codes.shape[-1]
    if k % 4:
        codes = torch.nn.functional.pad(codes, (0, 4 - k % 4))
    g = codes.unflatten(-1, (-1, 4)).to(torch.int32)
    word = g[..., 0] | (g[..., 1] << 6) | (g[..., 2] << 12) | (g[..., 3] << 18)
    return torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1).flatten(-2).to(torch.uint8)


def unpack_6bit(packed: torch.Tensor, last_dim: int | None) -> torch.Tensor:
    if packed.shape[-1] % 3:
        raise UsageError(f"packed 6-bit codes need a last dimension divisible by 3; got {packed.shape[-1]}")
    b = packed.to(torch.int64).unflatten(-1, (-1, 3))
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([(word >> (6 * j)) & 0x3F for j in range(4)], dim=-1).flatten(-2)
    return out[..., : last_dim if last_dim is not None else out.shape[-1]]
