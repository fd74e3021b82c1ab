"""Pool builders: golden YAML per case (table-driven) plus the invariants that matter."""

from __future__ import annotations

import base64

import pytest
from op_helpers import PoolBody, assert_golden

from harness.gke_schema import problems
from tpusync_operator.builders import names
from tpusync_operator.builders import pool as b
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.sidecar import DISK_DIR_RESERVE, DISK_EXTENT_HEADER, disk_tier_bytes, pool_file_bytes
from tpusync_operator.models import GKE_NODE_POOL_MAX, TPUSyncPoolSpec
from tpusync_operator.pool_plan import PlanError, plan_pool
from tpusync_operator.tpu import slice_for


def setup(body):
    owner = Owner.from_body(body)
    spec = TPUSyncPoolSpec.model_validate(body["spec"])
    return owner, spec, slice_for(spec.tpu.type, spec.tpu.topology)


CASES = {
    "pool-existing-v6e": PoolBody(),
    "pool-disk": PoolBody().spec(tiers={"dram": "8Gi", "disk": {"size": "100Gi"}}),
    "pool-store-statefulset": PoolBody().store(replicas=2, dram="4Gi",
                                               disk={"size": "1Ti", "medium": "EphemeralVolume",
                                                     "storageClassName": "premium-rwo"}),
    "pool-store-daemonset": PoolBody().store(kind="DaemonSet", nodeSelector={"pool": "cpu"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pool_children_golden(case):
    owner, spec, _ = setup(CASES[case].build())
    objs = [b.build_peers_service(owner, spec), b.build_network_policy(owner, spec)]
    if spec.store_nodes.enabled:
        objs.append(b.build_store_nodes(owner, spec))
    assert_golden(case, objs)
    for obj in objs:
        ref = obj["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "uid-pool" and ref["controller"] is True


NODE_POOL_CASES = {
    "nodepool-v6e-single-host": (PoolBody().gke().spec(capacity={"hosts": 3, "spot": True}), {
        "machineType": "ct6e-standard-8t", "initialNodeCount": 3, "placement": None}),
    "nodepool-v6e-multi-host": (PoolBody().spec(tpu={"topology": "4x4"}).gke(), {
        "machineType": "ct6e-standard-4t", "initialNodeCount": 4,
        "placement": {"type": "COMPACT", "tpuTopology": "4x4"}}),
    "nodepool-v7x-multi-host-reserved": (
        PoolBody().v7x("2x2x2").gke(workloadPolicy="wp", queuedProvisioning=False)
        .spec(capacity={"reservation": "res-1"}), {
            "machineType": "tpu7x-standard-4t", "initialNodeCount": 2,
            "placement": {"type": "COMPACT", "policyName": "wp"}}),
    "nodepool-v7x-autoscaling": (
        PoolBody().v7x("2x2x1").gke().spec(capacity={"autoscaling": {"minHosts": 0, "maxHosts": 4}}), {
            "machineType": "tpu7x-standard-4t", "initialNodeCount": 0, "placement": None}),
}


@pytest.mark.parametrize("case", sorted(NODE_POOL_CASES))
def test_node_pool_request(case):
    body, want = NODE_POOL_CASES[case]
    owner, spec, tpu = setup(body.build())
    req = b.build_node_pool_request(owner, spec, tpu)
    np = req["nodePool"]
    assert np["name"] == "pool"
    assert np["config"]["machineType"] == want["machineType"]
    assert np["initialNodeCount"] == want["initialNodeCount"]
    assert np.get("placementPolicy") == want["placement"]
    assert problems("CreateNodePoolRequest", req) == []     # Google's published schema of the API
    assert_golden(case, req)


def test_the_schema_check_refuses_what_gke_refuses():
    """gke_schema.problems against the discovery document: a misspelt field, an enum value in
    the wrong spelling, a wrong JSON type."""
    bad = {"nodePool": {"name": "p", "initialNodeCount": "3", "config": {
        "machineType": "ct6e-standard-4t", "tpuTopolgy": "2x2",
        "taints": [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}]}}}
    found = problems("CreateNodePoolRequest", bad)
    assert len(found) == 3, found
    assert any("tpuTopolgy" in p for p in found) and any("NO_SCHEDULE" in p for p in found)
    assert any("initialNodeCount" in p for p in found)


def test_reservation_affinity_and_autoscaling():
    _, _, _ = setup(PoolBody().build())
    owner, spec, tpu = setup(NODE_POOL_CASES["nodepool-v7x-multi-host-reserved"][0].build())
    affinity = b.build_node_pool_request(owner, spec, tpu)["nodePool"]["config"]["reservationAffinity"]
    assert affinity == {"consumeReservationType": "SPECIFIC_RESERVATION",
                        "key": "compute.googleapis.com/reservation-name", "values": ["res-1"]}
    owner, spec, tpu = setup(NODE_POOL_CASES["nodepool-v7x-autoscaling"][0].build())
    assert b.build_node_pool_request(owner, spec, tpu)["nodePool"]["autoscaling"] == {
        "enabled": True, "minNodeCount": 0, "maxNodeCount": 4}


def test_node_locations_pin_a_regional_cluster_pool_to_the_tpu_zone():
    owner, spec, tpu = setup(PoolBody().gke().build())
    assert "locations" not in b.build_node_pool_request(owner, spec, tpu)["nodePool"]
    owner, spec, tpu = setup(PoolBody().gke(nodeLocations=["us-central1-b"]).build())
    assert b.build_node_pool_request(owner, spec, tpu)["nodePool"]["locations"] == ["us-central1-b"]


def test_auth_secret_carries_the_token():
    owner, spec, _ = setup(PoolBody().build())
    secret = b.build_auth_secret(owner, spec, b"\x00\x01secret")
    assert secret["metadata"]["name"] == "pool-auth"
    assert base64.b64decode(secret["data"]["token"]) == b"\x00\x01secret"


def test_network_policy_admits_only_members_to_data_port():
    owner, spec, _ = setup(PoolBody().spec(sidecar={"dataPort": 9000}).build())
    np = b.build_network_policy(owner, spec)["spec"]
    data_rules = [r for r in np["ingress"] if {"protocol": "TCP", "port": 9000} in r["ports"]]
    assert len(data_rules) == 1
    assert data_rules[0]["from"] == [{"podSelector": {"matchLabels": {"tpusync.dev/pool": "pool"}}}]
    assert all(9000 not in [p["port"] for p in r["ports"]] for r in np["ingress"] if r is not data_rules[0])


def test_store_nodes_are_hardened():
    owner, spec, _ = setup(CASES["pool-store-statefulset"].build())
    pod = b.build_store_nodes(owner, spec)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"readinessProbe", "livenessProbe", "startupProbe"} <= c.keys()
    assert not any("hostPath" in v for v in pod["volumes"])
    assert "--dram-bytes=4294967296" in c["args"]
    assert f"--disk-bytes={disk_tier_bytes(2**40, 2**20)}" in c["args"]


@pytest.mark.parametrize("size,block", [(2**40, 2**20), (2**30, 2 * 2**20), (2**30, 64 * 2**10),
                                        (2**20 + 4096 + 4096, 4096)])
def test_the_disk_tier_fits_in_its_volume(size, block):
    """The sidecar's file holds a 4Ki header per block (native/src/store/disk_tier.cc) and the
    directory its own small files: with --disk-bytes as rendered, all of it fits in the volume
    (an emptyDir past its sizeLimit gets the pod evicted, as a real kubelet did), and one
    more block would not."""
    blocks = disk_tier_bytes(size, block) // block
    assert blocks >= 1
    used = blocks * (block + DISK_EXTENT_HEADER) + DISK_DIR_RESERVE
    assert used <= size < used + block + DISK_EXTENT_HEADER


def test_store_nodes_shm_holds_the_pool_file():
    """The DRAM tier's file is bigger than --dram-bytes (a header page and a slot table, both
    ends on 2 MiB): a memory-backed /dev/shm of exactly --dram-bytes fails its fallocate."""
    owner, spec, _ = setup(CASES["pool-store-statefulset"].build())   # 4 GiB of DRAM, 1 MiB blocks
    pod = b.build_store_nodes(owner, spec)["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "tpusync-shm"]
    slots = 4 * 2**30 // 2**20
    assert int(shm["emptyDir"]["sizeLimit"]) == pool_file_bytes(4 * 2**30, 2**20) == \
        4 * 2**30 + 2 * 2**20 * -(-(4096 + 64 * slots) // (2 * 2**20))


def test_store_nodes_request_the_memory_their_dram_tier_takes():
    owner, spec, _ = setup(CASES["pool-store-statefulset"].build())   # 4 GiB of DRAM, no resources
    c = b.build_store_nodes(owner, spec)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"memory": str(4 * 2**30 + 512 * 2**20)}}
    owner, spec, _ = setup(CASES["pool-store-statefulset"].store(resources={"requests": {"memory": "5Gi"}}).build())
    c = b.build_store_nodes(owner, spec)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["memory"] == "5Gi"     # the user's figure stands


@pytest.mark.parametrize("spec,selector", [
    (PoolBody().build()["spec"], {"cloud.google.com/gke-nodepool": "tpu-np"}),
    (PoolBody().gke(nodePoolName="np2").build()["spec"], {"cloud.google.com/gke-nodepool": "np2"}),
    (PoolBody().spec(provisioning={"existing": {"nodePoolName": None, "nodeSelector": {"a": "b"}}}).build()["spec"],
     {"a": "b"}),
])
def test_pool_node_selector(spec, selector):
    spec = TPUSyncPoolSpec.model_validate(spec)
    assert b.pool_node_selector("pool", "ns", spec, slice_for(spec.tpu.type, spec.tpu.topology)) == selector


@pytest.mark.parametrize("tpu,topology,machine,hosts,cores", [
    ("v5e", "2x4", "ct5lp-hightpu-8t", 1, 1), ("v5e", "4x4", "ct5lp-hightpu-4t", 4, 1),
    ("v6e", "2x2", "ct6e-standard-4t", 1, 1), ("v7x", "2x2x2", "tpu7x-standard-4t", 2, 2),
])
def test_slices_per_generation(tpu, topology, machine, hosts, cores):
    """Machine types, hosts and TensorCores per chip per generation (tensor parallelism
    counts TensorCores: versions.TPU_INFERENCE)."""
    s = slice_for(tpu, topology)
    assert (s.machine_type, s.hosts, s.cores_per_chip) == (machine, hosts, cores)
    assert s.tensor_parallel(s.chips) == s.chips * cores
    assert s.accelerator == {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v7x": "tpu7x"}[tpu]


def test_v5e_multi_host_node_pool_uses_tpu_topology():
    body = PoolBody().spec(tpu={"type": "v5e", "topology": "4x4"}, capacity={"hosts": 4}).gke().build()
    owner, spec, tpu = setup(body)
    req = b.build_node_pool_request(owner, spec, tpu)["nodePool"]
    assert req["config"]["machineType"] == "ct5lp-hightpu-4t" and req["initialNodeCount"] == 4
    assert req["placementPolicy"] == {"type": "COMPACT", "tpuTopology": "4x4"}


def test_the_shared_tier_claim_is_created_only_from_a_storage_class():
    owner, spec, _ = setup(PoolBody().spec(tiers={"shared": {"storageClassName": "lustre-rwx", "size": "18000Gi"}})
                           .build())
    claim = b.build_shared_claim(owner, spec)
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == f"{owner.name}-shared"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "lustre-rwx",
                             "resources": {"requests": {"storage": "18000Gi"}}}
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner.uid  # goes with the pool
    _, existing, _ = setup(PoolBody().spec(tiers={"shared": {"claimName": "kv-lustre"}}).build())
    assert b.build_shared_claim(owner, existing) is None


@pytest.mark.parametrize("name,hosts,refused", [
    ("p" * 40, 4, False),          # one v6e 4x4 slice: the node pool is the pool's name
    ("p" * 38, 36, False),         # nine slices: p...p-8, 40 characters
    ("p" * 38, 44, True),          # eleven: the last, p...p-10, has 41
])
def test_every_slice_node_pool_name_fits_gke(name, hosts, refused):
    """GKE allows node pool names of 40 characters; slices after the first are <base>-<i>. The
    schema checks the base; the planner the longest slice's name, before any GKE call."""
    body = PoolBody(name).spec(tpu={"topology": "4x4"}, capacity={"hosts": hosts}).gke().build()
    owner, spec, _ = setup(body)
    longest = names.gke_node_pool(name, spec, hosts // 4 - 1)
    if len(longest) > GKE_NODE_POOL_MAX:
        with pytest.raises(PlanError, match=r"metadata\.name \(the default of spec\.provisioning\.gke\.nodePoolName\)"):
            plan_pool(owner, spec)
    else:
        assert [r.name for r in plan_pool(owner, spec).node_pool_requests][-1] == longest
    assert (len(longest) > GKE_NODE_POOL_MAX) == refused
