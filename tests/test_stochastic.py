"""Stochastic rounding: ``lowprec.quantize(x, fmt, rounding="stochastic", seed=..., offset=...)``.

Oracles used in this file (each test's docstring names its own):

* the pure-Python counter hash ``_random.random_bits_py`` (plain ints, no tensors);
* grids of representable values enumerated with ml_dtypes from every bit pattern of the format (independent of
  lowprec's rounding code), giving the two neighbours ``lo < x < hi`` and the exact probability
  ``p = (x - lo) / (hi - lo)`` of rounding to ``hi``;
* Bernstein's inequality for sums of independent bounded variables: for ``k ~ Binomial(N, p)``,
  ``P(|k - N p| >= t) <= 2 exp(-t^2 / (2 (N p (1-p) + t/3)))``.  Every statistical check uses a per-check false
  failure rate ``DELTA = 1e-9`` (so ``t = L/3 + sqrt((L/3)^2 + 2 L N p (1-p))`` with ``L = ln(2 / DELTA)``).  The
  random words are a fixed function of the seeds used here, so each check is deterministic; the rate is the
  chance that a correct implementation with an ideal random source would fail it.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import lowprec
from lowprec.quant import _random
from lowprec.testing import assert_bitwise_equal

DELTA = 1e-9
_L = math.log(2.0 / DELTA)




# ------------------------------------------------------------------------------------------------ helpers
def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bitwise equality (NaN == NaN), via the shipped helper with its max/mean difference and SQNR report."""
    assert_bitwise_equal(got, want, context=what)

def bernstein_t(n: int, p: float) -> float:
    """Half-width t with P(|Binomial(n, p) - n p| >= t) <= DELTA (Bernstein)."""
    var = n * p * (1.0 - p)
    a = _L / 3.0
    return a + math.sqrt(a * a + 2.0 * _L * var)


_ML = {
    "float16": (np.float16, np.uint16),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8),
    "float8_e5m2": (ml_dtypes.float8_e5m2, np.uint8),
    "float6_e3m2fn": (ml_dtypes.float6_e3m2fn, np.uint8),
    "float6_e2m3fn": (ml_dtypes.float6_e2m3fn, np.uint8),
    "float4_e2m1fn": (ml_dtypes.float4_e2m1fn, np.uint8),
}
_BITS = {"float6_e3m2fn": 6, "float6_e2m3fn": 6, "float4_e2m1fn": 4}
_GRIDS: dict[str, np.ndarray] = {}


