"""``quantize``: elementwise rounding of a tensor onto a format's grid (no scaling).

The result stays in the input's dtype; only its values change.  It equals, bit for bit, a cast to the format and
back (``x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(float32)``) for ``rounding="nearest"`` and
``saturate=False``, with one deliberate difference: NaN stays NaN for formats that have no NaN encoding (float6,
float4), where ml_dtypes returns -0 and would hide the NaN.

Overflow follows the format's own rule unless ``saturate=True``.  PyTorch's ``x.to(torch.float8_e4m3fn)`` differs:
it saturates out-of-range values (even inf) to +-448; ``quantize(x, "float8_e4m3fn", saturate=True)`` matches it
on finite values, while inf stays visible (as NaN, e4m3fn has no inf).

Eager fast path (``round_nearest_fast``).  The kernel of ``_round`` takes about forty integer operations, each a
separate pass over memory when run eagerly.  Round-to-nearest-even onto a float format's grid has a much shorter
float32 route: with ``step = 2^(max(E, emin) - M)`` the grid spacing at ``v`` (``E = floor(log2 |v|)``) and
``C = 1.5 * 2^23 * step``,

    RNE(v) = fl(v + C) - C

because ``v + C`` lies in ``[2^23 step, 2^24 step)``: ``|v| < 2^(max(E, emin) + 1) = 2^(M+1) step``, which is at
most ``2^22 step`` for ``M <= 21`` (the route is used for ``M <= 20``), so this holds for negative ``v`` too.  That
binade's float32 spacing is exactly ``step``, so float32's own ties-to-even addition does the rounding
(``C / step = 1.5 * 2^23`` is even, so parity is that of the result); the subtraction is exact.  ``C`` is built
from the exponent bits of ``v`` (``bits & 0x7F800000`` is ``2^E`` as a float, 0 for float32 subnormals) times
``1.5 * 2^(23 - M)``, clamped below at ``1.5 * 2^(23 + emin - M)`` (the format's subnormal step).  Zero results
come out as +0 and get ``v``'s sign back with ``copysign``.  It is used only when every ``|v|`` is finite and small
enough for ``C`` not to overflow, for signed float formats with round-to-nearest, and only eagerly (the compiled
kernel stays the bit-operation one, whose bits the test suite compares against this route).
"""

from __future__ import annotations

import math

import torch

from .. import formats
from .._errors import UsageError
from ..formats import FormatSpec
from . import _backend, _native, _native_group, _random
from ._round import quantize_f32
from ._validate import Rounding, check_bool, check_offset, check_rounding, check_seed

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(x: object, name: str = "x") -> torch.Tensor:
    """Raise a clear ``ValueError`` unless ``x`` is a float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        hint = "; call .float() first" if x.dtype == torch.float64 else ""
        raise UsageError(
            f"{name} must be a float32, bfloat16 or float16 tensor; got dtype {x.dtype}{hint}"
        )
    return x


def stochastic_args(
    rounding: str, seed: int | None, offset: int, numel: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validated (keys, offset) tensors for stochastic rounding, or (None, None)."""
    seed = check_seed(seed)
    offset = check_offset(offset, numel)
    if rounding != "stochastic":
        return None, None
    if seed is None:
        seed = _random.draw_seed()
    return _random.key_tensor(seed, device), _random.offset_tensor(offset, device)


_EXP_BITS = 0x7F800000


