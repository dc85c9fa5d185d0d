"""Real low-bit storage for JAX: on-grid float32 values <-> arrays of JAX's low-bit dtypes.

JAX (through ml_dtypes) has a dtype for the built-in element and scale formats: ``float8_e4m3fn``,
``float8_e5m2``, the fnuz pair, ``float8_e8m0fnu``, ``float4_e2m1fn``, ``int4``, plus ``bfloat16``/``float16``/
``float32``; int8 and MXINT8 codes are ``int8``.  ``jnp.float6_e3m2fn``/``float6_e2m3fn`` exist but XLA (jaxlib
0.10.2) cannot convert to them ("Invalid XLA PrimitiveType: 35"), so float6 codes (and those of any other float
format of at most 8 bits without a dtype) are ``uint8``, one code per byte (PyTorch's codes, unpacked).  A value on
the format's grid converts exactly.  NaN: formats without a NaN code store 0 (as PyTorch; the group's NaN scale
keeps the NaN visible after dequantization).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._errors import UsageError
from ..formats import FormatSpec
from ..quant._storage import code_value
from ._bits import INF, bits

_JAX_DTYPES = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "float8_e4m3fnuz": jnp.float8_e4m3fnuz,
    "float8_e5m2fnuz": jnp.float8_e5m2fnuz,
    "float8_e8m0fnu": jnp.float8_e8m0fnu,
    "float4_e2m1fn": jnp.float4_e2m1fn,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
}


def jax_dtype(fmt: FormatSpec):
    """The JAX dtype that stores float format ``fmt`` exactly, or None."""
    dt = _JAX_DTYPES.get(fmt.name)
    if dt is None or fmt.kind != "float" or fmt != _registered(fmt.name):
        return None
    return dt


def _registered(name: str) -> FormatSpec | None:
    from .. import formats

    return formats.get(name) if name in formats.names() else None


def storage_dtype(fmt: FormatSpec):
    """The dtype codes of ``fmt`` are stored in; ``ValueError`` if JAX has none."""
    if fmt.kind == "int":
        if fmt.bits == 8:
            return jnp.int8
        if fmt.bits == 4:
            return jnp.int4
    else:
        dt = jax_dtype(fmt)
        if dt is not None:
            return dt
        if fmt.bits <= 8:
            return jnp.uint8
    raise UsageError(f"no JAX dtype stores the format {fmt.name}; use fake_quantize")


def encode(q: jnp.ndarray, fmt: FormatSpec) -> jnp.ndarray:
    """Storage array for on-grid float32 values ``q``."""
    dt = storage_dtype(fmt)
    if fmt.kind == "int":
        k = jnp.nan_to_num(q * float(2**fmt.frac_bits), nan=0.0).astype(jnp.int32)
        return k.astype(dt)
    if dt == jnp.uint8:
        return encode_float(q, fmt).astype(jnp.uint8)
    if not fmt.has_nan:
        q = jnp.where(jnp.isnan(q), 0.0, q)
    return q.astype(dt)


def encode_float(q: jnp.ndarray, fmt: FormatSpec) -> jnp.ndarray:
    """int32 codes of on-grid float32 values ``q`` (``lowprec.quant._codec.encode_float``, on bit patterns)."""
    b = bits(q)
    a = b & 0x7FFFFFFF
    m, e_bits = fmt.mbits, fmt.ebits
    normal = a >= (fmt.emin + 127) << 23
    field = jnp.where(normal, (a >> 23) - 127 + fmt.bias, 0)
    mant_normal = (a >> (23 - m)) & ((1 << m) - 1)
    if fmt.has_subnormals:  # |q| / min_subnormal, exactly: rounding the magnitude onto integers
        mant_sub = make_int(a, fmt.emin - fmt.mbits)
    else:
        mant_sub = jnp.zeros_like(a)
    code = (field << m) | jnp.where(normal, mant_normal, mant_sub)
    shift = e_bits + m
    neg = b < 0
    if fmt.signed:
        negative = neg & (code != 0) if not fmt.has_negative_zero else neg
        code = code | (negative.astype(jnp.int32) << shift)
    nan = a > INF
    sign_bit = (neg.astype(jnp.int32) << shift) if fmt.signed else jnp.zeros_like(b)
    if fmt.special == "ieee":
        inf_code = sign_bit | (((1 << e_bits) - 1) << m)
        code = jnp.where(a == INF, inf_code, code)
        code = jnp.where(nan, inf_code | (1 << (m - 1)), code)
    elif fmt.special == "fn":
        code = jnp.where(nan, sign_bit | ((1 << shift) - 1), code)
    elif fmt.special == "fnuz":
        code = jnp.where(nan, 1 << shift, code)
    else:
        code = jnp.where(nan, 0, code)
    return code


def make_int(a: jnp.ndarray, k: int) -> jnp.ndarray:
    """``|q| / 2^k`` truncated to an int, from magnitude bits ``a`` (finite), in integer arithmetic."""
    e = a >> 23
    sig = jnp.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
    sh = (jnp.maximum(e, 1) - 150) - k  # |q| = sig * 2^(e - 150)
    right = jnp.right_shift(sig, jnp.clip(-sh, 0, 31))
    return jnp.where(sh >= 0, jnp.left_shift(sig, jnp.clip(sh, 0, 31)), right)


def decode_table(fmt: FormatSpec) -> jnp.ndarray:
    """float32 values of all codes of a format of at most 8 bits (from the shared ``code_value``)."""
    return jnp.asarray(np.array([code_value(fmt, c) for c in range(1 << fmt.bits)], dtype=np.float32))


def decode(codes: jnp.ndarray, fmt: FormatSpec) -> jnp.ndarray:
    """float32 values of ``encode``'s storage."""
    dt = jnp.dtype(storage_dtype(fmt))
    if codes.dtype != dt:
        raise UsageError(f"codes for {fmt.name} must have dtype {dt}; got {codes.dtype}")
    if fmt.kind == "int":
        return codes.astype(jnp.float32) * float(2.0**-fmt.frac_bits)
    if dt == jnp.uint8:
        return decode_table(fmt)[codes.astype(jnp.int32)]
    return codes.astype(jnp.float32)
