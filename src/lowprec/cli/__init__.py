"""The ``lowprec`` command: a thin layer that builds the library's own objects and calls library functions.

User errors (``lowprec.UsageError``: bad names, arguments, config fields, files, store paths) print one line to
stderr, without a traceback, and exit with status 2; any other exception is a bug and keeps its traceback.
SIGTERM and SIGHUP raise ``Terminated`` in the main thread (where they are not ignored), so a command stops the way
Ctrl-C stops it: a run in progress is marked failed with the reason ("Terminated: interrupted by SIGTERM"), and
the command exits with status 128 + the signal number.  When ``lowprec run`` is stopped so (or by Ctrl-C), the
last line names the command that continues the run: ``lowprec run --resume RUN_ID``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .. import __version__, formats
from .._errors import UsageError


def _fmt_num(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args: argparse.Namespace) -> int:
    specs = [formats.get(n) for n in formats.names()]
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
        return 0
    cols = ["name", "bits", "E", "M", "bias", "max", "min_normal", "min_subnormal", "eps", "inf", "nan"]
    rows = [
        [
            s.name,
            str(s.bits),
            str(s.ebits),
            str(s.mbits),
            str(s.bias) if s.kind == "float" else f"int/{s.frac_bits}f",
            _fmt_num(s.max),
            _fmt_num(s.min_normal),
            _fmt_num(s.min_subnormal),
            _fmt_num(s.eps),
            "yes" if s.has_inf else "no",
            "yes" if s.has_nan else "no",
        ]
        for s in specs
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from .. import recipes

    if args.show:
        r = recipes.get(args.show)
        print(r.to_toml() if args.format == "toml" else r.to_json())
        return 0
    from ..recipes import _named

    for name in recipes.names():
        doc = " ".join((getattr(_named, name.replace("-", "_")).__doc__ or "").split())
        doc = doc if len(doc) <= 100 else doc[:99] + "…"
        kind = "profile" if name in recipes.PROFILES else "recipe"
        print(f"{name:<26}{kind:<9}{recipes.get(name).hash()}  {doc}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import main_demo

    return main_demo(store=args.store or "lowprec-runs/runs.db", out=args.out, steps=args.steps, quiet=args.quiet)


def cmd_quant_demo(args: argparse.Namespace) -> int:
    from ._quant_demo import run_demo

    run_demo(seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowprec", description="Exact emulation of low-precision number formats and training numerics."
    )
    p.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    f = sub.add_parser("formats", help="print the table of number formats")
    f.add_argument("--json", action="store_true", help="print JSON instead of a table")
    f.set_defaults(func=cmd_formats)
    r = sub.add_parser("recipes", help="list the built-in recipes and hardware profiles, or show one")
    r.add_argument("--show", metavar="NAME", help="print one recipe in full")
    r.add_argument("--format", choices=("toml", "json"), default="toml", help="format for --show (default toml)")
    r.set_defaults(func=cmd_recipes)
    d = sub.add_parser("demo", help="accuracy demo: low-precision recipes judged against an fp32 baseline")
    d.add_argument("--store", metavar="PATH", help="run store (default lowprec-runs/runs.db)")
    d.add_argument("--out", default="lowprec-runs/demo-report.html", help="HTML report path")
    d.add_argument("--steps", type=int, help="override the task's default number of steps")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)
    q = sub.add_parser("quant-demo", help="quantize a tensor with every named spec and print the error")
    q.add_argument("--seed", type=int, default=0, help="seed for the demo tensor (default 0)")
    q.set_defaults(func=cmd_quant_demo)
    from . import _accuracy, _precision, _ptq, _runs, _store

    _runs.add_parsers(sub)
    _precision.add_parsers(sub)
    _accuracy.add_parsers(sub)
    _ptq.add_parsers(sub)
    _store.add_parsers(sub)
    return p


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread like KeyboardInterrupt for Ctrl-C (a BaseException, so
    ``except Exception`` does not swallow it), so code in progress records why it stops."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)  # one-shot: a second signal during the clean-up ends the process
    raise Terminated(signum)


def _catch_termination() -> list[tuple[int, Any]]:
    """Install ``_terminated`` for SIGTERM and SIGHUP where they have their default action (not under ``nohup``,
    not where the embedding program has its own handler); returns what to restore."""
    if threading.current_thread() is not threading.main_thread():
        return []
    saved: list[tuple[int, Any]] = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_DFL:
            signal.signal(sig, _terminated)
            saved.append((sig, previous))
    return saved


def _print_resume(e: BaseException) -> None:
    """The command that continues an interrupted run, which ``lowprec run`` attaches to the exception."""
    command = getattr(e, "lowprec_resume", None)
    if command:
        print(f"lowprec: the run is marked failed; continue it with: {command}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    saved = _catch_termination()
    try:
        return int(args.func(args))
    except Terminated as e:
        print(f"lowprec: {e}", file=sys.stderr)
        _print_resume(e)
        return 128 + e.signum
    except UsageError as e:  # anything else is a bug: it keeps its traceback
        print(f"lowprec: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from ..runs._launch import RunFailed

        if not isinstance(e, RunFailed):
            raise
        print(f"lowprec: {e}", file=sys.stderr)
        _print_resume(e)
        return 1
    except KeyboardInterrupt as e:
        print("lowprec: interrupted", file=sys.stderr)
        _print_resume(e)
        return 130
    except BrokenPipeError:  # e.g. `lowprec formats | head`
        sys.stderr.close()
        return 0
    finally:
        for sig, previous in saved:
            signal.signal(sig, previous)


if __name__ == "__main__":
    sys.exit(main())
