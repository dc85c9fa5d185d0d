"""Scaled quantization for JAX arrays: ``fake_quantize``, ``quantize_scaled``, ``dequantize``.

Same arguments, shapes and bits as ``lowprec.quant._scaled`` (see its docstring and ``QuantSpec``): per group
``codes = Q(x / s)`` (float32 scales: ``Q(x * m)`` with stored scale ``fl(1/m)``; NVFP4's ``two_level_rule="te"``:
``Q(clamp(x * m))`` with ``m = fl(1 / fl(s * S_dec))``), ``x_hat = codes * s`` (NVFP4: ``codes * fl(s * s_t)``).  The
per-group arithmetic runs on bit patterns (``_scale``); the elementwise product/quotient by the scale uses the
float hardware and switches to the integer route only when a subnormal is involved (``_bits.mul_fast``).

Storage (``quantize_scaled``) uses JAX's own low-bit dtypes where PyTorch packs bytes: float4_e2m1fn, the two
float6 formats and int4 come back as ``jnp.float4_e2m1fn`` / ``jnp.float6_*`` / ``jnp.int4`` arrays of the input's
shape (the same codes as PyTorch's packed ``uint8``, unpacked), float8 formats and E8M0 scales as the
``jnp.float8_*`` dtypes, int8/MXINT8 as ``int8``.
"""

from __future__ import annotations

from functools import partial
from typing import TypeAlias

import jax
import jax.numpy as jnp

from .._errors import UsageError
from ..quant._scale_rules import TwoLevelScales as TwoLevelScales
from ..quant._scale_rules import uses_multiplier
from ..quant._spec import QuantSpec
from ..quant._spec_args import _resolve  # the same validation and message as the PyTorch side
from . import _codec, _fast_tensor, _groups, _random
from ._bits import ABS, bits, const_bits, div_fast, div_mag, f32, mul_fast, mul_mag
from ._quantize import check_array, stochastic_args
from ._round import quantize_f32
from ._scale import F32_MAX, group_scale, tensor_scale_from_amax

Scales: TypeAlias = jax.Array | TwoLevelScales


def _amax(g: jnp.ndarray, dims: tuple[int, ...]) -> jnp.ndarray:
    """Bits of ``max |g|`` over ``dims`` (kept): an integer max of magnitude bits (NaN bits sort above inf)."""
    a = bits(g) & ABS
    if g.size == 0:
        keep = {d % g.ndim for d in dims}
        return jnp.zeros([1 if i in keep else n for i, n in enumerate(g.shape)], jnp.int32)
    return jnp.max(a, axis=dims, keepdims=True) if dims else a


