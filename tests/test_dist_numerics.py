"""NaN/Inf localisation and automatic fallback in data-parallel runs, under real torchrun processes (gloo, 2 ranks).

Oracles: faults injected by construction on rank 1 only (``_faulty_tasks``: a forward overflow at batch 3, so
logged step 4, with the local batch of 32 rows; a NaN in one backward gradient, which leaves the loss finite), so
the event must name rank 1, that module and role, and no other rank; the single-process run of the same fallback
config (``tests/test_fallback.py``'s ``tiny_input``: every first-layer input underflows, so the policy fires at its
second sample, step 6), which the DDP run must follow on both replicas.  Both ranks train on the same rows
(``copies = 2``), so DDP's averaged gradient is the single-process gradient exactly and the curves must be equal
bit for bit, which they are only if rank 1 swapped the layer too (a replica still on fp8 computes layer 0 from
all-zero inputs).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from lowprec import recipes
from lowprec.accuracy import Baseline, Criteria, RunData, build_baseline
from lowprec.accuracy._judge import judge
from lowprec.recipes import Fallback
from lowprec.runs._config import ParallelConfig, RunConfig, StatsConfig
from lowprec.runs._parallel import World
from lowprec.runs._runner import run_config, train
from lowprec.runs._store import RunStore
from lowprec.testing import torchrun

pytestmark = pytest.mark.slow  # make test-slow: real torchrun process groups

TESTS = Path(__file__).parent
POLICY = Fallback(underflow_pct=50, sqnr_db=10, patience=2, to="bf16")


@pytest.fixture(autouse=True)
def _workers_import_test_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]))
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dist_numerics") / "runs.db")
    torchrun(TESTS / "_dist_numerics_worker.py", path, timeout=600,
             env={"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])})
    return path


@pytest.fixture(scope="module")
def clean_baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Baseline]:
    """Per fault model: two single-process runs in which the fault never fires."""
    path = str(tmp_path_factory.mktemp("clean") / "runs.db")
    out = {}
    with RunStore(path) as store:
        for fault in ("overflow_at", "nan_grad_at"):
            cfg = RunConfig(model=f"_faulty_tasks:{fault}", model_options={"step": 10**6}, steps=8, eval_interval=4,
                            seeds=(1, 2), threads=1, recipe=recipes.get("fp8-tensorwise"), store=path)
            ids = run_config(cfg, store=store, progress=False)
            out[fault] = build_baseline(fault, [RunData.from_store(store, r) for r in ids],
                                        criteria=Criteria(min_loss_drop=0.0))  # 8 steps: a plumbing test
    return out


def _run(store: RunStore, group: str) -> str:
    (rec,) = store.list_runs(group=group)
    return rec.run_id


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize(("fault", "module", "type_name", "role"), [
    ("overflow_at", "layers.1.amp", "Overflow", "output"),
    ("nan_grad_at", "layers.1.bad", "NanGrad", "grad_input"),
])
def test_replay_names_the_faulty_rank_module_and_role(store_path: str, clean_baselines: dict[str, Baseline],
                                                      strategy: str, fault: str, module: str, type_name: str,
                                                      role: str) -> None:
    with RunStore(store_path) as store:
        rid = _run(store, f"loc/{strategy}/{fault}")
        (ev,) = store.events(rid, kind="nonfinite")
        (div,) = store.events(rid, kind="diverged")
        assert store.get_run(rid).status == "diverged"
        run = RunData.from_store(store, rid)
    p = ev["payload"]
    assert ev["step"] == div["step"] == 4
    assert (p["module"], p["role"], p["step"], p["rank"], p["world_size"]) == (module, role, 4, 1, 2)
    assert p["found"] and p["replay_exact"] and p["shape"] == [32, 128]
    assert list(p["ranks"]) == ["1"], "rank 0's replay of its own shard must find nothing"
    assert f"{role} of module '{module}'" in p["ranks"]["1"] and "on rank 1" in p["ranks"]["1"]
    assert float(p["loss"]) > 0 if fault == "nan_grad_at" else np.isnan(float(p["loss"]))  # rank 1's own loss
    (div_result,) = [r for r in judge(clean_baselines[fault], [run]).results if r.name == "divergence"]
    assert not div_result.passed and f"{role} of module '{module}' ({type_name}) at step 4 on rank 1" in \
        div_result.reason


def test_replay_of_a_ddp_first_step_scales_with_the_global_amax(store_path: str) -> None:
    """fp8-delayed's first step scales each delayed role with the current amax MAX-reduced over the ranks; the
    replay of that step must reduce it again (every rank replays, so the all-reduces pair up), or rank 1 replays
    with its own shard's amax and its loss differs from the logged one (``replay_exact`` false: checked by
    removing the snapshot of the started roles)."""
    with RunStore(store_path) as store:
        rid = _run(store, "loc/ddp/first_step")
        (ev,) = store.events(rid, kind="nonfinite")
    p = ev["payload"]
    assert (p["rank"], p["module"], p["role"], p["step"]) == (1, "layers.1.bad", "grad_input", 1)
    assert p["found"] and p["replay_exact"]
    assert math.isfinite(float(p["loss"]))


def test_ddp_fallback_is_applied_on_every_replica(store_path: str, tmp_path: Path) -> None:
    recipe = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=POLICY)
    cfg = RunConfig(model="_faulty_tasks:tiny_input", batch_size=32, steps=16, eval_interval=8, threads=1,
                    recipe=recipe, stats=StatsConfig(every=5), store=str(tmp_path / "one.db"))
    with RunStore(cfg.store) as one:
        (ref,) = run_config(cfg, store=one, progress=False)
        want_events = [(e["step"], e["payload"]["module"]) for e in one.events(ref, kind="fallback")]
        want = one.scalars(ref)["train/loss"][1]
    with RunStore(store_path) as store:
        rid = _run(store, "fallback/ddp")
        got_events = [(e["step"], e["payload"]["module"]) for e in store.events(rid, kind="fallback")]
        got = store.scalars(rid)["train/loss"][1]
    assert want_events == got_events == [(6, "layers.0")]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("rank", [0, 1])
def test_no_module_of_a_finished_run_outlives_train(store_path: str, rank: int) -> None:
    """After six DDP/FSDP2 runs (five diverged mid-run) nothing of their wrapped models is alive: train() collects
    the reference cycles FSDP2/DDP build, so nothing is left to be freed during interpreter shutdown.  Without the
    collection the ranks held 16 and 20 modules here (the cycles had not been collected on their own)."""
    assert Path(f"{store_path}.rank{rank}.alive").read_text() == "0"


def test_fallback_refuses_sharded_runs(tmp_path: Path) -> None:
    recipe = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=POLICY)
    cfg = RunConfig(model="mlp-digits", steps=4, recipe=recipe, store=str(tmp_path / "runs.db"),
                    parallel=ParallelConfig(strategy="fsdp2", world_size=2))
    with RunStore(cfg.store) as store, pytest.raises(ValueError, match="single-process and DDP runs.*'fsdp2'"):
        run_config(cfg, store=store, progress=False)


def test_train_refuses_a_world_set_up_for_another_strategy(tmp_path: Path) -> None:
    cfg = RunConfig(model="mlp-digits", steps=4, store=str(tmp_path / "runs.db"),
                    parallel=ParallelConfig(strategy="fsdp2", world_size=2))
    with RunStore(cfg.store) as store, pytest.raises(ValueError, match="set up for 'ddp'"):
        train(cfg, seed=0, store=store, world=World(rank=0, size=2, strategy="ddp"), progress=False)