def all_values(fmt: str) -> np.ndarray:
    """float64 values of every finite code of ``fmt``, decoded by ml_dtypes/numpy (bf16: from float32 bits)."""
    if fmt == "int8":
        return np.arange(-128, 128, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore")  # casting (signalling) NaN codes
        if fmt == "bfloat16":  # a bf16 code is the top half of a float32 code
            vals = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            dt, raw = _ML[fmt]
            nbits = _BITS.get(fmt, 8 * np.dtype(raw).itemsize)
            codes = np.arange(1 << nbits, dtype=np.uint64).astype(raw)
            vals = codes.view(dt).astype(np.float64)
    return vals[np.isfinite(vals)]


def grid(fmt: str) -> np.ndarray:
    """Sorted non-negative finite values of ``fmt`` (float64)."""
    if fmt not in _GRIDS:
        _GRIDS[fmt] = np.unique(np.abs(all_values(fmt)))
    return _GRIDS[fmt]


def neighbours(fmt: str, x: float) -> tuple[float, float]:
    """Grid points lo <= |x| <= hi adjacent to |x| (lo == hi when |x| is on the grid)."""
    g = grid(fmt)
    a = abs(x)
    if a >= g[-1]:  # at or above the largest finite value: saturation gives the max
        return float(g[-1]), float(g[-1])
    hi = g[np.searchsorted(g, a, side="left")]
    lo = g[np.searchsorted(g, a, side="right") - 1]
    return float(lo), float(hi)


def exact(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``values``, asserting each is exactly representable in ``dtype``."""
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    back = t.double().tolist()
    assert back == values, f"test inputs not exact in {dtype}: {values} -> {back}"
    return t


# ------------------------------------------------------------------------------------------- random bits
_SEEDS = [0, 1, 12345, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
_OFFSETS = [0, 7, 2**31 - 100, 2**31, 2**32 - 256]


@pytest.mark.parametrize("seed", _SEEDS)
@pytest.mark.parametrize("offset", _OFFSETS)
def test_random_bits_match_pure_python(seed: int, offset: int) -> None:
    """random_bits (int32 tensor arithmetic) equals random_bits_py (pure-Python ints) word for word.

    Oracle: ``_random.random_bits_py(seed, offset + i)`` evaluated with Python integers for every i.
    """
    n = 256
    got = _random.random_bits(
        _random.key_tensor(seed), _random.offset_tensor(offset), n, torch.device("cpu")
    )
    assert got.dtype == torch.int32 and got.shape == (n,)
    got_u = [v & 0xFFFFFFFF for v in got.tolist()]
    want = [_random.random_bits_py(seed, offset + i) for i in range(n)]
    bad = [(i, got_u[i], want[i]) for i in range(n) if got_u[i] != want[i]]
    assert not bad, f"{len(bad)} words differ; first {bad[:4]}"


def test_random_bits_counter_wraps_mod_2_32() -> None:
    """Counters past 2^32 wrap: the word for offset + i is the word for (offset + i) mod 2^32.

    Oracle: random_bits_py at counter (offset + i) mod 2^32 (the module docstring's ``c = (offset + i) mod 2^32``).
    """
    seed, offset, n = 99, 2**32 - 5, 10
    got = _random.random_bits(_random.key_tensor(seed), _random.offset_tensor(offset), n, torch.device("cpu"))
    want = [_random.random_bits_py(seed, (offset + i) % 2**32) for i in range(n)]
    assert [v & 0xFFFFFFFF for v in got.tolist()] == want


def _lowbias32(x: int) -> int:
    """Chris Wellons' published lowbias32, written out independently here."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def test_pure_python_reference_is_the_documented_construction() -> None:
    """random_bits_py(seed, c) == h(h(c + k1) ^ k2) with h = lowbias32, as the _random docstring states.

    Oracle: an independent transcription of lowbias32 and the docstring formula, over a grid of counters.
    """
    rng = np.random.default_rng(7)
    counters = [0, 1, 2**31, 2**32 - 1] + [int(c) for c in rng.integers(0, 2**32, 60)]
    for seed in _SEEDS:
        k1, k2 = _random.seed_keys(seed)
        assert 0 <= k1 < 2**32 and 0 <= k2 < 2**32
        for c in counters:
            assert _random.hash32_py(c) == _lowbias32(c)
            assert _random.random_bits_py(seed, c) == _lowbias32(_lowbias32((c + k1) & 0xFFFFFFFF) ^ k2)


def test_public_quantize_accepts_offsets_up_to_2_32() -> None:
    """offset + numel == 2^32 is allowed and gives the counters just below 2^32.

    Oracle: split invariance (quantizing the two halves with offsets o and o + n equals quantizing the whole with
    offset o), checked at the very top of the counter range, and a statistical one: the rounding at those
    counters still has the correct mean within a Bernstein bound (DELTA = 1e-9).
    """
    n = 4096
    x = torch.full((2 * n,), 1.0 + 2.0**-5)  # e4m3: lo 1, hi 1.125, p = 1/4
    whole = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=3, offset=2**32 - 2 * n)
    a = lowprec.quantize(x[:n], "float8_e4m3fn", rounding="stochastic", seed=3, offset=2**32 - 2 * n)
    b = lowprec.quantize(x[n:], "float8_e4m3fn", rounding="stochastic", seed=3, offset=2**32 - n)
    assert_same_bits(torch.cat([a, b]), whole, "top of counter range")
    k = int((whole == 1.125).sum())
    assert int((whole == 1.0).sum()) + k == 2 * n
    assert abs(k - 2 * n * 0.25) <= bernstein_t(2 * n, 0.25)


# ------------------------------------------------------------------------------------------ probabilities
def _check_frequencies(xs: list[float], fmt: str, dtype: torch.dtype, n: int, seeds: tuple[int, int]) -> None:
    """Every draw is lo or hi, and the frequency of hi is p = (|x| - lo) / (hi - lo) within Bernstein's bound.

    Half of the n draws per value come from seeds[0] with offset 0, half from seeds[1] with offset 2^31.
    """
    t = exact(xs, dtype)
    half = n // 2
    rep = t[:, None].expand(len(xs), half).contiguous()
    outs = [
        lowprec.quantize(rep, fmt, rounding="stochastic", seed=seeds[0], offset=0),
        lowprec.quantize(rep, fmt, rounding="stochastic", seed=seeds[1], offset=2**31),
    ]
    out = torch.cat(outs, dim=1)
    assert out.dtype == dtype
    vals = out.double().numpy()
    for i, x in enumerate(xs):
        lo, hi = neighbours(fmt, x)
        assert lo < abs(x) < hi, f"test value {x} is on the {fmt} grid"
        sign = -1.0 if x < 0 else 1.0
        row = vals[i]
        is_hi = row == sign * hi
        is_lo = row == sign * lo
        if lo == 0.0:  # the sign of zero: -x rounding down gives -0
            is_lo = row == 0.0
            assert np.all(np.signbit(row[is_lo]) == (x < 0)), f"{fmt} x={x}: zero with the wrong sign"
        other = ~(is_hi | is_lo)
        assert not other.any(), f"{fmt} x={x}: {int(other.sum())} draws are neither {lo} nor {hi}: {row[other][:5]}"
        p = (abs(x) - lo) / (hi - lo)
        k = int(is_hi.sum())
        tol = bernstein_t(row.size, p)
        assert abs(k - row.size * p) <= tol, (
            f"{fmt} x={x!r}: {k} of {row.size} draws went up to {hi}, expected {row.size * p:.1f} +- {tol:.1f} "
            f"(p = {p!r})"
        )


_N = 100_000

# (format, values strictly between two grid points, exactly representable in float32).
_CASES = {
    "bfloat16": [1.0 + 2.0**-9, -(1.0 + 3 * 2.0**-10), 3.1415927410125732, 2.0**100 * (1 + 2.0**-8), 1e-30],
    "float16": [1.0 + 2.0**-12, 1000.2999877929688, 65490.0, -(2.0**-12 + 2.0**-25)],
    "float8_e4m3fn": [1.0625, 300.0, 440.0, -0.10000000149011612, 2.0**-5 * 1.3125],
    "float8_e5m2": [1.100000023841858, 50000.0, -7.25, 2.0**-14 * 1.125],
    "float4_e2m1fn": [5.0, 0.20000000298023224, 2.75, -1.2999999523162842, 0.009999999776482582],
    "float6_e2m3fn": [7.2, 0.05],
    "int8": [2.299999952316284, -100.75, 126.5],
}


@pytest.mark.parametrize("fmt", list(_CASES))
def test_probability_of_rounding_up_is_exact_float32(fmt: str) -> None:
    """SR of a float32 value strictly between grid points lo < |x| < hi gives only lo or hi, hi with p = (|x|-lo)/step.

    Oracle: neighbours from the ml_dtypes-enumerated grid (int8: the integers); frequency within Bernstein's
    bound at false-failure rate 1e-9 per value (N = 100000 draws from two seeds and two offset ranges).
    """
    xs = [float(np.float32(v)) for v in _CASES[fmt]]
    _check_frequencies(xs, fmt, torch.float32, _N, seeds=(11, 2**64 - 1))


def test_probability_in_subnormal_ranges() -> None:
    """Subnormal regions of the targets (and float32 subnormal inputs for bfloat16) keep P(up) = distance / step.

    Oracle: ml_dtypes grids (subnormals included) and Bernstein's bound (DELTA = 1e-9 per value).  The values:
    e4m3 below its smallest subnormal 2^-9 (p = 1/8 and 3/4) and between subnormals; e5m2 and fp16 subnormals;
    fp4's only subnormal 0.5; bfloat16 from a float32 subnormal (1.5 * 2^-133: between 2^-133 and 2^-132, p=1/2);
    e4m3 at 1.5 * 2^-20, where the docstring says the probability is truncated to a multiple of 2^-31 - here
    p = 1.5 * 2^-11 is such a multiple, so it is still exact.
    """
    cases = {
        "float8_e4m3fn": [2.0**-12, 3 * 2.0**-11, -5.5 * 2.0**-9, 1.5 * 2.0**-20],
        "float8_e5m2": [1.25 * 2.0**-16, -2.75 * 2.0**-16],
        "float16": [2.5 * 2.0**-24, 2.0**-26, -1000.25 * 2.0**-24],
        "float4_e2m1fn": [0.125, -0.375],
        "bfloat16": [1.5 * 2.0**-133, 2.0**-140],
    }
    for fmt, xs in cases.items():
        _check_frequencies(xs, fmt, torch.float32, _N, seeds=(5, 6))


def test_probability_on_the_truncated_path() -> None:
    """Far below the smallest subnormal (P(up) < 2^-8) the probability is still distance / step.

    The _round docstring says that here the threshold is truncated to a multiple of 2^-31; for these inputs
    P(up) = |x| / 2^-9 (e4m3) and |x| / 2^-24 (fp16) are multiples of 2^-31, so the truncation is exact.
    Oracle: Bernstein's bound (DELTA = 1e-9 per value) with N = 400000 draws, enough to see a factor-2 error in
    a probability of ~3e-3 (expected count ~1170, bound ~230).
    """
    _check_frequencies([1.5 * 2.0**-18, -1.75 * 2.0**-18], "float8_e4m3fn", torch.float32, 400_000, (21, 22))
    _check_frequencies([1.5 * 2.0**-33], "float16", torch.float32, 400_000, (23, 24))


def test_probability_from_bfloat16_and_float16_inputs() -> None:
    """SR with a bfloat16 (and float16) input tensor: same lo/hi and probabilities, result in the input dtype.

    Oracle: ml_dtypes grids and Bernstein's bound (DELTA = 1e-9 per value); the inputs are exact bf16/fp16 values.
    """
    _check_frequencies([1.0 + 2.0**-7, -(2.0 + 2.0**-5), 300.0, 2.0**-11], "float8_e4m3fn", torch.bfloat16, _N, (1, 2))
    _check_frequencies([5.0, 0.25, -2.5], "float4_e2m1fn", torch.bfloat16, _N, (3, 4))
    _check_frequencies([1.0 + 2.0**-10, 2.0**-17 * 1.5], "float8_e5m2", torch.float16, _N, (7, 8))


# ------------------------------------------------------------------------------------------ unbiasedness
@pytest.mark.parametrize("fmt,scale", [("bfloat16", 1.0), ("float8_e4m3fn", 30.0), ("float4_e2m1fn", 1.5)])
def test_mean_of_draws_is_unbiased(fmt: str, scale: float) -> None:
    """The mean of M independent SR draws of each element equals the element within a stated bound.

    Oracle: for an element with neighbours lo, hi (ml_dtypes grid) and p = (|x|-lo)/(hi-lo), the mean is
    lo + (hi-lo) k/M with k ~ Binomial(M, p) (variance p(1-p) step^2 / M for the mean); Bernstein gives
    |mean - |x|| <= step * t(M, p) / M with DELTA = 1e-9 per element (128 elements: < 1.3e-7 per test).
    On-grid elements (p = 0) must have mean exactly x.
    """
    gen = torch.Generator().manual_seed(1234)
    n, m = 128, 4096
    x = (torch.randn(n, generator=gen) * scale).clamp(-5.9, 5.9) if fmt == "float4_e2m1fn" else torch.randn(
        n, generator=gen
    ) * scale
    x[:4] = torch.tensor([1.0, -0.5, 0.0, 2.0])  # on every grid tested here
    draws = lowprec.quantize(x[None, :].expand(m, n).contiguous(), fmt, rounding="stochastic", seed=77)
    mean = draws.double().mean(dim=0).numpy()
    xs = x.double().numpy()
    for i in range(n):
        lo, hi = neighbours(fmt, xs[i])
        if lo == hi:
            assert mean[i] == xs[i], f"on-grid element {xs[i]} moved: mean {mean[i]}"
            continue
        p = (abs(xs[i]) - lo) / (hi - lo)
        tol = (hi - lo) * bernstein_t(m, p) / m
        assert abs(mean[i] - xs[i]) <= tol, f"{fmt} x={xs[i]!r}: mean {mean[i]!r}, bound {tol!r} (p = {p})"


def test_float16_accumulation_example() -> None:
    """1024 + 0.5 added 2048 times in float16: round-to-nearest stays at 1024, SR ends near 2048.

    Oracles: (a) round to nearest: 1024.5 is a tie between 1024 and 1025 (fp16 step 1 in [1024, 2048)) that goes
    to the even 1024, so the sum never moves - confirmed with torch's own float16 addition; (b) SR is unbiased,
    so each of 1000 independent chains (each step uses fresh counters: offset = step * 1000) is a martingale plus
    0.5 per step with expectation 2048 at the end.  Freedman/Bernstein for martingales: increments are bounded by
    the step (<= 2 below 4096) with conditional variance <= 1, so over 1000 * 2048 increments the mean of the
    chains is within (2 L/3 + sqrt((2 L/3)^2 + 2 L * 2048000)) / 1000 ~= 9.4 of 2048 except with probability 1e-9.
    """
    # (a) round to nearest, two ways.
    y16 = torch.tensor([1024.0], dtype=torch.float16)
    for _ in range(2048):
        y16 = y16 + torch.tensor(0.5, dtype=torch.float16)
    assert y16.item() == 1024.0
    # lowprec's round-to-nearest maps 1024 + 0.5 back to 1024, so the deterministic chain is constant.
    y = lowprec.quantize(torch.full((4,), 1024.0) + 0.5, "float16")
    assert torch.all(y == 1024.0)
    # (b) stochastic rounding.
    chains = 1000
    y = torch.full((chains,), 1024.0)
    for step in range(2048):
        y = lowprec.quantize(y + 0.5, "float16", rounding="stochastic", seed=2024, offset=step * chains)
    assert torch.all(y.half().float() == y), "chains left the float16 grid"
    a = 2 * _L / 3
    bound = (a + math.sqrt(a * a + 2 * _L * chains * 2048 * 1.0)) / chains
    mean = y.double().mean().item()
    assert abs(mean - 2048.0) <= bound, f"mean of SR chains {mean}, expected 2048 +- {bound:.2f}"


# ---------------------------------------------------------------------------------------- reproducibility
def _sample(n: int = 4096, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 10


def test_same_seed_and_offset_reproduce_bits() -> None:
    """Same (seed, offset) twice gives identical bits; a different seed, offset or high seed word changes many.

    Oracle: determinism is the contract.  For "changes": two independent draws of an element with up-probability p
    differ with probability 2p(1-p) (p from the ml_dtypes grid); the number of differing elements is a sum of
    independent Bernoullis with mean E and variance <= E, so by Bernstein it is >= E - t (DELTA = 1e-9).
    """
    x = _sample()
    expect = 0.0
    for v in x.tolist():
        lo, hi = neighbours("float8_e4m3fn", v)
        p = 0.0 if lo == hi else (abs(v) - lo) / (hi - lo)
        expect += 2 * p * (1 - p)
    floor = expect - (_L / 3 + math.sqrt((_L / 3) ** 2 + 2 * _L * expect))
    assert floor > 100
    a = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=42, offset=10)
    b = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=42, offset=10)
    assert_same_bits(a, b, "same seed")
    c = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=43, offset=10)
    d = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=42, offset=11)
    e = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=42 + 2**32, offset=10)
    for other, what in ((c, "seed+1"), (d, "offset+1"), (e, "seed + 2^32 (high word)")):
        n_diff = int((other != a).sum())
        assert n_diff >= floor, f"{what}: only {n_diff} elements differ, expected >= {floor:.0f} (mean {expect:.0f})"


