"""``lowprec.integrations.lightning.LowprecCallback`` on a real ``pytorch_lightning.Trainer``.

A small MLP learns a linear rule on generated data (CPU, no logger, progress bar or checkpoints).  Oracles: the
module itself notes each batch's loss in ``training_step`` and the learning rate follows a known step schedule, so
``train/loss`` / ``train/lr`` in the store are compared with them step by step; ``eval/loss`` / ``eval/acc``
(from ``val_loss`` / ``val/acc``) are at the epoch ends and the last step; the config holds the hparams, the
Trainer settings and ``steps = max_steps``; three seeds make a baseline that ``baseline_from_runs`` accepts and a
second arm gets a verdict with an exit code of ``EXIT_CODES``; a module that raises mid-training gives a "failed"
run with that exception's text.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from lowprec import UsageError, accuracy  # noqa: E402
from lowprec.cli import main  # noqa: E402
from lowprec.integrations.lightning import LowprecCallback  # noqa: E402
from lowprec.runs import RunStore  # noqa: E402

pytestmark = [
    # Lightning's advice to use more DataLoader workers (a PossibleUserWarning) is about speed on real data; the
    # test's in-memory tensors are fastest with none.
    pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers"),
    # pytorch_lightning 2.6.6's CombinedLoader builds torch.utils._pytree.LeafSpec, which torch 2.13 deprecates:
    # raised inside Lightning for every fit, nothing a Trainer setting avoids.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
]

BATCHES = 8  # batches per epoch
STEPS = 3 * BATCHES
LR = 0.2
METRICS = {"loss": "min", "acc": "max"}


def lr_at(step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under StepLR(step_size=10, gamma=0.5)."""
    return LR * 0.5 ** ((step - 1) // 10)


def loader(n: int, data_seed: int) -> Any:
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=n // BATCHES)


class MLP(pl.LightningModule):
    """``fail_at``: raise in the training step of that (0-based) global step."""

    def __init__(self, lr: float = LR, hidden: int = 16, fail_at: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.hparams.fail_at is not None and self.global_step >= self.hparams.fail_at:
            raise RuntimeError(f"broken batch at step {self.global_step}")
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), batch_size=len(y))
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), batch_size=len(y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(seed: int, callback: LowprecCallback, *, steps: int = STEPS, accumulate: int = 1,
        fail_at: int | None = None) -> MLP:
    torch.manual_seed(seed)
    module = MLP(fail_at=fail_at)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                         callbacks=[callback])
    trainer.fit(module, loader(256, 1), loader(64, 2))
    return module


@pytest.fixture
def no_global_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)


