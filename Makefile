# tpusync: `make test` and `make demo` bootstrap everything they need from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
CACHE := $(HOME)/.cache/tpusync
export PIP_CACHE_DIR := $(CACHE)/pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
BUILD_DEPS := scikit-build-core==0.11.6 pybind11==3.0.1
# Every C++ build goes through ccache (CMake takes its launcher from the environment; so does the
# extension's build under pip): a clean clone on a machine that has built these sources before
# compiles only what changed. Paths under the checkout are hashed relative to it, so another
# clone's objects serve; the sanitizers' reports name files relative to it too.
export CCACHE_DIR := $(CACHE)/ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export CCACHE_MAXSIZE := 8G
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
export CMAKE_C_COMPILER_LAUNCHER := ccache
# Source tarballs CMake fetches (libaegis, native/cmake/aegis.cmake), kept between build trees.
export TPUSYNC_DOWNLOADS := $(CACHE)/downloads
NATIVE_SRCS := $(shell find native -type f \( -name '*.cc' -o -name '*.h' -o -name 'CMakeLists.txt' -o -name '*.cmake' \)) CMakeLists.txt pyproject.toml

.PHONY: all test check-lane engine-lane image-lane demo install lint lint-python lint-stub stubs native-test fuzz pytest bench bench-inplace profile device-carry performance-doc clean system-deps caches \
  native-deps native-test-deps fuzz-deps lint-deps pytest-deps
FUZZ_SECONDS ?= 15

all: test

include operator/operator.mk e2e/e2e.mk charts/charts.mk images/images.mk tests/overlay.mk tests/vllm/vllm.mk tests/tpu_inference/tpu_inference.mk tests/llmd/llmd.mk tests/sglang/sglang.mk

# Debian packages, per target: each installs what it needs when missing, and nothing else (make
# demo needs the native build only: no SSH server, no clang, no firewall tools).
#   native-deps (the extension and the sidecar: install, demo): a C++ compiler, CMake, Ninja,
#     ccache (every build's compiler launcher, above), xxHash (header-only), OpenSSL (HMAC for
#     peer authentication), intel-ipsec-mb (the shared tier's GMAC tags; libaegis, the data
#     port's sessions, is built from its pinned sources: native/cmake/aegis.cmake)
#   native-test-deps: and GoogleTest       fuzz-deps: and clang with its runtimes (libFuzzer)
#   lint-deps: and clang-tidy, over a compile database that has the tests (GoogleTest)
#   pytest-deps: iproute2 and iptables for the simulated-hosts fabric (harness/fabric.py),
#     sshfs and an SSH server for the sshfs shared tier (harness/sshfs.py)
#   node-deps (the real-node tier, harness/nodes.py): the CNI plugins, iptables and conntrack of a
#     node, curl for its probes, libseccomp for runc's build
# system-deps is all of them: make test's (caches, its first step, installs them up front).
NATIVE_PACKAGES := g++ cmake ninja-build ccache libxxhash-dev libssl-dev libipsec-mb-dev
NATIVE_TEST_PACKAGES := $(NATIVE_PACKAGES) libgtest-dev
FUZZ_PACKAGES := $(NATIVE_PACKAGES) clang-14 libclang-rt-14-dev
LINT_PACKAGES := $(NATIVE_TEST_PACKAGES) clang-tidy-14
PYTEST_PACKAGES := iproute2 iptables sshfs openssh-server
NODE_PACKAGES := containernetworking-plugins iptables conntrack curl libseccomp-dev iproute2 util-linux

# $(call apt-install,PACKAGES[,THEN]): installs those that are missing (with sudo unless root),
# then runs the shell command THEN.
define apt-install
@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
if [ -n "$$missing" ]; then \
  echo "installing $$missing"; \
  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; \
  $(2) \
fi
endef
# Installing openssh-server enables and starts its system service where systemd runs: stopped
# and disabled at once (the sshfs tests start an sshd of their own, on 127.0.0.1).
STOP_SSHD := case " $$missing " in *" openssh-server "*) \
  if [ -d /run/systemd/system ]; then $$SUDO systemctl disable --now ssh.service >/dev/null 2>&1 || true; fi;; esac;

native-deps:
	$(call apt-install,$(NATIVE_PACKAGES))
native-test-deps:
	$(call apt-install,$(NATIVE_TEST_PACKAGES))
fuzz-deps:
	$(call apt-install,$(FUZZ_PACKAGES))
lint-deps:
	$(call apt-install,$(LINT_PACKAGES))
pytest-deps:
	$(call apt-install,$(PYTEST_PACKAGES),$(STOP_SSHD))
node-deps:
	$(call apt-install,$(NODE_PACKAGES))
system-deps:
	$(call apt-install,$(sort $(NATIVE_TEST_PACKAGES) $(FUZZ_PACKAGES) $(LINT_PACKAGES) $(PYTEST_PACKAGES) $(NODE_PACKAGES)),$(STOP_SSHD))

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_DEPS)
	touch $@

# Editable install: Python edits are live; the native extension rebuilds when its sources change.
# It builds without isolation (BUILD_DEPS above), so a dependency published only as an sdist,
# pyaegis (the tests' wire client), is installed first at pyproject's pin, built in pip's own
# isolated environment from its build requirements (pip's cache keeps the wheel).
SDIST_DEPS := $(shell grep -o '"pyaegis==[^"]*"' pyproject.toml | tr -d '"')
$(VENV)/.installed: $(VENV)/.created $(NATIVE_SRCS) | native-deps
	$(PY) -m pip install -q $(SDIST_DEPS)
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Static checks, first in make test: ruff over every Python tree, mypy --strict over the two
# packages and import-linter's contracts (the architecture's arrows) over them, harness/ and
# tests/ (all pinned in the dev extra, configured in pyproject.toml); the bindings' stub checked
# against the built module (lint-stub); clang-tidy over native/
# (.clang-tidy; every check an error) with the compile database of a configure-only CMake tree
# that has the bindings, the tests and the fuzz targets in it (rerun when native/ changes).
LINT_PY := python operator harness tests e2e bench
lint: lint-python lint-stub build/lint/clang-tidy.ok

lint-python: install
	$(VENV)/bin/ruff check $(LINT_PY)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo --cache-dir build/import-linter

# The bindings' stub, python/tpusync/_native.pyi, is generated from the built module by
# pybind11-stubgen (pinned in the dev extra; item types from pybind11::typing in
# native/python/bindings.cc): `make stubs` rewrites it, lint-stub fails while it differs.
NATIVE_STUB := python/tpusync/_native.pyi
STUBGEN = rm -rf build/stubs && $(VENV)/bin/pybind11-stubgen tpusync._native --exit-code -o build/stubs >/dev/null
stubs: install
	$(STUBGEN)
	cp build/stubs/tpusync/_native.pyi $(NATIVE_STUB)

lint-stub: install
	$(STUBGEN)
	@diff -u $(NATIVE_STUB) build/stubs/tpusync/_native.pyi || { echo "$(NATIVE_STUB) is not the stub of the" \
	  "built module (the bindings changed?): run 'make stubs' and commit the result"; exit 1; }
	@echo "$(NATIVE_STUB): the stub of the built module"

# A pass is kept under ~/.cache/tpusync/clang-tidy, named by the hash of everything it read (the
# sources by name and content, the configuration, clang-tidy's version, the headers' packages and
# pybind11's pin): the same inputs are not checked twice.
TIDY_INPUTS = $(sort $(filter native/%,$(NATIVE_SRCS))) CMakeLists.txt .clang-tidy
TIDY_PASS = $(CACHE)/clang-tidy/$$({ sha256sum $(TIDY_INPUTS); clang-tidy-14 --version; echo $(BUILD_DEPS); \
  dpkg-query -W $(sort $(LINT_PACKAGES)); } | sha256sum | cut -c1-16).ok
build/lint/clang-tidy.ok: $(filter native/%,$(NATIVE_SRCS)) CMakeLists.txt .clang-tidy | install lint-deps
	@mkdir -p build/lint $(CACHE)/clang-tidy; pass=$(TIDY_PASS); \
	if [ -e $$pass ]; then echo "clang-tidy: these sources passed before ($$pass)"; touch $@; exit 0; fi; \
	cmake -S . -B build/lint -G Ninja -DTPUSYNC_BUILD_TESTS=ON -DTPUSYNC_BUILD_PYTHON=ON -DTPUSYNC_FUZZ=ON \
	  -DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null && \
	{ run-clang-tidy-14 -quiet -clang-tidy-binary clang-tidy-14 -p build/lint '$(CURDIR)/native/(?!tests/layering/)' >build/lint/clang-tidy.log 2>&1 \
	  || { sed 's/\x1b\[[0-9;]*m//g' build/lint/clang-tidy.log | grep -E -A3 '(warning|error):'; exit 1; }; } && \
	echo "clang-tidy: no findings (build/lint/clang-tidy.log)" && touch $$pass $@

# C++ unit tests, three times: optimised, with AddressSanitizer + UndefinedBehaviorSanitizer,
# and with ThreadSanitizer (the store's and the servers' concurrency).
native-test: native-test-deps
	cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTPUSYNC_BUILD_TESTS=ON >/dev/null
	cmake --build build/native
	ctest --test-dir build/native --output-on-failure
	cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTPUSYNC_BUILD_TESTS=ON -DTPUSYNC_SANITIZE=ON >/dev/null
	cmake --build build/asan
	ctest --test-dir build/asan --output-on-failure
	cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTPUSYNC_BUILD_TESTS=ON -DTPUSYNC_TSAN=ON >/dev/null
	cmake --build build/tsan
	TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build/tsan --output-on-failure

