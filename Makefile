# Two stages: `make precompute DATA=...` encodes a dataset into the cache, `make train` trains from it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU wheel on CPU-only build machines and to the CUDA build from PyPI
# elsewhere; override (e.g. TORCH_SPEC="torch==2.13.0 --index-url ...") for another CUDA version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/shards_read.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
