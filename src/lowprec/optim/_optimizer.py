"""``LowPrecisionOptimizer``: a recipe's weight-update, optimizer-state and loss-scaling policy around any
``torch.optim`` optimizer.

The wrapped optimizer computes each update in float32 as usual; the wrapper then decides what is stored:

* ``Weights.update="master"``: nothing changes (float32 master weights; GEMMs quantize their own copies).
* ``"nearest"``: weights live on the ``Weights.format`` grid; ``w <- Q_nearest(w + u)``.  Updates smaller than half a
  step of the weight are lost, so training stalls when ``|u| << eps * |w|`` (pure bf16's known failure).
* ``"stochastic"``: ``w <- Q_sr(w + u)``, unbiased: ``E[w_new] = w + u``.  The random stream depends on (recipe seed,
  step, parameter index) only, never on the world size or the device.
* ``"kahan"``: Kahan-compensated summation with a compensation buffer ``c`` in the same format:
  ``y = u - c;  t = Q(w + y);  c = Q((t - w) - y);  w = t``; the rounding error of each step is carried into the next.

Here ``u`` is the optimizer's float32 update ``w_after - w_before``.  Optimizer state: after each step the Adam
moments ``exp_avg``/``exp_avg_sq`` and SGD's ``momentum_buffer`` (treated as ``exp_avg``) are replaced by their
fake-quantized values per ``OptimizerState``; gradients are fake-quantized per ``OptimizerState.grad`` before the
step.  AdamW, Adam and SGD (with momentum) are first-class; other optimizers get the weight policy, gradient
quantization and loss scaling, and any state tensors with those three names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import formats, recipes
from .._errors import UsageError
from ..quant import QuantSpec, _native_group, fake_quantize, quantize
from ..quant._elementwise import quantize_in_place
from ..quant._random import stream_seed
from ..recipes import Recipe
from ._scaler import LossScaler

_STATE_SPEC = {"exp_avg": "exp_avg", "momentum_buffer": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _local(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``p`` and 0, or for a sharded DTensor (FSDP2) its local shard and the flat index of the shard's first element
    in the full parameter: stochastic-rounding draws are indexed by global element, so they do not depend on how
    (or whether) the parameter is sharded.  Shards are contiguous row blocks (FSDP2 shards dim 0)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = 1
    for n in p.shape[1:]:
        row *= n
    return p.to_local(), int(offset[0]) * row if offset else 0


def _row_block(p: torch.Tensor) -> bool:
    """Whether ``p``'s local part is one block of whole rows of the full parameter (a plain tensor, replicated,
    or sharded on dim 0 only, as FSDP2 shards), so that ``_local``'s single offset indexes it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return True
    return all(type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0) for pl in p.placements)


