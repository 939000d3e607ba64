# OpenTinker developer commands. Everything runs from a venv in .venv that `make install` makes.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 has a local CPU wheel here; any other spec pulls GBs of CUDA packages.
CONSTRAINTS := .ci/constraints.txt
PROTO_FILES := $(shell find protos -name '*.proto')

.PHONY: install protos demo test test-fast lint bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[server,dev,textworld,adapters,cookbook]'
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1  # its tml-renderers pin is not on the index
	touch $@

install: $(VENV)/.installed

# Regenerate the Python stubs (with .pyi types) into the SDK from protos/.
protos: $(BIN)/python
	@$(BIN)/python -c 'import grpc_tools' 2>/dev/null || $(BIN)/pip install -q -c $(CONSTRAINTS) grpcio-tools==1.85.1
	$(BIN)/python tools/gen_protos.py

# The main job: start the single-node mesh, train the demo agent, exit 0 only on success.
demo: install
	$(BIN)/opentinker demo

test: install
	$(BIN)/python -m pytest -q

# The unit tier only (marker `unit`: no network, no subprocess): a quick check while editing.
test-fast: install
	$(BIN)/python -m pytest -q -m unit

lint: install
	$(BIN)/ruff check sdk services tests bench tools
	$(BIN)/mypy  # the SDK, the services, bench/ and tools/: files and paths in pyproject.toml [tool.mypy]

# The docs site (mkdocs.yml, docs/) into build/site, in strict mode: a broken link, a page
# missing from the nav or an unreadable docstring fails. Installs the `docs` extra once.
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python bench/step_breakdown.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs
