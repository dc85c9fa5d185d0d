"""lowprec.reliability fault injection: bit-level edits checked against struct's own IEEE encodings, and the
step / rank / persistence semantics in a real training loop."""

from __future__ import annotations

import struct

import pytest
import torch
from torch import nn

from lowprec import UsageError
from lowprec.reliability import Fault, FaultInjector, alter_bit


def _f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


@pytest.mark.parametrize("bit,mode,want_bits", [
    (30, "flip", 0x7F800000),  # exponent MSB: 1.0 -> inf
    (23, "flip", 0x3F000000),  # exponent LSB: 1.0 -> 0.5
    (31, "flip", 0xBF800000),  # sign: -1.0
    (22, "set", 0x3FC00000),  # mantissa MSB stuck at 1: 1.5
    (29, "clear", 0x1F800000),  # 2^-64
    (0, "flip", 0x3F800001),  # the last mantissa bit: 1 + 2^-23
])
def test_float32_bits(bit: int, mode: str, want_bits: int) -> None:
    t = torch.ones(3)
    before, after = alter_bit(t, 1, bit, mode)  # type: ignore[arg-type]
    want = _f32(want_bits)
    assert before == 1.0 and after == want and t[1].item() == want and t[0] == 1.0 and t[2] == 1.0


def test_other_dtypes() -> None:
    b = torch.ones(2, dtype=torch.bfloat16)
    assert alter_bit(b, 0, 14)[1] == float("inf")  # 0x3F80 ^ 0x4000 = 0x7F80
    d = torch.ones(1, dtype=torch.float64)
    assert alter_bit(d, 0, 52)[1] == 0.5 and alter_bit(d, 0, 63)[1] == -0.5
    h = torch.ones(1, dtype=torch.float16)
    assert alter_bit(h, 0, 10)[1] == 0.5  # 0x3C00 ^ 0x0400 = 0x3800
    with pytest.raises(UsageError, match="bit 16 is outside a torch.bfloat16 element"):
        alter_bit(b, 0, 16)
    with pytest.raises(UsageError, match="index 5 is outside a tensor of 2 elements"):
        alter_bit(b, 5, 1)
    with pytest.raises(UsageError, match="dtype torch.int64 are not supported"):
        alter_bit(torch.zeros(2, dtype=torch.int64), 0, 1)


def _loop(faults: list[Fault], steps: int = 5, rank: int = 0) -> tuple[FaultInjector, list[torch.Tensor],
                                                                        list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inj = FaultInjector(model, faults, rank=rank)
    outs, grads = [], []
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        inj.before_forward(step)
        out = model(x)
        outs.append(out.detach().clone())
        out.square().mean().backward()
        inj.after_backward(step)
        grads.append(model[2].weight.grad.detach().clone())
        opt.step()
        opt.zero_grad()
    return inj, outs, grads


def test_transient_and_persistent_weight_faults() -> None:
    inj, _, _ = _loop([Fault(target="weight", tensor="0.weight", step=2, index=5, bit=1)])
    assert [(r.step, r.target, r.tensor, r.index) for r in inj.injections] == [(2, "weight", "0.weight", 5)]
    stuck, _, _ = _loop([Fault(target="weight", tensor="0.weight", step=2, index=5, bit=22, mode="set",
                               persistent=True)])
    assert [r.step for r in stuck.injections] == [2, 3, 4]  # re-applied after every optimizer update
    bits = [struct.unpack("<I", struct.pack("<f", r.after))[0] for r in stuck.injections]
    assert all(b & (1 << 22) for b in bits)  # the mantissa's top bit stuck at 1 after each update
    assert stuck.injections[1].before != stuck.injections[0].after  # the optimizer moved it in between
    none, _, _ = _loop([Fault(target="weight", tensor="0.weight", step=2, rank=1)])  # another rank's fault
    assert none.injections == []


def test_activation_fault_changes_that_step_only() -> None:
    clean_inj, clean, _ = _loop([])
    inj, outs, _ = _loop([Fault(target="activation", tensor="2", step=1, index=3, bit=30)])
    assert torch.equal(outs[0], clean[0])
    assert not torch.equal(outs[1], clean[1]) and outs[1].reshape(-1)[3] != clean[1].reshape(-1)[3]
    diff = (outs[1] != clean[1]).reshape(-1)
    assert diff.sum() == 1 and bool(diff[3])  # exactly the chosen element of the output
    assert [r.step for r in inj.injections] == [1]
    assert not torch.equal(outs[2], clean[2])  # the faulty step's update changed the weights afterwards


def test_gradient_fault() -> None:
    _, _, clean = _loop([])
    inj, _, grads = _loop([Fault(target="grad", tensor="2.weight", step=3, index=0, bit=0)])
    assert torch.equal(grads[2], clean[2])
    g, c = grads[3].reshape(-1), clean[3].reshape(-1)
    assert g[0] != c[0] and torch.equal(g[1:], c[1:])
    assert inj.injections[0].before == float(c[0])


def test_bad_faults() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(UsageError, match="Fault.target must be one of"):
        Fault(target="optimizer", tensor="weight", step=0)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="Fault.step must be an integer >= 0"):
        Fault(target="weight", tensor="weight", step=-1)
    with pytest.raises(UsageError, match="'fc.weight' is not a parameter of the model; parameters: weight, bias"):
        FaultInjector(model, [Fault(target="grad", tensor="fc.weight", step=0)])
    with pytest.raises(UsageError, match="Fault.index=9 is outside 'bias' \\(2 elements\\)"):
        FaultInjector(model, [Fault(target="weight", tensor="bias", step=0, index=9)])
    with pytest.raises(UsageError, match=r"\[\[faults\]\]: unknown key\(s\) \['when'\]"):
        Fault.from_dict({"target": "weight", "tensor": "weight", "when": 3})
    assert Fault.from_dict({"target": "grad", "tensor": "weight", "step": 3}).step == 3
    inj = FaultInjector(model, [Fault(target="grad", tensor="weight", step=0)])
    inj.before_forward(0)
    with pytest.raises(UsageError, match="has no .grad"):
        inj.after_backward(0)
