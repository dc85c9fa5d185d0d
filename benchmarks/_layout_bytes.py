"""Bytes per step of tensor and pipeline parallelism for a GPT: measured on 2 ranks, and a model that extrapolates.

``measure(world)`` runs inside a torchrun worker (bench_distributed.py): the zoo GPT under TP (with and without
sequence parallelism) and PP (GPipe) for several recipes, one training step each after a warm-up, and reads what
each rank sent: ``lowprec.distributed.tp_stats`` (what a ring implementation of each collective sends) for TP;
for PP, the bytes of every tensor the stage boundary passes (the stage's outputs forward, their gradients
backward, M microbatches each), taken from forward hooks on this rank's stage modules.

``predict(...)`` is the closed form of the same counts for a decoder-only transformer of ``layers`` blocks, width
``d``, ``N`` tokens per step (batch x sequence), degree ``T`` or ``P``, with one colwise/rowwise pair in attention
and one in the MLP (as Megatron, TinyGPT and Llama).  Per block and step, each a ring collective over T ranks
(``s = (T - 1) / T`` of the full tensor sent per rank, ``2 s`` for an all-reduce):

* TP: the rowwise outputs are all-reduced forward and the colwise input gradients backward: 4 all-reduces of an
  ``N x d`` float32 tensor, ``4 * 2 s * 4 N d`` bytes;
* TP + SP: each all-reduce becomes a reduce-scatter plus an all-gather at another place: forward the colwise
  inputs are all-gathered in the GEMM's input format (``c`` bytes per element: 4 float32, 2 bf16, 1 fp8 plus one
  scale, 1 + 1/32 MXFP8) and the rowwise outputs reduce-scattered (float32); backward the rowwise output gradients
  are all-gathered and the colwise input gradients reduce-scattered (float32), and where the weight gradient
  quantizes the input along another axis than the forward (MX: blocks along the batch) the input is gathered
  again in float32: ``2 s N d (c + 4 + 4 + 4 [+ 4])``;
* PP: every stage boundary carries one ``N x d`` activation forward and its gradient backward (float32 here;
  bf16 in most production pipelines): ``2 * 4 N d`` per boundary, sent by the stage before (forward) and after
  (backward) it; with ``P`` stages, ``P - 1`` boundaries.

The amax all-reduces of tensorwise scaling (a few scalars per GEMM) are reported separately (``amax_bytes``) and
left out of the model.  The benchmark checks the model against the measurements at degree 2 (``model_error``)
and prints it for the layouts of large runs (``at_scale``): what changes there is the degree ``s -> 1`` and which
links carry the bytes, not the per-element accounting.
"""

from __future__ import annotations

import gc
import time
from typing import Any

RECIPES = ["fp32", "bf16", "fp8-tensorwise", "mxfp8"]
GPT = {"layers": 2, "d_model": 64, "heads": 4, "context": 32}
BATCH = 8
MICROBATCHES = 4
# bytes per element of the colwise input as gathered under sequence parallelism, per recipe (scales counted by
# the measurement; the model adds them as the fraction below)
GATHER_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8-tensorwise": 1.0, "mxfp8": 1.0 + 1.0 / 32}
REGATHER = {"mxfp8"}  # the weight gradient quantizes x along the batch: x gathered again in float32
# Layouts of large runs, for ``at_scale``: a Llama-3-8B-like decoder (32 blocks, d 4096) on 4096-token sequences,
# one sequence per data-parallel rank and step.
SCALE_MODEL = {"layers": 32, "d": 4096, "tokens": 4096}
SCALE_LAYOUTS = [("tp", 8), ("tp+sp", 8), ("pp", 16)]


def predict(layout: str, *, layers: int, d: int, tokens: int, degree: int, recipe: str = "fp32") -> float:
    """Bytes one rank sends per training step in ``layout`` ("tp", "tp+sp", "pp"; module docstring).  For "pp"
    the bytes of the busiest stage (an inner one: it sends forward and backward)."""
    s = (degree - 1) / degree
    nd = tokens * d
    if layout == "tp":
        return layers * 4 * 2 * s * 4 * nd
    if layout == "tp+sp":
        per = GATHER_BYTES[recipe] + 12 + (4 if recipe in REGATHER else 0)
        return layers * 2 * s * nd * per
    if layout == "pp":
        return 2 * 4 * nd if degree > 1 else 0.0
    raise ValueError(f"unknown layout {layout!r}")


