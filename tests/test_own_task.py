"""A task of your own (docs/runs.md, "Your own task"): the public Task helpers, the batch contract, the config's
folder on the import path, the ``device`` field, and the example under examples/own_task run end to end.

Oracles: hand-computed losses of the three batch forms (a dict calls ``model(**batch)``, a tuple ``(*inputs,
target)`` calls ``model(*inputs)``, a tensor ``model(batch)``) against the same model called directly; the run
store read back after ``lowprec run`` in a subprocess started from another folder (status, manifest, scalars);
the example's task built in this process (its data hash, its metric names); ``torch.cuda.is_available()`` for
what "auto" must pick.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import UsageError
from lowprec.runs import zoo

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
