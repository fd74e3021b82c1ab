"""Edits of a GKE-mode TPUSyncPool's capacity (spec.capacity.hosts / .autoscaling) applied to
its node pool.

This is a contract test against the *documented* GKE REST API (container.googleapis.com v1:
projects.locations.clusters.nodePools setSize and setAutoscaling, which return long-running
Operations; one operation at a time per cluster, another refused with 400
FAILED_PRECONDITION; no current node count in a NodePool; multi-host TPU slice node pools
are atomic), served by the local HTTP server in harness/gke_api.py written from that
documentation. It is not GKE. The reconciler runs with the real GKEClient against that server
and an in-memory Kubernetes API (FakeKube).
"""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest
from op_helpers import PoolBody

from harness.gke_api import PARENT
from tpusync_operator.gke import ClusterRef, GKEClient, GKEConflict, GKEError, StaticToken
from tpusync_operator.reconcile import Deps
from tpusync_operator.reconcile_pool import reconcile_pool

CLUSTER = ClusterRef("my-project", "us-central1", "c1")
SET_SIZE = ("POST", f"{PARENT}/nodePools/pool:setSize")
SET_AUTOSCALING = ("POST", f"{PARENT}/nodePools/pool:setAutoscaling")
CREATE = ("POST", f"{PARENT}/nodePools")


async def no_sleep(delay: float) -> None:
    pass


def node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": "pool"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


class Operator:
    """Reconcile passes of one TPUSyncPool held by FakeKube, against the GKE API server."""

    def __init__(self, kube, clock, state, client: GKEClient, body: dict):
        self.kube, self.state, self.events = kube, state, []
        self.deps = Deps(kube=kube, gke=client, now=clock, token=lambda: b"t", emit=self._emit)
        self.key = (body["apiVersion"], body["kind"], "ns", body["metadata"]["name"])
        kube.put(body)
        self.retry: kopf.TemporaryError | None = None

    def _emit(self, body, type_, reason, message):
        self.events.append((type_, reason, message))

    @property
    def status(self) -> dict:
        return self.kube.objects[self.key]["status"]

    def conditions(self) -> dict:
        return {c["type"]: c for c in self.status["conditions"]}

    def edit(self, capacity: dict | None = None, **spec) -> None:
        """A spec edit, as kubectl would make it: a new generation."""
        obj = self.kube.objects[self.key]
        if capacity is not None:
            obj["spec"]["capacity"] = capacity
        obj["spec"].update(spec)
        obj["metadata"]["generation"] += 1

    async def reconcile(self) -> list[tuple[str, str]]:
        """One pass over the stored object; returns the calls that changed something in GKE."""
        before = len(self.state.mutations())
        self.retry = None
        try:
            await reconcile_pool(copy.deepcopy(self.kube.objects[self.key]), self.deps)
        except kopf.TemporaryError as e:
            self.retry = e
        return self.state.mutations()[before:]

    async def settle(self, passes: int = 8) -> None:
        """Passes until no operation is pending and a pass changes nothing."""
        for _ in range(passes):
            if not await self.reconcile() and not (self.status.get("nodePool") or {}).get("operation"):
                return
        raise AssertionError(f"not settled: {self.status}")


