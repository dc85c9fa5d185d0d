"""Scaled fake quantization of any spec in one native call (``lp_group_fake`` in ``_native_group.c``).

The tensor route of ``_scaled`` is two kernels of a dozen to forty tensor operations each (group amax, scale rule,
element rounding, dequantization); eagerly every one of them is a pass over memory plus dispatch.  The C kernel
does the same float32 and integer operations per element, in the same order, in three loops per row block (amax
per group, the scales once per group, then one pass over the block, still in cache, that scales, rounds, and
dequantizes), for every scaling (tensor, axis,
block, tile, none), every scale rule (float32 multiplier, E8M0 power of two with the floor / ceil / nearest rules,
a scale rounded into a float format, NVFP4's two levels by either ``two_level_rule``), and round-to-nearest,
toward-zero or stochastic rounding with the counter-based random words of ``_random`` computed in the same pass.
Where a block's scaled values are all finite, round-to-nearest takes a float32 route (``(v + C) - C``, for float
formats as in ``_elementwise``, for integer formats with their one grid step) and stochastic rounding skips the
special-value rules.
The results are the tensor route's bits (tests/test_native_group.py compares both routes on whole binades, edge
values, every named spec, and transposed and odd-shaped tensors).

Layout: a contiguous tensor, or a 2-D transposed view of one (the GEMM operands ``w.t()``, ``x.t()``), is read in
place as ``[B, R, C]`` with groups of ``gr x gc`` elements (``_view``); the result has the input's layout.  Other
strides are copied to contiguous first.  Blocks of 16 or 32 that tile contiguous rows exactly are the same blocks
as those of one row of all the elements, and run as one (``_contiguous_view``).  A call that is not split keeps its
arguments per (spec, shape, strides) (``_one_call``: operands come back every step).  Large tensors are split
into ranges of whole groups (batches, row blocks or column blocks) that run on several threads at once
(``_parallel``), each range with its own first random counter; where one group spans the tensor (tensor scaling)
or a two-level spec's tensor scale needs all of it, the tensor's amax is read first and given to every range, so
the bits do not depend on the split.  Where the kernel
does not apply (``plan`` is None: unsigned element formats, a two-level spec with power-of-two scales; or ``fake``
returns None: a group holds NaN or inf, whose NaN payloads the tensor route decides), the caller runs the tensor
route.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
from typing import NamedTuple

import torch

from ..formats import FormatSpec
from . import _native, _parallel
from ._random_py import seed_keys
from ._scale_rules import _SCALE_ROUNDING_TO_ELEM, _mantissa_bits, te_constants, uses_multiplier
from ._spec import QuantSpec

_ROUNDING = {"nearest": 0, "toward_zero": 1, "stochastic": 2, "away": 3}


class _Elem(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("mbits", ctypes.c_int32), ("emin", ctypes.c_int32),
                ("rounding", ctypes.c_int32), ("ties_away", ctypes.c_int32), ("clamp_over", ctypes.c_int32),
                ("neg_zero", ctypes.c_int32), ("special", ctypes.c_int32), ("fmax", ctypes.c_float),
                ("fmin", ctypes.c_float), ("over_value", ctypes.c_float), ("float_route", ctypes.c_int32),
                ("k", ctypes.c_float), ("cmin", ctypes.c_float)]


class _Scale(ctypes.Structure):
    _fields_ = [("rule", ctypes.c_int32), ("pow2_mode", ctypes.c_int32), ("margin", ctypes.c_int32),
                ("has_margin", ctypes.c_int32), ("margin_mul", ctypes.c_float), ("elem_max", ctypes.c_float),
                ("elem_emax", ctypes.c_int32), ("elem_max_mant", ctypes.c_int32), ("s_emin", ctypes.c_int32),
                ("s_emax", ctypes.c_int32), ("s_min", ctypes.c_float), ("s_max", ctypes.c_float),
                ("two_level", ctypes.c_int32), ("denom", ctypes.c_float), ("inv_elem_max", ctypes.c_float),
                ("clamp_v", ctypes.c_int32), ("sfmt", _Elem)]


def _f32_exact(v: float) -> bool:
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0] == v
    except OverflowError:
        return False


def _elem(fmt: FormatSpec, rounding: str, saturate: bool) -> _Elem | None:
    """``quantize_f32``'s rules for ``fmt`` as the kernel's parameters (None: not supported here)."""
    if fmt.kind == "float" and fmt.mbits == 23 and fmt.emin <= -126:
        kind = 0  # float32 itself: no rounding
    elif fmt.kind == "float" and fmt.signed:
        kind = 1
    elif fmt.kind == "int":
        kind = 2
    else:
        return None  # exponent-only element formats: the tensor route
    if not (_f32_exact(fmt.max) and _f32_exact(fmt.min)):
        return None
    from ._elementwise import fast_round_ok, route_constants, route_fits  # (it imports this module)

    clamp_over = saturate or fmt.special == "finite" or rounding == "toward_zero"
    # round-to-nearest by the float route (_elementwise's docstring has the proof), where every value is finite
    # and clamped first; its constants are exact float32 numbers
    route = kind == 1 and clamp_over and fast_round_ok(fmt, rounding)
    k, cmin = route_constants(fmt) if route else (0.0, 0.0)
    route = route and _f32_exact(k) and _f32_exact(cmin) and route_fits(fmt, fmt.max)
    if kind == 2 and rounding == "nearest" and fmt.mbits >= 1:
        # integers: one grid step 2^(emin - M) below 2^(emin + 1), where every code lies; round_int_route rounds to
        # nearest-even by (v + k) - k with k = 1.5 * 2^23 * step (ties to even: mbits >= 1, no ties-away)
        k, cmin = 1.5 * 2.0 ** (23 + fmt.emin - fmt.mbits), 0.0
        route = max(-fmt.min, fmt.max) < 2.0 ** (fmt.emin + 1) and _f32_exact(k)
    return _Elem(kind=kind, mbits=fmt.mbits, emin=fmt.emin, rounding=_ROUNDING[rounding],
                 ties_away=int(fmt.mbits == 0), clamp_over=int(clamp_over),
                 neg_zero=int(fmt.kind == "float" and fmt.has_negative_zero),
                 special=0 if fmt.has_inf else (1 if fmt.special == "finite" else 2),
                 fmax=fmt.max, fmin=fmt.min, over_value=math.inf if fmt.has_inf else math.nan,
                 float_route=int(route), k=k if route else 0.0, cmin=cmin if route else 0.0)


def _scale(spec: QuantSpec) -> _Scale | None:
    """``_scale.group_scale``'s rule for ``spec`` as the kernel's parameters (None: not supported here)."""
    fmt, sfmt = spec.format, spec.scale_spec
    if spec.scaling == "none":
        return _Scale(rule=0)
    if uses_multiplier(spec):
        return _Scale(rule=1, elem_max=fmt.max, has_margin=int(spec.margin != 0), margin_mul=2.0 ** -spec.margin)
    if not sfmt.signed:
        if spec.tensor_scale or sfmt.emin < -127 or sfmt.emax > 127:
            return None  # the kernel multiplies by 2^-k, exact for |k| <= 127
        mode = {"floor": 0, "ceil": 1, "nearest": 2}[spec.scale_rounding]
        return _Scale(rule=2, pow2_mode=mode, margin=spec.margin, elem_max=fmt.max, elem_emax=fmt.emax,
                      elem_max_mant=_mantissa_bits(fmt.max), s_emin=sfmt.emin, s_emax=sfmt.emax)
    se = _elem(sfmt, _SCALE_ROUNDING_TO_ELEM[spec.scale_rounding], True)
    denom = fmt.max * sfmt.max if spec.tensor_scale else 1.0
    if se is None or not (_f32_exact(sfmt.min_subnormal) and _f32_exact(sfmt.max) and _f32_exact(denom)):
        return None
    two_level = 0 if not spec.tensor_scale else (2 if spec.two_level_rule == "te" else 1)
    inv = te_constants(spec)[1] if two_level == 2 else 0.0
    return _Scale(rule=3, elem_max=fmt.max, has_margin=int(spec.margin != 0), margin_mul=2.0 ** spec.margin,
                  s_min=sfmt.min_subnormal, s_max=sfmt.max, two_level=two_level, denom=denom, inv_elem_max=inv,
                  clamp_v=int(two_level == 2 and spec.saturate), sfmt=se)


class _Plan(NamedTuple):
    elem: _Elem
    scale: _Scale


_plans: dict[int, tuple[QuantSpec, _Plan | None]] = {}


def plan(spec: QuantSpec) -> _Plan | None:
    """The kernel's parameters for ``spec``, or None where it does not apply (cached by identity, holding the
    spec so that its id is not reused)."""
    hit = _plans.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    e = _elem(spec.format, spec.rounding, spec.saturate)
    s = _scale(spec) if e is not None else None
    p = _Plan(e, s) if e is not None and s is not None else None
    if torch.compiler.is_compiling():
        return p
    if len(_plans) > 4096:
        _plans.clear()
    _plans[id(spec)] = (spec, p)
    return p


class _View(NamedTuple):
    base: torch.Tensor  # contiguous float32
    transposed: bool  # the input is base.t()
    dims: tuple[int, int, int]  # B, R, C
    group: tuple[int, int]  # gr, gc
    counters: tuple[int, int, int]  # sb, sr, sc


def _prod(xs: tuple[int, ...] | list[int]) -> int:
    return math.prod(xs) if xs else 1


def _contiguous_view(shape: tuple[int, ...], spec: QuantSpec) -> tuple[tuple[int, int, int], tuple[int, int],
                                                                         tuple[int, int, int]]:
    """[B, R, C], the group and the counter strides of a contiguous tensor of ``shape``."""
    n = _prod(shape)
    if spec.scaling in ("none", "tensor") or not shape:
        return (1, 1, n), (1, max(n, 1)), (0, 0, 1)
    if spec.scaling == "tile":
        assert spec.tile is not None
        r, c = shape[-2], shape[-1]
        return (_prod(shape[:-2]), r, c), spec.tile, (r * c, c, 1)
    a = spec.axis % len(shape)
    outer, k, inner = _prod(shape[:a]), shape[a], _prod(shape[a + 1:])
    size = k if spec.scaling == "axis" else int(spec.block_size or k)
    if inner == 1 and size in (16, 32) and k % size == 0 and k < n:
        # blocks of 16 or 32 along contiguous rows that they tile exactly: the same blocks, in the same order and
        # with the same counters, as blocks along one row of n elements, which the kernel runs as one block loop
        # (per row of K = 128 its per-row set-up cost as much as the row's elements: MX operands 64K: ~2x)
        return (1, 1, n), (1, size), (0, 0, 1)
    if inner == 1:
        return (1, outer, k), (1, size), (0, k, 1)
    return (outer, k, inner), (size, 1), (k * inner, inner, 1)


def _view(x: torch.Tensor, spec: QuantSpec) -> _View:
    shape = tuple(x.shape)
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        base = x.t()  # [N, M], the input [M, N] read in place: t[i, j] = base[j, i], counter i * N + j
        m, n = shape
        if spec.scaling in ("none", "tensor"):
            group = (n, m)
        elif spec.scaling == "tile":
            assert spec.tile is not None
            group = (spec.tile[1], spec.tile[0])
        else:
            a = spec.axis % 2
            size = shape[a] if spec.scaling == "axis" else int(spec.block_size or shape[a])
            group = (size, 1) if a == 1 else (1, size)
        return _View(base, True, (1, n, m), group, (0, 1, n))
    base = x if x.is_contiguous() else x.contiguous()
    dims, group, counters = _contiguous_view(shape, spec)
    return _View(base, False, dims, group, counters)


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` may go through the kernel: a plain CPU tensor outside autograd, with the kernels built."""
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.device.type == "cpu" and x.numel() > 0
            and not (x.requires_grad and torch.is_grad_enabled()) and _native.available())


