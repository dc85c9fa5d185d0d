"""CLI commands for runs: ``run``, ``runs list|show|export``.  Each builds library objects and calls the library."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import sys
from typing import Any

from .runs._config import DEFAULT_STORE, RunConfig, load


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
    from .runs._store import RunStore

    return RunStore(path, create=create)


def config_with_overrides(args: argparse.Namespace) -> RunConfig:
    """The config file, with the command line's --seeds/--steps/--recipe/--store applied."""
    from . import recipes

    config = load(args.config)
    changes: dict[str, Any] = {}
    if isinstance(getattr(args, "seeds", None), list):  # `run --seeds S...` (baseline's --seeds is a count)
        changes["seeds"] = tuple(args.seeds)
    if getattr(args, "steps", None) is not None:
        changes["steps"] = args.steps
    if getattr(args, "recipe", None):
        changes["recipe"] = recipes.get(args.recipe)
    changes["store"] = store_path(args, config)
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise ValueError(f"command line: {e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    from .runs._runner import resume_run, run_config

    if args.world_size is not None and not args.resume:
        raise ValueError("--world-size goes with --resume; for a new run set parallel.world_size in the config")
    if args.allow_restart and not args.resume:
        raise ValueError("--allow-restart goes with --resume RUN_ID")
    if args.resume:
        with open_store(store_path(args), create=False) as store:  # a run to resume lives in an existing store
            run_id = resume_run(args.resume, store=store, progress=not args.quiet, world_size=args.world_size,
                                allow_restart=args.allow_restart)
            print(f"resumed run {run_id}: {store.get_run(run_id).status}")
        return 0
    if not args.config:
        raise ValueError("give a CONFIG.toml to run (or --resume RUN_ID)")
    config = config_with_overrides(args)
    with open_store(config.store) as store:
        ids = run_config(config, store=store, progress=not args.quiet)
        for run_id in ids:
            print(_run_line(store.get_run(run_id), store))
    return 0


def _when(t: float | None) -> str:
    return "-" if t is None else _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _last(scalars: dict[str, Any], key: str) -> str:
    if key not in scalars or not len(scalars[key][1]):
        return "-"
    return f"{float(scalars[key][1][-1]):.4g}"


def _run_line(rec: Any, store: Any) -> str:
    from .runs._store import StoreCorrupt

    try:
        sc = store.scalars(rec.run_id)
    except StoreCorrupt:
        return (f"{rec.run_id}  {'CORRUPT':<9} {'-':>6}  {rec.name:<40} stored values do not match their checksums: "
                f"lowprec store check --store {store.path}")
    evals = "  ".join(f"{k[5:]}={_last(sc, k)}" for k in sorted(sc) if k.startswith("eval/"))
    steps = int(sc["train/loss"][0][-1]) if "train/loss" in sc and len(sc["train/loss"][0]) else 0
    loss = _last(sc, "train/loss")
    return f"{rec.run_id}  {rec.status:<9} {steps:>6}  {rec.name:<40} train loss {loss}  eval {evals}"


def cmd_runs_list(args: argparse.Namespace) -> int:
    from .runs._store import StoreCorrupt

    with open_store(store_path(args), create=False) as store:
        runs = store.list_runs(group=args.group, status=args.status, verify=False)  # a corrupt run is flagged below
        if not runs:
            print("no runs" + (f" in group {args.group!r}" if args.group else ""))
            return 0
        print(f"{'id':<12}  {'status':<9} {'steps':>6}  {'name':<40} last values")
        for rec in runs:
            try:
                line = _run_line(store.get_run(rec.run_id), store)  # verified record; _run_line flags bad scalars
            except StoreCorrupt:
                line = (f"{rec.run_id}  {'CORRUPT':<9} {'-':>6}  {rec.name:<40} its record does not match its "
                        f"checksum: lowprec store check --store {store.path}")
            print(line)
    return 0


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

    from .runs._checkpoint import checkpoint_dir

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
                    raise ValueError(f"run {rec.run_id} ({rec.name}) is running ({where}); stop it first"
                                     + ("" if rec.hostname == _socket.gethostname() else
                                        ", or pass --force if that process is gone"))
            if rec.run_id in used and not args.force:
                names = ", ".join(repr(n) for n in used[rec.run_id])
                raise ValueError(f"run {rec.run_id} ({rec.name}) is a seed run of baseline {names}; delete the "
                                 f"baseline first (lowprec baselines delete NAME) or pass --force to delete the run "
                                 "anyway (the baseline keeps its summary, its over-time charts lose this run)")
        files = {rid: [p for p in (checkpoint_dir(store.path, rid), store.path.parent / "launch" / f"{rid}.json")
                       if p.exists()] for rid in records}
        print(f"{'deleting' if args.yes else 'would delete'} {len(records)} run(s) from {store.path}:")
        for rid, rec in records.items():
            when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(rec.created_at))
            print(f"  {rid}  {rec.status:<9} created {when}  {rec.name}"
                  + "".join(f"\n    and {p}" for p in files[rid]))
        if not args.yes:
            if not _sys.stdin.isatty():
                raise ValueError("stdin is not a terminal, so nobody can confirm: pass --yes to delete these runs")
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
    print(f"run {rec.run_id}: {rec.name}")
    print(f"  status   {rec.status}" + (f" ({rec.error})" if rec.error else ""))
    print(f"  group    {rec.group}")
    print(f"  created  {_when(rec.created_at)}   finished {_when(rec.finished_at)}")
    print(f"  model    {rec.config.get('model')}   recipe {rec.config.get('recipe', {}).get('name')} "
          f"({rec.manifest.get('recipe_hash')})   seed {rec.manifest.get('seed')}")
    print(f"  data     {rec.manifest.get('data_source')} sha256 {str(rec.manifest.get('data_hash'))[:16]}")
    versions = rec.manifest.get("versions", {})
    print("  versions " + "  ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"  hardware {rec.manifest.get('hardware', {}).get('cpu')}")
    for key in sorted(sc):
        steps, values = sc[key]
        if len(values):
            print(f"  {key:<22} {len(values):>6} points, last {float(values[-1]):.6g} at step {int(steps[-1])}")
    for ev in events:
        print(f"  event    step {ev['step']}: {ev['kind']} {json.dumps(ev['payload'])}")
    return 0


def cmd_runs_export(args: argparse.Namespace) -> int:
    from .runs._export import export_run, export_tensorboard

    with open_store(store_path(args), create=False) as store:
        run_id = store.get_run(args.run_id).run_id
        if args.format == "tensorboard":
            out = export_tensorboard(store, run_id, args.out or f"tb/{run_id}")
            print(f"wrote TensorBoard event files to {out} (tensorboard --logdir {out})")
            return 0
        if args.out:
            export_run(store, run_id, fmt=args.format, out=args.out)
            print(f"wrote {args.out}")
        else:
            export_run(store, run_id, fmt=args.format, out=sys.stdout)
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from .runs._config import STRATEGIES
    from .testing import check_parity

    if args.against not in STRATEGIES:
        raise ValueError(f"--against must be one of {', '.join(STRATEGIES)}; got {args.against!r}")
    config = config_with_overrides(args)
    with open_store(config.store) as store:
        result = check_parity(config, store=store, against=args.against, world_size=args.world_size,
                              progress=not args.quiet)
    print(result.summary())
    return 0 if result.passed else 1


def cmd_stats(args: argparse.Namespace) -> int:
    from .numerics import records_from_scalars, worst_layers

    with open_store(store_path(args), create=False) as store:
        rec = store.get_run(args.run_id)
        records = records_from_scalars(store.scalars(rec.run_id))
    if not records:
        raise ValueError(f"run {rec.run_id} has no tensor statistics: set [stats] every = N in its config")
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
    r.add_argument("--seeds", type=int, nargs="+", metavar="S", help="override the config's seeds")
    r.add_argument("--steps", type=int, help="override the config's steps")
    r.add_argument("--recipe", metavar="NAME", help="override the config's recipe with a named one")
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

    runs = sub.add_parser("runs", help="list, show and export recorded runs")
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
    show = rs.add_parser("show", help="one run: config, manifest, last values, events")
    show.add_argument("run_id", metavar="RUN_ID", help="run id or a unique prefix of it")
    add_store_arg(show)
    show.set_defaults(func=cmd_runs_show)
    exp = rs.add_parser("export", help="write a run's scalars as CSV, JSON or TensorBoard event files")
    exp.add_argument("run_id", metavar="RUN_ID")
    exp.add_argument("--format", choices=("csv", "json", "tensorboard"), default="csv")
    exp.add_argument("--out", metavar="PATH", help="output file (directory for tensorboard); default stdout")
    add_store_arg(exp)
    exp.set_defaults(func=cmd_runs_export)
