# Two commands from a fresh clone: `make demo` and `make test`.  Both create .venv and install the pinned
# dependencies first (requirements.lock); nothing but python3 (>= 3.11) is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowprec demo

test: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_train.py --threads 1

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
