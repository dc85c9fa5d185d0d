"""torchrun worker for tests/test_dist_compress.py: DDP with lowprec.distributed compress hooks on gloo.

Every rank builds every rank's local gradient itself (deterministic generators), so it can compute the oracle:
``mean_r fake_quantize(g_r)`` with ``lowprec.quant`` functions directly, the shared scale of tensor-scaled specs
obtained by appending the global amax as one extra element (then the tensor's own amax *is* the global amax).
Writes ``<out_dir>/rank<r>.json``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lowprec.distributed._compress import compress_hook, rounding_seed
from lowprec.quant import QuantSpec, fake_quantize

N = 4133  # not a multiple of 32 (a partial MX block) nor of 4 (float6 packing)
SEED = 1234


class Probe(torch.nn.Module):
    """loss = sum_i (p_i * x_i).sum(): the local gradient of p_i is exactly x_i."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes])

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p * x).sum() for p, x in zip(self.ps, xs, strict=True)), torch.zeros(()))


def local_grad(n: int, step: int, rank: int, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 17 * rank + 7919 * salt)
    mag = torch.exp2(torch.randint(-14, 1, (n,), generator=gen).float())  # a wide dynamic range
    return torch.randn(n, generator=gen) * mag


def oracle(xs: list[torch.Tensor], spec: QuantSpec, step: int, bucket: int = 0) -> torch.Tensor:
    amax = max(x.abs().max() for x in xs)
    ys = []
    for r, x in enumerate(xs):
        seed = rounding_seed(SEED, step, bucket, r) if spec.rounding == "stochastic" else None
        if spec.scaling == "tensor":
            ys.append(fake_quantize(torch.cat([x, amax.reshape(1)]), spec, seed=seed)[:-1])
        else:
            ys.append(fake_quantize(x, spec, seed=seed))
    acc = ys[0].clone()
    for y in ys[1:]:
        acc += y
    return acc / len(xs), ys


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def make_ddp(sizes: list[int], spec: QuantSpec, *, ef: bool = False, **ddp_kw: object) -> tuple:
    model = Probe(sizes)
    ddp = DDP(model, **ddp_kw)
    state, hook = compress_hook(spec, seed=SEED, error_feedback=ef)
    ddp.register_comm_hook(state, hook)
    return model, ddp, state


def parity(name: str, spec: QuantSpec, world: int, rank: int, *, same_input: bool = False, steps: int = 3) -> dict:
    model, ddp, state = make_ddp([N], spec)
    out: list[dict] = []
    for step in range(steps):
        xs = [local_grad(N, step, 0 if same_input else r) for r in range(world)]
        model.zero_grad()
        ddp([xs[rank]]).backward()
        grad = model.ps[0].grad
        expect, ys = oracle(xs, spec, step)
        out.append({
            "equal": bool(torch.equal(grad, expect)),
            "max_diff": float((grad - expect).abs().max()),
            "rel_err": float((grad - sum(xs) / world).norm() / (sum(xs) / world).norm()),
            "digest": digest(grad),
            "bytes_sent": state.bytes_sent,
            "bytes_uncompressed": state.bytes_uncompressed,
            "buckets": state.buckets,
            "step": state.step,
            "ranks_differ": bool(not torch.equal(ys[0], ys[1])),
        })
    return {"name": name, "numel": N, "steps": out}


def multi_bucket(world: int, rank: int) -> dict:
    """Several buckets (one per parameter after DDP's rebuild): elementwise bf16 parity per parameter."""
    sizes = [3000, 5000, 2000]
    spec = QuantSpec(elem="bfloat16", scaling="none")
    model, ddp, state = make_ddp(sizes, spec, bucket_cap_mb=0.004)
    equal, buckets = [], []
    for step in range(3):
        xs = [[local_grad(n, step, r, salt=i + 1) for i, n in enumerate(sizes)] for r in range(world)]
        model.zero_grad()
        ddp(xs[rank]).backward()
        for i, p in enumerate(model.ps):
            expect, _ = oracle([xs[r][i] for r in range(world)], spec, step)
            equal.append(bool(torch.equal(p.grad, expect)))
        buckets.append(state.buckets)
    return {"equal": equal, "buckets": buckets, "bytes_sent": state.bytes_sent, "total_numel": sum(sizes)}


