"""Scaled quantization: ``fake_quantize``, ``quantize_scaled``, ``dequantize`` and ``QuantSpec``.

Oracles: hand-worked blocks from the rules in the ``_spec`` docstring (OCP MX v1.0 floor rule, "ceil", "nearest",
NVFP4's two-level scales), and slow pure-numpy references that loop over the groups explicitly and round with
ml_dtypes casts (clipping to +-max first, which is what saturation means), independent of lowprec's kernels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import lowprec
from lowprec import QuantSpec
from lowprec.formats import FormatSpec
from lowprec.testing import assert_bitwise_equal


# ------------------------------------------------------------------------------------------------ helpers
def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bitwise equality (NaN == NaN), via the shipped helper with its max/mean difference and SQNR report."""
    assert_bitwise_equal(got, want, context=what)

def t32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float32)))


_ML_ELEM = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}
_MX_ELEM = {
    "mxfp8_e4m3": "float8_e4m3fn",
    "mxfp8_e5m2": "float8_e5m2",
    "mxfp6_e3m2": "float6_e3m2fn",
    "mxfp6_e2m3": "float6_e2m3fn",
    "mxfp4": "float4_e2m1fn",
    "mxint8": "int8_mx",
}
_F32_MAX = float(np.finfo(np.float32).max)


def elem_max(elem: str) -> float:
    """Largest element value, from ml_dtypes (MXINT8: 127 * 2^-6, OCP MX v1.0)."""
    if elem == "int8_mx":
        return 127 / 64
    return float(ml_dtypes.finfo(_ML_ELEM[elem]).max)


def cast_elem(v: np.ndarray, elem: str) -> np.ndarray:
    """Round float32 ``v`` to the element grid with saturation: clip to +-max, then ml_dtypes' RNE cast."""
    v = np.asarray(v, dtype=np.float32)
    if elem == "int8_mx":  # two's complement k * 2^-6, k in [-128, 127]; one zero
        k = np.clip(np.rint(v.astype(np.float64) * 64.0), -128, 127) + 0.0
        return (k / 64.0).astype(np.float32)
    m = np.float32(elem_max(elem))
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore")
        return np.clip(v, -m, m).astype(_ML_ELEM[elem]).astype(np.float32)


def mx_exponent(amax: float, elem: str, rounding: str = "floor", margin: int = 0) -> int:
    """E8M0 scale exponent for a finite block amax, from the rules in the _spec docstring (Python floats)."""
    m = elem_max(elem)
    if amax == 0.0:
        k = -1000  # clamps to the smallest scale
    else:
        e = math.frexp(amax)[1] - 1  # floor(log2 amax), exact
        if rounding == "floor":  # OCP MX: 2^(floor(log2 amax) - emax_elem)
            k = e - (math.frexp(m)[1] - 1)
        elif rounding == "ceil":  # smallest 2^k with 2^k * max_elem >= amax
            k = e - (math.frexp(m)[1] - 1) - 1
            while math.ldexp(m, k) < amax:
                k += 1
        else:  # amax / max_elem to the nearest power of two, ties up
            r = amax / m
            lo_e = math.frexp(r)[1] - 1
            lo, hi = math.ldexp(1.0, lo_e), math.ldexp(1.0, lo_e + 1)
            k = lo_e if r - lo < hi - r else lo_e + 1
    return max(-127, min(127, k + margin))


