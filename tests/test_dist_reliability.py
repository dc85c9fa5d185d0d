"""The fault matrix of issue 19 in real torchrun processes (gloo): every injected fault is detected and attributed
to its rank, step and tensor, and clean runs of the zoo tasks raise no alarm (``_fault_matrix``; the table in
docs/debugging.md is this test's output)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fault_matrix import CLEAN_TASKS, SCENARIOS, Scenario

from lowprec.runs._store import RunStore
from lowprec.testing import torchrun

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("_dist_reliability_worker.py")
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
    assert {s.verdict for s in SCENARIOS} == {"transient", "persistent"}
    assert {s.fault["target"] for s in SCENARIOS} == {"weight", "grad", "activation"}
    assert {s.rank for s in SCENARIOS} == {0, 1, 2}


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_fault_detected_and_attributed(matrix: dict[str, list[dict]], sc: Scenario) -> None:
    events = matrix[f"matrix/{sc.name}"]
    assert events, f"{sc.name}: not detected"
    first = events[0]
    p = first["payload"]
    assert first["kind"] == "rerun" and first["step"] == sc.step, (first, sc)  # no false alarm before the fault
    assert p["reason"] == sc.reason and p["verdict"] == sc.verdict and p["ranks"] == [sc.rank], p
    assert sc.tensor in p["tensors"], p


@pytest.mark.parametrize("task", CLEAN_TASKS)
def test_no_false_alarm_on_clean_zoo_runs(matrix: dict[str, list[dict]], task: str) -> None:
    assert matrix[f"clean/{task}"] == []
