"""The training speed paths give the bits of the paths they replace.

* Eager round-to-nearest by float32 arithmetic (``_elementwise.round_nearest_fast``).  Oracle: the integer kernel
  ``_round.quantize_f32`` (itself checked against ml_dtypes and torch casts elsewhere), over every float32 whose
  top 14 mantissa bits run through all values (with several low-bit patterns) in every binade around the
  format's subnormal range, its largest binades and a few in between, both signs, plus random bit patterns.
  Through the public quantizers the oracle is the same call with the fast paths turned off
  (``lowprec.quant._backend.fast_paths(False)``).  Each comparison runs twice: through the fused C loop
  (``lowprec.quant._native``, built with the system compiler) and through the tensor-operation route.
* One input quantization shared by sibling linears that read the same tensor (attention's q, k, v:
  ``_linear._SharedInput``).  Oracle: the same model with the sharing turned off; an input changed in place
  between the calls is quantized again.
* One quantization per tensor shared between GEMMs (``_linear.shares_quantization``).  Oracle: the per-GEMM
  implementation (every operand quantized for its own GEMM, ``_linear.gemm``), obtained by making
  ``shares_quantization`` answer False; forward output and both gradients over several training steps compared
  bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowprec
import lowprec.nn._linear as lin_mod
from lowprec import formats
from lowprec.quant import QuantSpec, _backend, _native, _native_group
from lowprec.quant._elementwise import fast_round_ok, one_pass_ieee, round_nearest_fast, route_constants
from lowprec.quant._round import quantize_f32
from lowprec.quant._scaled import fake_quantize_tensors
from lowprec.testing import assert_bitwise_equal

FAST_FORMATS = [n for n in formats.names() if fast_round_ok(formats.get(n), "nearest")]


@pytest.fixture(params=["native", "tensor-ops"])
def route(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Run the test through the fused C kernels and again through the tensor operations they replace."""
    if request.param == "native" and not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built (the tensor-ops route is tested)")
    with _native.enabled(request.param == "native"):
        yield request.param


def _binade_sweep(exponent: int) -> torch.Tensor:
    """float32 values of one binade (biased exponent ``exponent + 127``; -127 = zero and subnormals), both signs:
    all 2^14 top-mantissa patterns times low 9-bit patterns {0, 1, 0xFF, 0x100, 0x1FF} (exact ties for every
    rounding position of formats with up to 13 mantissa bits, and their neighbours)."""
    hi = torch.arange(1 << 14, dtype=torch.int64) << 9
    lo = torch.tensor([0, 1, 0xFF, 0x100, 0x1FF], dtype=torch.int64)
    mant = (hi[:, None] | lo[None, :]).reshape(-1)
    bits = mant | ((exponent + 127) << 23)
    bits = torch.cat([bits, bits | (1 << 31)])
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _exponents(fmt: formats.FormatSpec) -> list[int]:
    sub = range(max(fmt.emin - fmt.mbits - 3, -126), fmt.emin + 2)
    top = range(max(fmt.emax - 1, -126), min(fmt.emax + 2, 128))
    return sorted({-127, 0, 1, *sub, *top} - {128})


@pytest.mark.parametrize("name", FAST_FORMATS)
@pytest.mark.parametrize("saturate", [False, True])
def test_round_nearest_fast_matches_kernel(route: str, name: str, saturate: bool) -> None:
    fmt = formats.get(name)
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    rand = rand.view(torch.float32)
    rand = torch.where(torch.isfinite(rand), rand, 0.0)
    cases = [_binade_sweep(e) for e in _exponents(fmt)] + [rand * float(2.0 ** -100), rand]
    checked = 0
    for v in cases:
        got = round_nearest_fast(v, fmt, saturate=saturate)
        expected = quantize_f32(v, fmt, rounding="nearest", saturate=saturate, rbits=None)
        if got is None:  # only where the values overflow without saturation or C would overflow
            assert not saturate or v.abs().max() >= 2.0 ** (126 - (24 - fmt.mbits)), name
            continue
        assert_bitwise_equal(got, expected, context=f"{name} saturate={saturate}")
        checked += 1
    assert checked >= 3