# libFuzzer, with ASan and UBSan, for FUZZ_SECONDS each: the frame parser, the control
# channel (a real ControlService over a real Store), the HTTP request head.
FUZZ_TARGETS := frame_fuzz control_fuzz http_fuzz
fuzz: fuzz-deps
	CC=clang-14 CXX=clang++-14 cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTPUSYNC_FUZZ=ON -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined" >/dev/null
	cmake --build build/fuzz --target $(FUZZ_TARGETS)
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t; \
	  build/fuzz/native/$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 build/fuzz/corpus/$$t \
	    >build/fuzz/$$t.log 2>&1 || { tail -60 build/fuzz/$$t.log; exit 1; }; \
	  echo "$$t: $$(grep -E '^stat::(number_of_executed_units|new_units_added)' build/fuzz/$$t.log | tr -s ' ' | tr '\n' ' ')"; \
	done

pytest: install pytest-deps
	$(PY) -m pytest -q

# make test, in three steps (each lane one target after the other; a lane's make runs -j1, else
# the -j2 jobserver above would run its targets at once):
#   1. the caches (downloads, and Go builds under nice 19) beside the static checks and the
#      native suites (compiles, at normal priority: they take the cores the downloads leave);
#   2. the Python and engine tiers beside fuzzing, the chart, the CRDs, the images' builds (nice
#      10), the release and llm-d's indexer tier (measured warm: the Python tier's CPU time is
#      1.08 x its wall time, vLLM's 1.33 x, tpu-inference's 1.77 x, on two cores);
#   3. the e2e suite beside the real nodes (cluster-tiers). Not in step 2's shorter lane: beside
#      the vLLM tier's engines its API server starved (TLS handshake timeouts, 2026-12-07).
CHECK_LANE := lint native-test
ENGINE_LANE := pytest vllm-test tpu-inference-test sglang-test
IMAGE_LANE := fuzz chart-test verify images release-test llmd-test
# Each step's and each lane target's wall time is printed after it (CI's log shows where the
# time went).
test: system-deps
	@set -e; t0=$$(date +%s); step() { s=$$(date +%s); $(MAKE) "$$@"; echo "make test: step '$$*' took $$(( $$(date +%s) - s )) s"; }; \
	step -j2 --output-sync=target caches check-lane; \
	step -j2 --output-sync=target engine-lane image-lane; \
	step cluster-tiers; \
	echo "make test: passed in $$(( $$(date +%s) - t0 )) s"

# $(call lane,TARGETS): the targets one after the other, each its own make (-j1), its time printed.
define lane
@set -e; for t in $(1); do s=$$(date +%s); $(MAKE) -j1 $$t; echo "lane: $$t took $$(( $$(date +%s) - s )) s"; done
endef
check-lane:
	$(call lane,$(CHECK_LANE))
engine-lane: install
	$(call lane,$(ENGINE_LANE))
image-lane: install
	$(call lane,$(IMAGE_LANE))

# The slow prerequisites of the tiers, each cached under ~/.cache/tpusync and a no-op when present,
# built side by side first: on a cold machine the downloads (the two engines' environments, ~17 GB,
# and the images' Debian bases) overlap the Go builds (control plane, LWS, llm-d's indexer)
# instead of following them.
caches: system-deps
	$(MAKE) -j7 --output-sync=target controlplane lws llmd-indexer nodes vllm-env tpu-inference-env sglang-env image-bases

demo: install
	$(PY) -m tpusync.demo

bench: install
	$(PY) bench/native_bench.py
	$(PY) bench/transfer_bench.py
	$(PY) bench/serving_bench.py
	$(PY) bench/weight_sync_bench.py
	$(PY) bench/routing_bench.py
	$(PY) bench/router_lag_bench.py
	$(MAKE) bench-inplace performance-doc

# Where the loopback transfers' time goes: both ends under perf record -a, bucket by bucket
# (bench/profile_bench.py; it needs perf, Debian's linux-perf, and root). Not in make bench.
profile: install
	$(PY) bench/profile_bench.py
	$(MAKE) performance-doc

# In-place weight updates of real engines: runs on the vLLM tier's interpreter (and drives
# tpu-inference engines on that tier's, when it is built).
bench-inplace: $(VLLM_OVERLAY)/.ready
	$(VLLM_PY) bench/inplace_bench.py

# The device check (bench/device_check.py) on a lent GPU machine: device-carry fetches here what
# that machine's image lacks into .device/ (git-ignored, ~4 MiB); there, bench/device/run.sh builds
# tpusync and runs the check (README, "On a GPU"). make test runs the check's steps on the CPU.
device-carry:
	bench/device/prepare.sh

# docs/performance.md and its plots, generated from bench/results/*.json (matplotlib in a
# small environment of its own, cached).
DOCS_VENV := $(CACHE)/docs-venv/matplotlib-3.11.2
$(DOCS_VENV)/.created:
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q matplotlib==3.11.2
	touch $@

performance-doc: $(DOCS_VENV)/.created
	$(DOCS_VENV)/bin/python bench/performance_doc.py

clean:
	rm -rf build $(VENV)
