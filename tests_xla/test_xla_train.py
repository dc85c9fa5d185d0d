"""Training on the XLA device: ``lowprec.convert`` + ``LowPrecisionOptimizer`` on the zoo's mlp-digits, one
``torch_xla.sync`` per step, against the same steps in eager CPU under the same torch (2.9, .venv-xla).

Oracles, from the exact to the bounded:

* every quantized GEMM operand of 20 XLA training steps equals lowprec's eager CPU quantizer applied to the same
  input (the operand's float32 tensor, random keys and amax brought back from the device), bit for bit;
* the optimizer given the same gradients gives the CPU's weights and state bit for bit (the recipe's weight policy
  included: bf16 stochastic rounding for bf16-sr) with an inner SGD whose products are exact; AdamW's own
  arithmetic cannot match: torch's CPU float32 ``sqrt`` is not correctly rounded here (1 ulp off for about 17% of
  random inputs; XLA's is, checked against float64), and torch's CPU ``add(alpha=)``, ``lerp``, ``addcmul`` and
  ``addcdiv`` round once (fused multiply-add) where XLA under ``--xla_cpu_max_isa=AVX`` rounds twice (checked);
* whole training runs agree within ``TOLERANCES["xla_vs_cpu_*"]``, whose causes the tests above leave: XLA's
  float32 dot and reductions sum in another order than MKL's GEMM and torch's reductions (the full-precision
  head's logits, the grad_weight GEMMs over the batch, bias gradients, the loss mean), its ``exp``/``log`` differ
  from torch's in the last bit for about 10% of inputs (log_softmax), and AdamW differs as just said.  A last-bit
  difference then crosses an fp8 rounding boundary or a bf16 stochastic-rounding threshold now and then (a whole
  format step), and AdamW's normalised update carries the rest on.  The recipe's own step-1 effect (its loss
  against float32's) is checked to be far above the step-1 bound, so the bound cannot hide an unapplied recipe.

No operation takes torch_xla's CPU fallback, nothing reads a value back to the host inside a step, and the 20 steps
compile at most 3 graphs (a step-dependent Python constant would compile one per step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _helpers import (
    assert_same_bits,
    compiles,
    met,
    on_device_only,
    run_on_xla,
    start_runtime,
    strided_patterns,
    to_cpu,
    train_digits,
)

import lowprec
from lowprec.nn import _linear
from lowprec.testing.tolerances import TOLERANCES

RECIPES = ("fp8-tensorwise", "mxfp8", "bf16-sr")
STEPS = 20
DEV = start_runtime()


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_operands_match_eager_cpu(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GEMM operand quantization of 20 XLA steps, recomputed by the eager CPU quantizer on the same input."""
    seen: list[tuple[Any, ...]] = []
    original = _linear.quantize_operand

    def recording(t: torch.Tensor, spec: Any, name: str, which: str, keys: Any, amax: Any) -> torch.Tensor:
        q = original(t, spec, name, which, keys, amax)
        if t.device.type == "xla":  # the input as it is now (the weight is updated in place later)
            seen.append((t.detach().clone(), spec, name, which, keys, amax, q.detach().clone()))
        return q

    monkeypatch.setattr(_linear, "quantize_operand", recording)
    train_digits(recipe, DEV, STEPS)
    monkeypatch.undo()
    quantized = [s for s in seen if getattr(s[1], s[3]).spec is not None]
    assert len(quantized) >= 4 * STEPS  # two converted layers: 2 forward + 2-3 backward operands each per step
    for i, (t, spec, name, which, keys, amax, q) in enumerate(seen):
        want = original(t.cpu(), spec, name, which, to_cpu(keys), to_cpu(amax))
        assert_same_bits(q.cpu(), want, f"{recipe} operand {i} ({name}.{which})")


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxint8"])
def test_mx_blocks_with_the_smallest_scale(name: str) -> None:
    """An all-zero MX block (a dead ReLU unit's column in a grad_weight operand) and blocks whose amax is below
    2^-118 get E8M0's smallest scale 2^-127, a float32 subnormal that XLA reads as zero (0 / 0 was NaN, and broke
    mxfp8 training on XLA at step 1).  Now: the CPU's bits, except where the CPU's result is itself a float32
    subnormal (XLA writes zero there) or the input is (XLA reads it as zero)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 64, generator=g)
    x[:4] = 0.0
    x[4:8] = -0.0
    x[8:] *= 2.0 ** -121
    x[8:, ::32] = 2.0 ** -119
    got = run_on_xla(lowprec.fake_quantize, x, name)
    want = lowprec.fake_quantize(x, name)
    tiny = lambda t: (t != 0) & (t.abs() < 2.0**-126)  # noqa: E731
    flushed = tiny(want) | tiny(x)
    assert not got.isnan().any()
    assert (got[flushed] == 0).all()
    assert_same_bits(got[~flushed], want[~flushed], f"{name} blocks with scale 2^-127")
    assert (~flushed).sum() > x.numel() // 2


def test_xla_square_root_is_correctly_rounded() -> None:
    """The fact the AdamW test rests on: XLA's float32 sqrt equals float64's rounded to float32 (correctly rounded,
    2 * 24 + 2 <= 53 bits); so does numpy's.  torch's CPU sqrt is measured, not asserted (it may depend on the CPU)."""
    x = strided_patterns().abs()
    x = x[torch.isfinite(x) & (x >= 2.0**-126)]  # XLA flushes subnormals (test_xla_ops.py)
    exact = x.double().sqrt().float()
    assert_same_bits(torch.sqrt(x.to(DEV)).cpu(), exact, "XLA sqrt vs float64 sqrt rounded once")


def test_xla_multiply_add_rounds_twice() -> None:
    """The other optimizer fact: under tests_xla's ``--xla_cpu_max_isa=AVX`` XLA rounds ``a + alpha * b`` twice.
    torch's CPU kernels for ``add(alpha=)``, ``lerp``, ``addcmul`` and ``addcdiv`` (AdamW's update) use fused
    multiply-adds on AVX2 CPUs, one rounding, and XLA's default contraction fuses every ``a * b + c``, also
    ``x * alpha + y`` written as two torch operations: no XLA setting gives torch's CPU AdamW bits."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    alpha = 0.37
    twice = (a.double() + (torch.tensor(alpha).double() * b.double()).float().double()).float()
    assert_same_bits(torch.add(a.to(DEV), b.to(DEV), alpha=alpha).cpu(), twice, "XLA a + alpha * b")


