"""The real kube-controller-manager's HorizontalPodAutoscaler scaling a DisaggregatedServing's
units by a per-pod metric, as docs/gke.md prescribes (type Pods, target AverageValue).

The HPA scales a /scale target to ceil(average / target x the ready pods status.selector
selects) (k8s.io/kubernetes pkg/controller/podautoscaler/replica_calculator.go), and writes
that number to spec.replicas, which counts units. So status.selector must select one pod per
unit, as LeaderWorkerSet's selects one pod (the leader) per group
(sigs.k8s.io/lws v0.9.0 pkg/controllers/leaderworkerset_controller.go, hpaPodSelector).

The metric comes from a custom metrics API the test serves (harness/custom_metrics.py):
a fixed load of LOAD requests in flight, spread over the units that run; every engine pod of a
unit reports its unit's (its prefill and its decode both hold each request). With a target of
TARGET per pod, the units needed are LOAD / TARGET = 3. A selector of every engine pod (two
per unit here) makes the HPA count each request twice and settle at 6.
"""

from __future__ import annotations

import json

from conftest import STORE_POOL
from test_operator import API, apply, get, items, pool_obj, serving_obj

from harness.custom_metrics import custom_metrics_api
from harness.polling import wait_for

LOAD = 30.0
TARGET = 10
METRIC = "inflight-requests"
NAME = "hpa"


def test_hpa_scales_units_by_a_per_pod_metric(cluster, operator, operator_nodes, namespace, tmp_path):
    ns = namespace
    # cpuOnly engines on the untainted CPU pool: kwok runs them (Running and Ready), which the
    # HPA needs of every pod it counts.
    apply(cluster, pool_obj(ns, "kv", tpu={"type": "v6e", "topology": "2x2"}, node_pool=STORE_POOL, hosts=12))
    apply(cluster, serving_obj(ns, NAME, engine={"type": "reference", "cpuOnly": True}, pool="kv",
                               routing={"enabled": False}))

    def per_pod(pod: dict, metric: str) -> float:
        status, serving = cluster.api(f"/apis/{API}/namespaces/{ns}/disaggregatedservings/{NAME}")
        assert status == 200, serving
        return LOAD / serving["spec"]["replicas"]

    with custom_metrics_api(cluster, tmp_path, ns, [METRIC], per_pod) as metrics:
        apply(cluster, {
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": {"scaleTargetRef": {"apiVersion": API, "kind": "DisaggregatedServing", "name": NAME},
                     "minReplicas": 1, "maxReplicas": 8,
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": METRIC},
                                                           "target": {"type": "AverageValue",
                                                                      "averageValue": str(TARGET)}}}]}})

        def settled() -> dict | None:
            hpa = get(cluster, "horizontalpodautoscaler", ns, NAME) or {}
            st = hpa.get("status") or {}
            current = [m["pods"]["current"]["averageValue"] for m in st.get("currentMetrics") or [] if "pods" in m]
            # The HPA measured the pods of the units it asked for, and asks for no other number.
            return hpa if (st.get("currentReplicas") == st.get("desiredReplicas") == 3
                           and current in (["10"], ["10000m"])) else None

        def detail() -> str:
            hpa = get(cluster, "horizontalpodautoscaler", ns, NAME) or {}
            ds = get(cluster, "disaggregatedservings", ns, NAME) or {}
            return (f"\nHPA status: {json.dumps(hpa.get('status'))}\nserving spec.replicas "
                    f"{ds.get('spec', {}).get('replicas')}, status {json.dumps(ds.get('status'))}\n"
                    f"metrics requests: {metrics.requests[-5:]}")
        wait_for("the HPA settled at 3 units", settled, 180, interval=1, on_timeout=detail)

        ds = get(cluster, "disaggregatedservings", ns, NAME)
        assert ds["spec"]["replicas"] == 3
        selected = items(cluster, "pods", ns, ds["status"]["selector"])
        assert len(selected) == 3, [p["metadata"]["name"] for p in selected]
        assert len(items(cluster, "pods", ns, f"tpusync.dev/serving={NAME}")) == 6   # a prefill and a decode each
        assert any(f"/pods/*/{METRIC}" in r for r in metrics.requests), metrics.requests
    cluster.kubectl("delete", "horizontalpodautoscaler", NAME, "-n", ns)
    cluster.kubectl("delete", "disaggregatedservings", NAME, "-n", ns, "--timeout=60s", timeout=90)
