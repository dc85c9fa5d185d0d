"""``lowprec run`` with ``device = "xla"``: the runner trains on torch_xla's device and stores the run like any other.

Oracle: the same config with ``device = "cpu"`` in this process (eager CPU, same torch 2.9): the per-step losses
agree within ``TOLERANCES["xla_vs_cpu_step1_loss_rel"]`` at step 1 and ``"xla_vs_cpu_loss_rel"`` after (the causes:
tests_xla/test_xla_train.py), and the manifest says where each ran.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import numpy as np
from _helpers import start_runtime

from lowprec.runs import RunConfig, RunStore
from lowprec.runs._runner import run_config
from lowprec.testing.tolerances import TOLERANCES

start_runtime()
STEPS = 6


def _config(device: str, store: Path) -> RunConfig:
    return RunConfig.from_toml(f'model = "mlp-digits"\nrecipe = "fp8-tensorwise"\nsteps = {STEPS}\n'
                               f'eval_interval = 3\nthreads = 1\ndevice = "{device}"\nstore = "{store}"\n')


def _losses(store: RunStore, rid: str) -> np.ndarray:
    steps, values = store.scalars(rid)["train/loss"]
    assert list(steps) == list(range(1, STEPS + 1))
    return np.asarray(values, dtype=np.float64)


def test_run_on_xla_is_stored_and_matches_the_cpu_run(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with RunStore(str(db)) as store:
        (xla_id,) = run_config(_config("xla", db), store=store, progress=False)
        (cpu_id,) = run_config(_config("cpu", db), store=store, progress=False)
        xla, cpu = store.get_run(xla_id), store.get_run(cpu_id)
        assert xla.status == cpu.status == "completed"
        hw = xla.manifest["hardware"]
        assert hw["device"] == "xla" and hw["torch_xla"] == importlib.metadata.version("torch_xla")
        assert hw["xla_device"] == "CPU" and cpu.manifest["hardware"]["device"] == "cpu"
        assert xla.config["device"] == "xla"
        got, want = _losses(store, xla_id), _losses(store, cpu_id)
        rel = np.abs(got - want) / np.abs(want)
        assert rel[0] <= TOLERANCES["xla_vs_cpu_step1_loss_rel"].value, rel
        assert rel.max() <= TOLERANCES["xla_vs_cpu_loss_rel"].value, rel
        ev_x, ev_c = store.scalars(xla_id)["eval/accuracy"], store.scalars(cpu_id)["eval/accuracy"]
        assert list(ev_x[0]) == list(ev_c[0]) == [3, STEPS]
        assert np.allclose(ev_x[1], ev_c[1], atol=2 / 355)  # 355 validation digits: at most 2 flipped


def test_lowprec_run_cli_with_device_xla(tmp_path: Path) -> None:
    """The command line: ``lowprec run config.toml`` in a fresh process trains on XLA and records it."""
    db = tmp_path / "runs.db"
    cfg = tmp_path / "xla.toml"
    cfg.write_text(f'model = "mlp-digits"\nrecipe = "fp8-tensorwise"\nsteps = 2\neval_interval = 2\n'
                   f'threads = 1\ndevice = "xla"\nstore = "{db}"\n')
    out = subprocess.run([sys.executable, "-m", "lowprec.cli", "run", str(cfg), "--quiet"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    with RunStore(str(db)) as store:
        (run,) = store.list_runs()
        assert run.status == "completed" and run.manifest["hardware"]["device"] == "xla"
        assert len(store.scalars(run.run_id)["train/loss"][0]) == 2
