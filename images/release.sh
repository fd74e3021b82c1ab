#!/usr/bin/env bash
# The release's steps: what .github/workflows/release.yml runs on a version tag, and what
# `make release-test` (tests/release) runs against a registry it starts on 127.0.0.1. One script,
# so the test runs the workflow's own commands.
#
#   images/release.sh [--plain-http] check TAG
#       images/check-versions.py: the tag (v0.1.0), the package, the operator's version table,
#       the chart and the CRD defaults all name one version.
#   images/release.sh [--plain-http] push-images REGISTRY VERSION ARCHIVE...
#       each OCI archive (an OCI image layout in a tar, as `make images` and the workflow's
#       buildx write it: DIR/NAME.oci.tar) to REGISTRY/NAME:VERSION with its manifest unchanged
#       (skopeo copy --preserve-digests: the registry serves the archive's digest); prints
#       "pushed REGISTRY/NAME:VERSION@DIGEST" for each.
#   images/release.sh [--plain-http] chart REGISTRY VERSION [DIST]
#       helm lint --strict, helm package (version and appVersion VERSION) into DIST (default:
#       dist), helm push to oci://REGISTRY/charts; prints "pushed oci://REGISTRY/charts/
#       tpusync-operator:VERSION@DIGEST".
#
# REGISTRY is HOST[:PORT][/PATH] without a scheme (ghcr.io/tpusync, REGION-docker.pkg.dev/
# PROJECT/REPO); log in to it first (skopeo login, helm registry login). --plain-http: the
# registry speaks plain HTTP, not HTTPS (a registry on this machine, like the test's on
# 127.0.0.1; never across a network). Tools: $PYTHON (python3, with PyYAML), $SKOPEO (skopeo),
# $HELM (helm v4).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHART=$ROOT/charts/tpusync-operator
PYTHON=${PYTHON:-python3}
SKOPEO=${SKOPEO:-skopeo}
HELM=${HELM:-helm}

usage() {
  sed -n '6,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

plain_http=false
if [ "${1:-}" = --plain-http ]; then
  plain_http=true
  shift
fi
step=${1:-}
[ -n "$step" ] || usage
shift

registry_arg() {
  case "$1" in
    "" | *://* | */) echo "release: registry '$1': HOST[:PORT][/PATH], no scheme, no trailing slash" >&2; exit 2 ;;
  esac
}

case "$step" in
  check)
    [ $# -eq 1 ] || usage
    "$PYTHON" "$ROOT/images/check-versions.py" "$1"
    ;;

  push-images)
    [ $# -ge 3 ] || usage
    registry=$1 version=$2
    shift 2
    registry_arg "$registry"
    tls=()
    if $plain_http; then tls=(--dest-tls-verify=false); fi
    digests=$(mktemp -d)
    trap 'rm -rf "$digests"' EXIT
    for archive in "$@"; do
      case "$archive" in
        *.oci.tar) ;;
        *) echo "release: $archive: not an OCI archive (NAME.oci.tar)" >&2; exit 2 ;;
      esac
      name=$(basename "$archive" .oci.tar)
      ref=$registry/$name:$version
      # --all: an archive holding an image index (several platforms) is pushed whole.
      "$SKOPEO" copy --quiet --all --preserve-digests "${tls[@]}" \
        --digestfile "$digests/$name" "oci-archive:$archive" "docker://$ref"
      echo "pushed $ref@$(cat "$digests/$name")"
    done
    ;;

  chart)
    if [ $# -lt 2 ] || [ $# -gt 3 ]; then usage; fi
    registry=$1 version=$2 dist=${3:-dist}
    registry_arg "$registry"
    http=()
    if $plain_http; then http=(--plain-http); fi
    "$HELM" lint --strict "$CHART"
    "$HELM" package "$CHART" --version "$version" --app-version "$version" --destination "$dist"
    out=$("$HELM" push "$dist/tpusync-operator-$version.tgz" "oci://$registry/charts" "${http[@]}" 2>&1) \
      || { echo "$out" >&2; exit 1; }
    echo "$out"
    digest=$(sed -n 's/^Digest: *//p' <<<"$out")
    [ -n "$digest" ] || { echo "release: helm push printed no digest" >&2; exit 1; }
    echo "pushed oci://$registry/charts/tpusync-operator:$version@$digest"
    ;;

  *)
    usage
    ;;
esac
