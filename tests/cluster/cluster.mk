# The test control plane (tests/cluster/): included from the main Makefile.
#   make cluster-bin    build (or find in ~/.cache/rlhf-operator/cluster-bin) the binaries
#   make cluster        start etcd, kube-apiserver, controller-manager, scheduler, kwok with
#                       CLUSTER_NODES fake 8-GPU nodes and the training-operator; kubeconfig
#                       in .cluster/kubeconfig, logs in .cluster/logs/
#   make cluster-down   stop it (logs stay)
CLUSTER_NODES ?= 4

.PHONY: cluster cluster-down cluster-bin cluster-status
cluster-bin:
	bash tests/cluster/build.sh

cluster: cluster-bin $(STAMP)
	$(BIN)/python tests/cluster/harness.py up --nodes $(CLUSTER_NODES)

cluster-down:
	$(BIN)/python tests/cluster/harness.py down

cluster-status:
	$(BIN)/python tests/cluster/harness.py status

# `make test` builds the binaries first, with the build's output on the terminal (the
# chart tests of `make test-fast` need its helm).
test test-fast: cluster-bin

# Kueue v0.17.0 for tests/cluster/test_kueue.py, in a cache of its own (a few minutes, once).
.PHONY: kueue-bin
kueue-bin:
	bash tests/cluster/kueue/build.sh
test: kueue-bin

# Kubeflow Trainer v2.3.0 (spec.backend TrainJob): built with the control plane (cluster-bin).
.PHONY: trainer-bin
trainer-bin: cluster-bin

# The LeaderWorkerSet controller v0.9.0 (rollout.nodesPerServer > 1), in a cache of its own.
.PHONY: lws-bin
lws-bin:
	bash tests/cluster/lws/build.sh
test: lws-bin

# The images the real-pod tests run (tests/cluster/test_real_pods.py): pause, bases from
# Debian's archive and PyPI, and our four images from their Dockerfiles, built by BuildKit
# (hack/images.py) into the suite's registry, cached in ~/.cache/rlhf-operator/ (a warm run
# checks a hash and builds nothing). Needs root; elsewhere it says so and the tests skip.
.PHONY: test-images
test-images: $(STAMP) node-tools
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python tests/cluster/images/build_test_images.py; \
	  else echo "test-images: not root: the real-pod tests will be skipped"; fi
test: test-images
