"""Emulating a GEMM accumulator of limited precision.

Tensor cores multiply low-precision operands exactly but may add the products into an accumulator narrower than
float32 (DeepSeek-V3 measured about 14 significant bits for fp8 on H800) and periodically promote the partial sum
to a float32 register.  Two models (``lowprec.recipes.Accumulator``), for ``out[m, n] = sum_k a[m, k] * b[n, k]``:

The sequential model rounds after every addition::

    part = 0; total = 0
    for k in 0 .. K-1:
        part = Q_acc(fl32(part + a[m,k] * b[n,k]))       # each addition rounded into the accumulator format
        if (k + 1) % chunk == 0: total = fl32(total + part); part = 0     # promotion
    out = fl32(total + part)

Products of fp8/bf16/fp16 operands are exact in float32, so the only roundings are the ones written above.
``reference_loop`` runs it over k with whole ``[M, N]`` planes at a time (one elementwise quantizer pass per
reduction index: the oracle); ``accumulate_matmul`` runs the same float32 operations in the same order in one C
loop (``lowprec/quant/_native_accum.c``), where the rounding into a format with float32's exponent (e8m13,
bfloat16) is a mask on the bit pattern that the compiler vectorizes: the same bits, about two orders of magnitude
faster.

The blocked fused multiply-add model (Fasi, Higham, Mikaitis and Pranesh, 2021) adds ``n`` products at a time::

    c = 0
    for each block of n reduction indices:
        terms = [c, a[m,k] * b[n,k] for k in the block]          # exact products
        e = max exponent of the nonzero terms
        c = R_acc(sum of trunc(t / 2^(e - bits + 1)) * 2^(e - bits + 1))   # aligned, truncated, one rounding
    (promotion every chunk products as above)

``blocked_reference`` is that definition in exact rational arithmetic (the oracle); the C kernel computes it with
exact products in double, the aligned terms truncated to integers and summed exactly, vectorized over columns.

Inside ``torch.compile`` the kernels are one opaque operator (``torch.ops.lowprec.accumulate_matmul``): the
graph around it is compiled, the accumulation runs as eagerly.  Where no C compiler is available (or
``LOWPREC_NATIVE=0``) the sequential model runs the reference loop and the blocked model its tensor version; the
bits are the same.
"""

from __future__ import annotations

import ctypes
import math
from fractions import Fraction

import torch

from .. import formats
from ..formats import FormatSpec
from ..quant import _native, quantize
from ..recipes import Accumulator


def accumulate_matmul(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """``a @ b^T`` for ``a: [..., M, K]``, ``b: [..., N, K]`` (float32) with the accumulator model; ``[..., M, N]``."""
    if not acc.emulated:
        return a @ b.transpose(-1, -2)
    if a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and _native_on():
        if torch.compiler.is_compiling():
            return torch.ops.lowprec.accumulate_matmul(a, b, *_op_args(acc))
        return _native_batched(a, b, acc)
    if acc.block is not None:
        return _blocked_tensor(a, b, acc)
    return reference_loop(a, b, acc)


@torch._dynamo.assume_constant_result
def _native_on() -> bool:
    return _native.available()


# ------------------------------------------------------------------------------------------------- the oracle
def reference_loop(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """The sequential model as one elementwise pass of ``[..., M, N]`` planes per reduction index (the oracle)."""
    assert acc.format is not None and acc.block is None
    fmt = formats.get(acc.format)
    k_len = a.shape[-1]
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-2])
    total = torch.zeros(shape, dtype=torch.float32, device=a.device)
    part = torch.zeros_like(total)
    chunk = acc.chunk or k_len
    for k in range(k_len):
        prod = a[..., :, k].unsqueeze(-1) * b[..., :, k].unsqueeze(-2)  # [.., M, 1] * [.., 1, N], exact for fp8/bf16
        part = quantize(part + prod, fmt, rounding=acc.rounding)
        if (k + 1) % chunk == 0:
            total = total + part
            part = torch.zeros_like(total)
    return total + part


def _round_fraction(x: Fraction, fmt: FormatSpec | None, toward_zero: bool) -> float:
    """The exact rational ``x`` rounded into an IEEE-style float format (float32 when None), ties to even."""
    mbits, emin, emax, vmax = _fmt_params(fmt)
    if x == 0:
        return 0.0
    mag = abs(x)
    e = max(min(_binade(mag), emax), emin)
    q = Fraction(2) ** (e - mbits)
    n = mag / q
    r = math.floor(n) if toward_zero else round(n)  # round() of a Fraction: ties to even
    val = r * q
    out = (vmax if toward_zero else math.inf) if val > vmax else float(val)
    return out if x > 0 else -out


