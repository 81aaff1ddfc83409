# The two commands in the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
PORT ?= 8765
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: install run test lint bench clean

install:
	PYTHON=$(PY) scripts/install.sh

run: install
	$(VENV)/bin/rtts serve --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/python -m pytest -q --timeout 300 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check rtts tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
