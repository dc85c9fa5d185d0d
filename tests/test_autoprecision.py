"""Automatic precision (``lowprec.numerics._autoprecision``) and the ``lowprec autoprecision`` command.

Oracles: brute-force enumeration of every assignment for the knapsack solver; bit counts written out from the
OCP MX v1.0 and NVFP4 layouts (k elements share one 8-bit scale; NVFP4 adds one float32 per tensor); the
plan's own assignment for which module ``lowprec.convert`` gives which recipe; ``Recipe`` JSON/TOML parsing for
the round trip; the run store read back for the run that ``lowprec run`` makes from the written config; for the
training probe, a recording stand-in trainer (which recipe was trained with which seed) and, end to end, the final
eval losses of the probe runs read back from the run store.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch
from torch import nn

import lowprec
from lowprec.cli import main
from lowprec.nn import EmulatedLinear
from lowprec.numerics._autoprecision import (
    bits_per_element,
    choose_precision,
    probe_recipe,
    solve_budget,
    storage_bits,
    training_linear,
    training_probe,
    uniform_plan,
)
from lowprec.numerics._sensitivity import LayerSensitivity, resolve_candidate
from lowprec.quant import QuantSpec
from lowprec.recipes import Recipe
from lowprec.runs._store import RunStore


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _brute(values: list[list[float]], costs: list[list[int]], capacity: int) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(v)) for v in values)):
        if sum(c[j] for c, j in zip(costs, choice, strict=True)) <= capacity:
            best = min(best, sum(v[j] for v, j in zip(values, choice, strict=True)))
    return best


def test_solver_finds_the_brute_force_optimum() -> None:
    """Oracle: enumeration of every assignment of 400 random instances (1-6 items, 1-4 options each)."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 6)
        values = [[rng.choice([rng.random(), rng.random() * 1e-3, 0.0]) for _ in range(rng.randint(1, 4))]
                  for _ in range(n)]
        costs = [[rng.randint(1, 40) for _ in v] for v in values]
        lo, hi = sum(map(min, costs)), sum(map(max, costs))
        capacity = rng.randint(lo, hi)
        choice, exact = solve_budget(values, costs, capacity)
        assert exact
        assert sum(c[j] for c, j in zip(costs, choice, strict=True)) <= capacity
        assert sum(v[j] for v, j in zip(values, choice, strict=True)) == pytest.approx(
            _brute(values, costs, capacity), rel=1e-12, abs=1e-15)


def test_greedy_fallback_respects_the_budget_and_says_so() -> None:
    """Oracle: the budget inequality; brute force as an upper bound on quality (greedy is never better)."""
    rng = random.Random(1)
    for _ in range(100):
        values = [[rng.random() for _ in range(3)] for _ in range(5)]
        costs = [[rng.randint(1, 20) for _ in range(3)] for _ in range(5)]
        capacity = rng.randint(sum(map(min, costs)), sum(map(max, costs)))
        choice, exact = solve_budget(values, costs, capacity, max_states=0)  # greedy at once
        assert not exact
        assert sum(c[j] for c, j in zip(costs, choice, strict=True)) <= capacity
        assert sum(v[j] for v, j in zip(values, choice, strict=True)) >= _brute(values, costs, capacity) - 1e-12
    with pytest.raises(ValueError, match=r"budget \(5 bits\) is below the cheapest choice \(6 bits\)"):
        solve_budget([[1.0], [1.0]], [[3], [3]], 5)


def test_storage_bits_count_elements_and_scales() -> None:
    """Oracle: the formats' layouts counted by hand."""
    assert storage_bits(QuantSpec.named("mxfp4"), (64, 128)) == 4 * 64 * 128 + 8 * 64 * 4  # 4.25 bits
    assert bits_per_element("mxfp4", (64, 128)) == 4.25
    assert bits_per_element("mxfp6_e2m3", (10, 128)) == 6.25
    assert bits_per_element("mxfp8_e4m3") == 8.25
    assert storage_bits(QuantSpec.named("nvfp4"), (16, 32)) == 4 * 512 + 8 * 32 + 32  # e4m3 per 16, fp32 tensor
    assert storage_bits(QuantSpec.named("mxfp4"), (2, 40)) == 4 * 80 + 8 * 2 * 2  # a short last block
    assert bits_per_element("bf16") == 16.0 and bits_per_element(None) == 32.0
    assert storage_bits(QuantSpec.named("fp8_e4m3_tensorwise"), (8, 8)) == 8 * 64 + 32
    assert storage_bits(QuantSpec.named("fp8_e4m3_rowwise"), (8, 16)) == 8 * 128 + 32 * 8


