"""Objects the API server must refuse, each with the text its message must contain: one corpus
for the real API server (e2e/test_crds.py) and for `python -m tpusync_operator validate`
(tests/unit/operator/test_validate.py), so that the two are held to the same rules."""

from __future__ import annotations

import copy
from typing import Any

API = "tpusync.dev/v1alpha1"

POOL = {
    "apiVersion": API, "kind": "TPUSyncPool", "metadata": {"name": "p"},
    "spec": {"tpu": {"type": "v6e", "topology": "2x2"},
             "provisioning": {"mode": "existing", "existing": {"nodePoolName": "np"}}},
}
SERVING = {
    "apiVersion": API, "kind": "DisaggregatedServing", "metadata": {"name": "s"},
    "spec": {"model": {"name": "m", "uri": "hf://org/m"}, "poolRef": {"name": "p"}},
}


def variant(base: dict, path: str, value) -> dict:
    """A deep copy of base with the dotted spec path set (value None deletes it)."""
    obj = copy.deepcopy(base)
    node = obj
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return obj


POOL_CASES = [
    # (id, dotted path, value, text that must appear in the API server's message)
    ("tpu-type-enum", "spec.tpu.type", "v4", "spec.tpu.type"),
    ("tpu-required", "spec.tpu", None, "spec.tpu"),
    ("topology-pattern", "spec.tpu.topology", "two-by-two", "spec.tpu.topology"),
    ("topology-cel-v7x", "spec.tpu", {"type": "v7x", "topology": "2x4"},
     "spec.tpu.topology must be AxB for v5e and v6e and AxBxC for v7x"),
    ("topology-cel-v5e", "spec.tpu", {"type": "v5e", "topology": "2x2x1"},
     "spec.tpu.topology must be AxB for v5e and v6e and AxBxC for v7x"),
    ("hosts-and-autoscaling", "spec.capacity", {"hosts": 2, "autoscaling": {"maxHosts": 2}},
     "spec.capacity: set either hosts or autoscaling, not both"),
    ("spot-and-reservation", "spec.capacity", {"spot": True, "reservation": "r"},
     "spec.capacity: spot and reservation are mutually exclusive"),
    ("autoscaling-min-max", "spec.capacity.autoscaling", {"minHosts": 3, "maxHosts": 2},
     "spec.capacity.autoscaling.minHosts must not exceed maxHosts"),
    ("hosts-minimum", "spec.capacity.hosts", 0, "spec.capacity.hosts"),
    ("gke-requires-gke", "spec.provisioning", {"mode": "gke"},
     "spec.provisioning.gke is required when mode is gke"),
    ("existing-requires-existing", "spec.provisioning", {"mode": "existing"},
     "spec.provisioning.existing is required when mode is existing"),
    ("existing-needs-selector", "spec.provisioning.existing", {},
     "spec.provisioning.existing needs nodePoolName or nodeSelector"),
    ("mode-enum", "spec.provisioning.mode", "manual", "spec.provisioning.mode"),
    ("dram-quantity", "spec.tiers.dram", "lots", "spec.tiers.dram"),
    ("ephemeral-needs-class", "spec.tiers.disk", {"size": "1Ti", "medium": "EphemeralVolume"},
     "spec.tiers.disk.storageClassName is required when medium is EphemeralVolume"),
    ("shared-one-source", "spec.tiers.shared", {"claimName": "kv", "storageClassName": "lustre", "size": "18Ti"},
     "spec.tiers.shared needs exactly one of claimName"),
    ("shared-no-source", "spec.tiers.shared", {"capacity": "1Ti"}, "spec.tiers.shared needs exactly one of claimName"),
    ("shared-class-needs-size", "spec.tiers.shared", {"storageClassName": "lustre"},
     "spec.tiers.shared.size is required with storageClassName"),
    ("shared-watermarks", "spec.tiers.shared", {"claimName": "kv", "highWatermarkPercent": 60,
                                                "lowWatermarkPercent": 70},
     "spec.tiers.shared.lowWatermarkPercent must be below highWatermarkPercent"),
    ("shared-policy-enum", "spec.tiers.shared", {"claimName": "kv", "policy": "Sometimes"},
     "spec.tiers.shared.policy"),
    ("data-port-range", "spec.sidecar.dataPort", 70000, "spec.sidecar.dataPort"),
    ("store-replicas-daemonset", "spec.storeNodes", {"enabled": True, "kind": "DaemonSet",
                                                    "replicas": 2},
     "spec.storeNodes.replicas applies only to kind StatefulSet"),
    ("auth-secret-name", "spec.auth.secretName", "Not_A_Name", "spec.auth.secretName"),
]


