"""Issue 43 on the real control plane, the operator running as the chart's ServiceAccount: a
setting the schema cannot check, because it depends on another object, is reported with the
field named. (The schema's own refusals are the corpus of harness/invalid_objects.py, which
e2e/test_crds.py holds the real API server to.)"""

from __future__ import annotations

import json

from test_operator import apply, pool_obj, wait_condition


def claim(ns: str, storage: str) -> dict:
    """A ReadWriteMany claim of a class nothing provisions: it stays Pending, and its size is its request."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "kv", "namespace": ns},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "e2e-unprovisioned",
                     "resources": {"requests": {"storage": storage}}}}


def test_a_shared_tier_capacity_beyond_its_claim_is_a_condition_naming_the_field(cluster, operator, namespace):
    cluster.kubectl("create", "-f", "-", input=json.dumps(claim(namespace, "1Gi")))
    pool = pool_obj(namespace, "shared", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-none", hosts=1)
    pool["spec"]["tiers"]["shared"] = {"claimName": "kv", "capacity": "2Gi"}
    apply(cluster, pool)
    obj = wait_condition(cluster, "tpusyncpool", namespace, "shared", "Degraded", "True",
                         reason="SharedCapacityBeyondClaim")
    degraded = {c["type"]: c for c in obj["status"]["conditions"]}["Degraded"]
    assert "spec.tiers.shared.capacity 2Gi exceeds the 1Gi of PersistentVolumeClaim kv" in degraded["message"]
    pool["spec"]["tiers"]["shared"]["capacity"] = "1Gi"      # within the claim: the condition clears
    apply(cluster, pool)
    wait_condition(cluster, "tpusyncpool", namespace, "shared", "Degraded", "False")
