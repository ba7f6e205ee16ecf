# Every target runs inside .venv, which `make setup` creates and fills.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-chaos test-soak test-fuzz test-all lint bench bench-guard train-model profile clean

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

# The soak: open-loop load at 70% of the local stack's capacity for SOAK_MINUTES while a seeded injector
# kills and restarts workers, scheduler, predictor, reconfigurator, gateways, NATS nodes and the Redis
# primary, hangs a worker, skews a worker's clock and applies plans (none in the load's last 66.5 s, so each
# is seen to recover under load); writes soak-report.json and fails on any lost, duplicated or unanswered
# request or unrecovered fault (tests/chaos/README.md).
SOAK_MINUTES ?= 10
test-soak: setup
	$(PY) -m tests.soak --minutes $(SOAK_MINUTES) --json soak-report.json

# Schemathesis (the st CLI, unmodified) against `dls up --workers 2` for FUZZ_SECONDS with the examples,
# coverage and fuzzing phases and the status-code, content-type, response-schema and no-5xx checks; then
# a completion must still be answered correctly (tests/integration/test_schemathesis_stack.py).
FUZZ_SECONDS ?= 150
test-fuzz: setup
	DLS_FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m pytest -q -m fuzz tests/integration/test_schemathesis_stack.py

test-all: setup
	$(PY) -m pytest -q -m ''

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m bench.engine --json runs/bench-engine.json

# The headline figures (step predictor, paper-bench, paper-bench-long, both Azure traces, accuracy) measured
# at reduced sizes and held to their floors in bench/floors.toml; fails when one falls below (bench/guard.py).
bench-guard: setup
	$(PY) -m bench.guard --json runs/guard/report.json

train-model: setup
	$(VENV)/bin/dls train-model

profile: setup
	$(VENV)/bin/dls profile

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
