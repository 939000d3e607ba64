# OpenTinker developer commands. Everything runs from a venv in .venv that `make install` makes.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 has a local CPU wheel here; any other spec pulls GBs of CUDA packages.
CONSTRAINTS := .ci/constraints.txt
PROTO_FILES := $(shell find protos -name '*.proto')

.PHONY: install protos demo test lint bench clean

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

lint: install
	$(BIN)/ruff check sdk services tests bench tools
	$(BIN)/mypy sdk/opentinker/client.py sdk/opentinker/spec.py sdk/opentinker/spec_rl.py sdk/opentinker/jobs.py sdk/opentinker/cli.py sdk/opentinker/admin.py sdk/opentinker/admin_cli.py sdk/opentinker/auth.py sdk/opentinker/connection.py sdk/opentinker/infer_cli.py sdk/opentinker/inference_rows.py sdk/opentinker/spec_inference.py sdk/opentinker/spec_parts.py sdk/opentinker/spec_sft.py sdk/opentinker/session_config.py sdk/opentinker/training_session.py sdk/opentinker/sinks.py sdk/opentinker/live_view.py sdk/opentinker/plot.py sdk/opentinker/console.py sdk/opentinker/charts.py

bench: install
	$(BIN)/python bench/step_breakdown.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs
