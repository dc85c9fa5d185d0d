"""``lowprec.integrations.transformers.LowprecCallback`` on a real ``transformers.Trainer``.

A tiny BERT sequence classifier built from a config (no download) learns a label that is a function of one token
of generated data.  Oracles: the scalars in the store are the Trainer's own ``state.log_history`` (``loss``,
``learning_rate``, ``grad_norm`` at their ``step``; ``eval_loss`` / ``eval_accuracy`` at the last step); the
run's config holds the TrainingArguments' values and ``steps = max_steps``; three seeds make a baseline that
``baseline_from_runs`` accepts (so the loss fell by 5%+ and every step was logged) and a second arm of the same
recipe gets a verdict with an exit code of ``EXIT_CODES``; a run whose data raises at step 6 is "failed" with
that exception's text, whether the callback is a context manager, garbage-collected, or the process exits.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from lowprec import accuracy  # noqa: E402
from lowprec.cli import main  # noqa: E402
from lowprec.integrations.transformers import LowprecCallback  # noqa: E402
from lowprec.runs import RunStore  # noqa: E402

STEPS = 30
METRICS = {"loss": "min", "accuracy": "max"}


class Tokens(torch.utils.data.Dataset):
    """Fixed generated sequences (independent of the run's seed); label = token 1 is in the lower half.
    ``fail_after``: raise on the item of that index (a data pipeline that breaks mid-training)."""

    def __init__(self, n: int, data_seed: int, fail_after: int | None = None) -> None:
        g = torch.Generator().manual_seed(data_seed)
        self.ids = torch.randint(0, 64, (n, 8), generator=g)
        self.labels = (self.ids[:, 0] < 32).long()
        self.fail_after = fail_after
        self.served = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.served += 1
        if self.fail_after is not None and self.served > self.fail_after:
            raise RuntimeError(f"broken shard at sample {self.served}")
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": self.labels[i]}


def make_model(seed: int) -> Any:
    transformers.set_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def accuracy_of(pred: Any) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def make_trainer(tmp: Path, seed: int, callback: LowprecCallback, *, fail_after: int | None = None,
                 steps: int = STEPS) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp / f"out-{seed}"), max_steps=steps, per_device_train_batch_size=8, learning_rate=5e-3,
        lr_scheduler_type="constant", logging_steps=1, eval_strategy="steps", eval_steps=steps, save_strategy="no",
        report_to=[], use_cpu=True, seed=seed, dataloader_num_workers=0, disable_tqdm=True, log_level="error")
    return transformers.Trainer(model=make_model(seed), args=args, train_dataset=Tokens(320, 1, fail_after),
                                eval_dataset=Tokens(64, 2), compute_metrics=accuracy_of, callbacks=[callback])


@pytest.fixture(scope="module")
def arms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three reference seeds (group "ref") and three of a second arm of the same recipe (group "cand")."""
    tmp = tmp_path_factory.mktemp("hf")
    store = tmp / "runs.db"
    histories = {}
    for group, seeds in (("ref", (0, 1, 2)), ("cand", (10, 11, 12))):
        for seed in seeds:
            cb = LowprecCallback(store=store, group=group, metrics=METRICS, data_hash="tokens-1",
                                 config={"dataset": "tokens"})
            trainer = make_trainer(tmp, seed, cb)
            trainer.train()
            histories[cb.run_id] = (trainer.state.log_history, seed, group)
    return {"store": store, "histories": histories, "tmp": tmp}


def test_runs_are_the_trainers_log_history(arms: dict[str, Any]) -> None:
    with RunStore(arms["store"], create=False) as store:
        for rid, (history, seed, group) in arms["histories"].items():
            rec = store.get_run(rid)
            assert (rec.status, rec.group, rec.name, rec.error) == ("completed", group, f"{group} seed {seed}", None)
            assert rec.manifest["seed"] == seed and rec.manifest["source"] == "track"
            assert rec.manifest["metrics"] == METRICS and rec.manifest["data_hash"] == "tokens-1"
            assert rec.manifest["hardware"]["device"] == "cpu"
            cfg = rec.config
            assert cfg["model"] == "bert" and cfg["model_type"] == "bert" and cfg["steps"] == STEPS
            assert cfg["learning_rate"] == 5e-3 and cfg["per_device_train_batch_size"] == 8
            assert cfg["lr_scheduler_type"] == "constant" and cfg["logging_steps"] == 1
            assert cfg["dataset"] == "tokens" and "seed" not in cfg and "output_dir" not in cfg
            assert cfg["model_params"] > 0
            scalars = store.scalars(rid)
            expect: dict[str, dict[int, float]] = {}
            for entry in history:
                for key, name in (("loss", "train/loss"), ("learning_rate", "train/lr"),
                                  ("grad_norm", "train/grad_norm"), ("eval_loss", "eval/loss"),
                                  ("eval_accuracy", "eval/accuracy")):
                    if key in entry:
                        expect.setdefault(name, {})[entry["step"]] = float(entry[key])
            assert set(scalars) == set(expect)
            for name, by_step in expect.items():
                steps, values = scalars[name]
                assert dict(zip(steps.tolist(), values.tolist(), strict=True)) == pytest.approx(by_step, rel=1e-12)
            assert list(expect["train/loss"]) == list(range(1, STEPS + 1))
            assert list(expect["eval/loss"]) == [STEPS] and list(expect["eval/accuracy"]) == [STEPS]


def test_baseline_and_verdict(arms: dict[str, Any]) -> None:
    with RunStore(arms["store"]) as store:
        baseline = accuracy.baseline_from_runs(store, "ref", ["ref"])
        verdicts = accuracy.judge_groups(baseline, accuracy.select_runs(store, ["cand"]))
    assert len(verdicts) == 1 and verdicts[0].outcome in accuracy.EXIT_CODES
    # the command line gives the same outcome as its exit code
    code = main(["compare", "--baseline", "ref", "cand", "--store", str(arms["store"])])
    assert code == accuracy.EXIT_CODES[verdicts[0].outcome]


def _failed_run(store: Path, rid: str | None) -> Any:
    assert rid is not None
    with RunStore(store, create=False) as st:
        rec = st.get_run(rid)
        return rec, st.scalars(rid)


def test_an_exception_in_train_fails_the_run_with_block(tmp_path: Path) -> None:
    """The context manager marks the run failed with the exception that propagates from train()."""
    store = tmp_path / "runs.db"
    with pytest.raises(RuntimeError, match="broken shard"):
        with LowprecCallback(store=store, group="g", metrics=METRICS) as cb:
            trainer = make_trainer(tmp_path, 0, cb, fail_after=8 * 5, steps=10)
            trainer.train()
    rec, scalars = _failed_run(store, cb.run_id)
    assert rec.status == "failed" and "RuntimeError: broken shard at sample 41" in rec.error
    # the steps logged before the broken batch (accelerate fetches one batch ahead: steps 1-4 of batch 6's error)
    logged = [e["step"] for e in trainer.state.log_history if "loss" in e]
    assert scalars["train/loss"][0].tolist() == logged and 3 <= len(logged) <= 5
    assert cb.run is None


def test_an_exception_in_train_fails_the_run_when_collected(tmp_path: Path) -> None:
    """Without the ``with`` block, the run is marked failed when the callback is garbage-collected; a second
    train() with the same callback first closes the unfinished run."""
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, group="g", metrics=METRICS)
    trainer = make_trainer(tmp_path, 0, cb, fail_after=8 * 3, steps=10)
    with pytest.raises(RuntimeError, match="broken shard"):
        trainer.train()
    first = cb.run_id
    with pytest.raises(RuntimeError, match="broken shard"):
        trainer.train()
    rec, _ = _failed_run(store, first)
    assert rec.status == "failed" and "a new trainer.train() began" in rec.error
    second = cb.run_id
    assert second != first and cb.run_ids == [first, second]
    del trainer, cb
    gc.collect()
    rec, _ = _failed_run(store, second)
    assert rec.status == "failed" and "did not reach on_train_end" in rec.error


