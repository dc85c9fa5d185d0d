"""Run under torchrun (2 ranks, gloo): converted transformers models (tiny Llama and Mixtral, "fp8-tensorwise+attn")
under DDP and under FSDP2 (lowprec.distributed.shard_model) against one process.

argv: OUT RECIPE.  For each family and each mode, STEPS AdamW steps on a fixed global batch of 4 windows:

* ``single``: no process group involvement, the full batch (computed on rank 0 only);
* ``ddp-dup`` / ``fsdp-dup``: every rank trains on the full batch (the gradient average (g + g) / 2 is g exactly,
  so the arithmetic is the one-process arithmetic);
* ``ddp-split`` / ``fsdp-split``: rank r trains on rows [2r, 2r + 2) (each half has the same number of tokens, so
  the mean of the two local mean losses is the full-batch mean loss).

Rank 0 writes OUT/<family>-<mode>.pt: the per-step loss (the mean over ranks of the local losses), the per-step full
gradients (DDP's averaged ones; FSDP2's DTensor gradients gathered with full_tensor) and the final full parameters.
Every rank writes OUT/rank<r>.json with per-case timings.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec
from lowprec.distributed import shard_model

STEPS = 3
VOCAB = 128
FAMILIES = ("llama", "mixtral")
MODES = ("ddp-dup", "fsdp-dup", "ddp-split", "fsdp-split")


def make_model(family: str, recipe: str) -> nn.Module:
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.0, tie_word_embeddings=False)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    lowprec.convert(model.train(), recipe)
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1000 + step))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model: nn.Module, names: list[str], rows: slice, world: int) -> dict[str, object]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, grads = [], []
    for step in range(STEPS):
        ids = batch(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean)
        grads.append({n: full(p.grad) for n, p in zip(names, model.parameters(), strict=True)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: full(p) for n, p in zip(names, model.parameters(), strict=True)}
    return {"losses": torch.stack(losses), "grads": grads, "params": params}


def train_accumulated(model: nn.Module, names: list[str], world: int) -> dict[str, object]:
    """One process doing what the split-batch ranks do together: each half's forward and backward on its own (so
    its own tensorwise scales), then the gradient average g0 / 2 + g1 / 2 of DDP's bucket (divide, then sum)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, grads = [], []
    for step in range(STEPS):
        parts, total = [], None
        for r in range(world):
            ids = batch(step)[2 * r:2 * r + 2]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            parts.append([p.grad for p in model.parameters()])
            total = loss.detach().clone() if total is None else total + loss.detach()
            opt.zero_grad(set_to_none=True)
        for i, p in enumerate(model.parameters()):
            p.grad = parts[0][i] / world
            for part in parts[1:]:
                p.grad = p.grad + part[i] / world
        losses.append(total / world)
        grads.append({n: p.grad.detach().clone() for n, p in zip(names, model.parameters(), strict=True)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in zip(names, model.parameters(), strict=True)}
    return {"losses": torch.stack(losses), "grads": grads, "params": params}


def main() -> None:
    out, recipe = sys.argv[1], sys.argv[2]
    cases = [(recipe, m) for m in MODES] + [("fp32", "ddp-split")]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    timings: dict[str, float] = {}
    for family in FAMILIES:
        names = [n for n, _ in make_model(family, recipe).named_parameters()]
        if rank == 0:
            for rec, tag in ((recipe, "single"), ("fp32", "single-fp32")):
                t0 = time.perf_counter()
                res = train(make_model(family, rec), names, slice(None), 1)
                torch.save(res, f"{out}/{family}-{tag}.pt")
                timings[f"{family}-{tag}"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            torch.save(train_accumulated(make_model(family, recipe), names, world), f"{out}/{family}-accumulated.pt")
            timings[f"{family}-accumulated"] = round(time.perf_counter() - t0, 3)
        for rec, mode in cases:
            t0 = time.perf_counter()
            model = make_model(family, rec)
            tag = mode if rec == recipe else f"{mode}-fp32"
            if mode.startswith("ddp"):
                wrapped: nn.Module = DDP(model, broadcast_buffers=False)
            else:
                wrapped = shard_model(model, rec)
            rows = slice(None) if mode.endswith("dup") else slice(2 * rank, 2 * rank + 2)
            res = train(wrapped, names, rows, world)
            res["attn_implementation"] = model.config._attn_implementation
            if rank == 0:
                torch.save(res, f"{out}/{family}-{tag}.pt")
            timings[f"{family}-{tag}"] = round(time.perf_counter() - t0, 3)
            del wrapped, model
            gc.collect()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "seconds": timings}, f)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
