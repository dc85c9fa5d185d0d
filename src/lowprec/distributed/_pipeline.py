"""Pipeline-parallel training of emulated low-precision models on ``torch.distributed.pipelining``.

``Pipeline(model, loss_fn=..., microbatches=M, schedule="gpipe" | "1f1b")`` puts stage ``r`` of the converted model
(``split_stages``, _pp_split.py) on rank ``r`` of the process group and ``step(inputs, targets)`` runs one training
step's forwards and backwards under torch's ``ScheduleGPipe`` or ``Schedule1F1B``; ``schedule="interleaved-1f1b"``
with ``stages_per_rank=V`` puts stages r, r + W, ... on rank r of W (``ScheduleInterleaved1F1B``).

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
  stage advances it M times per optimizer step, as accumulation does, and every schedule offered runs the forwards
  of microbatches 0..M-1 in order: forward m draws the random bits of counter value (steps so far)*M + m + 1 in
  both.
  A backward reuses the keys of its own forward, so when 1F1B runs it does not matter.  (One process on the whole
  batch advances once per step: its random bits differ.)
* Delayed-scaling amax histories record one entry per microbatch forward (input, weight) and per microbatch
  backward (grad_output), in microbatch order, in both; the histories of different roles never read each other, so
  GPipe's F0 F1 .. B0 B1 and accumulation's F0 B0 F1 B1 record the same values.  A history of length L therefore
  covers L microbatches, L/M optimizer steps.
* Each stage's gradient is the sum over microbatches in microbatch order, as accumulation sums it.  All three
  schedules offered run a stage's forwards, and its backwards, in microbatch order.  torch's
  ``ScheduleLoopedBFS`` runs the backwards in reverse order (the float32 gradient sums, and a grad_output amax
  history, then differ from accumulation's in the last bit), so it is not offered.
* Current (tensorwise, MX) scales are per microbatch tensor: amaxes over B/M rows instead of B.
* A stochastic weight update (``Weights.update="stochastic"``) draws from (seed, step, parameter index); give the
  stage's optimizer ``param_index=pipeline.param_index`` so each parameter keeps its index in the whole model.

Tensor parallelism inside the stages (``tensor_parallel(model, tp_mesh)`` before ``Pipeline(..., group=pp_group,
tp_group=tp_group)``).  On a ``pp x tp`` mesh the pipeline's group links the ranks of one TP index (rank t of
stage s talks to rank t of stage s + 1), as torchtitan's PP over TP does: every stage runs its linears on local
shards with its TP group's collectives, and what crosses a stage boundary is each TP rank's plain local
activation: the whole activation (replicated over the TP group) without sequence parallelism, this rank's
sequence chunk with it (the chunk the next stage's first block expects), and back its gradient, which every TP
rank of the sending stage holds in full for a replicated activation (the colwise input gradient is summed over
the group) or for its own chunk.  The GEMMs are TP's (``_tp_linear``: one process's scales from the MAX
all-reduce over the TP group), the schedule PP's; ``clip_grad_norm_`` and ``grads_finite`` reduce over both.

Static stage metadata.  torch's dynamic shape inference runs one extra forward and backward of every stage on
``torch.empty`` inputs, which would advance ``lp_step`` and record uninitialised values in the amax histories.  So
``step`` works the shapes out itself on its first call: microbatch 0 through the stages up to this rank's last in
eval mode under ``no_grad`` (eval mode records nothing and advances no counter), and hands them to
``PipelineStage`` as ``input_args`` / ``output_args``.  Every rank therefore passes the inputs (and the last one the
targets) to ``step``; runs build the same batch on every rank from (seed, step) anyway.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .._errors import UsageError
from ._pp_split import StageModule, split_microbatches, split_stages

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b"]
_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


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


def _check_layout(schedule: str, world: int, stages_per_rank: int, microbatches: int) -> None:
    """UsageErrors for a schedule, stage count and microbatch count torch's schedules would refuse or hang on."""
    for name, v in (("microbatches", microbatches), ("stages_per_rank", stages_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{name} must be a positive int; got {v!r}")
    if schedule not in _SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(map(repr, _SCHEDULES))}; got {schedule!r}")
    if schedule != "interleaved-1f1b" and stages_per_rank != 1:
        raise UsageError(f"schedule {schedule!r} runs one stage per rank; got stages_per_rank = {stages_per_rank}: "
                         "use schedule 'interleaved-1f1b' for several")
    if schedule == "1f1b" and microbatches < world:
        raise UsageError(f"schedule '1f1b' needs at least as many microbatches as stages ({world}); got "
                         f"microbatches = {microbatches}: raise it or use schedule 'gpipe'")
    rounds = max(1, microbatches // world)
    if schedule == "interleaved-1f1b" and microbatches % rounds:
        raise UsageError(f"schedule 'interleaved-1f1b' runs microbatches in rounds of {world} (the ranks); "
                         f"microbatches = {microbatches} is not a multiple of {rounds} rounds: use a multiple of "
                         f"{world}, or fewer than {world}")


class Pipeline:
    """This rank's stages of ``model`` and the schedule that trains them (module docstring).

    ``model``: converted (``lowprec.convert``) before this call, identical on every rank (same seed).
    ``split_points`` / ``order``: as ``split_stages``; without split points the chain is cut into ranks x
    ``stages_per_rank`` stages balanced by parameter count.  ``microbatches``: M per step (1F1B needs M >= ranks).
    ``loss_fn(output, target)`` must reduce by mean (gradients are divided by M).  ``group``: the pipeline's process
    group (default: the world).  Stage s runs on the group's rank ``s % ranks``: one stage per rank for "gpipe" and
    "1f1b", ``stages_per_rank`` of them (rank r: stages r, r + ranks, ...) for "interleaved-1f1b".
    ``tp_group``: the tensor-parallel group of this rank's stages when ``tensor_parallel`` was applied to ``model``
    before this call (module docstring, "Tensor parallelism inside the stages"); ``group`` then links the ranks of
    one TP index.
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn, microbatches: int, schedule: ScheduleName = "1f1b",
                 split_points: Sequence[str] | None = None, order: Sequence[str] | None = None,
                 stages_per_rank: int = 1, group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("Pipeline needs a process group: call torch.distributed.init_process_group first (or "
                             "run under torchrun); use split_stages to inspect the stages without one")
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.tp_group = tp_group
        _check_layout(schedule, self.world, stages_per_rank, microbatches)
        self.n_stages = self.world * stages_per_rank
        stages = split_stages(model, n_stages=None if split_points is not None else self.n_stages,
                              split_points=split_points, order=order)
        if len(stages) != self.n_stages:
            raise UsageError(f"{len(stages)} stages from split_points {list(split_points or [])} but the pipeline "
                             f"has {self.world} ranks x {stages_per_rank} stages per rank; give "
                             f"{self.n_stages - 1} split points")
        self.stage_indices = list(range(self.rank, self.n_stages, self.world))
        self._stages, self.modules = stages, [stages[i] for i in self.stage_indices]
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
    def module(self) -> StageModule:
        """This rank's stage (one stage per rank; ``modules`` lists several)."""
        if len(self.modules) != 1:
            raise UsageError(f"this rank holds {len(self.modules)} stages ({self.stage_indices}); use .modules")
        return self.modules[0]

    @property
    def n_params(self) -> int:
        """The number of trainable parameters of the whole model (``param_index`` values lie in ``range(n_params)``;
        an optimizer state gathered from every stage has this many entries)."""
        return self._n_params

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (it feeds the inputs)."""
        return self.stage_indices[0] == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.stage_indices[-1] == self.n_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (give these to its optimizer, with ``param_index``)."""
        seen: set[int] = set()
        out = []
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _metadata(self, inputs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) templates of each of this rank's stages for microbatch 0, from running stages 0 up to
        the last local one in eval mode (which records nothing and advances no counter; the TP linears' byte
        counts are put back)."""
        modules = [m for s in self._stages for m in s.modules()]
        modes = [m.training for m in modules]
        infos: list[Any] = [m.lowprec_tp for m in modules if hasattr(m, "lowprec_tp")]
        tp = [(info, dataclasses.replace(info.stats)) for info in infos]
        x = split_microbatches(inputs, self.microbatches, what="inputs' batch")[0].to(self.device)
        out = []
        try:
            for m in modules:
                m.training = False
            with torch.no_grad():
                for i, stage in enumerate(self._stages[: self.stage_indices[-1] + 1]):
                    y = stage(x)
                    if i in self.stage_indices:
                        out.append((_template(x), _template(y)))
                    x = y
        finally:
            for m, mode in zip(modules, modes, strict=True):
                m.training = mode
            for info, stats in tp:  # nor counts TP bytes (``tp_stats``: what training sends)
                info.stats = stats
        return out

    def _build(self, inputs: torch.Tensor) -> object:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        from torch.distributed.pipelining.stage import _PipelineStageBase

        metas = self._metadata(inputs)
        stages: list[_PipelineStageBase] = [
            PipelineStage(m, i, self.n_stages, self.device, input_args=(x,), output_args=(y,), group=self.group)
            for m, i, (x, y) in zip(self.modules, self.stage_indices, metas, strict=True)]
        if self.schedule_name == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(stages, self.microbatches, loss_fn=self._scaled_loss, scale_grads=True)
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        return cls(stages[0], self.microbatches, loss_fn=self._scaled_loss, scale_grads=True)

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
        loss = (_mean_loss(losses, self._loss_scale) if self.is_last
                else torch.zeros((), dtype=torch.float32, device=self.device))  # NCCL sends device tensors only
        dist.broadcast(loss, src=self._src((self.n_stages - 1) % self.world), group=self.group)
        return loss

    def grads_finite(self) -> bool:
        """Whether every stage's gradients are finite (a MIN all-reduce over the group, and over ``tp_group``): with
        loss scaling, skip
        the step on every rank (``optimizer.zero_grad(); optimizer.scaler.update(False)``) when this is False."""
        ok = all(bool(torch.isfinite(_local(p.grad)).all()) for p in self.parameters() if p.grad is not None)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if self.tp_group is not None:  # a TP rank's shards can hold the only non-finite values
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.tp_group)
        return bool(flag.item())

    def _src(self, rank: int) -> int:
        """The global rank of the group's rank ``rank``."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def clip_grad_norm_(self, max_norm: float, *, loss_scale: float = 1.0) -> float:
        """The global L2 norm of every stage's gradients, divided by ``loss_scale``; gradients scaled down to
        ``max_norm`` where it is exceeded (0: no clipping).  As one process computes it: the norm of the vector of
        per-parameter norms in the whole model's parameter order (each stage fills its entries, a SUM all-reduce
        adds exact zeros elsewhere), so the norm and the clipped gradients are bitwise those of one process.  A
        tensor-parallel (DTensor) gradient's entry is its whole tensor's norm (DTensor's reduction over the TP
        shards, as the runner computes it under TP alone: the shards' sum of squares, not one process's order)."""
        from torch.distributed.tensor import DTensor

        norms = torch.zeros(self._n_params, dtype=torch.float32, device=self.device)
        has = torch.zeros(self._n_params, dtype=torch.int32, device=self.device)
        grads = []
        for i, p in zip(self.param_index, self.parameters(), strict=True):
            if p.grad is not None:
                n = torch.linalg.vector_norm(p.grad)
                norms[i], has[i] = (n.full_tensor() if isinstance(n, DTensor) else n).to(torch.float32), 1
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
        numerics of one process.  Tensor-parallel (DTensor) parameters send their local shards: the group links
        the ranks of one TP index (module docstring), which hold the same shard of every stage.  Collective: every
        rank of the group calls it."""
        with torch.no_grad():
            for s, stage in enumerate(self._stages):
                seen: set[int] = set()
                for t in [*stage.parameters(), *stage.buffers()]:
                    if id(t) not in seen:
                        seen.add(id(t))
                        dist.broadcast(_local(t.data), src=self._src(s % self.world), group=self.group)

