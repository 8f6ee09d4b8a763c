# The README's two commands: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-stack test-compose test-slow lint fmt bench-grouping clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# torch first: the CPU wheel on disk; a bare requirement would pull CUDA builds.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	bash scripts/setup-maniskill.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/joynexus demo

# Test processes at once (pytest-xdist). Most tests wait on a server, a role's start-up or a
# redelivery: two at a time use a 2-core machine's second core (README, "Suite", has the
# times). TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 2

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow and not stack and not heavy and not compose" -q --durations=25 -n $(TEST_WORKERS)

test-stack: $(STAMP)
	TEST_WORKERS=$(TEST_WORKERS) bash scripts/test-stack.sh

# docker compose for real: an engine (installed and started when absent), the images built
# offline, the stack up, an SFT job through it, a role killed and restarted.
test-compose: $(STAMP)
	bash scripts/docker-engine.sh
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m compose -q --durations=5

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m slow -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .joynexus
