# Two commands for a fresh machine: `make demo` (local P/D stack on CPU) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

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
	@$(PY) -m pytest -q --durations=30

test-fast: setup
	@$(PY) -m pytest -q -m "not slow"

lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check . || true

clean:
	rm -rf .pytest_cache build *.egg-info
