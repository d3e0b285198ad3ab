# Two commands do all set-up: `make run` and `make test`. Both create .venv (Python 3.12, pinned
# requirements) when it is missing or requirements.txt changed, then run.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

# A Python 3.12 interpreter: python3.12 on PATH if it really runs (a pyenv shim may not), else pyenv's.
PYTHON312 ?= $(shell \
  if python3.12 -c 'import sys' >/dev/null 2>&1; then command -v python3.12; \
  elif command -v pyenv >/dev/null 2>&1 && ls -d "$$(pyenv root)"/versions/3.12*/bin/python3.12 >/dev/null 2>&1; then \
    ls -d "$$(pyenv root)"/versions/3.12*/bin/python3.12 | sort -V | tail -n 1; \
  elif ls -d "$$HOME"/.pyenv/versions/3.12*/bin/python3.12 >/dev/null 2>&1; then \
    ls -d "$$HOME"/.pyenv/versions/3.12*/bin/python3.12 | sort -V | tail -n 1; \
  fi)

ARGS ?=

.PHONY: run test venv clean
venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	@if [ -z "$(PYTHON312)" ]; then echo "error: no Python 3.12 found (install python3.12, or pyenv install 3.12)"; exit 1; fi
	@if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
	  echo "creating $(VENV) with $(PYTHON312)"; rm -rf $(VENV); $(PYTHON312) -m venv $(VENV); fi
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $@

run: venv
	$(PY) -m strata_jax.decode $(ARGS)

# The suite is one pytest command: its tests spread over one worker process per core (pytest-xdist; a file's tests
# stay on one worker, so its module-scoped engines are built once; the slowest files first, in conftest's order,
# not xdist's default of the files with most tests first). A process that kept every engine it built faulted in
# XLA past Linux's limit of 65530 memory maps (benchmarks/results/NOTES.md item 7): tests/conftest.py frees JAX's
# caches and old engines between test files (past 18000 maps) and before that limit (engine_factory, past 30000).
# The test processes compile without XLA's persistent cache; their engines share executables in memory
# (graphs.compile_shared). TEST_WORKERS=1: one worker process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests $(ARGS)

clean:
	rm -rf $(VENV) .cache
