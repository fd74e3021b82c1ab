"""Rendering tests of charts/tpusync-operator: `helm template` with several values files,
assertions on the rendered objects. One section per template."""

from __future__ import annotations

import re

import pytest
import yaml

from harness import REPO as ROOT
from harness.helm import CHART, find, kinds

CI_VALUES = CHART / "ci" / "ci-values.yaml"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())


def deployment(objs):
    return find(objs, "Deployment")


def container(objs):
    (c,) = deployment(objs)["spec"]["template"]["spec"]["containers"]
    return c


# ----------------------------------------------------------------- lint, defaults

@pytest.mark.parametrize("values_file", [None, CI_VALUES], ids=["defaults", "ci-values"])
def test_helm_lint_strict(helm, values_file):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values_file)] if values_file else [])
    out = helm.run(*args).stdout
    assert "0 chart(s) failed" in out, out


def test_default_objects(helm):
    objs = helm.template()
    assert kinds(objs) == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment",
                           "Service", "ServiceAccount"]
    for o in objs:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tpusync-operator"
        assert labels["app.kubernetes.io/instance"] == "tpusync"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_ci_values_render(helm):
    objs = helm.template(files=[CI_VALUES])
    assert deployment(objs)["spec"]["replicas"] == 2
    assert "--verbose" in container(objs)["args"]


def test_chart_crds_are_the_generated_crds():
    """charts/tpusync-operator/crds/ is a copy of crds/ (`make crds` copies, `make verify` checks)."""
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    in_chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert in_chart == generated
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), \
            f"charts/tpusync-operator/crds/{name} differs from crds/{name}: run `make crds`"


def test_include_crds_renders_every_crd(helm):
    objs = helm.template(extra=["--include-crds"])
    crds = sorted(o["metadata"]["name"] for o in objs if o["kind"] == "CustomResourceDefinition")
    assert crds == ["clusterkopfpeerings.kopf.dev", "disaggregatedservings.tpusync.dev",
                    "kopfpeerings.kopf.dev", "tpusyncpools.tpusync.dev"]


# ------------------------------------------------------------------ Deployment

def test_security_contexts_fit_restricted_pod_security(helm):
    objs = helm.template()
    pod = deployment(objs)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    sc = container(objs)["securityContext"]
    assert sc == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                  "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "privileged": False,
                  "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    # Read-only root: /tmp is a size-limited emptyDir; nothing from the host.
    assert container(objs)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))