def fake(x: torch.Tensor, spec: QuantSpec, keys: torch.Tensor | None, offset: torch.Tensor | None) -> (
        torch.Tensor | None):
    """``fake_quantize_tensors(x, spec, keys=keys, offset=offset)`` by the native kernel (large tensors: split
    across threads, ``_split``), or None where the kernel does not apply (module docstring).  ``x``: float32,
    bfloat16 or float16; the result has its dtype."""
    k1 = k2 = off = 0
    if spec.rounding == "stochastic":
        if keys is None or offset is None:
            return None
        k1, k2 = (int(k) & 0xFFFFFFFF for k in keys.tolist())
        off = int(offset) & 0xFFFFFFFF
    return _fake(x, spec, k1, k2, off, in_place=False)


class _OneCall(NamedTuple):
    """What ``_view`` and ``_split`` work out for one spec and one input layout whose call is not split: the
    arguments of ``lp_group_fake`` but the pointers and the first counter, and the call's scratch memory."""

    spec: QuantSpec  # held, so that its id (the cache key) is not reused
    transposed: bool
    mid: tuple[object, ...]  # B, R, C, ld, gr, gc, elem, scale
    tail: tuple[object, ...]  # sb, sr, sc, amax_mode, amax, work
    work: torch.Tensor


class _OneCalls(threading.local):
    """Per thread (the scratch memory is written by each call): (id(spec), shape, strides) -> ``_OneCall``."""

    def __init__(self) -> None:
        self.calls: dict[tuple[object, ...], _OneCall] = {}