def blocked_reference(a: list[list[float]], b: list[list[float]], acc: Accumulator) -> list[list[float]]:
    """The blocked fused multiply-add model on Python lists ``a: [M][K]``, ``b: [N][K]`` in exact rational
    arithmetic (finite inputs): an oracle independent of the C kernel's double and integer arithmetic."""
    assert acc.block is not None and acc.bits is not None
    fmt = None if acc.format is None else formats.get(acc.format)
    tz = acc.rounding == "toward_zero"
    out = []
    for row in a:
        out_row = []
        for col in b:
            total, c, since = 0.0, 0.0, 0
            for k0 in range(0, len(row), acc.block):
                prods = [u * v for u, v in zip(row[k0:k0 + acc.block], col[k0:k0 + acc.block], strict=True)]
                terms = [Fraction(c)] + [Fraction(p) for p in prods]  # products of floats: exact in double
                nonzero = [t for t in terms if t != 0]
                if nonzero:
                    e = max(_binade(t) for t in nonzero)
                    q = Fraction(2) ** (e - acc.bits + 1)
                    s = sum((math.trunc(t / q) * q for t in terms), Fraction(0))
                    c = _round_fraction(s, fmt, tz) if s != 0 else 0.0
                else:
                    c = -0.0 if all(math.copysign(1.0, v) < 0 for v in [c, *prods]) else 0.0  # signs: floats
                since += len(prods)
                if acc.chunk is not None and since >= acc.chunk:
                    total = _f32(total + c)
                    c, since = 0.0, 0
            out_row.append(_f32(total + c))
        out.append(out_row)
    return out


def _binade(t: Fraction) -> int:
    """``floor(log2 |t|)`` exactly (``math.log2`` of a Fraction can be off by one near powers of two)."""
    e = math.floor(math.log2(abs(t)))
    while Fraction(2) ** e > abs(t):
        e -= 1
    while Fraction(2) ** (e + 1) <= abs(t):
        e += 1
    return e


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _fmt_params(fmt: FormatSpec | None) -> tuple[int, int, int, float]:
    """``(mantissa bits, emin, emax, max)`` of an IEEE-style format, float32 for None."""
    if fmt is None:
        return 23, -126, 127, float.fromhex("0x1.fffffep127")
    return fmt.mbits, fmt.emin, fmt.emax, fmt.max


# ------------------------------------------------------------------------------------------------ the kernels
class _Fmt(ctypes.Structure):
    _fields_ = [("mbits", ctypes.c_int32), ("emin", ctypes.c_int32), ("emax", ctypes.c_int32),
                ("toward_zero", ctypes.c_int32), ("maxv", ctypes.c_double)]


_NR = 32  # the kernel's tile width: b's rows are padded to a multiple of it


def _kernel_route(acc: Accumulator) -> tuple[_Fmt, bool] | None:
    """The C format parameters and whether the bit-mask route applies, or None where the kernel does not apply
    (a sequential accumulator in a format that is not an IEEE-style float)."""
    fmt = None if acc.format is None else formats.get(acc.format)
    if fmt is not None and (fmt.kind != "float" or fmt.special != "ieee" or not fmt.signed or fmt.frac_bits):
        return None
    mbits, emin, emax, vmax = _fmt_params(fmt)
    mask = fmt is None or (fmt.ebits == 8 and fmt.bias == 127 and fmt.mbits <= 23)
    return _Fmt(mbits, emin, emax, int(acc.rounding == "toward_zero"), vmax), mask


