# The SGLang tier (tests/sglang): tpusync as SGLang's HiCache L3 storage backend, against SGLang's
# real host pools and storage factory on the CPU. Included by the top-level Makefile; `make test`
# runs it.
#
# SGLang lives in a venv of its own under ~/.cache/tpusync, keyed by the versions (~150 MB, reused
# by every clone): the pinned wheel with --no-deps and what its memory-cache modules import
# (tests/sglang/requirements.txt); torch comes from the vLLM tier's environment through a .pth
# (the same torch 2.13.0, not a second copy). A small venv in build/ of this clone puts that
# environment and this clone's tpusync (the sources and the native extension built in .venv) on
# one interpreter, as the vLLM tier's overlay does.
.PHONY: sglang-env sglang-test sglang-bench

SGLANG_VERSION := 0.5.23
SGLANG_ENV := $(CACHE)/sglang-$(SGLANG_VERSION)-torch-$(VLLM_TORCH)
SGLANG_REQUIREMENTS := tests/sglang/requirements.txt
SGLANG_OVERLAY := build/sglang-venv
SGLANG_PY := $(SGLANG_OVERLAY)/bin/python

$(SGLANG_ENV)/.complete: $(SGLANG_REQUIREMENTS) $(VLLM_ENV)/.complete
	test -x $(SGLANG_ENV)/bin/python || $(PYTHON) -m venv $(SGLANG_ENV)
	$(SGLANG_ENV)/bin/python $(VLLM_PIP) --no-deps -r $(SGLANG_REQUIREMENTS)
	@lib=lib/$$($(PYTHON) -c 'import sys; print("python%d.%d" % sys.version_info[:2])')/site-packages; \
	echo "import site; site.addsitedir('$(VLLM_ENV)/$$lib')" > $(SGLANG_ENV)/$$lib/zz-vllm-torch.pth
	touch $@

sglang-env: $(SGLANG_ENV)/.complete

$(SGLANG_OVERLAY)/.ready: $(SGLANG_ENV)/.complete $(VENV)/.installed
	$(call overlay-venv,$(SGLANG_OVERLAY),$(PYTHON),$(SGLANG_ENV),00-sglang.pth,--without-pip)
	$(call overlay-tpusync,$(SGLANG_OVERLAY))
	touch $@

# test_hicache_events.py reads the backend's KV events with llm-d's own indexer (tests/llmd).
sglang-test: $(SGLANG_OVERLAY)/.ready llmd-indexer
	TPUSYNC_LLMD_INDEXER=$$(bash tests/llmd/build-indexer.sh --print) \
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider --timeout=600 tests/sglang

# The backend against a memcpy of the same pages: bench/results/sglang.json (docs/sglang.md).
sglang-bench: $(SGLANG_OVERLAY)/.ready
	$(SGLANG_PY) bench/sglang_bench.py