def error_feedback(world: int, rank: int, ef: bool, steps: int = 30) -> dict:
    """fp8 e4m3 with a shared scale: 1.0 sets the amax, 1e-6 lies below half the smallest step (always 0 without
    feedback); the rest are random.  Compares the sums over steps of sent and true mean gradients."""
    sizes = [2000, 1500]
    spec = QuantSpec.named("fp8_e4m3_tensorwise")
    model, ddp, state = make_ddp(sizes, spec, ef=ef, bucket_cap_mb=0.004)
    sent = [torch.zeros(n) for n in sizes]
    true = [torch.zeros(n) for n in sizes]
    for step in range(steps):
        xs = []
        for r in range(world):
            gs = [local_grad(n, step, r, salt=i + 5) * 1e-3 for i, n in enumerate(sizes)]
            for g in gs:
                g[0], g[1:100] = 1.0, 1e-6
            xs.append(gs)
        model.zero_grad()
        ddp(xs[rank]).backward()
        for i, p in enumerate(model.ps):
            sent[i] += p.grad
            true[i] += sum(xs[r][i] for r in range(world)) / world
    err = max(float((s - t).abs().max()) for s, t in zip(sent, true, strict=True))
    tiny_err = max(float((s[1:100] - t[1:100]).abs().max()) for s, t in zip(sent, true, strict=True))
    res = {"err": err, "tiny_err": tiny_err, "tiny_true": float(true[0][1]), "buckets": state.buckets}
    if ef:
        own = torch.cat([state.residuals[id(p)] for p in model.ps])
        allr = [torch.empty_like(own) for _ in range(world)]
        dist.all_gather(allr, own)
        mean_res = sum(allr) / world
        # telescoping: sum_t sent_t = sum_t true_t - mean_r residual_r (up to float32 rounding of the sums)
        tele = torch.cat([s - t for s, t in zip(sent, true, strict=True)]) + mean_res
        res.update(max_residual=float(max(r.abs().max() for r in allr)), telescope_err=float(tele.abs().max()))
    return res


def nan_check(world: int, rank: int) -> dict:
    spec = QuantSpec.named("fp8_e4m3_tensorwise")
    model, ddp, state = make_ddp([N], spec)
    x = local_grad(N, 0, rank)
    if rank == 1:
        x[5] = math.nan
    ddp([x]).backward()
    return {"all_nan": bool(torch.isnan(model.ps[0].grad).all())}


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # DDP broadcasts rank 0's (zero) parameters; nothing below draws from the global RNG
    named = QuantSpec.named
    configs = [
        ("float32", QuantSpec(elem="float32", scaling="none"), False),
        ("bfloat16", QuantSpec(elem="bfloat16", scaling="none"), False),
        ("float16", QuantSpec(elem="float16", scaling="none"), False),
        ("fp8_e4m3_tensorwise", named("fp8_e4m3_tensorwise"), False),
        ("fp8_e5m2_tensorwise", named("fp8_e5m2_tensorwise"), False),
        ("mxfp8_e4m3", named("mxfp8_e4m3"), False),
        ("mxfp6_e3m2", named("mxfp6_e3m2"), False),
        ("nvfp4", named("nvfp4"), False),
        ("bfloat16_sr", QuantSpec(elem="bfloat16", scaling="none", rounding="stochastic"), False),
        ("fp8_e4m3_tensorwise_sr", QuantSpec(elem="float8_e4m3fn", rounding="stochastic"), False),
        ("mxfp8_e4m3_sr", QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=32,
                                    scale_format="float8_e8m0fnu", scale_rounding="floor", rounding="stochastic"),
         False),
        ("fp8_e5m2_sr_same_input", QuantSpec(elem="float8_e5m2", rounding="stochastic"), True),
    ]
    result: dict = {"rank": rank, "world": world, "parity": {}}
    for name, spec, same in configs:
        result["parity"][name] = parity(name, spec, world, rank, same_input=same)
    result["multi_bucket"] = multi_bucket(world, rank)
    result["ef_on"] = error_feedback(world, rank, True)
    result["ef_off"] = error_feedback(world, rank, False)
    result["nan"] = nan_check(world, rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    gc.collect()  # the DDP/FSDP2 models' reference cycles: freed now, not during interpreter shutdown
    dist.barrier()  # no rank tears down gloo while a peer may still talk to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