def _native_2d(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """One ``[M, K] x [N, K]`` GEMM through the C kernels."""
    route = _kernel_route(acc)
    if route is None:
        return reference_loop(a, b, acc)
    params, mask = route
    lib = _native.lib()
    assert lib is not None
    a = a.detach().contiguous()
    (m, k), n = a.shape, b.shape[0]
    ldb = -(-n // _NR) * _NR
    bt = torch.zeros(k, ldb, dtype=torch.float32)
    bt[:, :n] = b.detach().t()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        chunk = acc.chunk or max(k, 1)
        if acc.block is None:
            lib.lp_accum_seq(a.data_ptr(), bt.data_ptr(), out.data_ptr(), m, n, ldb, k, chunk, ctypes.byref(params),
                             int(mask))
        else:
            assert acc.bits is not None
            lib.lp_accum_blocked(a.data_ptr(), bt.data_ptr(), out.data_ptr(), m, n, ldb, k, acc.chunk or 0,
                                 acc.block, acc.bits, ctypes.byref(params))
    return out


def _native_batched(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """Leading dimensions: ``b`` without them folds ``a``'s into its rows; otherwise one GEMM per batch element."""
    if a.dim() == 2 and b.dim() == 2:
        return _native_2d(a, b, acc)
    if b.dim() == 2:
        out = _native_2d(a.reshape(-1, a.shape[-1]), b, acc)
        return out.reshape(*a.shape[:-1], b.shape[0])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    outs = [_native_2d(x, y, acc) for x, y in zip(a3, b3, strict=True)]
    return torch.stack(outs).reshape(*batch, a.shape[-2], b.shape[-2])


def _blocked_tensor(a: torch.Tensor, b: torch.Tensor, acc: Accumulator) -> torch.Tensor:
    """The blocked model with tensor operations in float64 (the route without a C compiler): exact products,
    alignment by ``frexp``, truncated terms summed as int64, one rounding into the format."""
    assert acc.block is not None and acc.bits is not None
    fmt = None if acc.format is None else formats.get(acc.format)
    mbits, emin, emax, vmax = _fmt_params(fmt)
    tz = acc.rounding == "toward_zero"
    a64, b64 = a.double(), b.double()
    k_len = a.shape[-1]
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-2])
    total = torch.zeros(shape, dtype=torch.float32, device=a.device)
    c = torch.zeros(shape, dtype=torch.float64, device=a.device)
    since = 0
    for k0 in range(0, k_len, acc.block):
        prods = a64[..., :, k0:k0 + acc.block].unsqueeze(-2) * b64[..., :, k0:k0 + acc.block].unsqueeze(-3)
        terms = torch.cat([c.unsqueeze(-1), prods], dim=-1)  # [.., M, N, 1 + n]
        special = ~torch.isfinite(terms).all(-1)
        _, e = torch.frexp(torch.where(torch.isfinite(terms), terms, 0.0))
        emax_t = torch.where(terms != 0, e - 1, torch.iinfo(torch.int32).min).amax(-1)
        qe = (emax_t - acc.bits + 1).clamp(min=-2000).unsqueeze(-1)
        ints = torch.trunc(torch.ldexp(torch.where(torch.isfinite(terms), terms, 0.0), (-qe).double()))
        s = torch.ldexp(ints.to(torch.int64).sum(-1).double(), qe.squeeze(-1).double())
        rounded = _round_tensor(s, mbits, emin, emax, vmax, tz)
        zero_sign = torch.where(torch.signbit(terms).all(-1), -0.0, 0.0).double()
        c = torch.where(special, terms.sum(-1), torch.where(emax_t == torch.iinfo(torch.int32).min, zero_sign,
                                                             rounded))
        since += prods.shape[-1]
        if acc.chunk is not None and since >= acc.chunk:
            total = total + c.float()
            c = torch.zeros_like(c)
            since = 0
    return total + c.float()


def _round_tensor(s: torch.Tensor, mbits: int, emin: int, emax: int, vmax: float, tz: bool) -> torch.Tensor:
    """float64 ``s`` (finite) rounded into the format: ``q_ieee`` of ``_native_accum.c`` as tensor operations."""
    _, e = torch.frexp(s)
    e = (e - 1).clamp(emin, emax)
    q = torch.ldexp(torch.ones_like(s), (e - mbits).double())
    n = s / q
    r = (torch.trunc(n) if tz else torch.round(n)) * q
    over = r.abs() > vmax
    r = torch.where(over, torch.copysign(torch.tensor(vmax if tz else math.inf, dtype=s.dtype), s), r)
    return torch.where(r == 0, torch.copysign(torch.zeros_like(s), s), r)


# ------------------------------------------------------------------------------------ inside torch.compile
def _op_args(acc: Accumulator) -> tuple[str, int, str, int, int]:
    return acc.format or "", acc.chunk or 0, acc.rounding, acc.block or 0, acc.bits or 0


def _from_args(fmt: str, chunk: int, rounding: str, block: int, bits: int) -> Accumulator:
    return Accumulator(format=fmt or None, chunk=chunk or None, rounding=rounding,  # type: ignore[arg-type]
                       block=block or None, bits=bits or None)


@torch.library.custom_op("lowprec::accumulate_matmul", mutates_args=())
def _accumulate_op(a: torch.Tensor, b: torch.Tensor, fmt: str, chunk: int, rounding: str, block: int,
                   bits: int) -> torch.Tensor:
    return _native_batched(a, b, _from_args(fmt, chunk, rounding, block, bits))


@_accumulate_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, fmt: str, chunk: int, rounding: str, block: int, bits: int) -> torch.Tensor:
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-2])
    return a.new_empty(shape)
