"""More of the operator on the real control plane: store nodes as a DaemonSet (and a switch
of kind, which prunes the old one), a multi-host role as a LeaderWorkerSet run by the real LWS
controller (harness/lws.py: its webhooks label the group's pods and inject the TPU environment),
a Lockstep rollout run by LWS's DisaggregatedSet controller, and two live operators sharing one
peering, of which only one acts.
"""

from __future__ import annotations

import json

import yaml
from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, STORE_POOL
from test_operator import (
    CONVERGE,
    apply,
    conditions,
    container,
    get,
    items,
    owned_by,
    pool_obj,
    serving_obj,
    wait_condition,
)

from harness.operator_process import OperatorProcess
from harness.polling import wait_for
from harness.revision_router import RevisionRouter, ready, screener_parameters

MULTI_POOL = "e2e-v6e-4x4"      # a v6e 4x4 slice: 16 chips on 4 hosts


def test_store_nodes_as_a_daemonset_then_a_statefulset(cluster, operator, module_namespace):
    ns = module_namespace
    store = {"enabled": True, "kind": "DaemonSet", "dram": "16Gi", "disk": {"size": "50Gi"},
             "nodeSelector": {"cloud.google.com/gke-nodepool": STORE_POOL}}
    apply(cluster, pool_obj(ns, "ds", tpu={"type": "v6e", "topology": "2x2"},
                            node_pool="e2e-v6e-2x2", hosts=1, store=store))
    pool = wait_condition(cluster, "tpusyncpool", ns, "ds")
    ds = get(cluster, "daemonset", ns, "ds-store")
    assert owned_by(ds, pool) and ds["status"]["numberReady"] == 2      # one per store-pool node
    assert container(ds["spec"]["template"]["spec"], "tpusync-sidecar")["readinessProbe"]
    assert pool["status"]["sidecars"] == 2 and pool["status"]["readySidecars"] == 2
    assert pool["status"]["dramBytes"] == 2 * 16 * 2**30

    apply(cluster, pool_obj(ns, "ds", tpu={"type": "v6e", "topology": "2x2"},
                            node_pool="e2e-v6e-2x2", hosts=1,
                            store={**store, "kind": "StatefulSet", "replicas": 1}))
    pool = wait_condition(cluster, "tpusyncpool", ns, "ds")
    assert get(cluster, "statefulset", ns, "ds-store")["status"]["readyReplicas"] == 1
    wait_for("the DaemonSet pruned", lambda: get(cluster, "daemonset", ns, "ds-store") is None, CONVERGE)


def multi_host_prefill(cluster, ns: str, name: str, node_pool: str, engine: str) -> dict:
    """A pool of one v6e 4x4 slice (4 hosts, on nodes of its own) and a serving of one prefill
    replica of `engine` on it, Ready with its LWS group: the serving."""
    cluster.add_tpu_nodes(node_pool, 4, topology="4x4", chips_per_node=4)
    apply(cluster, pool_obj(ns, name, tpu={"type": "v6e", "topology": "4x4"}, node_pool=node_pool, hosts=4))
    wait_condition(cluster, "tpusyncpool", ns, name)
    apply(cluster, serving_obj(ns, name, engine={"type": engine}, pool=name, prefill=1, decode=0,
                               routing={"enabled": False}))
    ds = wait_condition(cluster, "disaggregatedservings", ns, name)
    assert ds["status"]["prefill"] == {"kind": "LeaderWorkerSet", "replicas": 1, "readyReplicas": 1}
    return ds


