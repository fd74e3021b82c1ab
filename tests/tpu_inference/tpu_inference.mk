# The tpu-inference tier (tests/tpu_inference): real vLLM on tpu-inference (JAX), run on the CPU
# through the test-support plugin in tests/tpu_inference/cpu_shim. Included by the top-level
# Makefile.
#
# vllm-tpu and tpu-inference 0.32.0 install from PyPI only for Python 3.12 (pyenv has one). The
# environment (~11 GB) lives under ~/.cache/tpusync/tpu-inference/<key>, keyed by the hash of the
# pinned requirements, installed without resolution. A small 3.12 venv in build/ of this clone
# puts that environment, this clone's tpusync (built for 3.12, without tpusync's jax pin) and
# the CPU shim plugin on one interpreter.
.PHONY: tpu-inference-env tpu-inference-venv tpu-inference-test

TPUINF_REQUIREMENTS := tests/tpu_inference/requirements.txt
TPUINF_KEY := $(shell sha256sum $(TPUINF_REQUIREMENTS) | cut -c1-16)
TPUINF_ENV := $(CACHE)/tpu-inference/$(TPUINF_KEY)
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) $(shell command -v python3.12))
TPUINF_OVERLAY := build/tpu-inference-venv
TPUINF_PY := $(TPUINF_OVERLAY)/bin/python
TPUINF_PIP := -m pip install -q --isolated --cache-dir $(CACHE)/pip --disable-pip-version-check
# Build and test tools for the overlay; tpusync's own runtime needs beyond the engine's pins.
TPUINF_OVERLAY_DEPS := scikit-build-core==0.11.6 pathspec==0.12.1 pybind11==3.0.1 xxhash==3.6.0 pytest-timeout==2.4.0

$(TPUINF_ENV)/.complete: $(TPUINF_REQUIREMENTS)
	test -x $(TPUINF_ENV)/bin/python || $(PYTHON312) -m venv $(TPUINF_ENV)
	nice -n 10 $(TPUINF_ENV)/bin/python $(TPUINF_PIP) --no-deps -r $(TPUINF_REQUIREMENTS)
	touch $@

tpu-inference-env: $(TPUINF_ENV)/.complete

# The overlay: this clone's tpusync (an editable install built for 3.12 in a build dir of its own,
# without tpusync's jax pin: the engine's jax is the one that counts) and the CPU shim plugin.
$(TPUINF_OVERLAY)/.ready: $(TPUINF_ENV)/.complete $(NATIVE_SRCS) $(wildcard tests/tpu_inference/cpu_shim/*.toml) | system-deps
	$(call overlay-venv,$(TPUINF_OVERLAY),$(TPUINF_ENV)/bin/python,$(TPUINF_ENV),00-tpu-inference.pth)
	$(TPUINF_PY) $(TPUINF_PIP) --no-deps $(TPUINF_OVERLAY_DEPS)
	nice -n 10 $(TPUINF_PY) $(TPUINF_PIP) --no-deps --no-build-isolation \
	  -C build-dir=build/tpu-inference-wheel -e .
	$(TPUINF_PY) $(TPUINF_PIP) --no-deps --no-build-isolation -e tests/tpu_inference/cpu_shim
	touch $@

tpu-inference-venv: $(TPUINF_OVERLAY)/.ready

# JAX on the CPU only; the shim plugin then stands in for the TPU-only kernels. llm-d's indexer
# reads the KV events of tpusync's connector (test_tpusync_connector.py).
tpu-inference-test: $(TPUINF_OVERLAY)/.ready llmd-indexer
	JAX_PLATFORMS=cpu $(TPUINF_PY) -m pytest -q -p no:cacheprovider --timeout=900 tests/tpu_inference