# Formats whose torch cast from float32 rounds to nearest-even with subnormals and keeps the sign of zero: on finite
# values within +-max (the only values the fast route lets through) it equals the kernel bit for bit (tested
# against the kernel on whole binades in tests/test_train_speedpaths.py).  On CPU only bf16/fp16 casts are
# vectorized (2.3x faster than the float route on 200K elements); torch's CPU fp8 casts are 3x slower than it, so
# fp8 takes the native cast on CUDA only.  The fnuz dtypes are left out: their "negative zero" encoding is NaN.
_NATIVE_RNE = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_RNE_CUDA = {**_NATIVE_RNE, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def fast_round_ok(fmt: FormatSpec, rounding: str) -> bool:
    """Whether ``round_nearest_fast`` handles ``fmt`` and ``rounding`` (signed float formats with 1 to 20 mantissa
    bits and float32's exponent range or less, round-to-nearest)."""
    return (
        rounding == "nearest" and fmt.kind == "float" and fmt.signed and 1 <= fmt.mbits <= 20 and fmt.emin >= -126
    )


def round_nearest_fast(
    v: torch.Tensor,
    fmt: FormatSpec,
    *,
    saturate: bool,
    vmax: float | None = None,
    sign: torch.Tensor | None = None,
    native_only: bool = False,
) -> torch.Tensor | None:
    """``quantize_f32(v, fmt, rounding="nearest", saturate=saturate)`` by the float32 route of the module
    docstring, or ``None`` where that route does not apply (non-finite values, overflow that does not saturate,
    formats ``fast_round_ok`` rejects, empty tensors): the caller then runs the kernel.

    ``v``: float32, any shape and strides.  Without ``sign`` it is not modified and a new tensor with ``v``'s
    layout is returned.  With ``sign`` (a tensor with the signs of ``v``, e.g. the unscaled ``x`` of ``v = x * m``)
    ``v`` is the caller's scratch tensor: it is rounded in place and returned.  ``vmax``: ``max |v|`` when the
    caller knows it (it must then know that ``v`` is finite); otherwise it is read back to Python (eager only).
    ``native_only``: None also where the fused C loop (``_native``) does not apply.  Unscaled bfloat16 (no
    ``vmax``; ``sign`` absent or ``v`` itself) of a tensor the C loops take is one pass on the bits that handles NaN
    and inf as well (``_native.round_bf16``), and so is float16 / float8_e5m2 by the float route
    (``_native.round_ieee``, ``one_pass_ieee``): never None.
    """
    if not fast_round_ok(fmt, "nearest") or v.numel() == 0 or v.dtype != torch.float32:
        return None
    if native_only and not _native.usable(v):
        return None
    if vmax is None and (sign is None or sign is v) and _native.usable(v):
        # unscaled: one pass that takes NaN and inf as well, for bfloat16 on the bits (``_native.round_bf16``), for
        # IEEE formats with inf and -0 (float16, float8_e5m2) by the float route (``_native.round_ieee``)
        out = v if sign is not None else None
        if fmt.name == "bfloat16":
            return _native.round_bf16(v, saturate=saturate, out=out)
        if one_pass_ieee(fmt):
            k, cmin = route_constants(fmt)
            return _native.round_ieee(v, k=k, cmin=cmin, fmax=fmt.max, saturate=saturate, out=out)
    if vmax is None and _native.usable(v):
        vmax = _native.absmax(v)
        if vmax is None:
            return None  # NaN or inf somewhere: the kernel's special-value rules apply
    if vmax is None:
        lo_t, hi_t = torch.aminmax(v)
        lo, hi = lo_t.item(), hi_t.item()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None  # NaN or inf somewhere: the kernel's special-value rules apply
        vmax = max(abs(lo), abs(hi))
    if not math.isfinite(vmax):
        return None
    clamp = clamp_for(fmt, vmax, saturate)
    if clamp is False:
        return None
    fmax = fmt.max
    native = (_NATIVE_RNE_CUDA if v.is_cuda else _NATIVE_RNE).get(fmt.name)
    big = not route_fits(fmt, min(vmax, fmax))
    if not big and _native.usable(v):  # the same operations fused in one C loop (_native.c)
        k, cmin = route_constants(fmt)
        return _native.round_nearest(v, k=k, cmin=cmin, clamp=clamp, signed_zero=fmt.has_negative_zero,
                                     out=v if sign is not None else None)
    if native_only:
        return None
    if clamp is not None:
        # clamping before rounding = rounding then saturating (fmax is on the grid)
        v = v.clamp_(-fmax, fmax) if sign is not None else torch.clamp(v, -fmax, fmax)
    if native is not None:  # finite and in range: torch's own cast is the same round-to-nearest-even, in 2 passes
        return v.to(native).to(torch.float32)
    if big:
        return None
    k, cmin = route_constants(fmt)
    c = (v.view(torch.int32) & _EXP_BITS).view(torch.float32)  # 2^E (0 for zero and float32 subnormals)
    c.mul_(k).clamp_(min=cmin)
    if sign is None:
        sign = v
        r = torch.add(v, c)
    else:
        r = v.add_(c)
    r.sub_(c)
    if fmt.has_negative_zero:
        r.copysign_(sign)
    return r


def clamp_for(fmt: FormatSpec, vmax: float, saturate: bool) -> float | None | bool:
    """How the fast route treats values up to ``vmax`` in magnitude: None (all in range), ``fmt.max`` (clamp to
    +-max first: saturation, or a format without inf/NaN encodings) or False (overflow to inf/NaN: the kernel's
    rules apply, not the fast route)."""
    if vmax <= fmt.max:
        return None
    return fmt.max if saturate or fmt.special == "finite" else False


def route_fits(fmt: FormatSpec, vmax: float) -> bool:
    """Whether the float route handles magnitudes up to ``vmax`` (after any clamp): ``C = 1.5 * 2^(E + 23 - M)``
    and ``v + C`` must stay finite."""
    return vmax < 2.0 ** (126 - (24 - fmt.mbits))


def one_pass_ieee(fmt: FormatSpec) -> bool:
    """Whether ``_native.round_ieee`` rounds ``fmt``: a float format with inf and -0 whose float route takes
    magnitudes up to ``2 * max`` (float16 and float8_e5m2; not bfloat16, which has its own kernel, nor tf32)."""
    return (fmt.kind == "float" and fmt.has_inf and fmt.has_negative_zero and fmt.name != "bfloat16"
            and fast_round_ok(fmt, "nearest") and route_fits(fmt, 2.0 * fmt.max))


def route_constants(fmt: FormatSpec) -> tuple[float, float]:
    """The fast route's ``k = 1.5 * 2^(23 - M)`` and ``cmin = 1.5 * 2^(23 + emin - M)`` (module docstring)."""
    return 1.5 * 2.0 ** (23 - fmt.mbits), 1.5 * 2.0 ** (23 + fmt.emin - fmt.mbits)


def _kernel(
    x: torch.Tensor,
    keys: torch.Tensor | None,
    off: torch.Tensor | None,
    *,
    fmt: FormatSpec,
    rounding: str,
    saturate: bool,
) -> torch.Tensor:
    xf = x.to(torch.float32)
    rbits = None
    if keys is not None and off is not None:
        rbits = _random.random_bits(keys, off, x.numel(), x.device).view(x.shape)
    return quantize_f32(xf, fmt, rounding=rounding, saturate=saturate, rbits=rbits).to(x.dtype)


def quantize(
    x: torch.Tensor,
    fmt: str | FormatSpec,
    *,
    rounding: Rounding = "nearest",
    seed: int | None = None,
    offset: int = 0,
    saturate: bool = False,
) -> torch.Tensor:
    """Round every element of ``x`` onto the grid of ``fmt``; same shape and dtype as ``x``.

    Args:
        x: float32, bfloat16 or float16 tensor, any shape.
        fmt: a format name (``lowprec.formats.names()``) or a ``FormatSpec``.
        rounding: "nearest" (ties to even), "stochastic" (round up with probability distance / step), or
            "toward_zero".
        seed: stochastic rounding only; the random bits are a function of ``(seed, offset + i)`` for the
            row-major element index ``i``.  ``None`` draws a seed from torch's default generator.
        offset: added to the element index (quantizing a slice with ``offset=start`` equals quantizing the whole).
        saturate: clamp finite out-of-range values to +-max instead of the format's overflow value.

    If ``fmt`` has more mantissa bits than ``x``'s dtype, the result is rounded back into ``x``'s dtype.
    """
    x = check_tensor(x)
    spec = formats.get(fmt)
    mode = check_rounding(rounding)
    saturate = check_bool(saturate, "saturate")
    keys, off = stochastic_args(mode, seed, offset, x.numel(), x.device)
    # large tensors under "auto": the native kernels, else compiled; XLA tensors: the traced kernel
    native = _backend.runs_native(x.numel()) and not _backend.traces_lazily(x)
    if keys is None and native and fast_round_ok(spec, mode):
        native_only = not _backend.runs_eager(x.numel())
        r = round_nearest_fast(x.to(torch.float32), spec, saturate=saturate, native_only=native_only)
        if r is not None:
            return r.to(x.dtype)
    unscaled = _native_group.elementwise_spec(spec, mode, saturate) if native else None
    if unscaled is not None:  # any other format or rounding (stochastic: the random words in the same pass)
        r = _native_group.fake(x, unscaled, keys, off)
        if r is not None:
            return r
    return _backend.run(_kernel, x.numel(), x, keys, off, fmt=spec, rounding=mode, saturate=saturate)


def quantize_in_place(x: torch.Tensor, fmt: FormatSpec, rounding: str = "nearest", seed: int = 0,
                      offset: int = 0) -> bool:
    """``x.copy_(quantize(x, fmt, rounding=rounding, seed=seed, offset=offset))`` by the native kernels without a
    new tensor and the copy (the optimizer's weight updates).  True when done; False, ``x`` unchanged, where no
    kernel applies (not a contiguous float32 CPU tensor outside autograd, no compiler here, or, for round to
    nearest, NaN or inf in ``x`` or a format outside the float route): the caller then runs ``quantize``."""
    if rounding == "nearest":
        if not (fast_round_ok(fmt, rounding) and x.dtype == torch.float32 and x.is_contiguous()
                and _native.usable(x)):
            return False
        return round_nearest_fast(x, fmt, saturate=False, sign=x, native_only=True) is not None
    return _native_group.round_in_place(x, fmt, rounding, seed, offset)
