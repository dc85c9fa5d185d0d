"""Every optional dependency the code imports is declared by an extra (``pip install lowprec[jax]`` then
``import lowprec.jax`` works), and the core never imports one at module level.

Oracle: the import statements of the source tree (scanned as text) against ``[project.optional-dependencies]``
of pyproject.toml, parsed with tomllib; a fresh interpreter's ``sys.modules`` after ``import lowprec`` and its
torch-free public packages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# import name -> (distribution, the extra that must declare it)
OPTIONAL = {"jax": ("jax", "jax"), "optax": ("optax", "jax"), "tensorboard": ("tensorboard", "tensorboard"),
            "mlflow": ("mlflow-skinny", "mlflow"), "transformers": ("transformers", "transformers"),
            "psycopg": ("psycopg", "postgresql")}
_IMPORT = re.compile(r"^(\s*)(?:import|from) (\w+)\b", re.M)


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_every_optional_import_is_declared_by_its_extra() -> None:
    extras = _extras()
    found = set()
    for path in (SRC / "lowprec").rglob("*.py"):
        for _, name in _IMPORT.findall(path.read_text()):
            if name in OPTIONAL:
                found.add(name)
                dist, extra = OPTIONAL[name]
                assert extra in extras, f"{path.relative_to(SRC)} imports {name}: no extra {extra!r}"
                assert dist in {_dist(r) for r in extras[extra]}, f"extra {extra!r} lacks {dist} ({path.name})"
    assert {"jax", "tensorboard", "mlflow"} <= found  # the scan sees the optional parts (a guard on the regex)
    (self_ref,) = extras["all"]  # "lowprec[a,b,...]": every extra but the test one
    named = set(re.fullmatch(r"lowprec\[([\w,]+)\]", self_ref).group(1).split(","))  # type: ignore[union-attr]
    assert named == set(extras) - {"all", "test"}, (named, sorted(extras))


def test_optional_packages_are_imported_only_inside_optional_modules() -> None:
    """Module-level imports of an optional package live only in the packages that need it (lowprec.jax, the JAX
    runner and models, lowprec.integrations); everywhere else they are inside a function."""
    allowed = ("lowprec/jax/", "lowprec/runs/_jax_", "lowprec/integrations/")
    for path in (SRC / "lowprec").rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for indent, name in _IMPORT.findall(path.read_text()):
            if name in OPTIONAL and not indent:
                assert rel.startswith(allowed), f"{rel} imports {name} at module level"


def test_core_imports_no_optional_package() -> None:
    code = ("import sys, json, lowprec, lowprec.accuracy, lowprec.runs, lowprec.formats, lowprec.recipes; "
            f"print(json.dumps(sorted(m for m in {sorted(OPTIONAL)!r} if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_every_c_source_ships_as_package_data() -> None:
    """The native kernels are compiled from their C sources at first use: every ``.c`` file under src/lowprec must
    match a ``package-data`` pattern, or an installed (non-editable) lowprec silently falls back to the slow
    tensor routes (as it did for ``_native_group.c`` and ``_native_accum.c`` before the glob)."""
    import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["lowprec"]
    pkg = ROOT / "src" / "lowprec"
    sources = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.c"))
    assert sources, "no C sources found"
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)]
    assert not missing, f"C sources not in [tool.setuptools.package-data]: {missing}"
