"""lowprec.jax's float route for tensorwise fake quantization (``_fast_tensor``) and its native amax (``_native``).

Oracles, independent of the route under test: the integer kernel (``_round.quantize_f32`` on bit patterns, and
``_fast_tensor.exact``, the integer route of ``_scaled``) and PyTorch's ``lowprec.quantize`` /
``lowprec.fake_quantize`` (themselves tested against ml_dtypes and golden bit patterns elsewhere); for the amax,
NumPy's integer max of the bit patterns.  The rounding step is checked over every exponent from below the
format's smallest subnormal to float32's largest with 2^16 mantissa patterns each (ties, just-below and
just-above ties included); the whole fake quantization over random tensors with amaxes from 2^-110 to 2^127 and
the edge tensors (all zero, subnormals only, subnormals among normals, the smallest amax the route takes and the
largest it refuses, float32 max, inf, NaN, -0, bfloat16 and float16 inputs).  Every case also checks which
route it takes: the predicate ``ok`` (the float route is exact) for the data, and the route's named scope and
the native amax target in the compiled program.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import lowprec  # noqa: E402
import lowprec.jax as lj  # noqa: E402
from lowprec import QuantSpec, formats  # noqa: E402
from lowprec.jax import _fast_tensor as ft  # noqa: E402
from lowprec.jax import _native  # noqa: E402
from lowprec.jax._round import quantize_f32  # noqa: E402

_E4M3 = QuantSpec.named("fp8_e4m3_tensorwise")
SPECS = {
    "fp8_e4m3_tensorwise": _E4M3,
    "fp8_e5m2_tensorwise": QuantSpec.named("fp8_e5m2_tensorwise"),  # has inf
    "e4m3fnuz_tensorwise": dataclasses.replace(_E4M3, elem="float8_e4m3fnuz"),  # no -0
    "e2m1_tensorwise": dataclasses.replace(_E4M3, elem="float4_e2m1fn"),  # no inf or NaN, one mantissa bit
}
ROUTES = [pytest.param(True, id="native_amax"), pytest.param(False, id="xla_amax")]


def _u32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def _assert_bits(ref, got, what: str) -> None:
    r, g = np.asarray(ref), np.asarray(got)
    assert r.shape == g.shape and r.dtype == g.dtype, (what, r.shape, g.shape, r.dtype, g.dtype)
    rb, gb = r.view(np.uint16 if r.itemsize == 2 else np.uint32), g.view(np.uint16 if g.itemsize == 2 else np.uint32)
    bad = np.flatnonzero(rb != gb)
    assert bad.size == 0, f"{what}: {bad.size} of {rb.size} differ, e.g. {r.ravel()[bad[:4]]} vs {g.ravel()[bad[:4]]}"


def _same_nan(ref, got, what: str) -> None:
    """Bits equal except NaN payloads (PyTorch and the integer route write different NaNs; both must be NaN)."""
    r, g = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    both = np.isnan(r) & np.isnan(g)
    _assert_bits(np.where(both, 0, r), np.where(both, 0, g), what)


# ---------------------------------------------------------------------------------------------- the rounding
def _binades(fmt) -> np.ndarray:
    """float32 values of both signs in every binade from 2^(emin - mbits - 3) to 2^(emax + 1) and a few far ones
    (float32 subnormals, 2^-126, 2^-63, 2^73, float32's largest): the top 16 mantissa bits exhaustive, the low 7
    bits 0, 1 or 0x7F (so ties of every step width, just above and just below them)."""
    exps = list(range(fmt.emin - fmt.mbits - 3 + 127, fmt.emax + 2 + 127)) + [0, 1, 64, 200, 254]
    top = np.arange(1 << 16, dtype=np.uint32) << 7
    mant = (top[:, None] | np.array([0, 1, 0x7F], dtype=np.uint32)[None, :]).ravel()
    b = (np.array(sorted(set(exps)), dtype=np.uint32)[:, None] << 23 | mant[None, :]).ravel()
    return np.concatenate([b, b | 0x80000000]).view(np.float32)


@pytest.mark.parametrize("name", SPECS)
def test_float_route_rounding_over_binades(name: str) -> None:
    """``float_route(x, 1, 1)`` is ``Q(x)`` itself: the integer kernel's and PyTorch's saturating rounding."""
    spec = SPECS[name]
    x = _binades(spec.format)
    one = jnp.float32(1.0)
    got = jax.jit(lambda v: ft.float_route(v, one, one, spec))(jnp.asarray(x))
    ref = jax.jit(lambda v: quantize_f32(v, spec.format, rounding="nearest", saturate=True, rbits=None))(
        jnp.asarray(x))
    # inputs below 2^-126 are flushed by XLA before the route sees them; they round to zero either way
    _assert_bits(np.asarray(ref), np.asarray(got), f"{name} float route vs integer kernel")
    t = lowprec.quantize(torch.from_numpy(x), spec.format, saturate=True).numpy()
    _assert_bits(t, np.asarray(got), f"{name} float route vs torch")


# -------------------------------------------------------------------------------------- the whole quantizer
def _tensor(rng: np.random.Generator, log2_amax: float, shape=(33, 130)) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0 ** (log2_amax - 2))
    x.ravel()[:40] = (rng.integers(0, 1 << 23, 40, dtype=np.uint32) | (np.arange(40, dtype=np.uint32) << 31)).view(
        np.float32)  # subnormals of both signs among the normals
    x.ravel()[40:44] = [0.0, -0.0, np.float32(2.0**-126), -np.float32(2.0**-149)]
    return x


def _edges() -> dict[str, tuple[np.ndarray, bool]]:
    """name -> (tensor, whether the float route is exact for it)."""
    rng = np.random.default_rng(7)
    base = _tensor(rng, 0.0)
    f32max = np.float32(np.finfo(np.float32).max)
    lo_ok = np.float32(448.0 * 2.0**-116)  # amax with m = 2^116 exactly: e4m3's bound, the smallest it takes
    out: dict[str, tuple[np.ndarray, bool]] = {
        "zero": (np.zeros((7, 9), np.float32), False),
        "minus_zero": (np.full((7, 9), -0.0, np.float32), False),
        "subnormal_only": ((rng.integers(1, 1 << 23, (5, 64), dtype=np.uint32)).view(np.float32), False),
        "normal": (base, True),
        "near_max": (np.where(np.abs(base) > 1, np.sign(base) * f32max, base).astype(np.float32), True),
        "amax_at_bound": (np.concatenate([[lo_ok], base.ravel()[:99] * np.float32(2.0**-120)]).astype(np.float32),
                          True),
        "amax_below_bound": (np.concatenate([[np.nextafter(lo_ok, np.float32(0))],
                                             base.ravel()[:99] * np.float32(2.0**-120)]).astype(np.float32), False),
    }
    for bad, val in (("nan", np.nan), ("inf", np.inf), ("minus_inf", -np.inf)):
        for pos in (0, 1234, base.size - 1):
            x = base.copy()
            x.ravel()[pos] = val
            out[f"{bad}_at_{pos}"] = (x, False)
    return out


_FNS: dict[tuple[str, bool], dict] = {}


def _fns(name: str, native: bool) -> dict:
    """The jitted functions under test for one spec, traced with the native amax on or off (a jitted function keeps
    the route it was first traced with, so each setting has its own)."""
    if (name, native) not in _FNS:
        spec = SPECS[name]
        f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
        jitted = {
            "scalars": jax.jit(lambda v: ft.multiplier(ft.amax_bits(f32(v)), spec)),
            "fq": jax.jit(lambda v: ft.fake_quantize_tensor(f32(v), spec).astype(v.dtype)),
            "exact": jax.jit(lambda v: ft.exact(f32(v), spec).astype(v.dtype)),
            "route": jax.jit(lambda v, m, s: ft.float_route(f32(v), m, s, spec).astype(v.dtype)),
        }

        def traced(fn):
            def run(*args):
                with _native.enabled(native):
                    return fn(*args)
            return run

        _FNS[name, native] = {k: traced(v) for k, v in jitted.items()}
    return _FNS[name, native]


def _check(x: np.ndarray, name: str, native: bool, ok_expected: bool | None, what: str) -> None:
    """``fake_quantize_tensor(x)`` against the integer route (all bits) and PyTorch (NaN payloads aside); the route
    taken against ``ok_expected``; where it is the float route, that route's own output, without the cond."""
    fns, xj = _fns(name, native), jnp.asarray(x)
    m, s, ok = fns["scalars"](xj)
    if ok_expected is not None:
        assert bool(ok) == ok_expected, f"{what}: float route taken={bool(ok)}, expected {ok_expected}"
    got, exact = np.asarray(fns["fq"](xj)), np.asarray(fns["exact"](xj))
    _assert_bits(exact, got, f"{what}: vs the integer route")
    if bool(ok):
        _assert_bits(exact, np.asarray(fns["route"](xj, m, s)), f"{what}: the float route's own bits")
    tx = torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16) if x.dtype == jnp.bfloat16 else torch.from_numpy(x)
    ref = lowprec.fake_quantize(tx, SPECS[name])
    _same_nan(ref.float().numpy(), got.astype(np.float32), f"{what}: vs torch")