def _global_index(p: torch.Tensor) -> torch.Tensor:
    """The flat index in the full parameter of every element of DTensor ``p``'s local shard (int64, local shape):
    ``distribute_tensor`` of ``arange`` with each rank keeping its own part (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(p.numel(), dtype=torch.int64, device=p.device).view(p.shape)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()  # type: ignore[attr-defined]


def _sr_scattered(p: torch.Tensor, index: torch.Tensor, numel: int, fmt: str, seed: int) -> None:
    """Stochastic rounding in place of a shard that is not a block of rows (tensor parallelism's column and
    strided shards): the values are placed at their global positions (``index``) in a zero vector of the full
    parameter's ``numel``, rounded there with counters from 0 and read back, so every element draws the counter
    of its index in the full parameter, as without sharding (the format is elementwise: the zeros change
    nothing else).  Costs a full-size vector per such parameter and step."""
    full = p.new_zeros(numel)
    full[index.reshape(-1)] = p.reshape(-1)
    q = quantize(full, fmt, rounding="stochastic", seed=seed, offset=0)
    p.copy_(q[index.reshape(-1)].view_as(p))


class LowPrecisionOptimizer:
    """Wraps ``optimizer`` with ``recipe``'s policies.  Use ``scale_loss(loss).backward()`` then ``step()``.

    ``param_index``: the index of each of the optimizer's parameters (in param-group order) in the whole model's
    parameter list, which keys the stochastic weight update's random stream; default ``0, 1, ...``.  A pipeline
    stage's optimizer holds a subset of the parameters and passes ``Pipeline.param_index`` so its draws are those
    of one process.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, recipe: Recipe | str, *,
                 param_index: Sequence[int] | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.recipe = recipes.get(recipe)
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        if param_index is not None and len(param_index) != n:
            raise UsageError(f"param_index has {len(param_index)} entries but the optimizer holds {n} parameters; "
                             "give one index per parameter, in param-group order")
        self.param_index = None if param_index is None else [int(i) for i in param_index]
        self.scaler = LossScaler(self.recipe.loss_scaling)
        self.steps = 0
        self.compensation: dict[int, torch.Tensor] = {}
        self._before: list[torch.Tensor] = []  # Kahan: the weights before the inner step (``_snapshot``)
        self._index: dict[int, torch.Tensor] = {}  # global element indices of column/strided shards (_global_index)
        w = self.recipe.weights
        if w.update != "master":
            with torch.no_grad():
                for i, p in enumerate(self._params()):
                    local, _ = _local(p)
                    local.copy_(quantize(local, w.format))  # weights start on the storage grid
                    if w.update == "kahan":
                        self.compensation[i] = torch.zeros_like(local)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on (multiplied by the loss scale when the recipe scales losses)."""
        return self.scaler.scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> bool:
        """Unscale and check gradients, quantize them, step, apply the weight and state policies.

        Returns False (and changes no weight) when loss scaling found a non-finite gradient.
        """
        params = self._params()
        finite = self.scaler.unscale_and_check(params)
        self.scaler.update(finite)
        if not finite:
            self.zero_grad()
            return False
        opt_state = self.recipe.optimizer
        with torch.no_grad():
            if opt_state.grad is not None:
                for p in params:
                    if p.grad is not None:
                        p.grad.copy_(fake_quantize(p.grad, opt_state.grad))
            update = self.recipe.weights.update
            before = self._snapshot(params) if update == "kahan" else []  # only Kahan reads them
        self.optimizer.step(closure)  # type: ignore[arg-type]
        with torch.no_grad():
            if update != "master":
                self._apply_weight_policy(params, before)
            self._quantize_state(params)
        self.steps += 1
        return True

    def _snapshot(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights (a sharded parameter's local shard) before the inner step, copied into buffers kept from
        step to step: a fresh clone per step and parameter made glibc's allocator hand back and re-fault megabytes
        each step, which showed as AdamW's own out-of-place sqrt and div running 3-5x slower next to it (MLP
        784-512-512-10: the optimizer step 9.3 ms against bf16-sr's 7.8 and fp32's 4.4; 5.7 with the buffers)."""
        local = [_local(p.detach())[0] for p in params]
        bufs = self._before
        if len(bufs) != len(local) or any(b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
                                          for b, t in zip(bufs, local, strict=True)):
            bufs[:] = [t.clone() for t in local]
            return bufs
        for b, t in zip(bufs, local, strict=True):
            b.copy_(t)
        return bufs

    def _apply_weight_policy(self, params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        w = self.recipe.weights
        for i, param in enumerate(params):
            p, offset = _local(param)  # a sharded (FSDP2) parameter: this rank's shard, at its global offset
            if w.update == "nearest":
                if not quantize_in_place(p, formats.get(w.format)):
                    p.copy_(quantize(p, w.format))
            elif w.update == "stochastic":
                index = i if self.param_index is None else self.param_index[i]
                seed = stream_seed(self.recipe.seed, "weight-update", str(self.steps), str(index))
                if not _row_block(param):  # a column or strided (tensor-parallel) shard: no single offset
                    if i not in self._index:
                        self._index[i] = _global_index(param)
                    _sr_scattered(p, self._index[i], param.numel(), w.format, seed)
                    continue
                if not quantize_in_place(p, formats.get(w.format), "stochastic", seed, offset):
                    p.copy_(quantize(p, w.format, rounding="stochastic", seed=seed, offset=offset))
            else:  # kahan
                old, _ = _local(before[i])
                c = self.compensation[i]
                if _native_group.kahan_update(p, old, c, formats.get(w.format)):  # the lines below, fused
                    continue
                y = (p - old) - c  # the update, minus the error carried from the last step
                t = quantize(old + y, w.format)
                c.copy_(quantize((t - old) - y, w.format))
                p.copy_(t)

    def _quantize_state(self, params: list[torch.Tensor]) -> None:
        specs: dict[str, QuantSpec | None] = {
            "exp_avg": self.recipe.optimizer.exp_avg,
            "exp_avg_sq": self.recipe.optimizer.exp_avg_sq,
        }
        if not any(specs.values()):
            return
        for p in params:
            state = self.optimizer.state.get(p, {})
            for key, which in _STATE_SPEC.items():
                spec = specs[which]
                t = state.get(key)
                if spec is not None and isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    t.copy_(fake_quantize(t, spec))

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "steps": self.steps,
            "compensation": {i: c.clone() for i, c in self.compensation.items()},
            "recipe": self.recipe.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``; ``state["optimizer"]`` None leaves the wrapped optimizer's state alone (for
        callers that load it themselves, e.g. FSDP2's ``set_optimizer_state_dict``)."""
        if state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["steps"])
        for i, c in state["compensation"].items():
            self.compensation[int(i)].copy_(c)