def operate(gke_server, kube, clock, body, scenario):
    state, url = gke_server

    async def main():
        client = GKEClient(StaticToken("good"), url, sleep=no_sleep)
        try:
            await scenario(Operator(kube, clock, state, client, body), state)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_resize_is_applied_once(gke_server, kube, clock):
    for i in range(3):
        kube.put(node(f"n{i}"))

    async def scenario(op: Operator, state):
        await op.settle()
        assert state.mutations() == [CREATE]
        assert op.status["nodePool"] == {"name": "pool", "state": "RUNNING", "nodeCount": 3}  # operation: null, removed
        assert await op.reconcile() == []                     # nothing differs: no call
        op.edit(capacity={"hosts": 1})
        assert await op.reconcile() == [SET_SIZE]
        assert state.bodies[-1] == {"nodeCount": 1}
        assert op.status["nodePool"]["operation"] == "operation-2" and op.status["nodePool"]["nodeCount"] == 1
        cond = op.conditions()
        assert (cond["Progressing"]["status"], cond["Progressing"]["reason"]) == ("True", "NodePoolUpdating")
        assert cond["Ready"]["status"] == "True"              # the pool keeps serving while GKE resizes it
        assert op.retry is not None and op.retry.delay == 15
        assert ("Normal", "NodePoolResizing") in [e[:2] for e in op.events]
        await op.settle()
        assert state.sizes["pool"] == 1
        # GKE keeps initialNodeCount at 3: comparing with it would resize again and again.
        assert state.pools["pool"]["initialNodeCount"] == 3
        assert await op.reconcile() == [] and state.mutations().count(SET_SIZE) == 1
        assert op.conditions()["Progressing"]["status"] == "False"

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 3}).build(), scenario)


async def autoscaling_set(op: Operator, state, max_hosts: int) -> None:
    """From a settled pool to autoscaling 0..max_hosts: one setAutoscaling call, with GKE's body
    for it; settled again."""
    await op.settle()
    op.edit(capacity={"autoscaling": {"minHosts": 0, "maxHosts": max_hosts}})
    assert await op.reconcile() == [SET_AUTOSCALING]
    assert state.bodies[-1] == {"autoscaling": {"enabled": True, "minNodeCount": 0, "maxNodeCount": max_hosts}}
    await op.settle()


def test_autoscaling_enabled_changed_disabled(gke_server, kube, clock):
    async def scenario(op: Operator, state):
        await autoscaling_set(op, state, max_hosts=4)
        # GKE's JSON: minNodeCount 0 left out, its default locationPolicy added; no change seen.
        assert state.pools["pool"]["autoscaling"]["locationPolicy"] == "BALANCED"
        assert "nodeCount" not in op.status["nodePool"]   # null in the merge patch: removed
        assert await op.reconcile() == []

        op.edit(capacity={"autoscaling": {"minHosts": 1, "maxHosts": 6}})
        assert await op.reconcile() == [SET_AUTOSCALING]
        assert state.bodies[-1] == {"autoscaling": {"enabled": True, "minNodeCount": 1, "maxNodeCount": 6}}
        await op.settle()

        op.edit(capacity={"hosts": 2})
        assert await op.reconcile() == [SET_AUTOSCALING]
        assert state.bodies[-1] == {"autoscaling": {"enabled": False}}
        await op.settle()                                     # then the size the autoscaler left is set
        assert state.mutations()[-1] == SET_SIZE and state.bodies[-1] == {"nodeCount": 2}
        assert state.sizes["pool"] == 2 and not state.pools["pool"].get("autoscaling")
        assert await op.reconcile() == []
        reasons = [e[1] for e in op.events if e[1].startswith("NodePool")]
        assert reasons == ["NodePoolCreating", "NodePoolAutoscalingChanged", "NodePoolAutoscalingChanged",
                           "NodePoolAutoscalingChanged", "NodePoolResizing"]

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 1}).build(), scenario)


def test_a_second_edit_waits_for_the_running_operation(gke_server, kube, clock):
    async def scenario(op: Operator, state):
        await op.settle()
        op.edit(capacity={"hosts": 2})
        assert await op.reconcile() == [SET_SIZE]
        op.edit(capacity={"hosts": 3})
        assert await op.reconcile() == []                     # operation-2 still RUNNING: nothing sent
        assert op.status["nodePool"]["operation"] == "operation-2"
        assert "is RUNNING" in op.conditions()["Progressing"]["message"]
        assert await op.reconcile() == [SET_SIZE]             # DONE: the next edit goes out
        assert state.bodies[-1] == {"nodeCount": 3}
        await op.settle()
        assert state.sizes["pool"] == 3 and state.mutations().count(SET_SIZE) == 2

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 1}).build(), scenario)


