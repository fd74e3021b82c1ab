"""The security contexts of every pod and container the operator renders: the restricted Pod
Security Standard for ours (uid 65532, no privilege escalation, every capability dropped,
seccomp RuntimeDefault), and the one exception GKE's TPU access asks of an engine container."""

from __future__ import annotations

from typing import Any

NONROOT_UID = 65532


def pod_security_context() -> dict[str, Any]:
    """Restricted Pod Security Standard at pod level."""
    return {"runAsNonRoot": True, "runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID,
            "fsGroup": NONROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(read_only_root: bool = True) -> dict[str, Any]:
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": read_only_root, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def tpu_engine_security_context() -> dict[str, Any]:
    """An engine container with TPUs, as GKE documents TPU access (versions.GKE_TPU): root, not
    privileged (GKE 1.28 and later give a container its requested TPU devices without it), no
    privilege escalation, seccomp RuntimeDefault. Every capability is dropped but DAC_OVERRIDE:
    root needs it to open the sidecar's pool file (mode 0600) and control socket, which belong
    to the sidecar's uid 65532. Its pod fits the baseline Pod Security Standard, not restricted;
    spec.engine.securityContext overrides it."""
    return {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
            "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]},
            "seccompProfile": {"type": "RuntimeDefault"}}
