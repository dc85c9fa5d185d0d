"""Shared test set-up: quantizers run eagerly unless a test opts into compiled kernels.

Tests that compare eager and compiled kernels switch explicitly with ``lowprec.quant.backend(...)``; everything
else stays eager so that no test pays for, or depends on, torch.compile by accident.

JAX tests spend most of their time in XLA compilation, so the suite turns on JAX's persistent compilation cache
(``~/.cache/lowprec/jax-compilation``, or ``$JAX_COMPILATION_CACHE_DIR``; inherited by subprocess tests): a
repeated run reuses the compiled executables (test_jax_train.py: 71 s cold, 32 s warm).  The cache changes no
result (XLA's cache key covers the program, the compiler options and the versions); delete the folder to measure
cold times.  torch's inductor keeps its own cache the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "lowprec" / "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest

import lowprec


@pytest.fixture(autouse=True)
def _eager_backend() -> Iterator[None]:
    with lowprec.quant.backend("eager"):
        yield


# -- run stores of both backends ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def postgres_server() -> str:
    """A PostgreSQL server's URL (``tests/_postgres.py``: $LOWPREC_TEST_POSTGRES, else one started here); skips
    where there is none, fails instead under LOWPREC_REQUIRE_POSTGRES=1 (CI)."""
    import _postgres

    why = _postgres.unavailable()
    if why is not None:
        if os.environ.get("LOWPREC_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"LOWPREC_REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)
    url = _postgres.postgres_url()
    assert url is not None
    return url


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on that server: one store per test, dropped afterwards."""
    import _postgres

    url = _postgres.fresh_database(postgres_server)
    yield url
    _postgres.drop_database(postgres_server, url)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a test's run store goes, once per backend: an SQLite file, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return str(request.getfixturevalue("postgres_url"))