def test_seed_none_uses_torch_default_generator() -> None:
    """seed=None draws the seed from torch's default generator: torch.manual_seed(k) makes it reproducible.

    Oracle: two runs after torch.manual_seed(5) agree bitwise; runs after manual_seed(5) and manual_seed(6), or two
    consecutive unseeded runs, differ (4096 values, >= 1000 with p in (0.01, 0.99): equality has prob. < 1e-4).
    """
    x = _sample()
    torch.manual_seed(5)
    a = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic")
    a2 = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic")
    torch.manual_seed(5)
    b = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic")
    torch.manual_seed(6)
    c = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic")
    assert_same_bits(a, b, "manual_seed(5) twice")
    assert (a != c).any(), "manual_seed(5) and manual_seed(6) gave the same draws"
    assert (a != a2).any(), "two consecutive seed=None calls gave the same draws"
    # Same for fake_quantize with a stochastic spec.
    spec = lowprec.QuantSpec(elem="float8_e4m3fn", scaling="none", rounding="stochastic")
    torch.manual_seed(9)
    f1 = lowprec.fake_quantize(x, spec)
    torch.manual_seed(9)
    f2 = lowprec.fake_quantize(x, spec)
    assert_same_bits(f1, f2, "fake_quantize, manual_seed(9) twice")


