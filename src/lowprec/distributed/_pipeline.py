"""Pipeline-parallel training of emulated low-precision models on ``torch.distributed.pipelining``.

``Pipeline(model, loss_fn=..., microbatches=M, schedule="gpipe" | "1f1b")`` puts stage ``r`` of the converted model
(``split_stages``, _pp_split.py) on rank ``r`` of the process group and ``step(inputs, targets)`` runs one training
step's forwards and backwards under torch's ``ScheduleGPipe`` or ``Schedule1F1B``.

What one step computes.  The batch (a function of (seed, step)) is cut into M equal consecutive microbatches
(``split_microbatches``: microbatch m is rows [m*B/M, (m+1)*B/M)).  The last stage computes ``l_m = loss_fn(y_m,
t_m)`` for each and back-propagates it; every stage's gradients are summed over the microbatches and divided by M
(torch's ``scale_grads``):

    grad = (1/M) * sum_m d l_m / d w          loss = (1/M) * sum_m l_m

which is gradient accumulation over the same microbatches in one process (``accumulate_step``): the honest baseline
for pipeline parallelism, equal to it bit for bit wherever the arithmetic is the same (the activations and their
gradients cross the stage boundary as float32, unchanged).  Against one process on the whole batch the loss of a
mean-reduced loss function differs by rounding, and every per-tensor statistic differs (next paragraph).

Emulated numerics are those of one process doing that accumulation:

* ``lp_step`` (an ``EmulatedLinear``'s stochastic-rounding step counter) advances once per training forward, so a
  stage advances it M times per optimizer step, as accumulation does, and both schedules run the forwards of
  microbatches 0..M-1 in order: forward m draws the random bits of counter value (steps so far)*M + m + 1 in both.
  A backward reuses the keys of its own forward, so when 1F1B runs it does not matter.  (One process on the whole
  batch advances once per step: its random bits differ.)
* Delayed-scaling amax histories record one entry per microbatch forward (input, weight) and per microbatch
  backward (grad_output), in microbatch order, in both; the histories of different roles never read each other, so
  GPipe's F0 F1 .. B0 B1 and accumulation's F0 B0 F1 B1 record the same values.  A history of length L therefore
  covers L microbatches, L/M optimizer steps.
* Current (tensorwise, MX) scales are per microbatch tensor: amaxes over B/M rows instead of B.
* A stochastic weight update (``Weights.update="stochastic"``) draws from (seed, step, parameter index); give the
  stage's optimizer ``param_index=pipeline.param_index`` so each parameter keeps its index in the whole model.

Static stage metadata.  torch's dynamic shape inference runs one extra forward and backward of every stage on
``torch.empty`` inputs, which would advance ``lp_step`` and record uninitialised values in the amax histories.  So
``step`` works the shapes out itself on its first call: microbatch 0 through stages 0..r in eval mode under
``no_grad`` (eval mode records nothing and advances no counter), and hands them to ``PipelineStage`` as
``input_args`` / ``output_args``.  Every rank therefore passes the inputs (and the last one the targets) to
``step``; runs build the same batch on every rank from (seed, step) anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from .._errors import UsageError
from ._pp_split import split_microbatches, split_stages

ScheduleName = Literal["gpipe", "1f1b"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _mean_loss(losses: Sequence[torch.Tensor], loss_scale: float) -> torch.Tensor:
    """``(1/M) sum_m l_m`` of the (scaled) microbatch losses, unscaled: the step's loss, float32 0-d."""
    return torch.stack([x.detach().to(torch.float32) for x in losses]).mean() / loss_scale


def accumulate_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *,
                    microbatches: int, loss_scale: float = 1.0) -> torch.Tensor:
    """One process's gradient accumulation over the microbatches a ``Pipeline`` step uses: the baseline.

    For m = 0..M-1: ``(loss_scale * loss_fn(model(x_m), t_m)).backward()``; then every gradient is divided by M
    (as torch's schedules do).  Returns the step's loss (unscaled mean of the microbatch losses, 0-d float32).
    The optimizer step is the caller's, as with ``Pipeline.step``.
    """
    xs = split_microbatches(inputs, microbatches, what="inputs' batch")
    ts = split_microbatches(targets, microbatches, what="targets' batch")
    losses = []
    for x, t in zip(xs, ts, strict=True):
        loss = loss_fn(model(x), t)
        loss = loss * loss_scale if loss_scale != 1.0 else loss
        loss.backward()
        losses.append(loss.detach())
    if microbatches != 1:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(microbatches)
    return _mean_loss(losses, loss_scale)


def _template(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s shape and dtype for ``PipelineStage``'s static metadata; floating tensors carry
    ``requires_grad`` (torch derives the gradient buffers from it: without it no gradient is received)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format).requires_grad_(t.is_floating_point())


