"""CLI commands for runs: ``run``, ``runs list|show|export|import``.  Each builds library objects and calls the
library."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from .._errors import UsageError
from ..runs._config import DEFAULT_STORE, RunConfig, check_declared, load

MLFLOW_DIR = "mlruns"
"""Default tracking folder of ``runs export --format mlflow`` (MLflow's own default)."""
TB_LOGDIR = "tb"
"""Default TensorBoard logdir of ``runs export --format tensorboard``: each run goes in ``tb/<run id>/``."""


def store_path(args: argparse.Namespace, config: RunConfig | None = None) -> str:
    """--store, else $LOWPREC_STORE, else the config's store, else ./lowprec-runs/runs.db."""
    if getattr(args, "store", None):
        return str(args.store)
    if os.environ.get("LOWPREC_STORE"):
        return os.environ["LOWPREC_STORE"]
    return config.store if config is not None else DEFAULT_STORE


def open_store(path: str, *, create: bool = True) -> Any:
    """The run store at ``path``.  Reading commands pass ``create=False``: a missing store (a mistyped --store) is
    an error naming the path, not a new empty store; commands that record runs create it."""
    from ..runs._store import RunStore

    return RunStore(path, create=create)


def recipe_arg(ref: str) -> Any:
    """The ``Recipe`` of ``--recipe REF``: a built-in name (``lowprec recipes``), or a recipe file: TOML, or JSON for
    ``*.json`` (what ``lowprec autoprecision --out`` and ``lowprec recipes --show`` write), or a run config with a
    ``[recipe]`` table or ``recipe = "NAME"`` (what ``autoprecision --config-out`` writes): its recipe is taken."""
    from .. import recipes
    from .._parse import parse_json, parse_toml

    if recipes.is_named(ref):
        return recipes.get(ref)
    p = Path(ref)
    if not p.is_file():
        if p.suffix.lower() in (".toml", ".json") or os.sep in ref:
            raise UsageError(f"--recipe {ref!r}: no such recipe file")
        raise UsageError(f"--recipe {ref!r} is neither a recipe name ({', '.join(recipes.names())}, each also "
                         "as NAME+attn) nor a recipe "
                         "file (RECIPE.toml or .json, e.g. what lowprec autoprecision --out writes)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--recipe: cannot read recipe file {ref!r}: {e}") from None
    where = f"recipe file {ref!r}"
    data = parse_json(text, where=where) if p.suffix.lower() == ".json" else parse_toml(text, where=where)
    if isinstance(data, dict) and "model" in data and "recipe" in data:  # a run config: take its recipe
        data, where = data["recipe"], f"{where} (its [recipe] table)"
        if isinstance(data, str):
            return recipes.get(data)
    try:
        return recipes.Recipe.from_dict(data)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None


def config_with_overrides(args: argparse.Namespace, *, apply_seeds: bool = True) -> RunConfig:
    """The config file, with the command line's --seeds (a list, unless ``apply_seeds`` is false: ``baseline``
    applies its own)/--steps/--recipe/--store applied, checked as a declared config (``check_declared``)."""
    config = load(args.config)
    changes: dict[str, Any] = {}
    if apply_seeds and getattr(args, "seeds", None) is not None:
        changes["seeds"] = tuple(args.seeds)
    if getattr(args, "steps", None) is not None:
        changes["steps"] = args.steps
    if getattr(args, "recipe", None):
        changes["recipe"] = recipe_arg(args.recipe)
    changes["store"] = store_path(args, config)
    try:
        config = dataclasses.replace(config, **changes)
        check_declared(config)
    except ValueError as e:
        raise UsageError(f"command line: {e}") from None
    return config


def _resume_command(run_id: str, store: Any) -> str:
    """The command that continues ``run_id``: ``--store`` is named unless it is where a bare command looks."""
    default = os.environ.get("LOWPREC_STORE") or DEFAULT_STORE
    same = default == store.location or (store.path is not None and os.path.abspath(default) == str(store.path))
    return f"lowprec run --resume {run_id}" + ("" if same else f" --store {shlex.quote(store.where)}")


def _is_interrupt(e: BaseException) -> bool:
    """Ctrl-C, SIGTERM/SIGHUP (``cli.Terminated``), or a data-parallel run whose launcher forwarded one."""
    from ..runs._launch import RunFailed

    if isinstance(e, KeyboardInterrupt) or type(e).__name__ == "Terminated":
        return True
    return isinstance(e, RunFailed) and "interrupted by" in str(e)


def _interrupted_run(store: Any, before: set[str], e: BaseException) -> str | None:
    """The run this command was training when ``e`` stopped it: the id a data-parallel launcher names in its
    error, else the one run, not in the store before the command and not completed, that this process created
    (seeds train one after another, so at most one; the store records each run's creating pid)."""
    m = re.match(r"run ([0-9a-f]{12}) failed", str(e))
    if m:
        return m.group(1)
    try:
        mine = [r for r in store.list_runs(verify=False) if r.run_id not in before
                and r.status not in ("completed", "diverged")
                and r.pid == os.getpid() and r.hostname == socket.gethostname()]
    except Exception:  # the hint is a courtesy: never hide the interrupt behind a store error
        return None
    return mine[0].run_id if len(mine) == 1 else None


def _with_resume_hint(e: BaseException, run_id: str | None, store: Any) -> None:
    """Attach the resume command to ``e``; ``cli.main`` prints it after the interrupt message."""
    if run_id is not None:
        e.lowprec_resume = _resume_command(run_id, store)  # type: ignore[attr-defined]


def cmd_run(args: argparse.Namespace) -> int:
    from ..runs._runner import resume_run, run_config

    if args.world_size is not None and not args.resume:
        raise UsageError("--world-size goes with --resume; for a new run set parallel.world_size in the config")
    if args.allow_restart and not args.resume:
        raise UsageError("--allow-restart goes with --resume RUN_ID")
    if args.resume:
        with open_store(store_path(args), create=False) as store:  # a run to resume lives in an existing store
            run_id = store.get_run(args.resume).run_id
            try:
                resume_run(run_id, store=store, progress=not args.quiet, world_size=args.world_size,
                           allow_restart=args.allow_restart)
            except BaseException as e:
                if _is_interrupt(e):
                    _with_resume_hint(e, run_id, store)
                raise
            print(f"resumed run {run_id}: {store.get_run(run_id).status}")
        return 0
    if not args.config:
        raise UsageError("give a CONFIG.toml to run (or --resume RUN_ID)")
    config = config_with_overrides(args)
    with open_store(config.store) as store:
        before = {r.run_id for r in store.list_runs(verify=False)}
        try:
            ids = run_config(config, store=store, progress=not args.quiet)
        except BaseException as e:
            if _is_interrupt(e):
                _with_resume_hint(e, _interrupted_run(store, before, e), store)
            raise
        for run_id in ids:
            rec = store.get_run(run_id)
            print(_run_line(rec, store))
            if rec.status == "diverged" and args.quiet:  # with progress on, the run printed it as it ended
                from ..runs._lifecycle import diverged_line

                print(diverged_line(store, run_id))
    return 0


def _when(t: float | None) -> str:
    return "-" if t is None else _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _last(scalars: dict[str, Any], key: str) -> str:
    if key not in scalars or not len(scalars[key][1]):
        return "-"
    return f"{float(scalars[key][1][-1]):.4g}"


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters (an ellipsis marks the cut), left-aligned in that width."""
    return (text if len(text) <= width else text[:width - 1] + "…").ljust(width)


# runs list: id, status, steps, created (month-day time), framework, recipe, "group seed N", final eval values;
# 92 characters before the eval values, so two metrics ("accuracy 0.9634  loss 0.1193") fit in 120 columns
LIST_HEADER = (f"{'id':<12}  {'status':<9} {'steps':>6} {'created':<11} {'fw':<5} {'recipe':<14} "
               f"{'group, seed':<26}  final eval")


def _list_prefix(rec: Any, status: str, steps: str) -> str:
    recipe = rec.config.get("recipe", {}) if isinstance(rec.config, dict) else {}
    recipe_name = str(recipe.get("name", "-")) if isinstance(recipe, dict) else str(recipe)
    framework = str(rec.config.get("framework", "torch")) if isinstance(rec.config, dict) else "-"
    created = _dt.datetime.fromtimestamp(rec.created_at).strftime("%m-%d %H:%M")
    seed = rec.manifest.get("seed") if isinstance(rec.manifest, dict) else None
    tail = f" seed {seed}" if seed is not None else ""
    who = _fit(str(rec.group or rec.name), max(8, 26 - len(tail))).rstrip() + tail  # the seed is never cut off
    return (f"{rec.run_id}  {status:<9} {steps:>6} {created:<11} {_fit(framework, 5)} {_fit(recipe_name, 14)} "
            f"{_fit(who, 26)}  ")


def _run_line(rec: Any, store: Any) -> str:
    """One line of ``runs list`` (and of ``run``'s summary): see ``LIST_HEADER``."""
    from ..runs._store import StoreCorrupt

    try:
        sc = store.scalars(rec.run_id)
    except StoreCorrupt:
        return (_list_prefix(rec, "CORRUPT", "-") + "stored values do not match their checksums: "
                f"lowprec store check --store {shlex.quote(store.where)}")
    evals = "  ".join(f"{k[5:]} {_last(sc, k)}" for k in sorted(sc) if k.startswith("eval/"))
    steps = int(sc["train/loss"][0][-1]) if "train/loss" in sc and len(sc["train/loss"][0]) else 0
    return _list_prefix(rec, rec.status, str(steps)) + (evals or "-")


def cmd_runs_list(args: argparse.Namespace) -> int:
    from ..runs._store import StoreCorrupt

    with open_store(store_path(args), create=False) as store:
        runs = store.list_runs(group=args.group, status=args.status, verify=False)  # a corrupt run is flagged below
        if not runs:
            print("no runs" + (f" in group {args.group!r}" if args.group else ""))
            return 0
        print(LIST_HEADER)
        for rec in runs:
            try:
                line = _run_line(store.get_run(rec.run_id), store)  # verified record; _run_line flags bad scalars
            except StoreCorrupt:
                line = (_list_prefix(rec, "CORRUPT", "-") + "its record does not match its checksum: "
                        f"lowprec store check --store {shlex.quote(store.where)}")
            print(line)
    return 0


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# always shown by `runs show`, default or not; every other config field only when it differs from the default
_SHOWN = ("steps", "batch_size", "eval_interval", "optimizer.name", "optimizer.lr", "schedule.name",
          "schedule.warmup_steps", "framework")


def compact_config(config: dict[str, Any], width: int = 108) -> list[str]:
    """The run config as ``key=value`` lines of at most ``width`` characters: the fields of ``_SHOWN`` and every
    other field whose value differs from ``RunConfig``'s default (the recipe, shown by name and hash elsewhere, and
    the model, on a line of its own, and the store path are left out), in that order."""
    defaults = _flat(RunConfig(model="-").to_dict())
    flat = _flat({k: v for k, v in config.items() if k not in ("recipe", "store", "model")})
    keys = [k for k in _SHOWN if k in flat] + sorted(k for k in flat if k not in _SHOWN
                                                      and flat[k] != defaults.get(k, object()))
    items = [f"{k}={json.dumps(flat[k]) if isinstance(flat[k], str | dict) else flat[k]}" for k in keys]
    lines, line = [], ""
    for item in items:
        if line and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}  {item}" if line else item
    return [*lines, line] if line else lines


def config_toml(config: dict[str, Any]) -> str:
    """The stored (resolved) config as a run config TOML file that ``lowprec run`` reads back: None values are left
    out (TOML has no null; each such field defaults to None), except ``optimizer.grad_clip``, written as 0 (off)."""
    from ..recipes._serial import dict_to_toml

    def strip(d: dict[str, Any], path: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if v is None and f"{path}{k}" == "optimizer.grad_clip":
                v = 0.0
            if isinstance(v, dict):
                if v:  # an empty table is the default
                    out[k] = strip(v, f"{path}{k}.")
            elif v is not None:
                out[k] = v
        return out

    return dict_to_toml(strip(config))


def _built_from(store: Any) -> dict[str, list[str]]:
    """Run id -> the stored baselines built from it."""
    out: dict[str, list[str]] = {}
    for name in store.list_baselines():
        for seed in store.get_baseline(name, verify=False).get("seeds", []):
            if isinstance(seed, dict) and isinstance(seed.get("run_id"), str):
                out.setdefault(seed["run_id"], []).append(name)
    return out


def cmd_runs_delete(args: argparse.Namespace) -> int:
    """``lowprec runs delete RUN_ID... [--yes] [--force]``: the runs' rows, checkpoint folders and launch configs.
    Refused (nothing deleted): a run a live process still writes, a run a stored baseline is built from (unless
    --force), and, without --yes, a stdin that is not a terminal (nobody can confirm)."""
    import shutil
    import socket as _socket
    import sys as _sys
    import time as _time

    from ..runs._checkpoint import checkpoint_dir

    with open_store(store_path(args), create=False) as store:
        records: dict[str, Any] = {}
        for ident in args.run_ids:
            rec = store.get_run(ident, verify=False)  # a corrupt run can still be deleted
            records.setdefault(rec.run_id, rec)
        used = _built_from(store)
        for rec in records.values():
            if rec.status == "running":
                where = (f"process {rec.pid} on this host" if rec.hostname == _socket.gethostname() else
                         f"process {rec.pid} on host {rec.hostname}, which cannot be checked from here")
                if rec.hostname == _socket.gethostname() or not args.force:
                    raise UsageError(f"run {rec.run_id} ({rec.name}) is running ({where}); stop it first"
                                     + ("" if rec.hostname == _socket.gethostname() else
                                        ", or pass --force if that process is gone"))
            if rec.run_id in used and not args.force:
                names = ", ".join(repr(n) for n in used[rec.run_id])
                raise UsageError(f"run {rec.run_id} ({rec.name}) is a seed run of baseline {names}; delete the "
                                 f"baseline first (lowprec baselines delete NAME) or pass --force to delete the run "
                                 "anyway (the baseline keeps its summary, its over-time charts lose this run)")
        files = {rid: [p for p in (checkpoint_dir(store, rid), store.files_dir / "launch" / f"{rid}.json")
                       if p.exists()] for rid in records}
        print(f"{'deleting' if args.yes else 'would delete'} {len(records)} run(s) from {store.where}:")
        for rid, rec in records.items():
            when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(rec.created_at))
            print(f"  {rid}  {rec.status:<9} created {when}  {rec.name}"
                  + "".join(f"\n    and {p}" for p in files[rid]))
        if not args.yes:
            if not _sys.stdin.isatty():
                raise UsageError("stdin is not a terminal, so nobody can confirm: pass --yes to delete these runs")
            if input(f"delete {len(records)} run(s)? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing deleted")
                return 1
        for rid in records:
            _, n_s, n_e = store.delete_run(rid)
            for p in files[rid]:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            print(f"deleted run {rid} ({n_s} scalar rows, {n_e} events"
                  + (f", {len(files[rid])} file(s)/folder(s)" if files[rid] else "") + ")")
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    with open_store(store_path(args), create=False) as store:
        rec = store.get_run(args.run_id)
        sc = store.scalars(rec.run_id)
        events = store.events(rec.run_id)
    if args.config:
        print(config_toml(rec.config), end="")
        return 0
    m = rec.manifest
    print(f"run {rec.run_id}: {rec.name}")
    print(f"  status   {rec.status}" + (f" ({rec.error})" if rec.error else ""))
    print(f"  group    {rec.group}")
    print(f"  created  {_when(rec.created_at)}   finished {_when(rec.finished_at)}")
    print(f"  model    {rec.config.get('model')}   recipe {rec.config.get('recipe', {}).get('name')} "
          f"({m.get('recipe_hash')})   seed {m.get('seed')}")
    for i, line in enumerate(compact_config(rec.config)):
        print(f"  {'config' if i == 0 else '':<8} {line}")
    print(f"  {'':<8} (lowprec runs show {rec.run_id} --config: the full config as TOML)")
    print(f"  data     {m.get('data_source')} sha256 {str(m.get('data_hash'))[:16]}")
    git = m.get("git")
    if isinstance(git, dict) and git.get("commit"):
        print(f"  git      {git['commit']}" + (" (uncommitted changes)" if git.get("dirty") else " (clean)"))
    else:
        print("  git      - (not started in a git checkout)")
    versions = m.get("versions", {})
    print("  versions " + "  ".join(f"{k} {v}" for k, v in versions.items()))
    hw = m.get("hardware", {})
    print(f"  hardware {hw.get('cpu')}" + (f"   gpu {hw['gpu']}" if hw.get("gpu") else "")
          + (f"   device {hw['device']}" if hw.get("device") not in (None, "cpu") else ""))
    stats = sorted(k for k in sc if k.startswith("stats/"))
    for key in sorted(sc):
        steps, values = sc[key]
        if len(values) and (args.all or not key.startswith("stats/")):
            print(f"  {key:<22} {len(values):>6} points, last {float(values[-1]):.6g} at step {int(steps[-1])}")
    if stats and not args.all:
        layers = {k.split("/")[1] for k in stats if k.count("/") >= 3}
        print(f"  stats    {len(stats)} per-layer statistic keys ({len(layers)} modules): --all lists them, "
              f"lowprec stats {rec.run_id} ranks the worst")
    for ev in events:
        print(f"  event    step {ev['step']}: {ev['kind']} {json.dumps(ev['payload'])}")
    return 0


def cmd_runs_export(args: argparse.Namespace) -> int:
    from ..runs._export import export_run, export_tensorboard

    if args.experiment is not None and args.format != "mlflow":
        raise UsageError("--experiment goes with --format mlflow")
    args.experiment = args.experiment or "lowprec"
    if args.overwrite and args.format != "tensorboard":
        raise UsageError("--overwrite goes with --format tensorboard (csv and json files are replaced anyway)")
    with open_store(store_path(args), create=False) as store:
        run_id = store.get_run(args.run_id).run_id
        if args.format == "mlflow":
            from ..runs._export import export_mlflow

            uri = args.out or MLFLOW_DIR
            mid = export_mlflow(store, run_id, uri, experiment=args.experiment)
            print(f"wrote MLflow run {mid} (experiment {args.experiment!r}) to {uri}")
            return 0
        if args.format == "tensorboard":
            logdir = args.out or TB_LOGDIR
            out = export_tensorboard(store, run_id, logdir, overwrite=args.overwrite)
            print(f"wrote TensorBoard event file {out} (view: tensorboard --logdir {shlex.quote(str(logdir))})")
            return 0
        if args.out:
            export_run(store, run_id, fmt=args.format, out=args.out)
            print(f"wrote {args.out}")
        else:
            export_run(store, run_id, fmt=args.format, out=sys.stdout)
    return 0


def _pairs(what: str, items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"{what} {item!r}: write {what} NAME=VALUE")
        out[key] = value
    return out


def cmd_runs_import(args: argparse.Namespace) -> int:
    from ..runs._import import import_run, load_config_file

    with open_store(store_path(args)) as store:
        rid = import_run(store, args.path, fmt=args.format, name=args.name, group=args.group, seed=args.seed,
                         mapping=_pairs("--map", args.map), metrics=_pairs("--metric", args.metric),
                         config=load_config_file(args.config), model=args.model, steps=args.steps,
                         recipe=args.recipe, data_hash=args.data_hash, framework=args.framework, run=args.run_id)
        rec = store.get_run(rid)
        src = rec.manifest["source"]
        n = sum(len(s) for s, _ in store.scalars(rid).values())
        print(f"imported run {rid} ({rec.name!r}, group {rec.group!r}, {rec.status}): {n} values of "
              f"{', '.join(sorted(set(src['mapping'].values())))} from {src['format']} {src['path']}")
        if src["skipped"]:
            print(f"  left out (not train/*, eval/* or mapped with --map): {', '.join(src['skipped'])}")
        steps, loss = store.scalars(rid)["train/loss"]
        bad = [int(s) for s, v in zip(steps, loss, strict=True) if not (v == v and abs(v) != float("inf"))]
        if bad:
            print(f"  note: train/loss is not finite from step {bad[0]} ({len(bad)} values): kept, so the judge's "
                  "divergence criterion sees it (a baseline refuses this run)")
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from ..runs._config import STRATEGIES
    from ..testing import check_parity

    if args.against not in STRATEGIES:
        raise UsageError(f"--against must be one of {', '.join(STRATEGIES)}; got {args.against!r}")
    config = config_with_overrides(args)
    with open_store(config.store) as store:
        result = check_parity(config, store=store, against=args.against, world_size=args.world_size,
                              progress=not args.quiet, tp=args.tp, pp=args.pp)
    print(result.summary())
    return 0 if result.passed else 1


def cmd_stats(args: argparse.Namespace) -> int:
    from .._layer_stats import records_from_scalars, worst_layers

    with open_store(store_path(args), create=False) as store:
        rec = store.get_run(args.run_id)
        records = records_from_scalars(store.scalars(rec.run_id))
    if not records:
        raise UsageError(f"run {rec.run_id} has no tensor statistics: set [stats] every = N in its config")
    if args.what_if is not None:
        known = sorted({r["what_if"] for r in records if r.get("what_if") is not None})
        if args.what_if not in known:
            have = f"its what-if names are {', '.join(known)}" if known else "it measured no what-if specs"
            raise UsageError(f"--what-if {args.what_if!r}: run {rec.run_id} has no what-if of that name; {have} "
                             "(the names of its config's [stats] what_if table)")
    worst = worst_layers(records, key=args.key, n=args.n, what_if=args.what_if)
    label = args.key + (f" under what-if {args.what_if!r}" if args.what_if else "")
    print(f"run {rec.run_id}: the {len(worst)} worst (module, tensor) by {label}")
    print(f"{'module':<28}{'tensor':<14}{args.key:>14}  sampled steps")
    for w in worst:
        print(f"{w.module:<28}{w.role:<14}{w.value:>14.4g}  {w.steps}")
    return 0


def add_store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="PATH",
                   help=f"run store database (default $LOWPREC_STORE or the config's, else {DEFAULT_STORE})")


def add_parsers(sub: Any) -> None:
    r = sub.add_parser("run", help="train a run config (one run per seed) and record it in the run store")
    r.add_argument("config", nargs="?", metavar="CONFIG.toml", help="run config (see docs/runs.md)")
    r.add_argument("--seeds", type=int, nargs="+", metavar="S",
                   help="override the config's seeds: the seeds themselves (--seeds 10 11 trains seeds 10 and 11)")
    r.add_argument("--steps", type=int, help="override the config's steps")
    r.add_argument("--recipe", metavar="NAME|FILE",
                   help="override the config's recipe: a built-in name (lowprec recipes) or a recipe file, TOML or "
                        "JSON (lowprec autoprecision --out/--config-out, lowprec recipes --show NAME > FILE.toml)")
    r.add_argument("--resume", metavar="RUN_ID",
                   help="continue a stored (failed or killed) run from its newest usable checkpoint, the one next to "
                        "the store that holds it; a completed run is refused")
    r.add_argument("--allow-restart", action="store_true",
                   help="with --resume: when no usable checkpoint reaches the steps the store holds, start the run "
                        "over from step 0, deleting its recorded steps (refused without this flag)")
    r.add_argument("--world-size", type=int, metavar="N",
                   help="with --resume: continue on N data-parallel processes (1 = a single process)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    add_store_arg(r)
    r.set_defaults(func=cmd_run)

    par = sub.add_parser("parity", help="train a config in its layout and another; compare the loss curves")
    par.add_argument("config", metavar="CONFIG.toml")
    par.add_argument("--against", default="single", help="reference layout: single (default), ddp or fsdp2")
    par.add_argument("--world-size", type=int, help="world size of the reference layout (default: the config's)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the reference layout (default 1)")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the reference layout (default 1)")
    par.add_argument("--steps", type=int, help="override the config's steps")
    par.add_argument("--quiet", action="store_true")
    add_store_arg(par)
    par.set_defaults(func=cmd_parity)

    st = sub.add_parser("stats", help="the layers and tensors that lose the most precision in a run")
    st.add_argument("run_id", metavar="RUN_ID")
    st.add_argument("--key", default="sqnr_db",
                    help="statistic to rank by: sqnr_db (lowest first), underflow_pct, overflow_pct, ... (highest)")
    st.add_argument("-n", type=int, default=10, help="how many to show (default 10)")
    st.add_argument("--what-if", help="rank the what-if spec of this name instead of the recipe's own")
    add_store_arg(st)
    st.set_defaults(func=cmd_stats)

    runs = sub.add_parser("runs", help="list, show, export and import recorded runs")
    rs = runs.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    lst = rs.add_parser("list", help="the runs in the store, newest first")
    lst.add_argument("--group", help="only runs of this group")
    lst.add_argument("--status", choices=("running", "completed", "diverged", "failed"),
                     help="only runs with this status")
    add_store_arg(lst)
    lst.set_defaults(func=cmd_runs_list)
    dl = rs.add_parser("delete", help="delete runs: their rows, checkpoints and launch configs (asks first)")
    dl.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="run ids or unique prefixes")
    dl.add_argument("--yes", action="store_true", help="do not ask (needed when stdin is not a terminal)")
    dl.add_argument("--force", action="store_true",
                    help="also delete a run a stored baseline is built from, or one marked running on another host")
    add_store_arg(dl)
    dl.set_defaults(func=cmd_runs_delete)
    show = rs.add_parser("show", help="one run: config, manifest (git commit, versions, hardware), last values, "
                                      "events")
    show.add_argument("run_id", metavar="RUN_ID", help="run id or a unique prefix of it")
    show.add_argument("--config", action="store_true",
                      help="print only the run's full (resolved) config as TOML, which lowprec run reads back")
    show.add_argument("--all", action="store_true",
                      help="also list every per-layer statistic key (stats/...), summarised by default")
    add_store_arg(show)
    show.set_defaults(func=cmd_runs_show)
    exp = rs.add_parser("export", help="write a run's scalars as CSV, JSON or TensorBoard event files")
    exp.add_argument("run_id", metavar="RUN_ID")
    exp.add_argument("--format", choices=("csv", "json", "tensorboard", "mlflow"), default="csv")
    exp.add_argument("--out", metavar="PATH",
                     help=f"output file (default stdout); for tensorboard the logdir (default {TB_LOGDIR}): the event "
                          "file goes in LOGDIR/RUN_ID/, and tensorboard --logdir LOGDIR shows every exported run; for "
                          f"mlflow the tracking URI or folder (default {MLFLOW_DIR})")
    exp.add_argument("--experiment", help="mlflow: the experiment to write the run in (default lowprec)")
    exp.add_argument("--overwrite", action="store_true",
                     help="tensorboard: replace the event files of an earlier export of this run")
    add_store_arg(exp)
    exp.set_defaults(func=cmd_runs_export)
    imp = rs.add_parser("import", help="record a run's curves from TensorBoard, MLflow, CSV or JSON Lines")
    imp.add_argument("path", metavar="PATH", help="TensorBoard logdir or events file, MLflow tracking URI or folder, "
                                                  "or a CSV / JSON Lines file")
    imp.add_argument("--format", required=True, choices=("tensorboard", "mlflow", "csv", "jsonl"))
    imp.add_argument("--name", help="run name (default: the MLflow run name or the file name)")
    imp.add_argument("--group", help="run group: one arm of an experiment (its seeds)")
    imp.add_argument("--seed", type=int, help="the seed the run trained with (required unless MLflow params have it)")
    imp.add_argument("--map", action="append", metavar="SRC=DEST",
                     help="rename a tag or column to a lowprec key, e.g. --map val_acc=eval/accuracy (repeatable)")
    imp.add_argument("--metric", action="append", metavar="NAME=min|max",
                     help="direction of eval metric NAME (loss: min and accuracy: max by default; repeatable)")
    imp.add_argument("--config", metavar="FILE.json|toml", help="the run's config (model, steps, recipe, ...)")
    imp.add_argument("--model", help="config['model'] (default: the --config's, else unknown)")
    imp.add_argument("--steps", type=int, help="planned steps (default: the --config's, else the last train/loss step)")
    imp.add_argument("--recipe", help="recipe name or description; its hash goes in the manifest (default none)")
    imp.add_argument("--data-hash", help="the data set's hash (default unknown)")
    imp.add_argument("--framework", help="framework that trained it, e.g. torch or jax (default unknown)")
    imp.add_argument("--run-id", help="mlflow: the run id or run name (needed when the store holds several)")
    add_store_arg(imp)
    imp.set_defaults(func=cmd_runs_import)