def _step_tp(model: Any, task: Any, opt: Any, step: int, group: Any) -> None:
    from lowprec.distributed import sync_amax_histories

    inputs, targets = task.train_batch(step)
    loss = task.loss_fn(model(inputs), targets)
    opt.zero_grad()
    loss.backward()
    sync_amax_histories(model, group)
    opt.step()


def _tp(recipe: str, sequence_parallel: bool, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import lowprec
    from lowprec.distributed import tensor_parallel, tp_stats
    from lowprec.runs.zoo import get_task

    mesh = init_device_mesh("cpu", (world,))
    task = get_task("gpt-bytes", seed=0, batch_size=BATCH, **GPT)
    model = lowprec.convert(task.model, recipe, on_unknown="ignore")
    tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _step_tp(model, task, opt, 0, mesh.get_group())
    before = tp_stats(model)
    t0 = time.perf_counter()
    _step_tp(model, task, opt, 1, mesh.get_group())
    dt = time.perf_counter() - t0
    after = tp_stats(model)
    sent = {k: after[k] - before[k] for k in after}
    return {"bytes_per_step": sent["allgather_bytes"] + sent["reduce_bytes"], "amax_bytes": sent["amax_bytes"],
            **sent, "step_ms": 1e3 * dt}


def _pp(recipe: str, world: int) -> dict[str, Any]:
    import torch

    import lowprec
    from lowprec.distributed import Pipeline
    from lowprec.runs.zoo import get_task

    task = get_task("gpt-bytes", seed=0, batch_size=BATCH, **GPT)
    model = lowprec.convert(task.model, recipe, on_unknown="ignore")
    pipe = Pipeline(model, loss_fn=task.loss_fn, microbatches=MICROBATCHES, schedule="gpipe")
    sent = [0]

    def count(_m: Any, _inp: Any, out: Any) -> None:
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                sent[0] += t.numel() * t.element_size()  # forward to the next stage, its gradient comes back

    hooks = [m.register_forward_hook(count) for m in pipe.modules]
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, foreach=False)
    inputs, targets = task.train_batch(0)
    pipe.step(inputs, targets)
    opt.step()
    sent[0] = 0
    inputs, targets = task.train_batch(1)
    t0 = time.perf_counter()
    pipe.step(inputs, targets)
    opt.step()
    dt = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    # the last stage's outputs are logits (they stay local): count the boundary stage, fwd + bwd
    boundary = 0 if pipe.is_last else 2 * sent[0]
    return {"bytes_per_step": boundary, "step_ms": 1e3 * dt, "stage": pipe.rank}


def measure(world: int) -> dict[str, Any]:
    """Every recipe x {tp, tp+sp, pp} on this torchrun world (2 ranks), rank 0's counts, the model's prediction
    and their relative difference."""
    import torch.distributed as dist

    out: dict[str, Any] = {"model": {**GPT, "batch": BATCH, "microbatches": MICROBATCHES}, "layouts": {}}
    tokens = BATCH * GPT["context"]
    worst = 0.0
    for recipe in RECIPES:
        for layout in ("tp", "tp+sp", "pp"):
            r = _pp(recipe, world) if layout == "pp" else _tp(recipe, layout == "tp+sp", world)
            gc.collect()  # the case's model and stages (reference cycles) freed while the process group lives
            counts = [None] * world
            dist.all_gather_object(counts, r["bytes_per_step"])
            measured = max(counts)  # pp: the boundary stage (rank 0 of 2); tp: equal on every rank
            pred = predict(layout, layers=GPT["layers"], d=GPT["d_model"], tokens=tokens, degree=world, recipe=recipe)
            err = abs(measured - pred) / pred if pred else float(measured != 0)
            worst = max(worst, err)
            out["layouts"][f"{layout}/{recipe}"] = {**r, "bytes_per_step": measured, "predicted": pred,
                                                     "model_error": err}
    out["model_worst_error"] = worst
    big = SCALE_MODEL
    out["at_scale"] = {
        "model": big,
        "bytes_per_step_per_rank": {
            f"{layout}{deg}/{recipe}": predict(layout, layers=big["layers"], d=big["d"], tokens=big["tokens"],
                                               degree=deg, recipe=recipe)
            for layout, deg in SCALE_LAYOUTS for recipe in RECIPES if layout != "pp" or recipe == "fp32"
        },
    }
    return out
