# Two stages: `make precompute DATA=...` encodes a dataset into the cache, `make train` trains from it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU wheel on CPU-only build machines and to the CUDA build from PyPI
# elsewhere; override (e.g. TORCH_SPEC="torch==2.13.0 --index-url ...") for another CUDA version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test files run in parallel worker processes (pytest-xdist), each file's tests in one worker so a
# module's fixtures (trained runs, encoded folders) are built once.
TEST_WORKERS ?= 2
# Passed to the stages only when set, so their own defaults (and --config files) decide the rest:
# MODEL (tiny-sana), CACHE (cache/MODEL), RUN (runs/MODEL), STEPS, PRECISION, PARALLEL.
MODEL ?=
CACHE ?=
RUN ?=
STEPS ?=
PRECISION ?=
PARALLEL ?=
NPROC ?= 1
NNODES ?= 1
RDZV_ENDPOINT ?= localhost:29400
RDZV_ID ?= cachedit
PRECOMPUTE_ARGS ?=
TRAIN_ARGS ?=
# One process; torchrun with NPROC processes on this node; or, with NNODES > 1, NPROC per node on every
# node, which meet at RDZV_ENDPOINT (host:port of any one of them) through torchrun's c10d rendezvous.
TORCHRUN = $(PY) -m torch.distributed.run
ifeq ($(NNODES),1)
LAUNCH = $(if $(filter 1,$(NPROC)),$(PY),$(TORCHRUN) --standalone --nproc_per_node $(NPROC))
else
LAUNCH = $(TORCHRUN) --nnodes $(NNODES) --nproc_per_node $(NPROC) --rdzv_backend c10d --rdzv_endpoint $(RDZV_ENDPOINT) --rdzv_id $(RDZV_ID)
endif

DEMO ?= demo
DEMO_PROMPTS = --validation-prompt "a large red circle on a blue background" \
	--validation-prompt "a small yellow square on a black background" \
	--validation-prompt "a large white triangle on a green background"

DEMO_VIDEO ?= demo-video
DEMO_VIDEO_PROMPTS = --validation-prompt "a red circle moving left to right on a blue background" \
	--validation-prompt "a yellow square moving top to bottom on a black background" \
	--validation-prompt "a white triangle moving right to left on a green background"

PLAN_ARGS ?=
# `--flag value` when value is set, nothing otherwise
option = $(if $(2),$(1) $(2))
# Cache sizes of the scale benchmark (make bench); SCALE_SIZES=10000,100000,1000000 adds the 1M-sample cache (~9 min more).
SCALE_SIZES ?= 10000,100000
# Stage one's "nothing changed" decision over 10M inputs (make bench) reads a 10M-sample cache kept here: the first
# `make bench-decide` builds it (about an hour, 13 GB), every later run measures it in about a minute.
SCALE_DECIDE_DIR ?= .bench/scale

.PHONY: install lint test test-fast test-slow fuzz bench bench-decide precompute train plan demo demo-video clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

lint: install
	$(PY) -m ruff check .

# `make test` is the lint and the quick suite (under 10 minutes on 2 cores); `make test-fast` the tests that start no
# model (the format, the readers, the options; about 2 minutes); `make test-slow` the slower end-to-end tests
# (torchrun runs, the memory planner's real-size plans); CI runs `make test` and `make test-slow`.
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not model" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow $(PYTEST_ARGS)

# Random operations on a cache checked against a model of every generation (tests/format_fuzz.py); prints each
# failing seed with its trace and replay command. FUZZ_KINDS=all adds the kinds of damage left out of `make test`.
FUZZ_CASES ?= 3000
FUZZ_SEED ?= 0
FUZZ_KINDS ?=
fuzz: install
	$(PY) -m tests.format.format_fuzz --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) --keep-going $(call option,--kinds,$(FUZZ_KINDS))

bench: install
	$(PY) bench/shards_read.py
	$(PY) bench/writer.py
	$(PY) bench/data_path.py
	$(PY) bench/precompute.py
	$(PY) bench/encoder_busy.py
	$(PY) bench/train_step.py
	$(PY) bench/syncs.py
	$(PY) bench/tread.py
	$(PY) bench/scale.py --sizes $(SCALE_SIZES)
	@if [ -d "$(SCALE_DECIDE_DIR)/cache-10000000-10000" ]; then $(MAKE) --no-print-directory bench-decide; \
	else echo "10M-input decision: no cache in $(SCALE_DECIDE_DIR); 'make bench-decide' builds it once (about an hour) and measures"; fi
	$(PY) bench/video.py
	$(PY) bench/video_isolation.py
	$(PY) bench/texts_scale.py