def _bf16_patterns(low_bits: list[int]) -> torch.Tensor:
    """Every float32 whose high 16 bits run through all 2^16 values (every sign, exponent and bfloat16 mantissa:
    zeros, subnormals, the largest finite, inf, every NaN payload high half) with each given low half."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = (hi[:, None] | torch.tensor(low_bits, dtype=torch.int64)[None, :]).reshape(-1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


_BF16_LOW = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # exact, just above, just below, at and past the tie, max


def _one_pass(v: torch.Tensor, fmt: formats.FormatSpec, saturate: bool, out: torch.Tensor | None) -> torch.Tensor:
    if fmt.name == "bfloat16":
        return _native.round_bf16(v, saturate=saturate, out=out)
    k, cmin = route_constants(fmt)
    return _native.round_ieee(v, k=k, cmin=cmin, fmax=fmt.max, saturate=saturate, out=out)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e5m2"])
@pytest.mark.parametrize("saturate", [False, True])
def test_one_pass_kernels_match_integer_route_on_every_high_half(name: str, saturate: bool) -> None:
    """``_native.round_bf16`` and ``_native.round_ieee`` (one pass, no amax pass, NaN and inf taken too) against
    the integer kernel on 393,216 bit patterns that include every NaN high half, inf and every float32 exponent
    (overflow past the format's max among them), plus, for the narrower formats, whole binades around their
    subnormal range and their largest binades (every tie); a new tensor and in place; and through the public
    ``quantize`` and ``round_nearest_fast``."""
    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    fmt = formats.get(name)
    assert name == "bfloat16" or one_pass_ieee(fmt)
    v = _bf16_patterns(_BF16_LOW)
    if name != "bfloat16":
        v = torch.cat([v, *(_binade_sweep(e) for e in _exponents(fmt))])
    expected = quantize_f32(v, fmt, rounding="nearest", saturate=saturate, rbits=None)
    overflow = (v.abs() > fmt.max) & v.isfinite()
    assert bool(torch.isnan(v).any()) and bool(torch.isinf(v).any()) and bool(overflow.any())
    before = v.clone()
    assert_bitwise_equal(_one_pass(v, fmt, saturate, None), expected, context="new tensor")
    assert_bitwise_equal(v, before, context="input unchanged")
    w = v.clone()
    assert _one_pass(w, fmt, saturate, w) is w
    assert_bitwise_equal(w, expected, context="in place")
    assert_bitwise_equal(lowprec.quant.quantize(v, name, saturate=saturate), expected, context="quantize")
    got = round_nearest_fast(v, fmt, saturate=saturate)
    assert got is not None  # the one-pass kernels take non-finite values: never declined
    assert_bitwise_equal(got, expected, context="round_nearest_fast")


def test_bf16_one_pass_kernel_split_across_threads_matches() -> None:
    """A tensor of 2^22 elements goes through ``_parallel``'s split (two ranges on two threads): same bits."""
    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    v = _bf16_patterns(list(range(0x7FC0, 0x8000)))  # 2^16 x 64: the low halves just below the tie
    assert v.numel() >= 2 * lowprec.quant._parallel.PASS_MIN_PER_THREAD
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = _native.round_bf16(v, saturate=False)
    finally:
        torch.set_num_threads(threads)
    expected = quantize_f32(v, formats.get("bfloat16"), rounding="nearest", saturate=False, rbits=None)
    assert_bitwise_equal(got, expected, context="split")


@pytest.mark.parametrize("recipe", ["bf16", "fp16-dynamic-loss-scale"])
def test_gemm_output_is_rounded_in_place_with_the_reference_bits(recipe: str) -> None:
    """The bf16 and fp16 recipes' GEMM output rounding (``product``) rounds the GEMM's fresh result in place: the
    bits of ``quantize(a @ b^T, format)``, NaN and inf from the GEMM (and, for fp16, overflow) included."""
    spec = lowprec.recipes.get(recipe).linear.forward
    assert spec.output_format is not None
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 48, generator=g), torch.randn(32, 48, generator=g)
    a[3, 7], a[5, 0], b[2, 1] = float("inf"), float("nan"), 3e38
    a[9] *= 3e4  # past float16's max in some outputs
    ref = a @ b.t()
    with _native.enabled(False):
        expected = lin_mod.product(a, b, spec)
    assert_bitwise_equal(expected, quantize_f32(ref, formats.get(spec.output_format), rounding="nearest",
                                                saturate=False, rbits=None), context="tensor route")
    assert bool(torch.isnan(expected).any()) and bool(torch.isinf(expected).any())
    assert_bitwise_equal(lin_mod.product(a, b, spec), expected, context="native in place")


