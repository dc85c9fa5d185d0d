"""``[reliability]`` and ``[[faults]]`` in single-process ``lowprec run``s: reruns, spikes, rollback, the ledger.

Oracles: a clean run of the same config (a transient fault that the rerun replaces leaves the curve identical to
the clean run's, bit for bit; periodic replays change nothing), the data (``_faulty_tasks.spike_at`` scales one
batch: skipping it removes the spike), and an uninterrupted run (a crashed run resumed from its checkpoint, which
reads the skip ledger back, gives the same curve)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lowprec import UsageError
from lowprec.reliability import Fault
from lowprec.reliability._config import ReliabilityConfig
from lowprec.runs import RunConfig, RunStore
from lowprec.runs._config import CheckpointConfig
from lowprec.runs._runner import resume_run, run_config


def _config(tmp_path: Path, **kw) -> RunConfig:
    base = dict(model="mlp-digits", steps=16, eval_interval=8, store=str(tmp_path / "runs.db"), seeds=(1,))
    base.update(kw)
    return RunConfig(**base)


def _run(cfg: RunConfig) -> tuple[str, RunStore]:
    store = RunStore(cfg.store)
    (rid,) = run_config(cfg, store=store, progress=False)
    return rid, store


def _curve(store: RunStore, rid: str) -> np.ndarray:
    return store.scalars(rid)["train/loss"][1]


def test_transient_activation_fault_is_rerun_and_leaves_the_clean_curve(tmp_path: Path) -> None:
    clean, s0 = _run(_config(tmp_path / "a", seeds=(0,)))
    fault = Fault(target="activation", tensor="layers.1", step=5, index=17, bit=30)  # 0.17 -> 5.8e37
    rel = ReliabilityConfig(fingerprints=True)
    rid, store = _run(_config(tmp_path / "b", seeds=(0,), faults=(fault,), reliability=rel))
    assert store.get_run(rid).status == "completed"
    (ev,) = store.events(rid, kind="rerun")
    p = ev["payload"]
    assert ev["step"] == 5 and p["reason"] == "nonfinite" and p["verdict"] == "transient" and p["action"] == "continue"
    assert p["ranks"] == [0] and p["tensors"] == ["activation:layers.1"]
    (inj,) = store.events(rid, kind="fault_injected")
    assert inj["payload"]["tensor"] == "layers.1" and inj["payload"]["step"] == 5
    np.testing.assert_array_equal(_curve(store, rid), _curve(s0, clean))  # the rerun's result, bit for bit


def test_transient_fault_without_fingerprints_names_rank_and_step(tmp_path: Path) -> None:
    fault = Fault(target="grad", tensor="head.weight", step=3, index=2, bit=30)
    rid, store = _run(_config(tmp_path, faults=(fault,)))
    (ev,) = store.events(rid, kind="rerun")
    p = ev["payload"]
    assert ev["step"] == 3 and p["verdict"] == "transient" and p["ranks"] == [0]
    assert p["tensors"] == ["grad:head.weight"]  # a fault after the reduction: the gradient that changed


def test_corrupted_weight_in_one_process_is_reproducible_and_diverges(tmp_path: Path) -> None:
    fault = Fault(target="weight", tensor="layers.0.weight", step=4, index=3, bit=30)
    rid, store = _run(_config(tmp_path, faults=(fault,)))
    (ev,) = store.events(rid, kind="rerun")
    assert ev["payload"]["verdict"] == "reproducible" and "one process" in ev["payload"]["detail"]
    assert store.get_run(rid).status == "diverged"
    (loc,) = store.events(rid, kind="nonfinite")  # the localisation replay still runs
    assert loc["step"] == 4


def test_nan_batch_is_reproducible_and_diverges_as_before(tmp_path: Path) -> None:
    rid, store = _run(_config(tmp_path, model="_faulty_tasks:nan_at", model_options={"step": 6}))
    assert store.get_run(rid).status == "diverged"
    (ev,) = store.events(rid, kind="rerun")
    assert ev["step"] == 7 and ev["payload"]["verdict"] == "reproducible" and ev["payload"]["action"] == "stop"
    assert store.events(rid, kind="diverged")[0]["step"] == 7


def test_nan_batch_skip_policy_skips_the_update(tmp_path: Path) -> None:
    rel = ReliabilityConfig(on_nonfinite="skip")
    rid, store = _run(_config(tmp_path, model="_faulty_tasks:nan_at", model_options={"step": 6}, reliability=rel))
    assert store.get_run(rid).status == "completed"
    sc = store.scalars(rid)
    steps, skipped = sc["train/update_skipped"]
    assert list(steps) == [7] and skipped[0] == 1.0
    (skip,) = store.events(rid, kind="skip")
    assert skip["payload"] == {"step": 7, "update_skipped": True, "reason": "nonfinite"}
    assert np.isfinite(sc["train/loss"][1][7:]).all()  # the NaN never reached the weights


def _spiky(tmp_path: Path, **kw) -> RunConfig:
    rel = ReliabilityConfig(**{"spike": "robust", **kw.pop("rel", {})})
    return _config(tmp_path, model="_faulty_tasks:spike_at", model_options={"step": 9}, reliability=rel,
                   checkpoint=CheckpointConfig(interval=4, keep=10), **kw)


def test_spike_rolls_back_skips_the_batch_and_is_recorded(tmp_path: Path) -> None:
    rid, store = _run(_spiky(tmp_path, steps=20))
    assert store.get_run(rid).status == "completed"
    (spike,) = store.events(rid, kind="spike")
    assert spike["step"] == 10 and spike["payload"]["rule"] == "robust"
    (rb,) = store.events(rid, kind="rollback")
    assert rb["payload"]["from_step"] == 10 and rb["payload"]["to_step"] == 8
    (skip,) = store.events(rid, kind="skip")
    assert skip["payload"]["batches"] == [9]
    (rerun,) = store.events(rid, kind="rerun")
    assert rerun["payload"]["verdict"] == "reproducible" and rerun["payload"]["action"] == "rollback"
    steps, loss = store.scalars(rid)["train/loss"]
    assert list(steps) == list(range(1, 21))  # the rolled-back steps were trained again
    # the same run on data without the spike, from step 9 on the batches after it: the curve agrees up to the
    # checkpoint, and afterwards it has no spike
    clean, s0 = _run(_config(tmp_path / "clean", steps=20))
    np.testing.assert_array_equal(loss[:8], _curve(s0, clean)[:8])
    assert loss[9] < 3 * np.median(loss[:9])


def test_spike_ledger_survives_a_crash_and_resume(tmp_path: Path) -> None:
    whole, s0 = _run(_spiky(tmp_path / "whole", steps=20))
    marker = tmp_path / "crashed"
    cfg = _spiky(tmp_path / "crash", steps=20)
    cfg = dataclasses.replace(cfg, model="_faulty_tasks:spike_crash",
                              model_options={"step": 9, "crash": 14, "marker": str(marker)})
    store = RunStore(cfg.store)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_config(cfg, store=store, progress=False)
    (rec,) = store.list_runs()
    assert rec.status == "failed"
    resume_run(rec.run_id, store=store, progress=False)
    np.testing.assert_array_equal(_curve(store, rec.run_id), _curve(s0, whole))
    assert len(store.events(rec.run_id, kind="skip")) == 1 and len(store.events(rec.run_id, kind="rollback")) == 1


def test_spike_skip_policy_and_early_max_rule(tmp_path: Path) -> None:
    rel = {"on_spike": "skip", "spike": "early-max", "spike_samples": 5, "spike_factor": 3.0}
    rid, store = _run(_spiky(tmp_path, rel=rel))
    (spike,) = store.events(rid, kind="spike")
    assert spike["step"] == 10 and spike["payload"]["rule"] == "early-max"
    assert list(store.scalars(rid)["train/update_skipped"][0]) == [10]


def test_periodic_replays_raise_no_false_alarm_and_change_no_bit(tmp_path: Path) -> None:
    a, sa = _run(_config(tmp_path / "a", reliability=ReliabilityConfig(replay_every=0)))
    b, sb = _run(_config(tmp_path / "b", reliability=ReliabilityConfig(replay_every=3, fingerprints=True)))
    np.testing.assert_array_equal(_curve(sa, a), _curve(sb, b))
    assert not [e for e in sb.events(b) if e["kind"] in ("rerun", "sdc", "spike")]


def test_sampled_replay_finds_a_finite_transient_fault(tmp_path: Path) -> None:
    fault = Fault(target="activation", tensor="layers.0", step=6, index=40, bit=3)  # a low mantissa bit
    rid, store = _run(_config(tmp_path, faults=(fault,), reliability=ReliabilityConfig(replay_every=2,
                                                                                        fingerprints=True)))
    (ev,) = store.events(rid, kind="rerun")
    p = ev["payload"]
    assert ev["step"] == 6 and p["reason"] == "sampled replay" and p["verdict"] == "transient"
    assert p["tensors"] == ["activation:layers.0"]


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="checkpoint.interval"):
        run_config(_config(tmp_path, reliability=ReliabilityConfig(spike="robust")), store=RunStore(tmp_path / "s"),
                   progress=False)
    with pytest.raises(UsageError, match="reliability.on_spike"):
        RunConfig.from_dict({"model": "mlp-digits", "reliability": {"on_spike": "pray"}})
    with pytest.raises(UsageError, match=r"\[\[faults\]\]: unknown key"):
        RunConfig.from_dict({"model": "mlp-digits", "faults": [{"target": "grad", "tensor": "x", "step": 1,
                                                                 "bits": 3}]})
    with pytest.raises(UsageError, match="not a parameter"):
        run_config(_config(tmp_path, faults=(Fault(target="grad", tensor="nope", step=1),)),
                   store=RunStore(tmp_path / "s2"), progress=False)
    cfg = RunConfig.from_toml('model = "mlp-digits"\n[reliability]\nspike = "robust"\n[checkpoint]\ninterval = 5\n'
                              '[[faults]]\ntarget = "weight"\ntensor = "head.weight"\nstep = 3\nrank = 1\n')
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert "reliability" not in RunConfig(model="mlp-digits").to_dict()


def test_judge_and_report_show_spikes_rollbacks_and_faults(tmp_path: Path) -> None:
    """A run that rolled a reproducible spike back FAILs the divergence guard naming it (its curve no longer
    shows it); a run whose transient fault was rerun away PASSes it, with the fault named; the report lists the
    reliability events."""
    from lowprec.accuracy import judge
    from lowprec.accuracy._baseline import RunData, build_baseline
    from lowprec.accuracy._report import write_report

    quiet = {"model": "_faulty_tasks:spike_at", "model_options": {"step": 10**6}}  # mlp-digits, no spike
    base_cfg = _config(tmp_path / "base", seeds=(0, 1, 2), steps=60, **quiet)
    store = RunStore(base_cfg.store)
    ids = run_config(base_cfg, store=store, progress=False)
    baseline = build_baseline("b", [RunData.from_store(store, i) for i in ids])
    spiky = _spiky(tmp_path / "spiky", seeds=(0,), steps=60)
    (sid,) = run_config(dataclasses.replace(spiky, store=base_cfg.store), store=store, progress=False)
    fault = Fault(target="grad", tensor="head.weight", step=3, index=2, bit=30)
    faulty = _config(tmp_path, seeds=(1,), steps=60, faults=(fault,), **quiet)
    (fid,) = run_config(dataclasses.replace(faulty, store=base_cfg.store), store=store, progress=False)
    v = judge(baseline, [RunData.from_store(store, sid)])
    div = next(r for r in v.results if r.name == "divergence")
    assert div.outcome == "fail" and "loss spike" in div.reason and "step 10" in div.reason
    v = judge(baseline, [RunData.from_store(store, fid)])
    div = next(r for r in v.results if r.name == "divergence")
    assert div.outcome == "pass" and "transient fault on rank(s) [0] at step 3" in div.reason
    html = write_report(tmp_path / "r.html", baseline=baseline, runs=[RunData.from_store(store, sid)],
                        verdict=None).read_text()
    assert "rollback" in html and "spike" in html
