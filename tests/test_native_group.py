"""The grouped native kernel (``lowprec.quant._native_group``, ``lp_group_fake``) gives the tensor route's bits.

Oracle: the same public quantizer with the fast paths off (``_backend.fast_paths(False)``): the tensor-operation
kernels of ``_scaled``, ``_scale`` and ``_round``, themselves checked against ml_dtypes, torch casts, torchao and
compressed-tensors elsewhere.  Covered:

1. element rounding alone (scaling "none") for every format lowprec knows (IEEE, fn, fnuz, finite, integer), three
   roundings, saturating or not, over every float32 whose top 14 mantissa bits run through all values in the
   binades around each format's subnormal range and largest binades (exact ties included), a strided sweep of all
   2^32 bit patterns (NaN, inf, float32 subnormals) and random words;
2. every named spec and variants of its scale rule (E8M0 floor / ceil / nearest, float scales rounded nearest /
   down / up, margins, no saturation), with nearest, stochastic and toward-zero rounding, on contiguous,
   transposed, 1-D, 3-D and odd-shaped tensors (partial blocks and tiles), float32 and bfloat16, with all-zero,
   subnormal and near-float32-max groups;
3. a group holding NaN or inf: the kernel declines and the quantizer's result is the tensor route's;
4. training: four AdamW steps of a small network through both routes give the same weights bit for bit, for
   every recipe whose operands take the kernel and the weight updates (stochastic, Kahan, nearest) it fuses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_speedpaths import _binade_sweep, _exponents
from torch import nn

import lowprec
import lowprec.optim
from lowprec import formats
from lowprec.quant import QuantSpec, _backend, _native, _native_group, _random
from lowprec.quant._elementwise import quantize_in_place
from lowprec.quant._scaled import fake_quantize_tensors
from lowprec.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler here: the native kernels are not built")

ROUNDINGS = ("nearest", "stochastic", "toward_zero")
KEYS = _random.key_tensor(20261203)


def _both(x: torch.Tensor, spec: QuantSpec, offset: int = 0) -> tuple[torch.Tensor | None, torch.Tensor]:
    off = _random.offset_tensor(offset)
    fast = _native_group.fake(x, spec, KEYS, off)
    with _backend.fast_paths(False):
        ref = fake_quantize_tensors(x, spec, keys=KEYS, offset=off)
    return fast, ref


def _sweep(fmt: formats.FormatSpec) -> torch.Tensor:
    strided = torch.arange(0, 1 << 32, 65521, dtype=torch.int64)
    strided = torch.where(strided >= 1 << 31, strided - (1 << 32), strided).to(torch.int32).view(torch.float32)
    rand = torch.randint(-(1 << 31), (1 << 31) - 1, (4096,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.int32).view(torch.float32)
    return torch.cat([*(_binade_sweep(e) for e in _exponents(fmt)), strided, rand])


ELEMENT_FORMATS = [n for n in formats.names() if formats.get(n).signed]  # E8M0 is never an element format


def test_every_element_format_takes_the_kernel() -> None:
    assert all(_native_group.plan(QuantSpec(elem=n, scaling="none")) is not None for n in ELEMENT_FORMATS)
    assert {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn", "bfloat16", "int8"} <= set(
        ELEMENT_FORMATS)
    assert _native_group.elementwise_spec(formats.get("float8_e8m0fnu"), "nearest", False) is None


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("saturate", [False, True])
def test_element_rounding_matches_the_kernel(name: str, rounding: str, saturate: bool) -> None:
    fmt = formats.get(name)
    spec = QuantSpec(elem=name, scaling="none", rounding=rounding, saturate=saturate)  # type: ignore[arg-type]
    x = _sweep(fmt)
    fast, ref = _both(x, spec, offset=12345)
    assert fast is not None  # scaling "none" handles NaN and inf itself
    assert_bitwise_equal(fast, ref, context=f"{name} {rounding} saturate={saturate}")


def _specs() -> list[QuantSpec]:
    out = []
    for name in QuantSpec.names():
        base = QuantSpec.named(name)
        variants = [base, dataclasses.replace(base, margin=2), dataclasses.replace(base, margin=-1)]
        if base.scaling != "tensor":
            variants += [dataclasses.replace(base, saturate=not base.saturate)]
        if not base.scale_spec.signed:
            variants += [dataclasses.replace(base, scale_rounding=r) for r in ("ceil", "nearest", "floor")]
        elif base.scale_spec.name != "float32":
            variants += [dataclasses.replace(base, scale_rounding=r) for r in ("floor", "ceil")]
        out += [dataclasses.replace(v, rounding=r) for v in variants for r in ROUNDINGS]  # type: ignore[arg-type]
    out += [QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=16, axis=0, scale_format="bfloat16"),
            QuantSpec(elem="float8_e5m2", scaling="axis", axis=0, scale_format="float8_e8m0fnu",
                      scale_rounding="ceil"),
            QuantSpec(elem="int8", scaling="axis", axis=-1),
            QuantSpec(elem="float6_e3m2fn", scaling="tile", tile=(4, 8), scale_format="float8_e4m3fn")]
    return list(dict.fromkeys(out))


SPECS = _specs()


def _varied(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Magnitudes spanning 2^-60 .. 2^60 with whole zero rows, a subnormal row and a row near float32's max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-60, 60, shape, generator=g).float())
    flat = x.view(-1, shape[-1])
    flat[0] = 0.0
    if flat.shape[0] > 2:
        flat[1] = torch.randn(shape[-1], generator=g) * 1e-40
        flat[2] = torch.randn(shape[-1], generator=g) * 1e37
    flat.view(-1)[5:9] = torch.tensor([-0.0, 0.0, 1e-45, -3e38])
    return x


SHAPES = [(64, 96), (37, 100), (130, 200), (3, 5, 40), (257,)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_scaled_specs_match_the_kernel(spec: QuantSpec) -> None:
    if _native_group.plan(spec) is None:
        pytest.skip("the kernel does not take this spec (the tensor route runs)")
    for i, shape in enumerate(SHAPES):
        x = _varied(shape, i)
        cases = [x, x.to(torch.bfloat16)]
        if x.dim() == 2:
            cases += [x.t(), x.t().to(torch.bfloat16)]
        if spec.scaling == "tile" and x.dim() < 2:
            continue
        for t in cases:
            fast, ref = _both(t, spec, offset=i * 1000)
            assert fast is not None, (spec, shape)
            assert fast.stride() == ref.stride() and fast.dtype == ref.dtype
            assert_bitwise_equal(fast, ref, context=f"{spec} {tuple(t.shape)} stride {t.stride()} {t.dtype}")


def test_cached_single_calls_follow_spec_identity_and_layout() -> None:
    """The single-call path caches each (spec, shape, strides)'s kernel arguments (``_native_group._one_call``):
    alternating specs, shapes and a transposed view keep the tensor route's bits, and a cache entry found under a
    spec's id but made for another spec object (an id reused after garbage collection) is not used."""
    mx, nv = QuantSpec.named("mxfp8_e4m3"), QuantSpec.named("nvfp4")
    xs = [_varied((64, 96), 1), _varied((32, 64), 2), _varied((96, 64), 3).t()]
    for _ in range(2):
        for spec in (mx, nv, mx):
            for x in xs:
                fast, ref = _both(x, spec, offset=11)
                assert fast is not None
                assert fast.stride() == ref.stride()
                assert_bitwise_equal(fast, ref, context=f"{spec} {tuple(x.shape)} {x.stride()}")
    x = xs[0]
    stale = _native_group._one_calls.calls[(id(mx), x.shape, x.stride())]
    _native_group._one_calls.calls[(id(nv), x.shape, x.stride())] = stale  # as if nv had mx's old id
    fast, ref = _both(x, nv)
    assert_bitwise_equal(fast, ref, context="entry of another spec object under this id")
    assert _native_group._one_calls.calls[(id(nv), x.shape, x.stride())].spec is nv


