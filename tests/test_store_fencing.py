"""One writer group per run: attempts fence stale writers, and a stopped `lowprec run` stops its workers.

Oracles: the store's rows (which attempt wrote what, the status after the dust settles), the exit status and
stderr of real `lowprec run` processes, and /proc (which processes are still alive).  The processes are real: a
single-process run in a subprocess taken over by a `reopen_run` from this test process (a second resume), SIGTERM
to a single-process and to a data-parallel `lowprec run`, and SIGKILL of torchrun under a data-parallel run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowprec.runs._store import RunStore, RunTakenOver

SRC = Path(__file__).resolve().parents[1] / "src"


def _new(store: RunStore) -> str:
    return store.create_run(name="r", config={}, manifest={})


# -- fencing within one process: two RunStore objects are two writers (each backend: store_location) -----------

def test_a_reopened_run_fences_its_earlier_writer(store_location: str) -> None:
    path = store_location
    with RunStore(path) as first, RunStore(path) as second, RunStore(path) as bystander:
        rid = _new(first)
        first.log_scalars(rid, 1, {"train/loss": 1.0})
        second.reopen_run(rid, from_step=1)  # a second resume: a new attempt
        for write in (lambda: first.log_scalars(rid, 2, {"train/loss": 0.5}),
                      lambda: first.log_rows(rid, [(2, "train/lr", 0.1)]),
                      lambda: first.add_event(rid, step=2, kind="k", payload={}),
                      lambda: first.finish_run(rid, status="completed"),
                      lambda: first.reopen_run(rid, from_step=0)):
            with pytest.raises(RunTakenOver, match=f"run {rid} was taken over by another attempt .* this writer "
                                                   "stops"):
                write()
        with pytest.raises(RunTakenOver, match="could not be recorded: boom"):  # the reason is kept in the error
            first.finish_run(rid, status="failed", error="boom")
        assert first.get_run(rid).status == "running" and first.scalars(rid)["train/loss"][0].tolist() == [1]
        second.log_scalars(rid, 2, {"train/loss": 0.5})  # the new attempt writes
        bystander.add_event(rid, step=2, kind="rank_failure", payload={"rank": 1})  # a non-owner always may
        bystander.log_scalars(rid, 2, {"other": 1.0})
        assert [e["kind"] for e in second.events(rid)] == ["rank_failure"]
        second.finish_run(rid, status="completed")
        assert second.get_run(rid).status == "completed" and second.verify_run(rid).state == "ok"


def test_a_non_owner_marking_the_run_failed_revokes_the_attempt(store_location: str) -> None:
    """The launcher's finish_run(failed) (it never claimed the run) ends the workers' attempt: a worker group that
    outlived torchrun cannot flip the failed run to completed."""
    path = store_location
    with RunStore(path) as worker, RunStore(path) as launcher:
        rid = _new(worker)
        worker.log_scalars(rid, 1, {"train/loss": 1.0})
        launcher.finish_run(rid, status="failed", error="torchrun exited with status -9")
        with pytest.raises(RunTakenOver):
            worker.log_scalars(rid, 2, {"train/loss": 0.5})
        with pytest.raises(RunTakenOver):
            worker.finish_run(rid, status="completed")
        rec = launcher.get_run(rid)
        assert (rec.status, rec.error) == ("failed", "torchrun exited with status -9")
        launcher.add_event(rid, step=1, kind="note", payload={})  # the non-owner still writes
        with RunStore(path) as resumer:  # and a later resume takes the run over cleanly
            resumer.reopen_run(rid, from_step=1)
            resumer.log_scalars(rid, 2, {"train/loss": 0.5})
            resumer.finish_run(rid, status="completed")
            assert resumer.get_run(rid).status == "completed"


def test_the_owner_keeps_its_claim_across_its_own_writes(store_location: str) -> None:
    with RunStore(path := store_location) as s:
        rid = _new(s)
        s.finish_run(rid, status="failed", error="x")  # the owner's own finish keeps its attempt
        s.reopen_run(rid, from_step=0)
        s.log_scalars(rid, 1, {"a": 1.0})
        s.finish_run(rid, status="completed")
    with RunStore(path) as s:
        assert s.get_run(rid).status == "completed" and s.verify_run(rid).state == "ok"


# -- real processes ------------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _lowprec(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lowprec.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _config(tmp: Path, *, ddp: bool = False) -> str:
    text = 'model = "mlp-digits"\nsteps = 1000000\neval_interval = 100000\nthreads = 1\n'
    text += "[checkpoint]\ninterval = 1000000\n"
    if ddp:
        text += '[parallel]\nstrategy = "ddp"\nworld_size = 2\n'
    (tmp / "c.toml").write_text(text)
    return str(tmp / "c.toml")


def _wait_for_steps(path: Path, n: int, proc: subprocess.Popen[str], timeout: float = 240.0) -> str:
    """The id of the one run in ``path`` once it has recorded ``n`` steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"lowprec run ended early ({proc.returncode}): {proc.communicate()}")
        if path.exists():
            with RunStore(path) as s:
                runs = s.list_runs()
                if runs and len(s.scalars(runs[0].run_id).get("train/loss", ([],))[0]) >= n:
                    return runs[0].run_id
        time.sleep(0.2)
    pytest.fail(f"no run reached {n} steps in {timeout} s")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _processes(run_id: str) -> tuple[list[int], list[int]]:
    """Live (torchrun agents, lowprec.train workers) of ``run_id``, found by their command lines."""
    agents, workers = [], []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if run_id.encode() not in cmd or not _alive(int(d.name)):
                continue
            if b"torch.distributed.run" in cmd:
                agents.append(int(d.name))
            elif b"lowprec.train" in cmd:
                workers.append(int(d.name))
    return agents, workers


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_a_second_resume_stops_the_first_writer_at_its_next_write(tmp_path: Path) -> None:
    """A single-process `lowprec run` is taken over (reopen_run from this process, as a second `--resume` would):
    the first process fails at its next write with the reason, records nothing more, and cannot complete or fail
    the run; the new attempt owns it."""
    path = tmp_path / "runs.db"
    proc = _lowprec("run", _config(tmp_path), "--store", str(path), "--quiet")
    try:
        rid = _wait_for_steps(path, 5, proc)
        with RunStore(path) as s:
            s.reopen_run(rid, from_step=3)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2 and f"run {rid} was taken over by another attempt" in err, err
            rec = s.get_run(rid)
            assert (rec.status, rec.pid) == ("running", os.getpid())  # not flipped by the stale writer
            assert s.scalars(rid)["train/loss"][0].tolist() == [1, 2, 3]  # nothing written after the takeover
            s.log_scalars(rid, 4, {"train/loss": 1.0})
            s.finish_run(rid, status="completed")
            assert s.verify_run(rid).state == "ok"
    finally:
        proc.kill()
        proc.communicate()


