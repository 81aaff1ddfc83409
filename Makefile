# The two commands in the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
PORT ?= 8765
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: install run test lint types clean

install:
	PYTHON=$(PY) scripts/install.sh

run: install
	$(VENV)/bin/rtts serve --host $(HOST) --port $(PORT)

test: install
	@if command -v node >/dev/null; then node --test web/test/; else echo "node not found: skipping web/test"; fi
	$(VENV)/bin/python -m pytest -q --timeout 300 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check rtts tests
	$(VENV)/bin/mypy

types:  # regenerate web/types/*.d.ts from the JSDoc
	cd web && npm ci --no-audit --no-fund && npx tsc

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
