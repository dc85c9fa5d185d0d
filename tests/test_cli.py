"""The ``lowprec`` command line (oracle: the FormatSpec registry and exit codes).

``run_cli`` runs it as a real subprocess (``python -m lowprec.cli``): the entry point, the exit status and the
absence of a traceback as a user sees them.  Each subprocess pays for importing torch (2-4 s on a loaded 2-core
machine), so the commands whose output is checked in detail run in-process through ``cli.main(argv)``
(``call``), which is what the entry point runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lowprec
from lowprec import formats

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "lowprec.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def call(*args: str) -> _Result:
    """``lowprec.cli.main(args)`` in this process, with its exit status (argparse's SystemExit included) and
    captured output."""
    import contextlib
    import io

    from lowprec import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:
            code = int(e.code or 0)
    return _Result(code, out.getvalue(), err.getvalue())


def test_formats_table_lists_every_format_with_its_limits() -> None:
    """Oracle: the registry; every name appears with its max printed to 6 significant digits."""
    r = call("formats")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["name", "bits"]
    for name in formats.names():
        row = next(line for line in lines if line.split()[0] == name)
        assert f"{formats.get(name).max:.6g}" in row.split()


def test_formats_json_round_trips_the_derived_values() -> None:
    """Oracle: FormatSpec.to_dict of each registered format."""
    r = call("formats", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["name"] for d in data] == formats.names()
    for d in data:
        assert d == json.loads(json.dumps(formats.get(d["name"]).to_dict()))


def test_version_and_help() -> None:
    """Oracle: lowprec.__version__ and argparse's usage line."""
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lowprec {lowprec.__version__}"
    h = call("--help")
    assert h.returncode == 0 and "formats" in h.stdout and "demo" in h.stdout


def test_user_errors_exit_2_without_traceback() -> None:
    """Oracle: the CLI contract (one-line message on stderr, exit status 2, no traceback): one real subprocess,
    the other cases in-process through the same ``main``."""
    r = run_cli("quant-demo", "--seed", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("lowprec: error:"), r.stderr
    for args in (("demo", "--steps", "0"), ("nonsense",), ()):
        c = call(*args)
        assert c.returncode == 2, (args, c.returncode, c.stderr)
        assert "Traceback" not in c.stderr


def test_quant_demo_prints_every_spec_and_the_stochastic_rounding_example() -> None:
    """Oracle: QuantSpec.names() and the fp16 1024 + 0.5 x 2048 example (nearest stays at 1024)."""
    r = call("quant-demo")
    assert r.returncode == 0, r.stderr
    for name in lowprec.QuantSpec.names():
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines()), name
    assert "nearest-even: 1024.0" in r.stdout


def test_recipes_lists_every_recipe_and_shows_one_as_loadable_toml() -> None:
    """Oracle: lowprec.recipes.names() and Recipe.from_toml of the printed text equals the built-in recipe."""
    r = call("recipes")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines()]
    assert listed == lowprec.recipes.names()
    r = call("recipes", "--show", "fp8-delayed")
    assert r.returncode == 0, r.stderr
    assert lowprec.Recipe.from_toml(r.stdout) == lowprec.recipes.get("fp8-delayed")
    r = call("recipes", "--show", "no-such-recipe")
    assert r.returncode == 2 and "valid names" in r.stderr and "Traceback" not in r.stderr


def test_progress_without_a_terminal_prints_at_a_steady_interval(monkeypatch) -> None:
    """Oracle: a fake clock.  Without a terminal a line comes every 10% of the steps or every ``interval_s``
    seconds, whichever is first: at 5 s a step and 30 s, every 6th step (not only every 100th of 1000); at 0.01 s a
    step, every 10%.  Each line has step/total, the rate and the loss; ``note`` prints one line of its own."""
    import io

    from lowprec.runs import _progress

    clock = [0.0]
    monkeypatch.setattr(_progress.time, "perf_counter", lambda: clock[0])
    for dt, total, expect in ((5.0, 1000, [6 * k for k in range(1, 9)]), (0.01, 100, [10, 20, 30, 40, 50])):
        clock[0] = 0.0
        out = io.StringIO()
        bar = _progress.Progress("run seed 0", total, stream=out)
        assert bar.interval_s == _progress.INTERVAL_S == 30.0
        bar.note("compiling the JAX step (first step)...")
        for step in range(1, 51):
            clock[0] += dt
            bar.update(step, loss=1.0 / step)
        lines = out.getvalue().splitlines()
        assert lines[0] == "run seed 0: compiling the JAX step (first step)..."
        steps = [int(ln.split("] ")[1].split("/")[0]) for ln in lines[1:]]
        assert steps == expect, (dt, steps)
        assert f"{expect[0]}/{total} " in lines[1] and "it/s" in lines[1] and f"loss {1.0 / expect[0]:.4g}" in lines[1]
    quiet = io.StringIO()
    bar = _progress.Progress("x", 10, stream=quiet, enabled=False)
    bar.note("hidden")
    bar.update(10, loss=1.0)
    assert quiet.getvalue() == ""
