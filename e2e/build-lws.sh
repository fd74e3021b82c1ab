#!/usr/bin/env bash
# Builds the LeaderWorkerSet controller (sigs.k8s.io/lws, LWS_VERSION in versions.env) from its
# Go module into ~/.cache/tpusync/lws/<key>/lws-controller, for the e2e tests that need LWS
# pods. Separate from build-controlplane.sh so that its cache key (and the long Kubernetes
# build behind it) does not change with LWS. `--print` prints the directory; no build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/versions.env"
source "$here/controlplane/goenv.sh"

key="$( (echo "$LWS_VERSION"; "$GO" version; cat "$here/build-lws.sh") | sha256sum | cut -c1-16)"
out="$TPUSYNC_CACHE/lws/$key"
if [ "${1:-}" = "--print" ]; then echo "$out"; exit 0; fi
if [ -x "$out/lws-controller" ]; then echo "lws: up to date ($out)"; exit 0; fi

mkdir -p "$TPUSYNC_CACHE/lws"
exec 9>"$TPUSYNC_CACHE/lws/.lock"
flock 9
if [ -x "$out/lws-controller" ]; then echo "lws: built by another process ($out)"; exit 0; fi
tmp="$(mktemp -d "$TPUSYNC_CACHE/lws/.tmp-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "lws: building sigs.k8s.io/lws@$LWS_VERSION with $("$GO" version)"
t0=$SECONDS
# `go mod download` needs a module to run in; the build then uses lws's own go.mod and go.sum.
(cd "$tmp" && "$GO" mod init tpusync-lws-build >/dev/null 2>&1)
src="$(cd "$tmp" && "$GO" mod download -json "sigs.k8s.io/lws@$LWS_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p')"
(cd "$src" && "$GO" build -trimpath -ldflags "-X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
   -o "$tmp/lws-controller" ./cmd)
"$tmp/lws-controller" --version
mkdir -p "$out"
mv "$tmp/lws-controller" "$out/"
echo "lws: built in $((SECONDS - t0))s ($out)"
