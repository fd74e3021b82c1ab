"""Smoke tests of the e2e control plane itself."""

from __future__ import annotations

import json

from harness.cluster import TPU_TAINT
from harness.controlplane import read_versions


def test_version_is_pinned(cluster):
    status, body = cluster.api("/version")
    assert status == 200, body
    want = read_versions()["KUBERNETES_VERSION"]
    assert body["gitVersion"] == want
    assert f"v{body['major']}.{body['minor']}" == ".".join(want.split(".")[:2])
    # kubectl is the pinned client too, and within the supported skew.
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == want
    assert out["clientVersion"]["minor"] == body["minor"]


def test_tpu_nodes_are_ready(cluster):
    # The default pools only (other modules add their own).
    nodes = cluster.kubectl_json("get", "nodes", "-l", "cloud.google.com/gke-tpu-accelerator,"
                                 "cloud.google.com/gke-nodepool in (v6e-pool,tpu7x-pool)")
    by_accel: dict[str, int] = {}
    for node in nodes["items"]:
        labels = node["metadata"]["labels"]
        by_accel[labels["cloud.google.com/gke-tpu-accelerator"]] = \
            by_accel.get(labels["cloud.google.com/gke-tpu-accelerator"], 0) + 1
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds["Ready"] == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"]["google.com/tpu"] == "4"
        assert labels["cloud.google.com/gke-tpu-topology"]
        assert labels["cloud.google.com/gke-nodepool"]
        assert {"key": TPU_TAINT["key"], "value": TPU_TAINT["value"],
                "effect": TPU_TAINT["effect"]} in node["spec"]["taints"]
    assert by_accel == {"tpu-v6e-slice": 2, "tpu7x": 1}


def test_tpu_pod_scheduled_and_ready(cluster, namespace):
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "tpu-worker", "namespace": namespace},
        "spec": {
            "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                             "cloud.google.com/gke-tpu-topology": "2x4"},
            "tolerations": [{"key": "google.com/tpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "registry.invalid/tpusync:test",
                            "resources": {"limits": {"google.com/tpu": "4"},
                                          "requests": {"cpu": "1", "memory": "1Gi"}}}],
        },
    }
    cluster.apply(pod)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/tpu-worker", "-n", namespace,
                    "--timeout=60s", timeout=90)
    got = cluster.kubectl_json("get", "pod", "tpu-worker", "-n", namespace)
    assert got["spec"]["nodeName"].startswith("gke-v6e-pool-")
    assert got["status"]["phase"] == "Running"
    assert got["status"]["podIP"].startswith("127.")
    conds = {c["type"]: c["status"] for c in got["status"]["conditions"]}
    assert conds["PodScheduled"] == "True" and conds["Ready"] == "True"
    events = cluster.kubectl_json("get", "events", "-n", namespace,
                                  "--field-selector", "involvedObject.name=tpu-worker")
    assert any(e["reason"] == "Scheduled" for e in events["items"]), events["items"]


def test_pod_without_toleration_stays_pending(cluster, namespace):
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "no-toleration", "namespace": namespace},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/x:1",
                                 "resources": {"limits": {"google.com/tpu": "4"}}}]},
    }
    cluster.apply(pod)
    cluster.kubectl("wait", "--for=jsonpath={.status.conditions[?(@.type=='PodScheduled')]"
                    ".reason}=Unschedulable", "pod/no-toleration", "-n", namespace,
                    "--timeout=60s", timeout=90)


