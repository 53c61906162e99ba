# `make demo` and `make test` work on a fresh machine: they create .venv/ here and
# install everything into it. uv is used because it installs the ~4 GiB torch wheel set
# (PyPI's Linux torch carries CUDA libraries) in seconds from its cache in ~/.cache/uv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.8
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit crd clean
venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/rlhfctl run examples/local-grpo.yaml --output runs/demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest tests

crd: $(STAMP)
	$(BIN)/rlhfctl crd > crds/rlhfjobs.yaml

clean:
	rm -rf $(VENV) runs

include tests/cluster/cluster.mk
include charts/chart.mk
