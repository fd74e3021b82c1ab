"""More of the operator on the real control plane: store nodes as a DaemonSet (and a switch
of kind, which prunes the old one), a multi-host role as a LeaderWorkerSet accepted by the
published LWS CRD, and two live operators sharing one peering, of which only one acts.

No LWS controller runs here (only its CRD is installed), so the LeaderWorkerSet gets no pods:
the test checks what the operator writes and what the API server accepts, and that the
serving reports the role as not ready rather than Ready.
"""

from __future__ import annotations

from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, STORE_POOL
from cluster import wait_for
from operator_proc import OperatorProcess
from test_operator import (CONVERGE, apply, conditions, container, get, owned_by, pool_obj, serving_obj,
                           wait_condition)

MULTI_POOL = "e2e-v6e-4x4"      # a v6e 4x4 slice: 16 chips on 4 hosts


def test_store_nodes_as_a_daemonset_then_a_statefulset(cluster, operator, module_namespace):
    ns = module_namespace
    store = {"enabled": True, "kind": "DaemonSet", "dram": "16Gi", "disk": {"size": "50Gi"},
             "nodeSelector": {"cloud.google.com/gke-nodepool": STORE_POOL}}
    apply(cluster, pool_obj(ns, "ds", tpu={"type": "v6e", "topology": "2x2"},
                            node_pool="e2e-v6e-2x2", hosts=1, store=store))
    pool = wait_condition(cluster, "tpusyncpool", ns, "ds")
    ds = get(cluster, "daemonset", ns, "ds-store")
    assert owned_by(ds, pool) and ds["status"]["numberReady"] == 1      # one store-pool node
    assert container(ds["spec"]["template"]["spec"], "tpusync-sidecar")["readinessProbe"]
    assert pool["status"]["sidecars"] == 1 and pool["status"]["readySidecars"] == 1
    assert pool["status"]["dramBytes"] == 16 * 2**30

    apply(cluster, pool_obj(ns, "ds", tpu={"type": "v6e", "topology": "2x2"},
                            node_pool="e2e-v6e-2x2", hosts=1,
                            store={**store, "kind": "StatefulSet", "replicas": 1}))
    pool = wait_condition(cluster, "tpusyncpool", ns, "ds")
    assert get(cluster, "statefulset", ns, "ds-store")["status"]["readyReplicas"] == 1
    wait_for("the DaemonSet pruned", lambda: get(cluster, "daemonset", ns, "ds-store") is None, CONVERGE)


def test_multi_host_role_is_a_leaderworkerset(cluster, operator, module_namespace):
    ns = module_namespace
    cluster.add_tpu_nodes(MULTI_POOL, 4, topology="4x4", chips_per_node=4)
    apply(cluster, pool_obj(ns, "mh", tpu={"type": "v6e", "topology": "4x4"}, node_pool=MULTI_POOL, hosts=4))
    wait_condition(cluster, "tpusyncpool", ns, "mh")
    apply(cluster, serving_obj(ns, "mh", engine={"type": "vllm-tpu"}, pool="mh", prefill=1, decode=0,
                               routing={"enabled": False}))
    ds = wait_condition(cluster, "disaggregatedservings", ns, "mh", "Progressing", "True")
    assert ds["status"]["prefill"] == {"kind": "LeaderWorkerSet", "replicas": 1, "readyReplicas": 0}
    assert conditions(ds)["Ready"]["status"] == "False"
    lws = get(cluster, "leaderworkersets.leaderworkerset.x-k8s.io", ns, "mh-prefill")
    assert owned_by(lws, ds)
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 1 and tpl["size"] == 4
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    for part in ("leaderTemplate", "workerTemplate"):
        spec = tpl[part]["spec"]
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
        assert container(spec, "engine")["resources"]["limits"]["google.com/tpu"] == "4"
        assert container(spec, "tpusync-sidecar", init=True)["restartPolicy"] == "Always"
    assert tpl["leaderTemplate"]["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"
    assert "llm-d.ai/inference-serving" not in tpl["workerTemplate"]["metadata"]["labels"]


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
