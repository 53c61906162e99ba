# The Helm chart (charts/rlhf-operator/): included from the main Makefile.
#   make chart-schema      regenerate values.schema.json from values.yaml
#   make chart-readme      regenerate the chart's README.md (its values table) from values.yaml
#   make chart-crd         copy the generated CRD into the chart (files/, rendered by templates/crd.yaml)
#   make chart-tools       helm-unittest, built from the Go module in charts/tools/ into
#                          ~/.cache/rlhf-operator/chart-tools/<hash>/ (charts/tools/build.sh)
#   make prometheus-tools  promtool and prometheus from Debian's `prometheus` package,
#                          unpacked (not installed) into ~/.cache/rlhf-operator/ for the
#                          chart tests (`promtool check/test rules`, a real Prometheus)
PROMETHEUS_DEB_VERSION := 2.42.0+ds-5+deb12u1
PROMETHEUS_CACHE := $(HOME)/.cache/rlhf-operator/prometheus-$(PROMETHEUS_DEB_VERSION)
export RLHF_PROMETHEUS_BIN := $(PROMETHEUS_CACHE)/usr/bin

.PHONY: chart-schema chart-readme chart-crd chart-tools prometheus-tools
chart-schema: $(STAMP)
	$(BIN)/python charts/rlhf-operator/hack/values_schema.py --write

chart-readme: $(STAMP)
	$(BIN)/python charts/rlhf-operator/hack/chart_readme.py --write

chart-crd: crd
	cp crds/rlhfjobs.yaml charts/rlhf-operator/files/rlhfjobs.crd.yaml

chart-tools:
	bash charts/tools/build.sh

prometheus-tools: $(RLHF_PROMETHEUS_BIN)/promtool

$(RLHF_PROMETHEUS_BIN)/promtool:
	rm -rf $(PROMETHEUS_CACHE).tmp && mkdir -p $(PROMETHEUS_CACHE).tmp
	cd $(PROMETHEUS_CACHE).tmp && { apt-get download 'prometheus=$(PROMETHEUS_DEB_VERSION)' 2>/dev/null \
		|| { apt-get update -qq && apt-get download 'prometheus=$(PROMETHEUS_DEB_VERSION)'; }; }
	dpkg-deb -x $(PROMETHEUS_CACHE).tmp/prometheus_*.deb $(PROMETHEUS_CACHE).tmp/root
	rm -rf $(PROMETHEUS_CACHE) && mv $(PROMETHEUS_CACHE).tmp/root $(PROMETHEUS_CACHE) && rm -rf $(PROMETHEUS_CACHE).tmp
	$(RLHF_PROMETHEUS_BIN)/promtool --version | head -1

test test-fast: prometheus-tools chart-tools