@pytest.fixture(scope="module")
def arms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Three reference seeds (group "ref", seed from seed_everything) and three of a second arm ("cand")."""
    store = tmp_path_factory.mktemp("pl") / "runs.db"
    before = os.environ.get("PL_GLOBAL_SEED")
    runs = {}
    try:
        for group, seeds in (("ref", (0, 1, 2)), ("cand", (10, 11, 12))):
            for seed in seeds:
                pl.seed_everything(seed, verbose=False)
                cb = LowprecCallback(store=store, group=group, metrics=METRICS, data_hash="linear-1",
                                     config={"dataset": "linear"})
                module = fit(seed, cb)
                runs[cb.run_id] = (module.losses, seed, group)
    finally:
        if before is None:
            os.environ.pop("PL_GLOBAL_SEED", None)
        else:
            os.environ["PL_GLOBAL_SEED"] = before
    yield {"store": store, "runs": runs}


def test_runs_record_the_fit(arms: dict[str, Any]) -> None:
    assert len(arms["runs"]) == 6
    with RunStore(arms["store"], create=False) as store:
        for rid, (losses, seed, group) in arms["runs"].items():
            rec = store.get_run(rid)
            assert (rec.status, rec.group, rec.name, rec.error) == ("completed", group, f"{group} seed {seed}", None)
            assert rec.manifest["seed"] == seed and rec.manifest["source"] == "track"
            assert rec.manifest["metrics"] == METRICS and rec.manifest["data_hash"] == "linear-1"
            assert rec.manifest["hardware"]["device"] == "cpu" and rec.manifest["framework"] == "torch"
            cfg = rec.config
            assert cfg["model"] == "MLP" and cfg["steps"] == STEPS and cfg["max_steps"] == STEPS
            assert cfg["model_params"] == 8 * 16 + 16 + 16 * 2 + 2
            assert cfg["precision"] == "32-true" and cfg["accumulate_grad_batches"] == 1
            assert cfg["world_size"] == 1 and "max_epochs" not in cfg
            assert cfg["hparams"] == {"lr": LR, "hidden": 16, "fail_at": None}
            assert cfg["dataset"] == "linear"
            scalars = store.scalars(rid)
            assert set(scalars) == {"train/loss", "train/lr", "eval/loss", "eval/acc"}
            steps, values = scalars["train/loss"]
            assert steps.tolist() == list(range(1, STEPS + 1))
            assert values.tolist() == pytest.approx(losses, rel=1e-6)
            steps, values = scalars["train/lr"]
            assert steps.tolist() == list(range(1, STEPS + 1))
            assert values.tolist() == pytest.approx([lr_at(s) for s in range(1, STEPS + 1)], rel=1e-12)
            for key in ("eval/loss", "eval/acc"):
                steps, values = scalars[key]
                assert steps.tolist() == [BATCHES, 2 * BATCHES, STEPS]
            assert 0.0 <= min(scalars["eval/acc"][1]) and max(scalars["eval/acc"][1]) <= 1.0
            assert losses[-1] < losses[0]


def test_baseline_and_verdict(arms: dict[str, Any]) -> None:
    with RunStore(arms["store"]) as store:
        baseline = accuracy.baseline_from_runs(store, "ref", ["ref"])
        verdicts = accuracy.judge_groups(baseline, accuracy.select_runs(store, ["cand"]))
    assert len(verdicts) == 1 and verdicts[0].outcome in accuracy.EXIT_CODES
    code = main(["compare", "--baseline", "ref", "cand", "--store", str(arms["store"])])
    assert code == accuracy.EXIT_CODES[verdicts[0].outcome]


def test_accumulation_and_final_validation_mid_epoch(tmp_path: Path) -> None:
    """Two batches per optimizer step: a step's loss is their mean; max_steps=6 ends the second epoch (4 steps
    each) in its middle, and the callback makes Lightning validate at step 6."""
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, seed=3, metrics=METRICS)
    module = fit(3, cb, steps=6, accumulate=2)
    with RunStore(store, create=False) as st:
        rec = st.get_run(cb.run_id)
        scalars = st.scalars(cb.run_id)
    assert rec.status == "completed" and rec.config["accumulate_grad_batches"] == 2 and rec.config["steps"] == 6
    assert len(module.losses) == 12
    steps, values = scalars["train/loss"]
    assert steps.tolist() == [1, 2, 3, 4, 5, 6]
    pairs = [(module.losses[2 * i] + module.losses[2 * i + 1]) / 2 for i in range(6)]
    assert values.tolist() == pytest.approx(pairs, rel=1e-6)
    assert scalars["eval/loss"][0].tolist() == [4, 6] and scalars["eval/acc"][0].tolist() == [4, 6]


def test_an_exception_in_fit_fails_the_run(tmp_path: Path) -> None:
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, seed=0, group="g", metrics=METRICS)
    with pytest.raises(RuntimeError, match="broken batch at step 5"):
        fit(0, cb, fail_at=5)
    assert cb.run is None
    with RunStore(store, create=False) as st:
        rec = st.get_run(cb.run_id)
        scalars = st.scalars(cb.run_id)
    assert rec.status == "failed" and "RuntimeError: broken batch at step 5" in rec.error
    assert scalars["train/loss"][0].tolist() == [1, 2, 3, 4, 5]


class Manual(MLP):
    """Manual optimization: training_step steps the optimizer itself, logs ``train_loss`` and returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_reads_the_logged_loss(tmp_path: Path) -> None:
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, seed=0, metrics=METRICS)
    module = Manual()
    pl.Trainer(max_steps=5, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
               enable_checkpointing=False, enable_model_summary=False,
               callbacks=[cb]).fit(module, loader(256, 1), loader(64, 2))
    with RunStore(store, create=False) as st:
        scalars = st.scalars(cb.run_id)
    assert scalars["train/loss"][0].tolist() == [1, 2, 3, 4, 5]
    assert scalars["train/loss"][1].tolist() == pytest.approx(module.losses, rel=1e-6)
    assert scalars["train/lr"][1].tolist() == [0.1] * 5 and scalars["eval/acc"][0].tolist() == [5]


def test_a_missing_metric_warns(tmp_path: Path) -> None:
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, seed=0, metrics={"loss": "min", "f1": "max"})
    with pytest.warns(UserWarning, match=r"no \['f1'\] at its last step 8"):
        fit(0, cb, steps=8)
    with RunStore(store, create=False) as st:
        assert st.get_run(cb.run_id).status == "completed"
        (event,) = st.events(cb.run_id, "missing_final_eval")
    assert event["payload"] == {"metrics": ["f1"]} and event["step"] == 8


def test_a_run_needs_a_seed(tmp_path: Path, no_global_seed: None) -> None:
    cb = LowprecCallback(store=tmp_path / "runs.db")
    with pytest.raises(UsageError, match="seed_everything"):
        fit(0, cb, steps=2)
    assert cb.run_id is None


def test_bad_arguments() -> None:
    with pytest.raises(UsageError, match="eval_prefixes"):
        LowprecCallback(store="x.db", eval_prefixes="val_")
    with pytest.raises(UsageError, match="config must be a dict"):
        LowprecCallback(store="x.db", config=["a"])  # type: ignore[arg-type]


def test_import_without_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # `import pytorch_lightning` raises ImportError
    monkeypatch.delitem(sys.modules, "lowprec.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'lowprec\[lightning\]'"):
        importlib.import_module("lowprec.integrations.lightning")


def test_import_lowprec_does_not_import_lightning() -> None:
    code = ("import sys, lowprec, lowprec.integrations, lowprec.runs; "
            "assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
