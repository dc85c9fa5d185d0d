"""Task entry points with injected faults, for runner tests (``model = "_faulty_tasks:crash_at"``)."""

from __future__ import annotations

import dataclasses
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
