"""A task of your own (docs/runs.md, "Your own task"): the public Task helpers, the batch contract, the config's
folder on the import path, the ``device`` field, and the example under examples/own_task run end to end.

Oracles: hand-computed losses of the three batch forms (a dict calls ``model(**batch)``, a tuple ``(*inputs,
target)`` calls ``model(*inputs)``, a tensor ``model(batch)``) against the same model called directly; the run
store read back after ``lowprec run`` in a subprocess started from another folder (status, manifest, scalars);
the example's task built in this process (its data hash, its metric names); ``torch.cuda.is_available()`` for
what "auto" must pick.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import UsageError
from lowprec.runs import RunConfig, RunStore, run_config, zoo
from lowprec.runs._config import ParallelConfig

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "own_task"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


class Linear2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with zoo.seeded(0):
            self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x) * (1.0 if scale is None else scale)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = zoo.generator(0, "test", zoo.check_step(step))
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


# ------------------------------------------------------------------------------------------- the batch contract


def test_batch_loss_follows_the_contract_for_dict_tuple_and_tensor_batches() -> None:
    m = Linear2()
    x, y = _batch(0)
    scale = torch.tensor(2.0)
    mse = F.mse_loss
    assert torch.equal(zoo.batch_loss(m, (x, y), mse), mse(m(x), y))
    assert torch.equal(zoo.batch_loss(m, [x, scale, y], mse), mse(m(x, scale), y))
    got = zoo.batch_loss(m, {"x": x, "scale": scale}, lambda out, b: mse(out, b["x"][:, :2]))
    assert torch.equal(got, mse(m(x, scale), x[:, :2]))
    assert torch.equal(zoo.batch_loss(m, x, lambda out, b: out.sum() + b.sum()), m(x).sum() + x.sum())
    with pytest.raises(UsageError, match="0-d float tensor.*shape \\[4, 2\\]"):
        zoo.batch_loss(m, (x, y), lambda out, t: out - t)
    with pytest.raises(UsageError, match="at least two elements"):
        zoo.batch_loss(m, (x,), mse)


def test_model_loss_reads_the_loss_the_model_returns() -> None:
    loss = torch.tensor(1.5)
    assert zoo.model_loss({"loss": loss, "logits": None}) is loss
    assert zoo.model_loss(type("Out", (), {"loss": loss})()) is loss
    assert zoo.model_loss(loss) is loss
    with pytest.raises(UsageError, match="no loss_fn and the model returned a dict without a loss"):
        zoo.model_loss({"logits": torch.zeros(2)})


def test_to_device_and_batch_rows_walk_nested_batches() -> None:
    b = {"a": (torch.zeros(5, 2), [torch.ones(5)]), "n": 3}
    moved = zoo.to_device(b, "cpu")
    assert moved["n"] == 3 and isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)
    assert zoo.batch_rows(b) == 5 and zoo.batch_rows((torch.zeros(7, 1), torch.zeros(7))) == 7
    assert zoo.model_device(Linear2()) == torch.device("cpu")
    with pytest.raises(UsageError, match="samples_per_step"):
        zoo.batch_rows({"n": 3})


# ------------------------------------------------------------------------------------------- a minimal Task


def test_a_minimal_task_fills_its_defaults() -> None:
    held_out = [_batch(10_000 + i) for i in range(2)]
    t = zoo.Task(model=Linear2(), train_batch=_batch, loss_fn=F.mse_loss, eval_batches=held_out)
    assert t.samples_per_step == 4 and t.metrics == {"loss": "min"} and t.defaults == {}
    assert t.data_hash == zoo.hash_batches(*held_out) and len(t.data_hash) == 64
    m = t.model
    with torch.no_grad():
        want = sum(float(F.mse_loss(m(x), y).double()) * 4 for x, y in held_out) / 8
    assert t.evaluate(m) == {"loss": pytest.approx(want, rel=1e-12)}
    assert m.training  # restored
    # a dict-batch task whose model returns its loss needs no loss_fn
    hf = zoo.Task(model=nn.Module(), train_batch=lambda s: {"x": torch.zeros(3, 1)},
                  eval_batches=[{"x": torch.zeros(3, 1)}])
    assert hf.loss_fn is zoo.model_loss and hf.samples_per_step == 3


def test_task_refusals_name_the_fix() -> None:
    with pytest.raises(UsageError, match="give eval_batches .* or evaluate"):
        zoo.Task(model=Linear2(), train_batch=_batch)
    with pytest.raises(UsageError, match="need an evaluate function"):
        zoo.Task(model=Linear2(), train_batch=_batch, eval_batches=[_batch(1)], metrics={"loss": "min", "acc": "max"})
    with pytest.raises(UsageError, match="data_hash is required"):
        zoo.Task(model=Linear2(), train_batch=_batch, evaluate=lambda m: {"loss": 0.0})
    with pytest.raises(UsageError, match="list of batches"):
        zoo.Task(model=Linear2(), train_batch=_batch, eval_batches={"x": torch.zeros(1)})


def test_generator_streams_are_independent_and_reproducible() -> None:
    a = torch.rand(3, generator=zoo.generator(1, "train", 0))
    assert torch.equal(a, torch.rand(3, generator=zoo.generator(1, "train", 0)))
    assert not torch.equal(a, torch.rand(3, generator=zoo.generator(1, "train", 1)))
    assert zoo.derive_seed(1, "train", 0) == zoo.derive_seed("1", "train", "0")  # parts are joined as text


# ------------------------------------------------------------------------------------------- the config's folder


def _write_task_module(folder: Path, module: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(
        "import torch\nfrom lowprec.runs import zoo\n\n"
        "def undeclared(*, seed, batch_size=None):\n    raise AssertionError('must not be called')\n\n"
        "@zoo.task\ndef make(*, seed, batch_size=None):\n"
        "    with zoo.seeded(seed):\n        model = torch.nn.Linear(3, 2)\n"
        "    def batch(step):\n        g = zoo.generator(seed, 'x', step)\n"
        "        return torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)\n"
        "    return zoo.Task(model=model, train_batch=batch, loss_fn=torch.nn.functional.mse_loss,\n"
        "                    eval_batches=[batch(10**6)])\n")


def test_config_folder_is_on_the_import_path_only_while_resolving(tmp_path: Path) -> None:
    module = "own_task_test_folder_mod"
    _write_task_module(tmp_path / "cfg", module)
    (tmp_path / "cfg" / "run.toml").write_text(f'model = "{module}:make"\nsteps = 3\n')
    from lowprec.runs import build_task, load_config

    config = load_config(tmp_path / "cfg" / "run.toml")
    assert config.config_dir == str((tmp_path / "cfg").resolve())
    assert "config_dir" not in config.to_dict()
    task = build_task(config, 0)
    assert task.name == f"{module}:make" and task.samples_per_step == 8
    assert config.config_dir not in sys.path
    with pytest.raises(UsageError, match="is not declared a lowprec task"):
        build_task(dataclasses.replace(config, model=f"{module}:undeclared"), 0)
    with pytest.raises(UsageError, match="next to the run config"):
        build_task(dataclasses.replace(config, model="own_task_no_such_mod:make"), 0)


# ------------------------------------------------------------------------------------------- device


def test_device_round_trips_and_is_checked() -> None:
    for device in ("cpu", "cuda"):
        c = RunConfig(model="mlp-digits", device=device)
        assert c.to_dict()["device"] == device and RunConfig.from_dict(c.to_dict()) == c
    auto = RunConfig(model="mlp-digits")
    assert auto.device == "auto" and "device" not in auto.to_dict()  # a default config's data is unchanged
    assert RunConfig.from_toml('model = "mlp-digits"\ndevice = "cpu"\n').device == "cpu"
    with pytest.raises(UsageError, match="device must be one of 'auto', 'cpu', 'cuda', 'xla'; got 'gpu'"):
        RunConfig.from_toml('model = "mlp-digits"\ndevice = "gpu"\n')
    with pytest.raises(UsageError, match="framework = \"jax\".*device"):
        RunConfig(model="mlp-digits", framework="jax", device="cuda")


@NO_CUDA
def test_auto_is_cpu_here_and_recorded(tmp_path: Path) -> None:
    from lowprec.runs._parallel import resolve_backend, resolve_device

    assert resolve_device("auto") == "cpu" and resolve_backend("auto", "auto") == "gloo"
    config = RunConfig(model="synthetic-regression", steps=2, eval_interval=2, threads=1, store=str(tmp_path / "r.db"))
    with RunStore(config.store) as store:
        (rid,) = run_config(config, store=store, progress=False)
        rec = store.get_run(rid)
    assert rec.status == "completed" and rec.manifest["hardware"]["device"] == "cpu"
    assert rec.manifest["hardware"]["gpu"] is None and "device" not in rec.config


@NO_CUDA
def test_cuda_without_a_gpu_is_refused_before_any_work(tmp_path: Path) -> None:
    from lowprec.runs._launch import preflight

    for par in (ParallelConfig(), ParallelConfig(strategy="ddp", world_size=2)):
        config = RunConfig(model="synthetic-regression", steps=2, device="cuda", parallel=par,
                           store=str(tmp_path / "r.db"))
        with RunStore(config.store) as store, pytest.raises(UsageError, match="no usable CUDA GPU.*device = \"cpu\""):
            run_config(config, store=store, progress=False)
        with RunStore(config.store) as store:
            assert store.list_runs() == []
    with pytest.raises(UsageError, match="no usable CUDA GPU"):
        preflight(RunConfig(model="mlp-digits", device="cuda", parallel=ParallelConfig(strategy="ddp", world_size=2)),
                  64)


# ------------------------------------------------------------------------------------------- the example


def _example_task() -> zoo.Task:
    if str(EXAMPLE) not in sys.path:
        sys.path.append(str(EXAMPLE))
    try:
        return zoo.get_task("mytask:make", seed=0, import_dir=EXAMPLE, hidden=32)
    finally:
        if str(EXAMPLE) in sys.path:
            sys.path.remove(str(EXAMPLE))


def _lowprec(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOWPREC_STORE", "LOWPREC_CONFIG_DIR")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "lowprec.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _check_example_runs(store_path: Path, n: int, steps: int, world_size: int, folder: Path = EXAMPLE) -> None:
    task = _example_task()
    with RunStore(store_path) as store:
        runs = store.list_runs()
        assert len(runs) == n
        for rec in runs:
            rec = store.get_run(rec.run_id)
            assert rec.status == "completed", rec.error
            assert rec.config["model"] == "mytask:make" and rec.config["steps"] == steps
            assert rec.manifest["hardware"]["device"] == "cpu" and rec.manifest["world_size"] == world_size
            assert rec.manifest["config_dir"] == str(folder.resolve())
            assert rec.manifest["data_hash"] == task.data_hash and rec.manifest["metrics"] == task.metrics
            sc = store.scalars(rec.run_id)
            assert list(sc["train/loss"][0]) == list(range(1, steps + 1))
            assert list(sc["eval/accuracy"][0])[-1] == steps and 0.0 <= sc["eval/accuracy"][1][-1] <= 1.0


@NO_CUDA
def test_example_runs_from_another_folder(tmp_path: Path) -> None:
    """``lowprec run examples/own_task/run.toml`` from a folder that is not the example's, no PYTHONPATH."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    store = tmp_path / "store" / "runs.db"
    p = _lowprec(["run", str(EXAMPLE / "run.toml"), "--store", str(store), "--steps", "6", "--seeds", "0",
                  "--quiet"], cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_example_runs(store, 1, 6, 1)
    assert not (cwd / "lowprec-runs").exists()


@NO_CUDA
@pytest.mark.slow  # torchrun with 2 processes (~20 s quiet, 50 s under load): make test-slow
def test_example_trains_data_parallel_with_dict_batches(tmp_path: Path) -> None:
    """The example on 2 torchrun workers (gloo) from a copy of its folder: the workers find mytask.py there, in the
    folder the launcher passes them, not through PYTHONPATH or the working directory."""
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "mytask.py").write_text((EXAMPLE / "mytask.py").read_text())
    text = (EXAMPLE / "run.toml").read_text().replace('recipe = "fp8-tensorwise"', 'recipe = "fp32"')
    (folder / "run.toml").write_text(text + '\n[parallel]\nstrategy = "ddp"\nworld_size = 2\n')
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    store = tmp_path / "runs.db"
    p = _lowprec(["run", str(folder / "run.toml"), "--store", str(store), "--steps", "4", "--seeds", "0", "--quiet"],
                 cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_example_runs(store, 1, 4, 2, folder=folder)
