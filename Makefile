# The README's commands: `make demo` runs the main job, `make test` runs the tests,
# `make bench` the efficiency sweep (the published Linformer packages, in the dev extra, beside ours).
# Each creates .venv on first use: the pinned CPU torch wheel first, then the package.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=  # e.g. https://download.pytorch.org/whl/cpu for the CPU build on any Linux
ARGS ?=  # flags for `linformer demo`, e.g. make demo ARGS="--steps 100"
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-all demo bench lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m ""

demo: setup
	$(BIN)/linformer demo $(ARGS)

bench: setup
	$(BIN)/linformer bench --peers --out benchmarks/bench

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format: setup
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .hypothesis
