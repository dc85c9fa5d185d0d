"""``lowprec ptq``: post-training quantization of a stored run's trained model, judged against it.

``lowprec ptq --run RUN_ID --scheme w8a8-int8`` loads the run's final checkpoint as a float32 model
(``runs._trained.load_trained``), calibrates and quantizes it (``lowprec.inference.quantize_model``, ``--algorithm``
max / percentile / mse / gptq / awq / smoothquant) on the task's training batches right after the run's last step
(``--calibration-batches``), judges it against the float32 model on the next ``--batches`` batches
(``judge_inference``, default ``InferenceCriteria`` or ``--criteria FILE.json``; ``--bf16`` adds the three-way
criterion ``bf16_ratio``), records the verdict in the run store (group ``inference``), and with ``--out DIR``
saves the compressed-tensors checkpoint.  Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE (2: a usage error).  Bad
input (an unknown scheme, a scheme that does not fit the model, a bad criteria file) fails before any model runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .._errors import UsageError
from ._runs import add_store_arg, open_store, store_path


def _scheme(value: str) -> Any:
    from .. import inference

    path = Path(value)
    if value in inference.names():
        return inference.get(value)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise UsageError(f"--scheme: no such file {value!r}")
        text = path.read_text()
        return inference.Scheme.from_toml(text) if path.suffix == ".toml" else inference.Scheme.from_json(text)
    raise UsageError(f"--scheme must be a preset ({', '.join(inference.names())}) or a .toml/.json scheme file; "
                     f"got {value!r}")


def _criteria(args: argparse.Namespace) -> Any:
    from ..inference import InferenceCriteria

    if args.criteria:
        path = Path(args.criteria)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise UsageError(f"--criteria: cannot read {args.criteria!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"--criteria: {args.criteria!r} is not JSON: {e}") from None
        crit = InferenceCriteria.from_dict(data)
    else:
        crit = InferenceCriteria()
    if args.bf16 and crit.bf16_ratio is None:
        import dataclasses

        crit = dataclasses.replace(crit, bf16_ratio=args.bf16_ratio)
    return crit


def _options(pairs: list[str] | None) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs; VALUE is JSON (``0.8``, ``true``, ``64``) or else a plain string."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise UsageError(f"--option {pair!r}: expected KEY=VALUE, e.g. --option alpha=0.8 or --option fold=true")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def cmd_ptq(args: argparse.Namespace) -> int:
    import copy

    from .. import inference
    from ..runs._trained import eval_batches, load_trained

    for flag in ("calibration_batches", "batches"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    scheme = _scheme(args.scheme)
    criteria = _criteria(args)
    options = _options(args.option)
    if args.out:
        from ..inference._checkpoint import check_savable

        try:
            check_savable(scheme, args.algorithm, options)
        except UsageError as e:
            raise UsageError(f"--out: {e}") from None
    store = open_store(store_path(args), create=False)
    with store:
        cal = load_trained(store, args.run)
        model = cal.model.eval()
        inference.plan(model, scheme)  # the scheme fits the model, before any calibration
        batches = eval_batches(cal, args.calibration_batches + args.batches)
        calib, held = batches[:args.calibration_batches], batches[args.calibration_batches:]
        quantized = inference.quantize_model(copy.deepcopy(model), scheme, calib, algorithm=args.algorithm,
                                             options=options or None)
        verdict = inference.judge_inference(model, quantized, held, criteria, bf16="auto" if args.bf16 else None,
                                            reference_name=f"{cal.task.name} run {cal.run_id} fp32",
                                            candidate_name=f"{scheme.name} ({args.algorithm})")
        rid = inference.record_verdict(store, verdict, scheme=scheme, extra={
            "algorithm": args.algorithm, "source_run": cal.run_id, "calibration_batches": args.calibration_batches,
            "batches": args.batches})
    if args.out:
        inference.save_quantized(quantized, scheme, args.out)
    if args.report:
        inference.write_inference_report(args.report, [verdict])
    if args.json:
        print(json.dumps({"run_id": rid, "verdict": verdict.to_dict(), "checkpoint": args.out}, indent=2))
    else:
        print(verdict.format_table())
        print(f"recorded as run {rid} (group inference)" + (f"; checkpoint {args.out}" if args.out else ""))
    return verdict.exit_code


ALGORITHM_CHOICES: tuple[str, ...] = ("max", "percentile", "mse", "gptq", "awq", "smoothquant")
"""The ``--algorithm`` choices, spelled out so that building the parser imports no torch (tests check they equal
``inference._calibrate.ALGORITHMS + inference._algorithms.WEIGHT_ALGORITHMS``)."""


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("ptq", help="quantize a stored run's trained model for inference and judge it")
    p.add_argument("--run", required=True, metavar="RUN_ID", help="the trained run (its final checkpoint)")
    p.add_argument("--scheme", required=True, metavar="NAME|FILE",
                   help="a preset (w8a8-int8, fp8-dynamic, ...) or a scheme .toml/.json")
    p.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="max",
                   help="calibration algorithm (default max)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="an option of the algorithm, repeatable: gptq damp/block_size/act_order/static_groups, awq "
                        "n_grid/fold, smoothquant alpha/fold (e.g. --option fold=true)")
    p.add_argument("--calibration-batches", type=int, default=4, metavar="N", help="calibration batches (default 4)")
    p.add_argument("--batches", type=int, default=8, metavar="N", help="held-out batches judged (default 8)")
    p.add_argument("--criteria", metavar="FILE.json", help="InferenceCriteria fields as JSON (default: defaults)")
    p.add_argument("--bf16", action="store_true", help="three-way mode: also judge against a bf16 copy")
    p.add_argument("--bf16-ratio", type=float, default=1.0,
                   help="with --bf16 and no bf16_ratio in --criteria: the largest KL ratio to bf16 (default 1.0)")
    p.add_argument("--out", metavar="DIR", help="save the compressed-tensors checkpoint here")
    p.add_argument("--report", metavar="FILE.html", help="write the HTML report")
    p.add_argument("--json", action="store_true", help="print JSON instead of the verdict table")
    add_store_arg(p)
    p.set_defaults(func=cmd_ptq)
