"""More of the operator on the real control plane: store nodes as a DaemonSet (and a switch
of kind, which prunes the old one), a multi-host role as a LeaderWorkerSet run by the real LWS
controller (tests/support/lws.py: its webhooks label the group's pods and inject the TPU environment),
and two live operators sharing one peering, of which only one acts.
"""

from __future__ import annotations

from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, STORE_POOL
from test_operator import CONVERGE, apply, container, get, items, owned_by, pool_obj, serving_obj, wait_condition

from tests.support.operator_process import OperatorProcess
from tests.support.polling import wait_for

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


def test_multi_host_role_is_a_leaderworkerset(cluster, operator, lws, module_namespace):
    """A v6e 4x4 slice is 4 hosts: the prefill replica is one LWS group of a leader and three
    workers, one per host of the slice, each with the TPU environment LWS injects; the
    serving is Ready once the group is."""
    ns = module_namespace
    cluster.add_tpu_nodes(MULTI_POOL, 4, topology="4x4", chips_per_node=4)
    apply(cluster, pool_obj(ns, "mh", tpu={"type": "v6e", "topology": "4x4"}, node_pool=MULTI_POOL, hosts=4))
    wait_condition(cluster, "tpusyncpool", ns, "mh")
    apply(cluster, serving_obj(ns, "mh", engine={"type": "vllm-tpu"}, pool="mh", prefill=1, decode=0,
                               routing={"enabled": False}))
    ds = wait_condition(cluster, "disaggregatedservings", ns, "mh")
    assert ds["status"]["prefill"] == {"kind": "LeaderWorkerSet", "replicas": 1, "readyReplicas": 1}
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
        assert env["TPUSYNC_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
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
        assert get(cluster, "configmap", ns, "two-config") is not None
        errors = [line for line in standby.log.read_text().splitlines() if " ERROR " in line]
        assert not errors, errors
    finally:
        standby.stop()
        if not operator.alive():
            operator.start()
