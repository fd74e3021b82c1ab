"""Child object names, in one place (the reconcilers and builders agree through these)."""

from __future__ import annotations

from ..models import TPUSyncPoolSpec


def pool_config(pool: str) -> str:
    return f"{pool}-config"


def pool_auth(pool: str, spec: TPUSyncPoolSpec) -> str:
    return spec.auth.secret_name or f"{pool}-auth"


def pool_peers(pool: str) -> str:
    return f"{pool}-peers"


def pool_netpol(pool: str) -> str:
    return f"{pool}-data"


def pool_shared_claim(pool: str) -> str:
    return f"{pool}-shared"


def pool_store(pool: str) -> str:
    return f"{pool}-store"


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


def epp(serving: str) -> str:
    return f"{serving}-epp"


def serving_netpol(serving: str) -> str:
    return f"{serving}-serving"


def pd_bootstrap(serving: str) -> str:
    return f"{serving}-pd-bootstrap"


def pd_secret(serving: str) -> str:
    return f"{serving}-pd-secret"