def test_round_nearest_fast_declines_nonfinite_and_keeps_input(route: str) -> None:
    fmt = formats.get("float8_e4m3fn")
    v = torch.tensor([1.0, float("nan")])
    assert round_nearest_fast(v, fmt, saturate=True) is None
    assert round_nearest_fast(torch.tensor([float("inf")]), fmt, saturate=True) is None
    assert round_nearest_fast(torch.tensor([500.0]), fmt, saturate=False) is None  # e4m3fn overflows to NaN
    w = torch.tensor([500.0, -0.0, -1e-30, 3.3])
    before = w.clone()
    out = round_nearest_fast(w.t(), fmt, saturate=True)
    assert out is not None
    assert_bitwise_equal(w, before, context="input unchanged")
    assert_bitwise_equal(out, torch.tensor([448.0, -0.0, -0.0, 3.25]), context="values")


def test_native_route_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernels really run where they apply (contiguous float32 CPU tensors outside autograd), and not
    where they do not (a transposed view, a tensor that requires grad)."""
    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    calls: list[int] = []
    real, real_ieee = _native.round_nearest, _native.round_ieee
    monkeypatch.setattr(_native, "round_nearest", lambda x, **kw: calls.append(x.numel()) or real(x, **kw))
    monkeypatch.setattr(_native, "round_ieee", lambda x, **kw: calls.append(-x.numel()) or real_ieee(x, **kw))
    grouped: list[str] = []
    real_group = _native_group.fake
    monkeypatch.setattr(_native_group, "fake",
                        lambda x, spec, *a: grouped.append(spec.scaling) or real_group(x, spec, *a))
    x = torch.randn(64, 32)
    lowprec.quant.fake_quantize(x, "fp8_e4m3_tensorwise")
    lowprec.quantize(x, "float8_e5m2")
    assert calls == [x.numel(), -x.numel()] and grouped == []  # (float8_e5m2: the one-pass kernel)
    lowprec.quant.fake_quantize(x, "mxfp8_e4m3")  # any other spec: one call of the grouped kernel
    lowprec.quant.fake_quantize(x.t(), "nvfp4")
    assert grouped == ["block", "block"]
    lowprec.quantize(x.t(), "float8_e5m2")
    lowprec.quantize(x.clone().requires_grad_(), "float8_e5m2")
    assert len(calls) == 2


@pytest.mark.parametrize("spec", ["bfloat16", "float8_e5m2", "fp8_e4m3_tensorwise"])
def test_wrapper_subclass_takes_the_tensor_route(spec: str) -> None:
    """FSDP2's weight shard wrapper has no storage of its own (``data_ptr()`` is 0): the C kernels must not read it
    (they did, and crashed the process, when the optimizer put bf16-sr weights on their grid under FSDP2).
    Oracle: the same values as a plain tensor."""
    from lowprec.distributed._fsdp_gather import GatherStats, LowpGatherWeight

    x = torch.randn(64, 32)
    wrapped = LowpGatherWeight(x.clone(), QuantSpec.named("fp8_e4m3_tensorwise"), GatherStats())
    assert wrapped.data_ptr() == 0 and not _native.usable(wrapped) and not _native.usable(nn.Parameter(wrapped))
    assert _native.usable(nn.Parameter(x, requires_grad=False)) == _native.available()
    fq = lowprec.quant.fake_quantize if spec.endswith("tensorwise") else lowprec.quantize
    with torch.no_grad():
        got = fq(wrapped, spec)
    assert_bitwise_equal(got._tensor if isinstance(got, LowpGatherWeight) else got, fq(x, spec), context=spec)


def _varied(shape: tuple[int, ...], seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e-42, 6.0, -7.0])
    if special:
        flat[6:8] = torch.tensor([float("nan"), float("inf")])
    return x


SPECS: list[str | QuantSpec] = [
    "fp8_e4m3_tensorwise",
    "fp8_e5m2_tensorwise",
    "fp8_e4m3_rowwise",
    "mxfp8_e4m3",
    "mxfp6_e3m2",
    "mxfp4",
    "nvfp4",
    "fp8_e4m3_1x128",
    QuantSpec(elem="float8_e4m3fnuz", scaling="tensor"),
    QuantSpec(elem="bfloat16", scaling="none"),
    QuantSpec(elem="float8_e5m2", scaling="tensor", saturate=False, margin=-3),
    QuantSpec(elem="float8_e5m2", scaling="block", block_size=32, axis=0, scale_format="float8_e8m0fnu",
              scale_rounding="ceil"),
]


def _fast_and_reference(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    fast = fn(*args, **kwargs)
    with _backend.fast_paths(False):
        ref = fn(*args, **kwargs)
    return fast, ref


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_fast_matches_kernel(
    route: str, spec: str | QuantSpec, special: bool, dtype: torch.dtype
) -> None:
    x = _varied((48, 100), 1, special).to(dtype)
    for t in (x, x.t()):
        fast, ref = _fast_and_reference(lowprec.quant.fake_quantize, t, spec)
        assert_bitwise_equal(fast, ref, context=f"{spec} special={special} {dtype}")
        assert fast.stride() == ref.stride()


@pytest.mark.parametrize("saturate", [False, True])
def test_tensorwise_fast_matches_kernel(route: str, saturate: bool) -> None:
    """Tensorwise float32 scales with margins, all-zero and tiny tensors, and explicit (delayed) amaxes from zero to
    far below the tensor's own (scaled values overflow the format)."""
    x = _varied((32, 64), 2, False)
    for elem in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"):
        for margin in (0, 2, -2):
            spec = QuantSpec(elem=elem, scaling="tensor", saturate=saturate, margin=margin)
            for amax in (0.0, 1e-45, 1e-3, 1.0, 1e30):
                fast, ref = _fast_and_reference(fake_quantize_tensors, x, spec, amax=torch.tensor(amax))
                assert_bitwise_equal(fast, ref, context=f"{elem} amax={amax} margin={margin} saturate={saturate}")
            for t in (x, x.t(), x * 1e-38, torch.zeros(3, 5), -torch.zeros(3, 5)):
                fast, ref = _fast_and_reference(fake_quantize_tensors, t, spec)
                assert_bitwise_equal(fast, ref, context=f"{elem} margin={margin} saturate={saturate}")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float6_e2m3fn"])
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("special", [False, True])
def test_quantize_fast_matches_kernel(route: str, fmt: str, saturate: bool, special: bool) -> None:
    x = _varied((40, 70), 4, special)
    for t in (x, x * 1e3, x.to(torch.float16)):
        fast, ref = _fast_and_reference(lowprec.quantize, t, fmt, saturate=saturate)
        assert_bitwise_equal(fast, ref, context=f"{fmt} saturate={saturate}")


