# Two commands from a fresh clone: `make demo` and `make test`.  Both create .venv and install the pinned
# dependencies first (requirements.lock); nothing but python3 (>= 3.11) is needed.  `make lint` runs ruff and mypy
# from their own venv (.venv-lint, pinned in requirements-lint.txt); mypy checks src against .venv's packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINT_VENV := .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed

.PHONY: demo test test-slow test-all test-xla lint bench clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# PyTorch/XLA: its own venv (torch 2.9.0 + torch_xla 2.9.0, pinned in requirements-xla.lock; a CUDA build of torch
# from PyPI, about 7 GB, that runs on the CPU).  `make test` does not need it.
$(XLA_STAMP): pyproject.toml requirements-xla.lock
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-xla.lock
	$(XLA_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(XLA_STAMP)

$(LINT_STAMP): requirements-lint.txt
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-lint.txt
	touch $(LINT_STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowprec demo

# `make test`: everything but the tests marked slow (pyproject's addopts: -m "not slow"), under 10 minutes on
# 2 cores.  `make test-slow`: the slow ones (torch.compile kernels, torchrun process groups, full Trainer and
# Lightning fits, JAX-vs-torch training runs); CI runs both.
test: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest

test-slow: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest -m slow

test-all: test test-slow

# `make test-xla`: tests_xla/ on torch_xla's CPU device (PJRT_DEVICE=CPU), in .venv-xla.
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU OMP_NUM_THREADS=2 $(XLA_VENV)/bin/python -m pytest tests_xla

lint: $(LINT_STAMP) $(STAMP)
	$(LINT_VENV)/bin/ruff check src tests benchmarks
	$(LINT_VENV)/bin/mypy --python-executable $(PY) src

bench: $(STAMP)
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_train.py --threads 1
	$(PY) benchmarks/accumulator_error.py
	$(PY) benchmarks/bench_jax.py
	$(PY) benchmarks/bench_transformers.py --threads 1
	$(PY) benchmarks/bench_inference.py --threads 1

clean:
	rm -rf $(VENV) $(LINT_VENV) $(XLA_VENV) .pytest_cache build src/*.egg-info
