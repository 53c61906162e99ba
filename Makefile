# `make demo` and `make test` work on a fresh machine: they create .venv/ here and
# install everything into it. uv is used because it installs the ~4 GiB torch wheel set
# (PyPI's Linux torch carries CUDA libraries) in seconds from its cache in ~/.cache/uv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.8
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit crd clean sandbox-bin
venv: $(STAMP)

# bubblewrap for the code reward's sandbox (rlhf_trainer/rewards/sandbox.py looks for it on
# PATH, then here). Fetched from Debian, not installed: no root needed to use it, and the
# tests run it both as root and as an unprivileged uid.
BWRAP_DEB_VERSION ?= 0.8.0-2+deb12u1
BWRAP_DIR := $(HOME)/.cache/rlhf-operator/bubblewrap
BWRAP := $(BWRAP_DIR)/usr/bin/bwrap
sandbox-bin: $(BWRAP)
$(BWRAP):
	@set -e; tmp=$$(mktemp -d); chmod 755 $$tmp; cd $$tmp; \
	  apt-get download -q bubblewrap=$(BWRAP_DEB_VERSION) 2>/dev/null \
	    || { apt-get update -q >/dev/null && apt-get download -q bubblewrap=$(BWRAP_DEB_VERSION); } \
	    || { echo "cannot fetch bubblewrap $(BWRAP_DEB_VERSION) with apt-get download; install bwrap on PATH or set RLHF_BWRAP" >&2; exit 1; }; \
	  rm -rf $(BWRAP_DIR); dpkg -x bubblewrap_*.deb $(BWRAP_DIR); rm -rf $$tmp
	$(BWRAP) --version

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/rlhfctl run examples/local-grpo.yaml --output runs/demo --overwrite

test: $(STAMP) sandbox-bin
	$(BIN)/python -m pytest tests

crd: $(STAMP)
	$(BIN)/rlhfctl crd > crds/rlhfjobs.yaml

clean:
	rm -rf $(VENV) runs

include tests/cluster/cluster.mk
include charts/chart.mk
