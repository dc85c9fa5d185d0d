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
from collections.abc import Callable
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
    """The pipeline of ``wrapped.model`` (converted, on its device; with ``tp`` > 1 already tensor parallel over
    the mesh's "tp" dimension, ``_parallel.wrap_model``) over the mesh's "pp" dimension: the ranks of one TP index
    form a pipeline.  With data-parallel replicas (``dp_replicate`` > 1: pipelines side by side, each on its rows of
    the batch) every stage's gradients are averaged over its replicas after the schedule (``GradReducer`` over the
    "dp_replicate" group, in the recipe's ``grad_comm`` format; ``wrapped.after_backward``), and the first step's
    delayed amaxes are MAX-reduced over them (before the TP group's reduction, where TP set one).  After every
    backward the amax histories of this rank's stages are MAX-reduced over the replicas and the TP group, so every
    rank of a stage scales as one process would.  ``wrapped.comm_bytes`` counts the gradient bytes sent and, with
    TP, the TP collectives' bytes."""
    from ..distributed import GradReducer, sync_amax_histories, tp_stats
    from ..nn import EmulatedLinear

    layout = world.layout
    group = world.mesh["pp"].get_group() if world.mesh is not None else None
    tp_group = world.mesh["tp"].get_group() if layout.tp > 1 else None
    pipe = Pipeline(wrapped.model, loss_fn=task.loss_fn, microbatches=layout.microbatches,
                    schedule=layout.pp_schedule, group=group, tp_group=tp_group)
    reducer = None
    syncs = [tp_group] if tp_group is not None else []
    if layout.dp > 1:
        dp_group = world.mesh["dp_replicate"].get_group()
        reducer = GradReducer(pipe.parameters(), dp_group, grad_comm=recipe.grad_comm, seed=recipe.seed)
        syncs.append(dp_group)
        for m in wrapped.model.modules():
            if isinstance(m, EmulatedLinear):
                m.amax_reduce = _max_then(dp_group, m.amax_reduce)
    if not syncs:
        return pipe

    def after_backward() -> None:
        if reducer is not None:
            reducer.reduce()
        for g in syncs:  # MAX over the TP group, then over the replicas: the MAX over both
            for stage in pipe.modules:
                sync_amax_histories(stage, g)

    seen = [0]

    def sent() -> int:
        total = sum(tp_stats(wrapped.model).values()) if tp_group is not None else 0
        step, seen[0] = total - seen[0], total
        return step + (reducer.bytes_sent if reducer is not None else 0)

    wrapped.after_backward = after_backward
    wrapped.comm_bytes = sent
    return pipe


def _max_then(group: dist.ProcessGroup, then: Any) -> Any:
    """``EmulatedLinear.amax_reduce``: the MAX all-reduce over ``group``, then ``then`` (the TP group's) if set."""
    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if then is not None:
            then(t)
    return reduce


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


def pp_evaluate(st: State, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Collective: ``evaluate()`` of the whole trained model (``Pipeline.sync_model`` first), computed by rank 0
    with its TP group (the ranks of pipeline index 0 and data-parallel index 0: a tensor-parallel forward takes
    all of them) and broadcast to every rank."""
    st.pipeline.sync_model()
    assert st.world.layout is not None
    c = st.world.layout.coords(st.world.rank)
    mine = c["pp"] == 0 and c["dp_replicate"] == 0 and c["dp_shard"] == 0
    return st.world.broadcast(evaluate() if mine else None)  # type: ignore[no-any-return]


def full_optimizer_state(pipe: Pipeline, optimizer: Any) -> dict[str, Any]:
    """Collective: the ``LowPrecisionOptimizer.state_dict`` one process training the whole model would have, on
    every rank: each stage's inner-optimizer state (whole tensors where TP shards it) renumbered by whole-model
    parameter index and merged; the wrapper's scaler and step count are the same on every stage."""
    import torch.distributed as dist

    from ..distributed import full_tensor

    own = optimizer.state_dict()
    inner = own["optimizer"]  # tensor-parallel (DTensor) states gathered over the TP group first (collective)
    mine = {pipe.param_index[i]: {k: full_tensor(t) if isinstance(t, torch.Tensor) else t for k, t in v.items()}
            for i, v in inner["state"].items()}
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


def pp_full_state(st: State) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: (model, optimizer) state of a pipeline (with TP inside its stages or not) in one process's
    format: every stage broadcast from its owner (``sync_model``), DTensors gathered whole over the TP group
    (``lowprec.distributed.full_model_state``), the optimizer state of every stage merged (``full_optimizer_state``)."""
    from ..distributed import full_model_state
    from ._parallel import unwrap

    st.pipeline.sync_model()
    model = unwrap(st.model)
    model_sd = full_model_state(model) if st.world.tp > 1 else model.state_dict()
    return model_sd, full_optimizer_state(st.pipeline, st.optimizer)


def pp_load_full_state(st: State, model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> None:
    """Load a full state (any layout's) into a pipeline: the whole model object on every rank (each DTensor its
    TP piece), the stage optimizer its part (``local_optimizer_state``; each DTensor state its TP piece, and the
    optimizer's ``foreach`` stays this layout's); no communication."""
    from ..distributed import load_full_model_state, load_full_optimizer_state
    from ._parallel import unwrap

    part = local_optimizer_state(st.pipeline, opt_sd)
    if st.world.tp == 1:
        unwrap(st.model).load_state_dict(model_sd)
        st.optimizer.load_state_dict(part)
        return
    load_full_model_state(unwrap(st.model), model_sd)
    inner, native = st.optimizer.optimizer, part["optimizer"]
    groups = [{**g, "foreach": own.get("foreach")} for g, own in zip(native["param_groups"], inner.param_groups,
                                                                      strict=True)]
    load_full_optimizer_state(inner, {**native, "param_groups": groups})
    st.optimizer.load_state_dict({**part, "optimizer": None})
