"""A diverged run (non-finite loss or gradient norm) ends with status "diverged", not "completed" (issue 15,
section 3): the store, ``runs list``, the printed localisation line, the judge, the baseline builder and resume.
Oracle: the injected fault of ``_faulty_tasks.overflow_at`` (batch 3: logged step 4, module ``layers.1.amp``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lowprec.accuracy import Criteria, RunData, build_baseline, judge
from lowprec.cli import main
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import resume_run, run_config
from lowprec.runs._store import RunStore


def _cfg(tmp_path: Path, step: int, seeds: tuple[int, ...] = (0,)) -> RunConfig:
    return RunConfig(model="_faulty_tasks:overflow_at", steps=8, eval_interval=4, seeds=seeds, threads=1,
                     model_options={"step": step}, store=str(tmp_path / "runs.db"))


def test_a_diverged_run_is_diverged_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with RunStore(tmp_path / "runs.db") as store:
        base = run_config(_cfg(tmp_path, 10**6, seeds=(1, 2)), store=store, progress=False)
        (rid,) = run_config(_cfg(tmp_path, 3), store=store, progress=True)
        out = capsys.readouterr().out
        assert [store.get_run(r).status for r in base] == ["completed", "completed"]
        assert store.get_run(rid).status == "diverged" and store.get_run(rid).finished_at is not None
        assert [r.run_id for r in store.list_runs(status="diverged")] == [rid]
        # the localisation line: module, role, step
        (line,) = [x for x in out.splitlines() if x.startswith(f"run {rid} diverged")]
        assert "at step 4" in line and "output of module 'layers.1.amp'" in line, line
        runs = [RunData.from_store(store, r) for r in base]
        flat = Criteria(min_loss_drop=0.0)  # 8 steps do not train the model; this test is about the status
        verdict = judge(build_baseline("ref", runs, criteria=flat), [RunData.from_store(store, rid)])
        by_name = {r.name: r for r in verdict.results}
        assert by_name["divergence"].outcome == "fail" and not verdict.passed
        assert "status diverged" in by_name["completion"].reason
        with pytest.raises(ValueError, match="takes completed runs only"):
            build_baseline("bad", [*runs, RunData.from_store(store, rid)], criteria=flat)
        with pytest.raises(ValueError, match=f"run {rid} .* is diverged: there is nothing to resume"):
            resume_run(rid, store=store, progress=False)
        assert store.check().ok
    assert main(["runs", "list", "--store", str(tmp_path / "runs.db"), "--status", "diverged"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and listed[1].startswith(f"{rid}  diverged "), listed


def test_a_diverged_jax_run_is_diverged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JAX run whose learning rate (1e38) blows the loss up at step 2: status diverged, and the line says that
    no localisation was recorded (JAX runs do not replay the step)."""
    pytest.importorskip("jax")
    cfg = RunConfig(model="mlp-digits", framework="jax", steps=6, eval_interval=3, threads=1, seeds=(0,),
                    store=str(tmp_path / "runs.db"))
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr=1e38))
    with RunStore(cfg.store) as store:
        (rid,) = run_config(cfg, store=store, progress=True)
        assert store.get_run(rid).status == "diverged"
        (ev,) = store.events(rid, kind="diverged")
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"run {rid} diverged")]
    assert line == [f"run {rid} diverged at step {ev['step']} (loss {ev['payload']['loss']}, grad norm "
                    f"{ev['payload']['grad_norm']}): no localisation recorded (JAX runs, and a non-finite value "
                    "outside the replayed step)"]


@pytest.mark.parametrize("quiet", [True, False])
def test_lowprec_run_prints_the_localisation_line_once_quiet_or_not(tmp_path: Path, quiet: bool,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: stdout of ``lowprec run`` of a run planted to overflow at step 3: exactly one "run ID diverged"
    line naming the module and the step, with or without ``--quiet`` (before, --quiet hid it)."""
    (tmp_path / "c.toml").write_text('model = "_faulty_tasks:overflow_at"\nsteps = 8\neval_interval = 4\nseed = 0\n'
                                     'threads = 1\n[model_options]\nstep = 3\n')
    args = ["run", str(tmp_path / "c.toml"), "--store", str(tmp_path / "runs.db")] + (["--quiet"] if quiet else [])
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if " diverged" in x and x.startswith("run ")]
    assert len(lines) == 1, out
    assert "at step 4" in lines[0] and "layers.1.amp" in lines[0], lines[0]