# ------------------------------------------------------------------------------------------ shared quantization
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 16, bias=False)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    """Outputs and all gradients of ``steps`` SGD steps (fixed inputs per step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    got: list[torch.Tensor] = []
    for i in range(steps):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(6, 5, 24, generator=g) * (1 + 10 * i)
        x.requires_grad_(True)
        out = model(x)
        (out.square().sum() + out.sum()).backward()
        got += [out.detach().clone(), x.grad.clone()]
        got += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return got


def _unshared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lin_mod, "shares_quantization", lambda first, second: False)
    import lowprec.nn.functional as fn_mod

    monkeypatch.setattr(fn_mod, "shares_quantization", lambda first, second: False)


RECIPES = ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8", "nvfp4", "bf16", "bf16-sr", "mi300-fp8", "fp32"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fast", [True, False])
def test_shared_quantization_matches_per_gemm(recipe: str, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    base = _Net()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    lowprec.convert(a, recipe)
    lowprec.convert(b, recipe)
    with _backend.fast_paths(fast):
        shared = _train(a, 3)
        _unshared(monkeypatch)
        per_gemm = _train(b, 3)
    assert len(shared) == len(per_gemm)
    for i, (s, p) in enumerate(zip(shared, per_gemm, strict=True)):
        assert_bitwise_equal(s, p, context=f"{recipe} tensor {i}")


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "nvfp4"])
def test_shared_quantization_matmul_matches_per_gemm(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    a0 = torch.randn(3, 1, 7, 20, generator=g)
    b0 = torch.randn(4, 20, 9, generator=g)

    def run() -> list[torch.Tensor]:
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        out = lowprec.nn.functional.matmul(a, b, recipe, seed=3)
        (out * out).sum().backward()
        return [out.detach(), a.grad, b.grad]  # type: ignore[list-item]

    shared = run()
    _unshared(monkeypatch)
    for s, p in zip(shared, run(), strict=True):
        assert_bitwise_equal(s, p, context=recipe)


class _Siblings(nn.Module):
    """Three linears reading one tensor, as attention's q, k and v do, then one reading another tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(24, 24) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.tanh()
        return self.o(self.q(h) * self.k(h) + self.v(h))


