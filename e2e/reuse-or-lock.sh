# Sourced by the build scripts that keep one build per key under $TPUSYNC_CACHE
# (e2e/build-nodes.sh, tests/llmd/build-indexer.sh).
#
# reuse_or_lock NAME DIR RESULT TEST...
#   Ends the script with RESULT on its last line when `TEST...` finds the build there; otherwise
#   takes DIR/.lock (fd 9, held until the script exits) and looks again: a build another process
#   finished while this one waited is reused too.
reuse_or_lock() {
  local name=$1 dir=$2 result=$3
  shift 3
  if "$@"; then echo "$name: up to date ($result)"; echo "$result"; exit 0; fi
  mkdir -p "$dir"
  exec 9>"$dir/.lock"
  flock 9   # one builder at a time; a second waits, then finds the result
  if "$@"; then echo "$name: built by another process"; echo "$result"; exit 0; fi
}
