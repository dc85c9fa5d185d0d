"""The runner's pipeline-parallel step, and a pipeline's optimizer state as one process's.

Under ``parallel.pp = S`` rank ``r`` trains stage ``r`` of the converted model (``lowprec.distributed.Pipeline``,
cut into S stages balanced by parameter count) with a ``LowPrecisionOptimizer`` over that stage's parameters
(``param_index``: their place in the whole model).  One step:

    loss = pipeline.step(inputs, targets)      M microbatches under "1f1b" or "gpipe"; the last stage's mean loss,
                                               broadcast to every rank; with R replicas (``dp_replicate``), the
                                               mean over them (what the store records)
    reducer.reduce()                           R > 1: each stage's gradients averaged over its replicas
    norm = pipeline.clip_grad_norm_(clip)      the global norm over all stages, as one process computes it
    finite on every stage ? optimizer.step() : skip (loss scaling) or stop the run (diverged)

which is one process accumulating gradients over the same R x M microbatches (``accumulate_step``; replica r
trains rows ``[r B/R, (r+1) B/R)``), not one process on the whole batch: the loss differs from that by what
microbatching changes (``docs/distributed.md``).

Evaluation and checkpoints use the whole model: ``Pipeline.sync_model`` broadcasts every stage from its owner, so
each rank's model object is the trained model.  A checkpoint is then the file a single process writes: the whole
model, and the optimizer state of every stage gathered to rank 0 and keyed by whole-model parameter index
(``full_optimizer_state``), so a pipeline run resumes on one process, and a one-process run (or a pipeline of
another depth) resumes as a pipeline (``local_optimizer_state`` picks a stage's part).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..distributed import Pipeline
from ..recipes import Recipe
from ._parallel import Wrapped
from .zoo import Task, to_device

if TYPE_CHECKING:
    from ._lifecycle import ResolvedConfig
    from ._torch_state import State


def build_pipeline(task: Task, wrapped: Wrapped, world: Any, recipe: Recipe) -> Pipeline:
    """The pipeline of ``wrapped.model`` (converted, on its device) over the mesh's "pp" dimension.  With
    data-parallel replicas (``dp_replicate`` > 1: pipelines side by side, each on its rows of the batch) every
    stage's gradients are averaged over its replicas after the schedule (``GradReducer`` over the "dp_replicate"
    group, in the recipe's ``grad_comm`` format; ``wrapped.after_backward``), the first step's delayed amaxes and
    the amax histories are MAX-reduced over them, and ``wrapped.comm_bytes`` counts the gradient bytes sent."""
    from ..distributed import GradReducer, sync_amax_histories
    from ..nn import EmulatedLinear

    layout = world.layout
    group = world.mesh["pp"].get_group() if world.mesh is not None else None
    pipe = Pipeline(wrapped.model, loss_fn=task.loss_fn, microbatches=layout.microbatches,
                    schedule=layout.pp_schedule, group=group)
    if layout.dp > 1:
        dp_group = world.mesh["dp_replicate"].get_group()
        reducer = GradReducer(pipe.parameters(), dp_group, grad_comm=recipe.grad_comm, seed=recipe.seed)

        def amax_max(t: torch.Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)

        for m in wrapped.model.modules():
            if isinstance(m, EmulatedLinear):
                m.amax_reduce = amax_max

        def after_backward() -> None:
            reducer.reduce()
            for stage in pipe.modules:
                sync_amax_histories(stage, dp_group)

        wrapped.after_backward = after_backward
        wrapped.comm_bytes = lambda: reducer.bytes_sent
    return pipe


def pp_train_step(task: Task, st: State, r: ResolvedConfig, lr: float) -> tuple[dict[str, float], None, str]:
    """One optimizer step through the pipeline: (scalars to log, None, "" or "diverged")."""
    pipe: Pipeline = st.pipeline
    t0 = time.perf_counter()
    for group in st.optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = to_device(st.world.shard(task.train_batch(st.step)), st.device)
    scale = st.optimizer.scaler.scale
    loss = st.world.mean(pipe.step(inputs, targets, loss_scale=scale))  # the mean over data-parallel replicas
    st.wrapped.after_backward()
    norm = pipe.clip_grad_norm_(r.grad_clip, loss_scale=scale)
    finite = pipe.grads_finite()
    end = ""
    if finite:
        st.optimizer.step()
    elif st.optimizer.scaler.enabled:
        st.optimizer.scaler.update(False)  # every stage skips the step together
    else:
        end = "diverged"
    st.optimizer.zero_grad()
    if not math.isfinite(loss):
        end = "diverged"
    dt = time.perf_counter() - t0
    values = {"train/loss": loss, "train/grad_norm": norm, "train/lr": lr, "train/step_time_s": dt,
              "train/samples_per_s": task.samples_per_step / dt}
    if st.wrapped.comm_bytes is not None:
        values["comm/bytes_sent"] = float(st.wrapped.comm_bytes())
    if not finite and not end:
        values["train/update_skipped"] = 1.0
    return values, None, end


def full_optimizer_state(pipe: Pipeline, optimizer: Any) -> dict[str, Any]:
    """Collective: the ``LowPrecisionOptimizer.state_dict`` one process training the whole model would have, on
    every rank: each stage's inner-optimizer state renumbered by whole-model parameter index and merged; the
    wrapper's scaler and step count are the same on every stage."""
    import torch.distributed as dist

    own = optimizer.state_dict()
    inner = own["optimizer"]
    mine = {pipe.param_index[i]: v for i, v in inner["state"].items()}
    comp = {pipe.param_index[int(i)]: c for i, c in own["compensation"].items()}
    parts: list[Any] = [None] * pipe.world
    dist.all_gather_object(parts, (mine, comp), group=pipe.group)
    state: dict[int, Any] = {}
    compensation: dict[int, Any] = {}
    for s, c in parts:
        state.update(s)
        compensation.update(c)
    groups = [{**g, "params": list(range(pipe.n_params))} for g in inner["param_groups"]]
    return {**own, "optimizer": {"state": dict(sorted(state.items())), "param_groups": groups},
            "compensation": dict(sorted(compensation.items()))}


def local_optimizer_state(pipe: Pipeline, full: dict[str, Any]) -> dict[str, Any]:
    """This stage's part of a whole-model ``LowPrecisionOptimizer.state_dict`` (``full_optimizer_state``, or a
    single-process checkpoint's), renumbered to the stage optimizer's own parameter order."""
    inner = full["optimizer"]
    local = {g: i for i, g in enumerate(pipe.param_index)}
    state = {local[int(g)]: v for g, v in inner["state"].items() if int(g) in local}
    groups = [{**g, "params": list(range(len(pipe.param_index)))} for g in inner["param_groups"]]
    comp = {local[int(g)]: c for g, c in full.get("compensation", {}).items() if int(g) in local}
    return {**full, "optimizer": {"state": state, "param_groups": groups}, "compensation": comp}