# forward input quantizations per step of _Siblings: 2 where q, k, v share one (round-to-nearest, current scaling,
# and Q(x) kept alive for backward because grad_weight reuses it), else 4
SIBLING_CALLS = {"fp8-tensorwise": 2, "bf16": 2, "mxfp8": 4, "fp8-delayed": 4, "nvfp4": 4}


@pytest.mark.parametrize("recipe", list(SIBLING_CALLS))
def test_sibling_linears_share_input_quantization(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k, v quantize their common input once where that gives the same bits (round-to-nearest, current
    scaling, a saved Q(x)); oracle: the same steps with the sharing turned off (each linear quantizes its own
    input).  mxfp8 shares nothing: its forward Q(x) (blocks along K) is not the grad_weight operand (blocks along
    the batch), so it is not saved and is gone before k runs; delayed scaling has one amax per module; nvfp4's
    input is round-to-nearest but its blocks are not saved either."""
    torch.manual_seed(0)
    base = _Siblings()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    lowprec.convert(a, recipe)
    lowprec.convert(b, recipe)
    calls: list[tuple[int, ...]] = []
    real = lin_mod.quantize_operand

    def counting(t, spec, name, which, keys, amax):  # type: ignore[no-untyped-def]
        if (name, which) == ("forward", "a"):
            calls.append(tuple(t.shape))
        return real(t, spec, name, which, keys, amax)

    monkeypatch.setattr(lin_mod, "quantize_operand", counting)
    shared = _train(a, 3)
    assert len(calls) == 3 * SIBLING_CALLS[recipe], (recipe, calls)
    monkeypatch.setattr(lin_mod._SharedInput, "cacheable", staticmethod(lambda x, op, amax: False))
    for i, (s, p) in enumerate(zip(shared, _train(b, 3), strict=True)):
        assert_bitwise_equal(s, p, context=f"{recipe} tensor {i}")


def test_shared_input_is_requantized_after_an_in_place_change() -> None:
    """The reuse is keyed on the tensor object and its version counter: after ``h.mul_`` the next sibling
    quantizes the new values (oracle: a fresh tensor with those values through the same linear)."""
    torch.manual_seed(0)
    m = lowprec.convert(_Siblings(), "fp8-tensorwise")
    h = torch.randn(5, 24)
    kept = m.q(h)  # its graph keeps Q(h) alive, so k could reuse it
    assert kept.requires_grad
    with torch.no_grad():
        h.mul_(1000.0)  # new values and amax: a reused Q(h) would be the old ones, 1000 times too small
    assert_bitwise_equal(m.k(h), m.k(h.clone()), context="k after the in-place change")


def test_shares_quantization_rules() -> None:
    lin = lowprec.recipes.get("fp8-tensorwise").linear
    share = lin_mod.shares_quantization
    assert share(lin.forward.a, lin.grad_weight.b) and share(lin.forward.b, lin.grad_input.b)
    assert share(lin.grad_input.a, lin.grad_weight.a)
    assert not share(lin.forward.a, lin.grad_input.a)  # e4m3 vs e5m2
    row = lowprec.recipes.get("fp8-rowwise").linear
    assert not share(row.forward.a, row.grad_weight.b)  # per-row scales group x and x^T differently
    sr = lowprec.recipes.get("nvfp4").linear
    assert not share(sr.grad_input.a, sr.grad_weight.a)  # stochastic: each GEMM draws its own bits
    fp32 = lowprec.recipes.get("fp32").linear
    assert share(fp32.forward.a, fp32.grad_weight.b)


def test_saved_input_is_quantized_input() -> None:
    """fp8-tensorwise saves Q(x) (not x) for grad_weight; oracle: fake_quantize of x with the input spec."""
    torch.manual_seed(0)
    lin = lowprec.nn.EmulatedLinear.from_linear(nn.Linear(16, 8), lowprec.recipes.get("fp8-tensorwise").linear)
    x = torch.randn(4, 16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lin(x)
    expected = lowprec.quant.fake_quantize(x.detach(), lin.recipe.forward.a.spec)  # type: ignore[arg-type]
    assert any(t.shape == x.shape and torch.equal(t, expected) for t in saved)
    assert not any(t.shape == x.shape and torch.equal(t, x.detach()) for t in saved)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "nvfp4"])
def test_skipped_input_gradient_keeps_weight_gradient(recipe: str) -> None:
    """A first layer's input needs no gradient, so its grad_input GEMM is skipped; the weight gradient keeps its
    bits (oracle: the same step with the input requiring a gradient)."""
    torch.manual_seed(0)
    base = _Net()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    lowprec.convert(a, recipe)
    lowprec.convert(b, recipe)
    x = torch.randn(6, 24)
    a(x).square().sum().backward()
    b(x.clone().requires_grad_(True)).square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert_bitwise_equal(pa.grad, pb.grad, context=f"{recipe} {name}")  # type: ignore[arg-type]


def test_compiled_region_calls_the_fused_kernel_with_eager_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside torch.compile, tensorwise fake quantization runs as the opaque custom op
    ``lowprec::fake_quantize_tensorwise`` (the fused C loop is called at run time) and gives the eager bits
    (oracle: the same call outside torch.compile), with the tensor's own amax and with a delayed amax."""
    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    calls: list[int] = []
    real = _native.round_nearest
    monkeypatch.setattr(_native, "round_nearest", lambda x, **kw: calls.append(x.numel()) or real(x, **kw))
    spec = QuantSpec.named("fp8_e4m3_tensorwise")
    x = _varied((32, 48), 9, False)
    amax = torch.tensor(3.0)
    torch._dynamo.reset()
    fn = torch.compile(lambda t, a: (fake_quantize_tensors(t, spec), fake_quantize_tensors(t, spec, amax=a)),
                       fullgraph=True)
    got = fn(x, amax)
    assert len(calls) == 2
    assert_bitwise_equal(got[0], fake_quantize_tensors(x, spec), context="own amax")
    assert_bitwise_equal(got[1], fake_quantize_tensors(x, spec, amax=amax), context="delayed amax")


@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
# dynamo reads .grad of a non-leaf while tracing the delayed-scaling buffers' updates (PyTorch's warning)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_compiled_backward_requantizes_saved_activations_with_eager_bits(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile an activation that needs a gradient is saved unquantized and quantized again in
    backward (so that the ReLU mask before it is not saved as a slow bool store): the compiled backward runs one
    extra fused quantization per such layer, and the loss and every gradient keep the eager bits (oracle: the same
    step without torch.compile, which saves Q(x)).  No biases: inductor sums a bias gradient in another order than
    eager PyTorch even without lowprec (tests/test_nn_convert.py)."""
    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(24, 40, bias=False), nn.ReLU(), nn.Linear(40, 16, bias=False), nn.ReLU(),
                         nn.Linear(16, 8, bias=False))
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    lowprec.convert(eager, recipe)
    lowprec.convert(compiled, recipe)
    x = torch.randn(6, 24)
    ref = eager(x).square().sum()
    ref.backward()
    calls: list[int] = []
    real = _native.round_nearest
    monkeypatch.setattr(_native, "round_nearest", lambda t, **kw: calls.append(t.numel()) or real(t, **kw))
    torch._dynamo.reset()
    loss = torch.compile(compiled)(x).square().sum()
    n_forward = len(calls)
    loss.backward()
    # forward: each layer's x and W; backward: dY of each layer and the replayed inputs of layers 2 ([6, 40]) and
    # 3 ([6, 16]), which follow a ReLU; the first layer's input needs no gradient, so its saved Q(x) is kept
    assert [n for n, m in compiled.named_modules() if getattr(m, "input_after_mask", False)] == ["2", "4"]
    assert n_forward == 6 and sorted(calls[n_forward:]) == sorted([6 * 40, 6 * 16, 6 * 40, 6 * 16, 6 * 8]), calls
    assert_bitwise_equal(loss.detach(), ref.detach(), context=recipe)
    for (name, pa), pb in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert_bitwise_equal(pb.grad, pa.grad, context=f"{recipe} {name}")  # type: ignore[arg-type]


class _Counting(nn.Module):
    """A ReLU that counts its calls: converting must not run it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(x)


def test_convert_marks_linears_after_relu_like_modules_without_running_the_model() -> None:
    """``convert`` marks exactly the emulated linears that directly follow a ReLU-like activation module in an
    ``nn.Sequential`` (oracle: the models' layout, read by hand), and runs none of the model's code."""
    counting = _Counting()
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8),
                        nn.Sequential(nn.LeakyReLU(), nn.Linear(8, 8)), counting, nn.Linear(8, 8),
                        nn.Hardtanh(), nn.Linear(8, 4))
    lowprec.convert(seq, "fp8-tensorwise")
    assert {n for n, m in seq.named_modules() if getattr(m, "input_after_mask", False)} == {"2", "5.1", "9"}
    assert counting.calls == 0


