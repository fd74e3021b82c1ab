#!/usr/bin/env bash
# Builds tests/llmd/indexer (llm-d's KV-cache indexer, github.com/llm-d/llm-d-kv-cache at the
# version pinned in its go.mod) into
#     ${TPUSYNC_CACHE:-~/.cache/tpusync}/llmd-indexer/<key>/llmd-indexer
# where <key> hashes the Go version, go.mod, go.sum, the sources and this script. A present
# binary makes this a no-op; a build goes to a temporary file renamed into place. Go's module
# and build caches are the control plane's (e2e/controlplane/goenv.sh), shared by every clone.
# Pure Go (go-zeromq/zmq4): no cgo, no libzmq.
#
#   tests/llmd/build-indexer.sh           build if needed, print the binary's path on the last line
#   tests/llmd/build-indexer.sh --print   print the path (built or not), build nothing
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=/dev/null
source "$here/../../e2e/controlplane/goenv.sh"
# shellcheck source=/dev/null
source "$here/../../e2e/reuse-or-lock.sh"
src="$here/indexer"
key="$( { "$GO" version; cat "$here/build-indexer.sh" "$src/go.mod" "$src/go.sum" "$src"/*.go; } | sha256sum | cut -c1-16)"
root="$TPUSYNC_CACHE/llmd-indexer"
bin="$root/$key/llmd-indexer"

if [ "${1:-}" = "--print" ]; then echo "$bin"; exit 0; fi
reuse_or_lock llmd-indexer "$root" "$bin" test -x "$bin"
mkdir -p "$root/$key"
t0=$SECONDS
echo "llmd-indexer: building key $key with $("$GO" version)"
tmp="$(mktemp "$root/$key/.tmp-XXXXXX")"
trap 'rm -f "$tmp"' EXIT
(cd "$src" && "$GO" build -trimpath -ldflags "-s -w" -o "$tmp" .)
mv "$tmp" "$bin"
echo "llmd-indexer: built in $((SECONDS - t0))s"
echo "$bin"
