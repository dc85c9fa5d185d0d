"""``lowprec.quantize`` (elementwise, eager backend) against independent casts.

Oracles: ml_dtypes casts ``x.astype(ml_dtypes.<fmt>).astype(float32)`` (numpy's float16 cast for float16),
torch's native casts where their overflow semantics agree, ``np.clip(np.rint(x))`` for integers, and a brute
force search over the format's grid (decoded by ml_dtypes) for round-toward-zero.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import lowprec
from lowprec import formats
from lowprec.quant import _codec

F32 = np.float32
ML: dict[str, type] = {
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
}
SIGNED = [n for n in ML if n != "float8_e8m0fnu"]
NO_NAN = ["float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn"]  # ml_dtypes maps NaN to -0 here
SMALL = [n for n in ML if n not in ("bfloat16", "float16")]  # <= 8 bits: grid from ml_dtypes decoding
INTS = ["int8", "int4", "int8_mx"]




# ------------------------------------------------------------------------------------------------ helpers
def ml_cast(x: np.ndarray, name: str) -> np.ndarray:
    """The oracle: round-trip through the ml_dtypes (numpy for float16) type."""
    # Overflow to inf/NaN and NaN -> format casts raise numpy "overflow"/"invalid" warnings; those results are
    # exactly what we compare against.
    with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(x, dtype=F32).astype(ML[name]).astype(F32)


def q(x: np.ndarray, fmt, **kw) -> np.ndarray:
    out = lowprec.quantize(torch.from_numpy(np.ascontiguousarray(x, dtype=F32)), fmt, **kw)
    assert out.dtype == torch.float32
    return out.numpy()


def assert_same_bits(got, exp, inputs, what: str, *, zero_sign: bool = True) -> None:
    """Bitwise float32 equality (int32 views), NaN == NaN whatever the payload/sign.  On failure: how many differ
    and the first few (input, got, expected)."""
    got = np.asarray(got, dtype=F32).reshape(-1)
    exp = np.asarray(exp, dtype=F32).reshape(-1)
    inputs = np.asarray(inputs).reshape(-1)
    assert got.shape == exp.shape
    if zero_sign:
        differ = got.view(np.int32) != exp.view(np.int32)
    else:
        differ = got != exp
    bad = differ & ~(np.isnan(got) & np.isnan(exp))
    if bad.any():
        idx = np.flatnonzero(bad)[:8]
        rows = [(float(inputs[i]), float(got[i]), float(exp[i])) for i in idx]
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} differ; first (input, got, expected): {rows}")


def random_wide(n: int, seed: int) -> np.ndarray:
    """Seeded randn * 2^randint(-40, 40), float32."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(F32)