def test_rbac_denies_unprivileged_service_account(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    status, body = cluster.api(f"/api/v1/namespaces/{namespace}/secrets", token=token)
    assert status == 403, body
    assert body["reason"] == "Forbidden"
    # The token itself is valid: the SA can reach what every authenticated user may.
    status, _ = cluster.api("/version", token=token)
    assert status == 200
    # and admin can list them.
    status, _ = cluster.api(f"/api/v1/namespaces/{namespace}/secrets")
    assert status == 200


def test_deployment_gets_replicaset_and_pods(cluster, namespace):
    labels = {"app": "web"}
    dep = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "tolerations": [{"key": "google.com/tpu", "operator": "Exists"}],
                "containers": [{"name": "web", "image": "registry.invalid/web:1"}]}},
        },
    }
    cluster.apply(dep)
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=90s",
                    timeout=120)
    rs = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")
    assert len(rs["items"]) == 1
    assert rs["items"][0]["metadata"]["ownerReferences"][0]["name"] == "web"
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app=web")
    assert len(pods["items"]) == 3
    assert all(p["status"]["phase"] == "Running" for p in pods["items"])
    # Garbage collection: deleting the Deployment removes its ReplicaSet and pods.
    cluster.kubectl("delete", "deployment", "web", "-n", namespace, "--cascade=foreground",
                    "--timeout=90s", timeout=120)
    cluster.kubectl("wait", "--for=delete", "pods", "-l", "app=web", "-n", namespace,
                    "--timeout=90s", timeout=120)


def test_third_party_crds_established(cluster, crds):
    want = {
        "leaderworkersets.leaderworkerset.x-k8s.io",
        "inferencepools.inference.networking.k8s.io",
        "inferenceobjectives.inference.networking.x-k8s.io",
        "httproutes.gateway.networking.k8s.io",
        "gateways.gateway.networking.k8s.io",
    }
    assert want <= set(crds)
    for name in want:
        crd = cluster.kubectl_json("get", "crd", name)
        conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conds.get("Established") == "True", name
    served = {v["name"] for v in cluster.kubectl_json(
        "get", "crd", "inferencepools.inference.networking.k8s.io")["spec"]["versions"]
        if v["served"]}
    assert "v1" in served
    served = {v["name"] for v in cluster.kubectl_json(
        "get", "crd", "httproutes.gateway.networking.k8s.io")["spec"]["versions"] if v["served"]}
    assert "v1" in served


def test_third_party_objects_validate(cluster, crds, namespace):
    """The published schemas accept the objects the operator will create."""
    cluster.apply([
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": {"name": "llm", "namespace": namespace},
         "spec": {"selector": {"matchLabels": {"app": "llm"}},
                  "targetPorts": [{"number": 8000}],
                  "endpointPickerRef": {"name": "llm-epp", "port": {"number": 9002}}}},
        {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
         "metadata": {"name": "chat", "namespace": namespace},
         "spec": {"priority": 1, "poolRef": {"name": "llm"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": "llm", "namespace": namespace},
         "spec": {"parentRefs": [{"name": "gw"}],
                  "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io",
                                              "kind": "InferencePool", "name": "llm"}]}]}},
        {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
         "metadata": {"name": "llm", "namespace": namespace},
         "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {
             "spec": {"containers": [{"name": "w", "image": "registry.invalid/w:1"}]}}}}},
    ])
    pool = cluster.kubectl_json("get", "inferencepool", "llm", "-n", namespace)
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    # Schema validation is on: a pool without its required endpointPickerRef is rejected.
    bad = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps(
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": {"name": "bad", "namespace": namespace},
         "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 1}]}}))
    assert bad.returncode != 0 and "endpointPickerRef" in bad.stderr, bad.stderr


def test_helm_installs_a_chart(cluster, namespace, tmp_path):
    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: smoke\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n")
    cluster.helm("install", "smoke", str(chart), "-n", namespace, "--set", "greeting=hi",
                 "--wait", "--timeout", "60s")
    cm = cluster.kubectl_json("get", "configmap", "smoke-cm", "-n", namespace)
    assert cm["data"]["greeting"] == "hi"
    assert "smoke" in cluster.helm("list", "-n", namespace, "-q").stdout.split()
    cluster.helm("uninstall", "smoke", "-n", namespace, "--wait")
