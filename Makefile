# Every target runs inside .venv, which `make setup` creates and fills.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-chaos test-all lint bench train-model profile clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/dls up

test: setup
	$(PY) -m pytest -q

# Fault injection (tests/chaos): workers, scheduler, gateway, a NATS node and Redis killed under load,
# plus an overload burst; writes chaos-report.json and fails on any lost or duplicated request.
test-chaos: setup
	$(PY) -m tests.chaos

test-all: setup
	$(PY) -m pytest -q -m ''

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m bench.engine --json runs/bench-engine.json

train-model: setup
	$(VENV)/bin/dls train-model

profile: setup
	$(VENV)/bin/dls profile

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
