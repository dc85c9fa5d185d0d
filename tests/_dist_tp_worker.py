"""Run under torchrun (2 ranks, gloo): tensor (and sequence) parallelism against one process, on every rank.

Every rank also computes the single-process reference itself (same seeds, no collectives), so the comparison
needs no extra launch.  Writes ``rank<r>.json`` into the output directory with, per case:

* ``layer``: one colwise and one rowwise ``EmulatedLinear`` (with bias), forward and backward on fixed tensors:
  for each result, whether this rank's slice equals the single-process slice bit for bit, and the max abs
  difference (where the arithmetic differs: sums over a sharded reduction dimension);
* ``gpt``: the zoo's TinyGPT trained for ``STEPS`` AdamW steps with TP=2 (``sp``: with sequence parallelism) and
  in one process: whether the gathered parameters start equal, per-step losses (float.hex), the largest parameter
  difference after the last step in units of the learning rate, and the bytes the TP collectives sent;
* ``gpt_wire``: ``gpt`` with the recipe's ``grad_comm`` (bf16) on the input-gradient partial sums;
* ``wire``: a colwise layer whose input-gradient partial sums are sent as float32, bf16 and fp8 (``GradComm``);
* ``dcp``: distributed checkpoints from TP=2 to TP=2 and one process, and from one process to TP=2;
* ``optim``: ``bf16-sr``'s stochastic weight update on TP-sharded parameters against one process;
* ``llama`` / ``gpt2``: a transformers Llama through ``llama_plan``, GPT-2 through ``gpt2_plan`` (``gpt``'s fields);
* ``doc``: the docs example (20 steps of TP=2 with sequence parallelism, fp8-delayed), run first.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import lowprec
from lowprec.distributed import EmulatedColwiseParallel, EmulatedRowwiseParallel, tensor_parallel, tp_stats
from lowprec.distributed._fsdp import sync_amax_histories
from lowprec.optim import LowPrecisionOptimizer
from lowprec.quant import QuantSpec
from lowprec.recipes import GradComm
from lowprec.runs.zoo import get_task
from lowprec.runs.zoo._text import lm_loss

STEPS = 3
LR = 3e-3
GPT = {"layers": 2, "d_model": 64, "heads": 4, "context": 16, "batch_size": 4}


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _cmp(local: torch.Tensor, ref: torch.Tensor) -> dict[str, object]:
    local, ref = local.detach(), ref.detach()
    d = (local.to(torch.float32) - ref.to(torch.float32)).abs()
    return {"bitwise": bool(torch.equal(local, ref)), "max_abs": float(d.max()) if d.numel() else 0.0,
            "ref_max": float(ref.abs().max())}


def layer_case(recipe: str, mesh: object, rank: int) -> dict[str, object]:
    """A colwise and a rowwise layer on fixed tensors against one process (module docstring)."""
    out: dict[str, object] = {}
    for kind in ("colwise", "rowwise"):
        torch.manual_seed(7)
        k, n = 64, 128
        ref = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(k, n)), recipe)[0]
        tp = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(k, n)), recipe)[0]
        tp.load_state_dict(ref.state_dict())
        style = EmulatedColwiseParallel() if kind == "colwise" else EmulatedRowwiseParallel()
        torch.distributed.tensor.parallel.parallelize_module(tp, mesh, style)
        g = torch.Generator().manual_seed(11)
        x = torch.randn(3, 8, k, generator=g)
        dy = torch.randn(3, 8, n, generator=g) * 1e-2
        xr = x.clone().requires_grad_(True)
        y_ref = ref(xr)
        y_ref.backward(dy)
        cols = slice(rank * k // 2, (rank + 1) * k // 2)
        rows = slice(rank * n // 2, (rank + 1) * n // 2)
        if kind == "colwise":
            xt = x.clone().requires_grad_(True)
            y = tp(xt)
            y.backward(dy[..., rows])
            out[kind] = {"y": _cmp(y, y_ref[..., rows]), "dx": _cmp(xt.grad, xr.grad),
                         "dw": _cmp(tp.weight.grad.to_local(), ref.weight.grad[rows]),
                         "db": _cmp(tp.bias.grad.to_local(), ref.bias.grad[rows])}
        else:
            xt = x[..., cols].clone().requires_grad_(True)
            y = tp(xt)
            y.backward(dy)
            out[kind] = {"y": _cmp(y, y_ref), "dx": _cmp(xt.grad, xr.grad[..., cols]),
                         "dw": _cmp(tp.weight.grad.to_local(), ref.weight.grad[:, cols]),
                         "db": _cmp(tp.bias.grad.to_local(), ref.bias.grad)}
    return out


WIRES = {"bf16": QuantSpec(elem="bfloat16", scaling="none", saturate=False),
         "fp8_e5m2": QuantSpec.named("fp8_e5m2_tensorwise")}


def wire_case(recipe: str, mesh: object) -> dict[str, object]:
    """A colwise layer whose input-gradient partial sums travel in each ``WIRES`` format (``GradComm``) and in
    float32: dx against one process, and the bytes sent."""
    out: dict[str, object] = {}
    for wname, spec in [("float32", None), *WIRES.items()]:
        torch.manual_seed(7)
        ref = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(64, 128)), recipe)[0]
        tp = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(64, 128)), recipe)[0]
        tp.load_state_dict(ref.state_dict())
        comm = None if spec is None else GradComm(spec=spec)
        torch.distributed.tensor.parallel.parallelize_module(tp, mesh, EmulatedColwiseParallel(grad_comm=comm))
        g = torch.Generator().manual_seed(11)
        x = torch.randn(3, 8, 64, generator=g)
        dy = torch.randn(3, 8, 128, generator=g) * 1e-2
        xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ref(xr).backward(dy)
        rank = dist.get_rank()
        tp(xt).backward(dy[..., rank * 64:(rank + 1) * 64])
        out[wname] = {"dx": _cmp(xt.grad, xr.grad), "stats": tp.lowprec_tp.stats.as_dict()}
    return out


def optim_case(mesh: object) -> dict[str, object]:
    """One ``LowPrecisionOptimizer`` step of ``bf16-sr`` (stochastic weight update) on a parameter sharded as tensor
    parallelism shards it (rows, columns, q/k/v strided rows) and on the same parameter in one process: whether
    the gathered result is bit for bit the same (the draws are indexed by global element)."""
    out: dict[str, object] = {}
    for name, place in (("shard0", Shard(0)), ("shard1", Shard(1)), ("strided", _StridedShard(0, split_factor=3))):
        g = torch.Generator().manual_seed(3)
        w, grad = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g) * 1e-3
        ref = torch.nn.Parameter(w.clone())
        ref.grad = grad.clone()
        shard = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [place]))  # type: ignore[arg-type]
        shard.grad = distribute_tensor(grad.clone(), mesh, [place])  # type: ignore[arg-type]
        for p in (ref, shard):
            LowPrecisionOptimizer(torch.optim.SGD([p], lr=1.0), "bf16-sr").step()
        out[name] = bool(torch.equal(shard.full_tensor(), ref.detach()))
    return out


def dcp_case(recipe: str, mesh: object, out_dir: Path) -> dict[str, object]:
    """Distributed checkpoints across layouts: a TP=2 TinyGPT saved with ``torch.distributed.checkpoint`` and
    loaded into another TP=2 model and (rank 0, no process group) into a one-process model, and a one-process
    checkpoint loaded into a TP=2 model: whether every parameter comes back bit for bit."""
    import torch.distributed.checkpoint as dcp

    cfg = {**GPT, "layers": 1}

    def fresh(seed: int) -> torch.nn.Module:
        return lowprec.convert(get_task("gpt-bytes", seed=seed, **cfg).model, recipe)

    def equal(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(_full(p), ref[n]) for n, p in model.named_parameters())

    src = fresh(0)
    ref = {n: p.detach().clone() for n, p in src.named_parameters()}
    tensor_parallel(src, mesh)  # type: ignore[arg-type]
    dcp.save(src.state_dict(), checkpoint_id=out_dir / "tp2")
    out: dict[str, object] = {}
    tp2 = tensor_parallel(fresh(1), mesh)  # type: ignore[arg-type]
    state = tp2.state_dict()
    dcp.load(state, checkpoint_id=out_dir / "tp2")
    tp2.load_state_dict(state)
    out["tp2_to_tp2"] = equal(tp2, ref)
    if dist.get_rank() == 0:
        one = fresh(1)
        state = one.state_dict()
        dcp.load(state, checkpoint_id=out_dir / "tp2", no_dist=True)
        one.load_state_dict(state)
        out["tp2_to_tp1"] = equal(one, ref)
        dcp.save(fresh(0).state_dict(), checkpoint_id=out_dir / "tp1", no_dist=True)
    dist.barrier()
    tp2b = tensor_parallel(fresh(1), mesh)  # type: ignore[arg-type]
    state = tp2b.state_dict()
    dcp.load(state, checkpoint_id=out_dir / "tp1")
    tp2b.load_state_dict(state)
    out["tp1_to_tp2"] = equal(tp2b, ref)
    return out


def _train(model: torch.nn.Module, task: object, group: object | None, recipe: str) -> list[float]:
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=False), recipe)
    losses = []
    for step in range(STEPS):
        idx, tgt = task.train_batch(step)  # type: ignore[attr-defined]
        loss = lm_loss(model(idx), tgt)
        opt.zero_grad()
        loss.backward()
        if group is not None:
            sync_amax_histories(model, group)
        opt.step()
        losses.append(loss.item())
    return losses


def gpt_case(name: str, sp: bool, mesh: object, wire: bool = False) -> dict[str, object]:
    """``wire``: the recipe with ``grad_comm`` bf16, which ``tensor_parallel(recipe=...)`` applies to the colwise
    input-gradient partial sums."""
    recipe = lowprec.recipes.get(name)
    if wire:
        recipe = dataclasses.replace(recipe, grad_comm=GradComm(spec=WIRES["bf16"]))
    task = get_task("gpt-bytes", seed=0, **GPT)
    ref = lowprec.convert(task.model, recipe)
    tp_model = lowprec.convert(get_task("gpt-bytes", seed=0, **GPT).model, recipe)
    tp_model.load_state_dict(ref.state_dict())
    tensor_parallel(tp_model, mesh, sequence_parallel=sp, recipe=recipe)  # type: ignore[arg-type]
    ref_p = dict(ref.named_parameters())
    init_equal = all(torch.equal(_full(p), ref_p[n].detach()) for n, p in tp_model.named_parameters())
    t0 = time.perf_counter()
    ref_losses = _train(ref, task, None, recipe)
    t1 = time.perf_counter()
    tp_losses = _train(tp_model, task, mesh.get_group(), recipe)  # type: ignore[attr-defined]
    t2 = time.perf_counter()
    worst = max(float((_full(p) - ref_p[n].detach()).abs().max()) for n, p in tp_model.named_parameters())
    return {"ref_losses": [v.hex() for v in ref_losses], "tp_losses": [v.hex() for v in tp_losses],
            "init_equal": init_equal, "param_lr_units": worst / LR, "stats": tp_stats(tp_model),
            "seconds": [t1 - t0, t2 - t1]}


def doc_example() -> dict[str, object]:
    """The Python example of docs/distributed.md's "Tensor and sequence parallelism" section, run as is (it
    initialises the process group): its last loss and the untrained model's loss on the first batch."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    section = text.split("## Tensor and sequence parallelism", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    scope: dict[str, object] = {}
    exec(compile(block, "docs/distributed.md", "exec"), scope)
    fresh = get_task("gpt-bytes", seed=0, batch_size=4, layers=2, d_model=64, heads=4, context=16)
    x, y = fresh.train_batch(0)
    with torch.no_grad():
        initial = float(fresh.loss_fn(fresh.model(x), y))
    return {"final_loss": float(scope["loss"].detach()), "initial_loss": initial}  # type: ignore[attr-defined]


