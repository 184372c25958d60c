# Two commands for a fresh machine: `make demo` (local P/D stack on CPU) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
# TEST_WORKERS=N runs the suite on N pytest-xdist workers, each file (e2e_tiny: the package)
# one unit so a stack it shares boots once (tests/conftest.py). One process is the default:
# the suite is CPU-bound engine boots, and on this 2-core machine two workers took 27 min
# against 30 serial but pushed fleets and fault checks past their bounds.
TEST_WORKERS ?= 0
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: setup models demo up test test-fast lint docs docs-build bench clean

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

# The docs site (mkdocs.yml): `make docs` serves it on http://127.0.0.1:8001 and rebuilds
# on every save, printing broken links and anchors as warnings; `make docs-build` writes it
# to site/ and fails on any warning (strict), as `make test` does (tests/test_docs_site.py).
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, printed on every build.
docs: setup
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --no-strict

docs-build: setup
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf .pytest_cache build *.egg-info site
