# tpusync: `make test` and `make demo` bootstrap everything they need from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CACHE := $(HOME)/.cache/tpusync
export PIP_CACHE_DIR := $(CACHE)/pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
BUILD_DEPS := scikit-build-core==0.11.6 pybind11==3.0.1
NATIVE_SRCS := $(shell find native -type f \( -name '*.cc' -o -name '*.h' -o -name 'CMakeLists.txt' \)) CMakeLists.txt pyproject.toml

.PHONY: all test demo install native-test pytest bench clean system-deps

all: test

include operator/operator.mk e2e/e2e.mk

# Debian packages the native build needs (header-only xxHash). Installs them when missing.
system-deps:
	@test -f /usr/include/xxhash.h || { \
	  echo "installing libxxhash-dev"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libxxhash-dev; }

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_DEPS)
	touch $@

# Editable install: Python edits are live; the native extension rebuilds when its sources change.
$(VENV)/.installed: $(VENV)/.created $(NATIVE_SRCS) | system-deps
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# C++ unit tests, twice: optimised, and with AddressSanitizer + UndefinedBehaviorSanitizer.
native-test: system-deps
	cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTPUSYNC_BUILD_TESTS=ON >/dev/null
	cmake --build build/native
	ctest --test-dir build/native --output-on-failure
	cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTPUSYNC_BUILD_TESTS=ON -DTPUSYNC_SANITIZE=ON >/dev/null
	cmake --build build/asan
	ctest --test-dir build/asan --output-on-failure

pytest: install
	$(PY) -m pytest -q

test: native-test pytest

demo: install
	$(PY) bench/native_bench.py

bench: install
	$(PY) bench/native_bench.py

clean:
	rm -rf build $(VENV)