# ------------------------------------------------------------------------------------ split invariance
@pytest.mark.parametrize("offset", [0, 1000, 2**31 - 300])
def test_split_1d_with_offsets_equals_whole(offset: int) -> None:
    """quantize(x[:n], offset=o) ++ quantize(x[n:], offset=o+n) == quantize(x, offset=o), bitwise.

    Oracle: the documented counter rule (element i uses counter offset + i), several split points.
    """
    x = _sample(1000, seed=1)
    kw = dict(rounding="stochastic", seed=2**40 + 3)
    for fmt in ("float8_e4m3fn", "bfloat16", "float4_e2m1fn"):
        whole = lowprec.quantize(x, fmt, offset=offset, **kw)
        for n in (1, 17, 500, 999):
            parts = [lowprec.quantize(x[:n], fmt, offset=offset, **kw),
                     lowprec.quantize(x[n:], fmt, offset=offset + n, **kw)]
            assert_same_bits(torch.cat(parts), whole, f"{fmt} split at {n}")
        # three pieces, quantized in reverse order
        pieces = [(0, 300), (300, 301), (301, 1000)]
        outs = {a: lowprec.quantize(x[a:b], fmt, offset=offset + a, **kw) for a, b in reversed(pieces)}
        assert_same_bits(torch.cat([outs[a] for a, _ in pieces]), whole, f"{fmt} three pieces")