_one_calls = _OneCalls()


def _one_call(x: torch.Tensor, spec: QuantSpec, p: _Plan, k1: int, k2: int, off: int) -> torch.Tensor | None:
    """``_fake`` of a float32 input whose call is not split, with its layout's arguments cached: the training
    GEMMs' operands are 10^4 to 10^5 elements and come back with the same spec and shape every step, where working
    out the view and the call (and allocating the scratch memory) each time cost as much as the kernel."""
    key = (id(spec), x.shape, x.stride())
    c = _one_calls.calls.get(key)
    if c is None or c.spec is not spec:
        v = _view(x, spec)  # x itself, or a transposed view of a contiguous tensor (the caller checks)
        calls = _split(v, x, p, 0, 0, 0)
        assert calls is not None and len(calls) == 1 and (v.base is x or v.transposed)  # not split: no amax first
        a = calls[0].args
        if len(_one_calls.calls) > 256:
            _one_calls.calls.clear()
        c = _OneCall(spec, v.transposed, a[2:10], a[13:], calls[0].work)
        _one_calls.calls[key] = c
    base = x.t() if c.transposed else x
    y = torch.empty_like(base)
    lib = _native.lib()
    assert lib is not None
    if not lib.lp_group_fake(base.data_ptr(), y.data_ptr(), *c.mid, k1, k2, off, *c.tail):
        return None
    return y.t() if c.transposed else y


