# Two commands for a fresh machine: `make demo` (local P/D stack on CPU) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
# Two xdist workers: a test waiting on an engine leaves a core idle, the other worker uses it.
# Each file (e2e_tiny: the package) is one unit, so a stack it shares boots once
# (tests/conftest.py). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: setup models demo up test test-fast lint bench clean

setup:
	@bash scripts/setup.sh

models: setup
	@$(VENV)/bin/kvpush models make

demo: setup
	@$(VENV)/bin/kvpush demo

up: setup
	@$(VENV)/bin/kvpush up

test: setup
	@$(VENV)/bin/ruff check .
	@$(PY) -m pytest -q --durations=30 $(XDIST)

test-fast: setup
	@$(PY) -m pytest -q -m "not slow" $(XDIST)

lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check . || true

clean:
	rm -rf .pytest_cache build *.egg-info
