"""The in-place fast paths of ``lowprec.inference._affine`` (activation and weight fake quantization) give the same
bits as the plain tensor operations they replace (``_affine._reference_fake_quantize_int`` / ``_float``,
``_calibrate.fake_quantize_static``): whole binades of float32 inputs, ties, zeros of both signs, float32
subnormals, values beyond the clipping range, inf and NaN, float32 and bfloat16, with lowprec's native C kernels
on and off.  Speed itself is measured by benchmarks/bench_inference.py, never here."""

from __future__ import annotations

import pytest
import torch

import lowprec.inference as li
from lowprec.inference import _affine, _calibrate
from lowprec.inference._quantize import _affine_view, fake_quantize_activation
from lowprec.inference._scheme import TensorScheme
from lowprec.quant import _native

K = 128
_TINY = float.fromhex("0x1p-126")


def _old_fake_quantize_activation(x: torch.Tensor, ts: TensorScheme, scale: torch.Tensor | None = None):
    """fake_quantize_activation before the fast paths (the oracle)."""
    if scale is not None:
        return _calibrate.fake_quantize_static(x, scale, ts)
    if ts.scale_format != "float32":
        from lowprec.quant import fake_quantize

        return fake_quantize(x, ts.quant_spec())
    x2 = x.reshape(-1, x.shape[-1])
    view = _affine_view(ts)
    ref = _affine._reference_fake_quantize_int if ts.is_int else _affine._reference_fake_quantize_float
    return ref(x2, view).reshape(x.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    same = _bits(a) == _bits(b)
    if not bool(same.all()):
        i = int((~same).reshape(-1).nonzero()[0])
        raise AssertionError(f"{int((~same).sum())} elements differ; first at {i}: "
                             f"{a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}")


def _sweep(lo_exp: int, hi_exp: int, step_bits: int) -> torch.Tensor:
    """Positive float32 values of every binade 2^lo_exp .. 2^hi_exp, every 2^step_bits-th bit pattern (ties to the
    grid of any format with <= 23 - step_bits mantissa bits included), and float32 subnormals."""
    lo = (lo_exp + 127) << 23 if lo_exp > -127 else 1
    hi = (hi_exp + 127) << 23
    pats = torch.arange(lo, hi, 1 << step_bits, dtype=torch.int64).to(torch.int32)
    sub = torch.tensor([1, 2, 3, 0x400000, 0x7FFFFF], dtype=torch.int32)
    return torch.cat([pats, sub]).view(torch.float32)


def _rows(anchor: float, values: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows of K: element 0 is ``anchor`` (the row's max |x|, so that its scale is exact), the rest ``values`` (at
    most ``anchor`` in magnitude) with random signs, shuffled; rows scaled by powers of two and by other factors."""
    g = torch.Generator().manual_seed(seed)
    v = values[values.abs() <= anchor]
    v = v * torch.where(torch.rand(v.shape, generator=g) < 0.5, -1.0, 1.0)
    v = v[torch.randperm(v.numel(), generator=g)]
    n = -(-v.numel() // (K - 1))
    v = torch.cat([v, torch.zeros(n * (K - 1) - v.numel())]).reshape(n, K - 1)
    rows = torch.cat([torch.full((n, 1), anchor), v], dim=1)
    factors = torch.tensor([1.0, 2.0 ** -20, 2.0 ** 20, 2.0 ** -100, 3.7, 0.0123, 1e-30, 1e30])
    return rows * factors[torch.arange(n) % factors.numel()][:, None]


def _specials() -> torch.Tensor:
    nan, inf = float("nan"), float("inf")
    rows = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    rows[0] = 0.0
    rows[1] = -0.0
    rows[2, 5] = inf
    rows[3, 7] = -inf
    rows[4, 9] = nan
    rows[5, :64] = -0.0
    rows[5, 64:] = 0.0
    rows[6] = torch.finfo(torch.float32).max * torch.sign(rows[6])
    rows[7] = 1e-45 * torch.sign(rows[7])  # float32's smallest subnormal
    return rows


def _inputs(ts: TensorScheme) -> torch.Tensor:
    """[rows, K] float32 test inputs for an activation scheme."""
    if ts.is_int:
        anchor = 127.5  # int8's (qmax - qmin) / 2: the scale is 1 (times the row factor) and x.5 are ties
        ties = torch.arange(-128.0, 128.0, 0.25)
        base = torch.cat([_sweep(-30, 7, 12), ties.abs()])
    else:
        anchor = 448.0  # e4m3's max: the scale is 1 (times the row factor)
        base = _sweep(-30, 9, 12)
    rows = torch.cat([_rows(anchor, base, 0), torch.randn(64, K, generator=torch.Generator().manual_seed(1)),
                      _specials()])
    return rows


ACT_SCHEMES = {name: li.get(name).config_groups[0].input_activations for name in li.names()}
ACT_SCHEMES = {n: ts for n, ts in ACT_SCHEMES.items() if ts is not None}
WEIGHT_SCHEMES = {name: li.get(name).config_groups[0].weights for name in li.names()}


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native"])
@pytest.mark.parametrize("name", list(ACT_SCHEMES))
def test_dynamic_activation_same_bits(name: str, native: bool) -> None:
    ts = ACT_SCHEMES[name]
    if ts.dynamic is False:
        pytest.skip("static: test_static_activation_same_bits")
    x = _inputs(ts)
    with _native.enabled(native):
        for t in (x, x.reshape(2, -1, K) if x.shape[0] % 2 == 0 else x[None], x.to(torch.bfloat16)):
            _assert_same_bits(fake_quantize_activation(t, ts), _old_fake_quantize_activation(t, ts))


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -10, 0.0123, 3.5, _TINY])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
def test_static_activation_same_bits(fmt: str, scale: float, native: bool) -> None:
    ts = TensorScheme(format=fmt, dynamic=False)
    x = _inputs(ts)
    x = torch.cat([x, x * 1000.0])  # beyond the clipping value: saturates
    s = _calibrate.scale_from_clip(torch.tensor(scale * _calibrate.max_representable(ts)), ts)
    s = torch.tensor(scale, dtype=torch.float32) if scale != _TINY else s
    with _native.enabled(native):
        for t in (x, x.reshape(2, -1, K), x.to(torch.bfloat16)):
            _assert_same_bits(fake_quantize_activation(t, ts, s), _old_fake_quantize_activation(t, ts, s))


def test_static_preset_same_bits() -> None:
    ts = ACT_SCHEMES["fp8-static"]
    x = _inputs(ts)
    for clip in (448.0, 1.0, 1e-3):
        s = _calibrate.scale_from_clip(torch.tensor(clip), ts)
        _assert_same_bits(fake_quantize_activation(x, ts, s), _calibrate.fake_quantize_static(x, s, ts))


@pytest.mark.parametrize("name", [n for n, ts in WEIGHT_SCHEMES.items() if ts is not None
                                  and ts.scale_format == "float32"])
def test_weight_same_bits(name: str) -> None:
    ts = WEIGHT_SCHEMES[name]
    x = _inputs(TensorScheme(format="int8" if ts.is_int else "float8_e4m3fn"))
    w = x[: (x.shape[0] // 128) * 128]  # [N, 128]: block (128, 128) and group 128 divide it
    w = torch.cat([w, w.flip(0) * 0.37], dim=1)  # K = 256
    fast = _affine.fake_quantize_int if ts.is_int else _affine.fake_quantize_float
    ref = _affine._reference_fake_quantize_int if ts.is_int else _affine._reference_fake_quantize_float
    for t in (w, w.to(torch.bfloat16), w[:128].clone()):
        _assert_same_bits(fast(t, ts), ref(t, ts))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["channel", "tensor", "group"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int_granularities_same_bits(fmt: str, granularity: str, symmetric: bool) -> None:
    ts = TensorScheme(format=fmt, granularity=granularity, symmetric=symmetric,
                      group_size=32 if granularity == "group" else None)
    x = _inputs(TensorScheme(format="int8"))
    for t in (x, x + 0.25 * x.abs().amax(dim=1, keepdim=True), x.to(torch.bfloat16)):  # asymmetric ranges too
        _assert_same_bits(_affine.fake_quantize_int(t, ts), _affine._reference_fake_quantize_int(t, ts))


def test_negative_zero_becomes_positive_as_in_the_reference() -> None:
    ts = TensorScheme(format="int8", granularity="channel")
    x = torch.tensor([[127.5, -0.3, -0.0, 0.2]])
    out = _affine.fake_quantize_int(x, ts)
    assert _bits(out).tolist() == _bits(_affine._reference_fake_quantize_int(x, ts)).tolist()
    assert not bool(torch.signbit(out[0, 1:]).any())
