"""Task entry points with injected faults, for runner tests (``model = "_faulty_tasks:crash_at"``)."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch

from lowprec.runs.zoo import Task, get_task


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


def sigkill_at(*, seed: int, batch_size: int | None = None, step: int = 5, marker: str = "") -> Task:
    """mlp-digits whose process kills itself with SIGKILL at ``step`` (0-based), once (see ``crash_at``)."""
    task = get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s: int) -> tuple[Any, torch.Tensor]:
        if s == step and not Path(marker).exists():
            Path(marker).write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        return task.train_batch(s)

    return dataclasses.replace(task, name="sigkill_at", train_batch=batch)


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
