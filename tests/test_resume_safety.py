"""Resume is safe against planted checkpoints, moved or copied stores, a store that lost its last commits, and
requests that would lose recorded steps (issue 14, items 1-4 and the checkpoint items of its low list).

Oracles: a marker file that planted code would create (it must not exist); the uninterrupted run of the same
config (a resumed run must reproduce its curve bit for bit, so a gap or a wrong restart point shows); the bytes of
the original store's checkpoints (a copy's resume must not change them); the store's rows (a refusal must leave
them as they were).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lowprec.cli import main
from lowprec.runs._checkpoint import checkpoint_dir, list_checkpoints, save_checkpoint
from lowprec.runs._config import CheckpointConfig, RunConfig
from lowprec.runs._dcp import _SafeLoadPlanner, read_metadata, verify
from lowprec.runs._resume import record_checkpoint
from lowprec.runs._runner import resume_run, run_config
from lowprec.runs._store import RunStore

STEPS = 30


def _config(store: str | Path, **kw) -> RunConfig:
    base = dict(model="mlp-digits", steps=STEPS, eval_interval=10, store=str(store),
                checkpoint=CheckpointConfig(interval=10))
    base.update(kw)
    return RunConfig(**base)


def _crashing(store: str | Path, marker: Path, *, at: int = 25, **kw) -> RunConfig:
    return _config(store, model="_faulty_tasks:crash_at", model_options={"step": at, "marker": str(marker)}, **kw)


def _loss(store: RunStore, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    return store.scalars(run_id)["train/loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The uninterrupted run's loss curve (every run here trains mlp-digits with seed 0 for 30 steps)."""
    path = tmp_path_factory.mktemp("ref") / "runs.db"
    with RunStore(path) as store:
        (rid,) = run_config(_config(path), store=store, progress=False)
        steps, loss = _loss(store, rid)
    assert np.array_equal(steps, np.arange(1, STEPS + 1))
    return loss


def _failed_run(store: RunStore, cfg: RunConfig) -> str:
    with pytest.raises(RuntimeError, match="injected failure"):
        run_config(cfg, store=store, progress=False)
    (failed,) = store.list_runs(status="failed")
    return failed.run_id


# -- 1. planted checkpoints ------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what a crafted pickle does: call any function on load
        return (os.system, (f"touch {self.marker}",))


def _plant_sharded(directory: Path, step: int, marker: Path) -> Path:
    """A ``step-N.dcp`` directory with a crafted ``.metadata`` and a manifest that matches every file."""
    d = directory / f"step-{step:08d}.dcp"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    torch.save({"run_id": "x"}, d / "extra.pt")
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
    (d / "MANIFEST.json").write_text(json.dumps({"step": step, "sha256": files}))
    return d


