"""CLI commands for the run store itself: ``lowprec store check [--store PATH] [--seal] [--quiet]`` and
``lowprec store copy SRC DST [--run ID ...] [--baseline NAME ...] [--overwrite | --skip-existing]``.

``check`` runs SQLite's ``PRAGMA integrity_check`` and ``foreign_key_check`` and verifies every run (its record,
every scalar and event row, the row counts) and every baseline against the checksums the store keeps (see
``lowprec.runs._store``), printing one line per run and baseline and what is wrong.  Exit status 0 when nothing is
corrupt (runs written before the store had checksums are listed as unverified, not failed), 1 when something is,
2 for a usage error (no store at that path).

``--seal`` records checksums for the unverified runs and baselines, trusting what is stored now, and only after
the check found nothing corrupt: afterwards any change to them is detected.  It needs write access.

``copy`` moves runs (record, config, manifest, scalars, events) and baselines between any two stores, SQLite
files or PostgreSQL URLs, in either direction, verifying each run on read and again after writing it
(``lowprec.runs._store_copy``).  It creates the destination store (a PostgreSQL database must exist), never
overwrites a run or baseline unless ``--overwrite``, and exits 2 when something is refused.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._runs import add_store_arg, store_path


def cmd_store_check(args: argparse.Namespace) -> int:
    from ..runs._store import RunStore, StoreCorrupt
    from ..runs._store_pg import is_url, redact

    path = store_path(args)
    try:
        store = RunStore(path, create=False)
    except StoreCorrupt as e:  # SQLite cannot even read the schema
        print(f"store {redact(path) if is_url(path) else path}: CORRUPT: {e}")
        return 1
    with store:
        report = store.check()
        if args.seal:
            if not report.ok:
                for line in report.lines():
                    print(line)
                print("not sealing: the store is corrupt (sealing would record checksums of damaged data)")
                return 1
            runs, baselines = store.seal()
            print(f"sealed {runs} runs and {baselines} baselines written before the store had checksums")
            report = store.check()
    lines = report.lines()
    if args.quiet:
        lines = [lines[0], *(ln for ln in lines[1:-1] if not ln.endswith(" ok") and ": ok (" not in ln), lines[-1]]
    for line in lines:
        print(line)
    return 0 if report.ok else 1


def cmd_store_copy(args: argparse.Namespace) -> int:
    import time

    from ..runs._store import RunStore
    from ..runs._store_copy import copy_store

    t0 = time.perf_counter()
    with RunStore(args.src, create=False) as src, RunStore(args.dst) as dst:
        done = copy_store(src, dst, run_ids=args.run or (), baselines=args.baseline or (), overwrite=args.overwrite,
                          skip_existing=args.skip_existing, progress=None if args.quiet else print)
        print(f"copied {len(done.runs)} runs ({done.rows} rows) and {len(done.baselines)} baselines from "
              f"{src.where} to {dst.where}, each verified after writing, in {time.perf_counter() - t0:.1f} s"
              + (f"; {len(done.skipped)} already there, left as they were" if done.skipped else ""))
    return 0


def add_parsers(sub: Any) -> None:
    st = sub.add_parser("store", help="check the run store's integrity (structure and per-row checksums), copy runs "
                                      "between stores")
    ss = st.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    chk = ss.add_parser("check", help="verify every run and baseline; exit 0 clean, 1 corrupt")
    chk.add_argument("--seal", action="store_true",
                     help="first record checksums for runs and baselines written before the store had them "
                          "(only when nothing is corrupt)")
    chk.add_argument("--quiet", action="store_true", help="print only what is not ok, and the summary")
    add_store_arg(chk)
    chk.set_defaults(func=cmd_store_check)
    cp = ss.add_parser("copy", help="copy runs and baselines between two stores (SQLite files or postgresql:// URLs), "
                                    "verified")
    cp.add_argument("src", metavar="SRC", help="the store to read: a path or a postgresql://USER@HOST:PORT/DB URL")
    cp.add_argument("dst", metavar="DST", help="the store to write (created if needed; a database must exist)")
    cp.add_argument("--run", action="append", metavar="ID", help="copy this run (id or unique prefix; repeatable); "
                                                                 "default: every run and baseline")
    cp.add_argument("--baseline", action="append", metavar="NAME", help="copy this baseline and its seed runs "
                                                                        "(repeatable)")
    how = cp.add_mutually_exclusive_group()
    how.add_argument("--overwrite", action="store_true", help="replace runs and baselines DST already holds")
    how.add_argument("--skip-existing", action="store_true", help="leave runs and baselines DST already holds")
    cp.add_argument("--quiet", action="store_true", help="print only the summary")
    cp.set_defaults(func=cmd_store_copy)
