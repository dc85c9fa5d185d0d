"""Shared by the XLA tests: the device, running a function there, the CPU-fallback check, bit views, inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run `make test-xla` (its own venv .venv-xla, from "
                        "requirements-xla.lock)")
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

HOST_READS = {"aten::_local_scalar_dense"}
"""A value read back to Python (``.item()``): a sync of the graph so far, not an operation run on the CPU."""


def device() -> torch.device:
    return torch_xla.device()  # type: ignore[no-any-return]


def to_xla(tree: Any) -> Any:
    return _map(tree, lambda t: t.to(device()))


def to_cpu(tree: Any) -> Any:
    return _map(tree, lambda t: t.cpu())


def _map(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if hasattr(tree, "_fields"):  # NamedTuple (TwoLevelScales)
        return type(tree)(*(_map(t, fn) for t in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_map(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


@contextlib.contextmanager
def on_device_only(allow_host_reads: bool = False) -> Iterator[None]:
    """Fail if an operation inside the block ran through torch_xla's CPU fallback (computed on the host)."""
    met.clear_all()
    yield
    ran = set(met.executed_fallback_ops()) - (HOST_READS if allow_host_reads else set())
    assert not ran, f"operations computed on the CPU by torch_xla's fallback, not on the XLA device: {sorted(ran)}"


def run_on_xla(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` with its tensor arguments on the XLA device, the graph executed (``torch_xla.sync``), the
    results back on the CPU; no CPU fallback and no host read allowed."""
    with on_device_only():
        out = fn(*to_xla(args), **kwargs)
        torch_xla.sync()
        return to_cpu(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of a float tensor (same element size), for bitwise comparisons."""
    if not t.is_floating_point():
        return t
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_same_bits(got: Any, want: Any, what: str) -> None:
    """Bitwise equality (int views, -0 included; NaN equals NaN whatever its payload and sign, as in tests/) of
    tensors or trees of them; on failure how many differ and the first few (got, want) values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, what
        g, w = bits(got).reshape(-1), bits(want).reshape(-1)
        bad = g != w
        if want.is_floating_point():
            bad &= ~(got.reshape(-1).isnan() & want.reshape(-1).isnan())
        if bad.any():
            idx = torch.nonzero(bad).flatten()[:6]
            pairs = [(got.reshape(-1)[i].item(), want.reshape(-1)[i].item()) for i in idx]
            pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} differ; first (xla, cpu): {pairs}")
        return
    if isinstance(want, tuple | list) or hasattr(want, "_fields"):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"{what}[{i}]")
        return
    assert got == want, what


def strided_patterns(stride: int = 4099) -> torch.Tensor:
    """Every ``stride``-th 32-bit pattern (both signs, every exponent field: subnormals, inf, NaNs), plus the
    edges: +-0, +-inf, the smallest subnormal, the largest finite value, a quiet and a signalling NaN."""
    import numpy as np

    pats = np.arange(0, 1 << 32, stride, dtype=np.int64).astype(np.uint32).view(np.int32)
    edges = np.array([0, -(1 << 31), 0x7F800000, -8388608, 1, 0x7F7FFFFF, -8388609, 0x7FC00000, 0x7F800001],
                     dtype=np.int64).astype(np.int32)
    return torch.from_numpy(np.concatenate([edges, pats])).view(torch.float32)


def binade(exponent: int, sign: int = 1) -> torch.Tensor:
    """All 2^23 float32 values of the binade [2^exponent, 2^(exponent+1)) (exponent -127: the subnormals)."""
    field = exponent + 127
    b = torch.arange(1 << 23, dtype=torch.int32) | (field << 23)
    if sign < 0:
        b = b | -(1 << 31)
    return b.view(torch.float32)


def start_runtime() -> torch.device:
    """The XLA device, with torch_xla's runtime started: a process's first ``backward`` sizes autograd's per-device
    queues from the device counts it sees then, so an XLA backward after a CPU one in a process where torch_xla
    had not yet been started fails inside autograd's engine ("device.index() < ... device_ready_queues_.size()")."""
    d = device()
    torch.zeros(1, device=d)
    return d


def compiles() -> int:
    """XLA graph compilations since the last ``met.clear_all()``."""
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def train_digits(recipe: str, dev: torch.device,
                 steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[float]]:
    """``steps`` optimizer steps of the zoo's mlp-digits (seed 0, its default batch, lr 3e-3) converted with
    ``recipe`` and trained by ``LowPrecisionOptimizer`` on ``dev`` (on XLA one ``torch_xla.sync`` per step, as
    ``xm.mark_step``): (the losses [steps] on the CPU, the final state dict on the CPU, each step's wall time)."""
    import time

    import lowprec
    from lowprec.runs.zoo import batch_loss, get_task, to_device

    task = get_task("mlp-digits", seed=0)
    model = lowprec.convert(task.model, recipe).to(dev)
    opt = lowprec.optim.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False), recipe)
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = batch_loss(model, to_device(task.train_batch(step), dev), task.loss_fn)
        opt.zero_grad()
        opt.scale_loss(loss).backward()
        opt.step()
        if dev.type == "xla":
            torch_xla.sync()
            xm.wait_device_ops()  # the step's graph has run: its wall time is the step's
        losses.append(loss.detach())
        times.append(time.perf_counter() - t0)
    return torch.stack(losses).cpu(), {k: v.detach().cpu() for k, v in model.state_dict().items()}, times
