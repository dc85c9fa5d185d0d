"""Float32 arithmetic on int32 bit patterns, exact on every backend.

Why integers.  XLA's CPU backend (and TPUs) flush float32 subnormals to zero: an operand below ``2^-126`` is read
as zero and a result below it is written as zero (``1e-40 * 1.0 == 0`` and ``1e-40 > 0`` is False under JAX on
CPU), and a division by a compile-time constant is rewritten as a multiplication by its rounded reciprocal.
PyTorch on CPU does neither.  To give PyTorch's bits on every JAX backend, the quantizers never let float
hardware see a subnormal: values are handled as their int32 bit patterns (``lax.bitcast_convert_type``), where
comparisons of non-negative floats are integer comparisons and rounding is integer shifting.

The few true multiplications and divisions of the scaled path (``x * m``, ``x / scale``, ``amax / max_elem``,
``1 / m``) are done here in integer arithmetic with IEEE 754 round-to-nearest-even, subnormal results included:

* ``mul_mag``: the 48-bit product of two 24-bit significands as two 24-bit limbs (12-bit partial products, each
  below 2^24), rounded once at the right bit;
* ``div_mag``: 26 quotient bits by restoring long division (remainder below 2^26) plus a sticky bit, rounded once.

``mul_fast``/``div_fast`` use the float hardware and fall back to these only when some operand or result is
subnormal (``lax.cond`` on the whole array, so jitted code pays for the integer route only on such inputs).
Only int32 is used (JAX's default 32-bit mode is enough; no ``jax_enable_x64``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

ABS = 0x7FFFFFFF
SIGN = -(1 << 31)  # 0x80000000 as int32
INF = 0x7F800000
QNAN = 0x7FC00000
MIN_NORMAL = 0x00800000


def bits(x: jnp.ndarray) -> jnp.ndarray:
    """The int32 bit pattern of a float32 array."""
    return lax.bitcast_convert_type(x, jnp.int32)


def f32(b: jnp.ndarray) -> jnp.ndarray:
    """The float32 array with int32 bit pattern ``b``."""
    return lax.bitcast_convert_type(b, jnp.float32)


def const_bits(v: float) -> int:
    """The float32 bit pattern of a Python float (that float32 holds exactly) as a Python int (signed int32)."""
    import struct

    u = struct.unpack("<I", struct.pack("<f", v))[0]
    return u - (1 << 32) if u >= 1 << 31 else u


def pow2_bits(k: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``2.0 ** k`` for int32 ``k`` in ``[-149, 127]``."""
    normal = (k + 127) << 23
    sub = jnp.left_shift(jnp.int32(1), jnp.clip(k + 149, 0, 22))
    return jnp.where(k >= -126, normal, sub)


