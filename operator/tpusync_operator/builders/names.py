"""Child object names, in one place (the reconcilers and builders agree through these)."""

from __future__ import annotations

from collections.abc import Callable

from ..models import TPUSyncPoolSpec

# Kubernetes' limits on the children's names: a Service's name is a DNS-1035 label (63), and a
# StatefulSet labels its pods controller-revision-hash <statefulset>-<hash of up to 10
# characters>, a label value of at most 63 (a longer StatefulSet name creates no pod).
LABEL_MAX = 63
STATEFULSET_MAX = LABEL_MAX - len("-") - 10
# LWS (v0.9.0, pkg/controllers/leaderworkerset_controller.go) names the StatefulSet of each
# group's workers <lws>-<group index>: two digits, up to 100 replicas of a role.
GROUP_INDEX = "-99"
# A DisaggregatedSet's LeaderWorkerSets are <set>-<8-character revision>-<role>.
REVISION = "-12345678"
ROLES = ("prefill", "decode")
# metadata.name of a TPUSyncPool or DisaggregatedServing: a DNS-1035 label, as its Services' names are.
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"


def _child(suffix: str) -> Callable[[str], str]:
    """The name of an owner's child: <owner>-<suffix>."""
    return lambda owner: f"{owner}-{suffix}"


pool_config = _child("config")
pool_peers = _child("peers")
pool_netpol = _child("data")
pool_shared_claim = _child("shared")
pool_store = _child("store")


def pool_auth(pool: str, spec: TPUSyncPoolSpec) -> str:
    return spec.auth.secret_name or f"{pool}-auth"


def peers_dns(pool: str, namespace: str) -> str:
    return f"{pool_peers(pool)}.{namespace}.svc"


def gke_node_pool(pool: str, spec: TPUSyncPoolSpec, slice_index: int = 0) -> str:
    """The GKE node pool of one slice: the base name for slice 0, `<base>-<i>` for the others."""
    gke = spec.provisioning.gke
    base = gke.node_pool_name if gke and gke.node_pool_name else pool
    return base if slice_index == 0 else f"{base}-{slice_index}"


def role(serving: str, role_name: str) -> str:
    return f"{serving}-{role_name}"


def disaggregated_set(serving: str) -> str:
    """Its LeaderWorkerSets are <serving>-<revision>-<role> (versions.DISAGGREGATEDSET_SOURCES)."""
    return serving


epp = _child("epp")
serving_netpol = _child("serving")
pd_bootstrap = _child("pd-bootstrap")
pd_secret = _child("pd-secret")


def _suffix(name_of: Callable[[str], str]) -> int:
    return len(name_of(""))


def pool_name_max(*, store_statefulset: bool) -> int:
    """The longest TPUSyncPool name whose children's names Kubernetes admits: the headless
    Service <pool>-peers, and the store nodes' StatefulSet <pool>-store."""
    limits = [LABEL_MAX - _suffix(pool_peers)]
    if store_statefulset:
        limits.append(STATEFULSET_MAX - _suffix(pool_store))
    return min(limits)


def serving_name_max(*, sglang: bool = False, multi_host: bool = False, lockstep: bool = False) -> int:
    """The longest DisaggregatedServing name whose children's names Kubernetes and LWS admit:
    the Services <serving>-<role>, <serving>-epp (and <serving>-pd-bootstrap for sglang-jax);
    with multi-host roles the StatefulSets of each role's LeaderWorkerSet, <serving>-<role> and
    <serving>-<role>-<group>; with Lockstep those of the DisaggregatedSet's LeaderWorkerSets,
    <serving>-<revision>-<role>-<group>."""
    role_suffix = max(len(role("", r)) for r in ROLES)
    services = [role_suffix, _suffix(epp), *([_suffix(pd_bootstrap)] if sglang else [])]
    limits = [LABEL_MAX - max(services)]
    if multi_host:
        limits.append(STATEFULSET_MAX - role_suffix - len(GROUP_INDEX))
    if lockstep:
        limits.append(STATEFULSET_MAX - _suffix(disaggregated_set) - len(REVISION) - role_suffix - len(GROUP_INDEX))
    return min(limits)