@pytest.mark.slow  # a subprocess importing transformers and training (~25 s quiet, 65 s under load): make test-slow
def test_an_uncaught_exception_fails_the_run_at_exit(tmp_path: Path) -> None:
    """A script whose trainer.train() raises: the run is failed at exit with the uncaught exception's text."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_integrations_transformers import LowprecCallback, make_trainer
        from pathlib import Path
        cb = LowprecCallback(store={str(tmp_path / "runs.db")!r}, group="g")
        trainer = make_trainer(Path({str(tmp_path)!r}), 0, cb, fail_after=8 * 2, steps=10)
        trainer.train()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "broken shard" in proc.stderr, proc.stderr[-2000:]
    with RunStore(tmp_path / "runs.db", create=False) as st:
        (rec,) = st.list_runs(group="g")
    assert rec.status == "failed" and "did not reach on_train_end" in rec.error
    assert "uncaught RuntimeError: broken shard at sample 17" in rec.error


def test_missing_final_eval_warns(tmp_path: Path) -> None:
    """A declared metric that compute_metrics does not return is reported at on_train_end."""
    store = tmp_path / "runs.db"
    cb = LowprecCallback(store=store, metrics={"loss": "min", "f1": "max"})
    trainer = make_trainer(tmp_path, 0, cb, steps=6)
    with pytest.warns(UserWarning, match=r"no \['f1'\] at its last step 6"):
        trainer.train()
    with RunStore(store, create=False) as st:
        assert st.get_run(cb.run_id).status == "completed"
        (event,) = st.events(cb.run_id, "missing_final_eval")
    assert event["payload"] == {"metrics": ["f1"]} and event["step"] == 6
    assert math.isfinite(trainer.state.log_history[-2]["eval_loss"])


def test_import_lowprec_does_not_import_transformers() -> None:
    code = "import sys, lowprec, lowprec.integrations, lowprec.runs; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# The example leaves dataloader_pin_memory at its default (True), on which torch warns on a machine without GPU.
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning")
def test_docs_trainer_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/own-loop.md's Trainer example runs as written (fewer steps, CPU, the test's tiny BERT and data for the
    names it leaves to the reader) and records one completed run with its eval metrics at the last step."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "own-loop.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "transformers import" in b]
    code = block.replace("max_steps=500", "max_steps=6").replace("eval_steps=100", "eval_steps=6")
    assert code.count("=6") == 2, "the example's max_steps=500 / eval_steps=100 changed: update this test"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "docs_trainer_example", "seed": 3, "data_hash": "tokens-1",
                                 "model": make_model(3), "train": Tokens(64, 1), "held_out": Tokens(16, 2),
                                 "accuracy": accuracy_of}
    exec(compile(code, "docs/own-loop.md", "exec"), namespace)  # noqa: S102
    with RunStore(tmp_path / "runs.db", create=False) as store:
        (rec,) = store.list_runs(group="my-fp8")
        assert rec.status == "completed" and rec.manifest["seed"] == 3
        scalars = store.scalars(rec.run_id)
        assert list(scalars["train/loss"][0]) == [1, 2, 3, 4, 5, 6]
        assert list(scalars["eval/accuracy"][0]) == [6] and rec.config["recipe"] == "fp8-tensorwise"
