"""A GKE-mode TPUSyncPool changes and deletes only the node pools the operator created for it.

Every node pool the operator creates carries its mark in its labels (config.labels:
`tpusync.dev/managed-by: tpusync-operator`, `tpusync.dev/owner-uid: <the pool's uid>`, with
`tpusync.dev/pool` and `tpusync.dev/namespace`). A node pool of a wanted name without the
mark (made by hand, by another TPUSyncPool, or by an operator before the mark) is never
adopted, resized, re-scaled or deleted, by a pass, by the removal of a slice or by the
finalizer; the pool says why in its conditions (`NodePoolNotOwned`, naming the node pool and
the way out).

This is a contract test against the *documented* GKE REST API, served by the local HTTP
server in harness/gke_api.py written from that documentation (not GKE), with the real
GKEClient and an in-memory Kubernetes API (FakeKube).
"""

from __future__ import annotations

import copy

import kopf
import pytest
from op_helpers import PoolBody
from test_operator_gke_resize import CREATE, Operator, operate

from harness.gke_api import PARENT
from tpusync_operator.nodepools import delete_pool

MARK = {"tpusync.dev/managed-by": "tpusync-operator", "tpusync.dev/owner-uid": "uid-pool"}


def someone_elses(state, name: str, labels: dict | None, **extra) -> None:
    """A RUNNING node pool of one node that the operator did not create (GKE's JSON)."""
    config = {"machineType": "ct6e-standard-8t", **({"labels": labels} if labels else {})}
    with state.lock:
        state.pools[name] = {"name": name, "status": "RUNNING", "initialNodeCount": 1, "config": config, **extra}
        state.sizes[name] = 1


def touching(state, name: str) -> list[tuple[str, str]]:
    """The calls that changed (or would have changed) node pool `name`."""
    return [(m, p) for m, p in state.mutations() if p.startswith(f"{PARENT}/nodePools/{name}")]


async def finalize(op: Operator) -> None:
    """The finalizer, until it lets the object go (kopf retries its TemporaryError); GKE
    completes the operations it starts meanwhile."""
    for _ in range(5):
        try:
            await delete_pool(copy.deepcopy(op.kube.objects[op.key]), op.deps)
            return
        except kopf.TemporaryError:
            with op.state.lock:
                for running in [o for o in op.state.ops.values() if o["status"] != "DONE"]:
                    op.state.finish(running)
    raise AssertionError("the finalizer never let go")


@pytest.mark.parametrize("labels", [
    None,                                                                   # made by hand
    {"tpusync.dev/pool": "pool", "tpusync.dev/namespace": "ns"},            # the pool's name labels only
    {**MARK, "tpusync.dev/owner-uid": "uid-of-another-tpusyncpool"},        # another TPUSyncPool's
    {"tpusync.dev/owner-uid": "uid-pool"},                                  # half the mark
], ids=["unlabelled", "name-labels", "other-owner", "partial"])
@pytest.mark.parametrize("capacity", [{"hosts": 3}, {"autoscaling": {"minHosts": 0, "maxHosts": 4}}],
                         ids=["resize", "autoscale"])
def test_a_node_pool_without_the_mark_is_never_adopted_resized_or_deleted(gke_server, kube, clock, labels,
                                                                           capacity):
    """A TPUSyncPool naming an existing node pool (here: the pool's own name) that would need
    a setSize or setAutoscaling to match the spec: nothing is sent, the status says why, and
    deleting the pool leaves the node pool where it is."""
    state, _ = gke_server
    someone_elses(state, "pool", labels)
    before = copy.deepcopy(state.pools["pool"])

    async def scenario(op: Operator, state):
        for _ in range(3):
            assert await op.reconcile() == []
        cond = op.conditions()
        degraded, ready = cond["Degraded"], cond["Ready"]
        assert (degraded["status"], degraded["reason"]) == ("True", "NodePoolNotOwned")
        message = degraded["message"]
        assert "GKE node pool pool exists but the operator did not create it" in message
        assert "tpusync.dev/owner-uid=uid-pool" in message
        assert "spec.provisioning.gke.nodePoolName" in message and "delete node pool pool yourself" in message
        assert (ready["status"], ready["reason"], ready["message"]) == ("False", "NodePoolNotOwned", message)
        assert cond["Progressing"]["reason"] != "NodePoolProvisioning"     # nothing is under way
        assert op.status["nodePool"]["name"] == "pool" and op.status["nodePool"]["state"] == "NotOwned"
        assert ("Warning", "NodePoolNotOwned") in [e[:2] for e in op.events]
        await finalize(op)

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity=capacity).build(), scenario)
    assert touching(state, "pool") == [] and state.mutations() == []
    assert state.pools["pool"] == before and state.sizes["pool"] == 1


def test_the_node_pools_the_operator_creates_carry_the_mark_and_are_deleted(gke_server, kube, clock):
    state, _ = gke_server

    async def scenario(op: Operator, state):
        await op.settle()
        assert state.pools["pool"]["config"]["labels"] == {
            "tpusync.dev/pool": "pool", "tpusync.dev/namespace": "ns", **MARK}
        assert op.conditions()["Degraded"]["status"] == "False"
        op.edit(capacity={"hosts": 2})
        assert await op.reconcile() == [("POST", f"{PARENT}/nodePools/pool:setSize")]     # its own: resized
        await op.settle()
        await finalize(op)

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 1}).build(), scenario)
    assert state.mutations()[0] == CREATE
    assert ("DELETE", f"{PARENT}/nodePools/pool") in state.mutations() and "pool" not in state.pools


def test_a_node_pool_named_in_the_status_only_is_not_deleted(gke_server, kube, clock):
    """A name the pool dropped (it pointed at someone else's node pool, then at a free name),
    or one written into status.nodePools by hand: the slice's node pool is deleted only if it
    is the pool's own, by a pass or by the finalizer."""
    state, _ = gke_server
    someone_elses(state, "shared", None)

    async def scenario(op: Operator, state):
        assert await op.reconcile() == []
        assert [(e["name"], e["state"]) for e in op.status["nodePools"]] == [("shared", "NotOwned")]
        op.edit(provisioning={"mode": "gke", "gke": {"project": "my-project", "location": "us-central1",
                                                     "cluster": "c1", "nodePoolName": "mine"}})
        await op.settle()
        assert [e["name"] for e in op.status["nodePools"]] == ["mine"]
        assert ("Warning", "NodePoolNotOwned") in [e[:2] for e in op.events]
        # A status naming it again (status is not proof of ownership): the finalizer leaves it too.
        op.kube.objects[op.key]["status"]["nodePools"].append({"name": "shared", "state": "RUNNING"})
        await finalize(op)

    operate(gke_server, kube, clock, PoolBody().gke(nodePoolName="shared").build(), scenario)
    assert touching(state, "shared") == [] and state.pools["shared"]["status"] == "RUNNING"
    assert ("DELETE", f"{PARENT}/nodePools/mine") in state.mutations() and "mine" not in state.pools