def _skip_unbuilt(native: bool) -> None:
    if native and not _native.available():
        pytest.skip("native amax not built (no C compiler, or LOWPREC_NATIVE=0)")


@pytest.mark.parametrize("native", ROUTES)
@pytest.mark.parametrize("name", SPECS)
def test_fake_quantize_random_amaxes(name: str, native: bool) -> None:
    _skip_unbuilt(native)
    fmt = SPECS[name].format
    bound = np.log2(fmt.max) - (fmt.emin - fmt.mbits + 125)  # log2 of the smallest amax the float route takes
    rng = np.random.default_rng(3)
    for log2_amax in (-120, -100, -90, -60, -20, -3, 0, 0.5, 7, 20, 60, 100, 126):
        x = _tensor(rng, log2_amax)
        a = float(np.abs(x).max())
        ok = None if abs(np.log2(a) - bound) < 1 else bool(np.log2(a) > bound)
        _check(x, name, native, ok, f"{name} amax {a:.3g}")


@pytest.mark.parametrize("native", ROUTES)
def test_fake_quantize_edges(native: bool) -> None:
    _skip_unbuilt(native)
    for what, (x, ok) in _edges().items():
        _check(x, "fp8_e4m3_tensorwise", native, ok, what)
    for name in ("fp8_e5m2_tensorwise", "e4m3fnuz_tensorwise", "e2m1_tensorwise"):
        for what, (x, _) in _edges().items():  # another bound; inf and NaN: the integer route's bits
            _check(x, name, native, None, f"{name} {what}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fake_quantize_half_inputs(dtype: str) -> None:
    x = np.array(jnp.asarray(_tensor(np.random.default_rng(5), 3.0)).astype(dtype))  # a writable copy
    _check(x, "fp8_e4m3_tensorwise", _native.available(), True, dtype)


def test_applies() -> None:
    import dataclasses

    assert ft.applies(QuantSpec.named("fp8_e4m3_tensorwise")) and ft.applies(QuantSpec.named("fp8_e5m2_tensorwise"))
    e4m3 = QuantSpec.named("fp8_e4m3_tensorwise")
    for no in (dataclasses.replace(e4m3, rounding="stochastic"), dataclasses.replace(e4m3, saturate=False),
               QuantSpec.named("fp8_e4m3_rowwise"), QuantSpec.named("mxfp8_e4m3"), QuantSpec.named("nvfp4"),
               dataclasses.replace(e4m3, elem=formats.get("int8"))):
        assert not ft.applies(no), no


def test_route_in_compiled_program() -> None:
    """The float route is in the program (as a branch of the cond), with the native amax on CPU if available."""
    spec = QuantSpec.named("fp8_e4m3_tensorwise")
    x = jnp.ones((16, 128), jnp.float32)
    with _native.enabled(True):
        hlo = jax.jit(lambda v: ft.fake_quantize_tensor(v, spec)).lower(x).compile().as_text()
    assert ft.SCOPE in hlo
    assert (_native.TARGET in hlo) == (_native.available() and jax.default_backend() == "cpu")
    with _native.enabled(False):
        hlo = jax.jit(lambda v: ft.fake_quantize_tensor(v, spec)).lower(x).compile().as_text()
    assert ft.SCOPE in hlo and _native.TARGET not in hlo


@pytest.mark.parametrize("native", ROUTES)
def test_gradient_is_the_integer_routes(native: bool) -> None:
    """Differentiable as the integer route is (bit patterns carry no gradient: zero), the native amax included."""
    _skip_unbuilt(native)
    spec = SPECS["fp8_e4m3_tensorwise"]
    x = jnp.asarray(_tensor(np.random.default_rng(9), 2.0))
    with _native.enabled(native):
        g = jax.jit(jax.grad(lambda v: ft.fake_quantize_tensor(v, spec).sum()))(x)
    ref = jax.jit(jax.grad(lambda v: ft.exact(v, spec).sum()))(x)
    _assert_bits(np.asarray(ref), np.asarray(g), "gradient")


def test_public_fake_quantize_takes_the_route() -> None:
    """``lj.fake_quantize`` and ``fake_quantize_traced`` use the float route for tensorwise specs."""
    from lowprec.jax._scaled import fake_quantize_traced

    x = jnp.ones((16, 128), jnp.float32)
    spec = QuantSpec.named("fp8_e4m3_tensorwise")
    assert ft.SCOPE in jax.jit(lambda v: lj.fake_quantize(v, spec)).lower(x).compile().as_text()
    assert ft.SCOPE in jax.jit(lambda v: fake_quantize_traced(v, spec)).lower(x).compile().as_text()


# ----------------------------------------------------------------------------------------------- native amax
@pytest.mark.skipif(not _native.available(), reason="native amax not built (no C compiler, or LOWPREC_NATIVE=0)")
def test_native_absmax_bits() -> None:
    """An integer max of the magnitude bits, as NumPy's: subnormals exact, NaN (any payload, either sign) wins."""
    rng = np.random.default_rng(11)
    f = jax.jit(_native.absmax_bits)
    for n in (1, 7, 64, 4097, 1 << 16):
        raw = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        sub = raw & 0x807FFFFF  # subnormals only: XLA's float max would read these as zero
        for b in (raw & 0xFF7FFFFF, sub):  # finite, then subnormal
            assert int(np.asarray(f(jnp.asarray(b.view(np.float32))))) == int((b & 0x7FFFFFFF).max())
        for nan in (0x7FC00000, 0xFF800001, 0x7F800000):
            b = sub.copy()
            b[rng.integers(0, n)] = nan
            assert int(np.asarray(f(jnp.asarray(b.view(np.float32))))) == int((b & 0x7FFFFFFF).max())
    x = rng.standard_normal((3, 5, 40)).astype(np.float32)
    x[1, 2, 7] = np.nan
    got = np.asarray(jax.vmap(jax.vmap(_native.absmax_bits))(jnp.asarray(x)))  # one amax per mapped slice
    assert np.array_equal(got, (_u32(x) & 0x7FFFFFFF).max(axis=-1).astype(np.int32))