def test_another_operation_on_the_cluster_is_waited_for(gke_server, kube, clock):
    async def scenario(op: Operator, state):
        await op.settle()
        upgrade = state.start("UPGRADE_MASTER", PARENT)["name"]     # not ours
        op.edit(capacity={"hosts": 2})
        assert await op.reconcile() == [SET_SIZE]                    # refused: 400 FAILED_PRECONDITION
        assert op.retry is not None and op.retry.delay == 15
        assert op.status["nodePool"] == {"name": "pool", "state": "RUNNING", "nodeCount": 1}  # operation: null, removed
        cond = op.conditions()
        assert cond["Degraded"]["status"] == "False"
        assert cond["Progressing"]["status"] == "True" and upgrade in cond["Progressing"]["message"]
        state.ops[upgrade]["status"] = "DONE"
        assert await op.reconcile() == [SET_SIZE]
        assert op.status["nodePool"]["operation"] is not None and op.status["nodePool"]["nodeCount"] == 2
        await op.settle()
        assert state.sizes["pool"] == 2

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 1}).build(), scenario)


@pytest.mark.parametrize("capacity,edit,field", [
    ({}, {"tpu": {"type": "v7x", "topology": "2x2x4"}}, "spec.tpu.topology"),
    ({"autoscaling": {"minHosts": 0, "maxHosts": 2}}, {"capacity": {}}, "spec.capacity.autoscaling"),
])
def test_multi_host_resize_is_reported_not_sent(gke_server, kube, clock, capacity, edit, field):
    body = PoolBody().v7x("2x2x2").gke(workloadPolicy="wp").spec(capacity=capacity).build()

    async def scenario(op: Operator, state):
        await op.settle()
        assert state.mutations() == [CREATE]
        op.edit(**edit)
        for _ in range(2):                                    # level-based: the same report, no loop
            assert await op.reconcile() == []
            cond = op.conditions()["Degraded"]
            assert (cond["status"], cond["reason"]) == ("True", "NodePoolImmutable")
            assert field in cond["message"] and "multi-host" in cond["message"]
            assert "operation" not in op.status["nodePool"]
        assert [e[:2] for e in op.events].count(("Warning", "NodePoolImmutable")) == 1
        assert state.mutations() == [CREATE]

    operate(gke_server, kube, clock, body, scenario)


def test_multi_host_slice_may_be_autoscaled(gke_server, kube, clock):
    body = PoolBody().v7x("2x2x2").gke(workloadPolicy="wp").build()

    async def scenario(op: Operator, state):
        await autoscaling_set(op, state, max_hosts=2)
        assert SET_SIZE not in state.mutations()

    operate(gke_server, kube, clock, body, scenario)


def test_forbidden_resize_is_an_auth_failure(gke_server, kube, clock):
    async def scenario(op: Operator, state):
        await op.settle()
        state.faults = [(403, "PERMISSION_DENIED", {}, ":setSize")]     # container.clusters.update missing
        op.edit(capacity={"hosts": 2})
        assert await op.reconcile() == [SET_SIZE]
        cond = op.conditions()["Degraded"]
        assert (cond["reason"], "403" in cond["message"]) == ("GKEAuthFailed", True)
        assert op.retry is not None and op.retry.delay == 120
        assert op.status["nodePool"]["nodeCount"] == 1                   # not applied: sent again
        assert await op.reconcile() == [SET_SIZE]
        await op.settle()
        assert state.sizes["pool"] == 2

    operate(gke_server, kube, clock, PoolBody().gke().spec(capacity={"hosts": 1}).build(), scenario)


