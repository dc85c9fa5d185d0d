"""Run under torchrun (2 ranks = 2 pipeline stages, gloo): lowprec.distributed.Pipeline against one process.

argv: output directory, JSON list of cases ``[model, recipe, schedule]``: schedule "gpipe" / "1f1b", or the
one-process baselines "accum" (gradient accumulation over the same microbatches) and "whole" (the whole batch in one
forward), run on every rank; "-clip" appended: global gradient-norm clipping; controls "1f1b-dynamic" (torch's
dynamic stage metadata), "1f1b-noindex" (the stage optimizer without ``param_index``) and "-group" (a new process
group object instead of the default group).  After training, a pipeline case syncs the whole model to every rank
(``sync_model``) and digests it.  Writes ``rank<r>.json`` with, per case: per-step losses (float.hex), and for every
parameter and buffer (``lp_step``, amax histories) the rank's stages hold (all of them for a baseline) a sha256
digest by its name in the whole model; amax histories also as lists.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import lowprec
from lowprec import recipes
from lowprec.distributed import Pipeline, accumulate_step
from lowprec.optim import LowPrecisionOptimizer
from lowprec.recipes import Recipe
from lowprec.runs._runner import _grad_norm_and_clip
from lowprec.runs.zoo import get_task

STEPS = 3
MICROBATCHES = 4
BATCH = 16
CLIP = 0.1  # "-clip" cases: global gradient norm clipped to this (the runner's _grad_norm_and_clip in one process)
VARIANTS = ("-clip", "-dynamic", "-noindex", "-group")
INTERLEAVED = {"gpt": {"split_points": ["blocks.0", "blocks.1", "ln_f"]},  # 4 stages, 2 per rank
               "mlp": {"order": ["layers.0", "act", "layers.1", "act", "head"]}}  # the default balanced split
EVALUATE = {("gpt", "fp8-delayed"), ("mlp", "mxfp4")}  # cases that also report the task's evaluation
MODELS = {
    "gpt": ("gpt-bytes", {"layers": 2, "d_model": 32, "heads": 2, "context": 16}, {"split_points": ["blocks.1"]}),
    "mlp": ("mlp-digits", {"hidden": 32, "layers": 2},
            {"split_points": ["layers.1"], "order": ["layers.0", "act", "layers.1", "act", "head"]}),
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def state(model: torch.nn.Module, modules: list[torch.nn.Module]) -> dict[str, object]:
    """Digests of the parameters and buffers of ``modules`` (by their names in ``model``), amax histories."""
    mine = {id(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
    params = {n: p for n, p in model.named_parameters() if id(p) in mine}
    bufs = {n: b for n, b in model.named_buffers() if id(b) in mine}
    return {"params": {n: digest(p) for n, p in params.items()}, "buffers": {n: digest(b) for n, b in bufs.items()},
            "amax": {n: b.tolist() for n, b in bufs.items() if ".amax_history_" in n},
            "lp_step": {n: int(b) for n, b in bufs.items() if n.endswith("lp_step")}}


def named_recipe(name: str) -> Recipe:
    """A named recipe, or "fp16-overflow": fp16 with a dynamic loss scale started at 2^30 (which overflows)."""
    if name != "fp16-overflow":
        return recipes.get(name)
    base = recipes.get("fp16-dynamic-loss-scale")
    return dataclasses.replace(base, name=name, loss_scaling=dataclasses.replace(base.loss_scaling,
                                                                                 init_scale=2.0**19))


def run_case(model_key: str, recipe_name: str, schedule: str) -> dict[str, object]:
    task_name, options, split = MODELS[model_key]
    recipe = named_recipe(recipe_name)
    task = get_task(task_name, seed=0, batch_size=BATCH, **options)
    model = task.model
    lowprec.convert(model, recipe)  # before splitting: lowprec_name is the path in the whole model
    model.train()
    losses = []
    kind, _, variant = schedule.rpartition("-") if schedule.endswith(VARIANTS) else (schedule, "", "")
    evaluation = {"eval": task.evaluate} if (model_key, recipe_name) in EVALUATE else {}
    if kind in ("accum", "whole"):
        params = list(model.parameters())
        opt = LowPrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), recipe)
        norms = []
        for step in range(STEPS):
            x, y = task.train_batch(step)
            if kind == "accum":
                loss = accumulate_step(model, x, y, task.loss_fn, microbatches=MICROBATCHES,
                                       loss_scale=opt.scaler.scale)
            else:
                loss = task.loss_fn(model(x), y)
                opt.scale_loss(loss).backward()
            if variant == "clip":
                norms.append(_grad_norm_and_clip(params, opt.scaler.scale, CLIP))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return {"losses": [float.hex(v) for v in losses], "skipped": opt.scaler.skipped_steps,
                "norms": [float.hex(v) for v in norms], **state(model, [model]),
                **{k: f(model) for k, f in evaluation.items()}}
    if kind == "interleaved-1f1b":
        split = {**INTERLEAVED[model_key], "stages_per_rank": 2}
    if variant == "group":  # the pipeline on a process group object of its own (a device mesh's "pp" dimension)
        split = {**split, "group": dist.new_group([0, 1])}
    pipe = Pipeline(model, loss_fn=task.loss_fn, microbatches=MICROBATCHES, schedule=kind, **split)
    if variant == "dynamic":  # control: torch's dynamic metadata inference instead of Pipeline's static metadata
        stage = PipelineStage(pipe.module, pipe.rank, pipe.n_stages, pipe.device)
        pipe._schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=task.loss_fn)
    index = None if variant == "noindex" else pipe.param_index  # control: the stage's own parameter indices
    opt = LowPrecisionOptimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2), recipe, param_index=index)
    local_finite, norms = [], []
    for step in range(STEPS):
        x, y = task.train_batch(step)
        loss = pipe.step(x, y, loss_scale=opt.scaler.scale)
        local_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in pipe.parameters() if p.grad is not None))
        if variant == "clip":
            norms.append(pipe.clip_grad_norm_(CLIP, loss_scale=opt.scaler.scale))
        if pipe.grads_finite():
            opt.step()
        else:  # some stage overflowed: every stage skips, as one process would
            opt.scaler.update(False)
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": [float.hex(v) for v in losses], "pieces": [n for m in pipe.modules for n in m.piece_names],
            "skipped": opt.scaler.skipped_steps, "local_finite": local_finite, "norms": [float.hex(v) for v in norms],
            **state(model, list(pipe.modules)), "synced": sync_and_digest(pipe, model),
            **{k: f(model) for k, f in evaluation.items()}}


def sync_and_digest(pipe: Pipeline, model: torch.nn.Module) -> dict[str, object]:
    """``sync_model``, then digests of the whole model on this rank (every stage's parameters and buffers)."""
    pipe.sync_model()
    full = state(model, [model])
    return {"params": full["params"], "buffers": full["buffers"]}


def doc_example() -> dict[str, object]:
    """The Python example of docs/distributed.md's "Pipeline parallelism" section, run as is (it initialises the
    process group): the loss and validation metrics it ends with, and the untrained model's loss on the first batch
    (one process)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text.split("## Pipeline parallelism", 1)[1], flags=re.S)
    scope: dict[str, object] = {}
    t0 = time.perf_counter()
    exec(compile(block, "docs/distributed.md", "exec"), scope)
    seconds = time.perf_counter() - t0
    fresh = get_task("gpt-bytes", seed=0, batch_size=16, layers=2, d_model=32, heads=2, context=16)
    x, y = fresh.train_batch(0)
    with torch.no_grad():
        initial = float(fresh.loss_fn(fresh.model(x), y))
    return {"final_loss": float(scope["loss"]), "initial_loss": initial,  # type: ignore[arg-type]
            "metrics": scope["metrics"], "seconds": round(seconds, 3)}


def main() -> None:
    doc = doc_example()
    rank = dist.get_rank()
    results = []
    for model_key, recipe, schedule in json.loads(sys.argv[2]):
        t0 = time.perf_counter()
        out = run_case(model_key, recipe, schedule)
        results.append({"model": model_key, "recipe": recipe, "schedule": schedule, **out,
                        "seconds": round(time.perf_counter() - t0, 3)})
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:  # one file per rank: no interleaved lines
        json.dump({"rank": rank, "cases": results, "doc": doc}, f)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
