"""Run under torchrun (2 ranks, gloo): FSDP2 via lowprec.distributed.shard_model against DDP on the same data.

Prints one line ``FSDP_JSON <json>`` per rank with, per case: per-step local losses (float.hex), final full
parameters and amax histories (hex digests), bytes gathered, low-precision gather checks and a state-dict round trip.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec
from lowprec.distributed._fsdp import allgather_bytes, allgather_stats, amax_histories, shard_model, sync_amax_histories
from lowprec.quant import QuantSpec, dequantize, quantize_scaled

STEPS = 4
DIMS = ((32, 64), (64, 64), (64, 16))


def make_model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (k, n) in enumerate(DIMS):
        layers[f"fc{i}"] = nn.Linear(k, n)
        if i < len(DIMS) - 1:
            layers[f"act{i}"] = nn.GELU()
    model = nn.Sequential(layers)
    lowprec.convert(model, recipe)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, DIMS[0][0], generator=g) * (1 + rank)
    return x, torch.randn(8, DIMS[-1][1], generator=g)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:16]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out[n.replace("module.", "")] = t.detach().to(torch.float32)
    return out


def train(model: nn.Module, rank: int, steps: range) -> list[float]:
    opt = getattr(model, "_opt", None) or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model._opt = opt  # type: ignore[assignment]
    losses = []
    for step in steps:
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync_amax_histories(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def gather_check(model: nn.Module, recipe: str) -> dict[str, object]:
    """Unshard each low-precision-gathered linear and compare with dequantize(quantize_scaled(full weight))."""
    res: dict[str, object] = {}
    for name in allgather_stats(model)["lowp_modules"]:
        mod = model.get_submodule(name)
        full = mod.weight.full_tensor().detach()
        spec: QuantSpec = mod.recipe.forward.b.spec
        want = dequantize(*quantize_scaled(full, spec), spec)
        mod.unshard()
        got = mod.weight.detach()
        got = got.to_local() if hasattr(got, "to_local") else got
        res[name] = {"bitwise": bool(torch.equal(got.view(torch.int32), want.view(torch.int32))),
                     "max_abs_diff": float((got - want).abs().max()), "lossy_vs_fp32": not torch.equal(got, full)}
        mod.reshard()
    return res


def run_case(recipe: str, mode: str, rank: int) -> dict[str, object]:
    model = make_model(recipe)
    out: dict[str, object] = {"recipe": recipe, "mode": mode}
    if mode == "ddp":
        wrapped: nn.Module = DDP(model, broadcast_buffers=False)
    else:
        lowp = {"fsdp": None, "fsdp_fp32": False, "fsdp_lowp": True}[mode]
        wrapped = shard_model(model, recipe, lowp_all_gather=lowp)
        allgather_bytes(wrapped, reset=True)
        with torch.no_grad():  # one forward: every parameter gathered once
            wrapped(batch(0, rank)[0])
        for m in model.modules():  # forget the amax this probe forward recorded
            for n, b in m.named_buffers(recurse=False):
                if n.startswith("amax_history_"):
                    b.zero_()
        out["stats"] = allgather_stats(wrapped)
        out["bytes_one_forward"] = allgather_bytes(wrapped, reset=True)
    out["losses"] = [float.hex(v) for v in train(wrapped, rank, range(STEPS))]
    params = full_params(wrapped)
    out["params"] = {n: digest(t) for n, t in params.items()}
    if rank == 0:
        torch.save(params, f"{sys.argv[1]}/{recipe}-{mode}.pt")
    out["amax"] = {n.replace("module.", ""): [float.hex(v) for v in h.tolist()]
                   for n, h in amax_histories(wrapped).items()}
    if mode.startswith("fsdp") and out["stats"]["lowp_modules"]:  # type: ignore[index]
        out["gather"] = gather_check(wrapped, recipe)
    if mode == "fsdp" and recipe == "fp8-delayed":
        out["roundtrip"] = roundtrip(wrapped, recipe, rank)
    return out


def roundtrip(model: nn.Module, recipe: str, rank: int) -> dict[str, object]:
    """Full state dict out, into a freshly sharded model, then one more step on both: same loss, same params."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    sd = get_model_state_dict(model, options=opts)
    fresh = shard_model(make_model(recipe), recipe)
    # set_model_state_dict turns the full tensors of the dict it is given into DTensors in place: give it a copy
    set_model_state_dict(fresh, {k: v.clone() for k, v in sd.items()}, options=opts)
    sd2 = get_model_state_dict(fresh, options=opts)
    same_sd = sorted(sd) == sorted(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    # the optimizer state is not part of the model state dict: compare one step from fresh optimizers on both
    model._opt = None  # type: ignore[assignment]
    a = train(model, rank, range(STEPS, STEPS + 1))
    b = train(fresh, rank, range(STEPS, STEPS + 1))
    pa, pb = full_params(model), full_params(fresh)
    return {"state_dict_equal": same_sd, "keys": sorted(sd), "next_loss_equal": a == b,
            "next_params_equal": all(torch.equal(pa[k], pb[k]) for k in pa)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = json.loads(sys.argv[2])
    results = []
    for recipe, mode in cases:
        t0 = time.perf_counter()
        results.append(run_case(recipe, mode, rank))
        results[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    # one file per rank: two ranks printing long lines to one pipe can interleave them
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "cases": results}, f)
    gc.collect()  # the DDP/FSDP2 models' reference cycles: freed now, not during interpreter shutdown
    dist.barrier()  # no rank tears down gloo while a peer may still talk to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
