"""Tensorwise fake quantization by the float32 route: one read pass for the amax, one fused read + write pass.

What.  For a tensor-scaled spec with a float32 multiplier (``fp8_e4m3_tensorwise``: ``m = max_elem / amax``,
``x_hat = Q(x * m) * fl(1/m)``, as ``_scaled``) and round-to-nearest onto a *saturating* float format, ``Q`` of a
finite float32 ``v`` is, with ``e(a) = floor(log2 a)`` read from the exponent field,

    a    = min(|v|, max_elem)                    saturate first: max_elem is on the grid, so rounding stays <= it
    C    = 2^(max(e(a), emin) - mbits + 23)      C's ulp is the grid step of a's binade (of the subnormals below emin)
    Q(v) = sign(v) * ((a + C) - C)               the float adder rounds a + C to nearest, ties to even, at that step

the "float route" of the native PyTorch kernels (``lowprec.quant._native.c``), here as jnp operations that XLA
fuses into one loop: the cost is the amax read plus one read and one write, against a copy's read and write.

Why the float hardware gives IEEE's bits here.  XLA on CPU reads float32 subnormals as zero and writes zero for
subnormal results (``_bits``).  With ``t = 2^(emin - mbits)`` the format's smallest subnormal, the route is taken
only when ``amax`` is finite and ``m`` lies in ``[2^-126, t * 2^125]``; then

* a subnormal ``|x| < 2^-126`` has ``|x| * m < t / 2``, which rounds to zero whether or not it was flushed (and a
  normal ``x`` whose product is subnormal likewise): zero with the sign of ``x`` either way;
* every nonzero ``|Q|`` is at least ``t`` and ``fl(1/m) >= 2^-125 / t``, so each dequantized product is normal;
* ``m`` and ``fl(1/m)`` are normal; both come from ``_bits.div_mag`` on the scalar amax, as in ``_scale``.

Everything else (an all-zero tensor, a tiny or subnormal amax, an inf or NaN anywhere) goes by ``lax.cond`` to
``exact``: the integer route of ``_scaled`` (bit patterns, subnormals kept), so the bits never depend on the route.

The amax pass.  On CPU it is the native kernel of ``_native`` (an integer max of the bit patterns in C, about
twice as fast as a copy).  Without it, two XLA reductions: a float max, which XLA vectorizes but which on CPU does
not propagate NaN (a NaN among 4096 values is dropped), and a float sum that decides finiteness (``amax_f32``).
A non-finite tensor goes to ``exact``, which takes its amax from the bits again.

Delayed scaling (an ``amax`` from a history) is not covered: values above that amax can overflow ``x * m``, and
the integer route's NaN payloads there depend on the rest of the tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..quant._scale_rules import uses_multiplier
from ..quant._spec import QuantSpec
from . import _native
from ._bits import ABS, MIN_NORMAL, SIGN, bits, const_bits, div_mag, f32, mul_fast
from ._round import quantize_f32
from ._scale import group_scale

SCOPE = "lowprec_float_route"  # named scope of the fast branch (tests find it in the lowered HLO)


def applies(spec: QuantSpec) -> bool:
    """Whether ``fake_quantize_tensor`` takes the float route for ``spec`` when the data allows it (static)."""
    f = spec.format
    return (
        spec.scaling == "tensor" and not spec.tensor_scale and uses_multiplier(spec) and spec.rounding == "nearest"
        and f.kind == "float" and f.signed and 1 <= f.mbits < 23 and (spec.saturate or f.special == "finite")
        and f.emin - f.mbits >= -124 and f.emax - f.mbits + 23 <= 127  # t / 2 normal; C finite
    )


def amax_f32(xf: jax.Array) -> jax.Array:
    """``max |x|`` by XLA reductions, as a float32 scalar: exact when it is finite and normal (subnormals may read
    as zero); +inf unless every element is finite."""
    # sum(x * 2^-64) cannot overflow for finite x (below 2^64 per element, fewer than 2^40 elements) and is NaN or
    # inf as soon as one x is: the finiteness test.  Both reductions take x directly (XLA fuses abs and the product
    # into them); a select before the max would be written out as a whole array first.
    finite = jnp.isfinite(jnp.sum(xf * jnp.float32(2.0**-64)))
    return jnp.where(finite, jnp.max(jnp.abs(xf)), jnp.float32(jnp.inf))


def amax_bits(xf: jax.Array) -> jax.Array:
    """int32 bits of the amax the route is chosen by: the native kernel's exact one on CPU where it is available
    (``_native``), ``amax_f32`` elsewhere; the two agree wherever ``multiplier`` finds the float route exact."""
    xla = lambda v: bits(amax_f32(v))  # noqa: E731
    if not _native.available():
        return xla(xf)
    # the amax's bits carry no gradient on either route (an FFI call has no JVP rule: stop it before it needs one)
    return lax.platform_dependent(lax.stop_gradient(xf), cpu=_native.absmax_bits, default=xla)


def multiplier(amax: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(m, fl(1/m), ok)`` (float32 scalars and a bool) from the amax bits (int32 scalar), by ``_scale.group_scale``
    and ``_bits.div_mag`` (XLA on CPU's float division is not correctly rounded: ``1 / m`` came out 2 ulps off);
    ``ok``: ``m`` lies where the float route is exact (module docstring)."""
    f = spec.format
    m = group_scale(amax.reshape(()), spec, None)  # NaN bits for a non-finite amax
    ok = (m >= MIN_NORMAL) & (m <= const_bits(2.0 ** (f.emin - f.mbits + 125)))
    return f32(m), f32(div_mag(jnp.int32(const_bits(1.0)), m)), ok


def float_route(xf: jax.Array, m: jax.Array, s: jax.Array, spec: QuantSpec) -> jax.Array:
    """``Q(x * m) * s`` elementwise by the float32 route (exact only where ``multiplier``'s ``ok`` holds)."""
    f = spec.format
    with jax.named_scope(SCOPE):
        vb = bits(xf * m)  # the bitcast keeps XLA from fusing this product into the addition below (no FMA)
        a = jnp.minimum(vb & ABS, const_bits(f.max))  # saturate; the integer order of magnitudes is their order
        c = f32((jnp.maximum(a >> 23, f.emin + 127) + (23 - f.mbits)) << 23)
        rb = bits((f32(a) + c) - c)
        sign = vb & SIGN
        if not f.has_negative_zero:
            sign = jnp.where(rb == 0, 0, sign)
        return f32(rb | sign) * s


def exact(xf: jax.Array, spec: QuantSpec) -> jax.Array:
    """The integer route of ``_scaled._core`` for a tensor-scaled multiplier spec (amax from the bits)."""
    amax = jnp.max(bits(xf) & ABS).reshape([1] * xf.ndim)
    m = group_scale(amax, spec, None)
    q = quantize_f32(mul_fast(xf, f32(m)), spec.format, rounding=spec.rounding, saturate=spec.saturate, rbits=None)
    return mul_fast(q, f32(div_mag(jnp.int32(const_bits(1.0)), m)))


def fake_quantize_tensor(xf: jax.Array, spec: QuantSpec) -> jax.Array:
    """``_scaled``'s fake quantization of float32 ``xf`` (any shape) for a spec where ``applies(spec)``: the float
    route where it is exact, ``exact`` elsewhere; float32 out, the same bits either way."""
    if xf.size == 0:
        return xf
    m, s, ok = multiplier(amax_bits(xf), spec)
    return lax.cond(ok, lambda v: float_route(v, m, s, spec), lambda v: exact(v, spec), xf)
