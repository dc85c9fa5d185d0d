"""``lowprec.numerics``: ``tensor_stats``, ``StatsObserver``, ``worst_layers``.

Oracles: hand-worked values from the format definitions (float8_e4m3fn: max 448, smallest subnormal 2^-9;
float4_e2m1fn: grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, emax 2) and the OCP MX floor scale rule; ``lowprec.testing.sqnr_db``
for the SQNR; the scales that ``quantize_scaled`` returns for the scale statistics; for overflow, the same spec with
``saturate=False``, whose output is inf/NaN exactly where a value rounds past max (``quant._round`` docstring); for
the observer, a training run without it (bitwise-equal losses and weights), tensors captured independently by the
test (retain_grad, .grad) and ``tensor_stats`` on them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import lowprec
from lowprec import QuantSpec
from lowprec.numerics import STATS, StatsObserver, records_from_scalars, tensor_stats, worst_layers
from lowprec.quant import TwoLevelScales, fake_quantize, quantize_scaled
from lowprec.testing import sqnr_db

E4M3_NONE = QuantSpec(elem="float8_e4m3fn", scaling="none")


# ================================================================================================ tensor_stats
def test_hand_worked_e4m3_unscaled() -> None:
    # 1e-9 < 2^-10 (half the smallest subnormal 2^-9): underflows; 500 > 464 (midpoint of 448 and the next grid
    # value 480): overflows and saturates to 448; 1.0 is exact; 0 counts in neither denominator.
    x = torch.tensor([1e-9, 1.0, 500.0, 0.0])
    st = tensor_stats(x, E4M3_NONE)
    assert set(st) == set(STATS)
    assert st["amax"] == 500.0
    assert st["dynamic_range_log2"] == pytest.approx(math.log2(500.0 / float(torch.tensor(1e-9))), rel=1e-12)
    assert st["underflow_pct"] == pytest.approx(100 / 3)
    assert st["overflow_pct"] == pytest.approx(100 / 3)
    assert st["nonfinite_pct"] == 0.0
    # x_hat = [0, 1, 448, 0]: noise^2 = 1e-18 + 52^2, signal^2 = 1e-18 + 1 + 500^2 (float32 values of 1e-9)
    e = float(torch.tensor(1e-9))
    assert st["sqnr_db"] == pytest.approx(10 * math.log10((e * e + 1 + 500.0**2) / (e * e + 52.0**2)), rel=1e-12)
    assert st["scale_log2_min"] == st["scale_log2_mean"] == st["scale_log2_max"] == 0.0


def test_spec_none_and_degenerate_tensors() -> None:
    x = torch.tensor([[0.25, -4.0], [0.0, 1.0]])
    st = tensor_stats(x, None)
    assert st["amax"] == 4.0 and st["dynamic_range_log2"] == 4.0  # log2(4 / 0.25)
    assert st["underflow_pct"] == st["overflow_pct"] == 0.0 and st["sqnr_db"] == math.inf
    for t in (torch.zeros(3, 4), torch.full((3, 4), -2.5)):  # all-zero, constant: range 0
        for spec in (None, "fp8_e4m3_tensorwise", "mxfp4"):
            s = tensor_stats(t, spec)
            assert s["dynamic_range_log2"] == 0.0 and s["underflow_pct"] == 0.0 and s["overflow_pct"] == 0.0
    assert tensor_stats(torch.zeros(2, 3), "mxfp4")["scale_log2_max"] == 0.0  # no nonzero group: 0
    empty = tensor_stats(torch.zeros(0, 32), "mxfp4")
    assert empty["amax"] == 0.0 and empty["sqnr_db"] == math.inf
    with pytest.raises(ValueError, match="unknown QuantSpec name"):
        tensor_stats(x, "mxfp5")


def test_hand_worked_mxfp4_blocks() -> None:
    # OCP MX floor rule: scale 2^(floor(log2 amax) - emax_e2m1) = 2^(2 - 2) = 1 for amax 7.5 and for amax 6.5.
    # Row 0: 7.5 rounds (unbounded) to 8 > 6: overflow, saturates to 6; 0.2 < 0.25: underflows to 0.
    # Row 1: 6.5 rounds to 6 (nearer than 8): clipped by nothing, not an overflow; 0.3 rounds to 0.5.
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([7.5, 0.2, 1.0])
    x[1, :2] = torch.tensor([6.5, 0.3])
    st = tensor_stats(x, "mxfp4")
    q = fake_quantize(x, "mxfp4")
    assert q[0, :3].tolist() == [6.0, 0.0, 1.0] and q[1, :2].tolist() == [6.0, 0.5]
    assert st["underflow_pct"] == pytest.approx(100 / 5)
    assert st["overflow_pct"] == pytest.approx(100 / 5)
    assert st["scale_log2_min"] == st["scale_log2_max"] == 0.0
    assert st["sqnr_db"] == pytest.approx(sqnr_db(x, q), rel=1e-12)


def test_float32_multiplier_one_ulp_above_max_is_not_overflow() -> None:
    # m = fl(448 / amax) can round up, so fl(amax * m) lands one float32 ulp above 448; it still rounds to 448.
    a = next(float(v) for v in torch.linspace(1.0, 2.0, 1001)
             if float(v * (torch.tensor(448.0) / v)) > 448.0)
    x = torch.tensor([[a, 0.5 * a, -0.25 * a]])
    spec = QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1)
    assert tensor_stats(x, spec)["overflow_pct"] == 0.0
    assert torch.isfinite(fake_quantize(x, dataclasses.replace(spec, saturate=False))).all()


@pytest.mark.parametrize("spec", [
    QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1, margin=-2),  # scale 4x too small: overflows
    QuantSpec(elem="float8_e5m2", scaling="tensor", margin=-3),
    QuantSpec.named("mxfp8_e5m2"),  # floor rule: block maxima up to 2x above max
    QuantSpec(elem="float6_e2m3fn", scaling="block", block_size=16, scale_format="float8_e8m0fnu",
              scale_rounding="floor"),
    QuantSpec(elem="float8_e4m3fn", scaling="none", rounding="toward_zero"),
])
def test_overflow_equals_nonfinite_output_of_nonsaturating_spec(spec: QuantSpec) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g) * torch.logspace(-3, 3, 64)
    if spec.scaling == "none":
        x = x * 100.0
    st = tensor_stats(x, spec)
    nonsat = fake_quantize(x, dataclasses.replace(spec, saturate=False))
    if spec.format.special == "finite" or spec.rounding == "toward_zero":
        # No inf/NaN code (or round-toward-zero, which never overflows to inf): both variants saturate, so use the
        # grid instead.  e2m3: max 7.5 = 15 * 0.5 (top spacing 2^(2-3)), next 8, so |v| >= 7.75 rounds past max
        # (7.75 ties to the even 16 * 0.5); e4m3 toward zero: only |v| >= 480 (the next grid value) rounds past 448.
        assert torch.equal(nonsat, fake_quantize(x, spec))
        if spec.scaling == "none":
            v, bound = x, 480.0
        else:
            _, scales = quantize_scaled(x, spec)
            v, bound = (x.view(16, 4, 16) / scales.float().view(16, 4, 1)).view(16, 64), 7.75
        expected = (v.abs() >= bound).sum().item() * 100.0 / (x != 0).sum().item()
    else:
        expected = (~torch.isfinite(nonsat)).sum().item() * 100.0 / (x != 0).sum().item()
    assert expected > 0
    assert st["overflow_pct"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["fp8_e4m3_tensorwise", "fp8_e4m3_rowwise", "fp8_e4m3_1x128", "mxfp8_e4m3",
                                  "mxfp4", "nvfp4", "mxint8"])
def test_sqnr_underflow_and_scales_against_direct_computation(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 96, generator=g) * torch.logspace(-4, 2, 96)
    x[3, 5] = 0.0
    st = tensor_stats(x, name)
    q = fake_quantize(x, name)
    assert st["sqnr_db"] == pytest.approx(sqnr_db(x, q), rel=1e-12)
    nz = x != 0
    assert st["underflow_pct"] == pytest.approx(100.0 * (nz & (q == 0)).sum().item() / nz.sum().item(), rel=1e-12)
    _, scales = quantize_scaled(x, name)
    eff = (scales.group.float() * scales.tensor) if isinstance(scales, TwoLevelScales) else scales.float()
    lg = torch.log2(eff.double())
    assert st["scale_log2_min"] == pytest.approx(lg.min().item(), abs=1e-12)
    assert st["scale_log2_max"] == pytest.approx(lg.max().item(), abs=1e-12)
    assert st["scale_log2_mean"] == pytest.approx(lg.mean().item(), abs=1e-9)


def test_nonfinite_inputs() -> None:
    # An inf poisons its MX block (every element NaN): the block's 31 finite nonzeros count as overflow.
    x = torch.ones(2, 32)
    x[0, 0] = math.inf
    st = tensor_stats(x, "mxfp8_e4m3")
    assert st["nonfinite_pct"] == pytest.approx(100 / 64)
    assert st["overflow_pct"] == pytest.approx(100 * 31 / 64)
    assert st["amax"] == 1.0  # over finite elements
    assert math.isnan(st["sqnr_db"])


# ================================================================================================ observer
def _mlp(recipe: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    return lowprec.convert(model, recipe)


def _train(model: nn.Module, steps: int, observer: StatsObserver | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        if observer is not None:
            observer.step(step)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # an evaluation pass: never recorded
            model(x)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8-delayed"])
def test_observer_does_not_change_training(recipe: str) -> None:
    ref_model, obs_model = _mlp(recipe), _mlp(recipe)
    ref = _train(ref_model, 3)
    obs = StatsObserver(obs_model, every=2, what_if={"mxfp4": "mxfp4", "e5m2": "fp8_e5m2_rowwise"})
    got = _train(obs_model, 3, obs)
    obs.close()
    assert [float.hex(v) for v in got] == [float.hex(v) for v in ref]
    for (n, p), q in zip(ref_model.state_dict().items(), obs_model.state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    steps = sorted({r["step"] for r in obs.records()})
    assert steps == [0, 2]
    # per step: 3 layers x (3 operand roles x 3 specs + 3 other roles), minus the first layer's grad_input
    assert len(obs.records()) == 2 * (3 * (9 + 3) - 1)


def test_observer_records_the_right_tensors_and_specs() -> None:
    model = _mlp("fp8-rowwise")
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):  # the oracle: the tensors, captured independently of the observer
        def hook(mod: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
            captured[name + ".input"] = args[0].detach().clone()
            out.retain_grad()
            captured[name + ".out"] = out
        return hook

    for name in ("0", "4"):
        model.get_submodule(name).register_forward_hook(keep(name))
    obs = StatsObserver(model, every=1, what_if={"mxfp4": "mxfp4"})
    obs.step(0)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    recs = {(r["module"], r["role"], r["what_if"]): r for r in obs.records()}
    assert ("0", "grad_input", None) not in recs and ("2", "grad_input", None) in recs
    lin = model.get_submodule("4").recipe
    assert recs[("4", "input", None)]["spec"] == "float8_e4m3fn/axis"  # power-of-two (E8M0, ceil) rowwise scales
    assert recs[("4", "input", "mxfp4")]["spec"] == "mxfp4"
    assert recs[("4", "output", None)]["spec"] == "float32"
    assert recs[("0", "input", None)]["stats"] == tensor_stats(x, lin.forward.a.spec)
    assert recs[("0", "input", "mxfp4")]["stats"] == tensor_stats(x, "mxfp4")
    assert recs[("4", "input", None)]["stats"] == tensor_stats(captured["4.input"], lin.forward.a.spec)
    assert recs[("4", "weight", None)]["stats"] == tensor_stats(model[4].weight, lin.forward.b.spec)
    out = captured["4.out"]
    assert recs[("4", "output", None)]["stats"] == tensor_stats(out, None)
    assert recs[("4", "grad_output", None)]["stats"] == tensor_stats(out.grad, lin.grad_input.a.spec)
    assert recs[("4", "grad_weight", None)]["stats"] == tensor_stats(model[4].weight.grad, None)
    assert recs[("0", "grad_weight", None)]["stats"] == tensor_stats(model[0].weight.grad, None)
    # closed: no more records
    obs.close()
    obs.step(1)
    model(x).sum().backward()
    assert all(r["step"] == 0 for r in obs.records())


def test_scalars_round_trip_through_the_store(tmp_path) -> None:
    from lowprec.runs._store import RunStore

    model = _mlp("mxfp8")
    obs = StatsObserver(model, every=3, what_if={"mxfp4": "mxfp4"}, keep_history=True)  # records() after popping
    _train(model, 4, obs)
    scal = obs.scalars()
    assert sorted(scal) == [0, 3]
    assert "stats/2/grad_output/sqnr_db" in scal[3] and "stats/2/weight@mxfp4/underflow_pct" in scal[3]
    assert obs.pop_scalars() == scal and obs.pop_scalars() == {}
    with RunStore(tmp_path / "runs.sqlite") as store:
        rid = store.create_run(name="t", config={}, manifest={})
        for step, values in scal.items():
            store.log_scalars(rid, step, values)
        back = records_from_scalars(store.scalars(rid))
    orig = {(r["step"], r["module"], r["role"], r["what_if"]): r["stats"] for r in obs.records()}
    assert {(r["step"], r["module"], r["role"], r["what_if"]): r["stats"] for r in back} == orig
    assert worst_layers(back, n=3) == worst_layers(obs.records(), n=3)


def test_worst_layers_ranking() -> None:
    def rec(step: int, module: str, role: str, sqnr: float, under: float, what_if: str | None = None) -> dict:
        return {"step": step, "module": module, "role": role, "spec": "s", "what_if": what_if,
                "stats": {"sqnr_db": sqnr, "underflow_pct": under}}

    records = [rec(0, "a", "input", 30.0, 1.0), rec(1, "a", "input", 20.0, 3.0),  # mean 25, 2
               rec(0, "b", "weight", 10.0, 0.0), rec(1, "b", "weight", 12.0, 0.5),  # mean 11, 0.25
               rec(0, "c", "output", math.inf, 0.0),  # unquantized: never a worst SQNR
               rec(0, "d", "grad_output", math.nan, 9.0),  # NaN ranks worst
               rec(0, "a", "input", 1.0, 50.0, what_if="mxfp4")]
    got = worst_layers(records, n=10)
    assert [(r.module, r.role) for r in got] == [("d", "grad_output"), ("b", "weight"), ("a", "input")]
    assert got[1].value == 11.0 and got[1].steps == 2
    under = worst_layers(records, key="underflow_pct", n=2)
    assert [(r.module, r.role, r.value) for r in under] == [("d", "grad_output", 9.0), ("a", "input", 2.0)]
    assert worst_layers(records, what_if="mxfp4")[0].value == 1.0
    with pytest.raises(ValueError, match="not a statistic"):
        worst_layers(records, key="nope")


def test_observer_validation() -> None:
    with pytest.raises(ValueError, match="lowprec.convert"):
        StatsObserver(nn.Sequential(nn.Linear(2, 2)))
    model = _mlp("mxfp8")
    with pytest.raises(ValueError, match="every"):
        StatsObserver(model, every=0)
    with pytest.raises(ValueError, match="what_if"):
        StatsObserver(model, what_if={"a/b": "mxfp4"})
    with pytest.raises(ValueError, match=r"what_if\['x'\]"):
        StatsObserver(model, what_if={"x": "mxfp5"})
    with StatsObserver(model) as obs:
        with pytest.raises(ValueError, match="step"):
            obs.step(-1)


@pytest.mark.parametrize("spec", ["fp8_e4m3_tensorwise", "mxfp4", "nvfp4", "fp8_e4m3_rowwise", None,
                                  QuantSpec(elem="float8_e5m2", scaling="tensor", saturate=False, margin=-3),
                                  QuantSpec(elem="bfloat16", scaling="none", rounding="stochastic")], ids=str)
def test_fused_native_statistics_equal_the_tensor_operation_route(spec: QuantSpec | str | None) -> None:
    """Oracle: the tensor-operation implementation (``quant._native.enabled(False)``); counts and extrema must be
    identical, the double sums equal to 1e-12 (summation order differs), on inputs with zeros, subnormals, values
    that underflow and overflow, and inf/NaN."""
    from lowprec.quant import _native

    if not _native.available():
        pytest.skip("no C compiler here: the native kernels are not built")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(48, 64, generator=g) * torch.exp2(torch.randint(-30, 12, (48, 64), generator=g).float())
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-41, 3e38, -3e38])
    xs = [x, x.clone()]
    xs[1].view(-1)[5:8] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for t in xs:
        fused = tensor_stats(t, spec)
        with _native.enabled(False):
            ref = tensor_stats(t, spec)
        for k in fused:
            if math.isnan(ref[k]):
                assert math.isnan(fused[k]), k
            else:
                assert fused[k] == pytest.approx(ref[k], rel=1e-12, abs=0.0), (k, fused[k], ref[k])
