"""Every field of the CRDs changes what the operator renders (the objects it applies and the GKE
node pools it requests), or is refused: no field is read and dropped. FIELDS names, for every
leaf of both specs, another valid value (and the context it needs, set in both objects); the
test fails when the CRDs gain a field this table does not name."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
from op_helpers import merge_patch

from tpusync_operator.crdgen import build_crd
from tpusync_operator.render import check, dump, render

POOL = {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool", "metadata": {"name": "pool", "namespace": "ns"},
        "spec": {"tpu": {"type": "v6e", "topology": "2x4"},
                 "provisioning": {"mode": "existing", "existing": {"nodePoolName": "tpu-np"}}}}
SERVING = {"apiVersion": "tpusync.dev/v1alpha1", "kind": "DisaggregatedServing",
           "metadata": {"name": "llm", "namespace": "ns"},
           "spec": {"model": {"name": "org/m", "uri": "hf://org/m"}, "poolRef": {"name": "pool"}}}

# Contexts are JSON merge patches (null deletes a key).
GKE = {"provisioning": {"mode": "gke", "existing": None,
                        "gke": {"project": "my-project", "location": "us-east5", "cluster": "c1"}}}
STORE = {"storeNodes": {"enabled": True}}
DISK = {"tiers": {"disk": {"size": "100Gi"}}}
SHARED = {"tiers": {"shared": {"claimName": "kv"}}}
GATEWAY = {"routing": {"gatewayRef": {"name": "gw"}}}
ROPE = {"model": {"ropeScaling": {"factor": 2.0, "originalMaxPositionEmbeddings": 32768, "ropeTheta": 1000000.0}}}
REFERENCE = {"engine": {"type": "reference"}}
OTHER_POOL = "pool-b"     # rendered beside the serving's pool, with its spec

# path: (another valid value, context of the pool spec, context of the serving spec)
FIELDS: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "spec.tpu.type": ("v5e", {}, {}),
    "spec.tpu.topology": ("2x2", {}, {}),
    "spec.capacity.hosts": (2, GKE, {}),
    "spec.capacity.autoscaling.minHosts": (1, merge_patch(GKE, {"capacity": {"autoscaling": {"maxHosts": 4}}}), {}),
    "spec.capacity.autoscaling.maxHosts": (8, GKE, {}),
    "spec.capacity.spot": (True, GKE, {}),
    "spec.capacity.reservation": ("my-reservation", GKE, {}),
    "spec.provisioning.mode": ("gke", {}, {}),          # refused alone: each mode has its block
    "spec.provisioning.gke.project": ("other-project", GKE, {}),
    "spec.provisioning.gke.location": ("us-central1", GKE, {}),
    "spec.provisioning.gke.cluster": ("c2", GKE, {}),
    "spec.provisioning.gke.nodeLocations": (["us-east5-b"], GKE, {}),
    "spec.provisioning.gke.nodePoolName": ("np-2", GKE, {}),
    "spec.provisioning.gke.workloadPolicy": ("wp-2", merge_patch(GKE, {
        "tpu": {"type": "v7x", "topology": "2x2x2"}, "provisioning": {"gke": {"workloadPolicy": "wp"}}}), {}),
    "spec.provisioning.gke.queuedProvisioning": (True, GKE, {}),
    "spec.provisioning.gke.serviceAccount": ("nodes@my-project.iam.gserviceaccount.com", GKE, {}),
    "spec.provisioning.existing.nodePoolName": ("other-np", {}, {}),
    "spec.provisioning.existing.nodeSelector": ({"example.com/tpu": "yes"}, {}, {}),
    "spec.tiers.dram": ("32Gi", {}, {}),
    "spec.tiers.disk.size": ("200Gi", DISK, {}),
    "spec.tiers.disk.medium": ("EphemeralVolume", {"tiers": {"disk": {"size": "1Ti", "storageClassName": "ssd"}}},
                               {}),
    "spec.tiers.disk.storageClassName": ("hyperdisk", {"tiers": {"disk": {
        "size": "1Ti", "medium": "EphemeralVolume", "storageClassName": "ssd"}}}, {}),
    "spec.tiers.shared.claimName": ("kv-2", SHARED, {}),
    "spec.tiers.shared.storageClassName": ("lustre-2", {"tiers": {"shared": {"storageClassName": "lustre",
                                                                            "size": "18Ti"}}}, {}),
    "spec.tiers.shared.size": ("36Ti", {"tiers": {"shared": {"storageClassName": "lustre", "size": "18Ti"}}}, {}),
    "spec.tiers.shared.capacity": ("1Ti", SHARED, {}),
    "spec.tiers.shared.policy": ("Demote", SHARED, {}),
    "spec.tiers.shared.highWatermarkPercent": (95, SHARED, {}),
    "spec.tiers.shared.lowWatermarkPercent": (50, SHARED, {}),
    "spec.tiers.blockBytes": ("2Mi", {}, {}),
    "spec.sidecar.image": ("registry.example/tpusync-sidecar:9", {}, {}),
    "spec.sidecar.imagePullPolicy": ("Always", {}, {}),
    "spec.sidecar.dataPort": (7700, {}, {}),
    "spec.sidecar.httpPort": (7701, {}, {}),
    "spec.sidecar.kvEventsPort": (5558, {}, {}),
    "spec.sidecar.resources.requests": ({"cpu": "2"}, {}, {}),
    "spec.sidecar.resources.limits": ({"memory": "4Gi"}, {}, {}),
    "spec.sidecar.encrypt": (True, {}, {}),
    "spec.storeNodes.enabled": (True, {}, {}),
    "spec.storeNodes.kind": ("DaemonSet", STORE, {}),
    "spec.storeNodes.replicas": (3, STORE, {}),
    "spec.storeNodes.dram": ("64Gi", STORE, {}),
    "spec.storeNodes.disk.size": ("1Ti", {"storeNodes": {"enabled": True, "disk": {"size": "100Gi"}}}, {}),
    "spec.storeNodes.disk.medium": ("EphemeralVolume", {"storeNodes": {
        "enabled": True, "disk": {"size": "100Gi", "storageClassName": "ssd"}}}, {}),
    "spec.storeNodes.disk.storageClassName": ("ssd-2", {"storeNodes": {
        "enabled": True, "disk": {"size": "100Gi", "medium": "EphemeralVolume", "storageClassName": "ssd"}}}, {}),
    "spec.storeNodes.nodeSelector": ({"example.com/store": "yes"}, STORE, {}),
    "spec.storeNodes.resources.requests": ({"cpu": "8"}, STORE, {}),
    "spec.storeNodes.resources.limits": ({"cpu": "16"}, STORE, {}),
    "spec.auth.secretName": ("my-token", {}, {}),

    "spec.model.name": ("org/other", {}, {}),
    "spec.model.uri": ("hf://org/other", {}, {}),
    "spec.model.revision": ("v2", {}, {}),
    "spec.model.tokenSecretRef.name": ("hf", {}, {}),
    "spec.model.tokenSecretRef.key": ("hf-token", {}, {"model": {"tokenSecretRef": {"name": "hf"}}}),
    "spec.model.maxModelLen": (4096, {}, {"model": {"maxPositionEmbeddings": 8192}}),
    "spec.model.maxPositionEmbeddings": (2048, {}, {"model": {"maxModelLen": 4096, "maxPositionEmbeddings": 8192}}),
    "spec.model.ropeScaling.type": ("yarn", {}, ROPE),    # its only value, the default
    "spec.model.ropeScaling.factor": (4.0, {}, ROPE),
    "spec.model.ropeScaling.originalMaxPositionEmbeddings": (16384, {}, ROPE),
    "spec.model.ropeScaling.ropeTheta": (10000.0, {}, ROPE),
    "spec.engine.type": ("reference", {}, {}),
    "spec.engine.image": ("registry.example/engine:2", {}, {}),
    "spec.engine.imagePullPolicy": ("Always", {}, {}),
    "spec.engine.cpuOnly": (True, {}, REFERENCE),
    "spec.engine.env": ([{"name": "X", "value": "1"}], {}, {}),
    "spec.engine.securityContext.runAsUser": (1000, {}, {}),
    "spec.engine.securityContext.runAsGroup": (1000, {}, {}),
    "spec.engine.securityContext.runAsNonRoot": (True, {}, {"engine": {"securityContext": {"runAsUser": 1000}}}),
    "spec.engine.securityContext.privileged": (True, {}, {"engine": {"securityContext": {
        "allowPrivilegeEscalation": True}}}),
    "spec.engine.securityContext.allowPrivilegeEscalation": (True, {}, {}),
    "spec.engine.securityContext.capabilities.add": (["IPC_LOCK"], {}, {}),
    "spec.engine.securityContext.capabilities.drop": (["ALL"], {}, {}),
    "spec.poolRef.name": ("pool-2", {}, {}),     # the pool is renamed with it (below)
    "spec.replicas": (2, {"capacity": {"hosts": 4}}, {}),
    "spec.prefill.replicas": (2, {"capacity": {"hosts": 4}}, {}),
    "spec.prefill.minReplicas": (2, {"capacity": {"hosts": 4}}, {}),
    "spec.prefill.maxReplicas": (0, {}, {}),
    # Another pool of the same spec for one role (the pools then need one auth Secret).
    "spec.prefill.poolRef.name": (OTHER_POOL, {"auth": {"secretName": "kv-auth"}}, {}),
    "spec.prefill.topology": ("2x4", {}, {}),    # the pool's: any other is refused (one slice shape)
    "spec.prefill.hostsPerReplica": (1, {}, {}),  # the slice's: any other is refused
    "spec.prefill.args": (["--max-num-seqs=8"], {}, {}),
    "spec.prefill.resources.requests": ({"cpu": "8"}, {}, {}),
    "spec.prefill.resources.limits": ({"memory": "64Gi"}, {}, {}),
    "spec.decode.replicas": (2, {"capacity": {"hosts": 4}}, {}),
    "spec.decode.minReplicas": (2, {"capacity": {"hosts": 4}}, {}),
    "spec.decode.maxReplicas": (1, {"capacity": {"hosts": 4}}, {"decode": {"replicas": 2}}),
    "spec.decode.poolRef.name": (OTHER_POOL, {"auth": {"secretName": "kv-auth"}}, {}),
    "spec.decode.topology": ("2x4", {}, {}),
    "spec.decode.hostsPerReplica": (1, {}, {}),
    "spec.decode.args": (["--max-num-seqs=8"], {}, {}),
    "spec.decode.resources.requests": ({"cpu": "8"}, {}, {}),
    "spec.decode.resources.limits": ({"memory": "64Gi"}, {}, {}),
    "spec.kvTransfer.connector": ("tpu-inference", {}, {}),
    "spec.prefixCache.hostDram": ("8Gi", {}, {}),
    "spec.prefixCache.disk": ("10Gi", DISK, {}),
    "spec.routing.enabled": (False, {}, {}),
    "spec.routing.scorerWeights.prefixCache": (3.0, {}, {}),
    "spec.routing.scorerWeights.queue": (2.0, {}, {}),
    "spec.routing.scorerWeights.kvCacheUtilization": (2.0, {}, {}),
    "spec.routing.pdThresholdTokens": (64, {}, {}),
    "spec.routing.precisePrefixCache": (False, {}, {}),
    "spec.routing.blockSizeTokens": (32, {}, {}),
    "spec.routing.gatewayRef.name": ("gw-2", {}, GATEWAY),
    "spec.routing.gatewayRef.namespace": ("gateways", {}, GATEWAY),
    "spec.routing.gatewayRef.sectionName": ("https", {}, GATEWAY),
    "spec.routing.objective.priority": (5, {}, {}),
    "spec.routing.gkeGatewayPolicies": (True, {}, {}),
    "spec.routing.eppImage": ("registry.example/epp:2", {}, {}),
    "spec.routing.proxyImage": ("registry.example/proxy:2", {}, {}),
    "spec.routing.eppReplicas": (3, {}, {}),
    "spec.routing.eppHighAvailability": ("ActiveActive", {}, {}),
    "spec.routing.proxyKvConnector": ("shared-storage", {}, {}),
    "spec.storage.weights.size": ("512Gi", {}, {}),
    "spec.storage.weights.medium": ("EphemeralVolume", {}, {"storage": {"weights": {"size": "512Gi",
                                                                                   "storageClassName": "hd"}}}),
    "spec.storage.weights.storageClassName": ("hd-2", {}, {"storage": {"weights": {
        "size": "512Gi", "medium": "EphemeralVolume", "storageClassName": "hd"}}}),
    "spec.storage.weights.claimName": ("weights-2", {}, {"storage": {"weights": {
        "size": "512Gi", "medium": "PersistentVolumeClaim", "claimName": "weights"}}}),
    "spec.storage.compileCache.size": ("64Gi", {}, {}),
    "spec.storage.compileCache.medium": ("EphemeralVolume", {}, {"storage": {"compileCache": {
        "size": "64Gi", "storageClassName": "hd"}}}),
    "spec.storage.compileCache.storageClassName": ("hd-2", {}, {"storage": {"compileCache": {
        "size": "64Gi", "medium": "EphemeralVolume", "storageClassName": "hd"}}}),
    "spec.storage.compileCache.claimName": ("cache-2", {}, {"storage": {"compileCache": {
        "size": "64Gi", "medium": "PersistentVolumeClaim", "claimName": "cache"}}}),
    "spec.rollout.strategy": ("Lockstep", {}, {}),
    "spec.rollout.maxSurge": (1, {}, {}),
    "spec.rollout.maxUnavailable": (2, {}, {}),
    "spec.port": (8080, {}, {}),
}
# Fields that only bound others, or that cannot change alone: the other value is refused.
# queuedProvisioning: true needs a ProvisioningRequest the operator does not create.
REFUSED = {"spec.provisioning.mode", "spec.model.maxPositionEmbeddings", "spec.provisioning.gke.queuedProvisioning"}
# Fields whose only valid alternative is their default or the value the rest of the spec fixes:
# set to that value, nothing may change (and nothing is refused).
SAME = {"spec.model.ropeScaling.type", "spec.prefill.topology", "spec.prefill.hostsPerReplica",
        "spec.decode.topology", "spec.decode.hostsPerReplica"}


POOL_KEYS = {"tpu", "capacity", "provisioning", "tiers", "sidecar", "storeNodes", "auth"}


def leaves(node: dict[str, Any], path: str):
    if node.get("type") == "object" and "properties" in node:
        for key, child in node["properties"].items():
            yield from leaves(child, f"{path}.{key}")
    else:
        yield path


def crd_fields() -> set[str]:
    out = set()
    for kind in ("TPUSyncPool", "DisaggregatedServing"):
        schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        out |= set(leaves(schema, "spec"))
    return out


def test_the_table_names_every_field_of_the_crds():
    assert set(FIELDS) == crd_fields()


def setting(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    keys = path.split(".")[1:]
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return out


def rendered(pool_spec: dict[str, Any], serving_spec: dict[str, Any]) -> str | list[str]:
    """What the operator renders, or the errors it refuses the objects with."""
    pool = {**copy.deepcopy(POOL), "spec": pool_spec}
    serving = {**copy.deepcopy(SERVING), "spec": serving_spec}
    pool["metadata"]["name"] = serving_spec["poolRef"]["name"]
    other = copy.deepcopy(pool)
    other["metadata"]["name"] = OTHER_POOL
    errors = check([pool, other, serving])
    if errors:
        return errors
    out = io.StringIO()
    dump(render([pool, other, serving]), out)
    return out.getvalue()


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_every_field_changes_what_the_operator_renders(path):
    value, pool_context, serving_context = FIELDS[path]
    pool_spec = merge_patch(POOL["spec"], pool_context)
    serving_spec = merge_patch(SERVING["spec"], serving_context)
    before = rendered(pool_spec, serving_spec)
    assert isinstance(before, str), before
    if path.split(".")[1] in POOL_KEYS:
        after = rendered(merge_patch(pool_spec, setting(path, value)), serving_spec)
    else:
        after = rendered(pool_spec, merge_patch(serving_spec, setting(path, value)))
    if path in REFUSED:
        assert isinstance(after, list), f"{path}={value!r} accepted"
    elif path in SAME:
        assert after == before
    else:
        assert after != before, f"{path}={value!r} changes nothing the operator renders"
