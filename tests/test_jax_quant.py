"""lowprec.jax against lowprec (PyTorch), bit for bit.

Oracle: the PyTorch quantizers (``lowprec.quantize``, ``fake_quantize``, ``quantize_scaled``), themselves tested
against ml_dtypes, torch casts and golden bit patterns elsewhere.  Both sides get the same NumPy inputs: random
bit patterns (every exponent, subnormals, inf, NaN), random normals at several magnitudes, and the edge values
0, -0, subnormals, max, beyond max, inf and NaN.  Stochastic rounding uses the same seed and offset on both
sides.  Float32 and float16 results must have identical bits, NaN payloads included; bfloat16 results identical
bits except NaN payloads (PyTorch's eager float32 -> bfloat16 cast writes every NaN as 0xFFFF, XLA keeps the
sign), which must be NaN on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import lowprec  # noqa: E402
import lowprec.jax as lj  # noqa: E402
from lowprec import QuantSpec, formats  # noqa: E402

ROUNDINGS = ("nearest", "stochastic", "toward_zero")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_JAX = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _edges() -> np.ndarray:
    e = [0.0, -0.0, 1e-45, -1e-45, 3e-39, -1.1e-38, 2.0**-126, 2.0**-9, 2.0**-16, 2.0**-133, 448, 464, 480, 500,
         -57344, 61440, 1e6, 6, 6.5, 7.5, 28, 30, 1.984375, 127, 128, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan,
         -np.nan, 1.0, -1.0, 0.75, 3.0, 1.5, 2.5]
    return np.array(e, dtype=np.float32)


def _inputs(seed: int = 0, n: int = 2048) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    raw[: n // 8] &= 0x807FFFFF  # subnormals
    raw[-4:] = [0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0xFF800000]  # NaN payloads, -inf
    normal = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)
    return np.concatenate([_edges(), raw.view(np.float32), normal])


def _assert_same(ref: np.ndarray, got: np.ndarray, dtype: str, what: str) -> None:
    assert ref.shape == got.shape, (what, ref.shape, got.shape)
    rb = ref.view(np.uint16 if ref.itemsize == 2 else (np.uint8 if ref.itemsize == 1 else np.uint32))
    gb = got.view(rb.dtype)
    ne = rb != gb
    if dtype == "bfloat16":
        ne &= ~(np.isnan(ref.astype(np.float32)) & np.isnan(got.astype(np.float32)))
    if ne.any():
        idx = np.flatnonzero(ne)[:5]
        raise AssertionError(
            f"{what}: {ne.sum()} of {ne.size} differ; torch {ref.ravel()[idx]} ({rb.ravel()[idx]}) "
            f"jax {got.ravel()[idx]} ({gb.ravel()[idx]})"
        )


def _torch_np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


X = _inputs()


# ------------------------------------------------------------------------------------------------ elementwise
# float32 inputs in every rounding/saturation; bfloat16 and float16 inputs in two of them (the casts around the
# float32 kernel are what they add).  One jit per format keeps compile time down.
_CONFIGS = [(r, s, "float32") for r in ROUNDINGS for s in (False, True)] + [
    ("nearest", False, "bfloat16"), ("stochastic", True, "float16"), ("toward_zero", False, "bfloat16")]


def _kw(rounding: str, saturate: bool) -> dict:
    return dict(rounding=rounding, saturate=saturate, offset=5, seed=2**63 + 11 if rounding == "stochastic" else None)


@pytest.mark.parametrize("name", formats.names() + ["e3m4", "e8m13", "e5m6fn", "float7_e4m2fnuz"])
def test_quantize_bits_match_torch(name: str) -> None:
    xs = {d: jnp.asarray(X).astype(_JAX[d]) for d in _JAX}
    many = jax.jit(lambda xs: [lj.quantize(xs[d], name, **_kw(r, s)) for r, s, d in _CONFIGS])
    for (rounding, saturate, dtype), got in zip(_CONFIGS, many(xs), strict=True):
        ref = _torch_np(lowprec.quantize(torch.from_numpy(X).to(_TORCH[dtype]), name, **_kw(rounding, saturate)))
        _assert_same(ref, np.asarray(got), dtype, f"{name} {rounding} saturate={saturate} {dtype}")


def test_quantize_jit_vmap_offset() -> None:
    x = X[: 64 * 32].reshape(64, 32)
    kw = dict(rounding="stochastic", seed=7)
    f = jax.jit(lambda v: lj.quantize(v, "float8_e5m2", **kw))
    whole = np.asarray(f(jnp.asarray(x)))
    ref = lowprec.quantize(torch.from_numpy(x), "float8_e5m2", **kw).numpy()
    _assert_same(ref, whole, "float32", "jit")
    # vmap: every row counts from 0, as PyTorch on each row alone
    rows = np.asarray(jax.vmap(lambda v: lj.quantize(v, "float8_e5m2", **kw))(jnp.asarray(x)))
    for i in (0, 5, 63):
        _assert_same(lowprec.quantize(torch.from_numpy(x[i]), "float8_e5m2", **kw).numpy(), rows[i], "float32", "vmap")
    # a slice quantized with offset=start equals the same slice of the whole
    part = np.asarray(lj.quantize(jnp.asarray(x[10:]), "float8_e5m2", offset=10 * 32, **kw))
    _assert_same(whole[10:], part, "float32", "offset")


def test_quantize_errors_match_torch() -> None:
    x = jnp.zeros(4, jnp.float32)
    for kw in ({"rounding": "up"}, {"saturate": 1}, {"seed": -1, "rounding": "stochastic"}, {"offset": -1},
               {"offset": 2**32}):
        with pytest.raises(ValueError) as t_err:
            lowprec.quantize(torch.zeros(4), "float8_e4m3fn", **kw)
        with pytest.raises(ValueError) as j_err:
            lj.quantize(x, "float8_e4m3fn", **kw)
        assert str(t_err.value) == str(j_err.value)
    with pytest.raises(ValueError, match="unknown format"):
        lj.quantize(x, "float9")
    with pytest.raises(ValueError, match="needs seed"):
        lj.quantize(x, "bfloat16", rounding="stochastic")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        lj.quantize(jnp.zeros(4, jnp.int32), "bfloat16")


# ------------------------------------------------------------------------------------------------------ scaled
# NaN payloads: where a group holds NaN/inf its scale is NaN and the group dequantizes to NaN on both sides, but
# which NaN (sign, payload) comes out of x86's and XLA's NaN propagation differs; those positions must be NaN on
# both sides, every other bit identical.
_CUSTOM = {
    "bf16_axis0_margin": QuantSpec(elem="float8_e5m2", scaling="axis", axis=0, scale_format="bfloat16", margin=2),
    "e8m0_ceil_block12_axis0": QuantSpec(elem="float6_e2m3fn", scaling="block", block_size=12, axis=0,
                                         scale_format="float8_e8m0fnu", scale_rounding="ceil", saturate=False),
    "e4m3_floor_tile_2x16": QuantSpec(elem="int8_mx", scaling="tile", tile=(2, 16), scale_format="float8_e4m3fn",
                                      scale_rounding="floor", rounding="toward_zero"),
    "none_e3m4": QuantSpec(elem="e3m4", scaling="none"),
    "e8m0_nearest_margin": QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=32,
                                     scale_format="float8_e8m0fnu", scale_rounding="nearest", margin=-3),
}
_SPECS = {n: QuantSpec.named(n) for n in QuantSpec.names()} | _CUSTOM
_STOCHASTIC = ("mxfp4", "nvfp4", "fp8_e4m3_tensorwise", "fp8_e5m2_rowwise")


def _scaled_input() -> np.ndarray:
    x = _inputs(1, 1600)[: 43 * 70].reshape(43, 70)  # every block, tile and row ragged
    x[40:] = np.abs(x[40:]) * np.float32(2.0**-140)  # rows of subnormals only
    x[:, 66:] = 0.0  # all-zero groups
    return x


def _same_nan(ref: np.ndarray, got: np.ndarray, what: str) -> None:
    both = np.isnan(ref) & np.isnan(got)
    _assert_same(np.where(both, 0, ref), np.where(both, 0, got), "float32", what)


@pytest.mark.parametrize("name", list(_SPECS))
def test_scaled_bits_match_torch(name: str) -> None:
    import dataclasses

    spec = _SPECS[name]
    if name in _STOCHASTIC:
        spec = dataclasses.replace(spec, rounding="stochastic")
    x = _scaled_input()
    kw = dict(seed=12345, offset=17) if spec.rounding == "stochastic" else {}
    ref = lowprec.fake_quantize(torch.from_numpy(x), spec, **kw).numpy()
    storable = spec.format.name in formats.names()

    @jax.jit
    def run(v):
        fq = lj.fake_quantize(v, spec, **kw)
        if not storable:
            return fq, fq
        codes, scales = lj.quantize_scaled(v, spec, **kw)
        return fq, lj.dequantize(codes, scales, spec, shape=v.shape)

    fq, dq = run(jnp.asarray(x))
    _same_nan(ref, np.asarray(fq), f"fake_quantize {name}")
    if storable:
        codes, scales = lowprec.quantize_scaled(torch.from_numpy(x), spec, **kw)
        _same_nan(lowprec.dequantize(codes, scales, spec, shape=x.shape).numpy(), np.asarray(dq), f"dequantize {name}")
        # dequantize(quantize_scaled(x)) == fake_quantize(x), the PyTorch identity, on the JAX side too
        _same_nan(np.asarray(fq), np.asarray(dq), f"jax fake == dequantize {name}")


def test_scaled_storage_and_vmap() -> None:
    x = _scaled_input()[:32, :64]
    codes, scales = lj.quantize_scaled(jnp.asarray(x), "mxfp8_e4m3")
    assert codes.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu and scales.shape == (32, 2)
    tc, ts = lowprec.quantize_scaled(torch.from_numpy(x), "mxfp8_e4m3")
    assert np.array_equal(np.asarray(codes).view(np.uint8), tc.view(torch.uint8).numpy())
    assert np.array_equal(np.asarray(scales).view(np.uint8), ts.view(torch.uint8).numpy())
    codes, two = lj.quantize_scaled(jnp.asarray(x), "nvfp4")
    assert codes.dtype == jnp.float4_e2m1fn and isinstance(two, lj.TwoLevelScales)
    # vmap over rows == PyTorch's per-row tensorwise scaling == rowwise spec
    rows = jax.vmap(lambda r: lj.fake_quantize(r, "fp8_e4m3_tensorwise"))(jnp.asarray(x))
    _same_nan(lowprec.fake_quantize(torch.from_numpy(x), "fp8_e4m3_rowwise").numpy(), np.asarray(rows), "vmap")


def test_scaled_errors_match_torch() -> None:
    bad = [("x", QuantSpec(scaling="axis", axis=3)), ("x", "mxfp9"), ("x", 3)]
    for _, spec in bad:
        with pytest.raises(ValueError) as t_err:
            lowprec.fake_quantize(torch.zeros(4, 4), spec)
        with pytest.raises(ValueError) as j_err:
            lj.fake_quantize(jnp.zeros((4, 4)), spec)
        assert str(t_err.value) == str(j_err.value)