def test_every_named_spec_takes_the_kernel() -> None:
    assert all(_native_group.plan(QuantSpec.named(n)) is not None for n in QuantSpec.names())


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3_rowwise", "fp8_e4m3_128x128"])
def test_nonfinite_groups_decline_and_the_quantizer_keeps_the_tensor_route(name: str) -> None:
    spec = QuantSpec.named(name)
    x = _varied((64, 256), 7)
    x[3, 40], x[9, 200] = float("nan"), float("-inf")
    fast, _ = _both(x, spec)
    assert fast is None
    with _backend.fast_paths(False):
        ref = lowprec.quant.fake_quantize(x, spec)
    assert_bitwise_equal(lowprec.quant.fake_quantize(x, spec), ref, context=name)


def test_other_layouts_are_copied_and_keep_the_input_strides() -> None:
    x = _varied((4, 6, 64), 3).permute(2, 0, 1)  # neither contiguous nor a 2-D transpose
    spec = QuantSpec.named("mxfp8_e4m3")
    out = lowprec.quant.fake_quantize(x, spec)
    with _backend.fast_paths(False):
        ref = lowprec.quant.fake_quantize(x, spec)
    assert_bitwise_equal(out, ref) and out.stride() == ref.stride()  # type: ignore[func-returns-value]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(64, 96), nn.Linear(96, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _train(recipe: str, fast: bool, steps: int) -> list[torch.Tensor]:
    """``steps`` AdamW steps of ``_Net`` converted to ``recipe``, with the fast paths and native kernels on or off:
    the weights and the optimizer's Kahan compensation buffers."""
    torch.manual_seed(0)
    model = lowprec.convert(_Net(), recipe)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    opt = lowprec.optim.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    with _native.enabled(fast), _backend.fast_paths(fast):
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()] + list(opt.compensation.values())


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp6", "mxfp4", "nvfp4",
                                    "b200-mxfp8", "bf16-kahan", "bf16-sr", "bf16-pure"])