SERVING_CASES = [
    ("no-replicas", "spec", {**SERVING["spec"], "prefill": {"replicas": 0}, "decode": {"replicas": 0}},
     "spec.prefill.replicas + spec.decode.replicas must be at least 1"),
    ("cpu-only-needs-reference", "spec.engine", {"type": "vllm-tpu", "cpuOnly": True},
     "spec.engine.cpuOnly is only valid with type reference"),
    ("gateway-needs-routing", "spec.routing", {"enabled": False, "gatewayRef": {"name": "gw"}},
     "spec.routing.gatewayRef requires spec.routing.enabled"),
    ("engine-enum", "spec.engine.type", "tgi", "spec.engine.type"),
    ("model-required", "spec.model", None, "spec.model"),
    ("model-uri-empty", "spec.model.uri", "", "spec.model.uri"),
    ("pool-ref-name", "spec.poolRef.name", "Bad_Name", "spec.poolRef.name"),
    ("port-range", "spec.port", 0, "spec.port"),
    ("scorer-weight", "spec.routing.scorerWeights.queue", -1, "spec.routing.scorerWeights.queue"),
    ("role-topology", "spec.decode.topology", "big", "spec.decode.topology"),
    ("role-replicas", "spec.decode.replicas", -1, "spec.decode.replicas"),
    ("hosts-per-replica", "spec.prefill.hostsPerReplica", 0, "spec.prefill.hostsPerReplica"),
    ("connector-enum", "spec.kvTransfer.connector", "nixl", "spec.kvTransfer.connector"),
    ("prefix-cache-quantity", "spec.prefixCache.hostDram", "1 GB", "spec.prefixCache.hostDram"),
    ("model-uri-scheme", "spec.model.uri", "s3://bucket/m", "spec.model.uri"),
    ("revision-needs-hf", "spec.model", {"name": "m", "uri": "/models/m", "revision": "v1"},
     "spec.model.revision applies only to hf:// models"),
    ("revision-needs-weights", "spec", {**SERVING["spec"], "engine": {"type": "reference"},
                                        "model": {"name": "m", "uri": "hf://org/m", "revision": "v1"}},
     "spec.model.revision does not apply to spec.engine.type reference"),
    ("weights-ephemeral-needs-class", "spec.storage", {"weights": {"size": "1Ti", "medium": "EphemeralVolume"}},
     "storageClassName is required when medium is EphemeralVolume"),
    ("weights-claim-needs-name", "spec.storage", {"weights": {"size": "1Ti", "medium": "PersistentVolumeClaim"}},
     "claimName is required when medium is PersistentVolumeClaim"),
    ("gke-policies-need-routing", "spec.routing", {"enabled": False, "gkeGatewayPolicies": True},
     "spec.routing.gkeGatewayPolicies requires spec.routing.enabled"),
    ("epp-replicas-range", "spec.routing.eppReplicas", 0, "spec.routing.eppReplicas"),
    ("epp-ha-enum", "spec.routing.eppHighAvailability", "Leader", "spec.routing.eppHighAvailability"),
    ("active-active-needs-precise-prefix", "spec.routing",
     {"eppHighAvailability": "ActiveActive", "precisePrefixCache": False},
     "spec.routing.eppHighAvailability ActiveActive needs spec.routing.precisePrefixCache"),
    ("rollout-strategy-enum", "spec.rollout.strategy", "Recreate", "spec.rollout.strategy"),
    ("rollout-cannot-progress", "spec.rollout", {"maxSurge": 0, "maxUnavailable": 0},
     "spec.rollout: maxSurge + maxUnavailable must be at least 1"),
]



