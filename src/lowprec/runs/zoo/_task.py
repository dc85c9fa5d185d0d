"""``Task``: a model, its data stream and its held-out metrics, all a pure function of one seed.

A task is what the runner trains and what the judge compares across recipes, so it must be reproducible to the
bit: the same ``seed`` gives the same initial parameters and the same batch at every step, on any machine with
the same torch build and thread count.  Three rules make that hold without any hidden state:

* model initialisation draws from the global torch generator inside :func:`seeded` (a ``fork_rng`` block seeded
  from the task seed), so building a task neither depends on nor disturbs the caller's random state;
* the batch of step ``s`` is computed from ``(seed, s)`` alone.  Data sets that are swept in epochs use a fresh
  permutation per epoch drawn from a generator seeded with ``derive_seed(seed, stream, epoch)``, so resuming at
  step ``k`` needs nothing but ``k``, and calling ``train_batch`` out of order gives the same batches;
* the held-out split never depends on the training seed, so every seed is judged on the same examples.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._errors import UsageError

DIRECTIONS = ("min", "max")


@dataclass(frozen=True, kw_only=True)
class Task:
    """A training task: a freshly initialised model, a pure batch function and held-out metrics."""

    name: str
    """Registry name (e.g. ``"mlp-digits"``), or the entry point that built it."""
    model: torch.nn.Module
    """Freshly initialised from the seed (float32, CPU, training mode)."""
    train_batch: Callable[[int], tuple[Any, torch.Tensor]]
    """``step`` (0-based) -> ``(inputs, targets)``; a pure function of ``(seed, step)``."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """``(model output, targets)`` -> scalar loss (a 0-d float tensor) to minimise."""
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    """Held-out metrics under ``torch.no_grad``; deterministic; restores the model's training mode."""
    metrics: dict[str, str]
    """Metric name -> ``"min"`` or ``"max"`` (which direction is better); always has ``"loss"``."""
    data_hash: str
    """sha256 (hex) of the data bytes actually used (train and held-out parts, in order)."""
    data_source: str
    """Where the data comes from, in words (with the library/Python version where the data can change)."""
    samples_per_step: int
    """Examples per training batch (sequences for language models), for throughput."""
    defaults: dict[str, Any]
    """Suggested ``steps``, ``lr``, ``optimizer``, ``eval_interval``, ``batch_size`` and ``warmup``."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able facts about the task (sizes, parameter count, resolved options, known optimum, ...)."""

    def __post_init__(self) -> None:
        if "loss" not in self.metrics:
            raise UsageError(f"Task.metrics must include 'loss'; got {sorted(self.metrics)}")
        for k, v in self.metrics.items():
            if v not in DIRECTIONS:
                raise UsageError(f"Task.metrics[{k!r}] must be 'min' or 'max'; got {v!r}")
        if not isinstance(self.model, torch.nn.Module):
            raise UsageError(f"Task.model must be a torch.nn.Module; got {type(self.model).__name__}")
        if not isinstance(self.samples_per_step, int) or self.samples_per_step < 1:
            raise UsageError(f"Task.samples_per_step must be a positive int; got {self.samples_per_step!r}")


# ---------------------------------------------------------------------------------------------- seeds and data


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` via sha256: stable across Python, numpy and torch versions."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the global CPU generator seeded from ``seed``; the caller's state is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def hash_arrays(*arrays: torch.Tensor) -> str:
    """sha256 over each tensor's dtype, shape and little-endian bytes, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = a.detach().cpu().contiguous()
        h.update(f"{a.dtype}{tuple(a.shape)}".encode())
        h.update(a.numpy().astype(a.numpy().dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def check_step(step: Any) -> int:
    """``step`` as an int >= 0 (ValueError otherwise)."""
    try:
        s = operator.index(step)
    except TypeError:
        raise UsageError(f"step must be an int >= 0; got {step!r}") from None
    if s < 0 or isinstance(step, bool):
        raise UsageError(f"step must be an int >= 0; got {step!r}")
    return s


def epoch_sampler(n: int, batch_size: int, *, seed: int, stream: str) -> Callable[[int], torch.Tensor]:
    """``step -> indices`` (int64, ``[batch_size]``) sweeping ``range(n)`` in epochs without replacement.

    Epoch ``e`` is ``randperm(n)`` from a generator seeded with ``derive_seed(seed, stream, e)``; step ``s`` takes
    slice ``s mod (n // batch_size)`` of epoch ``s // (n // batch_size)``; the last partial batch is dropped.
    """
    per_epoch = n // batch_size

    @functools.lru_cache(maxsize=2)
    def perm(epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(seed, stream, epoch))
        return torch.randperm(n, generator=g)

    def indices(step: int) -> torch.Tensor:
        epoch, i = divmod(check_step(step), per_epoch)
        return perm(epoch)[i * batch_size : (i + 1) * batch_size].clone()

    return indices


# ---------------------------------------------------------------------------------------------- option checks


def check_seed(seed: Any) -> int:
    """``seed`` as an int in [0, 2**63) (ValueError naming ``seed`` otherwise)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise UsageError(f"seed must be an int in [0, 2**63); got {seed!r}")
    return seed


def check_int(name: str, value: Any, lo: int, hi: int, *, task: str) -> int:
    """``value`` as an int in ``[lo, hi]``; ValueError naming the task option, the bad value and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"task {task!r}: option {name} must be an int in [{lo}, {hi}]; got {value!r}")
    return value


def check_float(name: str, value: Any, lo: float, hi: float, *, task: str) -> float:
    """``value`` as a finite float in ``[lo, hi]``; ValueError naming the option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise UsageError(f"task {task!r}: option {name} must be a number in [{lo}, {hi}]; got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: Sequence[Any], *, task: str) -> Any:
    """``value`` if it is one of ``allowed``; ValueError listing them otherwise."""
    if isinstance(value, bool) != any(isinstance(a, bool) for a in allowed) or value not in allowed:
        raise UsageError(f"task {task!r}: option {name} must be one of {list(allowed)}; got {value!r}")
    return value


def check_batch_size(batch_size: Any, default: int, *, task: str, most: int) -> int:
    """``batch_size`` (``None`` -> ``default``) as an int in ``[1, most]``."""
    if batch_size is None:
        return default
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= most:
        raise UsageError(f"task {task!r}: batch_size must be an int in [1, {most}]; got {batch_size!r}")
    return batch_size


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def restoring_mode(fn: Callable[[torch.nn.Module], dict[str, float]]) -> Callable[[torch.nn.Module], dict[str, float]]:
    """Wrap an evaluation function: ``model.eval()`` and ``torch.no_grad()`` inside, training mode restored after."""

    @functools.wraps(fn)
    def wrapped(model: torch.nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return fn(model)
        finally:
            model.train(was_training)

    return wrapped


def make_defaults(*, steps: int, lr: float, optimizer: str, eval_interval: int, batch_size: int,
                  warmup: int) -> dict[str, Any]:
    """``Task.defaults``; the warm-up is given both as ``warmup`` and as ``warmup_steps`` (the run config's name)."""
    return {"steps": steps, "lr": lr, "optimizer": optimizer, "eval_interval": eval_interval,
            "batch_size": batch_size, "warmup": warmup, "warmup_steps": warmup}