def _scales(
    xf: jnp.ndarray, spec: QuantSpec, amax: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """Grouped scales (bits, broadcastable against the grouped view) and the tensor scale (bits) or None.

    ``amax`` (bits of a non-negative float32 scalar; tensor scaling only) replaces the tensor's own amax: delayed
    scaling, as ``lowprec.quant._scaled.fake_quantize_tensors(amax=...)``."""
    if spec.scaling == "none":
        return jnp.int32(const_bits(1.0)), None
    if amax is not None:
        return group_scale(jnp.reshape(amax, [1] * xf.ndim), spec, None), None
    g = _groups.group(xf, spec)
    amax = _amax(g, _groups.reduce_dims(spec, g.ndim))
    s_t = None
    if spec.tensor_scale:
        s_t = tensor_scale_from_amax(jnp.max(amax), spec)
    return group_scale(amax, spec, s_t), s_t


def _core(xf: jnp.ndarray, keys, off, spec: QuantSpec, amax: jnp.ndarray | None = None):
    """Grouped element values on the element grid (float32), the effective scale (float32) and raw scales."""
    s, s_t = _scales(xf, spec, amax)
    rbits = None
    if keys is not None:
        rbits = _groups.group(_random.random_bits(keys, off, xf.shape), spec)
    if spec.scaling == "none":
        v, eff = xf, f32(s)
    elif uses_multiplier(spec):
        v, eff = mul_fast(_groups.group(xf, spec), f32(s)), f32(div_mag(jnp.int32(const_bits(1.0)), s))
    elif s_t is not None and spec.two_level_rule == "te":  # s_t = [s_t, m6, S_dec] (_scale.te_tensor_scales)
        m = jnp.minimum(div_mag(jnp.int32(const_bits(1.0)), mul_mag(s, s_t[2])), F32_MAX)  # 1/0 -> float32 max
        v = mul_fast(_groups.group(xf, spec), f32(m))
        if spec.saturate:  # TE's clamp to +-max before the cast (x * float32 max may be inf): _scaled._te_clamp
            v = jnp.clip(v, -spec.format.max, spec.format.max)
        eff = f32(mul_mag(s, s_t[0]))
    else:
        eff = f32(s if s_t is None else mul_mag(s, s_t))
        v = div_fast(_groups.group(xf, spec), eff)
    q = quantize_f32(v, spec.format, rounding=spec.rounding, saturate=spec.saturate, rbits=rbits)
    return q, eff, s, s_t


@partial(jax.jit, static_argnames=("spec",))
def _fake_kernel(x: jax.Array, keys, off, *, spec: QuantSpec) -> jax.Array:
    if _fast_tensor.applies(spec):  # tensorwise, nearest, saturating: the float route (same bits)
        return _fast_tensor.fake_quantize_tensor(x.astype(jnp.float32), spec).astype(x.dtype)
    q, eff, _, _ = _core(x.astype(jnp.float32), keys, off, spec)
    return _groups.ungroup(mul_fast(q, eff), spec, x.shape).astype(x.dtype)


@partial(jax.jit, static_argnames=("spec",))
def _scaled_kernel(x: jax.Array, keys, off, *, spec: QuantSpec):
    q, _, s, s_t = _core(x.astype(jnp.float32), keys, off, spec)
    codes = _codec.encode(_groups.ungroup(q, spec, x.shape), spec.format)
    scale = f32(div_mag(jnp.int32(const_bits(1.0)), s)) if uses_multiplier(spec) else f32(s)
    scales = _groups.scales_out(scale, spec).astype(_codec.jax_dtype(spec.scale_spec))
    if s_t is not None:
        return codes, TwoLevelScales(scales, f32(s_t[0] if spec.two_level_rule == "te" else s_t).reshape(()))
    return codes, scales


def fake_quantize_traced(
    x: jax.Array, spec: QuantSpec, *, keys: jax.Array | None = None, amax: jax.Array | None = None
) -> jax.Array:
    """``fake_quantize`` for training code, ``lowprec.quant._scaled.fake_quantize_tensors`` in JAX: float32 ``x``,
    random ``keys`` (uint32 ``[k1, k2]``, offset 0; stochastic specs only) and an optional ``amax`` (int32 bits of
    the float32 amax, tensor scaling only) that replaces the tensor's own (delayed scaling).  Traceable; no checks
    beyond those."""
    if spec.rounding != "stochastic":
        keys = None
    elif keys is None:
        raise UsageError("a stochastic-rounding spec needs random keys")
    if amax is not None and spec.scaling != "tensor":
        raise UsageError(f"an explicit amax needs scaling='tensor'; got scaling={spec.scaling!r}")
    if amax is None and _fast_tensor.applies(spec):  # tensorwise, nearest, saturating: the float route
        return _fast_tensor.fake_quantize_tensor(x, spec)
    off = None if keys is None else jnp.uint32(0)
    q, eff, _, _ = _core(x, keys, off, spec, amax)
    return _groups.ungroup(mul_fast(q, eff), spec, x.shape)


def _check(x: object, spec: object) -> tuple[jax.Array, QuantSpec]:
    arr = check_array(x)
    qspec = _resolve(spec)
    _groups.check_layout(arr.shape, qspec)
    return arr, qspec


def fake_quantize(x: jax.Array, spec: QuantSpec | str, *, seed: int | None = None, offset: int = 0) -> jax.Array:
    """Quantize with ``spec`` and dequantize again: ``x``'s shape and dtype, values as the hardware sees them.

    Args:
        x: float32, bfloat16 or float16 array.
        spec: a ``QuantSpec`` or a name from ``QuantSpec.names()`` (e.g. "mxfp8_e4m3", "nvfp4").
        seed, offset: random bits for ``spec.rounding == "stochastic"``, as in ``quantize`` (seed required there).
    """
    x, spec = _check(x, spec)
    keys, off = stochastic_args(spec.rounding, seed, offset, x.size)
    return _fake_kernel(x, keys, off, spec=spec)


def quantize_scaled(
    x: jax.Array, spec: QuantSpec | str, *, seed: int | None = None, offset: int = 0
) -> tuple[jax.Array, Scales]:
    """Real low-bit storage: ``(codes, scales)`` with ``x ≈ codes * scales`` per group (module docstring: dtypes).

    scales: in the scale format's dtype, shaped as described in ``QuantSpec``; a ``TwoLevelScales`` for two-level
    specs (NVFP4).
    """
    x, spec = _check(x, spec)
    keys, off = stochastic_args(spec.rounding, seed, offset, x.size)
    _codec.storage_dtype(spec.format)  # raises for formats without a JAX dtype
    if _codec.jax_dtype(spec.scale_spec) is None:
        raise UsageError(f"no JAX dtype stores scale format {spec.scale_spec.name}; use fake_quantize")
    return _scaled_kernel(x, keys, off, spec=spec)


def dequantize(
    codes: jax.Array,
    scales: Scales,
    spec: QuantSpec | str,
    *,
    shape: tuple[int, ...] | None = None,
    dtype=jnp.float32,
) -> jax.Array:
    """Values ``codes * scales`` from ``quantize_scaled``'s output, in ``dtype``.

    ``shape`` is accepted for symmetry with PyTorch (whose packed 4/6-bit codes need it); JAX codes are unpacked
    and carry their shape, which must then equal ``shape``.
    """
    spec = _resolve(spec)
    elems = _codec.decode(codes, spec.format)
    if shape is not None and tuple(elems.shape) != tuple(shape):
        raise UsageError(f"codes decode to shape {tuple(elems.shape)}, not the given shape {tuple(shape)}")
    if isinstance(scales, TwoLevelScales):
        s = mul_fast(_groups.scales_in(scales.group.astype(jnp.float32), spec), scales.tensor.astype(jnp.float32))
    else:
        s = _groups.scales_in(jnp.asarray(scales).astype(jnp.float32), spec)
    g = _groups.group(elems, spec)
    return _groups.ungroup(mul_fast(g, s), spec, elems.shape).astype(dtype)