def test_probes_use_the_kopf_liveness_endpoint(helm):
    c = container(helm.template({"probes": {"port": 8181}}))
    assert "--liveness=http://0.0.0.0:8181/healthz" in c["args"]
    assert {"name": "healthz", "containerPort": 8181, "protocol": "TCP"} in c["ports"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert c["livenessProbe"]["failureThreshold"] == 3


def test_resources_and_image(helm):
    c = container(helm.template())
    assert c["image"] == f"ghcr.io/tpusync/tpusync-operator:{CHART_META['appVersion']}"
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    c = container(helm.template({"image": {"digest": "sha256:" + "a" * 64}}))
    assert c["image"] == "ghcr.io/tpusync/tpusync-operator@sha256:" + "a" * 64


def test_default_image_tag_is_the_app_version():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == CHART_META["appVersion"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", values["image"]["tag"])


@pytest.mark.parametrize("tag", ["latest", "nightly", "nightly-2025-01-01", "main", "Latest", "0.2.0-SNAPSHOT", ""])
def test_moving_or_missing_image_tags_fail(helm, tag):
    err = helm.template_error({"image": {"tag": tag}})
    assert "image.tag" in err
    if tag:
        assert "moving tag" in err and "pin a release version" in err


def test_peering_args_and_object_with_two_replicas(helm):
    objs = helm.template({"replicas": 2})
    args = container(objs)["args"]
    assert "--peering=tpusync-operator" in args and "--priority=auto" in args
    assert "--standalone" not in args
    peering = find(objs, "ClusterKopfPeering", "tpusync-operator")
    assert peering["apiVersion"] == "kopf.dev/v1" and "namespace" not in peering["metadata"]
    env = {e["name"]: e for e in container(objs)["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Surge first: a new replica starts paused while the active one still runs.
    assert deployment(objs)["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_standalone_single_replica(helm):
    objs = helm.template({"replicas": 1, "peering": {"enabled": False}})
    args = container(objs)["args"]
    assert "--standalone" in args and not any(a.startswith(("--peering", "--priority")) for a in args)
    assert "ClusterKopfPeering" not in kinds(objs)


def test_two_replicas_without_peering_fail(helm):
    err = helm.template_error({"replicas": 2, "peering": {"enabled": False}})
    assert "replicas: 2 needs peering.enabled=true" in err


def test_pinned_priority(helm):
    assert "--priority=5" in container(helm.template({"peering": {"priority": 5}}))["args"]


def test_watch_namespaces(helm):
    objs = helm.template({"watchNamespaces": ["team-a", "team-b"]})
    args = container(objs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    for ns in ("team-a", "team-b"):
        assert find(objs, "KopfPeering", "tpusync-operator", ns)["apiVersion"] == "kopf.dev/v1"
    assert "ClusterKopfPeering" not in kinds(objs)


def test_environment(helm):
    c = container(helm.template({"resyncSeconds": 12, "gke": {"endpoint": "http://127.0.0.1:9999",
                                                              "metadataURL": "http://127.0.0.1:9998"}}))
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TPUSYNC_RESYNC_SECONDS"] == "12"
    assert env["TPUSYNC_GKE_ENDPOINT"] == "http://127.0.0.1:9999"
    assert env["TPUSYNC_METADATA_URL"] == "http://127.0.0.1:9998"
    env = {e["name"]: e.get("value") for e in container(helm.template())["env"]}
    assert set(env) == {"POD_ID", "TPUSYNC_RESYNC_SECONDS", "TPUSYNC_GKE_ENDPOINT"}


@pytest.mark.parametrize("values", [None, {"gke": {"endpoint": ""}}], ids=["default", "empty"])
def test_the_gke_endpoint_is_always_set_by_the_chart(helm, values):
    """The operator's token goes to the endpoint of its configuration only (no TPUSyncPool
    field names one): the chart always sets it, GKE's own unless told otherwise."""
    env = {e["name"]: e.get("value") for e in container(helm.template(values))["env"]}
    assert env["TPUSYNC_GKE_ENDPOINT"] == "https://container.googleapis.com"


@pytest.mark.parametrize("mode,key", [("soft", "preferredDuringSchedulingIgnoredDuringExecution"),
                                      ("hard", "requiredDuringSchedulingIgnoredDuringExecution")])
def test_pod_anti_affinity(helm, mode, key):
    pod = deployment(helm.template({"podAntiAffinity": mode}))["spec"]["template"]["spec"]
    assert list(pod["affinity"]["podAntiAffinity"]) == [key]
    pod = deployment(helm.template({"podAntiAffinity": "none"}))["spec"]["template"]["spec"]
    assert "affinity" not in pod


def test_scheduling_and_pod_metadata(helm):
    objs = helm.template({"nodeSelector": {"pool": "system"}, "priorityClassName": "system-cluster-critical",
                          "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                          "podLabels": {"team": "infra"}, "podAnnotations": {"a": "b"},
                          "imagePullSecrets": ["regcred"]})
    pod = deployment(objs)["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "infra" and pod["metadata"]["annotations"] == {"a": "b"}
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "system"}
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]


# ------------------------------------------------------------------ names

LONG = "a-very-long-release-name-for-testing-truncation-x"   # 49 characters, under helm's 53


def test_names_truncated_to_63(helm):
    objs = helm.template(release=LONG, values={"metrics": {"podMonitoring": {"enabled": True},
                                                           "serviceMonitor": {"enabled": True}}})
    for o in objs:
        name = o["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), (o["kind"], name)
        for k, v in o["metadata"]["labels"].items():
            assert len(v) <= 63, (o["kind"], k, v)
    assert deployment(objs)["metadata"]["name"] == f"{LONG}-tpusync-operator"[:63].rstrip("-")
    service = find(objs, "Service")["metadata"]["name"]
    assert service.endswith("-metrics") and len(service) == 63


def test_fullname_override_truncated(helm):
    objs = helm.template({"fullnameOverride": "x" * 80})
    assert deployment(objs)["metadata"]["name"] == "x" * 63
    assert find(objs, "Service")["metadata"]["name"] == "x" * 55 + "-metrics"
    assert find(objs, "ServiceAccount")["metadata"]["name"] == "x" * 63


def test_release_name_containing_chart_name(helm):
    objs = helm.template(release="tpusync-operator")
    assert deployment(objs)["metadata"]["name"] == "tpusync-operator"


def test_existing_service_account(helm):
    objs = helm.template({"serviceAccount": {"create": False, "name": "ops"}})
    assert "ServiceAccount" not in kinds(objs)
    assert deployment(objs)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert find(objs, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "ops", "namespace": "tpusync-system"}]
    err = helm.template_error({"serviceAccount": {"create": False}})
    assert "serviceAccount.name: required when serviceAccount.create=false" in err


def test_service_account_annotations(helm):
    ann = {"iam.gke.io/gcp-service-account": "op@p.iam.gserviceaccount.com"}
    sa = find(helm.template({"serviceAccount": {"annotations": ann}}), "ServiceAccount")
    assert sa["metadata"]["annotations"] == ann


# ------------------------------------------------------------------ metrics

def test_metrics_port_and_service(helm):
    objs = helm.template()
    c = container(objs)
    assert "--metrics-port=9090" in c["args"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
    svc = find(objs, "Service", "tpusync-tpusync-operator-metrics")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == deployment(objs)["spec"]["selector"]["matchLabels"]


def test_metrics_disabled(helm):
    objs = helm.template({"metrics": {"enabled": False}})
    c = container(objs)
    assert "--metrics-port=0" in c["args"]
    assert [p["name"] for p in c["ports"]] == ["healthz"]
    assert "Service" not in kinds(objs)


@pytest.mark.parametrize("pm,sm", [(False, False), (True, False), (False, True), (True, True)])
def test_monitoring_objects_toggled(helm, pm, sm):
    objs = helm.template({"metrics": {"podMonitoring": {"enabled": pm, "labels": {"x": "pm"}},
                                      "serviceMonitor": {"enabled": sm, "interval": "15s",
                                                         "labels": {"release": "prom"}}}})
    assert ("PodMonitoring" in kinds(objs)) is pm
    assert ("ServiceMonitor" in kinds(objs)) is sm
    selector = deployment(objs)["spec"]["selector"]["matchLabels"]
    if pm:
        p = find(objs, "PodMonitoring")
        assert p["apiVersion"] == "monitoring.googleapis.com/v1"
        assert p["spec"]["selector"]["matchLabels"] == selector
        assert p["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
        assert p["metadata"]["labels"]["x"] == "pm"
    if sm:
        s = find(objs, "ServiceMonitor")
        assert s["apiVersion"] == "monitoring.coreos.com/v1"
        assert s["spec"]["selector"]["matchLabels"] == selector
        assert s["spec"]["namespaceSelector"] == {"matchNames": ["tpusync-system"]}
        assert s["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
        assert s["metadata"]["labels"]["release"] == "prom"


def test_monitors_need_metrics(helm):
    err = helm.template_error({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
    assert "need metrics.enabled=true" in err


def test_port_clash_fails(helm):
    err = helm.template_error({"metrics": {"port": 8080}})
    assert "metrics.port and probes.port are both 8080" in err


# ------------------------------------------------------------------ NOTES

def test_notes(helm):
    notes = helm.notes()
    assert "kopf peering \"tpusync-operator\"" in notes and "the whole cluster" in notes
    assert "kubectl apply --server-side -f <chart>/crds/" in notes
    notes = helm.notes({"watchNamespaces": ["a", "b"], "replicas": 1, "peering": {"enabled": False}})
    assert "namespaces a, b" in notes and "standalone" in notes and "(1 replica, standalone)" in notes
