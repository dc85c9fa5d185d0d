"""CLI commands for precision analysis: ``sensitivity`` and ``autoprecision``.

Both start from a *trained* float32 model: a calibration run of the config with the float32 recipe (the config's
steps, or ``--calib-steps``; the config's own recipe is not used), recorded in the run store like any other run
(group ``calibration/<model>``), or an earlier run named with ``--run``.  The evaluation batches are the task's
training batches of the ``--batches`` steps right after the calibration run's last step (a pure function of seed
and step, so the same every time).  Results are stored as events of the calibration run (kinds ``sensitivity``
and ``autoprecision``), so ``lowprec runs show RUN`` lists them.

``--metric probe`` adds the training probe (``lowprec.numerics.training_probe``): one training run per (layer
group, spec, probe seed) with only that group quantized, plus one float32 run per probe seed, recorded in group
``probe/<model>``; seeds are the calibration seed and the next ``--probe-seeds`` - 1.  The calibration, model
loading and probe helpers live in ``runs/_trained.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .._errors import UsageError
from .._parse import parse_toml
from ..runs._config import load
from ..runs._trained import Calibrated, calibrate, eval_batches, load_trained, probe_trainer
from ._runs import add_store_arg, open_store, store_path

DEFAULT_CANDIDATES = "mxfp4,mxfp6_e2m3,mxfp8_e4m3,bf16"


def _probe(args: argparse.Namespace, store: Any, cal: Calibrated, table: list[Any]) -> list[Any]:
    """The table with probe deltas when ``--metric probe`` (seeds from the calibration seed on)."""
    if args.metric != "probe":
        return table
    from ..numerics._autoprecision import training_probe

    if cal.config is None:
        raise UsageError("the training probe needs the run config of the calibration run")
    config = dataclasses.replace(cal.config, store=store.location)
    if config.parallel.strategy != "single":
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, strategy="single",
                                                                           world_size=1, mesh_shape=None))
    trainer = probe_trainer(config, store=store, steps=args.probe_steps, progress=not args.quiet)
    return training_probe(table, trainer, seeds=[cal.seed + i for i in range(args.probe_seeds)])


def _group_by(value: str) -> str | int:
    if value.isdigit():
        return int(value)
    return value


def _prepare(args: argparse.Namespace) -> tuple[Any, Calibrated]:
    if args.batches < 1:
        raise UsageError(f"--batches must be >= 1; got {args.batches}")
    if args.calib_steps is not None and args.calib_steps < 1:
        raise UsageError(f"--calib-steps must be >= 1; got {args.calib_steps}")
    if args.probe_steps is not None and args.probe_steps < 1:
        raise UsageError(f"--probe-steps must be >= 1; got {args.probe_steps}")
    if args.probe_seeds < 1:
        raise UsageError(f"--probe-seeds must be >= 1; got {args.probe_seeds}")
    from ..numerics._sensitivity import group_layers

    try:
        group_layers([], _group_by(args.group_by))  # validates --group-by before any training
    except ValueError as e:
        raise UsageError(f"--group-by: {e}") from None
    if args.run:
        store = open_store(store_path(args), create=False)
        return store, load_trained(store, args.run)
    if not args.config:
        raise UsageError("give a CONFIG.toml to calibrate on (or --run RUN_ID of a trained run)")
    config = load(args.config)
    if config.parallel.strategy != "single":
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, strategy="single",
                                                                           world_size=1, mesh_shape=None))
    store = open_store(store_path(args, config))
    seed = args.seed if args.seed is not None else config.seeds[0]
    cal = calibrate(dataclasses.replace(config, store=store.location), store=store, seed=seed,
                    steps=args.calib_steps, progress=not args.quiet)
    return store, cal


def _fmt(v: float, spec: str = ".2f") -> str:
    return format(v, spec) if math.isfinite(v) else repr(v)


def cmd_sensitivity(args: argparse.Namespace) -> int:
    from ..numerics._sensitivity import layer_sensitivity, ranked, resolve_candidate

    resolve_candidate(args.spec)  # a bad --spec fails before training
    store, cal = _prepare(args)
    with store:
        rows = layer_sensitivity(cal.model, eval_batches(cal, args.batches), cal.task.loss_fn, args.spec,
                                 groups=_group_by(args.group_by))
        rows = ranked(_probe(args, store, cal, rows), args.metric)
        payload = {"spec": args.spec, "group_by": args.group_by, "batches": args.batches, "metric": args.metric,
                   **_probe_info(args), "rows": [r.to_dict() for r in rows]}
        store.add_event(cal.run_id, step=cal.steps, kind="sensitivity", payload=payload)
    if args.json:
        print(json.dumps({"run_id": cal.run_id, **payload}, indent=2))
        return 0
    print(f"sensitivity to {args.spec} of {cal.task.name} (float32 run {cal.run_id}, {cal.steps} steps, seed "
          f"{cal.seed}; {args.batches} evaluation batches), most sensitive first")
    probe = args.metric == "probe"
    print(f"{'rank':>4}  {'group':<28}{'modules':>8}{'params':>10}{'SQNR dB':>10}{'loss delta':>13}"
          + (f"{'probe delta':>13}" if probe else ""))
    for i, r in enumerate(rows, 1):
        print(f"{i:>4}  {r.name:<28}{len(r.modules):>8}{r.params:>10}{_fmt(r.sqnr_db):>10}"
              f"{_fmt(r.loss_delta, '+.3g'):>13}" + (f"{_fmt(r.probe_delta, '+.3g'):>13}" if probe else ""))
    print(f"stored as event 'sensitivity' of run {cal.run_id}")
    return 0


def _write_outputs(args: argparse.Namespace, recipe: Any) -> list[str]:
    from ..recipes._serial import dict_to_toml

    written = []
    if args.out:
        out = Path(args.out)
        out.write_text(recipe.to_json() + "\n" if out.suffix == ".json" else recipe.to_toml(), encoding="utf-8")
        written.append(str(out))
    if args.config_out:
        if not args.config:
            raise UsageError("--config-out copies CONFIG.toml with the chosen recipe: give a CONFIG.toml")
        data = parse_toml(Path(args.config).read_text(encoding="utf-8"), where=str(args.config))
        data.pop("recipe", None)
        data["recipe"] = recipe.to_dict()
        Path(args.config_out).write_text(dict_to_toml(data), encoding="utf-8")
        written.append(str(args.config_out))
    return written


def cmd_autoprecision(args: argparse.Namespace) -> int:
    from ..numerics._autoprecision import check_budget, choose_precision, plan_table
    from ..numerics._sensitivity import resolve_candidate, sensitivity_table

    labels = [resolve_candidate(c.strip())[0] for c in args.candidates.split(",") if c.strip()]
    if args.budget_bits <= 0 or not math.isfinite(args.budget_bits):
        raise UsageError(f"--budget-bits must be a positive number; got {args.budget_bits}")
    check_budget(args.budget_bits, labels)  # before calibration: no model fits a budget below every candidate
    for path, suffixes in ((args.out, (".toml", ".json")), (args.config_out, (".toml",))):
        if path and Path(path).suffix not in suffixes:
            raise UsageError(f"{path!r} must end in {' or '.join(suffixes)}")
    store, cal = _prepare(args)
    with store:
        table = sensitivity_table(cal.model, eval_batches(cal, args.batches), cal.task.loss_fn, labels,
                                  groups=_group_by(args.group_by))
        table = _probe(args, store, cal, table)
        plan = choose_precision(table, budget_bits=args.budget_bits, metric=args.metric)
        recipe = plan.to_recipe(name=args.name)
        store.add_event(cal.run_id, step=cal.steps, kind="autoprecision",
                        payload={"candidates": labels, "group_by": args.group_by, "batches": args.batches,
                                 "metric": args.metric, **_probe_info(args), "plan": plan.to_dict(),
                                 "table": [r.to_dict() for r in table], "recipe": recipe.to_dict()})
    print(f"autoprecision for {cal.task.name} (float32 run {cal.run_id}, {cal.steps} steps): budget "
          f"{args.budget_bits:g} bits per weight element, candidates {', '.join(labels)}")
    probe = args.metric == "probe"
    print(f"  {'group':<28}{'spec':<14}{'params':>10}{'bits':>8}{'SQNR dB':>10}"
          + (f"{'probe delta':>13}" if probe else ""))
    for row in plan_table(plan, table):
        print(f"  {row['group']:<28}{row['spec']:<14}{row['params']:>10}{row['bits']:>8.3f}"
              f"{_fmt(row['sqnr_db']):>10}" + (f"{_fmt(row['probe_delta'], '+.3g'):>13}" if probe else ""))
    print(f"average {plan.average_bits:.4f} bits per weight element; predicted output SQNR "
          f"{_fmt(plan.predicted_sqnr_db)} dB" + (f", predicted probe loss change {plan.predicted_loss_delta:+.4g}"
                                                 if probe else "")
          + f" ({'exact optimum' if plan.exact else 'greedy'}, minimising {args.metric})")
    for path in _write_outputs(args, recipe):
        print(f"wrote {path}")
    print(f"stored as event 'autoprecision' of run {cal.run_id}")
    return 0


def _probe_info(args: argparse.Namespace) -> dict[str, Any]:
    return {"probe_steps": args.probe_steps, "probe_seeds": args.probe_seeds} if args.metric == "probe" else {}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", metavar="CONFIG.toml", help="run config to calibrate (trained in float32)")
    p.add_argument("--run", metavar="RUN_ID", help="analyse this stored run's final model instead of training")
    p.add_argument("--calib-steps", type=int, metavar="N", help="calibration steps (default: the config's)")
    p.add_argument("--seed", type=int, help="calibration seed (default: the config's first)")
    p.add_argument("--batches", type=int, default=4, metavar="N", help="evaluation batches (default 4)")
    p.add_argument("--group-by", default="layer", metavar="HOW",
                   help="layer (default), block (name up to its first number, e.g. blocks.0), or a name depth")
    p.add_argument("--metric", choices=("sqnr", "probe"), default="sqnr",
                   help="sqnr (default): forward output SQNR of the trained model, no training; probe: also train "
                        "one run per (layer group, spec, probe seed) from initialisation with only that group "
                        "quantized as in training (backward GEMMs too) and use the final eval loss change")
    p.add_argument("--probe-steps", type=int, metavar="N", help="steps of each probe run (default: the config's)")
    p.add_argument("--probe-seeds", type=int, default=1, metavar="N",
                   help="probe seeds: the calibration seed and the next N-1 (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_store_arg(p)


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("sensitivity", help="quantize one layer (group) at a time; rank by output SQNR and loss")
    _common(s)
    s.add_argument("--spec", required=True, help="spec to apply (mxfp4, nvfp4, mxfp6_e2m3, bf16, ...)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_sensitivity)

    a = sub.add_parser("autoprecision", help="choose a format per layer under an average-bits budget")
    _common(a)
    a.add_argument("--budget-bits", type=float, required=True, metavar="B",
                   help="average bits per weight element, scales included (mxfp4 = 4.25)")
    a.add_argument("--candidates", default=DEFAULT_CANDIDATES, help=f"comma-separated (default {DEFAULT_CANDIDATES})")
    a.add_argument("--name", default="autoprecision", help="name of the written recipe")
    a.add_argument("--out", metavar="RECIPE.toml|.json", help="write the recipe (TOML or JSON by suffix)")
    a.add_argument("--config-out", metavar="RUN.toml", help="write CONFIG.toml with the recipe as its [recipe] table")
    a.set_defaults(func=cmd_autoprecision)
