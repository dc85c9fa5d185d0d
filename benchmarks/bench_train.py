"""Training-step time of lowprec recipes against plain PyTorch and torchao's Float8Linear, as one JSON object.

    PYTHONPATH=src python benchmarks/bench_train.py [--quick] [--recipes fp32 fp8-tensorwise ...] [--no-compile]
        [--compile-recipes all] [--models gpt mlp] [--threads 1] [--steps 16] [--profile [RECIPE]]

``--quick`` (one to two minutes with a warm compile cache): fp32 and fp8-tensorwise plus the baselines, both models
eager, the MLP also compiled (fp8-tensorwise and the baselines), 11-15 timed steps (the median of fewer
moved the GPT's eager fp8/fp32 ratio by up to 0.25 between runs on the shared 2-core machine).  The default run
(every built-in recipe, both models, eager and compiled) takes about 30 minutes on 2 cores with a cold inductor
cache, most of it compiling; ``--recipes`` / ``--compile-recipes`` / ``--no-compile`` narrow it.

One training step is forward + loss + backward + optimizer step (AdamW) + zero_grad, timed on the wall clock on CPU.
Every configuration builds a fresh model from the same seed and runs on one fixed batch:

* models: ``gpt``, a byte-level GPT (256-token embedding and learned positions, 2 pre-LayerNorm blocks of causal
  self-attention with q/k/v/o ``nn.Linear`` and a 4x GELU MLP, final LayerNorm, ``lm_head`` Linear; d_model 128,
  4 heads, seq 64, batch 8), and ``mlp``, 784-512-512-10 with ReLU (``fc1``, ``fc2``, ``head``), batch 256;
* implementations: ``pytorch-fp32`` (the plain model and ``torch.optim.AdamW``), ``torchao-float8``
  (``torchao.float8.convert_to_float8_training``, its default tensorwise recipe, on the same linears that lowprec's
  fp8 recipes convert, i.e. skipping the ``keep_high_precision`` ones such as ``lm_head``) and every requested
  lowprec recipe (``lowprec.convert(model, recipe)`` and ``LowPrecisionOptimizer(AdamW(...), recipe)``);
* modes: ``eager`` and ``compiled`` (``torch.compile(model)``; the optimizer step stays eager).  Dynamo is reset
  before each model's compiled group (its configurations are compiled side by side, each model its own graphs,
  with a recompile limit of 64 for the group).
  Compiling costs tens of seconds per model and recipe on a 2-core CPU with a cold inductor cache; every
  requested recipe is timed compiled unless ``--compile-recipes`` names fewer (skipped configurations are listed
  under ``skipped`` with the reason).  In eager mode the quantizer kernels run as lowprec's backend setting says
  (``--lowprec-backend``; the default "auto" runs tensors under 2^20 elements, i.e. everything here, through the
  eager native kernels); inside ``torch.compile(model)`` the native kernels are opaque operators
  (``torch.ops.lowprec.*``) for every scaled spec and the accumulator, and the rest is traced into the graph.

Compiled configurations are timed one recipe at a time, each with its own PyTorch baseline in the same rounds
(``compiled_groups``: dynamo's guard checks over many models compiled side by side distort the later ones).
Each configuration runs warm-up steps (the first one compiles in compiled mode; its time is reported as
``first_step_s``), then up to ``--steps`` timed steps, stopping early once the timed steps have taken
``--max-config-s`` seconds (at least ``--min-steps`` are always run).  The configurations of one model and mode are
timed interleaved: one step of each per round, in a rotating order, so that load from other processes falls on
all of them alike and the ratios, which compare medians of the same rounds, stay meaningful on a busy machine.
``step_ms`` is the median, ``best_ms`` the minimum.  Ratios compare medians within one mode: ``ratio_to_fp32``
against ``pytorch-fp32`` and ``ratio_to_torchao_float8`` against ``torchao-float8``.

Recipes with an emulated narrow accumulator (``h100-fp8``) run their GEMMs through the accumulator kernel
(``lowprec/quant/_native_accum.c``; an opaque operator inside ``torch.compile``) and are timed like the others.

The ``targets`` section checks, per model and mode, every timed recipe: at most 1.3x the fp32 step, or, for a
recipe with an emulated accumulator, at most 3x the fp8-tensorwise step; and fp8-tensorwise no slower than
torchao's float8 training.  Each check says met or not; the section only reports, it never fails.
``--profile RECIPE`` adds a breakdown of eager steps of that recipe: forward/backward/optimizer split, wall
time inside lowprec's operand quantizer and inside its GEMM, and the top operators from torch.profiler.

Timings on a shared machine are noisy: ``machine.load_average_start/end`` records the load during the run, and
a ``warnings`` entry appears when the load suggests that OpenMP threads compete with other processes (with 2
threads on 2 busy cores, steps can be 10-80x slower than with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lowprec
from lowprec.optim import LowPrecisionOptimizer
from lowprec.runs._manifest import host_info

DEFAULT_RECIPES = ["all"]
"""Every built-in recipe (``lowprec.recipes.names()``), eager and compiled."""
QUICK_RECIPES = ["fp32", "fp8-tensorwise"]
DEFAULT_COMPILE_RECIPES = ["all"]
BASELINES = ["pytorch-fp32", "torchao-float8"]
TARGET_RECIPE = "fp8-tensorwise"
TARGET_MAX_RATIO_TO_FP32 = 1.3
TARGET_MAX_RATIO_TO_TORCHAO = 1.0
TARGET_MAX_ACCUMULATOR_RATIO = 3.0


# --------------------------------------------------------------------------------------------------- models
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def split(y: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, D/H]
            return y.view(b, t, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Byte-level GPT: token + position embeddings, pre-LN blocks, final LayerNorm, untied ``lm_head``."""

    def __init__(self, vocab: int = 256, d_model: int = 128, n_heads: int = 4, n_layers: int = 2,
                 seq_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos_embed = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed(self.positions[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_mlp() -> nn.Module:
    return nn.Sequential(OrderedDict([
        ("fc1", nn.Linear(784, 512)), ("act1", nn.ReLU()),
        ("fc2", nn.Linear(512, 512)), ("act2", nn.ReLU()),
        ("head", nn.Linear(512, 10)),
    ]))


# name -> (model factory, batch factory, loss(model output, target), description)
def _gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (8, 65), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "factory": TinyGPT,
        "batch": _gpt_batch,
        "loss": _lm_loss,
        "description": "byte-level GPT: vocab 256, d_model 128, 4 heads, 2 blocks (q/k/v/o + 128-512-128 GELU MLP, "
                       "pre-LayerNorm), lm_head; seq 64, batch 8",
    },
    "mlp": {
        "factory": make_mlp,
        "batch": _mlp_batch,
        "loss": F.cross_entropy,
        "description": "MLP 784-512-512-10 (fc1, fc2, head), ReLU; batch 256",
    },
}


# --------------------------------------------------------------------------------------------- machine info
def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    try:
        import torchao

        torchao_version = torchao.__version__
    except Exception:  # noqa: BLE001 - any import failure just means "not available"
        torchao_version = None
    return {
        "torch": torch.__version__,
        "torchao": torchao_version,
        **host_info(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "lowprec_backend": lowprec.quant.get_backend(),
        "load_average_start": load_average(),
    }


# ------------------------------------------------------------------------------------------------ one config
def emulates_accumulator(recipe: str) -> bool:
    """Recipes whose GEMMs go through an emulated accumulator (``Accumulator.emulated``)."""
    lin = lowprec.recipes.get(recipe).linear
    return any(g.accumulator.emulated for g in (lin.forward, lin.grad_input, lin.grad_weight))


def torchao_filter() -> Callable[[nn.Module, str], bool]:
    """Convert the same linears as lowprec's fp8 recipes: skip their keep_high_precision patterns."""
    keep = lowprec.recipes.get(TARGET_RECIPE).keep_high_precision

    def fn(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and not any(fnmatch.fnmatchcase(fqn, p) for p in keep)

    return fn


class Step:
    """A model, its optimizer and one fixed batch; ``__call__`` runs one training step."""

    def __init__(self, model_name: str, impl: str, compiled: bool) -> None:
        spec = MODELS[model_name]
        torch.manual_seed(0)
        model: nn.Module = spec["factory"]()
        self.converted: list[str] = []
        if impl == "pytorch-fp32":
            opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif impl == "torchao-float8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=torchao_filter())
            self.converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            lowprec.convert(model, impl)
            self.converted = [n for n, m in model.named_modules() if isinstance(m, lowprec.nn.EmulatedLinear)]
            opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl)
        self.model, self.opt = model, opt
        self.forward = torch.compile(model) if compiled else model
        self.inputs, self.target = spec["batch"]()
        self.loss_fn = spec["loss"]
        self.last_loss = float("nan")

    def phases(self) -> tuple[float, float, float]:
        """One step, returning (forward + loss, backward, optimizer) seconds."""
        t0 = time.perf_counter()
        loss = self.loss_fn(self.forward(self.inputs), self.target)
        t1 = time.perf_counter()
        if isinstance(self.opt, LowPrecisionOptimizer):
            self.opt.scale_loss(loss).backward()
        else:
            loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.last_loss = float(loss.detach())
        return t1 - t0, t2 - t1, t3 - t2

    def __call__(self) -> float:
        return sum(self.phases())


def _result(step: Step, times: list[float], warmup: int, first: float | None, wall: float) -> dict[str, Any]:
    res: dict[str, Any] = {
        "step_ms": round(1e3 * statistics.median(times), 2),
        "best_ms": round(1e3 * min(times), 2),
        "steps": len(times),
        "warmup_steps": warmup,
    }
    if first is not None:
        res["first_step_s"] = round(first, 2)
    res["config_wall_s"] = round(wall, 1)
    res["last_loss"] = round(step.last_loss, 4) if math.isfinite(step.last_loss) else str(step.last_loss)
    if step.converted:
        res["converted_linears"] = len(step.converted)
    return res


def measure_interleaved(model_name: str, impls: list[str], mode: str, *, warmup: int, steps: int,
                        min_steps: int, max_config_s: float) -> dict[str, dict[str, Any]]:
    """Time several configurations of one model and mode in interleaved rounds (one step of each per round, in a
    rotating order), so that load from other processes hits them alike and their ratios stay comparable.

    A configuration that fails records ``{"error": ...}`` and leaves the others running.
    """
    compiled = mode == "compiled"
    if compiled:
        torch._dynamo.reset()
    out: dict[str, dict[str, Any]] = {}
    live: dict[str, Step] = {}
    first: dict[str, float | None] = {}
    wall: dict[str, float] = {}
    for impl in impls:
        print(f"[bench_train] {model_name} {impl} {mode}: build and warm up ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            step = Step(model_name, impl, compiled)
            first[impl] = None
            for i in range(warmup):
                dt = step()
                if i == 0:
                    first[impl] = dt
            live[impl] = step
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the others
            out[impl] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        wall[impl] = time.perf_counter() - t0
    times: dict[str, list[float]] = {impl: [] for impl in live}
    spent: dict[str, float] = {impl: 0.0 for impl in live}

    def wants(impl: str) -> bool:
        n = len(times[impl])
        return n < steps and (n < min_steps or spent[impl] < max_config_s)

    rnd = 0
    while any(wants(i) for i in live):
        order = list(live)
        order = order[rnd % len(order):] + order[: rnd % len(order)]
        for impl in order:
            if impl not in live or not wants(impl):
                continue
            try:
                dt = live[impl]()
            except Exception as e:  # noqa: BLE001
                out[impl] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                del live[impl]
                continue
            times[impl].append(dt)
            spent[impl] += dt
            wall[impl] += dt
        rnd += 1
    for impl, step in live.items():
        out[impl] = _result(step, times[impl], warmup, first[impl], wall[impl])
        print(f"[bench_train]   {impl} -> {out[impl]}", file=sys.stderr, flush=True)
    return {impl: out[impl] for impl in impls}


# ------------------------------------------------------------------------------------------------- profile
def time_parts(step: Step, steps: int) -> dict[str, Any]:
    """Wall time per step inside lowprec's operand quantizer and its GEMM, measured by wrapping the two functions
    that ``EmulatedLinear`` calls (``lowprec.nn._linear.fake_quantize_tensors`` / ``accumulate_matmul``)."""
    import lowprec.nn._linear as lin_mod

    acc: dict[str, float] = {"quantize": 0.0, "gemm": 0.0, "quantize_calls": 0, "quantized_elements": 0}
    originals = {"fake_quantize_tensors": lin_mod.fake_quantize_tensors, "accumulate_matmul": lin_mod.accumulate_matmul}

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            acc[key] += time.perf_counter() - t0
            if key == "quantize":
                acc["quantize_calls"] += 1
                acc["quantized_elements"] += a[0].numel()
            return out

        return wrapper

    lin_mod.fake_quantize_tensors = timed(originals["fake_quantize_tensors"], "quantize")  # type: ignore[assignment]
    lin_mod.accumulate_matmul = timed(originals["accumulate_matmul"], "gemm")  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
    finally:
        lin_mod.fake_quantize_tensors = originals["fake_quantize_tensors"]  # type: ignore[assignment]
        lin_mod.accumulate_matmul = originals["accumulate_matmul"]  # type: ignore[assignment]
    q, g = acc["quantize"] / steps, acc["gemm"] / steps
    n = acc["quantized_elements"] / steps
    return {
        "step": round(1e3 * total / steps, 2),
        "operand_quantization": round(1e3 * q, 2),
        "gemm": round(1e3 * g, 2),
        "everything_else": round(1e3 * (total / steps - q - g), 2),
        "quantize_calls_per_step": int(acc["quantize_calls"] // steps),
        "quantized_elements_per_step": int(n),
        "quantize_ns_per_element": round(1e9 * q / n, 2) if n else None,
    }


def profile_recipe(model_name: str, recipe: str, steps: int) -> dict[str, Any]:
    """Eager steps of ``recipe`` under torch.profiler: phase split and the operators that take the time."""
    from torch.profiler import ProfilerActivity, profile

    step = Step(model_name, recipe, compiled=False)
    step()
    step()
    split = [step.phases() for _ in range(steps)]
    parts = time_parts(step, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    gemm_ops = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_scaled_mm", "aten::linear"}
    gemm = sum(e.self_cpu_time_total for e in events if e.key in gemm_ops)
    aten = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    top = [
        {
            "op": e.key,
            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls_per_step": e.count // steps,
        }
        for e in rows[:15]
    ]
    n_aten_calls = sum(e.count for e in events if e.key.startswith("aten::")) // steps
    return {
        "model": model_name,
        "recipe": recipe,
        "mode": "eager",
        "steps": steps,
        "phase_ms_median": {
            name: round(1e3 * statistics.median(s[i] for s in split), 2)
            for i, name in enumerate(("forward_and_loss", "backward", "optimizer"))
        },
        "time_split_ms_per_step": parts,
        "profiled_self_cpu_ms_per_step": round(total / 1e3 / steps, 2),
        "gemm_share": round(gemm / total, 3),
        "non_gemm_aten_share": round((aten - gemm) / total, 3),
        "aten_calls_per_step": n_aten_calls,
        "top_ops": top,
    }


# ---------------------------------------------------------------------------------------------- assembling
_RATIOS = (("ratio_to_fp32", "pytorch-fp32"), ("ratio_to_torchao_float8", "torchao-float8"))


def compiled_groups(group: list[str]) -> list[list[str]]:
    """Compiled configurations are timed one recipe at a time with its own baselines (PyTorch fp32; torchao for
    fp8-tensorwise), dynamo reset before each group.  With every model of a run compiled side by side in one
    process, the guard checks over the cache entries of the code objects they share (the models' and the
    linears' ``forward``) added milliseconds per step to the configurations compiled last: lowprec's plain fp32
    recipe measured 1.24x of PyTorch's compiled GPT step side by side, 0.90x in a group of its own."""
    recipes = [i for i in group if i not in BASELINES]
    base = [i for i in BASELINES if i in group]
    if not recipes:
        return [base] if base else []
    subs = [[b for b in base if b == "pytorch-fp32" or r == TARGET_RECIPE] + [r] for r in recipes]
    if "torchao-float8" in base and TARGET_RECIPE not in recipes:
        subs[0].insert(1, "torchao-float8")
    return subs


def group_ratios(res: dict[str, dict[str, Any]]) -> None:
    """Ratios of a group's recipe against the baselines timed in the same rounds (kept by ``add_ratios``)."""
    for impl, r in res.items():
        if impl in BASELINES or "step_ms" not in r:
            continue
        for key, base in _RATIOS:
            ref = res.get(base, {}).get("step_ms")
            if ref:
                r[key] = round(r["step_ms"] / ref, 3)
                r[f"{base}_step_ms_same_rounds"] = ref


def add_ratios(results: dict[str, Any]) -> None:
    for by_impl in results.values():
        for impl, by_mode in by_impl.items():
            for mode, res in by_mode.items():
                if "step_ms" not in res:
                    continue
                for key, base in _RATIOS:
                    ref = by_impl.get(base, {}).get(mode, {}).get("step_ms")
                    if ref and impl != base and key not in res:
                        res[key] = round(res["step_ms"] / ref, 3)


def evaluate_targets(results: dict[str, Any]) -> dict[str, Any]:
    """Every timed recipe against its target, per model and mode (see the module docstring)."""
    out: dict[str, Any] = {
        "max_ratio_to_fp32": TARGET_MAX_RATIO_TO_FP32,
        "accumulator_max_ratio_to_fp8_tensorwise": TARGET_MAX_ACCUMULATOR_RATIO,
        "fp8_tensorwise_max_ratio_to_torchao_float8": TARGET_MAX_RATIO_TO_TORCHAO,
        "checks": {},
    }
    for model_name, by_impl in results.items():
        for impl, by_mode in by_impl.items():
            if impl in BASELINES:
                continue
            for mode, res in by_mode.items():
                if "step_ms" not in res:
                    continue
                if emulates_accumulator(impl):  # against fp8-tensorwise: the two ratios to fp32 (each its own rounds)
                    ref = by_impl.get(TARGET_RECIPE, {}).get(mode, {}).get("ratio_to_fp32")
                    own = res.get("ratio_to_fp32")
                    ratio = round(own / ref, 3) if ref and own else None
                    check = {"against": TARGET_RECIPE, "ratio": ratio, "limit": TARGET_MAX_ACCUMULATOR_RATIO}
                else:
                    check = {"against": "pytorch-fp32", "ratio": res.get("ratio_to_fp32"),
                             "limit": TARGET_MAX_RATIO_TO_FP32}
                check["met"] = check["ratio"] is not None and check["ratio"] <= check["limit"]
                out["checks"][f"{model_name}/{mode}/{impl}"] = check
                if impl == TARGET_RECIPE and "torchao-float8" in by_impl:
                    rao = res.get("ratio_to_torchao_float8")
                    out["checks"][f"{model_name}/{mode}/{impl}/torchao"] = {
                        "against": "torchao-float8", "ratio": rao, "limit": TARGET_MAX_RATIO_TO_TORCHAO,
                        "met": rao is not None and rao <= TARGET_MAX_RATIO_TO_TORCHAO}
    checks = out["checks"].values()
    out["met_count"] = sum(c["met"] for c in checks)
    out["checked"] = len(out["checks"])
    out["missed"] = [k for k, c in out["checks"].items() if not c["met"]]
    out["met"] = bool(out["checks"]) and not out["missed"]
    return out


def markdown_table(report: dict[str, Any]) -> str:
    """The README's table from a report: per recipe, the ratio to the fp32 step per model and mode (for an emulated
    accumulator, also the ratio to fp8-tensorwise), a cell marked with * where its target is missed."""
    checks = report["targets"]["checks"]
    cols = [(m, mode) for m in report["results"] for mode in report["config"]["modes"]]
    head = " | ".join(f"{m.upper()} {mode}" for m, mode in cols)
    lines = [f"| recipe | {head} |", "|---|" + "---|" * len(cols)]
    recipes = [r for r in next(iter(report["results"].values())) if r not in BASELINES]
    for r in recipes:
        cells = []
        for m, mode in cols:
            res = report["results"][m].get(r, {}).get(mode, {})
            c = checks.get(f"{m}/{mode}/{r}")
            if "ratio_to_fp32" not in res:
                cells.append("-")
                continue
            cell = f"{res['ratio_to_fp32']:.2f}x"
            if c is not None and c["against"] != "pytorch-fp32":
                cell += f" ({c['ratio']:.2f}x {c['against']})"
            cells.append(cell + ("" if c is None or c["met"] else " *"))
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings and library chatter on stdout (stdout carries only the JSON)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        yield


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"about a minute: recipes {' '.join(QUICK_RECIPES)}, 5-7 timed steps, 2 s per config")
    p.add_argument("--recipes", nargs="+", metavar="RECIPE",
                   help="lowprec recipes to time (default: all, every built-in recipe)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--no-compile", action="store_true", help="eager mode only")
    p.add_argument("--compile-recipes", nargs="+", metavar="RECIPE",
                   help="recipes also timed compiled (default and 'all': every requested recipe)")
    p.add_argument("--compile-models", nargs="+", choices=list(MODELS),
                   help="models also timed compiled (default: all; --quick: mlp)")
    p.add_argument("--lowprec-backend", choices=("auto", "eager", "compiled"), default=None,
                   help="lowprec.quant.set_backend for the quantizer kernels (default: the library's, 'auto')")
    p.add_argument("--no-eager", action="store_true", help="compiled mode only")
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao Float8Linear baseline")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per config (the first one compiles)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per config (at most)")
    p.add_argument("--min-steps", type=int, default=3, help="timed steps per config (at least)")
    p.add_argument("--max-config-s", type=float, default=6.0,
                   help="stop timing a config once its timed steps took this long (and --min-steps ran)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's choice; 1 gives steadier numbers on a loaded machine)")
    p.add_argument("--profile", metavar="RECIPE", nargs="?", const=TARGET_RECIPE,
                   help=f"add a torch.profiler breakdown of eager steps of RECIPE (default {TARGET_RECIPE})")
    p.add_argument("--profile-model", choices=list(MODELS), default="mlp")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--table", metavar="REPORT_JSON", help="print the README's markdown table of a saved report")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.min_steps, args.max_config_s = 15, 11, 4.0
        args.warmup = min(args.warmup, 2)
        if args.recipes is None:
            args.recipes = QUICK_RECIPES
        if args.compile_recipes is None:
            args.compile_recipes = [TARGET_RECIPE]
        if args.compile_models is None:
            args.compile_models = ["mlp"]
    if args.recipes is None:
        args.recipes = DEFAULT_RECIPES
    if args.recipes == ["all"]:
        args.recipes = lowprec.recipes.names()
    if args.compile_recipes is None:
        args.compile_recipes = DEFAULT_COMPILE_RECIPES
    if args.compile_recipes == ["all"]:
        args.compile_recipes = list(args.recipes)
    if args.compile_models is None:
        args.compile_models = list(MODELS)
    valid = lowprec.recipes.names()
    bad = [r for r in args.recipes + args.compile_recipes if r not in valid]
    if bad:
        p.error(f"unknown recipe(s) {bad}; valid: {', '.join(valid)}")
    if args.no_compile and args.no_eager:
        p.error("--no-compile and --no-eager leave nothing to run")
    if args.min_steps < 1 or args.steps < args.min_steps:
        p.error("need 1 <= --min-steps <= --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_table(json.load(f)))
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.lowprec_backend is not None:
        lowprec.quant.set_backend(args.lowprec_backend)
    t_start = time.perf_counter()
    modes = [m for m, off in (("eager", args.no_eager), ("compiled", args.no_compile)) if not off]
    impls = ["pytorch-fp32"] + ([] if args.no_torchao else ["torchao-float8"]) + list(args.recipes)
    info = machine_info()
    results: dict[str, Any] = {}
    skipped: list[dict[str, str]] = []
    with quiet():
        for model_name in args.models:
            results[model_name] = {impl: {} for impl in impls}
            for mode in modes:
                group: list[str] = []
                for impl in impls:
                    reason = None
                    if mode == "compiled" and model_name not in args.compile_models:
                        reason = "model not in --compile-models"
                    elif mode == "compiled" and impl not in BASELINES and impl not in args.compile_recipes:
                        reason = "recipe not in --compile-recipes (compiling costs minutes per recipe on CPU)"
                    if reason:
                        skipped.append({"model": model_name, "impl": impl, "mode": mode, "reason": reason})
                    else:
                        group.append(impl)
                for sub in (compiled_groups(group) if mode == "compiled" else [group] if group else []):
                    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
                        res = measure_interleaved(model_name, sub, mode, warmup=args.warmup, steps=args.steps,
                                                  min_steps=args.min_steps, max_config_s=args.max_config_s)
                    if len(sub) < len(group):  # a recipe's own group: its ratios against this group's baselines
                        group_ratios(res)
                    for impl, r in res.items():
                        results[model_name][impl].setdefault(mode, r)  # a baseline: its first group's timing
            for impl in impls:
                if not results[model_name][impl]:
                    del results[model_name][impl]
        add_ratios(results)
        profile = None
        if args.profile:
            print(f"[bench_train] profiling {args.profile} on {args.profile_model} ...", file=sys.stderr, flush=True)
            try:
                profile = profile_recipe(args.profile_model, args.profile, args.profile_steps)
            except Exception as e:  # noqa: BLE001 - the timings above are still worth printing
                profile = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    info["load_average_end"] = load_average()
    report: dict[str, Any] = {
        "machine": info,
        "config": {
            "models": {m: MODELS[m]["description"] for m in args.models},
            "implementations": impls,
            "modes": modes,
            "compile_recipes": args.compile_recipes if "compiled" in modes else [],
            "compile_models": args.compile_models if "compiled" in modes else [],
            "optimizer": "torch.optim.AdamW(lr=1e-3); lowprec recipes wrapped in LowPrecisionOptimizer",
            "step": "forward + cross-entropy + backward + optimizer.step + zero_grad, one fixed batch",
            "warmup": args.warmup,
            "steps": args.steps,
            "min_steps": args.min_steps,
            "max_config_s": args.max_config_s,
            "timing": "step_ms = median, best_ms = min of the timed steps (wall clock); ratios use medians, same mode",
            "last_loss": "loss of the last step run (a sanity check; it depends on how many steps a config ran)",
            "torchao_converts": "the linears lowprec's fp8 recipes convert (keep_high_precision skipped)",
            "quick": args.quick,
        },
        "results": results,
        "skipped": skipped,
        "targets": evaluate_targets(results),
        "total_wall_s": round(time.perf_counter() - t_start, 1),
    }
    warnings_out = []
    load, ncpu = info["load_average_start"], info["cpu_affinity"] or info["cpu_count"] or 1
    if load and load[0] > max(ncpu - 1, 0.5) and info["torch_num_threads"] > 1:
        warnings_out.append(
            f"load average {load[0]} at start on {ncpu} CPUs: other processes compete for the cores, and OpenMP "
            f"with {info['torch_num_threads']} threads can then be many times slower and very noisy; "
            "rerun with --threads 1 for steadier numbers")
    if warnings_out:
        report["warnings"] = warnings_out
    if profile is not None:
        report["profile"] = profile
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
