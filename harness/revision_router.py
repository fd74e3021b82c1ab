"""A stand-in for llm-d's disaggregatedset-rollout-screener, for the e2e tier (kwok runs no
router): it reads the screener's parameters from the EndpointPickerConfig the operator wrote and
picks a prefill/decode pair for a request as the plugin does at llm-d-router v0.10.0
(pkg/epp/framework/plugins/requestcontrol/screener/disaggregatedsetrollout, README.md "Request
Lifecycle"): count the Ready pods in scope by revision and role, drop every revision lacking a
Ready pod of a required role, choose one of the rest weighted by its Ready pods (mode sum), and
let the profiles pick within it. No revision left is an HTTP 503.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SCREENER = "disaggregatedset-rollout-screener"


@dataclass(frozen=True)
class Pick:
    """One request's outcome: the pods its profiles got, or None for a 503."""
    prefill: dict[str, Any] | None
    decode: dict[str, Any] | None


def screener_parameters(epp_config: dict[str, Any]) -> dict[str, Any]:
    (plugin,) = [p for p in epp_config["plugins"] if p["type"] == SCREENER]
    return plugin["parameters"]


def ready(pod: dict[str, Any]) -> bool:
    """What the router's pod notifications count: not terminating, Ready."""
    if "deletionTimestamp" in pod["metadata"]:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


class RevisionRouter:
    def __init__(self, parameters: dict[str, Any], seed: int = 0):
        gating = parameters["revisionGating"]
        if gating["mode"] != "sum":
            raise ValueError(f"stand-in implements mode sum, not {gating['mode']}")
        self.scope = parameters["scope"]["labelSelector"]
        self.revision_key = gating["revisionLabelKey"]
        self.role_key = gating["roleLabelKey"]
        self.roles = gating["requireRoles"]["values"]
        self.random = random.Random(seed)

    def pick(self, pods: list[dict[str, Any]]) -> Pick:
        """`pods`: the pods matching self.scope, as listed from the API server."""
        by_revision: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for pod in filter(ready, pods):
            labels = pod["metadata"].get("labels") or {}
            by_revision.setdefault(labels.get(self.revision_key, ""), {}).setdefault(
                labels.get(self.role_key, ""), []).append(pod)
        covered = {rev: roles for rev, roles in by_revision.items() if all(roles.get(r) for r in self.roles)}
        if not covered:
            return Pick(None, None)
        revisions = sorted(covered)
        weights = [sum(len(covered[rev][r]) for r in self.roles) for rev in revisions]
        chosen = covered[self.random.choices(revisions, weights)[0]]
        return Pick(self.random.choice(chosen["prefill"]), self.random.choice(chosen["decode"]))