def test_training_through_both_routes_gives_the_same_weights(recipe: str) -> None:
    for i, (a, b) in enumerate(zip(_train(recipe, True, 4), _train(recipe, False, 4), strict=True)):
        assert_bitwise_equal(a, b, context=f"{recipe} tensor {i}")


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_unscaled_operand_specs_take_the_float_route_with_the_kernels_bits(fmt: str, saturate: bool) -> None:
    """An unscaled round-to-nearest spec (the bf16 / fp16 recipes' GEMM operands) quantized by ``_eager_fast``:
    the float route where every value is finite and in range, the grouped kernel where NaN, inf or overflow is
    present; both against the tensor route, with values past max in the second case."""
    spec = QuantSpec(elem=fmt, scaling="none", saturate=saturate)
    x = _varied((64, 96), 3)
    in_range = x.clamp(-formats.get(fmt).max, formats.get(fmt).max)
    special = in_range.clone()
    special.view(-1)[7:10] = torch.tensor([float("nan"), float("-inf"), 3e38])
    for t in (in_range, special, in_range.t()):
        got = fake_quantize_tensors(t, spec)
        with _backend.fast_paths(False):
            want = fake_quantize_tensors(t, spec)
        assert_bitwise_equal(got, want, context=f"{fmt} saturate={saturate} {t.stride()}")


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("fmt", ["bfloat16", "tf32", "float16", "float8_e4m3fn", "int8"])
def test_rounding_in_place_matches_the_tensor_route(fmt: str, rounding: str) -> None:
    """``quantize_in_place`` (the optimizer's weight updates) against ``quantize`` with the fast paths off.
    Stochastic: the formats with float32's exponent range take the kernel's short loop (``seg_sr_wide``), the
    others the general one, over values past the format's largest (overflow), inf, NaN, signed zeros, float32
    subnormals and a counter offset.  Nearest: the float route in place (finite values; a NaN makes it decline and
    leave the tensor unchanged), except bfloat16 and float16, whose one-pass kernels take every value (overflow,
    inf and NaN too).  A transposed tensor is declined and left unchanged."""
    spec = formats.get(fmt)
    x = _varied((300, 77), 5)
    specials = [-0.0, -1e-40, 1e-45]
    every_value = rounding == "stochastic" or fmt in ("bfloat16", "float16")
    if every_value:
        specials += [spec.max, -spec.max, 3.3999e38, float("inf"), float("nan")]
    else:  # the float route in place takes values the format holds, below 2^100 (v + C stays finite)
        x = x.clamp(-min(spec.max, 2.0**100), min(spec.max, 2.0**100))
        specials += [min(spec.max, 2.0**100), -min(spec.max, 2.0**100) / 3]
    x.view(-1)[20:20 + len(specials)] = torch.tensor(specials)
    with _backend.fast_paths(False):
        want = lowprec.quantize(x, fmt, rounding=rounding, seed=1234, offset=77)  # type: ignore[arg-type]
    got = x.clone()
    done = quantize_in_place(got, spec, rounding, 1234, 77)
    assert done == (rounding == "stochastic" or fmt != "int8")
    assert_bitwise_equal(got, want if done else x, context=fmt)
    for declined in (x.t(), torch.where(torch.arange(x.numel()).view(x.shape) == 9, float("nan"), x)):
        before = declined.clone()
        if (rounding == "nearest" and not every_value) or not declined.is_contiguous():
            assert not quantize_in_place(declined, spec, rounding, 1234, 77)
            assert_bitwise_equal(declined, before, context=f"{fmt} declined")
        elif rounding == "nearest":  # bfloat16, float16: the NaN is taken and kept, the rest rounded
            with _backend.fast_paths(False):
                want = lowprec.quantize(declined, fmt)
            assert quantize_in_place(declined, spec, rounding, 1234, 77)
            assert_bitwise_equal(declined, want, context=f"{fmt} with a NaN")


