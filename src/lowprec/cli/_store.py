"""CLI command for the run store itself: ``lowprec store check [--store PATH] [--seal] [--quiet]``.

``check`` runs SQLite's ``PRAGMA integrity_check`` and ``foreign_key_check`` and verifies every run (its record,
every scalar and event row, the row counts) and every baseline against the checksums the store keeps (see
``lowprec.runs._store``), printing one line per run and baseline and what is wrong.  Exit status 0 when nothing is
corrupt (runs written before the store had checksums are listed as unverified, not failed), 1 when something is,
2 for a usage error (no store at that path).

``--seal`` records checksums for the unverified runs and baselines, trusting what is stored now, and only after
the check found nothing corrupt: afterwards any change to them is detected.  It needs write access.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._runs import add_store_arg, store_path


def cmd_store_check(args: argparse.Namespace) -> int:
    from ..runs._store import RunStore, StoreCorrupt

    path = store_path(args)
    try:
        store = RunStore(path, create=False)
    except StoreCorrupt as e:  # SQLite cannot even read the schema
        print(f"store {path}: CORRUPT: {e}")
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


def add_parsers(sub: Any) -> None:
    st = sub.add_parser("store", help="check the run store's integrity (SQLite structure and per-row checksums)")
    ss = st.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    chk = ss.add_parser("check", help="verify every run and baseline; exit 0 clean, 1 corrupt")
    chk.add_argument("--seal", action="store_true",
                     help="first record checksums for runs and baselines written before the store had them "
                          "(only when nothing is corrupt)")
    chk.add_argument("--quiet", action="store_true", help="print only what is not ok, and the summary")
    add_store_arg(chk)
    chk.set_defaults(func=cmd_store_check)