@pytest.mark.parametrize("recipe", RECIPES)
def test_optimizer_steps_match_eager_cpu(recipe: str) -> None:
    """Same weights, same gradients: 6 steps of ``LowPrecisionOptimizer`` on XLA give the CPU's weights and state
    bit for bit (bf16-sr: the stochastically rounded bf16 weights, whose draws depend on (seed, step, parameter,
    element) only).  The inner optimizer is SGD with a power-of-two learning rate and momentum, whose products are
    exact: AdamW's arithmetic itself differs in the last bit (the two tests above), which the training test bounds."""
    g = torch.Generator().manual_seed(7)
    shapes = [(128, 64), (128,), (10, 128)]
    init = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=g) * 2.0 ** float(torch.randint(-20, 0, ()).item()) for s in shapes]
             for _ in range(6)]

    def run(dev: torch.device) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone().to(dev)) for p in init]
        inner = torch.optim.SGD(params, lr=2.0**-5, momentum=0.5, foreach=False)
        opt = lowprec.optim.LowPrecisionOptimizer(inner, recipe)
        for step_grads in grads:
            for p, gr in zip(params, step_grads, strict=True):
                p.grad = gr.to(dev)
            opt.step()
            if dev.type == "xla":
                import torch_xla

                torch_xla.sync()
        state = [t for p in params for t in opt.optimizer.state[p].values() if isinstance(t, torch.Tensor)]
        return [p.detach().cpu() for p in params] + [t.cpu() for t in state]

    with on_device_only():
        got = run(DEV)
    want = run(torch.device("cpu"))
    assert len(got) == 6  # three weights, three momentum buffers
    assert_same_bits(got, want, f"{recipe} weights and optimizer state")


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_matches_eager_cpu_within_tolerance(recipe: str) -> None:
    sr = "_sr" if lowprec.recipes.get(recipe).weights.update == "stochastic" else ""
    step1 = TOLERANCES["xla_vs_cpu_step1_loss_rel"].value
    loss_rel = TOLERANCES[f"xla_vs_cpu{sr}_loss_rel"].value
    weight_rel = TOLERANCES[f"xla_vs_cpu{sr}_weight_rel"].value
    want_loss, want_w, _ = train_digits(recipe, torch.device("cpu"), STEPS)
    met.clear_all()
    with on_device_only():  # no CPU fallback, no host read inside the steps
        got_loss, got_w, _ = train_digits(recipe, DEV, STEPS)
    assert compiles() <= 3, f"{compiles()} XLA compilations in {STEPS} steps: a graph is specialised per step"
    rel = (got_loss.double() - want_loss.double()).abs() / want_loss.double().abs()
    assert rel[0] <= step1, f"{recipe} step-1 loss: relative difference {rel[0]:.3g} > {step1}"
    assert rel.max() <= loss_rel, f"{recipe}: max relative loss difference {rel.max():.3g} > {loss_rel}"
    for k, w in want_w.items():
        if w.is_floating_point():
            d = (got_w[k].double() - w.double()).abs().max() / w.double().abs().max()
            assert d <= weight_rel, f"{recipe} {k}: max |dw| / max |w| = {d:.3g} > {weight_rel}"
    # the step-1 bound is far below what the recipe itself changes there: an XLA run that ignored it would fail
    fp32 = train_digits("fp32", torch.device("cpu"), 1)[0].double()
    effect = abs(want_loss[0].item() - fp32[0].item()) / want_loss[0].item()
    assert effect > 10 * step1, f"{recipe}: its step-1 effect {effect:.3g} is not far above the bound {step1}"