def _table(noise: dict[tuple[str, str], float], shapes: dict[str, tuple[int, int]]) -> list[LayerSensitivity]:
    import math

    return [LayerSensitivity(name=g, modules=(g,), shapes=(shapes[g],), spec=s,
                             sqnr_db=math.inf if p == 0 else -10 * math.log10(p), loss=0.0, loss_delta=0.0)
            for (g, s), p in noise.items()]


def test_choose_precision_is_optimal_on_a_table_and_within_budget() -> None:
    """Oracle: brute force over the 4^3 assignments, bits counted with the hand-checked storage_bits."""
    rng = random.Random(2)
    specs = ["mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bfloat16"]
    shapes = {"a": (64, 64), "b": (128, 64), "c": (10, 128)}
    for budget in (4.25, 4.6, 5.0, 6.0, 7.5, 9.0, 16.0):
        noise = {(g, s): rng.random() * 10.0 ** -i for g in shapes for i, s in enumerate(specs)}
        plan = choose_precision(_table(noise, shapes), budget_bits=budget)
        elements = sum(a * b for a, b in shapes.values())
        assert plan.exact and plan.average_bits <= budget
        best = min((sum(noise[(g, s)] for g, s in zip(shapes, combo, strict=True)), combo)
                   for combo in itertools.product(specs, repeat=3)
                   if sum(storage_bits(resolve_candidate(s)[1], shapes[g]) for g, s in zip(shapes, combo,
                                                                                          strict=True))
                   <= budget * elements)
        got = sum(noise[(g, plan.spec_of(g))] for g in shapes)
        assert got == pytest.approx(best[0], rel=1e-12)
    with pytest.raises(ValueError, match=r"budget_bits=4 is below the cheapest mix .* \(4.25 bits"):
        choose_precision(_table(noise, shapes), budget_bits=4)


def test_written_recipe_round_trips_and_converts_the_right_modules() -> None:
    """Oracle: the plan's assignment (each module gets training_linear of its group's spec); JSON/TOML parsing."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 10)))
    shapes = {"0": (64, 32), "2.0": (32, 64), "2.1": (10, 32)}
    noise = {(g, s): p for g in shapes for s, p in (("mxfp4", 1e-2), ("bfloat16", 1e-5))}
    noise[("2.1", "mxfp4")] = 1.0  # the head is the sensitive one: it gets bf16
    plan = choose_precision(_table(noise, shapes), budget_bits=5.5)
    assert dict(plan.assignment) == {"0": "mxfp4", "2.0": "mxfp4", "2.1": "bfloat16"}
    recipe = plan.to_recipe(name="auto")
    assert Recipe.from_json(recipe.to_json()) == recipe and Recipe.from_toml(recipe.to_toml()) == recipe
    lowprec.convert(model, Recipe.from_toml(recipe.to_toml()))
    converted = {n: m.recipe for n, m in model.named_modules() if isinstance(m, EmulatedLinear)}
    assert converted == {g: training_linear(resolve_candidate(s)[1]) for g, s in plan.assignment}
    assert converted["2.1"].forward.a.spec == QuantSpec(elem="bfloat16", scaling="none", saturate=False)
    assert converted["0"].grad_input.a.spec.rounding == "stochastic"  # fp4 gradients round stochastically
    assert converted["0"].forward.a.spec == QuantSpec.named("mxfp4")
    uni = uniform_plan(_table(noise, shapes), "mxfp4")
    assert uni.average_bits == pytest.approx(4.25 + 32 * 0 / 1) and set(dict(uni.assignment).values()) == {"mxfp4"}


def test_cli_writes_a_recipe_that_lowprec_run_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored autoprecision event (budget), the written files parsed back, and the run that
    ``lowprec run`` records from the written config (its recipe equals the written one)."""
    cfg = tmp_path / "mlp.toml"
    cfg.write_text(f'model = "mlp-digits"\nseed = 0\nsteps = 6\nbatch_size = 16\nthreads = 1\n'
                   f'store = "{tmp_path / "runs.db"}"\n[model_options]\nhidden = 32\n', encoding="utf-8")
    rec, run_cfg = tmp_path / "auto.json", tmp_path / "auto-run.toml"
    assert main(["autoprecision", str(cfg), "--budget-bits", "5", "--batches", "2", "--quiet", "--out", str(rec),
                 "--config-out", str(run_cfg)]) == 0
    out = capsys.readouterr().out
    assert "exact optimum" in out and f"wrote {rec}" in out
    recipe = Recipe.from_json(rec.read_text())
    assert {p for p, _ in recipe.overrides} == {"layers.0", "layers.1", "head"}
    with RunStore(tmp_path / "runs.db") as store:
        (cal,) = store.list_runs(group="calibration/mlp-digits")
        (event,) = store.events(cal.run_id, kind="autoprecision")
    assert event["payload"]["plan"]["average_bits"] <= 5 and event["payload"]["recipe"] == recipe.to_dict()
    assert main(["run", str(run_cfg), "--quiet"]) == 0
    with RunStore(tmp_path / "runs.db") as store:
        (run,) = [r for r in store.list_runs() if r.run_id != cal.run_id]
    assert Recipe.from_dict(run.config["recipe"]) == recipe and run.status == "completed"
    capsys.readouterr()
    assert main(["autoprecision", str(cfg), "--budget-bits", "3", "--quiet", "--run", cal.run_id,
                 "--store", str(tmp_path / "runs.db")]) == 2
    assert "budget_bits=3.0 is below the cheapest mix" in capsys.readouterr().err
    assert main(["autoprecision", str(cfg), "--budget-bits", "5", "--out", "x.yaml"]) == 2
    assert "'x.yaml' must end in .toml or .json" in capsys.readouterr().err


