"""``mlp-digits`` and ``cnn-digits``: classifiers for scikit-learn's bundled 8x8 handwritten digits.

The data (1797 grey-level 8x8 images, values 0..16, ten classes; the UCI "optdigits" test set) ships inside
scikit-learn, so nothing is downloaded.  Pixels are scaled to [0, 1] by dividing by 16.

The CSV is read straight from scikit-learn's package data with numpy (importing ``sklearn.datasets`` costs seconds,
which the demo task cannot afford); ``sklearn.datasets.load_digits`` is the fallback if the file is not there.

The held-out split is fixed and independent of the training seed: within each class, in the data set's order,
every fifth example (positions 4, 9, 14, ... of that class) is held out.  That is a stratified 80/20 split with no
random number generator in it, so it cannot drift with numpy or scikit-learn versions; ``data_hash`` covers the
train and validation tensors in order, so any change would show up there.

Both models end in a Linear named ``head`` (kept in high precision by the fp8/MX recipes' ``*head`` convention)
after at least one hidden Linear, so every named recipe converts something.  Metrics: ``loss`` (mean
cross-entropy over the validation set, "min") and ``accuracy`` (fraction correct, "max").
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._declare import task
from ._task import (
    Task,
    check_batch_size,
    check_choice,
    check_int,
    count_params,
    epoch_sampler,
    hash_arrays,
    make_defaults,
    model_device,
    restoring_mode,
    seeded,
)

_HOLDOUT_EVERY = 5
_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


@functools.lru_cache(maxsize=1)
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train [1442,64] f32, y_train [1442] i64, x_val [355,64] f32, y_val [355] i64)``, pixels in [0, 1]."""
    raw = _digits_array()  # [1797, 65] float64: 64 pixels (0..16), then the label
    x = torch.from_numpy(raw[:, :64]).to(torch.float32) / 16.0
    y = torch.from_numpy(raw[:, 64]).to(torch.int64)
    val = torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        val[idx[_HOLDOUT_EVERY - 1 :: _HOLDOUT_EVERY]] = True
    return x[~val].contiguous(), y[~val].contiguous(), x[val].contiguous(), y[val].contiguous()


def _digits_array() -> np.ndarray:
    """scikit-learn's ``datasets/data/digits.csv.gz`` as ``[1797, 65]`` float64, read without importing sklearn."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",", dtype=np.float64).reshape(-1, 65)
    from sklearn.datasets import load_digits

    data = load_digits()
    return np.concatenate([data.data, data.target[:, None]], axis=1).astype(np.float64)


def _source() -> str:
    return (
        f"sklearn.datasets.load_digits (scikit-learn {importlib.metadata.version('scikit-learn')}; UCI optdigits "
        "test set, 1797 8x8 images, "
        "pixels/16); fixed stratified split: every 5th example of each class held out (1442 train, 355 validation)"
    )


class MLP(nn.Module):
    """``[B,64] -> hidden x layers -> [B,10]`` logits; Linear layers ``layers.<i>`` then ``head``."""

    def __init__(self, *, hidden: int, layers: int, activation: str) -> None:
        super().__init__()
        widths = [64] + [hidden] * layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.act = _ACTIVATIONS[activation]()
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = self.act(lin(x))
        return self.head(x)


class CNN(nn.Module):
    """``[B,1,8,8]`` -> conv3x3 (c) -> conv3x3 (2c) -> maxpool 2 -> ``fc`` [B,32c]->[B,hidden] -> ``head`` [B,10]."""

    def __init__(self, *, channels: int, hidden: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 16, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # [B,2c,8,8] -> [B,2c,4,4]
        return self.head(F.relu(self.fc(x.flatten(1))))


def _classifier_task(
    name: str, model: nn.Module, *, seed: int, batch_size: int, image: bool, defaults: dict[str, Any],
    options: dict[str, Any],
) -> Task:
    x_tr, y_tr, x_va, y_va = digits_split()
    shape = (-1, 1, 8, 8) if image else (-1, 64)
    sampler = epoch_sampler(len(y_tr), batch_size, seed=seed, stream=f"{name}/train")

    def train_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = sampler(step)
        return x_tr[idx].reshape(shape), y_tr[idx]

    @restoring_mode
    def evaluate(m: nn.Module) -> dict[str, float]:
        device = model_device(m)
        logits, y = m(x_va.reshape(shape).to(device)), y_va.to(device)
        return {
            "loss": float(F.cross_entropy(logits, y)),
            "accuracy": float((logits.argmax(-1) == y).to(torch.float64).mean()),
        }

    return Task(
        name=name,
        model=model,
        train_batch=train_batch,
        loss_fn=F.cross_entropy,
        evaluate=evaluate,
        metrics={"loss": "min", "accuracy": "max"},
        data_hash=hash_arrays(x_tr, y_tr, x_va, y_va),
        data_source=_source(),
        samples_per_step=batch_size,
        defaults=defaults,
        info={"n_train": len(y_tr), "n_val": len(y_va), "params": count_params(model), "options": options},
    )


@task
def mlp_digits(
    *, seed: int, batch_size: int | None = None, hidden: int = 128, layers: int = 2, activation: str = "relu"
) -> Task:
    """MLP ``64 -> hidden (x layers) -> 10`` on the digits.  Default: 64-128-128-10 ReLU, AdamW, 300 steps."""
    name = "mlp-digits"
    hidden = check_int("hidden", hidden, 1, 8192, task=name)
    layers = check_int("layers", layers, 1, 16, task=name)
    activation = check_choice("activation", activation, list(_ACTIVATIONS), task=name)
    bs = check_batch_size(batch_size, 64, task=name, most=len(digits_split()[1]))
    with seeded(seed):
        model = MLP(hidden=hidden, layers=layers, activation=activation)
    defaults = make_defaults(steps=300, lr=3e-3, optimizer="adamw", eval_interval=50, batch_size=bs, warmup=20)
    return _classifier_task(name, model, seed=seed, batch_size=bs, image=False, defaults=defaults,
                            options={"hidden": hidden, "layers": layers, "activation": activation})


@task
def cnn_digits(*, seed: int, batch_size: int | None = None, channels: int = 16, hidden: int = 64) -> Task:
    """Two 3x3 convolutions, max-pool, then Linear ``fc`` and ``head``.  Default: 16/32 channels, 64 hidden."""
    name = "cnn-digits"
    channels = check_int("channels", channels, 1, 512, task=name)
    hidden = check_int("hidden", hidden, 1, 8192, task=name)
    bs = check_batch_size(batch_size, 64, task=name, most=len(digits_split()[1]))
    with seeded(seed):
        model = CNN(channels=channels, hidden=hidden)
    defaults = make_defaults(steps=400, lr=3e-3, optimizer="adamw", eval_interval=50, batch_size=bs, warmup=20)
    return _classifier_task(name, model, seed=seed, batch_size=bs, image=True, defaults=defaults,
                            options={"channels": channels, "hidden": hidden})
