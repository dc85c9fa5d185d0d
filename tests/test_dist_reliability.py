"""The fault matrix of issue 19 in real torchrun processes (gloo): every injected fault is detected and attributed
to its rank, step and tensor, and clean runs of the zoo tasks raise no alarm (``_fault_matrix``; the table in
docs/debugging.md is this test's output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _fault_matrix import CHECKSUM_ONLY, CLEAN_TASKS, SCENARIOS, Scenario

from lowprec.runs._store import RunStore
from lowprec.testing import torchrun

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("_dist_reliability_worker.py")
ROOT = Path(__file__).resolve().parents[1]
ALARMS = ("rerun", "sdc", "spike")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    store = tmp_path_factory.mktemp("matrix") / "runs.db"
    for world in sorted({s.world for s in SCENARIOS}):
        torchrun(WORKER, str(store), "matrix", nproc=world, timeout=900)
    torchrun(WORKER, str(store), "clean", nproc=2, timeout=900)
    with RunStore(store, create=False) as s:
        return {r.group or "": [e for e in s.events(r.run_id) if e["kind"] in ALARMS] for r in s.list_runs()}


def test_matrix_is_large_enough() -> None:
    assert len(SCENARIOS) >= 20
    assert {s.verdict for s in SCENARIOS} == {"transient", "persistent", "sdc"}
    assert {s.fault["target"] for s in SCENARIOS} == {"weight", "grad", "activation"}
    assert {s.rank for s in SCENARIOS} == {0, 1, 2, 3}
    assert {s.layout for s in SCENARIOS} >= {"DDP", "FSDP2", "HSDP 3x1", "HSDP 2x2"}


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_fault_detected_and_attributed(matrix: dict[str, list[dict]], sc: Scenario) -> None:
    events = matrix[f"matrix/{sc.name}"]
    assert events, f"{sc.name}: not detected"
    first = events[0]
    p = first["payload"]
    if sc.reason == CHECKSUM_ONLY:  # the replicas' weights compared after the step
        assert first["kind"] == "sdc" and first["step"] == sc.step, (first, sc)
        assert p["check"] == "weights" and p["ranks"] == sc.ranks and p["tensors"] == [sc.tensor], p
        return
    assert first["kind"] == "rerun" and first["step"] == sc.step, (first, sc)  # no false alarm before the fault
    assert p["reason"] == sc.reason and p["verdict"] == sc.verdict and p["ranks"] == sc.ranks, p
    assert sc.tensor in p["tensors"], p


@pytest.mark.parametrize("task", CLEAN_TASKS)
def test_no_false_alarm_on_clean_zoo_runs(matrix: dict[str, list[dict]], task: str) -> None:
    assert matrix[f"clean/{task}"] == []


def _cli(tmp_path: Path, toml: str) -> tuple[subprocess.CompletedProcess[str], RunStore]:
    (tmp_path / "c.toml").write_text(toml)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "lowprec.cli", "run", "c.toml", "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    return p, RunStore(tmp_path / "lowprec-runs" / "runs.db", create=False)


DDP = '[parallel]\nstrategy = "ddp"\nworld_size = 2\n'


def test_cli_ddp_persistent_nonfinite_fault_diverges_naming_the_rank(tmp_path: Path) -> None:
    p, store = _cli(tmp_path, 'model = "mlp-digits"\nsteps = 8\nthreads = 1\n' + DDP +
                    '[[faults]]\ntarget = "grad"\ntensor = "head.weight"\nstep = 3\nrank = 1\npersistent = true\n')
    assert p.returncode == 0, p.stderr
    (rec,) = store.list_runs()
    assert rec.status == "diverged"  # a non-finite step that stops is localised and "diverged", as ever ...
    (ev,) = store.events(rec.run_id, kind="rerun")
    assert ev["payload"]["verdict"] == "persistent" and ev["payload"]["ranks"] == [1]  # ... with its device
    assert ev["payload"]["action"] == "stop" and store.events(rec.run_id, kind="nonfinite")
    assert "diverged" in p.stdout


def test_cli_ddp_persistent_finite_fault_stops_the_run_failed(tmp_path: Path) -> None:
    p, store = _cli(tmp_path, 'model = "mlp-digits"\nsteps = 8\nthreads = 1\nbatch_size = 60\n'
                    + DDP.replace("world_size = 2", "world_size = 3")
                    + '[reliability]\nreplay_every = 2\nfingerprints = true\n'
                    '[[faults]]\ntarget = "activation"\ntensor = "layers.1"\nstep = 3\nrank = 2\nbit = 6\n'
                    'persistent = true\nindex = 9\n')
    assert p.returncode == 0, p.stderr
    (rec,) = store.list_runs()
    assert rec.status == "failed" and rec.error.startswith("stopped: step 4 rejected (sampled replay): persistent")
    (ev,) = store.events(rec.run_id, kind="rerun")
    assert ev["payload"]["ranks"] == [2] and "failed" in p.stdout


def test_cli_ddp_spike_rolls_back_and_completes(tmp_path: Path) -> None:
    p, store = _cli(tmp_path, 'model = "_faulty_tasks:spike_at"\nsteps = 16\nthreads = 1\n'
                    '[model_options]\nstep = 9\n[checkpoint]\ninterval = 4\n[reliability]\nspike = "robust"\n' + DDP)
    assert p.returncode == 0, p.stderr
    (rec,) = store.list_runs()
    assert rec.status == "completed"
    (rb,) = store.events(rec.run_id, kind="rollback")
    assert rb["payload"]["from_step"] == 10 and rb["payload"]["to_step"] == 8
    (rerun,) = store.events(rec.run_id, kind="rerun")
    assert rerun["payload"]["verdict"] == "reproducible" and "another rank" in rerun["payload"]["detail"]
    assert list(store.scalars(rec.run_id)["train/loss"][0]) == list(range(1, 17))
