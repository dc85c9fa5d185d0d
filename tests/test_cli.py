"""The ``lowprec`` command line, run as a real subprocess (oracle: the FormatSpec registry and exit codes)."""

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


def test_formats_table_lists_every_format_with_its_limits() -> None:
    """Oracle: the registry; every name appears with its max printed to 6 significant digits."""
    r = run_cli("formats")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["name", "bits"]
    for name in formats.names():
        row = next(line for line in lines if line.split()[0] == name)
        assert f"{formats.get(name).max:.6g}" in row.split()


def test_formats_json_round_trips_the_derived_values() -> None:
    """Oracle: FormatSpec.to_dict of each registered format."""
    r = run_cli("formats", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["name"] for d in data] == formats.names()
    for d in data:
        assert d == json.loads(json.dumps(formats.get(d["name"]).to_dict()))


def test_version_and_help() -> None:
    """Oracle: lowprec.__version__ and argparse's usage line."""
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lowprec {lowprec.__version__}"
    r = run_cli("--help")
    assert r.returncode == 0 and "formats" in r.stdout and "demo" in r.stdout


def test_user_errors_exit_2_without_traceback() -> None:
    """Oracle: the CLI contract (one-line message on stderr, exit status 2, no traceback)."""
    for args in (("quant-demo", "--seed", "-1"), ("demo", "--steps", "0"), ("nonsense",), ()):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr


def test_quant_demo_prints_every_spec_and_the_stochastic_rounding_example() -> None:
    """Oracle: QuantSpec.names() and the fp16 1024 + 0.5 x 2048 example (nearest stays at 1024)."""
    r = run_cli("quant-demo")
    assert r.returncode == 0, r.stderr
    for name in lowprec.QuantSpec.names():
        assert any(line.startswith(name + " ") for line in r.stdout.splitlines()), name
    assert "nearest-even: 1024.0" in r.stdout


def test_recipes_lists_every_recipe_and_shows_one_as_loadable_toml() -> None:
    """Oracle: lowprec.recipes.names() and Recipe.from_toml of the printed text equals the built-in recipe."""
    r = run_cli("recipes")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines()]
    assert listed == lowprec.recipes.names()
    r = run_cli("recipes", "--show", "fp8-delayed")
    assert r.returncode == 0, r.stderr
    assert lowprec.Recipe.from_toml(r.stdout) == lowprec.recipes.get("fp8-delayed")
    r = run_cli("recipes", "--show", "no-such-recipe")
    assert r.returncode == 2 and "valid names" in r.stderr and "Traceback" not in r.stderr