def test_client_set_size_and_autoscaling(gke_server):
    state, url = gke_server
    body = {"nodePool": {"name": "np", "config": {"machineType": "ct6e-standard-8t"}, "initialNodeCount": 1}}

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=no_sleep)
        try:
            await client.wait_operation(CLUSTER, (await client.create_node_pool(CLUSTER, body))["name"], interval=0)
            op = await client.set_node_pool_size(CLUSTER, "np", 3)
            assert (op["operationType"], op["status"]) == ("SET_NODE_POOL_SIZE", "RUNNING")
            with pytest.raises(GKEConflict) as busy:                    # one operation at a time
                await client.set_node_pool_autoscaling(CLUSTER, "np", {"enabled": True, "maxNodeCount": 4})
            assert (busy.value.status, busy.value.reason) == (400, "FAILED_PRECONDITION")
            await client.wait_operation(CLUSTER, op["name"], interval=0)
            np = await client.get_node_pool(CLUSTER, "np")
            assert np["initialNodeCount"] == 1 and "nodeCount" not in np and "autoscaling" not in np
            op = await client.set_node_pool_autoscaling(CLUSTER, "np", {"enabled": True, "minNodeCount": 0,
                                                                         "maxNodeCount": 4})
            await client.wait_operation(CLUSTER, op["name"], interval=0)
            np = await client.get_node_pool(CLUSTER, "np")
            assert np["autoscaling"] == {"enabled": True, "maxNodeCount": 4, "locationPolicy": "BALANCED"}
            with pytest.raises(GKEError) as bad:
                await client.set_node_pool_size(CLUSTER, "np", -1)
            assert (bad.value.status, bad.value.reason) == (400, "INVALID_ARGUMENT")
            assert not isinstance(bad.value, GKEConflict)
            with pytest.raises(GKEError) as missing:
                await client.set_node_pool_size(CLUSTER, "absent", 1)
            assert missing.value.status == 404
        finally:
            await client.aclose()

    asyncio.run(scenario())
    assert state.sizes["np"] == 3
    assert ("POST", f"{PARENT}/nodePools/np:setSize", "Bearer good") in state.requests


def test_slices_are_node_pools_added_and_removed(gke_server, kube, clock):
    """A v6e 4x4 pool (4-host slices) grown to 3 slices gets 3 node pools, created one at a time
    (GKE runs one operation per cluster); shrunk to 1, the two extra node pools are deleted."""
    async def passes(op: Operator, n: int = 20) -> None:
        for _ in range(n):
            changed = await op.reconcile()
            if not changed and not any(e.get("operation") for e in op.status["nodePools"]) \
                    and {e["state"] for e in op.status["nodePools"]} == {"RUNNING"}:
                return
        raise AssertionError(f"not settled: {op.status}")

    async def scenario(op: Operator, state):
        await passes(op)
        assert sorted(state.pools) == ["pool", "pool-1", "pool-2"]
        assert [e["name"] for e in op.status["nodePools"]] == ["pool", "pool-1", "pool-2"]
        assert op.status["nodePool"]["name"] == "pool"
        # One create each, never refused: the operator starts none while another runs.
        assert state.mutations().count(CREATE) == 3
        assert all(p["placementPolicy"]["tpuTopology"] == "4x4" and p["initialNodeCount"] == 4
                   for p in state.pools.values())
        op.edit(capacity={"hosts": 4})
        for _ in range(20):
            await op.reconcile()
            if sorted(state.pools) == ["pool"] and [e["name"] for e in op.status["nodePools"]] == ["pool"]:
                break
        else:
            raise AssertionError(f"extra slices not deleted: {sorted(state.pools)} {op.status['nodePools']}")
        assert ("DELETE", f"{PARENT}/nodePools/pool-1") in state.mutations()
        assert ("Normal", "NodePoolDeleted") in [e[:2] for e in op.events]

    operate(gke_server, kube, clock, PoolBody().spec(tpu={"topology": "4x4"}).gke().spec(
        capacity={"hosts": 12}).build(), scenario)