def _fake(x: torch.Tensor, spec: QuantSpec, k1: int, k2: int, off: int, *, in_place: bool) -> torch.Tensor | None:
    p = plan(spec)
    lib = _native.lib()
    if p is None or lib is None or not usable(x):
        return None
    if (not in_place and x.dtype == torch.float32 and _parallel.parts(x.numel()) == 1
            and (x.is_contiguous() or (x.dim() == 2 and x.t().is_contiguous()))):
        return _one_call(x, spec, p, k1, k2, off)
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    v = _view(xf, spec)
    if in_place and (v.base is not x or p.scale.rule != 0):
        return None  # in place: unscaled specs (each element read once, before it is written), x itself the base
    y = x if in_place else torch.empty_like(v.base)
    calls = _split(v, y, p, k1, k2, off)
    if calls is None or not all(_parallel.run(lib.lp_group_fake, [c.args for c in calls])):
        return None
    out = y.t() if v.transposed else y.view(x.shape)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def round_in_place(x: torch.Tensor, fmt: FormatSpec, rounding: str, seed: int = 0, offset: int = 0) -> bool:
    """``x.copy_(quantize(x, fmt, rounding=rounding, seed=seed, offset=offset))`` without the new tensor and the
    copy (the optimizer's weight updates): True when done, False (``x`` unchanged) where the kernel does not apply
    (``x`` not a contiguous float32 CPU tensor outside autograd, a format no spec takes, no kernel built).  Unscaled
    specs only, whose kernel reads each element once before writing it and never declines (special values follow
    the format's rules in the loop).  ``quantize``'s seed and offset give the same random words."""
    spec = elementwise_spec(fmt, rounding, False)
    if spec is None or x.dtype != torch.float32 or not x.is_contiguous():
        return False
    k1 = k2 = 0
    if rounding == "stochastic":
        k1, k2 = seed_keys(seed)
    return _fake(x, spec, k1, k2, offset & 0xFFFFFFFF, in_place=True) is not None


class _Call(NamedTuple):
    args: tuple[object, ...]  # lp_group_fake's arguments
    work: torch.Tensor  # its scratch memory (kept alive with the arguments)