def _kahan_by_tensors(p: torch.Tensor, old: torch.Tensor, c: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """The Kahan update of ``lowprec.optim`` by tensor operations (the optimizer's fallback lines)."""
    with _backend.fast_paths(False):
        y = (p - old) - c
        t = lowprec.quantize(old + y, fmt)
        return t, lowprec.quantize((t - old) - y, fmt)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8"])
def test_kahan_update_matches_the_tensor_operations(fmt: str) -> None:
    """The fused update (lp_kahan_update) against the tensor lines, in pieces of 1024 that take its vectorized
    route (every value finite and at most fmax / 4) and pieces that take the route with the special-value rules:
    values just below and above fmax / 4, overflow of old + y past fmax, inf and NaN, signed zeros, subnormals,
    small updates that round away (the compensation then carries them) and updates of whole steps."""
    spec = formats.get(fmt)
    g = torch.Generator().manual_seed(7)
    n = 1024 * 8
    old = lowprec.quantize(torch.randn(n, generator=g) * spec.max / 64, fmt)
    step = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 2, (n,), generator=g).float())
    p = old + step * old.abs().clamp_min(2.0**-20)
    c = lowprec.quantize(torch.randn(n, generator=g) * spec.max * 2.0**-12, fmt)
    quarter = spec.max / 4
    p[1024:1030] = torch.tensor([quarter, -quarter, quarter * 1.0001, 0.0, -0.0, 1e-42])  # the bound, both sides
    old[2048:2052] = torch.tensor([spec.max, -spec.max, spec.max, 0.0])  # old + y past fmax
    p[2048:2052] = torch.tensor([spec.max * 3, -spec.max * 0.9, -spec.max * 3, -0.0])
    p[3072], old[3073], c[3074] = float("inf"), float("nan"), float("-inf")
    p[4096:4104] = old[4096:4104]  # no update at all
    want_p, want_c = _kahan_by_tensors(p, old, c, fmt)
    got_p, got_c = p.clone(), c.clone()
    assert _native_group.kahan_update(got_p, old, got_c, spec)
    assert_bitwise_equal(got_p, want_p, context=f"{fmt} weights")
    assert_bitwise_equal(got_c, want_c, context=f"{fmt} compensation")


