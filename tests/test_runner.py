"""The runner: determinism, recorded scalars and manifest, checkpoints and resume, divergence, failures.

Oracles: an uninterrupted run of the same config (resume must reproduce it bit for bit: ``np.array_equal`` on the
float64 values read back from SQLite, which hold the float32 losses exactly); the task object itself (data hash);
a second run with the same seed (determinism); a process killed with SIGKILL (real subprocess) for crash safety.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowprec import recipes
from lowprec.cli import main
from lowprec.runs._checkpoint import checkpoint_dir, list_checkpoints
from lowprec.runs._config import CheckpointConfig, RunConfig
from lowprec.runs._runner import resume_run, run_config
from lowprec.runs._store import RunStore
from lowprec.runs.zoo import get_task

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"


def _config(tmp_path: Path, **kw) -> RunConfig:
    base = dict(model="mlp-digits", steps=30, eval_interval=10, store=str(tmp_path / "runs.db"))
    base.update(kw)
    return RunConfig(**base)


def _loss(store: RunStore, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    return store.scalars(run_id)["train/loss"]


@pytest.mark.parametrize("recipe", ["fp32", "bf16-sr", "fp8-delayed"])
def test_same_seed_same_bits_and_complete_record(tmp_path: Path, recipe: str) -> None:
    cfg = _config(tmp_path, recipe=recipes.get(recipe))
    with RunStore(cfg.store) as store:
        a, b = run_config(dataclasses.replace(cfg, seeds=(3, 3 + 1)), store=store, progress=False)
        (c,) = run_config(dataclasses.replace(cfg, seeds=(3,)), store=store, progress=False)
        steps, la = _loss(store, a)
        assert np.array_equal(steps, np.arange(1, 31)) and np.isfinite(la).all()
        assert np.array_equal(la, _loss(store, c)[1])  # same seed: bitwise-equal losses
        assert not np.array_equal(la, _loss(store, b)[1])  # another seed: another run
        sc = store.scalars(a)
        for key in ("train/grad_norm", "train/lr", "train/step_time_s", "train/samples_per_s"):
            assert len(sc[key][0]) == 30, key
        assert np.array_equal(sc["eval/accuracy"][0], [10, 20, 30])
        rec = store.get_run(a)
        assert rec.status == "completed" and rec.group == f"mlp-digits {recipe}"
        task = get_task("mlp-digits", seed=3)
        m = rec.manifest
        assert m["seed"] == 3 and m["data_hash"] == task.data_hash and m["metrics"] == task.metrics
        assert m["recipe_hash"] == recipes.get(recipe).hash()
        assert set(m["versions"]) == {"lowprec", "torch", "numpy", "python"} and m["hardware"]["cpu"]
        stored = RunConfig.from_dict(rec.config)  # the resolved config reads back
        assert stored.steps == 30 and stored.batch_size == task.samples_per_step and stored.recipe.name == recipe


def test_lr_schedule_recorded(tmp_path: Path) -> None:
    cfg = _config(tmp_path, steps=12)
    with RunStore(cfg.store) as store:
        (rid,) = run_config(cfg, store=store, progress=False)
        lr = store.scalars(rid)["train/lr"][1]
        resolved = RunConfig.from_dict(store.get_run(rid).config)
    want = [resolved.schedule.lr_at(i, lr=resolved.optimizer.lr, steps=12) for i in range(12)]
    assert np.array_equal(lr, want)


@pytest.mark.parametrize("recipe", ["bf16-kahan", "fp8-delayed", "fp16-dynamic-loss-scale"])
def test_resume_after_failure_equals_uninterrupted(tmp_path: Path, recipe: str) -> None:
    """Optimizer state, Kahan buffers, amax histories and the loss scaler all travel in the checkpoint."""
    r = recipes.get(recipe)
    ref_cfg = _config(tmp_path, recipe=r)
    crash = _config(tmp_path, recipe=r, model="_faulty_tasks:crash_at",
                    model_options={"step": 25, "marker": str(tmp_path / "m")},
                    checkpoint=CheckpointConfig(interval=10))
    with RunStore(ref_cfg.store) as store:
        (ref,) = run_config(ref_cfg, store=store, progress=False)
        with pytest.raises(RuntimeError, match="injected failure at step 25"):
            run_config(crash, store=store, progress=False)
        (failed,) = store.list_runs(status="failed")
        assert "injected failure" in (failed.error or "")
        assert len(_loss(store, failed.run_id)[0]) == 25  # nothing recorded is lost
        rid = resume_run(failed.run_id[:6], store=store, progress=False)
        assert rid == failed.run_id and store.get_run(rid).status == "completed"
        steps, got = _loss(store, rid)
        assert np.array_equal(steps, np.arange(1, 31))
        assert np.array_equal(got, _loss(store, ref)[1])  # resumed at step 20: the same curve, bit for bit
        assert np.array_equal(store.scalars(rid)["eval/loss"][1], store.scalars(ref)["eval/loss"][1])


def test_corrupted_newest_checkpoint_falls_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, checkpoint=CheckpointConfig(interval=10, keep=3))
    with RunStore(cfg.store) as store:
        (ref,) = run_config(cfg, store=store, progress=False)
        (rid,) = run_config(cfg, store=store, progress=False)
        cks = list_checkpoints(checkpoint_dir(cfg.store, rid))
        assert [s for s, _ in cks] == [10, 20, 30]
        data = bytearray(cks[-1][1].read_bytes())
        data[-100] ^= 0xFF
        cks[-1][1].write_bytes(bytes(data))
        store.finish_run(rid, status="failed", error="pretend it died")
        resume_run(rid, store=store, progress=False)  # continues from step 20
        assert "checksum mismatch" in capsys.readouterr().out
        assert np.array_equal(_loss(store, rid)[1], _loss(store, ref)[1])


def test_nan_loss_stops_run_with_event(tmp_path: Path) -> None:
    cfg = _config(tmp_path, model="_faulty_tasks:nan_at", model_options={"step": 6})
    with RunStore(cfg.store) as store:
        (rid,) = run_config(cfg, store=store, progress=False)
        steps, loss = _loss(store, rid)
        assert steps[-1] == 7 and np.isnan(loss[-1]) and np.isfinite(loss[:-1]).all()
        (ev,) = store.events(rid, kind="diverged")
        assert ev["step"] == 7
        assert store.get_run(rid).status == "diverged"


def _cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "lowprec.cli", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def _recorded_checkpoints(cwd: Path) -> int:
    path = cwd / "lowprec-runs" / "runs.db"
    if not path.exists():
        return 0
    with RunStore(path, create=False) as store:
        return sum(len(store.events(r.run_id, kind="checkpoint")) for r in store.list_runs())


def test_sigkill_mid_run_then_cli_resume(tmp_path: Path) -> None:
    """A real process killed with SIGKILL: the store shows the run as failed, --resume completes the same curve."""
    (tmp_path / "c.toml").write_text('model = "mlp-digits"\nsteps = 200\neval_interval = 100\nseed = 1\n'
                                     "[checkpoint]\ninterval = 25\n")
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "lowprec.cli", "run", "c.toml", "--quiet"], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckdir = tmp_path / "lowprec-runs" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        # a checkpoint counts once the store records its digest (just after the file's rename): killed in between,
        # the file is rightly not trusted (test_resume_safety), and this test would race on a loaded machine
        if any(len(list_checkpoints(d)) for d in ckdir.glob("*")) and _recorded_checkpoints(tmp_path):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    listing = _cli("runs", "list", cwd=tmp_path).stdout
    assert "failed" in listing
    rid = listing.splitlines()[1].split()[0]
    _cli("run", "--resume", rid, "--quiet", cwd=tmp_path)
    _cli("run", "c.toml", "--quiet", cwd=tmp_path)  # the uninterrupted reference
    with RunStore(tmp_path / "lowprec-runs" / "runs.db") as store:
        ref = next(r for r in store.list_runs() if r.run_id != rid)
        assert store.get_run(rid).status == "completed"
        steps, got = _loss(store, rid)
        assert np.array_equal(steps, np.arange(1, 201))
        assert np.array_equal(got, _loss(store, ref.run_id)[1])


@pytest.mark.parametrize(
    "toml, needle",
    [
        ('model = "no-such-task"\n', "mlp-digits"),
        ('model = "mlp-digits"\nrecipe = "nope"\n', "nope"),
        ('model = "mlp-digits"\n[model_options]\nwidth = 3\n', "width"),
        ('model = "mlp-digits\n', "not valid TOML"),
        ('model = "nosuchmodule_xyz:fn"\n', "nosuchmodule_xyz"),
    ],
)
def test_cli_bad_config_exit_2_without_traceback(tmp_path: Path, toml: str, needle: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """In-process ``main`` (the same code path as the console script; the subprocess tests below cover the rest)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))
    (tmp_path / "c.toml").write_text("steps = 2\n" + toml)
    assert main(["run", "c.toml", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowprec: error:") and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "lowprec-runs").exists() or not RunStore(tmp_path / "lowprec-runs/runs.db").list_runs()


def test_cli_store_errors_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('model = "mlp-digits"\nsteps = 2\n')
    (tmp_path / "file").write_text("x")
    for args, needle in ((["run", "c.toml", "--store", str(tmp_path / "file" / "runs.db")], "cannot write"),
                         (["runs", "show", "ffffffff"], "no run store at"),  # reading never creates a store
                         (["run", "--resume", "abcd1234"], "no run store at")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("lowprec: error:") and needle in err, (args, err)
    assert not (tmp_path / "lowprec-runs").exists()
    with RunStore(tmp_path / "r.db"):
        pass
    for args, needle in ((["runs", "show", "ffffffff", "--store", str(tmp_path / "r.db")], "ffffffff"),
                         (["run", "--resume", "abcd1234", "--store", str(tmp_path / "r.db")], "abcd1234")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("lowprec: error:") and needle in err, (args, err)
    (tmp_path / "bad.db").write_bytes(b"this is not sqlite" * 100)
    p = _cli("runs", "list", "--store", str(tmp_path / "bad.db"), cwd=tmp_path, check=False)  # the console path
    assert p.returncode == 2 and "not a lowprec run store" in p.stderr and "Traceback" not in p.stderr
    assert (tmp_path / "bad.db").read_bytes() == b"this is not sqlite" * 100  # nothing overwritten


def test_stats_recorded_without_changing_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the same run without statistics (bitwise-equal losses), and lowprec.numerics.tensor_stats'
    own tests for the values; `lowprec stats` ranks what the run stored."""
    from lowprec.runs._config import StatsConfig

    cfg = _config(tmp_path, recipe=recipes.get("fp8-tensorwise"), steps=20)
    with RunStore(cfg.store) as store:
        (plain,) = run_config(cfg, store=store, progress=False)
        (obs,) = run_config(dataclasses.replace(cfg, stats=StatsConfig(every=10, what_if={"mxfp4": "mxfp4"})),
                            store=store, progress=False)
        assert np.array_equal(_loss(store, plain)[1], _loss(store, obs)[1])
        sc = store.scalars(obs)
    steps, sqnr = sc["stats/layers.0/input/sqnr_db"]
    assert np.array_equal(steps, [1, 11]) and (sqnr > 20).all()  # sampled steps 0 and 10, logged with their loss
    assert "stats/layers.0/weight@mxfp4/sqnr_db" in sc
    assert main(["stats", obs, "--store", cfg.store, "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "worst" in out and len(out.splitlines()) == 5
    assert main(["stats", plain, "--store", cfg.store]) == 2
    assert "no tensor statistics" in capsys.readouterr().err