# ================================================================================================ training probe
def test_training_probe_trains_each_group_alone_with_paired_seeds() -> None:
    """Oracle: a recording stand-in trainer: one float32 run per seed, one run per (quantized row, seed) whose
    recipe overrides exactly the row's modules with training_linear(spec); probe_delta is the mean paired
    difference, written out."""
    shapes = {"a": (64, 64), "b": (32, 64)}
    table = [LayerSensitivity(name="ab", modules=("a", "b"), shapes=(shapes["a"], shapes["b"]), spec=s,
                              sqnr_db=20.0, loss=0.0, loss_delta=0.0) for s in ("mxfp4", "mxfp4/b64", "float32")]
    calls: list[tuple[object, int]] = []

    def fake_loss(recipe: Recipe | None, seed: int) -> float:
        calls.append((recipe, seed))
        if recipe is None:
            return 1.0 + seed
        assert recipe.linear == training_linear(None)  # every other linear float32
        ((pa, lin), (pb, lin_b)) = recipe.overrides
        assert (pa, pb) == ("a", "b") and lin == lin_b
        return 1.0 + seed + {4.25: 0.5, 4.125: 0.25}[bits_per_element(lin.forward.a.spec, (64, 64))] * (seed + 1)

    rows = training_probe(table, fake_loss, seeds=[7, 8])
    assert [r.probe_delta for r in rows] == [pytest.approx((0.5 * 8 + 0.5 * 9) / 2),
                                             pytest.approx((0.25 * 8 + 0.25 * 9) / 2), 0.0]
    assert [(None if r is None else r.name, s) for r, s in calls] == [
        (None, 7), (None, 8), ("probe ab mxfp4", 7), ("probe ab mxfp4", 8), ("probe ab mxfp4/b64", 7),
        ("probe ab mxfp4/b64", 8)]  # the float32 row is not trained
    assert probe_recipe(table[1]).overrides[0][1] == training_linear(
        QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=64, scale_format="float8_e8m0fnu",
                  scale_rounding="floor"))
    assert [r.sqnr_db for r in rows] == [20.0] * 3  # the rest of the row is kept
    assert LayerSensitivity.from_dict(rows[0].to_dict()) == rows[0]
    with pytest.raises(ValueError, match="at least one probe seed"):
        training_probe(table, fake_loss, seeds=[])


