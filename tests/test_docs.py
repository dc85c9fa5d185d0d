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


def test_runs_page_config_example_is_valid() -> None:
    """Oracle: RunConfig.from_toml, the same parser `lowprec run` uses, accepts the documented example as is."""
    import re

    from lowprec import recipes
    from lowprec.runs._config import RunConfig

    text = (ROOT / "docs" / "runs.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    cfg = RunConfig.from_toml(block, where="docs/runs.md")
    assert cfg.recipe == recipes.get("fp8-tensorwise") and cfg.seeds == (0, 1, 2) and cfg.checkpoint.interval == 100