def test_split_2d_and_3d_along_dim0_row_major() -> None:
    """Rows r0: of a 2-D (and 3-D) tensor use counters offset + r0 * (elements per row) (row-major order).

    Oracle: the row-major counter rule; also a transposed (non-contiguous) view equals its contiguous copy,
    since the counter follows the logical row-major index, not memory.
    """
    kw = dict(rounding="stochastic", seed=31337)
    x = _sample(6 * 50, seed=2).reshape(6, 50)
    whole = lowprec.quantize(x, "float8_e5m2", offset=77, **kw)
    for r in (1, 2, 5):
        top = lowprec.quantize(x[:r], "float8_e5m2", offset=77, **kw)
        bottom = lowprec.quantize(x[r:], "float8_e5m2", offset=77 + r * 50, **kw)
        assert_same_bits(torch.cat([top, bottom]), whole, f"2-D split at row {r}")
    flat = lowprec.quantize(x.reshape(-1), "float8_e5m2", offset=77, **kw)
    assert_same_bits(flat.reshape(6, 50), whole, "2-D vs flattened")
    y = _sample(4 * 3 * 7, seed=3).reshape(4, 3, 7)
    whole3 = lowprec.quantize(y, "bfloat16", offset=5, **kw)
    parts3 = [lowprec.quantize(y[:1], "bfloat16", offset=5, **kw),
              lowprec.quantize(y[1:], "bfloat16", offset=5 + 21, **kw)]
    assert_same_bits(torch.cat(parts3), whole3, "3-D split")
    xt = x.t()
    assert not xt.is_contiguous()
    assert_same_bits(
        lowprec.quantize(xt, "float8_e5m2", offset=3, **kw),
        lowprec.quantize(xt.contiguous(), "float8_e5m2", offset=3, **kw),
        "transposed view",
    )