def test_probe_metric_minimises_the_summed_loss_change_within_budget() -> None:
    """Oracle: brute force over the 4^3 assignments minimising the summed probe_delta under the budget, where the
    output SQNR would choose differently."""
    specs = ["mxfp4/b128", "mxfp4", "nvfp4", "mxfp6_e2m3"]
    shapes = {"l0": (128, 64), "l1": (128, 128), "head": (10, 128)}
    table = _table({(g, s): 1e-2 for g in shapes for s in specs}, shapes)
    rng = random.Random(3)
    for budget in (4.2, 4.25, 4.5, 5.0):
        deltas = {(r.name, r.spec): rng.uniform(-0.01, 0.03) for r in table}
        probed = [dataclasses.replace(r, probe_delta=deltas[(r.name, r.spec)]) for r in table]
        plan = choose_precision(probed, budget_bits=budget, metric="probe")
        elements = sum(a * b for a, b in shapes.values())
        feasible = [(sum(deltas[(g, s)] for g, s in zip(shapes, combo, strict=True)), combo)
                    for combo in itertools.product(specs, repeat=3)
                    if sum(storage_bits(resolve_candidate(s)[1], shapes[g])
                           for g, s in zip(shapes, combo, strict=True)) <= budget * elements]
        best = min(feasible)
        assert plan.exact and plan.metric == "probe" and plan.average_bits <= budget
        assert plan.predicted_loss_delta == pytest.approx(best[0], rel=1e-12)
        assert sum(deltas[(g, plan.spec_of(g))] for g in shapes) == pytest.approx(best[0], rel=1e-12)
    with pytest.raises(ValueError, match="has no probe_delta: run training_probe"):
        choose_precision(table, budget_bits=4.5, metric="probe")
    with pytest.raises(ValueError, match="metric must be one of sqnr, probe"):
        choose_precision(table, budget_bits=4.5, metric="grad")


def test_cli_probe_metric_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the probe runs' final eval losses read back from the run store (one float32 run per seed, one run
    per quantized row and seed, each overriding only its layer), the probe deltas recomputed from them, and brute
    force over the stored table for the chosen plan (average bits within the budget)."""
    cfg = tmp_path / "mlp.toml"
    cfg.write_text(f'model = "mlp-digits"\nseed = 0\nsteps = 6\nbatch_size = 16\nthreads = 1\n'
                   f'store = "{tmp_path / "runs.db"}"\n[model_options]\nhidden = 32\n', encoding="utf-8")
    cands = ["mxfp4/b128", "mxfp4", "nvfp4"]
    assert main(["autoprecision", str(cfg), "--budget-bits", "4.25", "--batches", "2", "--quiet", "--metric",
                 "probe", "--probe-steps", "3", "--probe-seeds", "2", "--candidates", ",".join(cands)]) == 0
    out = capsys.readouterr().out
    assert "minimising probe" in out and "predicted probe loss change" in out
    with RunStore(tmp_path / "runs.db") as store:
        (cal,) = store.list_runs(group="calibration/mlp-digits")
        (event,) = store.events(cal.run_id, kind="autoprecision")
        probes = store.list_runs(group="probe/mlp-digits")
        final = {}
        for r in probes:
            rec = Recipe.from_dict(r.config["recipe"])
            key = (rec.name, int(r.manifest["seed"]))
            assert key not in final and r.config["steps"] == 3
            final[key] = float(store.scalars(r.run_id)["eval/loss"][1][-1])
    table = [LayerSensitivity.from_dict(d) for d in event["payload"]["table"]]
    assert len(probes) == 2 * (1 + len(table)) and {s for _, s in final} == {0, 1}
    for row in table:
        deltas = [final[(f"probe {row.name} {row.spec}", s)] - final[("fp32", s)] for s in (0, 1)]
        assert row.probe_delta == pytest.approx(sum(deltas) / 2, abs=1e-12)
    plan = event["payload"]["plan"]
    groups = list(dict.fromkeys(r.name for r in table))
    by = {(r.name, r.spec): r for r in table}
    elements = sum(by[(g, cands[0])].params for g in groups)

    def bits(combo: tuple[str, ...]) -> int:
        return sum(storage_bits(resolve_candidate(s)[1], sh) for g, s in zip(groups, combo, strict=True)
                   for sh in by[(g, s)].shapes)

    best = min((sum(by[(g, s)].probe_delta for g, s in zip(groups, combo, strict=True)), combo)
               for combo in itertools.product(cands, repeat=len(groups)) if bits(combo) <= 4.25 * elements)
    assert plan["metric"] == "probe" and plan["average_bits"] <= 4.25
    assert plan["predicted_loss_delta"] == pytest.approx(best[0], abs=1e-12)