def make_float(n: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``n * 2^k`` for int32 ``0 <= n <= 2^24`` and ``k >= -149`` (the value lies on float32's grid);
    +inf above float32's range.  Integer operations only (no subnormal ever reaches float hardware)."""
    fb = bits(n.astype(jnp.float32))  # exact: n <= 2^24
    ef = (fb >> 23) + k  # exponent field of the result if it is normal
    sub = jnp.left_shift(n, jnp.clip(k + 149, 0, 31))  # subnormal: the bits are the multiple of 2^-149
    out = jnp.where(ef >= 1, fb + (k << 23), sub)
    out = jnp.where(ef >= 255, INF, out)
    return jnp.where(n == 0, 0, out)


def _unpack(a: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """For finite non-negative bits ``a != 0``: (24-bit normalised significand, unbiased exponent)."""
    e = a >> 23
    sig = jnp.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
    # subnormals: shift the leading one up to bit 23 (int -> float conversion is exact for sig < 2^24)
    lead = (bits(sig.astype(jnp.float32)) >> 23) - 127  # floor(log2 sig)
    shift = jnp.clip(23 - lead, 0, 23)
    return jnp.left_shift(sig, shift), jnp.maximum(e, 1) - 127 - shift


def _round_shift(p: jnp.ndarray, d: jnp.ndarray, sticky: jnp.ndarray) -> jnp.ndarray:
    """``p >> d`` rounded to nearest, ties to even; ``sticky``: nonzero bits below ``p`` (``p < 2^26``, ``d >= 1``)."""
    d = jnp.clip(d, 1, 30)
    n = p >> d
    rem = p & (jnp.left_shift(jnp.int32(1), d) - 1)
    half = jnp.left_shift(jnp.int32(1), d - 1)
    up = (rem > half) | ((rem == half) & (sticky | ((n & 1) == 1)))
    return n + up.astype(jnp.int32)


def _special(a: jnp.ndarray, b: jnp.ndarray, out: jnp.ndarray, rules: list) -> jnp.ndarray:
    for cond, val in rules:
        out = jnp.where(cond, val, out)
    return out


def mul_mag(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``|x| * |y|`` correctly rounded (ties to even), from the magnitude bits ``a``, ``b`` (sign cleared)."""
    a, b = jnp.broadcast_arrays(a, b)
    sa, ea = _unpack(jnp.where(a == 0, 1, a))
    sb, eb = _unpack(jnp.where(b == 0, 1, b))
    ah, al, bh, bl = sa >> 12, sa & 0xFFF, sb >> 12, sb & 0xFFF
    mid = ah * bl + al * bh  # < 2^25
    lo = al * bl + ((mid & 0xFFF) << 12)  # < 2^25
    hi = ah * bh + (mid >> 12) + (lo >> 24)  # product = hi * 2^24 + (lo mod 2^24), hi in [2^22, 2^24)
    lo = lo & 0xFFFFFF
    p = (hi << 2) | (lo >> 22)  # the top 26 (or 25) bits, in [2^24, 2^26)
    sticky = (lo & 0x3FFFFF) != 0
    # value = p * 2^(ea + eb - 46 + 22); keep 24 bits (fewer below 2^-126)
    t = (hi >= 1 << 23).astype(jnp.int32)
    er = ea + eb + t
    d = 1 + t + jnp.maximum(0, -126 - er)
    n = _round_shift(p, d, sticky)
    out = make_float(n, jnp.maximum(ea + eb - 24 + d, -149))
    an, bn = a > INF, b > INF
    ai, bi = a == INF, b == INF
    zero = (a == 0) | (b == 0)
    return _special(a, b, out, [
        (zero, 0), ((ai | bi), INF), ((ai & (b == 0)) | (bi & (a == 0)), QNAN), (an | bn, QNAN),
    ])


def div_mag(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``|x| / |y|`` correctly rounded (ties to even), from the magnitude bits ``a``, ``b``."""
    a, b = jnp.broadcast_arrays(a, b)
    sa, ea = _unpack(jnp.where(a == 0, 1, a))
    sb, eb = _unpack(jnp.where(b == 0, 1, b))
    small = sa < sb
    r = jnp.where(small, sa << 1, sa)
    eq = ea - eb - small.astype(jnp.int32)  # quotient in [1, 2) * 2^eq

    def step(_: int, rq: tuple[jnp.ndarray, jnp.ndarray]) -> tuple[jnp.ndarray, jnp.ndarray]:
        r, q = rq  # restoring division: r < 2 * sb < 2^25 throughout
        bit = r >= sb
        return jnp.where(bit, r - sb, r) << 1, (q << 1) | bit.astype(jnp.int32)

    r, q = lax.fori_loop(0, 26, step, (r, jnp.zeros_like(r)))
    # q in [2^25, 2^26): value = q * 2^(eq - 25) (+ sticky)
    d = 2 + jnp.maximum(0, -126 - eq)
    n = _round_shift(q, d, r != 0)
    out = make_float(n, jnp.maximum(eq - 25 + d, -149))
    an, bn = a > INF, b > INF
    ai, bi = a == INF, b == INF
    return _special(a, b, out, [
        (a == 0, 0), (b == 0, INF), (ai, INF), (bi, 0), ((a == 0) & (b == 0), QNAN), (ai & bi, QNAN),
        (an | bn, QNAN),
    ])


def _sign_apply(mag: jnp.ndarray, sign: jnp.ndarray) -> jnp.ndarray:
    return mag | (sign & SIGN)


def mul_signed(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``x * y`` (both int32 float bit patterns), IEEE round-to-nearest-even with subnormals."""
    return _sign_apply(mul_mag(x & ABS, y & ABS), x ^ y)


def div_signed(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """Bits of ``x / y`` (both int32 float bit patterns), IEEE round-to-nearest-even with subnormals."""
    return _sign_apply(div_mag(x & ABS, y & ABS), x ^ y)


def _needs_soft(xb: jnp.ndarray, yb: jnp.ndarray, rb: jnp.ndarray) -> jnp.ndarray:
    """Whether a hardware result ``rb`` of an operation on ``xb``, ``yb`` may differ from IEEE (subnormals)."""
    xa, ya, ra = xb & ABS, yb & ABS, rb & ABS
    sub = lambda v: (v != 0) & (v < MIN_NORMAL)  # noqa: E731
    tiny = (ra <= MIN_NORMAL) & (xa != 0) & (xa < INF) & (ya < INF) & (ya != 0)
    return jnp.any(sub(xa) | sub(ya) | tiny)


def _fast(op, soft, x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    x, y = jnp.broadcast_arrays(x, y)
    if x.size == 0:
        return op(x, y)
    xb, yb = bits(x), bits(y)
    r = op(x, y)
    return lax.cond(_needs_soft(xb, yb, bits(r)), lambda: f32(soft(xb, yb)), lambda: r)


def mul_fast(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """``x * y`` (float32) with IEEE subnormals: the hardware product unless a subnormal is involved."""
    return _fast(lax.mul, mul_signed, x, y)


def div_fast(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """``x / y`` (float32) with IEEE subnormals: the hardware quotient unless a subnormal is involved."""
    return _fast(lax.div, div_signed, x, y)
