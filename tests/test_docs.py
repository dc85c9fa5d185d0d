"""docs/recipes.md is current with the recipe objects, and its TOML and Python examples run.

Oracle: docs/gen_recipes_table.py --check, which regenerates the tables from lowprec.recipes and executes every
example block of the page.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recipes_page_is_current_and_its_examples_run() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_recipes_table.py"), "--check", str(ROOT / "docs" / "recipes.md")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