@pytest.mark.slow  # make test-slow: four compiled models, 15-25 s per recipe on 2 cores
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated")
@pytest.mark.parametrize("recipe", ["bf16", "fp16-dynamic-loss-scale"])
def test_traced_quantizers_save_no_relu_mask_and_keep_the_eager_bits(recipe: str) -> None:
    """bf16 / fp16 operands are quantized by traced code inside torch.compile (not the opaque operator): a linear
    after a ReLU still saves its input unquantized, so the compiled graph saves no bool mask (checked with
    saved-tensor hooks, and seen to appear when the linears are not marked), and the loss and gradients keep the
    eager bits.  No biases (inductor sums a bias gradient in another order than eager PyTorch)."""
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(24, 40, bias=False), nn.ReLU(), nn.Linear(40, 16, bias=False), nn.ReLU(),
                         nn.Linear(16, 8, bias=False))
    x = torch.randn(6, 24)

    def run(model: nn.Module, compiled: bool) -> tuple[torch.Tensor, list[torch.dtype]]:
        saved: list[torch.dtype] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.dtype)
            return t

        torch._dynamo.reset()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = (torch.compile(model) if compiled else model)(x).square().sum()
        loss.backward()
        return loss.detach(), saved

    eager, compiled, unmarked = (lowprec.convert(copy.deepcopy(base), recipe) for _ in range(3))
    ref, _ = run(eager, False)
    loss, saved = run(compiled, True)
    assert torch.bool not in saved, saved
    assert_bitwise_equal(loss, ref, context=recipe)
    for (name, pa), pb in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert_bitwise_equal(pb.grad, pa.grad, context=f"{recipe} {name}")  # type: ignore[arg-type]
    for m in unmarked.modules():
        if hasattr(m, "input_after_mask"):
            m.input_after_mask = False
    _, saved_unmarked = run(unmarked, True)
    assert torch.bool in saved_unmarked  # the control: without the marks the partitioner saves ReLU's mask
