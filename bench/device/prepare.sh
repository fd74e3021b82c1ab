#!/usr/bin/env bash
# What the lent GPU machine's image lacks to build and run tpusync, fetched here (where Debian and
# PyPI are reachable) into .device/ (git-ignored; the device tool carries it: carry [".device"]):
#   debs/    Debian bookworm's libxxhash-dev (xxhash.h), libipsec-mb-dev (intel-ipsec-mb's header
#            and static library) and libssl-dev (OpenSSL's headers and static libcrypto), the
#            packages the Makefile's NATIVE_PACKAGES names; run.sh unpacks them into a sysroot
#            under /tmp there, never into /.
#   wheels/  for CPython 3.12, what tpusync needs that the image lacks: cbor2 (the package's) and
#            pyzmq (the reference engine's KV events), at pyproject.toml's pins (the image has
#            numpy, rich, xxhash, msgpack, pybind11, scikit-build-core, cmake and ninja: the
#            device library's KINDS.md).
#   downloads/ libaegis's sources (native/cmake/aegis.cmake's pinned tarball): CMake finds it
#            there (TPUSYNC_DOWNLOADS) and checks its hash rather than downloading it.
# Then, on the device machine: bench/device/run.sh (README: "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device
rm -rf "$out"
mkdir -p "$out/debs" "$out/wheels" "$out/downloads"
lists=$(mktemp -d)
trap 'rm -rf "$lists"' EXIT
apt_opts=(-o APT::Architecture=amd64 -o APT::Architectures=amd64 -o "Dir::State::Lists=$lists"
          -o "Dir::Cache=$lists" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
mkdir -p "$lists/partial" "$lists/archives/partial"
apt-get "${apt_opts[@]}" update -qq
(cd "$out/debs" && apt-get "${apt_opts[@]}" download -qq libxxhash-dev libipsec-mb-dev libssl-dev)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$out/wheels" "cbor2==5.7.1" "pyzmq==27.3.0"
aegis_url=$(sed -n 's/^ *"\(https:[^"]*pyaegis[^"]*\)")$/\1/p' native/cmake/aegis.cmake)
curl -fsSL -o "$out/downloads/${aegis_url##*/}" "$aegis_url"
ls -l "$out"/debs "$out"/wheels "$out"/downloads
du -sh "$out"