POOL_CASES += [
    ("block-bytes-multiple", "spec.tiers.blockBytes", "3000", "spec.tiers.blockBytes must be a multiple of 4096"),
    ("block-bigger-than-dram", "spec.tiers", {"dram": "1Mi", "blockBytes": "2Mi"},
     "spec.tiers.dram must hold at least one block"),
    ("dram-beyond-the-host", "spec.tiers.dram", "100Ti",
     "spec.tiers.dram must be less than the memory of the TPU host"),
    ("disk-smaller-than-a-block", "spec.tiers.disk", {"size": "4Ki"},
     "spec.tiers.disk.size must hold at least one block"),
    ("disk-without-room-for-a-header", "spec.tiers.disk", {"size": "1Mi"},
     "spec.tiers.disk.size must hold at least one block of spec.tiers.blockBytes, its 4Ki header"),
    ("store-disk-without-room-for-a-header", "spec.storeNodes", {"enabled": True, "disk": {"size": "1Mi"}},
     "spec.storeNodes.disk.size must hold at least one block of spec.tiers.blockBytes, its 4Ki header"),
    ("shared-smaller-than-a-block", "spec.tiers.shared", {"claimName": "kv", "capacity": "4Ki"},
     "spec.tiers.shared.capacity must hold at least one block"),
    ("store-dram-smaller-than-a-block", "spec.storeNodes", {"enabled": True, "dram": "4Ki"},
     "spec.storeNodes.dram must hold at least one block"),
    ("unknown-field", "spec.tiers.dramm", "1Gi", "spec.tiers.dramm"),
    ("reservation-name", "spec.capacity.reservation", "My_Reservation", "spec.capacity.reservation"),
    ("gke-project", "spec.provisioning", {"mode": "gke", "gke": {"project": "My Project", "location": "us-east5",
                                                                 "cluster": "c"}}, "spec.provisioning.gke.project"),
    ("gke-location", "spec.provisioning", {"mode": "gke", "gke": {"project": "my-project", "location": "nowhere",
                                                                  "cluster": "c"}}, "spec.provisioning.gke.location"),
    ("sidecar-image", "spec.sidecar.image", "not an image", "spec.sidecar.image"),
    ("gke-block-in-mode-existing", "spec.provisioning.gke", {"project": "my-project", "location": "us-east5",
                                                             "cluster": "c"},
     "spec.provisioning.gke applies only to mode gke"),
    ("workload-policy-on-v6e", "spec.provisioning", {"mode": "gke", "gke": {
        "project": "my-project", "location": "us-east5", "cluster": "c", "workloadPolicy": "wp"}},
     "spec.provisioning.gke.workloadPolicy applies only to v7x multi-host slices"),
]

SGLANG = {"engine": {"type": "sglang-jax", "image": "r.example/sgl:main"}, "kvTransfer": {"connector": "sglang-jax"},
          "routing": {"precisePrefixCache": False}}

SERVING_CASES += [
    ("owned-flag", "spec.prefill.args", ["--tensor-parallel-size=64"],
     "spec.prefill.args: --tensor-parallel-size is rendered by the operator"),
    ("owned-flag-underscores", "spec.decode.args", ["--enforce-eager", "--max_model_len", "9"],
     "spec.decode.args: --max_model_len is rendered by the operator"),
    ("owned-flag-short", "spec.decode.args", ["-tp=3"], "spec.decode.args: -tp is rendered by the operator"),
    ("owned-flag-reference", "spec", {**SERVING["spec"], "engine": {"type": "reference"},
                                      "prefill": {"args": ["--kv-events-topic=x"]}},
     "spec.prefill.args: --kv-events-topic is rendered by the operator"),
    ("sglang-multi-host", "spec", {**SERVING["spec"], **SGLANG, "prefill": {"hostsPerReplica": 2}},
     "spec.prefill/decode.hostsPerReplica must be 1 with spec.engine.type sglang-jax"),
    ("connector-needs-engine", "spec", {**SERVING["spec"], "engine": {"type": "reference"},
                                        "kvTransfer": {"connector": "tpu-inference"}},
     "spec.kvTransfer.connector tpu-inference needs spec.engine.type vllm-tpu"),
    ("sglang-connector-needs-sglang", "spec.kvTransfer.connector", "sglang-jax",
     "spec.kvTransfer.connector: sglang-jax is required by"),
    ("model-name", "spec.model.name", "my model@v1", "spec.model.name"),
    ("model-revision", "spec.model.revision", "main; rm -rf /", "spec.model.revision"),
    ("engine-image", "spec.engine.image", "Registry.example/UPPER:1", "spec.engine.image"),
    ("engine-env-name", "spec.engine.env", [{"name": "A=B", "value": "1"}], "spec.engine.env[0].name"),
    ("args-too-many", "spec.decode.args", ["--enforce-eager"] * 65, "spec.decode.args"),
]