def test_multi_host_role_is_a_leaderworkerset(cluster, operator, lws, module_namespace):
    """A v6e 4x4 slice is 4 hosts: the prefill replica is one LWS group of a leader and three
    workers, one per host of the slice, each with the TPU environment LWS injects; the
    serving is Ready once the group is."""
    ns = module_namespace
    ds = multi_host_prefill(cluster, ns, "mh", MULTI_POOL, "vllm-tpu")
    lws_obj = get(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", ns, "mh-prefill")
    assert owned_by(lws_obj, ds)
    tpl = lws_obj["spec"]["leaderWorkerTemplate"]
    assert lws_obj["spec"]["replicas"] == 1 and tpl["size"] == 4
    assert lws_obj["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    for part in ("leaderTemplate", "workerTemplate"):
        spec = tpl[part]["spec"]
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert container(spec, "engine")["resources"]["limits"]["google.com/tpu"] == "4"
        assert container(spec, "tpusync-sidecar", init=True)["restartPolicy"] == "Always"

    pods = items(cluster, "pods", ns, "leaderworkerset.sigs.k8s.io/name=mh-prefill")
    by_index = {p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"]: p for p in pods}
    assert sorted(by_index) == ["0", "1", "2", "3"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == [f"gke-{MULTI_POOL}-{i}" for i in range(4)]
    hostnames = None
    for index, pod in by_index.items():
        env = {e["name"]: e for e in container(pod["spec"], "engine")["env"]}
        assert env["TPU_WORKER_ID"]["value"] == index
        hostnames = hostnames or env["TPU_WORKER_HOSTNAMES"]["value"]
        assert env["TPU_WORKER_HOSTNAMES"]["value"] == hostnames
        assert all(c["ready"] for c in pod["status"]["containerStatuses"])
        serving = pod["metadata"]["labels"].get("llm-d.ai/inference-serving")
        assert serving == ("true" if index == "0" else None)      # only the leader takes requests
        # One Ray cluster per group, as tpu-inference runs multi-host vLLM: the leader starts the
        # head and vllm serve, workers join the head at the address LWS injects.
        engine = container(pod["spec"], "engine")
        assert env["TPU_MULTIHOST_BACKEND"]["value"] == "ray"
        assert env["LWS_GROUP_SIZE"]["value"] == "4"
        assert env["LWS_LEADER_ADDRESS"]["value"].startswith("mh-prefill-0.")
        script = engine["command"][2]
        assert ("ray start --head" in script) == (index == "0")
        assert ('ray start --address="$LWS_LEADER_ADDRESS:6379"' in script) == (index != "0")
        assert (engine.get("args", [])[:1] == ["serve"]) == (index == "0")
    assert len(hostnames.split(",")) == 4


REFERENCE_POOL = "e2e-v6e-4x4-ref"   # another 4x4 slice, for the reference engine


def test_a_multi_host_reference_replica_is_one_slice(cluster, operator, lws, module_namespace):
    """The reference engine on a 4-host slice: one process per LWS pod, each beside its own
    sidecar, joined as one JAX program (tpusync.engines.reference.slice). What each pod's engine would be
    started with, from the stored pod as the real LWS webhook left it and expanded as the kubelet
    expands it, read by the engine's own parser."""
    from harness.kube_expansion import command_line
    from tpusync.engines.reference.__main__ import parse_args

    ns = module_namespace
    multi_host_prefill(cluster, ns, "rs", REFERENCE_POOL, "reference")
    pods = items(cluster, "pods", ns, "leaderworkerset.sigs.k8s.io/name=rs-prefill")
    assert len(pods) == 4
    for pod in pods:
        index = int(pod["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"])
        engine = container(pod["spec"], "engine")
        env = {e["name"]: e["value"] for e in engine["env"] if "value" in e}
        env["POD_IP"] = pod["status"]["podIP"]
        args = parse_args(command_line(engine, env)[3:])
        assert (args.num_processes, args.process_id) == (4, index)
        assert env["LWS_LEADER_ADDRESS"].startswith("rs-prefill-0.")
        assert args.coordinator == f"{env['LWS_LEADER_ADDRESS']}:7620"
        assert args.data_address == f"{pod['status']['podIP']}:7600"
        assert container(pod["spec"], "tpusync-sidecar", init=True)["restartPolicy"] == "Always"
        assert ("readinessProbe" in engine) == (index == 0)


V7X_PREFILL_POOL, V6E_DECODE_POOL = "e2e-v7x-2x2x1", "e2e-v6e-2x2-decode"


def test_prefill_and_decode_on_pools_of_their_own(cluster, operator, module_namespace):
    """Prefill on a v7x pool, decode on a v6e pool of its own (spec.decode.poolRef), on the real
    API server: each role's pod is scheduled onto its pool's nodes with its slice's chips and
    parallelism, its sidecar may dial the other pool's members, both authenticate with the one
    Secret the pools name; the schema refuses a poolRef on both roles, and the operator a decode
    pool that authenticates with another Secret."""
    ns = module_namespace
    cluster.add_tpu_nodes(V7X_PREFILL_POOL, 1, accelerator="tpu7x", topology="2x2x1", chips_per_node=4,
                          machine_type="tpu7x-standard-4t", memory="960Gi")
    cluster.add_tpu_nodes(V6E_DECODE_POOL, 1, topology="2x2", chips_per_node=4)
    cluster.kubectl("create", "secret", "generic", "mixed-kv-auth", "-n", ns, "--from-literal=token=e2e-shared-token")
    for name, tpu, node_pool in (("mxp", {"type": "v7x", "topology": "2x2x1"}, V7X_PREFILL_POOL),
                                 ("mxd", {"type": "v6e", "topology": "2x2"}, V6E_DECODE_POOL)):
        pool = pool_obj(ns, name, tpu=tpu, node_pool=node_pool, hosts=1)
        pool["spec"]["auth"] = {"secretName": "mixed-kv-auth"}
        apply(cluster, pool)
        wait_condition(cluster, "tpusyncpool", ns, name)
    serving = serving_obj(ns, "mx", engine={"type": "vllm-tpu"}, pool="mxp", routing={"enabled": False})
    both = {**serving, "spec": {**serving["spec"], "prefill": {"replicas": 1, "poolRef": {"name": "mxd"}},
                                "decode": {"replicas": 1, "poolRef": {"name": "mxd"}}}}
    refused = cluster.kubectl("apply", "-f", "-", input=json.dumps(both), check=False)
    assert refused.returncode != 0 and "spec.prefill.poolRef and spec.decode.poolRef" in refused.stderr, \
        refused.stderr
    serving["spec"]["decode"]["poolRef"] = {"name": "mxd"}
    apply(cluster, serving)
    ds = wait_condition(cluster, "disaggregatedservings", ns, "mx")
    assert ds["status"]["prefill"]["readyReplicas"] == ds["status"]["decode"]["readyReplicas"] == 1

    for role, pool, other, node_pool, tp in (("prefill", "mxp", "mxd", V7X_PREFILL_POOL, "8"),
                                             ("decode", "mxd", "mxp", V6E_DECODE_POOL, "4")):
        (pod,) = items(cluster, "pods", ns, f"tpusync.dev/serving=mx,tpusync.dev/role={role}")
        assert pod["metadata"]["labels"]["tpusync.dev/pool"] == pool
        assert pod["spec"]["nodeName"].startswith(f"gke-{node_pool}-")
        engine = container(pod["spec"], "engine")
        assert engine["resources"]["limits"]["google.com/tpu"] == "4"
        assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == tp
        sidecar = container(pod["spec"], "tpusync-sidecar", init=True)
        assert f"--peers-dns={pool}-peers.{ns}.svc" in sidecar["args"]
        assert f"--peers={other}-peers.{ns}.svc:7600" in sidecar["args"]
        auth = next(v for v in pod["spec"]["volumes"] if v["name"] == "tpusync-auth")
        assert auth["secret"]["secretName"] == "mixed-kv-auth"

    # A decode pool with a Secret of its own: its sidecars could not authenticate the prefill's.
    apply(cluster, pool_obj(ns, "mxo", tpu={"type": "v6e", "topology": "2x2"}, node_pool=V6E_DECODE_POOL, hosts=1))
    serving["spec"]["decode"]["poolRef"] = {"name": "mxo"}
    apply(cluster, serving)
    ds = wait_condition(cluster, "disaggregatedservings", ns, "mx", type_="Degraded", reason="InvalidSpec")
    assert "spec.decode.poolRef.name: TPUSyncPool mxo authenticates its data port with Secret mxo-auth" in \
        conditions(ds)["Degraded"]["message"]
    # The namespace is the module's: an operator resuming later must not meet the refused serving.
    cluster.kubectl("delete", "disaggregatedservings", "mx", "-n", ns, "--wait=true")


LOCKSTEP_POOL = "e2e-lockstep"   # six v6e 2x2 hosts: two units of one prefill and one decode, plus a surge of each
DS_REVISION = "disaggregatedset.x-k8s.io/revision"


def test_lockstep_rollout_pairs_prefill_and_decode_of_one_revision(cluster, operator, lws, module_namespace):
    """spec.rollout.strategy Lockstep, run by the real DisaggregatedSet controller (LWS v0.9.0):
    a new engine image rolls prefill and decode forward as a pair while a client keeps
    sending requests through a stand-in of llm-d's rollout screener, configured from the
    EndpointPickerConfig the operator wrote (harness/revision_router.py). Every request finds
    a revision with both roles ready and is served within it, although both revisions' pods are up
    at once for a while; the serving stays Ready and its status reports the rollout; the old
    revision's LeaderWorkerSets are gone at the end."""
    ns = module_namespace
    cluster.add_tpu_nodes(LOCKSTEP_POOL, 6, topology="2x2", chips_per_node=4)
    apply(cluster, pool_obj(ns, "ls", tpu={"type": "v6e", "topology": "2x2"}, node_pool=LOCKSTEP_POOL, hosts=6))
    wait_condition(cluster, "tpusyncpool", ns, "ls")
    serving = serving_obj(ns, "ls", engine={"type": "reference"}, pool="ls")
    serving["spec"].update(replicas=2, rollout={"strategy": "Lockstep", "maxSurge": 1, "maxUnavailable": 0})
    apply(cluster, serving)
    ds = wait_condition(cluster, "disaggregatedservings", ns, "ls", timeout=2 * CONVERGE)
    dset = get(cluster, "disaggregatedsets.disaggregatedset.x-k8s.io", ns, "ls")
    assert owned_by(dset, ds)
    (first,) = [r["revision"] for r in ds["status"]["rollout"]["revisions"]]
    assert ds["status"]["rollout"]["revision"] == first
    sets = items(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", ns, "disaggregatedset.x-k8s.io/name=ls")
    assert sorted((s["metadata"]["name"], s["spec"]["replicas"]) for s in sets) == [
        (f"ls-{first}-decode", 2), (f"ls-{first}-prefill", 2)]

    config = yaml.safe_load(get(cluster, "configmap", ns, "ls-epp")["data"]["config.yaml"])
    router = RevisionRouter(screener_parameters(config))
    assert "--allow-experimental-plugins=true" in container(
        get(cluster, "deployment", ns, "ls-epp")["spec"]["template"]["spec"], "epp")["args"]

    def in_scope() -> list[dict]:
        return items(cluster, "pods", ns, router.scope)
    assert {p["metadata"]["labels"][DS_REVISION] for p in in_scope()} == {first}

    serving["spec"]["engine"]["image"] = "registry.example/tpusync-serving:next"    # a new engine release
    apply(cluster, serving)
    requests: list[tuple[str, str]] = []   # (prefill revision, decode revision) of each request
    refused: list[str] = []                # the pods in scope whenever no revision could serve
    mixed_looks = 0                        # looks at which pods of both revisions served a role
    statuses: list[tuple[str, str, int]] = []   # (Ready, Progressing reason, revisions in status)

    def rolled() -> bool:
        nonlocal mixed_looks
        pods = in_scope()
        pick = router.pick(pods)
        if pick.prefill is None or pick.decode is None:    # the router would answer 503
            refused.append(", ".join(f"{p['metadata']['name']} ready={ready(p)}" for p in pods))
        else:
            requests.append((pick.prefill["metadata"]["labels"][DS_REVISION],
                             pick.decode["metadata"]["labels"][DS_REVISION]))
        live = {(p["metadata"]["labels"]["llm-d.ai/role"], p["metadata"]["labels"][DS_REVISION])
                for p in pods if ready(p)}
        mixed_looks += any(len({rev for role, rev in live if role == r}) > 1 for r in ("prefill", "decode"))
        now = get(cluster, "disaggregatedservings", ns, "ls")
        c = conditions(now)
        if c["Ready"]["observedGeneration"] == now["metadata"]["generation"]:
            statuses.append((c["Ready"]["status"], c["Progressing"]["reason"],
                             len(now["status"]["rollout"]["revisions"])))
        revisions = {p["metadata"]["labels"][DS_REVISION] for p in pods}
        return (len(revisions) == 1 and first not in revisions and len([p for p in pods if ready(p)]) == 4
                and c["Progressing"]["reason"] == "Stable" and now["status"]["rollout"]["revision"] != first)
    wait_for("the lockstep rollout", rolled, 4 * CONVERGE, interval=0.2)

    assert not refused, refused
    assert all(p == d for p, d in requests), [r for r in requests if r[0] != r[1]]
    served = {p for p, _ in requests}
    assert first in served and len(served) == 2, served         # traffic moved from the old revision to the new
    assert mixed_looks > 0     # both revisions' pods served at once: a router without the screener could cross
    assert all(ready_ == "True" for ready_, _, _ in statuses), statuses
    assert ("True", "LockstepRollout", 2) in statuses, statuses
    now = get(cluster, "disaggregatedservings", ns, "ls")
    (second,) = [r["revision"] for r in now["status"]["rollout"]["revisions"]]
    wait_for("the old revision's LeaderWorkerSets deleted", lambda: sorted(
        s["metadata"]["name"] for s in items(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", ns,
                                             "disaggregatedset.x-k8s.io/name=ls"))
        == [f"ls-{second}-decode", f"ls-{second}-prefill"], CONVERGE)
    assert now["status"]["prefill"] == {"kind": "LeaderWorkerSet", "replicas": 2, "readyReplicas": 2}


def test_two_operators_only_one_acts(cluster, operator, module_namespace, tmp_path):
    """A second operator with a lower priority joins the chart's peering: it pauses and makes
    no pass while the first runs; when the first leaves, it takes over."""
    ns = module_namespace
    standby = OperatorProcess(cluster, service_account=OPERATOR_RELEASE, namespace=OPERATOR_NAMESPACE,
                              workdir=tmp_path, priority=50, extra_env={"POD_ID": "e2e-operator-standby"})
    standby.start()
    try:
        wait_for("both operators in the peering", lambda: {"e2e-operator", "e2e-operator-standby"} <= set(
            cluster.kubectl_json("get", "clusterkopfpeering", "tpusync-operator").get("status", {})), 30)
        apply(cluster, pool_obj(ns, "one", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1))
        wait_condition(cluster, "tpusyncpool", ns, "one")
        # kopf starts paused under mandatory peering and stays so: no pass, no handler ran.
        assert standby.metric("tpusync_operator_reconcile_total", kind="TPUSyncPool", result="ok") is None
        assert "Handler '" not in standby.log.read_text()

        operator.stop()          # SIGTERM: kopf leaves the peering
        wait_for("the standby resumed", lambda: "Resuming operations" in standby.log.read_text(), 60)
        apply(cluster, pool_obj(ns, "two", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1))
        wait_condition(cluster, "tpusyncpool", ns, "two")
        assert standby.metric("tpusync_operator_reconcile_total", kind="TPUSyncPool", result="ok") >= 1
        assert get(cluster, "networkpolicy", ns, "two-data") is not None
        errors = [line for line in standby.log.read_text().splitlines() if " ERROR " in line]
        assert not errors, errors
    finally:
        standby.stop()
        if not operator.alive():
            operator.start()