def ref_mx(x: np.ndarray, elem: str, *, block: int = 32, axis: int = -1, rounding: str = "floor", margin: int = 0):
    """Slow reference for E8M0 block scaling: (values, scale bytes); loops over every block."""
    xt = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    k_len = xt.shape[-1]
    nb = max(1, -(-k_len // block))
    out = np.zeros_like(xt)
    sbytes = np.zeros(xt.shape[:-1] + (nb,), dtype=np.uint8)
    for idx in np.ndindex(*xt.shape[:-1]):
        row = xt[idx]
        for b in range(nb):
            blk = row[b * block : (b + 1) * block]
            if blk.size == 0:
                continue
            amax = float(np.max(np.abs(blk)))
            if not math.isfinite(amax):
                out[idx + (slice(b * block, (b + 1) * block),)] = np.nan
                sbytes[idx + (b,)] = 0xFF
                continue
            k = mx_exponent(amax, elem, rounding, margin)
            sbytes[idx + (b,)] = 127 + k
            s = math.ldexp(1.0, k)
            v = (blk.astype(np.float64) / s).astype(np.float32)  # exact power-of-two division
            q = cast_elem(v, elem)
            out[idx + (slice(b * block, (b + 1) * block),)] = (q.astype(np.float64) * s).astype(np.float32)
    return np.moveaxis(out, -1, axis), np.moveaxis(sbytes, -1, axis)


def ref_nvfp4(x: np.ndarray, rule: str = "te"):
    """Slow NVFP4 reference: (values, e4m3 block scales as float32, tensor scale), all float32 arithmetic.

    ``rule="te"``: TransformerEngine's kernels (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh and
    quantize_transpose_nvfp4.cuh; its Python reference custom_recipes/reference_nvfp4.py): S_enc = 2688 / amax
    (float32 max at most, 1 for amax 0), S_dec = 1 / S_enc, block scale e4m3(block_amax * (S_enc * fl(1/6))) with
    no lower bound, elements clamp(x * min(1 / (s * S_dec), float32 max), -6, 6) rounded to e2m1; the decode scale
    s * fl(amax / 2688) (TE's GEMM alpha and dequantize use amax / (6 * 448)).  ``rule="divide"``: lowprec's
    earlier rule (s_t = amax / 2688 >= 2^-126, block scale (block_amax / 6) / s_t clamped to [2^-9, 448], x / eff).
    """
    x = np.asarray(x, dtype=np.float32)
    f = np.float32
    fmax = f(np.finfo(np.float32).max)
    amax_t = f(np.max(np.abs(x)))
    nb = max(1, -(-x.shape[-1] // 16))
    out = np.zeros_like(x)
    scales = np.zeros(x.shape[:-1] + (nb,), dtype=np.float32)
    if not np.isfinite(amax_t):
        return np.full_like(x, np.nan), np.full_like(scales, np.nan), f(np.nan)
    if rule == "te":
        with np.errstate(divide="ignore", over="ignore"):
            s_enc = f(1.0) if amax_t == 0 else min(f(f(6 * 448) / amax_t), fmax)
            s_dec = f(f(1.0) / s_enc)
            m6 = f(s_enc * f(1.0 / 6.0))
        s_t = f(1.0) if amax_t == 0 else max(f(amax_t / f(6 * 448)), f(2.0**-149))
    else:
        s_t = f(1.0) if amax_t == 0 else max(f(amax_t / f(6 * 448)), f(2.0**-126))
    for idx in np.ndindex(*x.shape[:-1]):
        for b in range(nb):
            sl = idx + (slice(b * 16, (b + 1) * 16),)
            blk = x[sl]
            if blk.size == 0:
                continue
            bmax = f(np.max(np.abs(blk)))
            if rule == "te":
                s = cast_elem(np.array([f(bmax * m6)]), "float8_e4m3fn")[0]  # nearest-even, saturating, may be 0
                with np.errstate(divide="ignore", over="ignore"):
                    m = min(f(f(1.0) / f(s * s_dec)), fmax)
                    v = np.clip((blk * m).astype(np.float32), f(-6.0), f(6.0))
                q = cast_elem(v, "float4_e2m1fn")
                eff = f(s * s_t)
            else:
                raw = f(f(bmax / f(6.0)) / s_t)
                s = cast_elem(np.array([raw]), "float8_e4m3fn")[0]  # e4m3, nearest-even, saturating
                s = f(min(max(s, f(2.0**-9)), f(448.0)))  # clamp to [smallest subnormal, max]
                eff = f(s * s_t)
                q = cast_elem(blk / eff, "float4_e2m1fn")
            scales[idx + (b,)] = s
            out[sl] = q * eff
    return out, scales, s_t


def groups_of(shape: tuple[int, ...], spec: QuantSpec) -> list[tuple]:
    """Index tuples of every scaling group, enumerated with explicit loops (independent of lowprec._groups)."""
    nd = len(shape)
    if spec.scaling == "tensor":
        return [tuple(slice(None) for _ in shape)]
    if spec.scaling == "axis":
        a = spec.axis % nd
        return [
            tuple(slice(None) if d == a else i[d] for d in range(nd))
            for i in np.ndindex(*[1 if d == a else n for d, n in enumerate(shape)])
        ]
    if spec.scaling == "block":
        a, bs = spec.axis % nd, spec.block_size
        out = []
        for i in np.ndindex(*[n if d != a else 1 for d, n in enumerate(shape)]):
            for b in range(max(1, -(-shape[a] // bs))):
                out.append(tuple(slice(b * bs, (b + 1) * bs) if d == a else i[d] for d in range(nd)))
        return out
    ta, tb = spec.tile
    m, k = shape[-2:]
    out = []
    for i in np.ndindex(*shape[:-2]):
        for r in range(max(1, -(-m // ta))):
            for c in range(max(1, -(-k // tb))):
                out.append(tuple(i) + (slice(r * ta, (r + 1) * ta), slice(c * tb, (c + 1) * tb)))
    return out


def ref_float32_scaled(x: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, list[float]]:
    """Reference with float32 scales, the TransformerEngine/torchao convention: per group the multiplier
    m = float32(max_elem / amax) computed in float64 and rounded once (as torchao's amax_to_scale does; amax 0 gives
    the largest float32), elements = Q(x * m) * float32(1 / m).  Returns values and the per-group stored
    (dequantization) scales float32(1 / m) in groups_of order."""
    x = np.asarray(x, dtype=np.float32)
    elem = spec.format.name
    me = np.float32(elem_max(elem))
    out = np.zeros_like(x)
    scales = []
    for g in groups_of(x.shape, spec):
        blk = x[g]
        if blk.size == 0:
            scales.append(None)
            continue
        amax = np.float32(np.max(np.abs(blk)))
        if not np.isfinite(amax):
            out[g] = np.nan
            scales.append(float("nan"))
            continue
        mult = np.float32(min(float(me) / float(amax), _F32_MAX)) if amax > 0 else np.float32(_F32_MAX)
        inv = np.float32(1.0 / float(mult))  # float64 quotient rounded once to float32 = correctly rounded
        scales.append(float(inv))
        out[g] = cast_elem((blk * mult).astype(np.float32), elem) * inv
    return out, scales


def expected_scale_tensor(shape: tuple[int, ...], spec: QuantSpec, scales: list[float]) -> torch.Tensor:
    """Place per-group scales (groups_of order) into the documented public scale shape."""
    nd = len(shape)
    if spec.scaling == "tensor":
        return torch.tensor(scales[0], dtype=torch.float32)
    if spec.scaling == "axis":
        a = spec.axis % nd
        sh = tuple(1 if d == a else n for d, n in enumerate(shape))
    elif spec.scaling == "block":
        a = spec.axis % nd
        sh = tuple(max(1, -(-n // spec.block_size)) if d == a else n for d, n in enumerate(shape))
        # groups_of enumerates the other dims row-major with the block index innermost
        arr = np.array(scales, dtype=np.float32).reshape(
            tuple(n for d, n in enumerate(sh) if d != a) + (sh[a],)
        )
        return torch.from_numpy(np.ascontiguousarray(np.moveaxis(arr, -1, a)))
    else:
        ta, tb = spec.tile
        sh = tuple(shape[:-2]) + (max(1, -(-shape[-2] // ta)), max(1, -(-shape[-1] // tb)))
    return torch.from_numpy(np.array(scales, dtype=np.float32).reshape(sh))


def varied(shape: tuple[int, ...], seed: int, spread: int = 12) -> torch.Tensor:
    """Normal samples times 2^k with k varying per element: exercises many scale exponents in one tensor."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    k = torch.randint(-spread, spread + 1, shape, generator=gen).float()
    return base * torch.exp2(k)


# ----------------------------------------------------------------------------------- MX floor rule by hand
# (spec, first-block values, E8M0 byte 127 + floor(log2 amax) - emax_elem, expected elements) worked by hand.
_HAND_FLOOR = [
    # e4m3: emax 8.  amax 500 -> X = 2^(8-8) = 1; 500 saturates to 448; 3.3 -> 3.25 (step 1/4 in [2,4));
    # -0.1 -> -13/128 (step 2^-7 in [2^-4, 2^-3): 12.8 steps -> 13).
    ("mxfp8_e4m3", [500.0, 3.3, -0.1], 127, [448.0, 3.25, -0.1015625]),
    # e4m3, amax 1: X = 2^(0-8); 0.3 * 256 = 76.8 -> 80 (step 8 in [64,128)) -> 0.3125.
    ("mxfp8_e4m3", [1.0, 0.3], 119, [1.0, 0.3125]),
    # e5m2: emax 15.  amax 1000 -> floor(log2) = 9 -> X = 2^-6; 64000 saturates to 57344 -> 896;
    # 3 -> 192 exact; -0.7 * 64 = -44.8 -> -48 (step 8 in [32, 64)) -> -0.75.
    ("mxfp8_e5m2", [1000.0, 3.0, -0.7], 121, [896.0, 3.0, -0.75]),
    # e3m2: emax 4, max 28.  amax 30 -> X = 1; 30 -> 28; 5.5 is a tie between 5 and 6 -> even 6;
    # 0.3 -> 0.3125 (step 1/16 in [1/4, 1/2): 4.8 -> 5).
    ("mxfp6_e3m2", [30.0, 5.5, 0.3], 127, [28.0, 6.0, 0.3125]),
    # e2m3: emax 2, max 7.5.  amax 7.9 -> X = 1; 7.9 -> 7.5; 1.1 -> 1.125; -0.2 -> -0.25 (subnormal step 1/8).
    ("mxfp6_e2m3", [7.9, 1.1, -0.2], 127, [7.5, 1.125, -0.25]),
    # e2m1: emax 2, max 6.  amax 7.9 -> X = 2^(2-2) = 1 and 7.9 clips to 6; 2.6 -> 3; -0.2 -> -0 (< 0.25).
    ("mxfp4", [7.9, 2.6, -0.2], 127, [6.0, 3.0, -0.0]),
    # MXINT8: emax 0.  amax 3.99 -> X = 2; 1.995 * 64 = 127.68 -> 128 clips to 127 -> 3.96875;
    # 1.01 / 2 * 64 = 32.32 -> 32 -> 1.0; -0.3 / 2 * 64 = -9.6 -> -10 -> -0.3125.
    ("mxint8", [3.99, 1.01, -0.3], 128, [3.96875, 1.0, -0.3125]),
]


@pytest.mark.parametrize("name,vals,byte,want", _HAND_FLOOR)
def test_mx_floor_rule_hand_blocks(name: str, vals: list[float], byte: int, want: list[float]) -> None:
    """OCP MX floor rule X = 2^(floor(log2 amax) - emax_elem) and saturating elements, on hand-made blocks.

    Oracle: the values worked by hand in _HAND_FLOOR's comments.  A second block of 32 copies of 0.001 checks
    that blocks are independent: floor(log2 0.001) = -10, so X = 2^(-10 - emax); its elements are worked out
    by hand per format.
    """
    # 0.001 (float32 1.00000005e-3): floor(log2) = -10, so X = 2^(-10 - emax) and 0.001 / X = 2^emax * 1.024:
    second = {  # name: (E8M0 byte, quantized 0.001)
        "mxfp8_e4m3": (127 - 18, 2.0**-10),  # 262.14 -> 256 (step 32 in [256, 512))
        "mxfp8_e5m2": (127 - 25, 2.0**-10),  # 33554.4 -> 32768 (step 8192 in [32768, 65536))
        "mxfp6_e3m2": (127 - 14, 2.0**-10),  # 16.38 -> 16 (step 4 in [16, 32))
        "mxfp6_e2m3": (127 - 12, 2.0**-10),  # 4.096 -> 4 (step 0.5 in [4, 8))
        "mxfp4": (127 - 12, 2.0**-10),  # 4.096 -> 4 (step 2 in [4, 6])
        "mxint8": (127 - 10, 66 / 64 * 2.0**-10),  # 1.024 * 64 = 65.54 -> 66
    }
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, : len(vals)] = vals
    x[0, 32:] = 0.001
    xt = t32(x)
    fake = lowprec.fake_quantize(xt, name)
    codes, scales = lowprec.quantize_scaled(xt, name)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (1, 2)
    assert scales.view(torch.uint8).tolist() == [[byte, second[name][0]]]
    expect = np.zeros((1, 64), dtype=np.float32)
    expect[0, : len(want)] = want
    expect[0, 32:] = second[name][1]
    if name == "mxint8":
        expect = expect + np.float32(0.0)  # integers have a single (+) zero
    assert_same_bits(fake, t32(expect), f"{name} fake_quantize")
    assert_same_bits(lowprec.dequantize(codes, scales, name, shape=(1, 64)), t32(expect), f"{name} dequantize")


# ------------------------------------------------------------------------------- ceil / nearest by hand
def _mx_spec(elem: str, rounding: str, **kw) -> QuantSpec:
    return QuantSpec(
        elem=elem, scaling="block", block_size=32, scale_format="float8_e8m0fnu", scale_rounding=rounding, **kw
    )


_HAND_POW2 = [
    # ceil: smallest 2^k with 2^k * max >= amax.  e4m3: 500 -> k=1 (448 < 500 <= 896); 500/2 = 250 -> 256
    # (step 16 in [128,256): 250 is nearer 256) -> 512; 3.3/2 = 1.65 -> 1.625 -> 3.25.
    ("float8_e4m3fn", "ceil", [500.0, 3.3], 128, [512.0, 3.25]),
    ("float8_e4m3fn", "ceil", [448.0, 1.0], 127, [448.0, 1.0]),  # amax == max: k = 0, no clipping
    ("float8_e4m3fn", "ceil", [224.0, -3.0], 126, [224.0, -3.0]),  # 224 = 448 / 2: k = -1
    ("float4_e2m1fn", "ceil", [7.9, 1.0], 128, [8.0, 1.0]),  # 7.9/2 = 3.95 -> 4 -> 8; 0.5 -> 0.5 -> 1
    ("float4_e2m1fn", "ceil", [3.1, 1.1], 127, [3.0, 1.0]),  # 6 * 2^-1 = 3 < 3.1: k = 0
    # nearest: amax/max to the nearest power of two (values chosen away from the log/linear ambiguity).
    ("float8_e4m3fn", "nearest", [500.0, 3.3], 127, [448.0, 3.25]),  # 1.116 -> 1: 500 saturates
    ("float8_e4m3fn", "nearest", [700.0, 1.0], 128, [704.0, 1.0]),  # 1.5625 -> 2; 350 -> 352 (step 32)
    ("float8_e4m3fn", "nearest", [672.0, 1.0], 128, [640.0, 1.0]),  # 1.5 tie -> up: 2; 336 tie -> even 320
    ("float8_e4m3fn", "nearest", [600.0, 1.0], 127, [448.0, 1.0]),  # 1.339 -> 1
    ("float4_e2m1fn", "nearest", [9.0, 1.0], 128, [8.0, 1.0]),  # 1.5 tie -> 2; 4.5 tie -> even 4 -> 8
    ("float4_e2m1fn", "nearest", [8.0, 1.0], 127, [6.0, 1.0]),  # 1.333 -> 1: 8 saturates to 6
    ("int8_mx", "nearest", [3.0, 1.0], 128, [3.0, 1.0]),  # 3 / (127/64) = 1.512 -> 2; 1.5 * 64 = 96 exact
]


@pytest.mark.parametrize("elem,rounding,vals,byte,want", _HAND_POW2)
def test_e8m0_ceil_and_nearest_hand_blocks(elem: str, rounding: str, vals, byte: int, want) -> None:
    """scale_rounding="ceil" (never clips) and "nearest" for E8M0 scales, on hand-worked blocks.

    Oracle: the worked examples in _HAND_POW2's comments, derived from the _spec docstring rules.
    """
    spec = _mx_spec(elem, rounding)
    x = np.zeros((32,), dtype=np.float32)
    x[: len(vals)] = vals
    xt = t32(x)
    codes, scales = lowprec.quantize_scaled(xt, spec)
    assert scales.view(torch.uint8).tolist() == [byte]
    expect = np.zeros((32,), dtype=np.float32)
    expect[: len(want)] = want
    assert_same_bits(lowprec.fake_quantize(xt, spec), t32(expect), f"{elem} {rounding}")
    assert_same_bits(lowprec.dequantize(codes, scales, spec, shape=(32,)), t32(expect), f"{elem} {rounding} deq")


def test_margin_shifts_power_of_two_scale() -> None:
    """margin multiplies the scale by 2^margin (E8M0: adds to the exponent).

    Oracle, worked by hand: a block with amax 448 in e4m3 has X = 1 (byte 127); margin +1 gives X = 2 (byte 128)
    and 448 -> 224 * 2 = 448; margin -1 gives X = 1/2 (byte 126) and 448 / 0.5 = 896 saturates to 448 -> 224.
    """
    x = torch.zeros(32)
    x[0] = 448.0
    for margin, byte, v in ((1, 128, 448.0), (-1, 126, 224.0), (0, 127, 448.0)):
        spec = QuantSpec(
            elem="float8_e4m3fn", scaling="block", block_size=32, scale_format="float8_e8m0fnu",
            scale_rounding="floor", margin=margin,
        )
        _, scales = lowprec.quantize_scaled(x, spec)
        assert scales.view(torch.uint8).tolist() == [byte], margin
        assert lowprec.fake_quantize(x, spec)[0].item() == v, margin


def test_float_scale_format_rounding_modes_bf16() -> None:
    """Non-power-of-two scale formats: amax / max_elem rounded into bfloat16 down, up or to nearest.

    Oracle, worked by hand: amax = float32(1.2), e4m3 max 448: 1.2 / 448 = 175.54 units of 2^-16 (the bf16 step
    in [2^-9, 2^-8)), so floor -> 175 * 2^-16, ceil and nearest -> 176 * 2^-16.  Elements: 1.2 / (175 * 2^-16)
    = 449.4 saturates to 448 -> 448 * 175 / 65536 = 1.1962890625 (the floor scale clips); with 176 * 2^-16: 446.8
    -> 448 (step 32) -> 1.203125.  0.5: 187.2 -> 192 (step 16) -> 192 * 175 / 65536 = 0.5126953125, resp.
    186.2 -> 192 -> 0.515625.
    """
    x = t32([1.2, 0.5])
    cases = {
        "floor": (175 / 65536, [1.1962890625, 0.5126953125]),
        "ceil": (176 / 65536, [1.203125, 0.515625]),
        "nearest": (176 / 65536, [1.203125, 0.515625]),
    }
    for rounding, (scale, want) in cases.items():
        spec = QuantSpec(elem="float8_e4m3fn", scaling="tensor", scale_format="bfloat16", scale_rounding=rounding)
        codes, scales = lowprec.quantize_scaled(x, spec)
        assert scales.dtype == torch.bfloat16 and scales.shape == ()
        assert scales.float().item() == scale, rounding
        assert_same_bits(lowprec.fake_quantize(x, spec), t32(want), rounding)
        assert_same_bits(lowprec.dequantize(codes, scales, spec), t32(want), rounding + " deq")


# ------------------------------------------------------------------------ MX and NVFP4 vs numpy references
_SHAPES = [(4, 64), (3, 70), (2, 3, 45), (100,), (5, 1), (2, 33)]


@pytest.mark.parametrize("name", list(_MX_ELEM))
def test_mx_specs_match_numpy_reference(name: str) -> None:
    """Every OCP MX named spec equals the slow block-loop reference bitwise (values and E8M0 bytes).

    Oracle: ref_mx - per block amax, the floor rule in Python integers, exact power-of-two division, ml_dtypes
    saturating RNE cast of the elements.  Shapes include last dims not divisible by 32 and of size 1; data spans
    2^-12 .. 2^12 per element so blocks get very different scales.
    """
    elem = _MX_ELEM[name]
    for i, shape in enumerate(_SHAPES):
        x = varied(shape, seed=100 + i)
        want, want_bytes = ref_mx(x.numpy(), elem)
        assert_same_bits(lowprec.fake_quantize(x, name), t32(want), f"{name} {shape} fake")
        codes, scales = lowprec.quantize_scaled(x, name)
        assert scales.dtype == torch.float8_e8m0fnu
        assert scales.view(torch.uint8).numpy().tolist() == want_bytes.tolist(), f"{name} {shape} scales"
        assert_same_bits(lowprec.dequantize(codes, scales, name, shape=shape), t32(want), f"{name} {shape} deq")


@pytest.mark.parametrize("rounding", ["ceil", "nearest"])
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float4_e2m1fn", "int8_mx"])
def test_e8m0_ceil_nearest_match_reference(elem: str, rounding: str) -> None:
    """E8M0 "ceil" and "nearest" scale rounding equal the Python-integer reference on random blocks.

    Oracle: ref_mx with mx_exponent's ceil (smallest k with 2^k max >= amax) and nearest (linear nearest power of
    two of amax / max, ties up) rules.  Random data essentially never hits the ambiguous range where float32
    rounding of amax / max could matter.
    """
    spec = _mx_spec(elem, rounding)
    for i, shape in enumerate([(6, 64), (3, 50)]):
        x = varied(shape, seed=200 + i)
        want, want_bytes = ref_mx(x.numpy(), elem, rounding=rounding)
        codes, scales = lowprec.quantize_scaled(x, spec)
        assert scales.view(torch.uint8).numpy().tolist() == want_bytes.tolist(), f"{elem} {rounding} scales"
        assert_same_bits(lowprec.fake_quantize(x, spec), t32(want), f"{elem} {rounding} fake")


def test_mx_block_along_axis0_and_middle_axis() -> None:
    """Blocks along axis=0 (and axis=1 of a 3-D tensor): scales shaped as the input with axis -> number of blocks.

    Oracle: ref_mx with np.moveaxis (blocks of 32 consecutive elements along the axis), looping over blocks.
    """
    for shape, axis in (((70, 5), 0), ((3, 40, 4), 1), ((33, 2), -2)):
        spec = QuantSpec(
            elem="float8_e4m3fn", scaling="block", block_size=32, axis=axis, scale_format="float8_e8m0fnu",
            scale_rounding="floor",
        )
        x = varied(shape, seed=7)
        want, want_bytes = ref_mx(x.numpy(), "float8_e4m3fn", axis=axis)
        codes, scales = lowprec.quantize_scaled(x, spec)
        assert tuple(scales.shape) == want_bytes.shape, (shape, axis, tuple(scales.shape))
        assert scales.view(torch.uint8).numpy().tolist() == want_bytes.tolist()
        assert_same_bits(lowprec.fake_quantize(x, spec), t32(want), f"axis {axis} fake")
        assert_same_bits(lowprec.dequantize(codes, scales, spec, shape=shape), t32(want), f"axis {axis} deq")


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_div"])
@pytest.mark.parametrize("shape", [(4, 64), (3, 50), (2, 3, 20), (33,), (1, 16), (7, 5)])
def test_nvfp4_matches_numpy_reference(shape, name: str) -> None:
    """NVFP4 by either two-level rule: TransformerEngine's ("nvfp4") and lowprec's earlier division ("nvfp4_div").

    Oracle: ref_nvfp4, float32 numpy arithmetic with ml_dtypes e4m3/fp4 casts, looping over blocks of 16.
    Data spans 2^-12 .. 2^12, so some block scales underflow e4m3: TE's rule rounds them to e4m3 subnormals or 0,
    the division rule clamps them to e4m3's smallest value 2^-9.
    """
    x = varied(shape, seed=sum(shape))
    want, want_scales, want_st = ref_nvfp4(x.numpy(), "te" if name == "nvfp4" else "divide")
    assert_same_bits(lowprec.fake_quantize(x, name), t32(want), f"{name} {shape} fake")
    codes, scales = lowprec.quantize_scaled(x, name)
    assert isinstance(scales, lowprec.quant.TwoLevelScales)
    assert scales.group.dtype == torch.float8_e4m3fn and scales.tensor.dtype == torch.float32
    assert scales.tensor.shape == ()
    assert scales.tensor.item() == float(want_st)
    assert_same_bits(scales.group.float(), t32(want_scales), f"{name} {shape} block scales")
    assert_same_bits(lowprec.dequantize(codes, scales, name, shape=shape), t32(want), f"{name} {shape} deq")


def test_nvfp4_hand_example() -> None:
    """NVFP4 on a hand-worked 2x16 tensor (TE's rule; the division rule gives the same values here).

    Oracle, by hand: amax = 2688 = 6 * 448, so S_enc = S_dec = s_t = 1 exactly and fl(1/6) = 1/6 + 2^-26 / 3.
    Block 0 (amax 2688): 2688 * fl(1/6) = 448 + 2^-14.2 rounds to 448 in float32 -> e4m3 448; x * fl(1/448):
    2688 -> 6, 1000 -> 2.23 -> 2 -> 896, -300 -> -0.67 -> -0.5 -> -224.  Block 1 (amax 3): 3 * fl(1/6) -> 0.5 ->
    scale 0.5, multiplier 2: 3 -> 6 -> 3, 1.3 -> 2.6 -> 3 -> 1.5, 0.1 -> 0.2 -> 0 -> 0.
    """
    x = torch.zeros(2, 16)
    x[0, :3] = torch.tensor([2688.0, 1000.0, -300.0])
    x[1, :3] = torch.tensor([3.0, 1.3, 0.1])
    want = torch.zeros(2, 16)
    want[0, :3] = torch.tensor([2688.0, 896.0, -224.0])
    want[1, :3] = torch.tensor([3.0, 1.5, 0.0])
    assert_same_bits(lowprec.fake_quantize(x, "nvfp4"), want, "nvfp4 hand")
    _, scales = lowprec.quantize_scaled(x, "nvfp4")
    assert scales.tensor.item() == 1.0
    assert scales.group.float().tolist() == [[448.0], [0.5]]


# -------------------------------------------------------------- float32 scales: tensor / axis / block / tile
_F32_SPECS = [
    QuantSpec(elem="float8_e4m3fn", scaling="tensor"),
    QuantSpec(elem="float8_e5m2", scaling="tensor"),
    QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1),
    QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=0),
    QuantSpec(elem="float8_e5m2", scaling="axis", axis=1),
    QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=32, axis=0),
    QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=16, axis=-1),
    QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(1, 128)),
    QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(128, 128)),
    QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(3, 5)),
]
_F32_SHAPES = [(6, 40), (130, 260), (2, 7, 11), (3, 300)]


@pytest.mark.parametrize("spec", _F32_SPECS, ids=lambda s: f"{s.scaling}-{s.format.name}-{s.axis}-{s.tile}")
def test_float32_scaled_matches_group_loop(spec: QuantSpec) -> None:
    """Tensorwise / axis / block / tile scaling with float32 scales equals an explicit loop over the groups.

    Oracle: groups_of enumerates each group with Python slicing (tiles over the last two dims, edge tiles
    smaller; blocks along the axis, last one shorter); per group m = float32(max_elem / amax), elements =
    ml_dtypes saturating cast of x * m, times float32(1 / m).  Scales are checked in their documented public shapes.
    """
    for i, shape in enumerate(_F32_SHAPES):
        if spec.scaling == "axis" and spec.axis >= len(shape):
            continue
        x = varied(shape, seed=300 + i, spread=6)
        want, want_scales = ref_float32_scaled(x.numpy(), spec)
        assert_same_bits(lowprec.fake_quantize(x, spec), t32(want), f"{shape} fake")
        codes, scales = lowprec.quantize_scaled(x, spec)
        assert scales.dtype == torch.float32
        assert_same_bits(scales, expected_scale_tensor(shape, spec, want_scales), f"{shape} scales")
        assert_same_bits(lowprec.dequantize(codes, scales, spec, shape=shape), t32(want), f"{shape} deq")


def test_named_tensorwise_rowwise_tile_specs_are_the_documented_groupings() -> None:
    """The fp8 named specs: tensorwise = one scale, rowwise = one per row, 1x128 / 128x128 tiles.

    Oracle: groups_of + ref_float32_scaled on a (130, 300) tensor (tiles do not divide either dimension), and
    the documented scale shapes: [], (130, 1), (130, 3), (2, 3).
    """
    x = varied((130, 300), seed=9, spread=5)
    for name, scale_shape in (
        ("fp8_e4m3_tensorwise", ()),
        ("fp8_e5m2_tensorwise", ()),
        ("fp8_e4m3_rowwise", (130, 1)),
        ("fp8_e5m2_rowwise", (130, 1)),
        ("fp8_e4m3_1x128", (130, 3)),
        ("fp8_e4m3_128x128", (2, 3)),
    ):
        spec = QuantSpec.named(name)
        want, want_scales = ref_float32_scaled(x.numpy(), spec)
        assert_same_bits(lowprec.fake_quantize(x, name), t32(want), name)
        _, scales = lowprec.quantize_scaled(x, name)
        assert tuple(scales.shape) == scale_shape, name
        assert_same_bits(scales, expected_scale_tensor((130, 300), spec, want_scales), name + " scales")


# --------------------------------------------------------------------------------------------- round trip
def _is_pow2_spec(spec: QuantSpec) -> bool:
    return not spec.scale_spec.signed


@pytest.mark.parametrize("name", QuantSpec.names())
def test_dequantize_of_quantize_scaled_equals_fake_quantize(name: str) -> None:
    """dequantize(*quantize_scaled(x, spec), spec, shape=x.shape) equals fake_quantize(x, spec) bitwise.

    Oracle: the _scaled docstring identity, for every named spec, shapes with odd last dims (fp4 / fp6 packing:
    33, 7, 1) and float32 / bfloat16 / float16 inputs.  For low-precision inputs, fake_quantize returns x's dtype,
    so it is compared with dequantize(..., dtype=x.dtype); for power-of-two (MX) scales the float32 dequantized
    values are exactly representable in x's dtype and must equal fake_quantize(x).float() directly.
    """
    spec = QuantSpec.named(name)
    for i, shape in enumerate([(4, 64), (3, 33), (2, 3, 7), (5, 1), (130, 20)]):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = varied(shape, seed=400 + i, spread=4).to(dtype)
            fake = lowprec.fake_quantize(x, spec)
            assert fake.dtype == dtype and fake.shape == x.shape
            codes, scales = lowprec.quantize_scaled(x, spec)
            deq = lowprec.dequantize(codes, scales, spec, shape=x.shape, dtype=dtype)
            assert_same_bits(deq, fake, f"{name} {shape} {dtype}")
            deq32 = lowprec.dequantize(codes, scales, spec, shape=x.shape)
            assert deq32.dtype == torch.float32
            if dtype == torch.float32 or _is_pow2_spec(spec):
                assert_same_bits(deq32, fake.float(), f"{name} {shape} {dtype} float32")


@pytest.mark.parametrize("name", QuantSpec.names())
def test_storage_dtypes_and_shapes(name: str) -> None:
    """codes and scales use the storage documented in _codec / quantize_scaled.

    Oracle: the _codec docstring: torch float8 dtypes, fp4 packed two per byte (ceil(K/2) bytes), fp6 four per
    three bytes (3 * ceil(K/4)), MXINT8 as int8; scales float8_e8m0fnu (MX), TwoLevelScales (NVFP4), float32.
    """
    spec = QuantSpec.named(name)
    x = varied((3, 33), seed=1)
    codes, scales = lowprec.quantize_scaled(x, spec)
    bits = spec.format.bits
    if spec.format.kind == "int":
        assert codes.dtype == torch.int8 and codes.shape == (3, 33)
    elif bits == 4:
        assert codes.dtype == torch.uint8 and codes.shape == (3, 17)
    elif bits == 6:
        assert codes.dtype == torch.uint8 and codes.shape == (3, 27)
    else:
        assert codes.dtype == {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[
            spec.format.name
        ]
        assert codes.shape == (3, 33)
    if name.startswith("mx"):
        assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (3, 2)
    elif name.startswith("nvfp4"):
        assert scales.group.shape == (3, 3) and scales.tensor.shape == ()
    else:
        assert scales.dtype == torch.float32


def _pack4(codes: np.ndarray) -> np.ndarray:
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), codes.dtype)], -1)
    c = codes.astype(np.uint32)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _pack6(codes: np.ndarray) -> np.ndarray:
    pad = (-codes.shape[-1]) % 4
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), codes.dtype)], -1)
    c = codes.astype(np.uint32)
    word = c[..., 0::4] | (c[..., 1::4] << 6) | (c[..., 2::4] << 12) | (c[..., 3::4] << 18)
    return np.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], -1).reshape(
        codes.shape[:-1] + (-1,)
    ).astype(np.uint8)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6_e3m2", "mxfp6_e2m3", "nvfp4"])
def test_packed_codes_match_ml_dtypes_bit_patterns(name: str) -> None:
    """Packed 4/6-bit codes are ml_dtypes' bit patterns of the element values, packed as _codec documents.

    Oracle: element values x / scale from the numpy reference, cast with ml_dtypes and viewed as uint8 (the code),
    then packed by hand: fp4 first element in the low nibble; fp6 little-endian 24-bit groups of four.
    """
    shape = (3, 37)
    x = varied(shape, seed=11)
    if name == "nvfp4":
        vals, scales, s_t = ref_nvfp4(x.numpy())
        eff = (np.repeat(scales, 16, axis=-1)[:, :37] * s_t).astype(np.float32)
        assert (eff > 0).all()  # no zero block scale here: the element values are vals / eff
        elems = (vals / eff).astype(np.float32)
    else:
        vals, sbytes = ref_mx(x.numpy(), _MX_ELEM[name])
        s = np.ldexp(1.0, np.repeat(sbytes.astype(np.int64) - 127, 32, axis=-1)[:, :37])
        elems = (vals / s).astype(np.float32)
    elem = QuantSpec.named(name).format.name
    ref_codes = elems.astype(_ML_ELEM[elem]).view(np.uint8)
    packed = _pack4(ref_codes) if QuantSpec.named(name).format.bits == 4 else _pack6(ref_codes)
    codes, _ = lowprec.quantize_scaled(x, name)
    assert codes.numpy().tolist() == packed.tolist()


# --------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "mxint8"])
def test_all_zero_block(name: str) -> None:
    """An all-zero block gets the smallest E8M0 scale (byte 0 = 2^-127) and zero codes; -0 keeps its sign.

    Oracle: the _spec docstring ("an all-zero group gets the smallest scale and zero codes"); every float
    element format of the MX family has -0, MXINT8 (two's complement) has only +0.
    """
    x = torch.zeros(2, 32)
    x[0, 1::2] = -0.0
    x[1] = torch.linspace(-3, 3, 32)
    fake = lowprec.fake_quantize(x, name)
    codes, scales = lowprec.quantize_scaled(x, name)
    assert scales.view(torch.uint8)[0, 0].item() == 0
    want0 = x[0] + 0.0 if name == "mxint8" else x[0].clone()  # -0 + 0.0 is +0
    assert_same_bits(fake[0], want0, f"{name} zero block")
    assert_same_bits(lowprec.dequantize(codes, scales, name, shape=x.shape)[0], want0, f"{name} zero block deq")


def test_all_zero_tensor_tensorwise_and_nvfp4() -> None:
    """amax = 0: the tensorwise float32 multiplier is the largest float32, stored as its reciprocal; NVFP4 uses
    s_t = 1 and block scales 0 (TE's rule: S_enc = 1, 0 * S_enc rounds to e4m3 0) or 2^-9 (the division rule's
    smallest e4m3); outputs are zeros with the input's signs.

    Oracle: the _spec docstring (float32 scales: multiplier max_elem / amax clamped to float32 max; TE's two-level
    rule has no lower bound; other scale formats clamp to [smallest, max]) and _scale's "1 for an all-zero tensor"
    tensor scale; -0 * s = -0 in IEEE arithmetic.
    """
    x = torch.tensor([[0.0, -0.0, 0.0, -0.0] * 8])
    for name in ("fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise", "fp8_e4m3_rowwise"):
        codes, scales = lowprec.quantize_scaled(x, name)
        assert torch.all(scales == torch.tensor(1.0 / _F32_MAX, dtype=torch.float32)), name
        assert_same_bits(lowprec.fake_quantize(x, name), x, name)
        assert_same_bits(lowprec.dequantize(codes, scales, name), x, name + " deq")
    for name, smallest in (("nvfp4", 0.0), ("nvfp4_div", 2.0**-9)):
        codes, scales = lowprec.quantize_scaled(x, name)
        assert scales.tensor.item() == 1.0
        assert torch.all(scales.group.float() == smallest)
        assert_same_bits(lowprec.fake_quantize(x, name), x, f"{name} zeros")
        assert_same_bits(lowprec.dequantize(codes, scales, name, shape=x.shape), x, f"{name} zeros deq")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "spec",
    ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4", "mxint8", "fp8_e4m3_rowwise", "fp8_e4m3_1x128",
     QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=16)],
    ids=lambda s: s if isinstance(s, str) else "e4m3_block16_float32_scale",
)
def test_nonfinite_poisons_only_its_group(spec, bad: float) -> None:
    """A NaN or +-inf inside a group makes that whole group NaN (E8M0 scale byte 0xFF); other groups are intact.

    Oracle: the _spec docstring rule; the other groups are compared with the same call on a tensor where the
    poisoned group is replaced by ordinary values (groups are independent), and with the numpy references.
    """
    x = varied((3, 64), seed=12, spread=3)
    x[1, 5] = bad
    fake = lowprec.fake_quantize(x, spec)
    sp = QuantSpec.named(spec) if isinstance(spec, str) else spec
    poisoned = torch.zeros_like(x, dtype=torch.bool)
    if sp.scaling == "block":
        b = sp.block_size
        poisoned[1, (5 // b) * b : (5 // b + 1) * b] = True
    elif sp.scaling == "axis":
        poisoned[1] = True
    else:  # 1x128 tile over a row of 64
        poisoned[1] = True
    assert torch.isnan(fake[poisoned]).all(), "poisoned group not all NaN"
    assert not torch.isnan(fake[~poisoned]).any(), "NaN leaked out of the poisoned group"
    clean = x.clone()
    clean[1, 5] = 1.0
    assert_same_bits(fake[~poisoned], lowprec.fake_quantize(clean, spec)[~poisoned], "other groups")
    codes, scales = lowprec.quantize_scaled(x, spec)
    deq = lowprec.dequantize(codes, scales, spec, shape=x.shape)
    assert_same_bits(deq, fake, "dequantize")
    if isinstance(spec, str) and spec.startswith("mx"):
        want, want_bytes = ref_mx(x.numpy(), _MX_ELEM[spec])
        assert_same_bits(fake, t32(want), "vs ref_mx")
        assert scales.view(torch.uint8)[1, 0].item() == 0xFF
        assert scales.view(torch.uint8).numpy().tolist() == want_bytes.tolist()


def test_nonfinite_in_tensorwise_poisons_everything() -> None:
    """Tensorwise: the tensor is one group, so one NaN/inf makes every element NaN (NaN scale).

    Oracle: the _spec docstring rule with the whole tensor as the group.
    """
    for bad in (float("nan"), float("inf")):
        x = torch.ones(4, 8)
        x[2, 3] = bad
        assert torch.isnan(lowprec.fake_quantize(x, "fp8_e4m3_tensorwise")).all()
        codes, scales = lowprec.quantize_scaled(x, "fp8_e4m3_tensorwise")
        assert torch.isnan(scales).all()
        assert torch.isnan(lowprec.dequantize(codes, scales, "fp8_e4m3_tensorwise")).all()


def test_e8m0_scale_underflow_clamps_to_2_pow_minus_127() -> None:
    """Tiny blocks: the floor rule asks for 2^(-140 - emax), the scale clamps to 2^-127 (E8M0 byte 0).

    Oracle, by hand: amax 2^-140 (a float32 subnormal); x / 2^-127 = 2^-13: below half of e4m3's smallest
    subnormal 2^-9 -> 0, while e5m2 (smallest subnormal 2^-16) keeps 2^-13 -> 2^-140 exactly.  amax 2^-130 in
    e4m3: x / 2^-127 = 2^-3, exact -> 2^-130.
    """
    for name, amax, want in (
        ("mxfp8_e4m3", 2.0**-140, 0.0),
        ("mxfp8_e5m2", 2.0**-140, 2.0**-140),
        ("mxfp8_e4m3", 2.0**-130, 2.0**-130),
    ):
        x = torch.zeros(32)
        x[0] = amax
        x[1] = -amax
        codes, scales = lowprec.quantize_scaled(x, name)
        assert scales.view(torch.uint8).tolist() == [0], name
        want_t = torch.zeros(32)
        want_t[0], want_t[1] = want, -want
        assert_same_bits(lowprec.fake_quantize(x, name), want_t, f"{name} amax {amax}")
        assert_same_bits(lowprec.dequantize(codes, scales, name), want_t, f"{name} amax {amax} deq")


def test_largest_blocks_near_float32_max() -> None:
    """amax = float32 max (1.99999988 * 2^127): the floor rule gives X = 2^(127 - emax) and the block maximum
    saturates to max_elem * X.

    Oracle, by hand: e4m3 X = 2^119 (byte 246), 511.99997 -> 448 -> 448 * 2^119; e5m2 X = 2^112 (byte 239),
    -> 57344 * 2^112; fp4 X = 2^125 (byte 252) -> 6 * 2^125; MXINT8 X = 2^127 (byte 254), 1.99999988 * 64 rounds
    to 128 and clips to 127 -> 127/64 * 2^127.  A third element 2^126 quantizes exactly in every format.
    """
    big = float(np.finfo(np.float32).max)
    cases = {
        "mxfp8_e4m3": (246, 448 * 2.0**119),
        "mxfp8_e5m2": (239, 57344 * 2.0**112),
        "mxfp4": (252, 6 * 2.0**125),
        "mxint8": (254, 127 / 64 * 2.0**127),
    }
    for name, (byte, top) in cases.items():
        # MXINT8 is two's complement: -big would round to k = -128, i.e. -2 * 2^127, outside float32 - so its
        # negative element is -(2^127 + 2^120) instead: / 2^127 * 64 = -64.5, a tie -> -64 (even) -> -2^127.
        neg, neg_want = (-(2.0**127 + 2.0**120), -(2.0**127)) if name == "mxint8" else (-big, -top)
        x = torch.zeros(32)
        x[0], x[1], x[2] = big, neg, 2.0**126
        codes, scales = lowprec.quantize_scaled(x, name)
        assert scales.view(torch.uint8).tolist() == [byte], name
        want = torch.zeros(32)
        want[0], want[1], want[2] = top, neg_want, 2.0**126
        assert_same_bits(lowprec.fake_quantize(x, name), want, name)
        assert_same_bits(lowprec.dequantize(codes, scales, name), want, name + " deq")


def test_mxint8_uses_the_twos_complement_range() -> None:
    """MXINT8 elements are k * 2^-6 with k in [-128, 127] (formats docstring: two's complement), so a value just
    above -2 X rounds to -128 (-2 X) while one just below +2 X saturates to 127 (127/64 X).

    Oracle, by hand: block amax 1.999 -> X = 2^0; -1.999 * 64 = -127.94 -> -128 -> -2.0; 1.999 * 64 -> 128
    clips to 127 -> 1.984375; 0.5 -> 32 -> 0.5.
    """
    x = torch.zeros(2, 32)
    x[0, :2] = torch.tensor([-1.999, 0.5])
    x[1, :2] = torch.tensor([1.999, 0.5])
    want = torch.zeros(2, 32)
    want[0, :2] = torch.tensor([-2.0, 0.5])
    want[1, :2] = torch.tensor([1.984375, 0.5])
    assert_same_bits(lowprec.fake_quantize(x, "mxint8"), want, "mxint8 range")
    codes, scales = lowprec.quantize_scaled(x, "mxint8")
    assert codes.dtype == torch.int8 and codes[:, 0].tolist() == [-128, 127]
    assert scales.view(torch.uint8)[:, 0].tolist() == [127, 127]


def test_last_block_shorter_than_block_size() -> None:
    """A dimension the block size does not divide ends in a shorter block with its own amax.

    Oracle, by hand: shape (2, 40) in mxfp8_e4m3: the first 32 elements have amax 1 (X = 2^-8, byte 119); the last
    8 have amax 96 (floor(log2 96) = 6, X = 2^-2, byte 125; 96 * 4 = 384 is on the grid).  The padding never
    enters an amax.  Row 1 is all tiny (amax 2^-20 in both blocks: byte 127 - 28 = 99).
    """
    x = torch.zeros(2, 40)
    x[0, :32] = 1.0
    x[0, 32:] = 96.0
    x[0, 39] = 0.3  # 0.3 / 2^-2 = 1.2 -> 1.25 -> 0.3125
    x[1, :] = 2.0**-20
    codes, scales = lowprec.quantize_scaled(x, "mxfp8_e4m3")
    assert scales.shape == (2, 2)
    assert scales.view(torch.uint8).tolist() == [[119, 125], [99, 99]]
    want = x.clone()
    want[0, 39] = 0.3125
    assert_same_bits(lowprec.fake_quantize(x, "mxfp8_e4m3"), want, "short block")


def test_tile_not_dividing_either_dimension_hand() -> None:
    """Tile (2, 3) on a (3, 4) tensor: groups are rows {0,1},{2} x cols {0,1,2},{3}; scales shape (2, 2).

    Oracle, by hand: each of the four groups holds a single nonzero value v, so its float32 scale is v / 448
    and v / s rounds back to 448: every nonzero element is reproduced and each scale is v / 448 in float32.
    """
    x = torch.tensor([[1.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 8.0]])
    spec = QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=(2, 3))
    codes, scales = lowprec.quantize_scaled(x, spec)
    want_scales = torch.tensor([[1.0, 2.0], [4.0, 8.0]]) / 448
    assert_same_bits(scales, want_scales, "tile scales")
    assert_same_bits(lowprec.fake_quantize(x, spec), x, "tile values")


@pytest.mark.parametrize("name", QuantSpec.names())
@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (0,)], ids=["0x32", "4x0", "0"])
def test_empty_tensors(name: str, shape) -> None:
    """Empty tensors (valid layouts) quantize to empty tensors of the same shape and dtype.

    Oracle: fake_quantize's contract ("x's shape and dtype"): there is nothing to quantize.  Tile specs need two
    dimensions, so (0,) with a tile spec must raise the documented ValueError instead.
    """
    x = torch.empty(shape)
    spec = QuantSpec.named(name)
    if spec.scaling == "tile" and len(shape) < 2:
        with pytest.raises(ValueError, match="tile"):
            lowprec.fake_quantize(x, name)
        return
    out = lowprec.fake_quantize(x, name)
    assert out.shape == x.shape and out.dtype == x.dtype
    codes, scales = lowprec.quantize_scaled(x, name)
    assert lowprec.dequantize(codes, scales, name, shape=shape).shape == x.shape


# ------------------------------------------------------------------------------------- QuantSpec checks
@pytest.mark.parametrize("bs", [0, -32, 1.5, True, None])
def test_block_size_must_be_positive_int(bs) -> None:
    """QuantSpec(scaling="block") rejects a block_size that is not a positive int, naming block_size.

    Oracle: the _spec field docs (block_size: elements per block, an int).
    """
    with pytest.raises(ValueError, match="block_size"):
        QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=bs)


def test_axis_out_of_range_names_axis() -> None:
    """An axis outside [-ndim, ndim) raises ValueError naming the axis, for axis and block scaling.

    Oracle: numpy-style axis range; the shapes and axes below are out of range by construction.
    """
    x = torch.ones(4, 8)
    for spec in (
        QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=2),
        QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-3),
        QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=4, axis=5),
    ):
        for fn in (lowprec.fake_quantize, lowprec.quantize_scaled):
            with pytest.raises(ValueError, match="axis"):
                fn(x, spec)
    with pytest.raises(ValueError, match="axis"):
        lowprec.fake_quantize(torch.tensor(1.0), QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=0))


def test_tile_needs_two_dims_and_a_valid_pair() -> None:
    """Tiles need a tensor of rank >= 2 and a pair of positive ints; errors name the tile.

    Oracle: the _spec docstring (tiles over the last two dimensions).
    """
    with pytest.raises(ValueError, match="tile"):
        lowprec.fake_quantize(torch.ones(128), "fp8_e4m3_1x128")
    with pytest.raises(ValueError, match="tile"):
        lowprec.quantize_scaled(torch.ones(128), "fp8_e4m3_128x128")
    for bad in [(0, 128), (1,), (1, 2, 3), [1, 128], (1.0, 128), None]:
        with pytest.raises(ValueError, match="tile"):
            QuantSpec(elem="float8_e4m3fn", scaling="tile", tile=bad)


def test_unknown_spec_name_lists_valid_names() -> None:
    """An unknown spec name raises ValueError that lists every valid name.

    Oracle: QuantSpec.names() (each must appear in the message).
    """
    for call in (
        lambda: QuantSpec.named("mxfp5"),
        lambda: lowprec.fake_quantize(torch.ones(4), "mxfp5"),
        lambda: lowprec.quantize_scaled(torch.ones(4), "mxfp5"),
    ):
        with pytest.raises(ValueError) as ei:
            call()
        msg = str(ei.value)
        assert "mxfp5" in msg
        for n in QuantSpec.names():
            assert n in msg, f"{n} missing from {msg!r}"


def test_names_are_the_documented_specs() -> None:
    """The named specs carry the documented parameters.

    Oracle: OCP MX v1.0 (block 32, E8M0, floor), NVFP4 (block 16, e4m3 scale, nearest, tensor scale), and the
    fp8 tensorwise / rowwise / DeepSeek-V3 tile recipes, as listed in the _named docstring.
    """
    for name, elem in _MX_ELEM.items():
        s = QuantSpec.named(name)
        assert (s.format.name, s.scaling, s.block_size, s.scale_spec.name, s.scale_rounding, s.axis) == (
            elem, "block", 32, "float8_e8m0fnu", "floor", -1
        ), name
        assert s.saturate is True and s.tensor_scale is False
    for name, rule in (("nvfp4", "te"), ("nvfp4_div", "divide")):
        s = QuantSpec.named(name)
        assert (s.format.name, s.block_size, s.scale_spec.name, s.scale_rounding, s.tensor_scale,
                s.two_level_rule) == ("float4_e2m1fn", 16, "float8_e4m3fn", "nearest", True, rule)
    assert QuantSpec.named("fp8_e4m3_1x128").tile == (1, 128)
    assert QuantSpec.named("fp8_e4m3_128x128").tile == (128, 128)
    assert QuantSpec.named("fp8_e4m3_rowwise").scaling == "axis"
    assert QuantSpec.named("fp8_e5m2_tensorwise").scaling == "tensor"


@pytest.mark.parametrize("name", QuantSpec.names())
def test_to_dict_from_dict_round_trip(name: str) -> None:
    """from_dict(to_dict(spec)) == spec for every named spec, also through JSON.

    Oracle: dataclass equality with the original spec; to_dict must be plain data (json.dumps must succeed) and
    holds every field, two_level_rule only for two-level specs (the to_dict docstring).
    """
    spec = QuantSpec.named(name)
    d = spec.to_dict()
    fields = {f.name for f in dataclasses.fields(QuantSpec)}
    assert set(d) == (fields if spec.tensor_scale else fields - {"two_level_rule"})
    assert QuantSpec.from_dict(d) == spec
    assert QuantSpec.from_dict(json.loads(json.dumps(d))) == spec


def test_to_dict_round_trip_custom_formats() -> None:
    """Custom FormatSpecs (element and scale) survive to_dict / JSON / from_dict.

    Oracle: equality with the original spec, and that the custom format is written as its fields (a dict).
    """
    e3m4 = FormatSpec.custom(3, 4, special="fn")
    spec = QuantSpec(elem=e3m4, scaling="tile", tile=(1, 64), scale_format="bfloat16", margin=2)
    d = json.loads(json.dumps(spec.to_dict()))
    assert isinstance(d["elem"], dict) and d["tile"] == [1, 64]
    back = QuantSpec.from_dict(d)
    assert back == spec and back.format == e3m4 and back.tile == (1, 64)


def test_from_dict_rejects_unknown_keys() -> None:
    """Unknown keys raise ValueError naming them.

    Oracle: the from_dict docstring.
    """
    d = QuantSpec.named("mxfp8_e4m3").to_dict()
    d["blocksize"] = 32
    d["zzz_extra"] = 1
    with pytest.raises(ValueError) as ei:
        QuantSpec.from_dict(d)
    assert "blocksize" in str(ei.value) and "zzz_extra" in str(ei.value)
