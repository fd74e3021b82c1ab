# Sourced by e2e build scripts: Go caches live outside the clone, shared by every checkout.
TPUSYNC_CACHE="${TPUSYNC_CACHE:-$HOME/.cache/tpusync}"
export GOMODCACHE="$TPUSYNC_CACHE/go/mod"
export GOCACHE="$TPUSYNC_CACHE/go/build"
export GOPATH="$TPUSYNC_CACHE/go/path"
export GOFLAGS="-modcacherw"
# Never fetch a toolchain: the machine's Go (>= 1.26) builds every pinned module.
export GOTOOLCHAIN=local
export CGO_ENABLED=0
if [ -z "${GO:-}" ]; then
  if command -v go >/dev/null 2>&1; then GO=go; else GO=/usr/local/go/bin/go; fi
fi