def test_kahan_bfloat16_bit_route_over_every_binade() -> None:
    """bfloat16's vectorized Kahan pieces round on the bits (bf16_rne in _native_group.c): against the tensor lines
    on weights of every binade from bfloat16's smallest subnormal (2^-133) to 2^120, each updated by k half-steps
    (k = -3 .. 3: the odd k make old + y an exact tie between two bfloat16 neighbours, the even ones land on the
    grid) with a compensation of up to a quarter step, both signs."""
    g = torch.Generator().manual_seed(11)
    e = torch.arange(-133, 121).repeat_interleave(64)  # 254 binades x 64 weights
    n = e.numel()
    mant = 1.0 + torch.randint(0, 128, (n,), generator=g).float() / 128  # on bfloat16's grid
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    old = sign * mant * torch.exp2(e.float())
    old = torch.where(e < -126, sign * torch.randint(1, 128, (n,), generator=g).float() * 2.0**-133, old)
    half = torch.exp2(torch.clamp(e, min=-126).float() - 8)  # half a bfloat16 step at old's exponent
    k = torch.randint(-3, 4, (n,), generator=g).float()
    p = old + k * half
    c = lowprec.quantize(torch.randn(n, generator=g) * half * 0.5, "bfloat16")
    c[::3] = 0.0
    pad = (-n) % 1024
    p, old, c = (torch.cat([t, torch.ones(pad)]) for t in (p, old, c))
    spec = formats.get("bfloat16")
    assert max(float(t.abs().max()) for t in (p, old, c)) <= spec.max / 4  # every piece takes the bit route
    want_p, want_c = _kahan_by_tensors(p, old, c, "bfloat16")
    got_p, got_c = p.clone(), c.clone()
    assert _native_group.kahan_update(got_p, old, got_c, spec)
    assert_bitwise_equal(got_p, want_p, context="bfloat16 weights")
    assert_bitwise_equal(got_c, want_c, context="bfloat16 compensation")
    assert not torch.equal(want_p, old) and bool((want_c != 0).any())  # updates applied, errors carried


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float8_e4m3fn", "int8"])
def test_stochastic_quantize_matches_the_kernel(fmt: str) -> None:
    x = _varied((300, 77), 11)
    for t in (x, x.t(), x.to(torch.bfloat16)):
        fast = lowprec.quantize(t, fmt, rounding="stochastic", seed=99, offset=5)
        with _backend.fast_paths(False):
            ref = lowprec.quantize(t, fmt, rounding="stochastic", seed=99, offset=5)
        assert_bitwise_equal(fast, ref, context=f"{fmt} {t.dtype} {t.stride()}")


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_integer_elements_at_exact_ties_and_the_code_range_ends(rounding: str) -> None:
    """MX INT8 blocks whose power-of-two scale is 1 (amax 1.5): every half-step tie j/64 + 1/128 between the codes,
    the ends -2 and 127/64 and beyond them, and signed zeros (the kernel's integer float route, round to nearest)."""
    ties = (torch.arange(-140, 140, dtype=torch.float32) + 0.5) / 64
    ends = torch.tensor([-2.0, -2.0 - 1 / 128, -2.5, 127 / 64, 127 / 64 + 1 / 128, 2.1, -0.0, 0.0, -1 / 256])
    vals = torch.cat([ties, ends, ties * -1])
    blocks = vals[: vals.numel() // 31 * 31].view(-1, 31)
    x = torch.cat([torch.full((blocks.shape[0], 1), 1.5), blocks], dim=1).contiguous()
    spec = dataclasses.replace(QuantSpec.named("mxint8"), rounding=rounding)  # type: ignore[arg-type]
    fast, ref = _both(x, spec)
    assert fast is not None
    assert_bitwise_equal(fast, ref, context=f"mxint8 {rounding} ties")
