"""``synthetic-regression``: multi-output linear least squares with a known optimum, for fast tests.

Data (fixed, independent of the training seed; generated in float64 from a fixed generator, stored as float32):

    X = Z @ diag(s)          Z ~ N(0, 1) [n, features],  s = logspace(0, -0.5, features)  (X^T X: condition ~10)
    Y = X @ W* + b* + 0.1 E  W* ~ N(0, 1/features) [features, outputs],  b* ~ N(0, 1) [outputs],
                             E ~ N(0, 1) [n, outputs]

The objective is the squared error summed over outputs and averaged over the whole data set,
``L(W, b) = mean_i ||W x_i + b - y_i||^2``; mini-batches are sampled from the same set, so there is no held-out
split: the task measures optimisation error, not generalisation.  Its minimum ``L*`` is computed once in float64
from the normal equations of the augmented design ``A = [X, 1]``: ``(A^T A) theta = A^T Y`` solved by Cholesky,
``L* = L(theta)``.
Metrics: ``loss`` (``L`` of the model, accumulated in float64, "min") and ``excess_loss = loss - L*`` ("min"; zero
at the optimum, slightly negative only by float32 rounding of the model's predictions).

The model is ``Regression`` with a single Linear named ``linear`` (not ``head``, so fp8/MX recipes convert it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..._errors import UsageError
from ._declare import task
from ._task import (
    Task,
    check_batch_size,
    check_int,
    count_params,
    derive_seed,
    epoch_sampler,
    hash_arrays,
    make_defaults,
    model_device,
    restoring_mode,
    seeded,
)

NOISE = 0.1


@functools.lru_cache(maxsize=4)
def regression_data(samples: int, features: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X [samples, features] f32, Y [samples, outputs] f32)``; a fixed function of the three sizes."""
    g = torch.Generator().manual_seed(derive_seed("synthetic-regression/data", samples, features, outputs))
    scales = torch.logspace(0, -0.5, features, dtype=torch.float64)
    x = torch.randn(samples, features, generator=g, dtype=torch.float64) * scales
    w = torch.randn(features, outputs, generator=g, dtype=torch.float64) / features**0.5
    b = torch.randn(outputs, generator=g, dtype=torch.float64)
    y = x @ w + b + NOISE * torch.randn(samples, outputs, generator=g, dtype=torch.float64)
    return x.to(torch.float32), y.to(torch.float32)


def optimum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Least-squares ``(W [outputs, features], b [outputs], L*)`` in float64 via Cholesky of ``A^T A``."""
    a = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], dim=1)  # [n, features+1]
    chol = torch.linalg.cholesky(a.T @ a)
    theta = torch.cholesky_solve(a.T @ y.double(), chol)  # [features+1, outputs]
    loss = float(((a @ theta - y.double()) ** 2).sum(1).mean())
    return theta[:-1].T.contiguous(), theta[-1].contiguous(), loss


class Regression(nn.Module):
    """``[B, features] -> [B, outputs]``: one Linear named ``linear``."""

    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def squared_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over outputs, averaged over the batch: ``[B, outputs]`` x2 -> 0-d."""
    return ((pred - target) ** 2).sum(1).mean()


@task
def synthetic_regression(
    *, seed: int, batch_size: int | None = None, samples: int = 2048, features: int = 32, outputs: int = 8
) -> Task:
    """Linear least squares with a known optimum.  Default: 2048 x 32 -> 8, 400 steps of 64.

    The default lr (0.02) is tuned for SGD with momentum 0.9 (the runner's default): fp32 then ends ~5e-5 above
    the optimum, while pure-bf16 weights stall ~10x higher.
    """
    name = "synthetic-regression"
    samples = check_int("samples", samples, 2, 1_000_000, task=name)
    features = check_int("features", features, 1, 4096, task=name)
    outputs = check_int("outputs", outputs, 1, 4096, task=name)
    if samples <= features:
        raise UsageError(f"task {name!r}: option samples must exceed features ({features}) so that the optimum "
                         f"is unique; got {samples}")
    bs = check_batch_size(batch_size, 64, task=name, most=samples)
    x, y = regression_data(samples, features, outputs)
    _, _, best = optimum(x, y)
    with seeded(seed):
        model = Regression(features, outputs)
    sampler = epoch_sampler(samples, bs, seed=seed, stream=f"{name}/train")

    def train_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = sampler(step)
        return x[idx], y[idx]

    @restoring_mode
    def evaluate(m: nn.Module) -> dict[str, float]:
        device = model_device(m)
        loss = float(((m(x.to(device)).double() - y.to(device).double()) ** 2).sum(1).mean())
        return {"loss": loss, "excess_loss": loss - best}

    return Task(
        name=name,
        model=model,
        train_batch=train_batch,
        loss_fn=squared_error,
        evaluate=evaluate,
        metrics={"loss": "min", "excess_loss": "min"},
        data_hash=hash_arrays(x, y),
        data_source=(
            f"synthetic: X = N(0,1) [{samples},{features}] * logspace(0,-0.5), Y = X W* + b* + {NOISE} N(0,1) "
            f"[{samples},{outputs}], drawn in float64 by torch.Generator from a fixed seed, stored as float32"
        ),
        samples_per_step=bs,
        defaults=make_defaults(steps=400, lr=0.02, optimizer="sgd", eval_interval=50, batch_size=bs, warmup=0),
        info={"optimum_loss": best, "n_train": samples, "params": count_params(model),
              "options": {"samples": samples, "features": features, "outputs": outputs}},
    )
