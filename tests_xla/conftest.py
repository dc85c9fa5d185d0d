"""The PyTorch/XLA suite (``make test-xla``): lowprec on torch_xla's lazy XLA device against eager CPU.

Runs in its own environment (.venv-xla: torch 2.9.0 + torch_xla 2.9.0, requirements-xla.lock); the default
``make test`` never collects this folder (pyproject's ``testpaths`` is ``tests``).  Without torch_xla every
module here is skipped with the reason (``_helpers.torch_xla``).  ``PJRT_DEVICE`` defaults to CPU and
``XLA_FLAGS`` to ``--xla_cpu_max_isa=AVX`` (no fused multiply-add; set before torch_xla is imported).  The
quantizers run eagerly on CPU tensors unless a test says otherwise (as in tests/conftest.py); on XLA tensors
they trace into the XLA graph whatever the backend setting.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA's CPU code generator contracts a * b + c into a fused multiply-add (one rounding where torch on the CPU rounds
# twice): the optimizer's updates would differ in the last bit.  Without AVX2's FMA instructions it cannot.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_max_isa=AVX")


@pytest.fixture(autouse=True)
def _eager_backend() -> Iterator[None]:
    import lowprec

    with lowprec.quant.backend("eager"):
        yield
