"""Task entry points with injected faults, for runner tests (``model = "_faulty_tasks:crash_at"``).

Each builder is declared with ``@zoo.task``: a run config may only name declared task builders."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch

from lowprec.runs import zoo
from lowprec.runs.zoo import Task, get_task


@zoo.task
def crash_at(*, seed: int, batch_size: int | None = None, step: int = 5, marker: str = "") -> Task:
    """mlp-digits whose batch function raises at ``step`` (0-based), once: a run that dies mid-way.  The failure
    happens while the file ``marker`` does not exist, and creates it (so a resumed run goes through)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        if s == step and not Path(marker).exists():
            Path(marker).write_text("failed once")
            raise RuntimeError(f"injected failure at step {s}")
        return task.train_batch(s)

    return dataclasses.replace(task, name="crash_at", train_batch=batch)


@zoo.task
def nan_at(*, seed: int, batch_size: int | None = None, step: int = 5) -> Task:
    """mlp-digits whose batch at ``step`` (0-based) holds a NaN: the loss of step ``step + 1`` is NaN."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        x, y = task.train_batch(s)
        if s == step:
            x = x.clone()
            x[0, 0] = float("nan")
        return x, y

    return dataclasses.replace(task, name="nan_at", train_batch=batch)


@zoo.task
def sigkill_at(*, seed: int, batch_size: int | None = None, step: int = 5, marker: str = "") -> Task:
    """mlp-digits whose process kills itself with SIGKILL at ``step`` (0-based), once (see ``crash_at``)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        if s == step and not Path(marker).exists():
            Path(marker).write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        return task.train_batch(s)

    return dataclasses.replace(task, name="sigkill_at", train_batch=batch)


@zoo.task
def duplicated(*, seed: int, batch_size: int | None = None, copies: int = 2) -> Task:
    """mlp-digits whose global batch is ``copies`` stacked copies of a batch of ``batch_size / copies`` rows.

    With ``copies`` = world size, every DDP rank trains on the same rows, so the averaged gradient is
    ``(g + g) / 2 = g`` exactly: a 2-rank run does the same arithmetic as a 1-process run with ``copies = 1`` and
    half the batch, and any difference must come from state that depends on the world size."""
    total = batch_size or 64
    task = get_task("mlp-digits", seed=seed, batch_size=total // copies)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        x, y = task.train_batch(s)
        return torch.cat([x] * copies), torch.cat([y] * copies)

    return dataclasses.replace(task, name="duplicated", train_batch=batch, samples_per_step=total)


class _StepCounter(torch.nn.Module):
    """Counts its training-mode forwards in a buffer (so a replay that restores buffers restores the count).  With
    ``rank`` set, the fault fires only in the torchrun worker of that rank (``RANK``)."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        super().__init__()
        self.step = step
        self.rank = rank
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def _now(self) -> bool:
        if not self.training:
            return False
        with torch.no_grad():
            self.calls += 1
        here = self.rank is None or int(os.environ.get("RANK", "0")) == self.rank
        return here and int(self.calls) - 1 == self.step


class Overflow(_StepCounter):
    """Identity, except that its ``step``-th training forward multiplies by 2^140 (in two float32 products, so
    every |x| > 2^-12 overflows to +-inf and zeros stay zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0**100) * 2.0**40 if self._now() else x


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = grad.clone()
        out[0, 1] = float("nan")
        return out


class NanGrad(_StepCounter):
    """Identity in forward; on its ``step``-th training forward, its backward returns a gradient with one NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanBackward.apply(x) if self._now() else x  # type: ignore[no-any-return]


def _insert_after(task: Task, layer: int, name: str, module: torch.nn.Module) -> None:
    """Replace ``layers.<layer>`` of the zoo MLP by ``Sequential(linear=<it>, <name>=module)``."""
    from collections import OrderedDict

    layers = task.model.layers  # type: ignore[union-attr]
    layers[layer] = torch.nn.Sequential(OrderedDict([("linear", layers[layer]), (name, module)]))


@zoo.task
def overflow_at(*, seed: int, batch_size: int | None = None, step: int = 5, rank: int | None = None) -> Task:
    """mlp-digits with module ``layers.1.amp`` after the second linear whose forward output at batch ``step``
    (0-based) overflows to +-inf: the run's first non-finite tensor is that module's output at step ``step + 1``
    (on rank ``rank`` only, when set)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)
    _insert_after(task, 1, "amp", Overflow(step, rank))
    return dataclasses.replace(task, name="overflow_at")


@zoo.task
def nan_grad_at(*, seed: int, batch_size: int | None = None, step: int = 5, rank: int | None = None) -> Task:
    """mlp-digits with module ``layers.1.bad`` after the second linear whose backward at batch ``step`` (0-based)
    returns one NaN in the gradient of its input: the loss stays finite, the gradient norm is NaN, and the first
    non-finite tensor is ``layers.1.bad``'s grad_input at step ``step + 1`` (on rank ``rank`` only, when set)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)
    _insert_after(task, 1, "bad", NanGrad(step, rank))
    return dataclasses.replace(task, name="nan_grad_at")


@zoo.task
def tiny_input(*, seed: int, batch_size: int | None = None, scale: float = 2.0**-12, crash_step: int = -1,
               marker: str = "", copies: int = 1) -> Task:
    """mlp-digits with inputs multiplied by ``scale`` (pixels in [0, 1] -> at most 2^-12: every nonzero input
    underflows in unscaled fp8 e4m3, whose smallest subnormal is 2^-9).  With ``crash_step`` >= 0 the batch
    function raises once at that step (see ``crash_at``).  ``copies`` stacks copies of a batch of
    ``batch_size / copies`` rows (see ``duplicated``).  Evaluation uses the unscaled held-out data."""
    rows = batch_size if copies == 1 else (batch_size or 64) // copies
    task = get_task("mlp-digits", seed=seed, batch_size=rows)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        if s == crash_step and not Path(marker).exists():
            Path(marker).write_text("failed once")
            raise RuntimeError(f"injected failure at step {s}")
        x, y = task.train_batch(s)
        return torch.cat([x * scale] * copies), torch.cat([y] * copies)

    return dataclasses.replace(task, name="tiny_input", train_batch=batch,
                               samples_per_step=task.samples_per_step * copies)


@zoo.task
def spike_at(*, seed: int, batch_size: int | None = None, step: int = 5, scale: float = 300.0) -> Task:
    """mlp-digits whose batch ``step`` (0-based batch index) is scaled by ``scale``: a reproducible loss spike in
    the data (skipping that batch removes it)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        x, y = task.train_batch(s)
        return (x * scale, y) if s == step else (x, y)

    return dataclasses.replace(task, name="spike_at", train_batch=batch)


@zoo.task
def spike_crash(*, seed: int, batch_size: int | None = None, step: int = 5, crash: int = 12,
                marker: str = "") -> Task:
    """``spike_at`` whose batch function also raises once at batch ``crash`` (see ``crash_at``)."""
    task = spike_at(seed=seed, batch_size=batch_size, step=step)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        if s == crash and not Path(marker).exists():
            Path(marker).write_text("failed once")
            raise RuntimeError(f"injected failure at batch {s}")
        return task.train_batch(s)

    return dataclasses.replace(task, name="spike_crash", train_batch=batch)