def test_fake_quantize_stochastic_spec_matches_quantize_and_splits() -> None:
    """fake_quantize with QuantSpec(scaling="none", rounding="stochastic") uses the same counters as quantize.

    Oracles: (a) it equals quantize(x, "float8_e4m3fn", rounding="stochastic", saturate=True) with the same seed
    and offset (the spec saturates by default); (b) split invariance along dim 0 with offset o + rows * cols.
    """
    spec = lowprec.QuantSpec(elem="float8_e4m3fn", scaling="none", rounding="stochastic")
    x = _sample(8 * 40, seed=4).reshape(8, 40) * 30  # some values above 448: saturation matters
    assert (x.abs() > 448).any()
    whole = lowprec.fake_quantize(x, spec, seed=8, offset=123)
    ref = lowprec.quantize(x, "float8_e4m3fn", rounding="stochastic", seed=8, offset=123, saturate=True)
    assert_same_bits(whole, ref, "fake_quantize(none) vs quantize")
    top = lowprec.fake_quantize(x[:3], spec, seed=8, offset=123)
    bottom = lowprec.fake_quantize(x[3:], spec, seed=8, offset=123 + 3 * 40)
    assert_same_bits(torch.cat([top, bottom]), whole, "fake_quantize split")


def test_block_scaled_stochastic_split_rows() -> None:
    """Blocks run along the last dim, so rows are independent: splitting rows with offset o + r*K is invisible.

    Oracle: row-major counter rule applied to an MX spec with stochastic element rounding; every result lies on
    the two e4m3 neighbours of x / scale times the scale (scale = E8M0 from quantize_scaled, grid via ml_dtypes).
    """
    spec = lowprec.QuantSpec(
        elem="float8_e4m3fn", scaling="block", block_size=32, scale_format="float8_e8m0fnu",
        scale_rounding="floor", rounding="stochastic",
    )
    x = _sample(6 * 70, seed=5).reshape(6, 70)
    whole = lowprec.fake_quantize(x, spec, seed=1, offset=9)
    parts = [lowprec.fake_quantize(x[:4], spec, seed=1, offset=9),
             lowprec.fake_quantize(x[4:], spec, seed=1, offset=9 + 4 * 70)]
    assert_same_bits(torch.cat(parts), whole, "mx stochastic split")
    _, scales = lowprec.quantize_scaled(x, spec, seed=1, offset=9)
    s = scales.float().repeat_interleave(32, dim=1)[:, :70].double().numpy()
    xs, ws = x.double().numpy(), whole.double().numpy()
    for i in range(6):
        for j in range(70):
            lo, hi = neighbours("float8_e4m3fn", xs[i, j] / s[i, j])
            got = abs(ws[i, j]) / s[i, j]
            assert got in (lo, hi), f"[{i},{j}] x/s={xs[i, j] / s[i, j]} rounded to {got}, not {lo} or {hi}"