class Pipeline:
    """This rank's stage of ``model`` and the schedule that trains it (module docstring).

    ``model``: converted (``lowprec.convert``) before this call, identical on every rank (same seed).
    ``split_points`` / ``order``: as ``split_stages``; without split points the chain is cut into as many stages
    as the group has ranks, balanced by parameter count.  ``microbatches``: M per step (1F1B needs M >= stages).
    ``loss_fn(output, target)`` must reduce by mean (gradients are divided by M).  ``group``: the pipeline's process
    group (default: the world); stage r runs on the group's rank r.
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn, microbatches: int, schedule: ScheduleName = "1f1b",
                 split_points: Sequence[str] | None = None, order: Sequence[str] | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("Pipeline needs a process group: call torch.distributed.init_process_group first (or "
                             "run under torchrun); use split_stages to inspect the stages without one")
        if schedule not in ("gpipe", "1f1b"):
            raise UsageError(f"schedule must be 'gpipe' or '1f1b'; got {schedule!r}")
        self.group = group
        self.n_stages = dist.get_world_size(group)
        self.stage_index = dist.get_rank(group)
        stages = split_stages(model, n_stages=None if split_points is not None else self.n_stages,
                              split_points=split_points, order=order)
        if len(stages) != self.n_stages:
            raise UsageError(f"{len(stages)} stages from split_points {list(split_points or [])} but the pipeline "
                             f"group has {self.n_stages} ranks; give {self.n_stages - 1} split points")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise UsageError(f"microbatches must be a positive int; got {microbatches!r}")
        if schedule == "1f1b" and microbatches < self.n_stages:
            raise UsageError(f"schedule '1f1b' needs at least as many microbatches as stages ({self.n_stages}); "
                             f"got microbatches = {microbatches}: raise it or use schedule 'gpipe'")
        self._stages, self.module = stages, stages[self.stage_index]
        self.loss_fn, self.microbatches, self.schedule_name = loss_fn, microbatches, schedule
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(trainable)}
        self.param_index = [index[id(p)] for p in self.parameters()]
        """Index of each of ``parameters()`` in ``[p for p in model.parameters() if p.requires_grad]``."""
        self._n_params = len(trainable)
        self._schedule: object | None = None
        self._loss_scale = 1.0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """This stage's trainable parameters (give these to the stage's optimizer, with ``param_index``)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def _metadata(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of this stage for microbatch 0, from stages 0..r in eval mode (records nothing)."""
        modules = list(self._stages[0].modules()) + [m for s in self._stages[1:] for m in s.modules()]
        modes = [m.training for m in modules]
        x = split_microbatches(inputs, self.microbatches, what="inputs' batch")[0]
        try:
            for m in modules:
                m.training = False
            with torch.no_grad():
                for stage in self._stages[: self.stage_index]:
                    x = stage(x)
                y = self.module(x)
        finally:
            for m, mode in zip(modules, modes, strict=True):
                m.training = mode
        return _template(x), _template(y)

    def _build(self, inputs: torch.Tensor) -> object:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        x, y = self._metadata(inputs)
        stage = PipelineStage(self.module, self.stage_index, self.n_stages, self.device, input_args=(x,),
                              output_args=(y,), group=self.group)
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        return cls(stage, self.microbatches, loss_fn=self._scaled_loss, scale_grads=True)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        return loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forwards and backwards of one step over M microbatches; gradients left in this stage's parameters.

        ``inputs`` / ``targets``: the whole batch (dim 0 divisible by M), on every rank (module docstring).
        ``loss_scale``: multiplies each microbatch loss before its backward (``optimizer.scaler.scale``).
        Returns the step's loss, the unscaled mean of the microbatch losses computed on the last stage and
        broadcast to every rank of the group (0-d float32).
        """
        split_microbatches(inputs, self.microbatches, what="inputs' batch")
        split_microbatches(targets, self.microbatches, what="targets' batch")
        if self._schedule is None:
            self._schedule = self._build(inputs)
        self._loss_scale = float(loss_scale)
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.is_first else ()
        kwargs = {"target": targets.to(self.device), "losses": losses} if self.is_last else {}
        self._schedule.step(*args, return_outputs=False, **kwargs)  # type: ignore[attr-defined]
        loss = _mean_loss(losses, self._loss_scale) if self.is_last else torch.zeros((), dtype=torch.float32)
        dist.broadcast(loss, src=self._src(self.n_stages - 1), group=self.group)
        return loss

    def grads_finite(self) -> bool:
        """Whether every stage's gradients are finite (a MIN all-reduce over the group): with loss scaling, skip
        the step on every rank (``optimizer.zero_grad(); optimizer.scaler.update(False)``) when this is False."""
        ok = all(bool(torch.isfinite(p.grad).all()) for p in self.parameters() if p.grad is not None)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _src(self, stage: int) -> int:
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def clip_grad_norm_(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """The global L2 norm of every stage's gradients, divided by ``loss_scale``; gradients scaled down to
        ``max_norm`` where it is exceeded (0: no clipping).  As one process computes it: the norm of the vector of
        per-parameter norms in the whole model's parameter order (each stage fills its entries, a SUM all-reduce
        adds exact zeros elsewhere), so the norm and the clipped gradients are bitwise those of one process."""
        norms = torch.zeros(self._n_params, dtype=torch.float32)
        has = torch.zeros(self._n_params, dtype=torch.int32)
        grads = []
        for i, p in zip(self.param_index, self.parameters(), strict=True):
            if p.grad is not None:
                norms[i], has[i] = torch.linalg.vector_norm(p.grad).to(torch.float32), 1
                grads.append(p.grad)
        dist.all_reduce(norms, group=self.group)
        dist.all_reduce(has, group=self.group)
        if not bool(has.any()):
            return 0.0
        norm = float(torch.linalg.vector_norm(norms[has.bool()])) / loss_scale
        if max_norm and math.isfinite(norm) and norm > max_norm:
            coef = max_norm / norm
            for g in grads:
                g.mul_(coef)
        return norm

    def sync_model(self) -> None:
        """Broadcast every stage's parameters and buffers (``lp_step``, amax histories) from the rank that trains
        it, so the whole model object is current on every rank: for evaluation or a full checkpoint, with the
        numerics of one process.  Collective: every rank of the group calls it."""
        with torch.no_grad():
            for s, stage in enumerate(self._stages):
                seen: set[int] = set()
                for t in [*stage.parameters(), *stage.buffers()]:
                    if id(t) not in seen:
                        seen.add(id(t))
                        dist.broadcast(t.data, src=self._src(s), group=self.group)