bench-decide: install
	$(PY) bench/scale.py --decide-only --sizes 10000000 --samples-per-shard 10000 --out $(SCALE_DECIDE_DIR) --keep

precompute: install
	@test -n "$(DATA)" || { echo "usage: make precompute DATA=<folder, metadata file or tars> [MODEL=tiny-sana] [CACHE=cache/MODEL] [NPROC=1]"; exit 2; }
	$(LAUNCH) -m precompute "$(DATA)" $(call option,--model,$(MODEL)) $(call option,--cache,$(CACHE)) $(PRECOMPUTE_ARGS)

train: install
	$(LAUNCH) -m train $(call option,--model,$(MODEL)) $(call option,--cache,$(CACHE)) $(call option,--run-dir,$(RUN)) \
		$(call option,--steps,$(STEPS)) $(call option,--precision,$(PRECISION)) $(call option,--parallel,$(PARALLEL)) $(TRAIN_ARGS)

plan: install
	@test -n "$(MODEL)" || { echo "usage: make plan MODEL=<preset> [PLAN_ARGS='--batch-size 4 ...']"; exit 2; }
	$(PY) -m train plan $(MODEL) $(PLAN_ARGS)

# The whole path offline on a generated sample: data -> stage one -> stage two with validation grids.
# The tiny preset's VAE and text encoder have random weights: the grids show the mechanics, not art.
demo: install
	$(PY) -m precompute.sample_data $(DEMO)/data --count 96
	$(PY) -m precompute $(DEMO)/data --model tiny-sana --cache $(DEMO)/cache $(DEMO_PROMPTS)
	rm -rf $(DEMO)/run
	$(PY) -m train --model tiny-sana --cache $(DEMO)/cache --run-dir $(DEMO)/run --steps 400 --batch-size 8 --lr 1e-3 \
		--warmup-steps 20 --ema-decay 0.99 --checkpoint-every 200 --validate-every 200 --validation-steps 20 --log-every 20
	@echo
	@echo "demo done:"
	@echo "  sample grids   $$(ls $(DEMO)/run/samples-*.png | tr '\n' ' ')"
	@echo "  loss curve     $(DEMO)/run/loss.png"
	@echo "  metrics        $(DEMO)/run/metrics.jsonl"
	@echo "  checkpoints    $$(ls -d $(DEMO)/run/checkpoints/step-* | tr '\n' ' ')"
	@echo "  cache          $(DEMO)/cache (inspect: $(PY) -m shards inspect $(DEMO)/cache)"

# The video path offline: generated clips of moving shapes -> a tiny-wan cache (17- and 33-frame clips at 16 fps, four
# encoded at a time) -> training with validation videos (an mp4 per prompt beside a PNG contact sheet). The tiny
# encoders have random weights: the videos show the mechanics, not motion.
demo-video: install
	$(PY) -m precompute.sample_video $(DEMO_VIDEO)/data --count 48
	$(PY) -m precompute $(DEMO_VIDEO)/data --model tiny-wan --cache $(DEMO_VIDEO)/cache --frames 33 --batch-size 4 \
		$(DEMO_VIDEO_PROMPTS)
	rm -rf $(DEMO_VIDEO)/run
	$(PY) -m train --model tiny-wan --cache $(DEMO_VIDEO)/cache --run-dir $(DEMO_VIDEO)/run --steps 400 --batch-size 4 \
		--lr 1e-3 --warmup-steps 20 --ema-decay 0.99 --checkpoint-every 200 --validate-every 200 --validation-steps 20 \
		--log-every 20
	@echo
	@echo "video demo done:"
	@echo "  videos (mp4)    $$(ls $(DEMO_VIDEO)/run/samples/*/*.mp4 | tr '\n' ' ')"
	@echo "  contact sheets  $$(ls $(DEMO_VIDEO)/run/samples/*/contact-sheet.png | tr '\n' ' ')"
	@echo "  loss curve      $(DEMO_VIDEO)/run/loss.png"
	@echo "  metrics         $(DEMO_VIDEO)/run/metrics.jsonl"
	@echo "  checkpoints     $$(ls -d $(DEMO_VIDEO)/run/checkpoints/step-* | tr '\n' ' ')"
	@echo "  cache           $(DEMO_VIDEO)/cache (inspect: $(PY) -m shards inspect $(DEMO_VIDEO)/cache)"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
