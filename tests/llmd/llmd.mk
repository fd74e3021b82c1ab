# The llm-d tier (tests/llmd): llm-d's own KV-cache indexer (github.com/llm-d/llm-d-kv-cache,
# pinned in tests/llmd/indexer/go.mod; built into ~/.cache/tpusync/llmd-indexer/<key>/ by
# tests/llmd/build-indexer.sh) subscribed to reference engines with real sidecars.
# Included by the top-level Makefile; `make test` runs it.
.PHONY: llmd-indexer llmd-test llmd-operator-test

llmd-indexer:
	nice -n 19 bash tests/llmd/build-indexer.sh

# test_llmd_operator.py (the operator's EPP parameters against its engines) fails today: the
# builders render blockSize 64 for 32-token pages, no tier weights, and decode topics on the
# engine's port instead of the pool's. It runs in `make llmd-operator-test` and joins
# llmd-test when the builders agree (issue 13).
LLMD_RUN = TPUSYNC_LLMD_INDEXER=$$(bash tests/llmd/build-indexer.sh --print) $(PY) -m pytest -q

llmd-test: llmd-indexer install
	$(LLMD_RUN) tests/llmd --ignore=tests/llmd/test_llmd_operator.py

llmd-operator-test: llmd-indexer install
	$(LLMD_RUN) tests/llmd/test_llmd_operator.py
