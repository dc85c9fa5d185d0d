"""CLI commands for accuracy baselining: ``baseline``, ``baselines``, ``compare``, ``report``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .._errors import UsageError
from ._runs import add_store_arg, config_with_overrides, open_store, store_path


def _criteria(path: str | None) -> Any:
    """The ``Criteria`` of ``--criteria FILE`` (TOML, or JSON for ``*.json``; a top-level ``criteria`` table is
    unwrapped), or None.  Every problem is a ValueError naming the file: missing, unreadable, not valid or too
    deeply nested TOML/JSON (``parse_toml``/``parse_json``), or a bad field."""
    from .._parse import parse_json, parse_toml, read_text_file
    from ..accuracy._stats import Criteria

    if path is None:
        return None
    p = Path(path)
    text = read_text_file(p, "criteria")
    where = f"criteria file {path!r}"
    data = parse_json(text, where=where) if p.suffix == ".json" else parse_toml(text, where=where)
    try:
        return Criteria.from_dict(data.get("criteria", data) if isinstance(data, dict) else data)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None


def baseline_seeds(values: list[int] | None) -> int | tuple[int, ...]:
    """``baseline --seeds``: none given: 3 (seeds 0, 1, 2); one value N: a count, seeds 0..N-1 (as before lists were
    accepted); two or more values: the seeds themselves, as ``run --seeds`` takes them."""
    if not values:
        return 3
    if len(values) == 1:
        return values[0]
    return tuple(values)


def _check_baseline_source(args: argparse.Namespace) -> None:
    """``baseline`` takes either CONFIG.toml (train the seeds) or ``--from-runs`` (stored runs), never both."""
    if args.from_runs:
        if args.config is not None:
            raise UsageError(f"baseline: give either CONFIG.toml ({args.config!r}: train the seeds) or --from-runs "
                             f"(build it from stored runs), not both")
        given = [f"--{o}" for o in ("seeds", "steps", "recipe") if getattr(args, o) is not None]
        if given:
            raise UsageError(f"baseline --from-runs trains nothing, so {', '.join(given)} do not apply: drop them "
                             f"(the runs' own seeds, steps and recipe are used)")
    else:
        if args.config is None:
            raise UsageError("baseline needs CONFIG.toml (train its seeds) or --from-runs GROUP_OR_RUN_ID... (build "
                             "it from runs already in the store, e.g. runs recorded by lowprec.runs.track)")
        if args.latest:
            raise UsageError("baseline --latest applies to --from-runs only (it picks the newest run of each seed)")


def cmd_baseline(args: argparse.Namespace) -> int:
    _check_baseline_source(args)
    criteria = _criteria(args.criteria)
    if args.from_runs:
        from ..accuracy._workflow import baseline_from_runs

        left_out: list[str] = []
        with open_store(store_path(args), create=False) as store:
            b = baseline_from_runs(store, args.name, args.from_runs, criteria=criteria, overwrite=args.overwrite,
                                   latest=args.latest, left_out=left_out)
        for line in left_out:
            print(line, file=sys.stderr)
    else:
        from ..runs._seeds import train_baseline

        seeds = baseline_seeds(args.seeds)
        config = config_with_overrides(args, apply_seeds=False)
        with open_store(config.store) as store:
            b = train_baseline(config, name=args.name, store=store, seeds=seeds, criteria=criteria,
                               overwrite=args.overwrite, progress=not args.quiet)
    print(f"baseline {b.name!r}: {b.model}, {len(b.seeds)} seeds {list(b.seeds)}, {b.steps} steps")
    for metric, values in b.finals.items():
        print(f"  final {metric:<12} mean {values.mean():.6g}  std {values.std(ddof=1):.3g}  "
              f"min {values.min():.6g}  max {values.max():.6g}")
    if args.export:
        print(f"wrote {b.save_json(args.export)}")
    return 0


def cmd_baselines(args: argparse.Namespace) -> int:
    from ..accuracy._baseline import Baseline

    with open_store(store_path(args), create=args.action == "import") as store:
        if args.action == "list":
            names = store.list_baselines()
            for name in names:
                b = Baseline.from_dict(store.get_baseline(name))
                print(f"{name:<30} {b.model:<22} {len(b.seeds)} seeds  {b.steps} steps  data {b.data_hash[:12]}")
            if not names:
                print("no baselines")
        elif args.action == "export":
            b = Baseline.from_dict(store.get_baseline(args.name))
            print(f"wrote {b.save_json(args.file)}")
        elif args.action == "delete":
            seeds = store.get_baseline(args.name, verify=False).get("seeds", [])
            ids = [str(s.get("run_id")) for s in seeds if isinstance(s, dict) and s.get("run_id")]
            store.delete_baseline(args.name)
            print(f"deleted baseline {args.name!r}; its {len(ids)} seed runs stay in the store"
                  + (f" (lowprec runs delete {' '.join(ids)} removes them)" if ids else ""))
        else:  # import
            b = Baseline.load_json(args.file)
            name = args.name or b.name
            if name != b.name:
                b = Baseline.from_dict({**b.to_dict(), "name": name})
            store.save_baseline(name, b.to_dict(), overwrite=args.overwrite)
            print(f"imported baseline {name!r} from {args.file}")
    return 0


def _judged(args: argparse.Namespace) -> tuple[Any, list[Any], list[Any]]:
    from ..accuracy._workflow import judge_groups, load_baseline, select_runs

    left_out: list[str] = []
    with open_store(store_path(args), create=False) as store:
        baseline = load_baseline(store, args.baseline)
        runs = select_runs(store, args.runs, latest=args.latest, left_out=left_out)
    for line in left_out:
        print(line, file=sys.stderr)
    return baseline, runs, judge_groups(baseline, runs)


def cmd_compare(args: argparse.Namespace) -> int:
    _, _, verdicts = _judged(args)
    if args.json:
        print(json.dumps([v.to_dict() for v in verdicts], indent=2))
    else:
        print("\n\n".join(v.format_table() for v in verdicts))
    return _exit_code(verdicts)


def _exit_code(verdicts: list[Any]) -> int:
    """0 when every group PASSes, 1 when any FAILs, 3 when none FAILs but some are INCONCLUSIVE (2: usage error)."""
    from ..accuracy._judge import EXIT_CODES, combine_outcomes

    return EXIT_CODES[combine_outcomes([v.outcome for v in verdicts])]


def cmd_plan(args: argparse.Namespace) -> int:
    from ..accuracy._plan import format_plan, plan
    from ..accuracy._workflow import load_baseline

    if args.baseline.endswith(".json") or Path(args.baseline).is_file():
        baseline = load_baseline(None, args.baseline)  # type: ignore[arg-type]  # a file needs no store
    else:
        with open_store(store_path(args), create=False) as store:
            baseline = load_baseline(store, args.baseline)
    p = plan(baseline, worse_by_fraction=args.worse_by)
    print(json.dumps(p, indent=2) if args.json else format_plan(baseline, p))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ..accuracy._report import write_report

    baseline, runs, verdicts = _judged(args)
    path = write_report(args.out, baseline=baseline, runs=runs, verdict=verdicts,
                        baseline_runs=_baseline_runs(args, baseline) or ())
    from ..accuracy._judge import WORDS, combine_outcomes

    word = WORDS[combine_outcomes([v.outcome for v in verdicts])]
    print(f"wrote {path} ({word}); open it in a browser")
    return 0


def _baseline_runs(args: argparse.Namespace, baseline: Any) -> list[Any] | None:
    """The baseline's own seed runs when the store holds them (the report's over-time charts), else None (a
    baseline file from another machine)."""
    from ..accuracy._baseline import RunData
    from ..runs._store import StoreCorrupt, StoreError

    try:
        with open_store(store_path(args), create=False) as store:
            return [RunData.from_store(store, rid) for rid in baseline.run_ids]
    except StoreCorrupt:
        raise
    except StoreError:  # not in this store (a golden file, or deleted runs): the charts show the candidates only
        return None


def add_parsers(sub: Any) -> None:
    b = sub.add_parser("baseline", help="run a config over N seeds and store a named baseline, or build one from "
                                        "stored runs (--from-runs)")
    b.add_argument("config", nargs="?", metavar="CONFIG.toml", help="run config whose seeds are trained (or use "
                                                                     "--from-runs)")
    b.add_argument("--from-runs", nargs="+", metavar="GROUP_OR_RUN_ID",
                   help="build the baseline from runs already in the store (groups or run ids: runs of lowprec run, "
                        "of lowprec.runs.track in your own loop, or imported) instead of training; no CONFIG")
    b.add_argument("--latest", action="store_true",
                   help="with --from-runs: where a group holds one seed more than once, use the newest completed "
                        "run of that seed")
    b.add_argument("--name", required=True, help="name of the baseline")
    b.add_argument("--seeds", type=int, nargs="+", metavar="S",
                   help="one value N: N seeds, 0..N-1 (default 3: seeds 0 1 2); two or more values: those seeds, as "
                        "for lowprec run (--seeds 5 trains seeds 0-4; --seeds 5 6 7 trains seeds 5, 6 and 7)")
    b.add_argument("--steps", type=int, help="override the config's steps")
    b.add_argument("--recipe", metavar="NAME|FILE",
                   help="reference recipe, a built-in name or a recipe file (TOML/JSON) (default: the config's)")
    b.add_argument("--criteria", metavar="FILE", help="acceptance criteria (TOML or JSON table; docs/accuracy.md)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing baseline of that name")
    b.add_argument("--export", metavar="FILE.json", help="also write the baseline as a JSON golden file")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_store_arg(b)
    b.set_defaults(func=cmd_baseline)

    bl = sub.add_parser("baselines", help="list, export, import or delete baselines (JSON golden files)")
    bs = bl.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = bs.add_parser("list", help="the stored baselines")
    add_store_arg(p)
    p.set_defaults(func=cmd_baselines)
    p = bs.add_parser("export", help="write a stored baseline to a JSON file")
    p.add_argument("name")
    p.add_argument("file", metavar="FILE.json")
    add_store_arg(p)
    p.set_defaults(func=cmd_baselines)
    p = bs.add_parser("delete", help="delete a stored baseline (its seed runs stay; lowprec runs delete removes them)")
    p.add_argument("name")
    add_store_arg(p)
    p.set_defaults(func=cmd_baselines)
    p = bs.add_parser("import", help="store a baseline read from a JSON file")
    p.add_argument("file", metavar="FILE.json")
    p.add_argument("--name", help="store it under this name (default: the file's)")
    p.add_argument("--overwrite", action="store_true")
    add_store_arg(p)
    p.set_defaults(func=cmd_baselines)

    pl = sub.add_parser("plan", help="how many seeds decide a comparison against a baseline, before training them")
    pl.add_argument("--baseline", required=True, metavar="NAME|FILE.json",
                    help="a stored baseline's name or a baseline JSON file")
    pl.add_argument("--worse-by", type=float, default=0.0, metavar="F",
                    help="assume the candidate is worse by this fraction of each margin (default 0: as good)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_store_arg(pl)
    pl.set_defaults(func=cmd_plan)

    for cmd, helptext in (("compare", "judge runs against a baseline: PASS (exit 0), FAIL (exit 1) or INCONCLUSIVE "
                                      "(exit 3), with the evidence"),
                          ("report", "write a self-contained HTML report of runs against a baseline")):
        c = sub.add_parser(cmd, help=helptext)
        c.add_argument("--baseline", required=True, metavar="NAME|FILE.json",
                       help="a stored baseline's name or a baseline JSON file")
        c.add_argument("runs", nargs="+", metavar="RUN_OR_GROUP",
                       help="run ids (or unique prefixes) or group names; each group is judged on its own")
        c.add_argument("--latest", action="store_true",
                       help="where a group holds one seed more than once (the same command run twice), judge the "
                            "newest completed run of that seed (the others are named on stderr)")
        add_store_arg(c)
        if cmd == "compare":
            c.add_argument("--json", action="store_true", help="print the verdicts as JSON")
            c.set_defaults(func=cmd_compare)
        else:
            c.add_argument("--out", default="lowprec-report.html", help="output HTML file")
            c.set_defaults(func=cmd_report)
