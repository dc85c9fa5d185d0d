"""Training numerics: delayed scaling, loss scaling, limited-precision accumulation, low-precision weight updates
and optimizer-state formats.

Oracles: hand computations from the documented rules (the amax history of ``_linear``, the tensorwise float32-scale
rule of ``QuantSpec``/docs/quantization.md, the ``LossScaler`` docstring); a pure-Python reference loop for the
accumulator model of ``_accum`` with its own round-to-nearest-even / truncation implemented with math.frexp and
math.ldexp; float32 PyTorch training as the reference for weight-update policies; exact small-number arithmetic for
optimizer steps.  ``lowprec.quantize(..., "float8_e4m3fn", saturate=True)`` and ``lowprec.quantize(t, fmt)`` serve
as element oracles (checked against ml_dtypes in test_quantize_nearest.py).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import lowprec
import lowprec.optim  # not imported by ``import lowprec``
from lowprec import QuantSpec
from lowprec.nn._accum import accumulate_matmul
from lowprec.optim import LossScaler, LowPrecisionOptimizer
from lowprec.recipes import (
    Accumulator,
    Gemm,
    LinearRecipe,
    LossScaling,
    Operand,
    OptimizerState,
    Recipe,
    Scaling,
)
from lowprec.testing import TOLERANCES, assert_bitwise_equal

# ================================================================================================ delayed scaling
E4M3_MAX = 448.0  # float8_e4m3fn: 1.75 * 2^8 (OCP FP8 spec)


def _fq_e4m3(t: torch.Tensor, amax: float) -> torch.Tensor:
    """Tensorwise e4m3 fake quantization with a float32 scale, written from the documented rule: multiplier
    ``m = fl32(448 / amax)``, codes ``Q_e4m3(x * m)`` saturated to +-448, value ``codes * fl32(1 / m)``."""
    m = torch.tensor(E4M3_MAX, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    codes = lowprec.quantize(t * m, "float8_e4m3fn", saturate=True)
    return codes * torch.reciprocal(m)


def _base_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values in (-0.9, 0.9) plus one element of magnitude exactly 1, so ``base * a`` has amax exactly ``a`` for a
    power of two ``a``."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.rand(rows, cols, generator=g) * 2 - 1) * 0.9
    base[rows // 2, cols // 3] = -1.0
    return base


def _delayed_linear(recipe: Recipe | str, k: int = 16, n: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return lowprec.convert(nn.Sequential(nn.Linear(k, n)), recipe)


def test_delayed_scaling_history_and_forward_by_hand() -> None:
    """fp8-delayed (history 16, max): feeding inputs with amax 1, 3, 2.5, 7, 0.375, 12, the input history after each
    step is the list of amaxes so far, newest first, zero-padded; the forward output equals fake-quantizing the
    input with the max of the PREVIOUS steps' amaxes (the current amax on the very first step) and the weight
    with its own amax, then ``xq @ wq.t() + b``.

    Oracle: the history written out by hand, and the documented tensorwise rule applied by ``_fq_e4m3``.  At steps
    1, 3 and 5 the input's amax exceeds the delayed one, so the largest elements saturate at 448 * scale; at steps
    2 and 4 the delayed scale is coarser than the current one.  No two amaxes differ by a power of two (which
    would give the same grid), and each step checks that current scaling would have given a different output, so
    the check cannot pass by accident.
    """
    model = _delayed_linear("fp8-delayed")
    lin = model[0]
    assert lin.amax_history_input.shape == (16,)
    W, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    w_amax = float(W.abs().max())
    base = _base_input(4, 16, seed=3)
    amaxes = [1.0, 3.0, 2.5, 7.0, 0.375, 12.0]
    expected_used = [1.0, 1.0, 3.0, 3.0, 7.0, 7.0]  # max of the previous amaxes; the current one at step 0
    for step, a in enumerate(amaxes):
        x = base * a
        assert float(x.abs().max()) == a
        with torch.no_grad():
            y = model(x)
        want = _fq_e4m3(x, expected_used[step]) @ _fq_e4m3(W, w_amax).t() + b
        assert_bitwise_equal(y, want, context=f"step {step}")
        if expected_used[step] != a:
            assert not torch.equal(_fq_e4m3(x, a), _fq_e4m3(x, expected_used[step]))
        hist = amaxes[: step + 1][::-1] + [0.0] * (16 - step - 1)
        assert lin.amax_history_input.tolist() == hist, f"input history after step {step}"
        assert lin.amax_history_weight.tolist() == [w_amax] * (step + 1) + [0.0] * (16 - step - 1)
        # Forward passes do not touch the grad_output history.
        assert lin.amax_history_grad_output.tolist() == [0.0] * 16


def test_delayed_scaling_window_of_sixteen() -> None:
    """The history keeps 16 steps: an amax of 50 at step 0 followed by inputs of amax 1 scales steps 1..16 with 50
    (it is still in the window of previous steps) and step 17 with 1 (it has dropped out).  Oracle: the window rule
    by hand; the expected outputs come from ``_fq_e4m3`` (and differ between the two scales)."""
    model = _delayed_linear("fp8-delayed", seed=1)
    lin = model[0]
    W, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    wq = _fq_e4m3(W, float(W.abs().max()))
    base = _base_input(3, 16, seed=4)
    assert not torch.equal(_fq_e4m3(base, 50.0), _fq_e4m3(base, 1.0))
    for step in range(19):
        a = 50.0 if step == 0 else 1.0
        used = 50.0 if step <= 16 else 1.0
        with torch.no_grad():
            y = model(base * a)
        assert_bitwise_equal(y, _fq_e4m3(base * a, used) @ wq.t() + b, context=f"step {step}")
    assert lin.amax_history_input.tolist() == [1.0] * 16


def test_delayed_scaling_most_recent_algorithm() -> None:
    """With ``algorithm="most_recent"`` (history 4) the scale comes from the previous step's amax only, not the
    max of the window (oracle: the Scaling docstring; amaxes 1, 6, 2.5, 3.5, 0.75 use 1, 1, 6, 2.5, 3.5)."""
    delayed = Scaling(kind="delayed", history_len=4, algorithm="most_recent")
    e4m3 = Operand(spec=QuantSpec.named("fp8_e4m3_tensorwise"), scaling=delayed)
    recipe = Recipe(name="most-recent", linear=LinearRecipe(forward=Gemm(a=e4m3)))
    model = _delayed_linear(recipe, seed=2)
    lin = model[0]
    W, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    base = _base_input(4, 16, seed=5)
    for step, (a, used) in enumerate(zip([1.0, 6.0, 2.5, 3.5, 0.75], [1.0, 1.0, 6.0, 2.5, 3.5], strict=True)):
        with torch.no_grad():
            y = model(base * a)
        assert_bitwise_equal(y, _fq_e4m3(base * a, used) @ W.t() + b, context=f"step {step}")
        if step >= 3:  # the "max" algorithm would still use 6 here
            assert not torch.equal(_fq_e4m3(base * a, used), _fq_e4m3(base * a, 6.0))
    assert lin.amax_history_input.tolist() == [0.75, 3.5, 2.5, 6.0]
    assert not hasattr(lin, "amax_history_weight")  # only delayed roles keep a history


def test_delayed_scaling_grad_output_history_and_backward() -> None:
    """Backward records the amax of each upstream gradient (once per backward, newest first) and does not record
    the input or weight again; grad_input of the first backward equals ``Q(dY) @ Q(W)`` with dY scaled by its own
    amax (e5m2, the first step) and W by its amax.  Oracle: hand-computed amaxes; the tensorwise rule with e5m2
    (max 57344) applied by hand."""
    model = _delayed_linear("fp8-delayed", k=16, n=8, seed=3)
    lin = model[0]
    W = lin.weight.detach().clone()
    x = _base_input(4, 16, seed=6).requires_grad_()
    gy = _base_input(4, 8, seed=7) * 2.0  # amax exactly 2
    model(x).backward(gy)
    assert lin.amax_history_grad_output.tolist() == [2.0] + [0.0] * 15
    assert lin.amax_history_input.tolist() == [1.0] + [0.0] * 15
    w_amax = float(W.abs().max())
    assert lin.amax_history_weight.tolist() == [w_amax] + [0.0] * 15
    m = torch.tensor(57344.0) / torch.tensor(2.0)
    gq = lowprec.quantize(gy * m, "float8_e5m2", saturate=True) * torch.reciprocal(m)
    # grad_input = dY @ W: operand b is W^T [K, N] (reduction dim last), its amax is W's.
    want_gx = gq @ _fq_e4m3(W.t().contiguous(), w_amax).t()
    assert_bitwise_equal(x.grad, want_gx, context="grad_input")
    model(x.detach()).backward(gy * 0.5)
    assert lin.amax_history_grad_output.tolist()[:3] == [1.0, 2.0, 0.0]


# ================================================================================================ loss scaling
def test_dynamic_loss_scaler_sequence_by_hand() -> None:
    """Dynamic loss scaling (init 1024, x2 after 3 consecutive finite steps, x0.5 on overflow): a sequence of
    outcomes gives the scale, good-step count and skipped-step count computed by hand from the ``_scaler``
    docstring."""
    s = LossScaler(LossScaling(kind="dynamic", init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=3))
    assert s.enabled and s.scale == 1024.0
    outcomes = [True, True, True, True, False, True, True, False, False, True, True, True, True]
    # hand: grow on the 3rd consecutive good step (counter resets), halve on every overflow (counter resets)
    scales = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 512, 256, 256, 256, 512, 512]
    goods = [1, 2, 0, 1, 0, 1, 2, 0, 0, 1, 2, 0, 1]
    skipped = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3]
    for i, ok in enumerate(outcomes):
        s.update(ok)
        assert (s.scale, s.good_steps, s.skipped_steps) == (scales[i], goods[i], skipped[i]), f"after step {i}"


def test_loss_scaler_other_factors_and_kinds() -> None:
    """Non-default factors (x4 growth every 2 steps, x0.25 back-off), static scaling (fixed scale, non-finite steps
    still counted as skipped) and "none" (scale 1, the loss returned unchanged).  Oracle: hand computation."""
    s = LossScaler(LossScaling(kind="dynamic", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25,
                               growth_interval=2))
    for ok in (True, True, False, True):
        s.update(ok)
    assert s.scale == 8.0 * 4 * 0.25 and s.good_steps == 1 and s.skipped_steps == 1
    st = LossScaler(LossScaling(kind="static", init_scale=512.0))
    for ok in (True, False, True, True, False):
        st.update(ok)
    assert st.scale == 512.0 and st.skipped_steps == 2
    loss = torch.tensor(3.0)
    assert torch.equal(st.scale_loss(loss), torch.tensor(1536.0))
    off = LossScaler(LossScaling())
    assert not off.enabled and off.scale == 1.0
    assert off.scale_loss(loss) is loss
    off.update(False)
    assert off.scale == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_loss_scaler_fused_check_equals_per_gradient_loop(dtype: torch.dtype, bad: str | None) -> None:
    """The fused unscale-and-check (torch's ``_amp_foreach_non_finite_check_and_unscale_``, as GradScaler) gives
    the bits and the verdict of the per-gradient loop it replaced (``g.mul_(1 / scale)``, ``isfinite(g).all()``,
    written out below as the oracle), for a scale that is not a power of two, in float32, bf16 and fp16."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(37, 19, generator=g).to(dtype) * 3000, torch.randn(5, generator=g).to(dtype)]
    if bad is not None:
        grads[0][4, 7] = float(bad)

    def params(gs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in gs:
            p = torch.zeros_like(t, requires_grad=True)
            p.grad = t.clone()
            out.append(p)
        return out

    fused, loop = params(grads), params(grads)
    s = LossScaler(LossScaling(kind="dynamic", init_scale=3000.0))
    ok = s.unscale_and_check(fused)
    inv = 1.0 / 3000.0
    want = True
    for p in loop:  # the loop, by hand
        p.grad.mul_(inv)
        want &= bool(torch.isfinite(p.grad).all())
    assert ok is want is (bad is None)
    for a, b in zip(fused, loop, strict=True):
        assert_bitwise_equal(a.grad, b.grad, context=f"{dtype} {bad}")


def test_loss_scaler_unscale_and_check() -> None:
    """unscale_and_check divides gradients by the scale in place (exact for a power-of-two scale) and reports
    whether all are finite; state_dict round-trips (oracle: hand values)."""
    s = LossScaler(LossScaling(kind="dynamic", init_scale=1024.0))
    p = torch.zeros(3, requires_grad=True)
    q = torch.zeros(2, requires_grad=True)
    p.grad = torch.tensor([1024.0 * 1.5, -3072.0, 0.25])
    q.grad = torch.tensor([2048.0, 0.0])
    assert s.unscale_and_check([p, q]) is True
    assert p.grad.tolist() == [1.5, -3.0, 0.25 / 1024] and q.grad.tolist() == [2.0, 0.0]
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert s.unscale_and_check([p, q]) is False
    p.grad = torch.tensor([float("nan"), 1.0, 0.0])
    assert s.unscale_and_check([p, q]) is False
    s.update(False)
    state = s.state_dict()
    t = LossScaler(LossScaling(kind="dynamic", init_scale=1024.0))
    t.load_state_dict(state)
    assert (t.scale, t.good_steps, t.skipped_steps) == (512.0, 0, 1)


def test_fp16_optimizer_skips_inf_step_and_halves_scale() -> None:
    """LowPrecisionOptimizer with fp16-dynamic-loss-scale: the loss is multiplied by 2^16; an injected inf gradient
    makes step() return False, leaves every weight bit-identical, clears the gradients and halves the scale; a
    following finite step returns True and equals a plain SGD step on the unscaled gradients (the scale is a power
    of two, so scaling and unscaling are exact).  Oracle: hand values and plain torch.optim.SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    ref = nn.Sequential(nn.Linear(6, 3))
    ref.load_state_dict(model.state_dict())
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "fp16-dynamic-loss-scale")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert opt.scaler.scale == 65536.0
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))

    loss = model(x).square().mean()
    scaled = opt.scale_loss(loss)
    assert torch.equal(scaled, loss * 65536.0)
    scaled.backward()
    model[0].weight.grad[1, 2] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step() is False
    for p, b in zip(model.parameters(), before, strict=True):
        assert_bitwise_equal(p.detach(), b, context="weights after skipped step")
        assert p.grad is None or not bool(p.grad.any())
    assert opt.scaler.scale == 32768.0 and opt.scaler.skipped_steps == 1 and opt.steps == 0

    opt.zero_grad()
    opt.scale_loss(model(x).square().mean()).backward()
    assert opt.step() is True
    ref_opt.zero_grad()
    ref(x).square().mean().backward()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), r.detach(), context="finite step vs plain SGD")
    assert opt.scaler.scale == 32768.0 and opt.steps == 1


# ================================================================================================ accumulation
def _round_bits(x: float, mbits: int, mode: str) -> float:
    """Round a Python float to ``mbits`` fraction bits (``mbits + 1`` significant bits), ties to even for
    "nearest", truncation for "toward_zero"; exponent range unlimited (no test value comes near float32's limits).

    Own implementation: frexp gives x = f * 2^e with 0.5 <= |f| < 1, so f * 2^(mbits+1) is an exactly representable
    double with mbits+1 integer bits; Python's round() on a float rounds half to even exactly.
    """
    if x == 0.0:
        return x
    f, e = math.frexp(x)
    scaled = math.ldexp(f, mbits + 1)
    r = round(scaled) if mode == "nearest" else math.trunc(scaled)
    return math.ldexp(float(r), e - mbits - 1)


def _f32(x: float) -> float:
    return _round_bits(x, 23, "nearest")


def _reference_accumulate(a: list[list[float]], b: list[list[float]], mbits: int, chunk: int | None,
                          mode: str) -> list[list[float]]:
    """The ``_accum`` model, one output element at a time: ``part = Q(fl32(part + a*b))``, promotion into a float32
    total every ``chunk`` products, ``out = fl32(total + part)``.  Products of bf16 values are exact in double and
    ``part + prod`` spans well under 53 bits here, so each double sum is exact before its single rounding."""
    out = []
    for row in a:
        out_row = []
        for col in b:
            part = total = 0.0
            for k, (u, v) in enumerate(zip(row, col, strict=True)):
                part = _round_bits(_f32(part + u * v), mbits, mode)
                if chunk is not None and (k + 1) % chunk == 0:
                    total, part = _f32(total + part), 0.0
            out_row.append(_f32(total + part))
        out.append(out_row)
    return out


def _bf16_values(shape: tuple[int, ...], seed: int, positive: bool = False) -> torch.Tensor:
    """float32 tensor of bf16-representable values with magnitudes in [1/8, 8)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(shape, generator=g) * 6 - 3)
    sign = torch.ones(shape) if positive else torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(torch.bfloat16).float()


@pytest.mark.parametrize(("fmt", "mbits"), [("e8m4", 4), ("e8m13", 13)])
@pytest.mark.parametrize("chunk", [None, 16, 7])
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_accumulate_matmul_equals_reference_loop(fmt: str, mbits: int, chunk: int | None, rounding: str) -> None:
    """accumulate_matmul with a few-bit accumulator (e8m4: 5 significant bits; e8m13: H800's ~14) equals the
    pure-Python reference loop bit for bit, with and without promotion (chunk dividing K or not), for both
    roundings and mixed-sign operands (oracle: ``_reference_accumulate`` with its own rounding)."""
    M, N, K = 3, 4, 100
    a = _bf16_values((M, K), seed=10)
    b = _bf16_values((N, K), seed=11)
    got = accumulate_matmul(a, b, Accumulator(format=fmt, chunk=chunk, rounding=rounding))
    want = torch.tensor(_reference_accumulate(a.tolist(), b.tolist(), mbits, chunk, rounding), dtype=torch.float32)
    assert_bitwise_equal(got, want, context=f"{fmt} chunk={chunk} {rounding}")
    # The accumulator really is narrower than float32 here: the float32 matmul differs.
    assert not torch.equal(got, a @ b.t())


def test_accumulate_matmul_batched_equals_reference_loop() -> None:
    """Leading batch dimensions broadcast (a: [2, M, K], b: [N, K]); each batch equals the reference loop."""
    a = _bf16_values((2, 2, 40), seed=12)
    b = _bf16_values((3, 40), seed=13)
    got = accumulate_matmul(a, b, Accumulator(format="e8m4", chunk=8))
    assert got.shape == (2, 2, 3)
    for i in range(2):
        want = torch.tensor(_reference_accumulate(a[i].tolist(), b.tolist(), 4, 8, "nearest"))
        assert_bitwise_equal(got[i], want, context=f"batch {i}")


def test_long_reduction_promotion_recovers_precision() -> None:
    """Summing K=4096 positive values in [1/2, 1) (a dot product with ones) in an e8m7 accumulator (8 significant
    bits, nearest):

    * without promotion the sum stalls: once the partial sum reaches 256 its spacing is 2, so adding any value
      below 1 (half a spacing) rounds back to 256; the result is at most 256 while the true sum is at least 2048,
      an error of at least 7/8 of the sum;
    * promoting every 128 products keeps each partial below 128 (+1); the rounding error of the j-th addition in
      a chunk is at most half a spacing at magnitude j, i.e. 2^(floor(log2 j) - 8), so the total error is at most
      32 chunks * sum_j 2^(floor(log2 j) - 8) plus the float32 promotions (< 64 * 2^-12): computed below, about
      700, under a quarter of the sum (~3070 here) and far below the no-promotion error.

    Oracle: the float64 sum and these two hand bounds.  Both results also equal the reference loop.
    """
    K = 4096
    g = torch.Generator().manual_seed(20)
    vals = (0.5 + 0.5 * torch.rand(1, K, generator=g)).to(torch.bfloat16).float().clamp(max=0.99609375)
    ones = torch.ones(1, K)
    exact = float(vals.double().sum())
    assert exact >= 2048.0
    no_promo = float(accumulate_matmul(vals, ones, Accumulator(format="e8m7"))[0, 0])
    promo = float(accumulate_matmul(vals, ones, Accumulator(format="e8m7", chunk=128))[0, 0])
    assert no_promo <= 256.0
    assert exact - no_promo >= 7 / 8 * exact
    per_chunk = sum(2.0 ** (math.floor(math.log2(j)) - 8) for j in range(1, 129))
    bound = (K // 128) * per_chunk + 64 * 2.0**-12
    assert abs(promo - exact) <= bound
    assert bound < 0.25 * exact < exact - no_promo
    # Same numbers as the reference model.
    ref = _reference_accumulate(vals.tolist(), ones.tolist(), 7, None, "nearest")[0][0]
    ref_promo = _reference_accumulate(vals.tolist(), ones.tolist(), 7, 128, "nearest")[0][0]
    assert (no_promo, promo) == (ref, ref_promo)


def test_converted_linear_uses_accumulator() -> None:
    """A converted linear whose forward GEMM has an e8m4 accumulator (operands unquantized) gives
    ``accumulate-by-reference(x, W) + b`` (oracle: the reference loop and a float32 bias add)."""
    acc = Accumulator(format="e8m4", chunk=8, rounding="toward_zero")
    recipe = Recipe(name="acc", linear=LinearRecipe(forward=Gemm(accumulator=acc)))
    torch.manual_seed(0)
    model = lowprec.convert(nn.Sequential(nn.Linear(24, 3)), recipe)
    with torch.no_grad():
        model[0].weight.copy_(_bf16_values((3, 24), seed=21))
        model[0].bias.copy_(torch.tensor([0.5, -0.25, 0.0]))
    x = _bf16_values((2, 24), seed=22)
    with torch.no_grad():
        y = model(x)
    ref = torch.tensor(_reference_accumulate(x.tolist(), model[0].weight.tolist(), 4, 8, "toward_zero"))
    assert_bitwise_equal(y, ref + model[0].bias.detach(), context="forward with e8m4 accumulator")


# ================================================================================================ weight updates
_SEEDS = (0, 1, 2)
_D, _N = 8, 256


def _regression_problems() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One least-squares problem per seed, stacked: X [S,n,d] ~ N(0,1), w* ~ N(0, 0.5^2), y = X w* + N(0, 0.1^2);
    initial weights +-2 (+ up to 0.25), far from w*."""
    xs, ys, w0 = [], [], []
    for s in _SEEDS:
        g = torch.Generator().manual_seed(s)
        x = torch.randn(_N, _D, generator=g)
        w_star = torch.randn(_D, generator=g) * 0.5
        xs.append(x)
        ys.append(x @ w_star + 0.1 * torch.randn(_N, generator=g))
        w0.append(2.0 * torch.sign(torch.randn(_D, generator=g)) + 0.25 * torch.rand(_D, generator=g))
    return torch.stack(xs), torch.stack(ys), torch.stack(w0)


def _train_regression(recipe: str, steps: int = 600, lr: float = 1e-2) -> torch.Tensor:
    """Full-batch SGD on the stacked problems (the summed loss keeps them independent); final loss per seed."""
    x, y, w0 = _regression_problems()

    def losses(w: torch.Tensor) -> torch.Tensor:
        return ((torch.einsum("snd,sd->sn", x, w) - y) ** 2).mean(1)

    w = nn.Parameter(w0.clone())
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=lr), recipe)
    for _ in range(steps):
        opt.zero_grad()
        opt.scale_loss(losses(w).sum()).backward()
        opt.step()
    with torch.no_grad():
        return losses(w)


def test_bf16_nearest_stalls_while_sr_and_kahan_track_fp32() -> None:
    """Linear regression, SGD lr 1e-2, 600 full-batch steps, weights starting at |w| ~ 2, three seeds:

    * fp32 reaches the least-squares optimum (loss ~ 0.01, the noise floor);
    * bf16-pure (bf16 weights, round-to-nearest updates) stalls: an update lr * g smaller than half a bf16 spacing
      of w (2^-8 |w|) is lost, i.e. once |g| < 2^-8 |w| / lr ~ 0.4 |w|, far from the optimum.  Claim: its final
      loss is more than 2x fp32's (measured 3.8x - 7.6x);
    * bf16-sr (stochastic rounding, unbiased) and bf16-kahan (compensated) keep the lost low bits on average / in
      the compensation buffer and end within about one bf16 spacing of the optimum.  Margin: final loss within 2%
      of fp32's.  Why 2%: an offset of one spacing per coordinate costs about sum_i ulp(w*_i)^2 * lambda(Sigma)
      ~ 8 * (2^-9)^2 ~ 3e-5, i.e. ~0.3% of the 0.01 floor (measured 0.06% - 0.4%); 2% leaves 5x headroom.

    Oracle: float32 PyTorch training (the fp32 recipe) and the optimum from float64 lstsq.
    """
    fp32 = _train_regression("fp32")
    x, y, _ = _regression_problems()
    for i in range(len(_SEEDS)):
        sol = torch.linalg.lstsq(x[i].double(), y[i].double().unsqueeze(1)).solution.squeeze(1)
        opt_loss = float(((x[i].double() @ sol - y[i].double()) ** 2).mean())
        assert abs(float(fp32[i]) - opt_loss) <= TOLERANCES["fp32_converged_rel"].value * opt_loss, (
            "fp32 did not converge: the baseline is wrong"
        )
    pure = _train_regression("bf16-pure")
    sr = _train_regression("bf16-sr")
    kahan = _train_regression("bf16-kahan")
    for i, seed in enumerate(_SEEDS):
        stall, track = TOLERANCES["bf16_pure_stall_ratio"].value, TOLERANCES["sr_kahan_track_ratio"].value
        assert float(pure[i]) > stall * float(fp32[i]), f"seed {seed}: bf16-pure did not stall"
        assert float(sr[i]) <= track * float(fp32[i]), f"seed {seed}: bf16-sr {float(sr[i])} vs fp32 {float(fp32[i])}"
        assert float(kahan[i]) <= track * float(fp32[i]), f"seed {seed}: bf16-kahan {float(kahan[i])}"


def test_low_precision_weights_stay_on_grid() -> None:
    """With bf16 weight storage every parameter is on the bf16 grid after construction and after each step, for
    nearest, stochastic and Kahan updates (the Kahan compensation buffer too); the float32-master recipe leaves the
    weights off the grid (oracle: ``quantize(w, "bfloat16") == w``)."""
    for recipe in ("bf16-pure", "bf16-sr", "bf16-kahan", "fp32"):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 5))
        opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), recipe)
        on_grid = recipe != "fp32"
        for _ in range(3):
            opt.zero_grad()
            (w * torch.arange(20.0).reshape(4, 5)).sum().backward()
            opt.step()
            assert torch.equal(lowprec.quantize(w.detach(), "bfloat16"), w.detach()) == on_grid, recipe
        for c in opt.compensation.values():
            assert torch.equal(lowprec.quantize(c, "bfloat16"), c)


def _sgd_plus(recipe: str, n: int, steps: int) -> torch.Tensor:
    """``n`` weights at 1.0, SGD with lr 2^-9 on loss = -sum(w): each step's float32 update is exactly +2^-9, a
    quarter of the bf16 spacing at 1 (2^-7)."""
    w = nn.Parameter(torch.ones(n))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=2.0**-9), recipe)
    for _ in range(steps):
        opt.zero_grad()
        (-w.sum()).backward()
        opt.step()
    return w.detach()


def test_kahan_and_nearest_updates_by_hand() -> None:
    """Four updates of +2^-9 to a bf16 weight at 1 (spacing 2^-7), by hand from the ``_optimizer`` docstring:

    nearest: Q(1 + 2^-9) = 1 every step, the weight never moves;
    Kahan (y = u - c; t = Q(w + y); c = Q((t - w) - y)):
      1: y = 2^-9,   t = 1,          c = -2^-9
      2: y = 2^-8,   t = Q(1 + 2^-8) = 1 (a tie, to even), c = -2^-8
      3: y = 3*2^-9, t = 1 + 2^-7,   c = 2^-9
      4: y = 0,      t = 1 + 2^-7,   c = 0
    so Kahan ends at 1 + 2^-7, exactly the float32 result 1 + 4 * 2^-9.
    """
    assert _sgd_plus("fp32", 2, 4).tolist() == [1 + 2.0**-7] * 2
    assert _sgd_plus("bf16-pure", 2, 4).tolist() == [1.0] * 2
    w = nn.Parameter(torch.ones(2))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=2.0**-9), "bf16-kahan")
    trace = []
    for _ in range(4):
        opt.zero_grad()
        (-w.sum()).backward()
        opt.step()
        trace.append((w.detach()[0].item(), opt.compensation[0][0].item()))
    assert trace == [(1.0, -(2.0**-9)), (1.0, -(2.0**-8)), (1 + 2.0**-7, 2.0**-9), (1 + 2.0**-7, 0.0)]


def test_stochastic_weight_update_is_unbiased() -> None:
    """One +2^-9 update of 8192 bf16 weights at 1 with stochastic rounding: each weight rounds up to 1 + 2^-7 with
    probability (2^-9) / (2^-7) = 1/4, else stays at 1.  The number rounded up is Binomial(8192, 1/4) (mean 2048,
    sd 39.2) and must lie within TOLERANCES["stochastic_sigma"] standard deviations (false-failure rate 2e-9).
    Oracle: that binomial law.  Rerunning gives the same bits (seeded), and a second step moves further weights."""
    n, p = 8192, 0.25
    w1 = _sgd_plus("bf16-sr", n, 1)
    assert set(w1.unique().tolist()) <= {1.0, 1 + 2.0**-7}
    ups = int((w1 > 1).sum())
    sd = math.sqrt(n * p * (1 - p))
    assert abs(ups - n * p) <= TOLERANCES["stochastic_sigma"].value * sd, ups
    w2 = _sgd_plus("bf16-sr", n, 2)
    assert not torch.equal(w2 - w1, torch.full_like(w1, 0.0))  # the second step moved some weights
    assert torch.equal(_sgd_plus("bf16-sr", n, 1), w1)  # same seed, same bits


# ================================================================================================ optimizer state
_BF16_ELEM = QuantSpec(elem="bfloat16", scaling="none")
_E8M3_ELEM = QuantSpec(elem="e8m3", scaling="none")


def _state_recipe(**kw: QuantSpec) -> Recipe:
    return Recipe(name="lowp-state", optimizer=OptimizerState(**kw))


def _on_grid(t: torch.Tensor, fmt: str) -> bool:
    return torch.equal(lowprec.quantize(t, fmt), t)


def _run_steps(opt_cls, recipe: Recipe | str, steps: int = 3, **opt_kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = LowPrecisionOptimizer(opt_cls(model.parameters(), **opt_kw), recipe)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(9, 12, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def test_adamw_state_on_format_grid() -> None:
    """AdamW with exp_avg stored as bf16 and exp_avg_sq as e8m3 (elementwise): after each of 3 steps every moment
    tensor lies on its format's grid, while the fp32 recipe's moments do not (so the check has teeth).  Oracle:
    ``quantize(t, fmt) == t``."""
    recipe = _state_recipe(exp_avg=_BF16_ELEM, exp_avg_sq=_E8M3_ELEM)
    model, opt = _run_steps(torch.optim.AdamW, recipe, lr=1e-2)
    states = [opt.optimizer.state[p] for p in model.parameters()]
    assert len(states) == 4
    for st in states:
        assert _on_grid(st["exp_avg"], "bfloat16")
        assert _on_grid(st["exp_avg_sq"], "e8m3")
        assert bool(st["exp_avg_sq"].gt(0).any())
    model32, opt32 = _run_steps(torch.optim.AdamW, "fp32", lr=1e-2)
    st32 = [opt32.optimizer.state[p] for p in model32.parameters()]
    assert not all(_on_grid(st["exp_avg"], "bfloat16") for st in st32)
    assert not all(_on_grid(st["exp_avg_sq"], "e8m3") for st in st32)


def test_sgd_momentum_buffer_on_grid() -> None:
    """SGD's momentum_buffer is treated as exp_avg: with a bf16 exp_avg spec it lies on the bf16 grid after each
    step; without one it does not (oracle: ``quantize(t, "bfloat16") == t``)."""
    model, opt = _run_steps(torch.optim.SGD, _state_recipe(exp_avg=_BF16_ELEM), lr=1e-2, momentum=0.9)
    for p in model.parameters():
        assert _on_grid(opt.optimizer.state[p]["momentum_buffer"], "bfloat16")
    model32, opt32 = _run_steps(torch.optim.SGD, "fp32", lr=1e-2, momentum=0.9)
    assert not all(_on_grid(opt32.optimizer.state[p]["momentum_buffer"], "bfloat16") for p in model32.parameters())


def test_sgd_momentum_quantized_state_steps_by_hand() -> None:
    """Two SGD steps (lr 1/16, momentum 1/2) on loss = sum(c * w) with c = 1 + 2^-10 (not a bf16 value), every
    number exact in float32:

    step 1: buf = c (stored as Q(c) = 1), w1 = w0 - c/16 (the update uses the buffer before it is stored);
    step 2: buf = 1/2 * Q(c) + c = 1.5 + 2^-10, w2 = w1 - buf/16, stored buf = Q(1.5 + 2^-10) = 1.5.
    With float32 state the second buffer would be 1.5 * c instead.  Oracle: this hand computation (the
    ``_optimizer`` docstring: state is replaced by its fake-quantized value after each step)."""
    c = 1 + 2.0**-10
    for recipe, buf2 in ((_state_recipe(exp_avg=_BF16_ELEM), 1.5 + 2.0**-10), ("fp32", 1.5 * c)):
        w = nn.Parameter(torch.ones(3))
        opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1 / 16, momentum=0.5), recipe)
        for _ in range(2):
            opt.zero_grad()
            (w * c).sum().backward()
            opt.step()
        w1 = 1 - c / 16
        assert w.detach().tolist() == [w1 - buf2 / 16] * 3, recipe
        stored = opt.optimizer.state[w]["momentum_buffer"].tolist()
        assert stored == ([1.5] * 3 if recipe != "fp32" else [buf2] * 3)


def test_gradient_spec_applied_before_step() -> None:
    """OptimizerState.grad fake-quantizes gradients before the step: with a bf16 grad spec a gradient of
    1 + 2^-10 becomes 1, so plain SGD (lr 1/4) moves w from 1 to 3/4 exactly (oracle: hand computation)."""
    c = 1 + 2.0**-10
    w = nn.Parameter(torch.ones(2))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=0.25), _state_recipe(grad=_BF16_ELEM))
    (w * c).sum().backward()
    opt.step()
    assert w.detach().tolist() == [0.75, 0.75]


def test_optimizer_state_dict_round_trip() -> None:
    """LowPrecisionOptimizer.state_dict/load_state_dict restore the wrapped optimizer, scaler, step count and Kahan
    buffers: a restored optimizer continues exactly like the original (oracle: the uninterrupted run)."""
    recipe = dataclasses.replace(lowprec.recipes.get("bf16-kahan"), loss_scaling=LossScaling(kind="static",
                                                                                                init_scale=256.0))

    def make() -> tuple[nn.Parameter, LowPrecisionOptimizer]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(6))
        return w, LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-3), recipe)

    def step(w: nn.Parameter, opt: LowPrecisionOptimizer, i: int) -> None:
        opt.zero_grad()
        opt.scale_loss((w * (torch.arange(6.0) - i)).square().sum()).backward()
        opt.step()

    w_a, opt_a = make()
    for i in range(4):
        step(w_a, opt_a, i)
    w_b, opt_b = make()
    for i in range(2):
        step(w_b, opt_b, i)
    saved_w, saved = w_b.detach().clone(), opt_b.state_dict()
    w_c, opt_c = make()
    with torch.no_grad():
        w_c.copy_(saved_w)
    opt_c.load_state_dict(saved)
    for i in range(2, 4):
        step(w_c, opt_c, i)
    assert_bitwise_equal(w_c.detach(), w_a.detach(), context="resumed run")
    assert opt_c.steps == 4


def test_conflicting_delayed_algorithms_for_one_role_are_rejected() -> None:
    """Oracle: the documented rule that amax history is shared per tensor role (input appears in the forward and
    grad_weight GEMMs), so one role cannot use "max" in one GEMM and "most_recent" in another."""
    import dataclasses

    from lowprec.recipes import Scaling

    r = lowprec.recipes.get("fp8-delayed")
    fwd = dataclasses.replace(
        r.linear.forward, a=dataclasses.replace(r.linear.forward.a, scaling=Scaling(kind="delayed",
                                                                                      algorithm="most_recent"))
    )
    bad = dataclasses.replace(r, linear=dataclasses.replace(r.linear, forward=fwd))
    with pytest.raises(ValueError, match="input uses two amax algorithms"):
        lowprec.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), bad)


def test_power_of_two_ceil_scales_compile_without_graph_breaks() -> None:
    """Oracle: torch._dynamo.explain of a converted model with fp8-rowwise (E8M0 ceil scales): one graph."""
    m = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(8, 8)), "fp8-rowwise")
    explanation = torch._dynamo.explain(m)(torch.randn(4, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
