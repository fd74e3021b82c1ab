# Operator targets (crds, verify): included by the top-level Makefile.
# The CRDs under crds/ are generated from operator/tpusync_operator/models.py; the Helm chart
# ships a copy in charts/tpusync-operator/crds/ (Helm installs a chart's crds/ verbatim).
.PHONY: crds verify operator-test

CHART_CRDS := charts/tpusync-operator/crds

crds: install
	$(PY) -m tpusync_operator.crdgen --out crds
	mkdir -p $(CHART_CRDS) && rm -f $(CHART_CRDS)/*.yaml && cp crds/*.yaml $(CHART_CRDS)/

# Regenerate into a temporary directory and fail on any difference with crds/ or with the
# chart's copy.
verify: install
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m tpusync_operator.crdgen --out "$$tmp" || exit 1; \
	status=0; for f in "$$tmp"/*.yaml; do \
	  diff -u "crds/$$(basename "$$f")" "$$f" || status=1; \
	done; \
	if [ $$status -ne 0 ]; then echo "crds/ differs from the models: run 'make crds'" >&2; exit 1; fi; \
	if ! diff -ru "$$tmp" $(CHART_CRDS); then \
	  echo "$(CHART_CRDS)/ differs from the models: run 'make crds'" >&2; exit 1; fi; \
	echo "crds/ and $(CHART_CRDS)/ match the models"

operator-test: install
	$(PY) -m pytest -q tests/unit/operator
