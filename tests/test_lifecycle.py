"""The run lifecycle both runners share (``lowprec.runs._lifecycle``): the resolved config, the eval and checkpoint
cadence, the records of create / drive / finish / fail, and the runners' imports.

Oracles: the zoo tasks' declared defaults (``make_defaults`` calls in ``runs/zoo``, typed here by hand) and the
expressions the runners used before the resolved config existed (``config.steps or 0``, ``config.eval_interval or
1``, ``config.optimizer.lr or 0.0``, ``config.stats.every or (FALLBACK_EVERY if fallback else None)``); cadences
worked out by hand; the store's own records of a fake loop; a PyTorch and a JAX run of the same config (the same
keys); a fresh interpreter's ``sys.modules``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from lowprec import recipes
from lowprec.recipes import Fallback
from lowprec.runs import zoo
from lowprec.runs._config import CheckpointConfig, OptimizerConfig, RunConfig, StatsConfig
from lowprec.runs._lifecycle import (
    FALLBACK_EVERY,
    ResolvedConfig,
    RunLifecycle,
    build_task,
    resolve,
    resolve_for_task,
    run_manifest,
)
from lowprec.runs._store import RunStore

ZOO_DEFAULTS = {  # (steps, lr, optimizer, eval_interval, warmup): the make_defaults calls of the built-in tasks
    "mlp-digits": (300, 3e-3, "adamw", 50, 20),
    "cnn-digits": (400, 3e-3, "adamw", 50, 20),
    "synthetic-regression": (400, 0.02, "sgd", 50, 0),
    "gpt-bytes": (600, 3e-3, "adamw", 100, 50),
    "hf-causal-lm": (300, 3e-3, "adamw", 100, 30),
}


def test_resolved_config_has_no_optional_field() -> None:
    hints = typing.get_type_hints(ResolvedConfig)
    for f in dataclasses.fields(ResolvedConfig):
        t = hints[f.name]
        assert type(None) not in typing.get_args(t) and t is not type(None), f"{f.name}: {t}"
        assert not isinstance(t, types.UnionType), f"{f.name}: {t}"
    assert dataclasses.is_dataclass(ResolvedConfig) and ResolvedConfig.__dataclass_params__.frozen  # type: ignore


@pytest.mark.parametrize("name", sorted(ZOO_DEFAULTS))
def test_resolved_values_are_what_the_runner_used(name: str) -> None:
    assert set(ZOO_DEFAULTS) == set(zoo.names())
    config = RunConfig(model=name)
    task = build_task(config, 0)
    r = resolve_for_task(config, task, 0)
    steps, lr, optimizer, every, warmup = ZOO_DEFAULTS[name]
    assert (r.steps, r.lr, r.optimizer, r.eval_interval, r.warmup_steps) == (steps, lr, optimizer, every, warmup)
    assert r.batch_size == task.samples_per_step
    # the runners' former fallbacks on the RunConfig they resolved
    old = config.for_seed(0).resolve({**task.defaults, "batch_size": task.samples_per_step})
    assert r.config == old
    assert r.steps == (old.steps or 0) and r.eval_interval == (old.eval_interval or 1)
    assert r.lr == (old.optimizer.lr or 0.0) and r.batch_size == old.batch_size
    assert r.grad_clip == old.optimizer.grad_clip == 1.0
    assert r.stats_every == 0 and old.stats.every is None and old.recipe.fallback is None
    assert (r.checkpoint_interval, r.checkpoint_keep, r.threads) == (0, 2, 0)
    assert (r.name, r.group) == (f"{name} fp32 seed 0", f"{name} fp32")
    assert [r.lr_at(s) for s in (0, steps // 2, steps - 1)] == [
        old.schedule.lr_at(s, lr=lr, steps=steps) for s in (0, steps // 2, steps - 1)]


def test_declared_values_win_and_stats_every_follows_the_fallback_policy() -> None:
    config = RunConfig(model="mlp-digits", steps=7, batch_size=16, eval_interval=3, seeds=(0, 5), group="g",
                       optimizer=OptimizerConfig(name="sgd", lr=0.5, grad_clip=None),
                       checkpoint=CheckpointConfig(interval=2, keep=3), threads=1)
    r = resolve(config, seed=5, defaults={"steps": 99, "lr": 1e-3, "warmup_steps": 4})
    assert (r.steps, r.batch_size, r.eval_interval, r.optimizer, r.lr, r.warmup_steps) == (7, 16, 3, "sgd", 0.5, 4)
    assert (r.grad_clip, r.checkpoint_interval, r.checkpoint_keep, r.threads, r.group) == (0.0, 2, 3, 1, "g")
    assert r.config.seeds == (5,) and r.seed == 5
    assert resolve(RunConfig(model="m", stats=StatsConfig(every=7)), seed=0, defaults={}).stats_every == 7
    fallback = dataclasses.replace(recipes.get("fp8-unscaled"), fallback=Fallback(underflow_pct=50, to="bf16"))
    assert resolve(RunConfig(model="m", recipe=fallback), seed=0, defaults={}).stats_every == FALLBACK_EVERY == 50
    with_every = RunConfig(model="m", recipe=fallback, stats=StatsConfig(every=5))
    assert resolve(with_every, seed=0, defaults={}).stats_every == 5


def _cadence(steps: int, eval_interval: int, interval: int) -> ResolvedConfig:
    return resolve(RunConfig(model="m", steps=steps, eval_interval=eval_interval,
                             checkpoint=CheckpointConfig(interval=interval)), seed=0, defaults={})


def test_cadence_by_hand() -> None:
    r = _cadence(10, 4, 3)
    assert [s for s in range(1, 11) if r.evaluates(s)] == [4, 8, 10]
    assert r.evaluates(3, diverged=True)
    assert [s for s in range(1, 11) if r.checkpoints(s)] == [3, 6, 9]
    r = _cadence(9, 9, 3)
    assert [s for s in range(1, 10) if r.evaluates(s)] == [9]
    assert [s for s in range(1, 10) if r.checkpoints(s)] == [3, 6]  # step 9 saves as the end of the run
    assert not any(_cadence(5, 1, 0).checkpoints(s) for s in range(1, 6))


def _fake_step(diverge_at: int | None = None) -> Any:
    def step_fn(step: int) -> tuple[dict[str, float], dict[str, Any] | None, bool]:
        bad = step + 1 == diverge_at
        loss = float("nan") if bad else 1.0 / (step + 1)
        return {"train/loss": loss, "train/grad_norm": 0.5}, ({"module": "fc"} if bad else None), bad

    return step_fn


def _life(tmp_path: Path, r: ResolvedConfig, **kw: Any) -> tuple[RunLifecycle, RunStore, str]:
    store = RunStore(tmp_path / "runs.db")
    task = build_task(RunConfig(model="mlp-digits", model_options={"hidden": 8}), 0)
    life = RunLifecycle(r, store, progress=False, **kw)
    rid = life.create(run_manifest(r, task, device="cpu", world_size=1)) if kw.get("is_main", True) else ""
    return life, store, rid


def test_drive_records_evaluates_and_saves_on_the_cadence(tmp_path: Path) -> None:
    life, store, rid = _life(tmp_path, _cadence(10, 4, 3))
    saved: list[int] = []
    with life.running(rid, 0):
        diverged = life.drive(_fake_step(), evaluate=lambda s: {"eval/loss": float(s)}, save=saved.append)
    life.finish(diverged=diverged)
    assert not diverged and saved == [3, 6, 9, 10]
    sc = store.scalars(rid)
    assert list(sc["train/loss"][0]) == list(range(1, 11)) and list(sc["eval/loss"][0]) == [4, 8, 10]
    rec = store.get_run(rid)
    assert (rec.status, rec.name, rec.group, rec.config["steps"]) == ("completed", "m fp32 seed 0", "m fp32", 10)
    assert rec.manifest["checkpoint_records"] is True and rec.manifest["world_size"] == 1
    store.close()


def test_drive_stops_at_a_diverged_step(tmp_path: Path) -> None:
    life, store, rid = _life(tmp_path, _cadence(10, 4, 3))
    saved: list[int] = []
    with life.running(rid, 0):
        diverged = life.drive(_fake_step(diverge_at=5), evaluate=lambda s: {"eval/loss": 0.0}, save=saved.append)
    life.finish(diverged=diverged)
    assert diverged and saved == [3, 5]
    assert [e["kind"] for e in store.events(rid)] == ["nonfinite", "diverged"]
    assert store.events(rid, kind="diverged")[0]["payload"] == {"loss": "nan", "grad_norm": "0.5"}
    assert list(store.scalars(rid)["eval/loss"][0]) == [4, 5] and store.get_run(rid).status == "diverged"
    store.close()


def test_resumed_reopens_from_the_step(tmp_path: Path) -> None:
    life, store, rid = _life(tmp_path, _cadence(6, 2, 0))
    with pytest.raises(KeyboardInterrupt), life.running(rid, 0):
        life.drive(_fake_step(), evaluate=lambda s: {}, save=lambda s: None)  # runs to the end ...
        raise KeyboardInterrupt  # ... and is stopped before finishing
    life.resumed(rid, 4, world_size=1, checkpoint="file")
    assert list(store.scalars(rid)["train/loss"][0]) == [1, 2, 3, 4] and store.get_run(rid).status == "running"
    assert store.events(rid, kind="resumed")[0]["payload"] == {"from_step": 4, "world_size": 1, "checkpoint": "file"}
    with life.running(rid, life.step):
        life.finish(diverged=life.drive(_fake_step(), evaluate=lambda s: {}, save=lambda s: None))
    assert list(store.scalars(rid)["train/loss"][0]) == [1, 2, 3, 4, 5, 6] and store.get_run(rid).status == "completed"
    store.close()


def test_an_interrupt_marks_the_run_failed_with_the_reason(tmp_path: Path) -> None:
    from lowprec.cli import Terminated

    life, store, rid = _life(tmp_path, _cadence(4, 2, 0))
    with pytest.raises(Terminated), life.running(rid, 0):
        raise Terminated(15)
    rec = store.get_run(rid)
    assert (rec.status, rec.error) == ("failed", "Terminated: interrupted by SIGTERM")
    life2, store2, rid2 = _life(tmp_path / "b", _cadence(4, 2, 0))
    with pytest.raises(KeyboardInterrupt), life2.running(rid2, 0):
        raise KeyboardInterrupt
    assert store2.get_run(rid2).error == "interrupted (KeyboardInterrupt)"
    other = RunLifecycle(_cadence(4, 2, 0), store2, progress=False, is_main=False, rank=1)
    with pytest.raises(ValueError), other.running(rid2, 3):
        raise ValueError("boom")
    assert store2.events(rid2, kind="rank_failure")[0]["payload"] == {"rank": 1, "error": "ValueError: boom"}
    store.close()
    store2.close()


def test_torch_and_jax_runs_record_the_same_keys(tmp_path: Path) -> None:
    from lowprec.runs._runner import run_config

    # a config read from a file (load_config sets config_dir): both manifests record the folder
    base = RunConfig(model="mlp-digits", steps=3, eval_interval=2, model_options={"hidden": 16},
                     config_dir=str(tmp_path))
    with RunStore(tmp_path / "runs.db") as store:
        (t,) = run_config(base, store=store, progress=False)
        (j,) = run_config(dataclasses.replace(base, framework="jax"), store=store, progress=False)
        rt, rj = store.get_run(t), store.get_run(j)
        assert set(store.scalars(t)) == set(store.scalars(j))
        assert {k for k in store.scalars(t) if k.startswith("eval/")} == {"eval/loss", "eval/accuracy"}
        assert set(rj.manifest) - set(rt.manifest) == {"framework"} and set(rt.manifest) <= set(rj.manifest)
        assert set(rt.config) == set(rj.config) and rt.config["steps"] == rj.config["steps"] == 3
        assert [s for s in store.scalars(j)["eval/loss"][0]] == [2, 3] == list(store.scalars(t)["eval/loss"][0])
        assert (rt.status, rj.status) == ("completed", "completed")
        assert rt.manifest["config_dir"] == rj.manifest["config_dir"] == str(tmp_path)


@pytest.mark.parametrize("module", ["lowprec.runs._runner", "lowprec.runs._lifecycle", "lowprec.train"])
def test_the_torch_runner_does_not_import_jax(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
