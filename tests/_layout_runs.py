"""Shared by the tests that run configs under several layouts with ``lowprec run`` (real torchrun workers) and
compare their loss curves: train every case into one store, read each back."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from lowprec.cli import main
from lowprec.runs._store import RunStore

TESTS = Path(__file__).parent


def train_cases(tmp: Path, cases: dict[str, str], steps: int) -> dict[str, tuple[np.ndarray, dict]]:
    """``lowprec run`` of each case's config text (its group: the case's name) into ``tmp/runs.db``, workers
    with one thread and this checkout's sources; returns per case (train/loss, manifest), each run completed
    with every step recorded once."""
    store = str(tmp / "runs.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))
        for name, text in cases.items():
            path = tmp / f"{name}.toml"
            path.write_text(text)
            assert main(["run", str(path), "--store", store]) == 0, name
    out = {}
    with RunStore(store) as s:
        for name in cases:
            (rec,) = s.list_runs(group=name)
            assert rec.status == "completed", (name, rec.error)
            got, loss = s.scalars(rec.run_id)["train/loss"]
            assert np.array_equal(got, np.arange(1, steps + 1)), name
            out[name] = (loss, rec.manifest)
    return out


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    """The largest relative difference of two loss curves (b the reference)."""
    return float(np.max(np.abs(a - b) / np.abs(b)))