# Issue 43: every setting works or is refused, naming it.
POOL_NAME = "metadata.name must be a DNS-1035 label"
SERVING_NAME = POOL_NAME
STORE = {"enabled": True}
GKE = {"mode": "gke", "gke": {"project": "my-project", "location": "us-east5", "cluster": "c"}}
LOCKSTEP = {"strategy": "Lockstep"}
POOL_CASES += [
    ("name-peers-service-too-long", "metadata.name", "p" * 58, POOL_NAME),
    ("name-not-a-service-name", "metadata.name", "1pool", POOL_NAME),
    ("name-with-a-dot", "metadata.name", "pool.a", POOL_NAME),
    ("gke-node-pool-name-too-long", "spec.provisioning", {**GKE, "gke": {**GKE["gke"], "nodePoolName": "n" * 41}},
     "spec.provisioning.gke.nodePoolName"),
    ("queued-provisioning", "spec.provisioning", {**GKE, "gke": {**GKE["gke"], "queuedProvisioning": True}},
     "spec.provisioning.gke.queuedProvisioning: true is not supported"),
    ("shared-size-with-claim", "spec.tiers.shared", {"claimName": "kv", "size": "18Ti"},
     "spec.tiers.shared.size applies only with storageClassName"),
    ("shared-capacity-beyond-size", "spec.tiers.shared", {"storageClassName": "lustre", "size": "1Ti",
                                                          "capacity": "2Ti"},
     "spec.tiers.shared.capacity must not exceed spec.tiers.shared.size"),
]
SERVING_CASES += [
    ("name-role-service-too-long", "metadata.name", "s" * 56, SERVING_NAME),
    ("name-not-a-service-name", "metadata.name", "9s", SERVING_NAME),
    ("decode-clamped-off", "spec.decode", {"maxReplicas": 0}, "spec.decode.maxReplicas: 0 with spec.decode.replicas"),
    ("no-role-runs", "spec", {**SERVING["spec"], "prefill": {"maxReplicas": 0}, "decode": {"replicas": 0}},
     "leave no replica of either role at any spec.replicas"),
    ("lockstep-one-role-minimum", "spec", {**SERVING["spec"], "rollout": LOCKSTEP, "prefill": {"minReplicas": 1}},
     "spec.rollout.strategy Lockstep runs every role or none"),
    ("lockstep-role-clamped-off", "spec", {**SERVING["spec"], "rollout": LOCKSTEP, "prefill": {"maxReplicas": 0}},
     "spec.rollout.strategy Lockstep runs every role or none"),
    ("sglang-two-units", "spec", {**SERVING["spec"], **SGLANG, "replicas": 2},
     "spec.prefill: at most one prefill replica with spec.engine.type sglang-jax"),
    ("sglang-two-prefills", "spec", {**SERVING["spec"], **SGLANG, "prefill": {"replicas": 2}},
     "spec.prefill: at most one prefill replica with spec.engine.type sglang-jax"),
    ("sglang-prefill-minimum", "spec", {**SERVING["spec"], **SGLANG, "prefill": {"minReplicas": 2, "maxReplicas": 2}},
     "spec.prefill: at most one prefill replica with spec.engine.type sglang-jax"),
    ("active-active-one-picker", "spec.routing", {"eppHighAvailability": "ActiveActive", "eppReplicas": 1},
     "spec.routing.eppHighAvailability ActiveActive needs spec.routing.enabled and spec.routing.eppReplicas"),
    ("active-active-no-routing", "spec.routing", {"eppHighAvailability": "ActiveActive", "enabled": False},
     "spec.routing.eppHighAvailability ActiveActive needs spec.routing.enabled and spec.routing.eppReplicas"),
    ("proxy-connector-enum", "spec.routing.proxyKvConnector", "nixl", "spec.routing.proxyKvConnector"),
    ("proxy-sglang-without-sglang-jax", "spec.routing.proxyKvConnector", "sglang",
     "spec.routing.proxyKvConnector: sglang is the P/D protocol of spec.engine.type sglang-jax"),
]
# Objects that need more than one change: (id, object, text).
OTHER_CASES = [
    ("pool-name-store-statefulset-too-long",
     variant(variant(POOL, "metadata.name", "p" * 47), "spec.storeNodes", STORE), POOL_NAME),
    ("pool-name-too-long-for-its-gke-node-pool",
     variant(variant(POOL, "metadata.name", "p" * 41), "spec.provisioning", GKE),
     "metadata.name names the GKE node pool in mode gke"),
    ("serving-name-sglang-bootstrap-too-long",
     variant(variant(SERVING, "metadata.name", "s" * 51), "spec", {**SERVING["spec"], **SGLANG}), SERVING_NAME),
    ("serving-name-multi-host-too-long",
     variant(variant(SERVING, "metadata.name", "s" * 42), "spec.decode", {"hostsPerReplica": 2}), SERVING_NAME),
    ("serving-name-lockstep-too-long",
     variant(variant(SERVING, "metadata.name", "s" * 33), "spec.rollout", LOCKSTEP), SERVING_NAME),
]


def invalid_objects() -> list[tuple[str, dict[str, Any], str]]:
    """(id, object, text its refusal must contain) for every case above."""
    out = [(f"pool-{i}", variant(POOL, path, value), message) for i, path, value, message in POOL_CASES]
    out += [(f"serving-{i}", variant(SERVING, path, value), message) for i, path, value, message in SERVING_CASES]
    return out + OTHER_CASES