def test_planted_sharded_checkpoint_runs_no_code_on_resume(tmp_path: Path, reference: np.ndarray,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A single-process run's checkpoint folder gets a newer, self-consistent ``step-N.dcp``: resume skips it
    (the store has no record of it) and continues from the run's own checkpoint; the planted code never runs."""
    marker = tmp_path / "pwned"
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
        directory = checkpoint_dir(store.path, rid)
        _plant_sharded(directory, 24, marker)
        resume_run(rid, store=store, progress=False)
        assert not marker.exists()
        assert "was not written by run" in capsys.readouterr().out
        (ev,) = store.events(rid, kind="resumed")
        assert ev["payload"]["from_step"] == 20 and ev["payload"]["checkpoint"] == "file"
        assert np.array_equal(_loss(store, rid)[1], reference)


def test_sharded_metadata_is_read_without_running_code(tmp_path: Path) -> None:
    """Even a checkpoint the store vouched for cannot run code: ``.metadata`` goes through an unpickler that
    admits only DCP's metadata classes, and ``verify`` (which reads it) refuses the directory."""
    marker = tmp_path / "pwned"
    d = _plant_sharded(tmp_path, 5, marker)
    with pytest.raises(ValueError, match="unsafe metadata.*os.*system|unsafe metadata.*posix.*system"):
        read_metadata(d)
    with pytest.raises(ValueError, match="metadata"):
        verify(d)
    assert not marker.exists()


def test_sharded_verify_refuses_files_the_manifest_does_not_list(tmp_path: Path) -> None:
    d = _plant_sharded(tmp_path, 5, tmp_path / "m")
    (d / "__9_0.distcp").write_bytes(b"extra shard")
    with pytest.raises(ValueError, match="__9_0.distcp.*does not list"):
        verify(d)


def test_sharded_non_tensor_entries_load_with_weights_only(tmp_path: Path) -> None:
    """DCP's default planner loads non-tensor entries with ``torch.load(weights_only=False)``; lowprec's refuses
    an object that would run code and still loads plain values."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    marker = tmp_path / "pwned"
    planner = _SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("lr"), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex("lr"), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    good = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.99)}, good)
    good.seek(0)
    planner.load_bytes(item, good)
    assert planner.state_dict["lr"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    evil = io.BytesIO()
    torch.save(_Evil(marker), evil)
    evil.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, evil)
    assert not marker.exists()


def test_checkpoint_of_another_run_is_not_loaded(tmp_path: Path, reference: np.ndarray,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A valid checkpoint file copied from another run into this run's folder, at a newer step, is skipped."""
    with RunStore(tmp_path / "runs.db") as store:
        (other,) = run_config(_config(store.path), store=store, progress=False)
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
        newest = list_checkpoints(checkpoint_dir(store.path, other))[-1][1]
        shutil.copy(newest, checkpoint_dir(store.path, rid) / "step-00000024.ckpt")
        resume_run(rid, store=store, progress=False)
        assert "was not written by run" in capsys.readouterr().out
        assert store.events(rid, kind="resumed")[0]["payload"]["from_step"] == 20
        assert np.array_equal(_loss(store, rid)[1], reference)


# -- 2. checkpoints belong to the store that holds the run ----------------------------------------------------


def test_resume_from_another_working_directory(tmp_path: Path, reference: np.ndarray,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The default relative store: the run starts in ``a/``, is resumed from ``b/`` with ``--store`` pointing at
    a's store.  It continues from its checkpoint at step 20 and writes nothing under ``b/``."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    rel = Path("lowprec-runs") / "runs.db"
    with RunStore(rel) as store:
        rid = _failed_run(store, _crashing(rel, tmp_path / "m"))
    monkeypatch.chdir(tmp_path / "b")
    with RunStore(tmp_path / "a" / rel) as store:
        resume_run(rid, store=store, progress=False)
        assert store.events(rid, kind="resumed")[0]["payload"]["from_step"] == 20
        assert store.get_run(rid).status == "completed"
        assert np.array_equal(_loss(store, rid)[1], reference)
    assert list((tmp_path / "b").iterdir()) == []
    assert [s for s, _ in list_checkpoints(tmp_path / "a" / "lowprec-runs" / "checkpoints" / rid)] == [20, 30]


def test_moved_store_resumes_from_its_own_checkpoints(tmp_path: Path, reference: np.ndarray) -> None:
    with RunStore(tmp_path / "old" / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
    shutil.move(tmp_path / "old", tmp_path / "new")
    with RunStore(tmp_path / "new" / "runs.db") as store:
        resume_run(rid, store=store, progress=False)
        assert store.events(rid, kind="resumed")[0]["payload"]["from_step"] == 20
        assert np.array_equal(_loss(store, rid)[1], reference)
    assert not (tmp_path / "old").exists()


def test_resuming_a_copy_leaves_the_original_alone(tmp_path: Path, reference: np.ndarray) -> None:
    """Resuming a copy of a store (its folder copied whole) writes the copy's checkpoints only; the original's
    checkpoint files keep their bytes and the original still resumes to the full curve."""
    with RunStore(tmp_path / "orig" / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = {p.name: p.read_bytes() for p in (tmp_path / "orig" / "checkpoints" / rid).iterdir()}
    with RunStore(tmp_path / "copy" / "runs.db") as copy:
        resume_run(rid, store=copy, progress=False)
        assert np.array_equal(_loss(copy, rid)[1], reference)
    assert {p.name: p.read_bytes() for p in (tmp_path / "orig" / "checkpoints" / rid).iterdir()} == before
    with RunStore(tmp_path / "orig" / "runs.db") as store:
        assert len(_loss(store, rid)[0]) == 25
        resume_run(rid, store=store, progress=False)
        assert np.array_equal(_loss(store, rid)[1], reference)


# -- 3. the store must hold every step up to the checkpoint ----------------------------------------------------


def _lose_commits(store: RunStore, rid: str, keep: int) -> None:
    """What a power loss or a backup without ``runs.db-wal`` does: the store's records after step ``keep`` are
    gone (consistently: scalars and events), the run is left as its dead process left it."""
    store.reopen_run(rid, from_step=keep)
    store.finish_run(rid, status="failed", error="power loss")


def test_resume_uses_the_newest_checkpoint_the_store_reaches(tmp_path: Path, reference: np.ndarray,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints at 10 and 20, the store lost everything after step 15: resume from 10, no gap."""
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
        _lose_commits(store, rid, 15)
        resume_run(rid, store=store, progress=False)
        assert "holds the run's steps only up to 15" in capsys.readouterr().out
        assert store.events(rid, kind="resumed")[-1]["payload"]["from_step"] == 10
        steps, loss = _loss(store, rid)
        assert np.array_equal(steps, np.arange(1, STEPS + 1)) and np.array_equal(loss, reference)


def test_resume_refuses_when_no_checkpoint_is_reached_then_restarts_on_request(
        tmp_path: Path, reference: np.ndarray) -> None:
    """Only the checkpoint of step 20 is kept and the store holds steps 1..15: refused with the numbers, nothing
    changed; with ``allow_restart`` the run starts over and completes the full curve."""
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m", checkpoint=CheckpointConfig(interval=10,
                                                                                                   keep=1)))
        _lose_commits(store, rid, 15)
        with pytest.raises(ValueError, match=r"holds its steps 1\.\.15.*step 20.*--allow-restart"):
            resume_run(rid, store=store, progress=False)
        assert len(_loss(store, rid)[0]) == 15 and store.get_run(rid).status == "failed"
        resume_run(rid, store=store, progress=False, allow_restart=True)
        (ev,) = store.events(rid, kind="resumed")
        assert ev["payload"]["from_step"] == 0 and ev["payload"]["discarded_steps"] == 15
        assert np.array_equal(_loss(store, rid)[1], reference)


# -- 4. no checkpoint, and completed runs --------------------------------------------------------------------


def test_resume_without_checkpoint_keeps_recorded_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No checkpoint (interval 0 and a crash before the final one): refused, through the CLI too (exit 2, one
    line, no traceback); the 25 recorded steps stay."""
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m", checkpoint=CheckpointConfig(interval=0)))
        assert list_checkpoints(checkpoint_dir(store.path, rid)) == []
        with pytest.raises(ValueError, match=r"steps 1\.\.25.*has no usable checkpoint.*--allow-restart"):
            resume_run(rid, store=store, progress=False)
        assert main(["run", "--resume", rid, "--store", str(store.path), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--allow-restart" in err and "Traceback" not in err
        assert len(_loss(store, rid)[0]) == 25 and store.get_run(rid).status == "failed"


def test_completed_run_cannot_be_resumed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with RunStore(tmp_path / "runs.db") as store:
        (rid,) = run_config(_config(store.path), store=store, progress=False)
        before = store.get_run(rid)
        with pytest.raises(ValueError, match="is completed: there is nothing to resume"):
            resume_run(rid, store=store, progress=False)
        assert main(["run", "--resume", rid, "--store", str(store.path), "--quiet", "--allow-restart"]) == 2
        assert "is completed" in capsys.readouterr().err
        after = store.get_run(rid)
        assert (after.status, after.finished_at) == (before.status, before.finished_at)
        assert store.events(rid, kind="resumed") == []


def test_allow_restart_needs_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_text('model = "mlp-digits"\nsteps = 2\n')
    assert main(["run", str(tmp_path / "c.toml"), "--allow-restart", "--store", str(tmp_path / "r.db")]) == 2
    assert "--allow-restart goes with --resume" in capsys.readouterr().err


# -- low: checkpoints that verify but cannot be loaded, partial files -----------------------------------------


def test_checkpoint_that_verifies_but_does_not_fit_falls_back(tmp_path: Path, reference: np.ndarray,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The newest checkpoint has a valid checksum and a store record but a wrong-shaped weight: resume skips it
    with the reason and continues from the previous one (it used to abort with a traceback)."""
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
        directory = checkpoint_dir(store.path, rid)
        step, newest = list_checkpoints(directory)[-1]
        assert step == 20
        from lowprec.runs._checkpoint import checkpoint_digest, load_checkpoint

        state = load_checkpoint(newest)
        key = next(k for k, v in state["model"].items() if v.ndim == 2)
        state["model"][key] = torch.zeros(3, 3)
        save_checkpoint(directory, 20, state, keep=5)
        record_checkpoint(store, rid, 20, "file", checkpoint_digest(newest))
        resume_run(rid, store=store, progress=False)
        assert "verifies but does not fit" in capsys.readouterr().out
        assert store.events(rid, kind="resumed")[0]["payload"]["from_step"] == 10
        assert np.array_equal(_loss(store, rid)[1], reference)


def test_checkpoint_that_torch_refuses_to_load_is_a_clear_error(tmp_path: Path) -> None:
    """A payload with a valid checksum that ``weights_only`` refuses (it would run code) is reported, not raised
    as an UnpicklingError and never executed."""
    from lowprec.runs._checkpoint import load_checkpoint

    marker = tmp_path / "pwned"
    path = save_checkpoint(tmp_path, 1, {"evil": _Evil(marker)})
    with pytest.raises(ValueError, match="passes its checksum but cannot be loaded"):
        load_checkpoint(path)
    assert not marker.exists()


def test_partial_checkpoint_files_are_removed_on_resume(tmp_path: Path) -> None:
    with RunStore(tmp_path / "runs.db") as store:
        rid = _failed_run(store, _crashing(store.path, tmp_path / "m"))
        directory = checkpoint_dir(store.path, rid)
        (directory / ".step-00000030.ckpt.k2j3h4.tmp").write_bytes(b"half a checkpoint")
        (directory / "step-00000030.dcp.tmp").mkdir()
        (directory / "step-00000030.dcp.tmp" / "__0_0.distcp").write_bytes(b"half a shard")
        resume_run(rid, store=store, progress=False)
        assert sorted(p.name for p in directory.iterdir()) == ["step-00000020.ckpt", "step-00000030.ckpt"]


def test_checkpoint_dir_refuses_ids_that_are_paths(tmp_path: Path) -> None:
    for bad in ("../..", "/abs/path", "0123456789ab/../x", ""):
        with pytest.raises(ValueError, match="not a lowprec run id"):
            checkpoint_dir(tmp_path / "runs.db", bad)


def test_config_store_field_is_not_used_for_checkpoints(tmp_path: Path) -> None:
    """``train`` puts checkpoints next to the store it is given, even when the config names another store."""
    with RunStore(tmp_path / "real" / "runs.db") as store:
        (rid,) = run_config(dataclasses.replace(_config(tmp_path / "elsewhere" / "runs.db"), steps=10),
                            store=store, progress=False)
        assert list_checkpoints(checkpoint_dir(store.path, rid))
    assert not (tmp_path / "elsewhere").exists()
