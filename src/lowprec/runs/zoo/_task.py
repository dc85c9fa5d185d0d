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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._batches import call_model
from ..._errors import UsageError
from ..._types import DIRECTIONS, Direction


@dataclass(frozen=True, kw_only=True)
class Task:
    """A training task: a freshly initialised model, a pure batch function and held-out metrics.

    Only ``model``, ``train_batch`` and either ``eval_batches`` or ``evaluate`` are required::

        Task(model=net, train_batch=lambda step: {"x": ..., "labels": ...}, loss_fn=my_loss, eval_batches=[...])

    The batch contract (see :func:`batch_loss`): a dict batch calls ``model(**batch)`` and ``loss_fn(output,
    batch)``; a tuple or list ``(*inputs, target)`` calls ``model(*inputs)`` and ``loss_fn(output, target)``; any
    other batch (a tensor) calls ``model(batch)`` and ``loss_fn(output, batch)``.  Without ``loss_fn`` the loss is
    the one the model returns (:func:`model_loss`: ``output.loss``, ``output["loss"]`` or a 0-d output).
    """

    name: str = ""
    """Registry name (e.g. ``"mlp-digits"``); empty: ``get_task`` fills in the name the config used."""
    model: torch.nn.Module
    """Freshly initialised from the seed (float32, CPU, training mode); the runner moves it to the run's device."""
    train_batch: Callable[[int], Any]
    """``step`` (0-based) -> batch (a dict, a tuple ``(*inputs, target)`` or a tensor) on the CPU; a pure function
    of ``(seed, step)``."""
    loss_fn: Callable[[Any, Any], torch.Tensor] = None  # type: ignore[assignment]  # left out: model_loss
    """``(model output, target)`` -> scalar loss (a 0-d float tensor) to minimise; the target is the batch's last
    element for a tuple batch, the whole batch otherwise.  Left out: :func:`model_loss` (the model returns its
    loss)."""
    eval_batches: Sequence[Any] | None = None
    """Held-out batches (the same contract as ``train_batch``'s), independent of the seed.  With ``evaluate``
    unset, the held-out ``loss`` is their mean loss, weighted by rows."""
    evaluate: Callable[[torch.nn.Module], dict[str, float]] = None  # type: ignore[assignment]  # left out: mean_loss
    """Held-out metrics under ``torch.no_grad``; deterministic; restores the model's training mode; moves its data
    to the model's device (:func:`model_device`).  Left out: the mean loss over ``eval_batches``."""
    metrics: dict[str, Direction] = field(default_factory=lambda: {"loss": "min"})
    """Metric name -> ``"min"`` or ``"max"`` (which direction is better); always has ``"loss"``."""
    data_hash: str = ""
    """sha256 (hex) of the data bytes actually used (train and held-out parts, in order; :func:`hash_arrays`), the
    same for every seed: runs are seeds of one experiment only when it matches.  Empty: :func:`hash_batches` of
    ``eval_batches`` (the training batches differ between seeds)."""
    data_source: str = ""
    """Where the data comes from, in words (with the library/Python version where the data can change)."""
    samples_per_step: int = None  # type: ignore[assignment]  # left out: batch_rows(train_batch(0))
    """Examples per training batch (sequences for language models), for throughput.  Left out: the rows of the
    first training batch (:func:`batch_rows`)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Suggested ``steps``, ``lr``, ``optimizer``, ``eval_interval``, ``batch_size`` and ``warmup_steps`` (each
    optional: the run config's own fallbacks fill the rest)."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able facts about the task (sizes, parameter count, resolved options, known optimum, ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise UsageError(f"Task.model must be a torch.nn.Module; got {type(self.model).__name__}")
        if not callable(self.train_batch):
            raise UsageError(f"Task.train_batch must be a function step -> batch; got {self.train_batch!r}")
        if "loss" not in self.metrics:
            raise UsageError(f"Task.metrics must include 'loss'; got {sorted(self.metrics)}")
        for k, v in self.metrics.items():
            if v not in DIRECTIONS:
                raise UsageError(f"Task.metrics[{k!r}] must be 'min' or 'max'; got {v!r}")
        if self.loss_fn is None:
            object.__setattr__(self, "loss_fn", model_loss)
        if self.eval_batches is not None:
            if isinstance(self.eval_batches, dict | torch.Tensor) or not isinstance(self.eval_batches, Sequence):
                raise UsageError("Task.eval_batches must be a list of batches (each a dict, tuple or tensor); got "
                                 f"{type(self.eval_batches).__name__}")
            object.__setattr__(self, "eval_batches", list(self.eval_batches))
        if self.evaluate is None:
            if not self.eval_batches:
                raise UsageError("a Task needs held-out data: give eval_batches (a list of batches) or evaluate "
                                 "(model -> {'loss': ...})")
            extra = sorted(set(self.metrics) - {"loss"})
            if extra:
                raise UsageError(f"Task.metrics {extra} need an evaluate function; eval_batches alone give 'loss'")
            object.__setattr__(self, "evaluate", mean_loss(self.eval_batches, self.loss_fn))
        if not self.data_hash:
            if not self.eval_batches:
                raise UsageError("Task.data_hash is required with a custom evaluate and no eval_batches: give "
                                 "data_hash=lowprec.runs.zoo.hash_arrays(...) of the data the task uses")
            object.__setattr__(self, "data_hash", hash_batches(*self.eval_batches))
        if not self.data_source:
            object.__setattr__(self, "data_source", "not described")
        if self.samples_per_step is None:
            object.__setattr__(self, "samples_per_step", batch_rows(self.train_batch(0)))
        if isinstance(self.samples_per_step, bool) or not isinstance(self.samples_per_step, int) \
                or self.samples_per_step < 1:
            raise UsageError(f"Task.samples_per_step must be a positive int; got {self.samples_per_step!r}")


# ---------------------------------------------------------------------------------------------- the batch contract


def batch_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
               ) -> torch.Tensor:
    """The loss of ``model`` on ``batch`` (a 0-d float tensor), by the batch contract every runner follows.

    * a dict (``{"input_ids": ..., "labels": ...}``, Hugging Face style): ``loss_fn(model(**batch), batch)``;
    * a tuple or list ``(*inputs, target)``: ``loss_fn(model(*inputs), target)`` (``(x, y)``: ``model(x)``);
    * anything else (a tensor): ``loss_fn(model(batch), batch)``.

    ``loss_fn=None`` is :func:`model_loss`.  UsageError for an empty tuple or a loss that is not a 0-d tensor.
    """
    fn = model_loss if loss_fn is None else loss_fn
    loss = fn(*call_model(model, batch))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise UsageError(f"the task's loss must be a 0-d float tensor; got {_describe(loss)}: reduce it (e.g. "
                         ".mean()) in loss_fn")
    return loss


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss a model returns itself: ``output.loss`` (a Hugging Face ``ModelOutput``), ``output["loss"]``, or
    ``output`` when it is a 0-d tensor; ``target`` is ignored.  UsageError otherwise, naming ``Task.loss_fn``."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise UsageError(f"the task has no loss_fn and the model returned {_describe(output)} without a loss: give "
                     "Task(loss_fn=...) (output, target) -> 0-d loss, or return the loss from the model (pass the "
                     "labels in the batch)")


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {list(obj.shape)} and dtype {obj.dtype}"
    return f"a {type(obj).__name__}"


def _tensors(batch: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a (nested) batch with their paths, dict keys in sorted order."""
    if isinstance(batch, torch.Tensor):
        yield "", batch
    elif isinstance(batch, Mapping):
        for k in sorted(batch, key=str):
            for path, t in _tensors(batch[k]):
                yield f"{k}/{path}", t
    elif isinstance(batch, tuple | list):
        for i, b in enumerate(batch):
            for path, t in _tensors(b):
                yield f"{i}/{path}", t


