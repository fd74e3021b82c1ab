# Operator targets (crds, verify): included by the top-level Makefile.
# The CRDs under crds/ are generated from operator/tpusync_operator/models.py.
.PHONY: crds verify operator-test

crds: install
	$(PY) -m tpusync_operator.crdgen --out crds

# Regenerate into a temporary directory and fail on any difference with crds/.
verify: install
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m tpusync_operator.crdgen --out "$$tmp" || exit 1; \
	status=0; for f in "$$tmp"/*.yaml; do \
	  diff -u "crds/$$(basename "$$f")" "$$f" || status=1; \
	done; \
	if [ $$status -ne 0 ]; then echo "crds/ differs from the models: run 'make crds'" >&2; exit 1; fi; \
	echo "crds/ matches the models"

operator-test: install
	$(PY) -m pytest -q tests/unit/operator