# ------------------------------------------------------------------------------------- fixed points, sign
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float6_e3m2fn", "float16"])
def test_grid_values_never_move(fmt: str) -> None:
    """Every finite value of the format (both zeros included) is returned unchanged by SR, for any random bits.

    Oracle: the ml_dtypes-decoded code table of the format; 64 repetitions of each value with distinct counters.
    """
    vals = all_values(fmt).astype(np.float32)
    if fmt == "float16":
        vals = vals[:: 7]  # a sample of the 63k values
    x = torch.from_numpy(np.ascontiguousarray(vals))[None, :].expand(64, -1).contiguous()
    out = lowprec.quantize(x, fmt, rounding="stochastic", seed=17, offset=5)
    assert_same_bits(out, x, f"{fmt} grid values under SR")


def test_grid_values_never_move_bfloat16_and_specials() -> None:
    """bf16 values (as float32) are fixed points of SR to bfloat16; inf and NaN keep their meaning.

    Oracle: values built as bf16 (so on the grid by construction); IEEE formats keep +-inf, NaN stays NaN.
    """
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(20000, generator=gen) * torch.exp(torch.randn(20000, generator=gen) * 20)).bfloat16().float()
    assert_same_bits(lowprec.quantize(x, "bfloat16", rounding="stochastic", seed=1), x, "bf16 grid")
    sp = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    for fmt in ("bfloat16", "float16", "float8_e5m2"):
        out = lowprec.quantize(sp, fmt, rounding="stochastic", seed=2)
        assert_same_bits(out, sp, f"{fmt} specials")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "bfloat16", "float4_e2m1fn", "float16"])
def test_sign_symmetry(fmt: str) -> None:
    """quantize(-x) == -quantize(x) bitwise with the same seed and offset (the magnitude is rounded).

    Oracle: symmetry of the grid and of the rounding rule (P(up) depends on |x| only, with the same bits).
    """
    x = _sample(5000, seed=6)
    if fmt == "float4_e2m1fn":
        x = x.clamp(-6, 6) / 2
    a = lowprec.quantize(x, fmt, rounding="stochastic", seed=123, offset=4)
    b = lowprec.quantize(-x, fmt, rounding="stochastic", seed=123, offset=4)
    assert_same_bits(b, -a, f"{fmt} sign symmetry")


def test_derive_keys_python_route_equals_tensor_route() -> None:
    """Eagerly on CPU, ``derive_keys`` computes the step's keys on Python ints; the words equal the int32 tensor
    operations (the route compiled code and other devices take) for keys of either sign and steps across the
    32-bit boundary."""
    from lowprec.quant import _random

    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        keys = torch.randint(-(2**31), 2**31, (2,), dtype=torch.int32, generator=g)
        for step in (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**40 + 3):
            st = torch.tensor(step, dtype=torch.int64)
            assert torch.equal(_random.derive_keys(keys, st), _random._derive_keys_tensor(keys, st)), (keys, step)
