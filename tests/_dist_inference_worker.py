"""torchrun worker for tests/test_inference_dist.py: quantize_model's calibration on 2 gloo ranks, each with its own
shard of the calibration batches (rank r takes batches 2r and 2r+1 of 4).

Writes ``<out>/<case>.rank<r>.safetensors`` (every QuantizedLinear's ``weight``, ``input_scale``, ``smooth``) and
``<out>/errors.rank<r>.json`` (the message each error case raised on this rank).  ``build`` and ``batches`` are
imported by the test to compute the single-process oracle on the same model and data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from lowprec import UsageError
from lowprec import inference as inf
from lowprec.inference import QuantizedLinear


class TwoHeads(nn.Module):
    """Both Linears read the model's input, so their Gram matrices are sums of the data's own products: with inputs
    on the grid k/8 (|k| <= 64) every float64 sum is exact, whatever the order."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = nn.Linear(128, 32)
        self.b = nn.Linear(128, 16, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(32, 128, generator=g) * 0.05)
            self.a.bias.copy_(torch.randn(32, generator=g) * 0.01)
            self.b.weight.copy_(torch.randn(16, 128, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def build(kind: str) -> nn.Module:
    if kind == "exact":
        return TwoHeads().eval()
    from lowprec.runs.zoo import get_task

    return get_task("gpt-bytes", seed=0, batch_size=4, d_model=128, layers=1, context=16).model.eval()


def batches(kind: str) -> list[torch.Tensor]:
    """4 calibration batches: dyadic inputs with outlier channels (``exact``), or byte windows (``gpt``)."""
    if kind == "exact":
        g = torch.Generator().manual_seed(11)
        out = []
        for i in range(4):
            x = torch.randint(-64, 65, (3, 8, 128), generator=g).float() / 8
            x[..., :4] *= 4 + i  # salient channels, larger in later batches (still on the grid)
            out.append(x)
        return out
    from lowprec.runs.zoo import get_task

    task = get_task("gpt-bytes", seed=0, batch_size=4, d_model=128, layers=1, context=16)
    return [task.train_batch(i)[0] for i in range(4)]


CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # name: (model kind, preset, algorithm, extra keyword arguments)
    "exact-max": ("exact", "fp8-static", "max", {}),
    "exact-percentile": ("exact", "fp8-static", "percentile", {"percentile": 99.0}),
    "exact-mse": ("exact", "fp8-static", "mse", {}),
    "exact-gptq": ("exact", "w4a16-int4", "gptq", {}),
    "exact-awq": ("exact", "w4a16-int4", "awq", {}),
    "exact-awq-static": ("exact", "fp8-static", "awq", {}),
    "exact-smoothquant": ("exact", "w8a8-int8", "smoothquant", {}),
    "exact-nvfp4-mse": ("exact", "nvfp4", "mse", {}),
    "gpt-max": ("gpt", "fp8-static", "max", {}),
    "gpt-mse": ("gpt", "fp8-static", "mse", {}),
    "gpt-gptq": ("gpt", "w4a16-int4", "gptq", {}),
}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for key in ("weight", "input_scale", "input_global_scale", "smooth"):
                t = getattr(m, key)
                if t is not None:
                    out[f"{name}.{key}"] = t.contiguous()
    return out


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case, (kind, preset, algorithm, kw) in CASES.items():
        model = build(kind)
        mine = batches(kind)[2 * rank: 2 * rank + 2]
        inf.quantize_model(model, inf.get(preset), mine, algorithm=algorithm, **kw)
        save_file(state(model), str(out / f"{case}.rank{rank}.safetensors"))
    # rank 1 has no batch: the scales are rank 0's
    model = build("exact")
    inf.quantize_model(model, inf.get("fp8-static"), batches("exact")[:2] if rank == 0 else [])
    save_file(state(model), str(out / f"empty-shard.rank{rank}.safetensors"))
    # distributed_sync=False: each rank alone
    model = build("exact")
    inf.quantize_model(model, inf.get("fp8-static"), batches("exact")[2 * rank: 2 * rank + 2], distributed_sync=False)
    save_file(state(model), str(out / f"local.rank{rank}.safetensors"))

    errors: dict[str, str] = {}
    bad = batches("exact")[:2] if rank == 0 else [torch.zeros(2, 64)]
    for case, data, kw in [
        ("bad-batch", bad, {}),
        ("disagree", batches("exact")[:2], {"algorithm": "percentile", "percentile": 99.0 if rank == 0 else 99.5}),
        ("all-empty", [], {}),
    ]:
        model = build("exact")
        try:
            inf.quantize_model(model, inf.get("fp8-static"), data, **kw)
            errors[case] = "no error"
        except UsageError as e:
            errors[case] = str(e)
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules()), case
    (out / f"errors.rank{rank}.json").write_text(json.dumps(errors))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
