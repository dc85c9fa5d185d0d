"""``device = "xla"`` in run configs, in the main suite (no torch_xla here): what is refused, and when.

Training on the XLA device itself is tests_xla/test_xla_runs.py (``make test-xla``).  Oracle: the refusals are
UsageErrors naming ``device`` and the fix, raised before any work (the store holds no run afterwards).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lowprec._errors import UsageError
from lowprec.runs import RunConfig, RunStore
from lowprec.runs._config import ParallelConfig
from lowprec.runs._runner import run_config


def test_xla_round_trips() -> None:
    c = RunConfig(model="mlp-digits", device="xla")
    assert c.to_dict()["device"] == "xla" and RunConfig.from_dict(c.to_dict()) == c
    assert RunConfig.from_toml('model = "mlp-digits"\ndevice = "xla"\n').device == "xla"


def test_xla_without_torch_xla_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else real(name, *a))
    config = RunConfig(model="synthetic-regression", steps=2, device="xla", store=str(tmp_path / "r.db"))
    with RunStore(config.store) as store, pytest.raises(
            UsageError, match=r"device = \"xla\" needs torch_xla, which is not installed.*pip install torch_xla.*"
                              r"set device = \"cpu\""):
        run_config(config, store=store, progress=False)
    with RunStore(config.store) as store:
        assert store.list_runs() == []


@pytest.mark.parametrize("parallel", [ParallelConfig(strategy="ddp", world_size=2),
                                      ParallelConfig(strategy="fsdp2", world_size=2)])
def test_xla_with_more_than_one_process_is_refused_when_built(parallel: ParallelConfig) -> None:
    with pytest.raises(UsageError, match=r"device = \"xla\" trains in one process.*parallel.strategy = \"single\""):
        RunConfig(model="mlp-digits", device="xla", parallel=parallel)
    toml = 'model = "mlp-digits"\ndevice = "xla"\n[parallel]\nstrategy = "ddp"\nworld_size = 2\n'
    with pytest.raises(UsageError, match=r"device = \"xla\" trains in one process"):
        RunConfig.from_toml(toml)


def test_xla_with_jax_is_refused() -> None:
    with pytest.raises(UsageError, match=r"device = \"xla\" is a PyTorch/XLA device.*framework = \"torch\""):
        RunConfig(model="mlp-digits", framework="jax", device="xla")
