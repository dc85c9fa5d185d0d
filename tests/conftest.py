"""Shared test set-up: quantizers run eagerly unless a test opts into compiled kernels.

Tests that compare eager and compiled kernels switch explicitly with ``lowprec.quant.backend(...)``; everything
else stays eager so that no test pays for, or depends on, torch.compile by accident.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lowprec


@pytest.fixture(autouse=True)
def _eager_backend() -> Iterator[None]:
    with lowprec.quant.backend("eager"):
        yield
