"""Status computation: conditions, transition times, capacity."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tpusync_operator.status import (
    Capacity,
    Cond,
    PoolObservation,
    RoleObservation,
    ServingObservation,
    merge_conditions,
    pool_capacity,
    pool_conditions,
    revisions_of,
    serving_conditions,
    transitions,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_transition_time_changes_only_with_status():
    first = merge_conditions(None, [Cond("Ready", False, "A", "x")], 1, T0)
    assert first[0]["lastTransitionTime"] == OLD
    same = merge_conditions(first, [Cond("Ready", False, "B", "y")], 2, T0 + timedelta(minutes=5))
    assert same[0]["lastTransitionTime"] == OLD
    assert same[0]["reason"] == "B" and same[0]["observedGeneration"] == 2
    flipped = merge_conditions(same, [Cond("Ready", True, "C")], 2, T0 + timedelta(minutes=9))
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    assert transitions(same, flipped) == flipped and transitions(flipped, flipped) == []
    # Degraded staying True with a new cause is a transition (its event names the new cause).
    api = merge_conditions(None, [Cond("Degraded", True, "APIError", "429")], 1, T0)
    crd = merge_conditions(api, [Cond("Degraded", True, "MissingCRD", "InferencePool")], 1, T0)
    assert transitions(api, crd) == crd and transitions(crd, crd) == []


def pod(name, ready, dram=0, disk=0, deleting=False):
    meta = {"name": name, "annotations": {"tpusync.dev/dram-bytes": str(dram), "tpusync.dev/disk-bytes": str(disk)}}
    if deleting:
        meta["deletionTimestamp"] = OLD
    return {"metadata": meta, "status": {"initContainerStatuses": [{"name": "tpusync-sidecar", "ready": ready}]}}


def test_pool_capacity_counts_ready_sidecars_only():
    cap = pool_capacity([pod("a", True, 10, 1), pod("b", False, 100, 100), pod("c", True, 5, 0),
                         pod("d", True, 1000, 0, deleting=True),
                         {"metadata": {"name": "e"}, "status": {"containerStatuses": [{"name": "tpusync-sidecar",
                                                                                        "ready": True}]}}])
    assert cap == Capacity(sidecars=5, ready_sidecars=3, dram_bytes=15, disk_bytes=1)


def obs(**kw):
    base = {"mode": "existing", "desired_hosts": 2, "min_ready_hosts": 2, "ready_hosts": 2,
                "capacity": Capacity(2, 2, 0, 0), "store_desired": 0, "store_ready": 0}
    base.update(kw)
    return PoolObservation(**base)


def by_type(conds):
    return {c.type: c for c in conds}


@pytest.mark.parametrize("o,ready,progressing,degraded,reason", [
    (obs(), True, False, False, "PoolReady"),
    (obs(ready_hosts=1), False, True, False, "HostsNotReady"),
    (obs(mode="gke", node_pool_ready=False, node_pool_state="PROVISIONING"), False, True, False,
     "NodePoolProvisioning"),
    (obs(store_desired=2, store_ready=1), False, True, False, "StoreNodesNotReady"),
    (obs(store_desired=-1, store_ready=0), False, True, False, "StoreNodesNotReady"),
    (obs(issues=[Cond("Degraded", True, "AuthSecretMissing", "spec.auth.secretName: missing")]), False, False, True,
     "AuthSecretMissing"),
    (obs(issues=[Cond("Degraded", True, "NodePoolDrift", "drift")]), True, False, True, "PoolReady"),
    (obs(issues=[Cond("Degraded", True, "NodePoolImmutable", "spec.tpu.topology")]), True, False, True, "PoolReady"),
    (obs(mode="gke", node_pool_updating="resizing"), True, True, False, "PoolReady"),
    (obs(mode="gke", node_pool_updating="resizing", ready_hosts=1), False, True, False, "HostsNotReady"),
])
def test_pool_conditions(o, ready, progressing, degraded, reason):
    c = by_type(pool_conditions(o))
    assert (c["Ready"].status, c["Progressing"].status, c["Degraded"].status) == (ready, progressing, degraded)
    assert c["Ready"].reason == reason


NOT_OWNED = Cond("Degraded", True, "NodePoolNotOwned", "GKE node pool np exists but the operator did not create it")


@pytest.mark.parametrize("ready_hosts,progressing", [(0, "HostsNotReady"), (2, "Stable")])
def test_a_node_pool_not_owned_stops_the_pool_and_says_why(ready_hosts, progressing):
    """Nothing is under way (the operator leaves the node pool alone): Ready is False with the
    reason and message, Progressing is not NodePoolProvisioning."""
    c = by_type(pool_conditions(obs(mode="gke", node_pool_ready=False, node_pool_state="NotOwned",
                                    node_pool_message=NOT_OWNED.message, ready_hosts=ready_hosts,
                                    issues=[NOT_OWNED])))
    assert (c["Ready"].status, c["Ready"].reason, c["Ready"].message) == (False, "NodePoolNotOwned",
                                                                            NOT_OWNED.message)
    assert (c["Degraded"].status, c["Degraded"].reason, c["Degraded"].message) == (True, "NodePoolNotOwned",
                                                                                   NOT_OWNED.message)
    assert c["Progressing"].reason == progressing and NOT_OWNED.message not in c["Progressing"].message


def test_node_pool_edit_is_progress_of_a_ready_pool():
    c = by_type(pool_conditions(obs(mode="gke", node_pool_updating="resizing GKE node pool np to 3 nodes")))
    assert (c["Progressing"].reason, c["Progressing"].message) == ("NodePoolUpdating",
                                                                   "resizing GKE node pool np to 3 nodes")
    assert c["Ready"].message == "2 hosts, 2 sidecars ready"
    c = by_type(pool_conditions(obs(mode="gke", node_pool_updating="resizing", ready_hosts=1, min_ready_hosts=3)))
    assert c["Progressing"].message == "resizing; 1/3 hosts ready"


def sobs(**kw):
    base = {"roles": [RoleObservation("prefill", "Deployment", 1, 1), RoleObservation("decode", "Deployment", 2, 2)],
                "routing_enabled": True, "routing_ready": True, "pool_ready": True}
    base.update(kw)
    return ServingObservation(**base)


def test_serving_ready():
    c = by_type(serving_conditions(sobs()))
    assert c["Ready"].status and not c["Progressing"].status and not c["Degraded"].status


def test_serving_rollout_and_routing():
    c = by_type(serving_conditions(sobs(roles=[RoleObservation("decode", "LeaderWorkerSet", 2, 1)],
                                        routing_ready=False)))
    assert not c["Ready"].status and c["Progressing"].status
    assert "decode 1/2 ready" in c["Progressing"].message and "routing not ready" in c["Progressing"].message


def test_serving_missing_crd_degrades_and_names_it():
    c = by_type(serving_conditions(sobs(missing_kinds_message="CRD not installed in the cluster: LeaderWorkerSet")))
    assert c["Degraded"].status and c["Degraded"].reason == "MissingCRD"
    assert "LeaderWorkerSet" in c["Degraded"].message
    assert not c["Ready"].status and c["Ready"].reason == "MissingCRD"


OLD, NEW, NEWER = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-02T00:00:01Z"


def lws(revision, role, replicas, ready, created):
    return {"metadata": {"labels": {"disaggregatedset.x-k8s.io/revision": revision,
                                    "disaggregatedset.x-k8s.io/role": role},
                         "creationTimestamp": created},
            "spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def revisions(*sets):
    return revisions_of(list(sets), "disaggregatedset.x-k8s.io/revision", "disaggregatedset.x-k8s.io/role")


def test_revisions_newest_first_with_their_roles():
    revs = revisions(lws("a", "prefill", 2, 2, OLD), lws("b", "decode", 1, 0, NEW),
                     lws("a", "decode", 2, 1, OLD), lws("b", "prefill", 1, 1, NEWER))
    assert [r.revision for r in revs] == ["b", "a"]
    assert revs[1].replicas == {"prefill": 2, "decode": 2} and revs[1].ready == {"prefill": 2, "decode": 1}
    assert revs[1].servable() and not revs[0].servable()     # b has no ready decode yet


def test_a_lockstep_rollout_stays_ready_while_a_revision_serves():
    revs = revisions(lws("a", "prefill", 1, 1, OLD), lws("a", "decode", 1, 1, OLD),
                     lws("b", "prefill", 1, 0, NEW), lws("b", "decode", 1, 0, NEW))
    c = by_type(serving_conditions(sobs(roles=[RoleObservation("prefill", "LeaderWorkerSet", 1, 0),
                                               RoleObservation("decode", "LeaderWorkerSet", 1, 0)], revisions=revs)))
    assert c["Progressing"].status and c["Progressing"].reason == "LockstepRollout"
    assert c["Progressing"].message == ("lockstep rollout to revision b (prefill 0/1 ready, decode 0/1 ready); "
                                        "draining revision a (prefill 1/1 ready, decode 1/1 ready)")
    assert c["Ready"].status and c["Ready"].message.startswith("serving while it rolls: ")
    # once no revision has both roles ready, nothing can serve
    gone = revisions(lws("a", "prefill", 0, 0, OLD), lws("a", "decode", 1, 1, OLD),
                     lws("b", "prefill", 1, 1, NEW), lws("b", "decode", 1, 0, NEW))
    c = by_type(serving_conditions(sobs(revisions=gone)))
    assert not c["Ready"].status and c["Ready"].reason == "LockstepRollout"
