# The llm-d tier (tests/llmd): llm-d's own KV-cache indexer (github.com/llm-d/llm-d-kv-cache,
# pinned in tests/llmd/indexer/go.mod; built into ~/.cache/tpusync/llmd-indexer/<key>/ by
# tests/llmd/build-indexer.sh) subscribed to reference engines with real sidecars.
# Included by the top-level Makefile; `make test` runs it.
.PHONY: llmd-indexer llmd-test

llmd-indexer:
	nice -n 19 bash tests/llmd/build-indexer.sh

# test_llmd_operator.py checks the operator's EPP parameters against the engines it deploys.
LLMD_RUN = TPUSYNC_LLMD_INDEXER=$$(bash tests/llmd/build-indexer.sh --print) $(PY) -m pytest -q

llmd-test: llmd-indexer install
	$(LLMD_RUN) tests/llmd