def batch_rows(batch: Any) -> int:
    """Rows (dim 0) of the batch's first tensor (dict keys in sorted order); UsageError when it has none."""
    for _, t in _tensors(batch):
        if t.dim() > 0:
            return int(t.shape[0])
    raise UsageError(f"cannot count the examples of a batch that is {_describe(batch)} with no tensor of rank >= 1: "
                     "give Task(samples_per_step=...)")


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor moved to ``device`` (dicts, tuples and lists rebuilt; anything else as is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):  # a dict (a Mapping such as transformers' BatchEncoding comes back as one)
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model with neither."""
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def mean_loss(batches: Sequence[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
              ) -> Callable[[torch.nn.Module], dict[str, float]]:
    """An ``evaluate`` function: ``{"loss": mean over batches of batch_loss, weighted by rows}`` (float64 sum),
    each batch moved to the model's device, in eval mode under ``no_grad``."""

    @restoring_mode
    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        device = model_device(model)
        total, rows = 0.0, 0
        for b in batches:
            n = batch_rows(b)
            total += float(batch_loss(model, to_device(b, device), loss_fn).double()) * n
            rows += n
        return {"loss": total / rows}

    return evaluate


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


def generator(*parts: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``derive_seed(*parts)``, e.g. ``generator(seed, "train", step)``: a
    stream of its own for each purpose, so adding a draw to one never shifts another."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def hash_batches(*batches: Any) -> str:
    """sha256 over the tensors of (nested) batches in order, each with its path (dict keys sorted) and as in
    :func:`hash_arrays`; entries that are not tensors are left out."""
    h = hashlib.sha256()
    for i, b in enumerate(batches):
        for path, t in _tensors(b):
            h.update(f"{i}/{path}".encode())
            h.update(hash_arrays(t).encode())
    return h.hexdigest()


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
