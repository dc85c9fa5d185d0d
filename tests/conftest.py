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