def llama(recipe: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return lowprec.convert(model.train(), recipe)


def gpt2(recipe: str) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    return lowprec.convert(model.train(), recipe)


def llama_case(recipe: str, mesh: object, build: Any = None) -> dict[str, object]:
    """A transformers Llama (2 layers, 4 heads, 2 key-value heads) with ``llama_plan`` (or the model ``build``
    makes: GPT-2 with ``gpt2_plan``), TP=2 vs one process."""
    build = build or llama
    ref, tp_model = build(recipe), build(recipe)
    tensor_parallel(tp_model, mesh)  # type: ignore[arg-type]
    ref_p = dict(ref.named_parameters())
    init_equal = all(torch.equal(_full(p), ref_p[n].detach()) for n, p in tp_model.named_parameters())
    losses: dict[str, list[str]] = {}
    for key, model in (("ref", ref), ("tp", tp_model)):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        out = []
        for step in range(STEPS):
            ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1000 + step))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item().hex())
        losses[key] = out
    worst = max(float((_full(p) - ref_p[n].detach()).abs().max()) for n, p in tp_model.named_parameters())
    return {"ref_losses": losses["ref"], "tp_losses": losses["tp"], "init_equal": init_equal,
            "param_lr_units": worst / LR, "stats": tp_stats(tp_model), "seconds": [0.0, 0.0]}


def main() -> None:
    out_dir = Path(sys.argv[1])
    cases = json.loads(sys.argv[2])
    doc = doc_example()
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = []
    for recipe, kind in cases:
        if kind == "dcp":
            results.append({"recipe": recipe, "kind": kind, **dcp_case(recipe, mesh, out_dir)})
        elif kind == "optim":
            results.append({"recipe": recipe, "kind": kind, **optim_case(mesh)})
        elif kind in ("llama", "gpt2"):
            results.append({"recipe": recipe, "kind": kind,
                            **llama_case(recipe, mesh, gpt2 if kind == "gpt2" else None)})
        elif kind == "wire":
            results.append({"recipe": recipe, "kind": kind, **wire_case(recipe, mesh)})
        elif kind == "layer":
            results.append({"recipe": recipe, "kind": kind, **layer_case(recipe, mesh, rank)})
        elif kind in ("gpt", "gpt_sp", "gpt_wire"):
            results.append({"recipe": recipe, "kind": kind,
                            **gpt_case(recipe, kind == "gpt_sp", mesh, wire=kind == "gpt_wire")})
        else:
            raise ValueError(f"unknown case kind {kind!r}")
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "cases": results, "doc": doc}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