def all_16bit_patterns() -> np.ndarray:
    """All 65,536 bf16 and all 65,536 fp16 bit patterns, as float32 (exact widening)."""
    codes = np.arange(2**16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # bf16 NaN patterns widen with an "invalid" flag; they stay NaN
        bf = codes.view(ml_dtypes.bfloat16).astype(F32)
    fp = codes.view(np.float16).astype(F32)
    return np.concatenate([bf, fp])


def grid_values(name: str) -> np.ndarray:
    """Sorted distinct finite non-negative values of the format (ml_dtypes decoding of every code)."""
    if name in ("bfloat16", "float16"):
        codes = np.arange(2**16, dtype=np.uint16)
    else:
        bits = ml_dtypes.finfo(ML[name]).bits
        codes = np.arange(2**bits, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        v = codes.view(ML[name]).astype(np.float64)
    v = v[np.isfinite(v) & (v >= 0)] + 0.0  # + 0.0 turns -0 into +0 so the grid's zero is +0
    return np.unique(v)


def finfo(name: str):
    return np.finfo(np.float16) if name == "float16" else ml_dtypes.finfo(ML[name])


def nextup(x: np.ndarray) -> np.ndarray:
    # nextafter(FLT_MAX, inf) = inf raises numpy's "overflow" flag; inf is a wanted input.
    with np.errstate(over="ignore"):
        return np.nextafter(np.asarray(x, dtype=F32), F32(np.inf))


def nextdown(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # as in nextup, for -FLT_MAX
        return np.nextafter(np.asarray(x, dtype=F32), F32(-np.inf))


def edge_values(name: str) -> np.ndarray:
    """Inputs built from the format's own limits (ml_dtypes' grid and finfo), both signs, as float32."""
    fi = finfo(name)
    g = grid_values(name)  # float64, exact
    mids = (g[:-1] + g[1:]) / 2  # exact in float64; exactly representable in float32 (checked below)
    mids32 = mids.astype(F32)
    assert (mids32.astype(np.float64) == mids).all()
    fmax = float(fi.max)
    step_at_max = fmax - g[-2]  # spacing of the top binade (grid values are evenly spaced there)
    over = np.array([fmax + step_at_max / 2, fmax + step_at_max, 2 * fmax], dtype=np.float64)
    over = over[over < float(np.finfo(F32).max)].astype(F32)
    tiny_sub = F32(fi.smallest_subnormal)
    tiny_norm = F32(fi.tiny)
    specials = np.array(
        [
            0.0,
            tiny_sub,
            tiny_sub / 2,  # ties to zero (zero is even)
            tiny_sub * F32(0.75),
            tiny_sub * F32(1.5),  # tie between the two smallest subnormals -> 2 * min_subnormal (even)
            tiny_norm,
            tiny_norm - tiny_sub / 2,  # tie between largest subnormal and smallest normal
            tiny_norm / 2,
            fmax,
            np.finfo(F32).max,
            np.finfo(F32).tiny,
            np.finfo(F32).smallest_subnormal,
            np.inf,
            np.nan,
        ],
        dtype=F32,
    )
    pos = np.concatenate(
        [g.astype(F32), nextup(g.astype(F32)), nextdown(g.astype(F32)), mids32, nextup(mids32), nextdown(mids32),
         over, nextup(over), nextdown(over), specials, nextup(specials[:-2]), nextdown(specials[:-2])]
    )  # fmt: skip
    pos = pos[~(pos < 0)]  # nextdown(0) is negative: its mirror is covered below anyway
    return np.concatenate([pos, -pos])


# ------------------------------------------------------------------------------------------------ ml_dtypes
def _compare_to_ml(name: str, x: np.ndarray, what: str) -> None:
    if name == "float8_e8m0fnu":
        x = x[np.isfinite(x) & (x >= np.finfo(F32).tiny)]  # E8M0: positive normal float32 only
    if name in NO_NAN:
        x = x[~np.isnan(x)]  # deliberate difference, tested separately
    assert_same_bits(q(x, name), ml_cast(x, name), x, f"{name} {what}")


@pytest.mark.parametrize("name", list(ML))
def test_nearest_random_matches_ml_dtypes(name):
    """Oracle: ml_dtypes cast round trip (numpy for float16) on 1e5 seeded randn * 2^randint(-40, 40) values."""
    _compare_to_ml(name, random_wide(100_000, seed=11), "random")


@pytest.mark.parametrize("name", list(ML))
def test_nearest_all_16bit_patterns_match_ml_dtypes(name):
    """Oracle: ml_dtypes cast round trip (numpy for float16) on every bf16 and every fp16 bit pattern (as
    float32): all exponents, subnormals, infs and NaNs of both."""
    _compare_to_ml(name, all_16bit_patterns(), "16-bit patterns")


@pytest.mark.parametrize("name", list(ML))
def test_nearest_edge_values_match_ml_dtypes(name):
    """Oracle: ml_dtypes cast round trip (numpy for float16) on values built from the format's limits as decoded
    by ml_dtypes: every grid point and its float32 neighbours, every midpoint between consecutive grid values
    (exact ties) and its neighbours, min_subnormal/2 and neighbours, the subnormal/normal boundary, max,
    max + half a step (the overflow tie) +- one float32 ulp, 2*max, +-inf, NaN, +-0."""
    _compare_to_ml(name, edge_values(name), "edge values")


@pytest.mark.parametrize("name", SIGNED)
def test_nearest_hand_checked_ties(name):
    """Oracle: ties-to-even worked out by hand from the grid (decoded by ml_dtypes): the midpoint between grid
    values g[i] and g[i+1] goes to whichever has an even mantissa field; in the regularly spaced grid that is
    the one whose index in the (non-negative) grid is even.  Also min_subnormal/2 -> +0 and -min_subnormal/2 ->
    -0 (or +0 where the format has no negative zero)."""
    g = grid_values(name)
    if name in ("bfloat16", "float16"):
        g = g[:4096]  # the low end is enough for a hand rule; the full grid is in the ml_dtypes test
    mids = ((g[:-1] + g[1:]) / 2).astype(F32)
    idx = np.arange(len(g) - 1)
    exp = np.where(idx % 2 == 0, g[:-1], g[1:]).astype(F32)
    assert_same_bits(q(mids, name), exp, mids, f"{name} ties")
    has_neg_zero = formats.get(name).special != "fnuz"  # fnuz: 0x80 is NaN, there is no -0
    neg_exp = -exp if has_neg_zero else -exp + F32(0.0)
    assert_same_bits(q(-mids, name), neg_exp, -mids, f"{name} negative ties")
    half = F32(finfo(name).smallest_subnormal) / 2
    out = q(np.array([half, -half], dtype=F32), name)
    assert out[0] == 0 and not np.signbit(out[0])
    assert out[1] == 0 and bool(np.signbit(out[1])) == has_neg_zero


@pytest.mark.parametrize("name", NO_NAN)
def test_nan_stays_nan_for_formats_without_nan(name):
    """Oracle: the documented deliberate difference from ml_dtypes: float6/float4 have no NaN code; ml_dtypes maps
    NaN to -0 (checked here so the difference stays deliberate), lowprec keeps NaN (both signs, any payload)."""
    nans = np.array([np.nan, -np.nan, np.float32(np.nan) * 0], dtype=F32)
    nans = np.concatenate([nans, np.array([0x7FC00001, 0xFFFFFFFF, 0x7F800001], dtype=np.uint32).view(F32)])
    assert np.isnan(nans).all()
    assert not np.isnan(ml_cast(nans, name)).any()  # ml_dtypes hides the NaN
    for sat in (False, True):
        assert np.isnan(q(nans, name, saturate=sat)).all()


@pytest.mark.parametrize("name", NO_NAN)
def test_formats_without_inf_or_nan_clamp_overflow(name):
    """Oracle: ml_dtypes: for float6/float4 out-of-range values and infinities become +-max (checked against
    ml_dtypes on inf and 1e30 so the rule is the reference's, not ours)."""
    fmax = float(finfo(name).max)
    x = np.array([np.inf, -np.inf, 1e30, -1e30, 2 * fmax, -2 * fmax], dtype=F32)
    assert_same_bits(q(x, name), ml_cast(x, name), x, name)
    assert np.abs(q(x, name)).max() == fmax


# ------------------------------------------------------------------------------------------------ input dtypes
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                  "float4_e2m1fn", "float6_e3m2fn"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(name, dtype):
    """Oracle: ml_dtypes cast of the widened input (the low-precision input as float32, cast to the format and
    back), then to the input dtype (exact: every value of these formats is representable in bf16 and fp16).
    Also equal to quantizing the widened float32 tensor and narrowing the result."""
    x32 = torch.from_numpy(random_wide(20_000, seed=21))
    if dtype == torch.float16:
        x32 = x32 * 2.0**-20  # keep most values inside fp16's range
    xl = x32.to(dtype)
    with warnings.catch_warnings():  # fp16 overflow to inf is intended input
        warnings.simplefilter("ignore")
        xl = torch.cat([xl, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype)])
    got = lowprec.quantize(xl, name)
    assert got.dtype == dtype and got.shape == xl.shape
    widened = xl.float()
    via_f32 = lowprec.quantize(widened, name).to(dtype)
    view = torch.int16
    same = (got.view(view) == via_f32.view(view)) | (torch.isnan(got) & torch.isnan(via_f32))
    assert bool(same.all()), f"{int((~same).sum())} differ from quantize(x.float()).to(dtype)"
    exp = ml_cast(widened.numpy(), name)
    assert_same_bits(got.float().numpy(), exp, widened.numpy(), f"{name} from {dtype}")


def test_bfloat16_input_to_wider_format_is_identity():
    """Oracle: exact representability: every bf16 value (all 65,536 patterns) is a float32 value and a bfloat16
    value, so quantizing a bf16 tensor to float32 or bfloat16 changes nothing (bitwise int16 compare)."""
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = codes.view(torch.bfloat16)
    for name in ("float32", "bfloat16"):
        got = lowprec.quantize(x, name)
        same = (got.view(torch.int16) == codes) | (torch.isnan(got) & torch.isnan(x))
        assert bool(same.all()), f"{name}: {int((~same).sum())} differ"


# ------------------------------------------------------------------------------------------------ torch casts
def _torch_cast(x: np.ndarray, dt: torch.dtype) -> np.ndarray:
    return torch.from_numpy(x.copy()).to(dt).float().numpy()


def _torch_inputs() -> np.ndarray:
    x = np.concatenate([random_wide(50_000, seed=31), all_16bit_patterns()])
    for name in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]:
        x = np.concatenate([x, edge_values(name)])
    return x


def test_torch_e4m3fn_saturates_like_saturate_true():
    """Oracle: torch's native x.to(torch.float8_e4m3fn), which saturates out-of-range finite values to +-448.
    quantize(saturate=True) must match it on every finite input.  Documented difference: torch also saturates
    +-inf to +-448, lowprec keeps inf visible as NaN (e4m3fn has no inf) -- asserted below."""
    x = _torch_inputs()
    fin = x[np.isfinite(x)]
    assert_same_bits(q(fin, "float8_e4m3fn", saturate=True), _torch_cast(fin, torch.float8_e4m3fn), fin, "e4m3fn")
    infs = np.array([np.inf, -np.inf], dtype=F32)
    assert _torch_cast(infs, torch.float8_e4m3fn).tolist() == [448.0, -448.0]  # torch's rule, for the record
    assert np.isnan(q(infs, "float8_e4m3fn", saturate=True)).all()
    # NaN agrees.
    assert np.isnan(_torch_cast(np.array([np.nan], F32), torch.float8_e4m3fn)).all()
    assert np.isnan(q(np.array([np.nan], F32), "float8_e4m3fn", saturate=True)).all()


@pytest.mark.parametrize(
    ("name", "dt"),
    [
        ("float8_e5m2", torch.float8_e5m2),
        ("float8_e4m3fnuz", torch.float8_e4m3fnuz),
        ("float8_e5m2fnuz", torch.float8_e5m2fnuz),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
    ],
)
def test_torch_native_casts_match_default_overflow(name, dt):
    """Oracle: torch's native x.to(dt).  Found by experiment (torch 2.13): e5m2 overflows to +-inf (IEEE), the
    fnuz types overflow to NaN and turn -0 into +0, inf -> NaN for fnuz; i.e. exactly saturate=False, on every
    input including +-inf, NaN and +-0.  bf16/fp16 casts are IEEE round-to-nearest-even."""
    x = _torch_inputs()
    assert_same_bits(q(x, name), _torch_cast(x, dt), x, f"{name} vs torch")


def test_torch_e8m0_matches_on_positive_normals():
    """Oracle: torch's native x.to(torch.float8_e8m0fnu) on positive normal float32 inputs (torch ignores the sign
    and maps 0 to 2^-127 outside that domain, so only the shared domain is compared)."""
    x = _torch_inputs()
    x = x[np.isfinite(x) & (x >= np.finfo(F32).tiny)]
    assert_same_bits(q(x, "float8_e8m0fnu"), _torch_cast(x, torch.float8_e8m0fnu), x, "e8m0 vs torch")


# ------------------------------------------------------------------------------------------------ saturate
@pytest.mark.parametrize("name", list(ML))
def test_saturate_clamps_finite(name):
    """Oracle: ml_dtypes cast of x clipped to +-finfo.max first (clipping a finite value to the largest finite
    value then rounding gives +-max for out-of-range x and leaves in-range rounding alone)."""
    fmax = F32(finfo(name).max)
    x = np.concatenate([random_wide(30_000, seed=41), edge_values(name)])
    x = x[np.isfinite(x)]
    if name == "float8_e8m0fnu":
        x = x[x >= np.finfo(F32).tiny]
    exp = ml_cast(np.clip(x, -fmax, fmax), name)
    assert_same_bits(q(x, name, saturate=True), exp, x, f"{name} saturate")


@pytest.mark.parametrize(
    ("name", "pos_inf"),
    [
        ("float8_e5m2", np.inf),
        ("bfloat16", np.inf),
        ("float16", np.inf),
        ("float8_e4m3fn", np.nan),
        ("float8_e4m3fnuz", np.nan),
        ("float8_e5m2fnuz", np.nan),
    ],
)
def test_saturate_keeps_inf_rule(name, pos_inf):
    """Oracle: ml_dtypes' cast of +-inf (inf for IEEE formats, NaN for the fn/fnuz float8s), which saturate=True
    must keep; the expected value is also hand-stated in the parameters."""
    infs = np.array([np.inf, -np.inf], dtype=F32)
    got = q(infs, name, saturate=True)
    assert_same_bits(got, ml_cast(infs, name), infs, f"{name} inf under saturate")
    if np.isnan(pos_inf):
        assert np.isnan(got).all()
    else:
        assert got.tolist() == [np.inf, -np.inf]


# ------------------------------------------------------------------------------------------------ integers
INT_CASES = [("int8", -128, 127, 1), ("int4", -8, 7, 1), ("int8_mx", -128, 127, 64)]


def _int_inputs(seed: int) -> np.ndarray:
    """Seeded random values around the integer ranges, exact ties k + 1/2 at both scales, and neighbours."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(40_000) * np.exp2(rng.integers(-8, 10, 40_000))).astype(F32)
    k = np.arange(-300, 300, dtype=F32)
    halves = np.concatenate([k + F32(0.5), (k + F32(0.5)) / 64, k / 64 + F32(1 / 128)])  # ties in both scales
    special = np.array([0.0, -0.0, 1e30, -1e30, 3e38, -3e38, 127.5, -128.5, 7.5, -8.5, 1.984375, -2.0078125], F32)
    x = np.concatenate([a, halves, special])
    return np.concatenate([x, nextup(x), nextdown(x)])


def _int_oracle(x: np.ndarray, lo: int, hi: int, scale: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # x * 64 may overflow to inf for huge x; clip then gives the bound
        return (np.clip(np.rint(x * F32(scale)), lo, hi) / F32(scale)).astype(F32)


@pytest.mark.parametrize(("name", "lo", "hi", "scale"), INT_CASES)
def test_integer_nearest(name, lo, hi, scale):
    """Oracle: np.clip(np.rint(x * scale), lo, hi) / scale on finite x (np.rint is round-half-to-even; scale 2^6
    for MXINT8, exact in float32).  Integers have one zero, so +-0 compare equal and the output has no -0.
    saturate makes no difference (integers always clamp); NaN stays NaN."""
    x = _int_inputs(51)
    exp = _int_oracle(x, lo, hi, scale)
    got = q(x, name)
    assert_same_bits(got, exp, x, name, zero_sign=False)
    assert not (np.signbit(got) & (got == 0)).any(), "integer formats have a single (+) zero"
    assert_same_bits(q(x, name, saturate=True), exp, x, f"{name} saturate=True", zero_sign=False)
    for sat in (False, True):
        assert np.isnan(q(np.array([np.nan, -np.nan], F32), name, saturate=sat)).all()


@pytest.mark.parametrize(("name", "lo", "hi", "scale"), INT_CASES)
def test_integer_infinity_clamps(name, lo, hi, scale):
    """Oracle: np.clip(np.rint(+-inf), lo, hi) = hi / lo (integers have no inf/NaN code; quantize_f32's docstring:
    infinite input becomes +-max for formats with neither, and finite overflow already clamps to [min, max])."""
    x = np.array([np.inf, -np.inf], dtype=F32)
    exp = _int_oracle(x, lo, hi, scale)
    assert exp.tolist() == [hi / scale, lo / scale]
    for sat in (False, True):
        assert_same_bits(q(x, name, saturate=sat), exp, x, f"{name} inf saturate={sat}", zero_sign=False)


# ------------------------------------------------------------------------------------------------ toward zero
def _toward_zero_oracle(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Brute force over the grid: the largest-magnitude value on x's side of zero with |g| <= |x|; beyond the
    grid that is the extreme value (IEEE round-toward-zero never overflows).  NaN -> NaN.  A zero result takes
    x's sign when the grid holds -0."""
    fin = table[np.isfinite(table)].astype(np.float64)
    has_neg_zero = bool(((fin == 0) & np.signbit(fin)).any())
    pos = np.unique(fin[fin >= 0] + 0.0)  # + 0.0: the zero of this half is +0
    neg = np.unique(fin[fin <= 0] + 0.0)  # ascending: most negative first; zero's sign is set below
    out = np.empty(x.shape, dtype=np.float64)
    xd = x.astype(np.float64)
    p = ~np.signbit(xd)  # -0 belongs to the negative side
    i = np.searchsorted(pos, xd[p], side="right") - 1
    out[p] = pos[np.clip(i, 0, None)]
    n = ~p
    j = np.searchsorted(neg, xd[n], side="left")
    out[n] = neg[np.clip(j, None, len(neg) - 1)]
    if has_neg_zero:
        out = np.where((out == 0) & np.signbit(xd), -0.0, out)
    out[np.isnan(xd)] = np.nan
    return out.astype(F32)


def _table(name: str) -> np.ndarray:
    """Every code's value, decoded by ml_dtypes / numpy (int8, int8_mx = int8 * 2^-6) / ml_dtypes.int4."""
    fmt = formats.get(name)
    if name in ML:
        bits = ml_dtypes.finfo(ML[name]).bits
        table = np.arange(2**bits, dtype=np.uint8).view(ML[name]).astype(F32)
    elif name == "int4":
        table = np.arange(16, dtype=np.uint8).view(ml_dtypes.int4).astype(F32)
    else:
        table = np.arange(256, dtype=np.uint8).view(np.int8).astype(F32) / F32(2**fmt.frac_bits)
    # Cross-check against lowprec's own table (a failure here is a codec bug, not a rounding one).
    assert_same_bits(_codec.decode_table(fmt).numpy(), table, np.arange(len(table)), f"{name} table")
    return table


def _first_overflow(table: np.ndarray) -> float:
    """Smallest positive x that truncation on the grid could carry past the largest value: max + the top step
    (for E8M0, whose next power of two 2^128 is beyond float32, the first float32 above max)."""
    fin = np.unique(table[np.isfinite(table) & (table > 0)].astype(np.float64))
    limit = fin[-1] + (fin[-1] - fin[-2])
    if limit > np.finfo(F32).max:
        limit = float(nextup(np.array([fin[-1]], F32))[0])
    return limit


@pytest.mark.parametrize("name", SMALL + INTS)
def test_toward_zero_in_range_matches_grid_search(name):
    """Oracle: brute-force search over the format's grid (ml_dtypes / numpy decoding of every code) for the
    largest-magnitude value not exceeding |x| with x's sign, on seeded random values spanning the format's
    range, every grid value and its float32 neighbours, +-0 and NaN.  Only |x| below max + one top step (where
    truncation cannot carry past max); beyond that is the next test."""
    fmt = formats.get(name)
    table = _table(name)
    fin = table[np.isfinite(table)]
    top = float(np.abs(fin).max())
    low = float(np.abs(fin[fin != 0]).min())
    rng = np.random.default_rng(61)
    lo_e, hi_e = int(np.floor(np.log2(low))) - 3, int(np.ceil(np.log2(top))) + 3
    x64 = rng.standard_normal(30_000) * np.exp2(rng.integers(lo_e, hi_e, 30_000))
    fmax32 = float(np.finfo(F32).max)
    x = np.clip(x64, -fmax32, fmax32).astype(F32)  # E8M0's range reaches float32's top: stay finite
    g = np.unique(fin).astype(F32)
    x = np.concatenate([x, g, nextup(g), nextdown(g), np.array([0.0, -0.0, np.nan], F32)])
    limit = _first_overflow(table)
    if fmt.kind == "float":
        x = x[~(np.abs(x) >= limit)]
    if name == "float8_e8m0fnu":
        x = x[np.isfinite(x) & (x >= np.finfo(F32).tiny)]
    exp = _toward_zero_oracle(x, table)
    got = q(x, name, rounding="toward_zero")
    assert_same_bits(got, exp, x, f"{name} toward_zero", zero_sign=fmt.kind == "float")


@pytest.mark.parametrize("name", SMALL + INTS)
def test_toward_zero_never_overflows(name):
    """Oracle: IEEE 754 round-toward-zero (and the brute-force grid search): a finite |x| beyond the format's
    largest value truncates to +-max, never to inf/NaN (e4m3fn: 672 -> 448; e5m2: 86016 -> 57344), on seeded
    random values from max + one top step up to float32's max."""
    fmt = formats.get(name)
    table = _table(name)
    limit = _first_overflow(table)
    rng = np.random.default_rng(71)
    room = min(40.0, float(np.log2(np.finfo(F32).max)) - float(np.log2(limit)))
    mags = (limit * np.exp2(rng.uniform(0, room, 5_000))).astype(F32)
    mags = np.concatenate([mags, np.array([limit, np.finfo(F32).max], F32), nextup(np.array([limit], F32))])
    x = mags if not fmt.signed else np.concatenate([mags, -mags])
    exp = _toward_zero_oracle(x, table)
    fin = table[np.isfinite(table)]
    assert (exp[x > 0] == fin.max()).all() and (exp[x < 0] == fin.min()).all()  # oracle agrees with IEEE
    got = q(x, name, rounding="toward_zero")
    assert_same_bits(got, exp, x, f"{name} toward_zero overflow", zero_sign=fmt.kind == "float")


@pytest.mark.parametrize(
    ("name", "x", "expected"),
    [
        # e4m3fn: 672 = 1.3125 * 2^9 truncates to 640 on the 2^9 binade (step 64), beyond max 448 -> 448.
        ("float8_e4m3fn", 672.0, 448.0),
        ("float8_e4m3fn", 479.0, 448.0),  # below 480 (where the NaN code would sit): plain truncation to 448
        # e5m2: 86016 = 1.3125 * 2^16 truncates to 81920 (step 2^14), beyond max 57344 -> 57344.
        ("float8_e5m2", 86016.0, 57344.0),
        ("float8_e5m2", 65535.0, 57344.0),
        # e4m3fnuz: max 240 = 1.875 * 2^7; 360 truncates to 352 (step 32) -> 240.
        ("float8_e4m3fnuz", 360.0, 240.0),
        ("float8_e5m2fnuz", 86016.0, 57344.0),
        ("float4_e2m1fn", 100.0, 6.0),
    ],
)
def test_toward_zero_past_max_hand_checked(name, x, expected):
    """Oracle: hand-worked IEEE 754 round-toward-zero (the arithmetic is in the parameter comments): finite values
    past max give max, with the input's sign."""
    got = q(np.array([x, -x], dtype=F32), name, rounding="toward_zero")
    exp = np.array([expected, -expected], dtype=F32)
    assert_same_bits(got, exp, np.array([x, -x]), f"{name} toward_zero {x}")


@pytest.mark.parametrize(("name", "inf_to"), [("float8_e5m2", np.inf), ("float8_e4m3fn", np.nan),
                                              ("float8_e4m3fnuz", np.nan), ("float8_e5m2fnuz", np.nan)])  # fmt: skip
def test_toward_zero_infinity_keeps_format_rule(name, inf_to):
    """Oracle: ml_dtypes' cast of +-inf (inf is exact, so every rounding mode gives the same: inf for e5m2, NaN
    for the formats without inf); the hand-stated value is in the parameters."""
    x = np.array([np.inf, -np.inf], dtype=F32)
    got = q(x, name, rounding="toward_zero")
    assert_same_bits(got, ml_cast(x, name), x, f"{name} toward_zero inf")
    assert (np.isnan(got).all() if np.isnan(inf_to) else got.tolist() == [np.inf, -np.inf])
