# Helm chart targets: included by the top-level Makefile.
# The chart tests use the pinned helm (v4) that `make controlplane` builds into the e2e
# control-plane cache (e2e/build-controlplane.sh); see harness/helm.py.
.PHONY: chart-test chart-lint

CHART := charts/tpusync-operator

# helm lint --strict (defaults and the CI values), then the rendering tests.
chart-test: chart-lint
	$(PY) -m pytest -q tests/unit/chart

chart-lint: controlplane install
	@helm="$(CONTROLPLANE_BIN)/helm"; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	export HELM_CACHE_HOME="$$tmp/cache" HELM_CONFIG_HOME="$$tmp/config" HELM_DATA_HOME="$$tmp/data"; \
	"$$helm" lint --strict $(CHART) && \
	"$$helm" lint --strict $(CHART) -f $(CHART)/ci/ci-values.yaml
