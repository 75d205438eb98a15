# Two stages: `make precompute DATA=...` encodes a dataset into the cache, `make train` trains from it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU wheel on CPU-only build machines and to the CUDA build from PyPI
# elsewhere; override (e.g. TORCH_SPEC="torch==2.13.0 --index-url ...") for another CUDA version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
MODEL ?= tiny-sana
CACHE ?= cache/$(MODEL)
NPROC ?= 1
RUN ?= runs/$(MODEL)
STEPS ?= 200
PRECISION ?= bf16
PRECOMPUTE_ARGS ?=
TRAIN_ARGS ?=
# one process, or torchrun with NPROC processes on this node
LAUNCH = $(if $(filter 1,$(NPROC)),$(PY),$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC))

.PHONY: install test bench precompute train clean

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
	$(PY) bench/precompute.py
	$(PY) bench/train_step.py --workers 0

precompute: install
	@test -n "$(DATA)" || { echo "usage: make precompute DATA=<folder or tars> [MODEL=$(MODEL)] [CACHE=$(CACHE)] [NPROC=1]"; exit 2; }
	$(LAUNCH) -m precompute "$(DATA)" --model $(MODEL) --cache $(CACHE) $(PRECOMPUTE_ARGS)

train: install
	$(PY) -m train --model $(MODEL) --cache $(CACHE) --run $(RUN) --steps $(STEPS) --precision $(PRECISION) $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