def _split(v: _View, y: torch.Tensor, p: _Plan, k1: int, k2: int, off: int) -> list[_Call] | None:
    """``lp_group_fake`` calls that together quantize ``v`` into ``y``: one, or for large tensors one per range of
    whole groups (``_parallel``): batches, else row blocks of each batch, else column blocks.  Where one group spans
    the tensor (tensor scaling) or a two-level spec's tensor scale needs the whole tensor, its amax is read first
    and given to every call (None: it is NaN or inf, the caller runs the tensor route)."""
    (b, r, c), (gr, gc), (sb, sr, sc) = v.dims, v.group, v.counters
    gr, gc = max(1, min(gr, r)), max(1, min(gc, c))
    k = _parallel.parts(b * r * c)
    nr, nc = -(-r // gr), -(-c // gc)
    mode, amax = 0, 0.0
    if k > 1 and p.scale.rule != 0 and (b * nr * nc == 1 or p.scale.two_level):
        top = _native.absmax(v.base)
        if top is None:
            return None
        mode, amax = (2, top) if b * nr * nc == 1 else (1, top)
    free = mode == 2 or p.scale.rule == 0  # one group, or no scales: any split is a split into whole groups
    if free:
        gr, gc, nr, nc = 1, 1, r, c
    px, py = v.base.data_ptr(), y.data_ptr()

    def call(b0: int, b1: int, r0: int, r1: int, c0: int, c1: int) -> _Call:
        rows, cols = r1 - r0, c1 - c0
        g_r, g_c = (rows, cols) if free else (min(gr, rows), min(gc, cols))
        groups = -(-cols // g_c)  # per row block: amax, scale, dequantization factor; the row's spread scales
        work = torch.empty(3 * groups + (2 * cols if 1 < g_c < cols else 0), dtype=torch.float32)
        at = 4 * ((b0 * r + r0) * c + c0)
        cnt = (off + b0 * sb + r0 * sr + c0 * sc) & 0xFFFFFFFF
        return _Call((px + at, py + at, b1 - b0, rows, cols, c, g_r, g_c, ctypes.byref(p.elem), ctypes.byref(p.scale),
                      k1, k2, cnt, sb, sr, sc, mode, amax, work.data_ptr()), work)

    if k > 1 and b >= k:
        return [call(b0, b1, 0, r, 0, c) for b0, b1 in _parallel.ranges(b, k)]
    if k > 1 and nr >= k:
        return [call(i, i + 1, r0 * gr, min(r1 * gr, r), 0, c) for i in range(b) for r0, r1 in _parallel.ranges(nr, k)]
    if k > 1 and nc >= k:
        align = gc * 16 // math.gcd(gc, 16)  # whole groups and whole 64-byte cache lines of each row
        return [call(i, i + 1, 0, r, c0, c1) for i in range(b) for c0, c1 in _parallel.ranges(c, k, align)]
    return [call(0, b, 0, r, 0, c)]


_elementwise_specs: dict[tuple[str, str, bool], QuantSpec] = {}


def elementwise_spec(fmt: FormatSpec, rounding: str, saturate: bool) -> QuantSpec | None:
    """The unscaled spec that rounds onto ``fmt`` as ``quantize`` does (cached); None for the exponent-only formats,
    which no spec takes as elements (``quantize`` keeps the tensor route for them)."""
    if not fmt.signed:
        return None
    key = (fmt.name, rounding, saturate)
    spec = _elementwise_specs.get(key)
    if spec is None:
        spec = QuantSpec(elem=fmt, scaling="none", rounding=rounding, saturate=saturate)  # type: ignore[arg-type]
        _elementwise_specs[key] = spec
    return spec


def kahan_update(p: torch.Tensor, old: torch.Tensor, c: torch.Tensor, fmt: FormatSpec) -> bool:
    """The Kahan-compensated weight update of ``lowprec.optim`` in place, in one native pass:
    ``y = (p - old) - c``, ``t = Q(old + y)``, ``c = Q((t - old) - y)``, ``p = t`` with ``Q`` rounding to nearest
    onto ``fmt``.  False (nothing changed) where the kernel does not apply: the caller runs the tensor
    operations."""
    lib = _native.lib()
    spec = elementwise_spec(fmt, "nearest", False)
    pl = plan(spec) if spec is not None else None  # cached per spec: no per-step parameter building
    if lib is None or pl is None or pl.elem.kind == 0 or not (p.shape == old.shape == c.shape) or p.numel() == 0:
        return False
    if not all(_native.usable(t) for t in (p, old, c)):  # contiguous float32 CPU tensors outside autograd
        return False
    lib.lp_kahan_update(p.data_ptr(), old.data_ptr(), c.data_ptr(), p.numel(), ctypes.byref(pl.elem))
    return True
