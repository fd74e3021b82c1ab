#!/usr/bin/env bash
# Assembles a local stand-in for an upstream base image and imports it into buildah's storage,
# for `make images` on a machine that reaches no container registry (only Debian's apt and the
# package registries). The release builds FROM the upstream bases pinned by digest in each
# Dockerfile; `make images` passes these instead through the same build-args.
#
#   images/base/local-base.sh bookworm|python3.11|python3.12   prints the image name it made or found
#
#   bookworm    Debian 12 (bookworm) minbase from mmdebstrap, with python3 (3.11), python3-venv,
#               python-is-python3, passwd and ca-certificates: a superset of debian:12.x-slim for
#               the sidecar's builder (apt, the same suite).
#   python3.11  bookworm plus python3-dev (the headers python:3.11-slim carries). For what our
#               images need, this is python:3.11.x-slim-bookworm: the same Debian suite, a CPython
#               3.11 called `python` with its headers, venv, useradd, apt. The CPython differs in
#               patch level (Debian's 3.11.2, not 3.11.14) and place (/usr/bin, not
#               /usr/local/bin); builder and runtime share it, so the venv is sound.
#   python3.12  bookworm plus this machine's pyenv CPython 3.12 (the interpreter the
#               tpu-inference tier uses), at its own prefix, first on PATH as python3/python:
#               a stand-in for python:3.12-slim-bookworm as the vLLM image's *builder* (a cp312
#               wheel). vllm/vllm-tpu itself cannot be assembled here: see images/vllm-tpu.
#
# Environment: PIP_CERT (a CA bundle for pip, where this machine's network needs one), BUILDAH (the buildah command with its storage options), CACHE_DIR (where the
# root filesystem tarball is kept: $CACHE_DIR/<name>-<key>/rootfs.tar, reused by fresh clones),
# APT_SOURCES (default: this machine's Debian sources, i.e. bookworm, -updates and -security).
# The key hashes the suite, the packages and those sources: change any and the base is assembled again.
set -euo pipefail
name="$1"
: "${BUILDAH:?}" "${CACHE_DIR:?}"
SUITE=bookworm
PACKAGES=python3,python3-venv,python-is-python3,passwd,ca-certificates
APT_SOURCES=${APT_SOURCES:-/etc/apt/sources.list.d/debian.sources}
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
key=$( (echo "$SUITE $PACKAGES"; cat "$APT_SOURCES") | sha256sum | cut -c1-12)
# The Python bases also hash their recipe (python3.11: python3-dev) and the CA bundle they trust.
build_key=$( (echo "python3-dev"; cat "${PIP_CERT:-/dev/null}") | sha256sum | cut -c1-8)

exists() { $BUILDAH inspect --type image "$1" >/dev/null 2>&1; }

bookworm() {
  local image="localhost/tpusync-base/bookworm:$key"
  exists "$image" && { echo "$image"; return; }
  local dir="$CACHE_DIR/bookworm-$key"
  if [ ! -s "$dir/rootfs.tar" ]; then
    mkdir -p "$dir"
    echo "local-base: mmdebstrap $SUITE ($PACKAGES) into $dir" >&2
    nice -n 10 mmdebstrap --quiet --mode=root --variant=minbase --include="$PACKAGES" \
      "$SUITE" "$dir/rootfs.tar.partial" "$APT_SOURCES" >&2
    mv "$dir/rootfs.tar.partial" "$dir/rootfs.tar"
  fi
  local c
  c=$($BUILDAH from scratch)
  $BUILDAH add "$c" "$dir/rootfs.tar" / >/dev/null
  $BUILDAH config --env "$PATH_ENV" --env LANG=C.UTF-8 --cmd /bin/bash \
    --label "dev.tpusync.local-base=debian:$SUITE minbase+$PACKAGES (mmdebstrap)" "$c"
  $BUILDAH commit --quiet --rm "$c" "$image" >/dev/null
  echo "$image"
}

# What a local build needs of this machine, in the base rather than in the images' own layers:
# pip's cache directory, where `make images` mounts this machine's (the mount point exists, so
# no RUN step leaves one behind), and the CA bundle pip must trust here (PIP_CERT), if any.
build_settings() {
  local c="$1"
  $BUILDAH run --isolation chroot "$c" -- mkdir -p /root/.cache/pip
  if [ -n "${PIP_CERT:-}" ]; then
    $BUILDAH copy "$c" "$PIP_CERT" /etc/ssl/certs/build-ca.crt >/dev/null
    $BUILDAH run --isolation chroot "$c" -- sh -c \
      'printf "[global]\ncert = /etc/ssl/certs/build-ca.crt\n" > /etc/pip.conf'
  fi
}

python311() {
  local base c
  base=$(bookworm)
  local image="localhost/tpusync-base/python3.11:$key-$build_key"
  exists "$image" && { echo "$image"; return; }
  c=$($BUILDAH from --pull-never "$base")
  $BUILDAH run --isolation chroot "$c" -- sh -c \
    "apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-dev >/dev/null && rm -rf /var/lib/apt/lists/*" >&2
  build_settings "$c"
  $BUILDAH config --label "dev.tpusync.local-base=bookworm + python3-dev" "$c"
  $BUILDAH commit --quiet --rm "$c" "$image" >/dev/null
  echo "$image"
}

python312() {
  local py prefix version base c
  py=$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -1)
  [ -x "$py" ] || { echo "local-base: no CPython 3.12 under ~/.pyenv (the tpu-inference tier's)" >&2; exit 1; }
  prefix=$(dirname "$(dirname "$py")")
  version=$("$py" -c 'import platform; print(platform.python_version())')
  base=$(bookworm)
  local image="localhost/tpusync-base/python3.12:$key-$build_key-$version"
  exists "$image" && { echo "$image"; return; }
  c=$($BUILDAH from --pull-never "$base")
  # The pyenv build runs from its own prefix (RUNPATH), so it goes in at the same path.
  $BUILDAH copy "$c" "$prefix" "$prefix" >/dev/null
  build_settings "$c"
  $BUILDAH run --isolation chroot "$c" -- sh -c \
    "for n in python3.12 python3 python pip3 pip; do ln -sf $prefix/bin/\$n /usr/local/bin/\$n; done"
  $BUILDAH config --label "dev.tpusync.local-base=bookworm + pyenv CPython $version at $prefix" "$c"
  $BUILDAH commit --quiet --rm "$c" "$image" >/dev/null
  echo "$image"
}

case "$name" in
  bookworm) bookworm ;;
  python3.11) python311 ;;
  python3.12) python312 ;;
  *) echo "local-base: unknown base $name" >&2; exit 2 ;;
esac
