"""torch.compile'd quantizers give the same bits as the eager path (oracle: the eager kernels themselves).

Each case compiles a fused kernel (inductor C++ on CPU), so these tests take tens of seconds in all.
"""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.quant import QuantSpec
from lowprec.testing import assert_bitwise_equal

pytestmark = pytest.mark.slow  # make test-slow: torch.compile kernels: a cold inductor cache compiles for minutes


def _varied(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Normals over a wide exponent range plus zeros, subnormals, huge values, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    flat = x.view(-1)
    flat[:12] = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-42, 3e38, -3e38, 448.0, 464.0, 6.0, 7.0, float("nan"), float("inf")]
    )
    flat[-40:] = 0.0  # an all-zero tail block
    return x


def _both(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    with lowprec.quant.backend("eager"):
        eager = fn(*args, **kwargs)
    with lowprec.quant.backend("compiled"):
        compiled = fn(*args, **kwargs)
    return eager, compiled


ELEMENTWISE = [
    ("float8_e4m3fn", "nearest", False),
    ("float8_e5m2", "toward_zero", True),
    ("bfloat16", "stochastic", False),
    ("float4_e2m1fn", "stochastic", True),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "rounding", "saturate"), ELEMENTWISE)
def test_quantize_compiled_matches_eager(fmt: str, rounding: str, saturate: bool) -> None:
    x = _varied((64, 300))
    e, c = _both(lowprec.quantize, x, fmt, rounding=rounding, seed=7, offset=11, saturate=saturate)
    assert_bitwise_equal(c, e, context=f"quantize {fmt} {rounding}")


@pytest.mark.slow
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "tf32", "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz",
                                 "float6_e3m2fn", "float4_e2m1fn"])
def test_nearest_rounding_of_compiled_graphs_matches_the_integer_route(fmt: str, saturate: bool) -> None:
    """Inside torch.compile, round-to-nearest takes float32 arithmetic (``_round._nearest_magnitude_float_route``;
    bfloat16 its four-operation bit form ``_bf16_nearest_bits``); eager, the integer route.  Every float32 whose
    top 14 mantissa bits run through all values in the binades around the format's subnormal range and largest
    binades (ties, subnormals, overflow past max), a strided sweep of all 2^32 bit patterns (NaN payloads of both
    signs, inf, float32 subnormals) and signed zeros, with each format's overflow, zero and NaN rules."""
    from test_native_group import _sweep

    x = torch.cat([_sweep(lowprec.formats.get(fmt)), torch.tensor([0.0, -0.0])]).view(-1, 2)
    e, c = _both(lowprec.quantize, x, fmt, saturate=saturate)
    assert_bitwise_equal(c, e, context=f"{fmt} saturate={saturate}")
    nan = x.view(-1)[torch.isnan(x.view(-1))]
    assert len(set(nan.view(torch.int32).tolist())) > 100  # many NaN payloads went through


SPECS = [
    "fp8_e4m3_tensorwise",
    "fp8_e4m3_rowwise",
    "mxfp8_e4m3",
    "mxfp4",
    "nvfp4",
    "fp8_e4m3_1x128",
    QuantSpec(elem="float8_e5m2", scaling="block", block_size=32, axis=0, scale_format="float8_e8m0fnu",
              scale_rounding="ceil", rounding="stochastic"),
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else "e5m2_block_axis0_sr")
def test_fake_quantize_compiled_matches_eager(spec: str | QuantSpec) -> None:
    x = _varied((64, 300), seed=1)
    e, c = _both(lowprec.fake_quantize, x, spec, seed=3)
    assert_bitwise_equal(c, e, context=f"fake_quantize {spec}")


@pytest.mark.slow
def test_bf16_input_compiled_matches_eager() -> None:
    x = _varied((32, 256), seed=2).bfloat16()
    e, c = _both(lowprec.fake_quantize, x, "mxfp8_e4m3")
    assert_bitwise_equal(c, e, context="bf16 input mxfp8")


@pytest.mark.slow
def test_many_float32_scales_compiled_matches_eager() -> None:
    """2048 rowwise float32 scales (multiplier max/amax and its reciprocal): inductor must keep both divisions
    correctly rounded (a reciprocal-multiply rewrite would differ in many rows)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (2048, 1), generator=g).float())
    e, c = _both(lowprec.fake_quantize, x, "fp8_e5m2_rowwise")
    assert_bitwise_equal(c, e, context="rowwise 2048 scales")
    with lowprec.quant.backend("compiled"):
        codes, scales = lowprec.quantize_scaled(x, "fp8_e5m2_rowwise")
    assert_bitwise_equal(lowprec.dequantize(codes, scales, "fp8_e5m2_rowwise"), e, context="stored scales")