def test_sigterm_marks_a_single_process_run_failed_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    proc = _lowprec("run", _config(tmp_path), "--store", str(path), "--quiet")
    try:
        rid = _wait_for_steps(path, 3, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM and "lowprec: interrupted by SIGTERM" in err, err
    with RunStore(path) as s:
        rec = s.get_run(rid)
    assert (rec.status, rec.error) == ("failed", "Terminated: interrupted by SIGTERM")


@pytest.mark.slow  # make test-slow: a real 2-worker torchrun, stopped
@pytest.mark.parametrize("how", ["sigkill-torchrun", "sigterm-parent"])
def test_a_stopped_data_parallel_run_leaves_no_worker_and_stays_failed(tmp_path: Path, how: str) -> None:
    """SIGKILL of torchrun: its workers get SIGTERM from Linux (PR_SET_PDEATHSIG) and the parent marks the run
    failed.  SIGTERM to `lowprec run`: forwarded to torchrun's group, the workers stop, the run is failed with
    "interrupted by SIGTERM".  Either way no worker survives and the run is still failed seconds later."""
    path = tmp_path / "runs.db"
    proc = _lowprec("run", _config(tmp_path, ddp=True), "--store", str(path), "--quiet")
    agents: list[int] = []
    workers: list[int] = []
    try:
        rid = _wait_for_steps(path, 3, proc)
        agents, workers = _processes(rid)
        assert len(agents) == 1 and len(workers) == 2, (agents, workers)
        if how == "sigkill-torchrun":
            os.kill(agents[0], signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
        survivors = _wait_gone(workers)
        assert not survivors, f"workers {survivors} still alive after {how}"
        assert proc.returncode == 1 and f"run {rid} failed" in err, err
        if how == "sigterm-parent":
            assert "interrupted by SIGTERM (forwarded to torchrun's process group)" in err, err
        with RunStore(path) as s:
            first = s.get_run(rid)
            n = len(s.scalars(rid)["train/loss"][0])
            time.sleep(3)
            later = s.get_run(rid)
            assert first.status == later.status == "failed", (first, later)
            assert later.error == first.error and len(s.scalars(rid)["train/loss"][0]) == n
            if how == "sigterm-parent":
                assert first.error == "interrupted by SIGTERM (forwarded to torchrun's process group)"
    finally:  # never leave a process behind (their pipes would also keep communicate() waiting)
        _kill_all([*agents, *workers])
        proc.kill()
        proc.communicate(timeout=60)
