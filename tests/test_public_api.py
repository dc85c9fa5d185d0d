"""The public faces of the packages and the CLI's error contract (issue 16, section 1).

Oracles: ``__all__`` against what each name resolves to; ``sys.modules`` of a fresh interpreter; the text of the
docs and examples (no import of a private module); the CLI's exit status and stderr for a user error versus a
bug.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lowprec
from lowprec import accuracy, cli, runs
from lowprec.runs import StoreError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


@pytest.mark.parametrize("package", [lowprec, accuracy, runs])
def test_every_public_name_resolves_and_is_documented(package) -> None:
    for name in package.__all__:
        value = getattr(package, name)
        if callable(value) and not isinstance(value, type(lowprec)):
            assert value.__doc__ and value.__doc__.strip(), f"{package.__name__}.{name} has no docstring"
    assert sorted(package.__all__) == sorted(set(package.__all__))


def test_accuracy_and_runs_import_without_torch() -> None:
    code = ("import sys, json; import lowprec.accuracy, lowprec.runs, lowprec.cli; "
            "print(json.dumps(sorted(m for m in ('torch', 'jax') if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_accuracy_never_imports_the_runner() -> None:
    """Oracle: the source of every module of lowprec.accuracy: it reads runs (the store, the config) and never
    trains, so no module imports the runners, the zoo, torch or the torch-based packages (even lazily, inside a
    function)."""
    banned = re.compile(r"^\s*(from|import)\s+(torch|jax|\.\.runs\._(runner|jax_runner|seeds|launch)|\.\.runs\.zoo|"
                        r"\.\.runs import (zoo|run_config|train_baseline)|\.\.(numerics|nn|optim|distributed))\b",
                        re.M)
    for p in (SRC / "lowprec" / "accuracy").glob("*.py"):
        hits = banned.findall(p.read_text())
        assert not hits, f"{p.name} imports {hits}"


def test_no_doc_or_example_imports_a_private_module() -> None:
    """Oracle: every ``import``/``from`` line in a fenced Python block of README.md and docs/*.md, and every
    import of benchmarks/ examples shown to users (examples/), names only public modules."""
    private = re.compile(r"^\s*(?:from|import)\s+(lowprec(?:\.\w+)*\._\w+)", re.M)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            assert not private.findall(block), f"{page.name} imports {private.findall(block)}"
    for ex in sorted((ROOT / "examples").rglob("*.py")) if (ROOT / "examples").is_dir() else []:
        assert not private.findall(ex.read_text()), f"{ex} imports {private.findall(ex.read_text())}"


def test_store_errors_are_usage_errors() -> None:
    assert issubclass(StoreError, lowprec.UsageError) and issubclass(lowprec.UsageError, ValueError)


def test_cli_prints_a_usage_error_in_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["runs", "list", "--store", str(tmp_path / "missing.db")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("lowprec: error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_lets_a_bug_keep_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: a ValueError that is not a UsageError (a bug inside a command) propagates out of ``main``, so the
    process prints its traceback, instead of being dressed up as a usage error with exit 2."""
    from lowprec.cli import _runs

    def broken(args):
        raise ValueError("internal invariant broken")

    monkeypatch.setattr(_runs, "cmd_runs_list", broken)
    with pytest.raises(ValueError, match="internal invariant broken"):
        cli.main(["runs", "list"])


def test_python_m_lowprec_cli_runs_the_command() -> None:
    r = subprocess.run([sys.executable, "-m", "lowprec.cli", "--version"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert r.returncode == 0 and r.stdout.startswith("lowprec "), r.stderr
