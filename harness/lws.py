"""The real LeaderWorkerSet controller (sigs.k8s.io/lws, built by e2e/build-lws.sh) as a
process beside the control plane (harness/cluster.py), with its admission webhooks.

In a cluster LWS runs as a pod behind a Service and rotates its own webhook certificate.
Here it serves its webhooks on 127.0.0.1 with a certificate made for that address, and the
webhook configurations point at that URL. The pod webhooks (which label group pods and inject
the TPU environment) only see pods that carry LWS's set label, so a stopped controller can
never block other pods of the shared cluster.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harness.cluster import Cluster
from harness.controlplane import ControlPlaneError
from harness.polling import wait_for
from harness.processes import LOOPBACK, Component, free_port

LWS_SET_LABEL = "leaderworkerset.sigs.k8s.io/name"
# (name, path, kind, group, resource, operations): LWS v0.9's config/webhook/manifests.yaml.
WEBHOOKS = [
    ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "mutating",
     "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"]),
    ("mpod.kb.io", "/mutate--v1-pod", "mutating", "", "pods", ["CREATE"]),
    ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "validating",
     "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"]),
    ("vpod.kb.io", "/validate--v1-pod", "validating", "", "pods", ["CREATE", "UPDATE"]),
    ("vdisaggregatedset.kb.io", "/validate-disaggregatedset-x-k8s-io-v1-disaggregatedset", "validating",
     "disaggregatedset.x-k8s.io", "disaggregatedsets", ["CREATE", "UPDATE"]),
]


def lws_binary() -> Path:
    d = os.environ.get("TPUSYNC_LWS_DIR")
    if not d:
        raise ControlPlaneError("TPUSYNC_LWS_DIR is not set: run the e2e tests through `make e2e` "
                                "(it builds LWS with e2e/build-lws.sh)")
    path = Path(d) / "lws-controller"
    if not path.is_file():
        raise ControlPlaneError(f"{path} is missing: run `bash e2e/build-lws.sh`")
    return path


def _serving_certificate(pki: Path, host: str) -> bytes:
    """A CA and a certificate for `host` (an IP address) signed by it (tls.crt/tls.key, where
    controller-runtime looks). Returns the CA in PEM, the webhooks' caBundle."""
    openssl = shutil.which("openssl")
    if not openssl:
        raise ControlPlaneError("openssl is needed for the LWS webhook certificate")
    pki.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=pki)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=lws-webhook-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={host}", "-keyout", "tls.key",
        "-out", "tls.csr")
    (pki / "san.ext").write_text(f"subjectAltName=IP:{host}\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "tls.crt")
    return (pki / "ca.crt").read_bytes()


@dataclass
class LWSController:
    """`host` is the address its webhooks and health port listen on, one the API server and
    this process both reach; `wrap` runs the controller where that address is (the real-node
    tier: the control plane's network namespace)."""

    cluster: Cluster
    workdir: Path
    host: str = LOOPBACK
    wrap: Callable[[list[str]], list[str]] = field(default=list)
    component: Component | None = None

    def start(self, timeout: float = 90) -> None:
        ca = _serving_certificate(self.workdir / "pki", self.host)
        webhook_port, health_port = free_port(), free_port()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": self.host, "port": webhook_port, "certDir": str(self.workdir / "pki")},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"{self.host}:{health_port}"},
        }
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        argv = self.wrap([str(lws_binary()), f"--config={self.workdir / 'config.yaml'}"])
        component = Component("lws-controller", argv,
                              self.workdir / "logs" / "lws-controller.log", env=env)
        self.component = component
        component.start()
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
            _webhook_configurations(f"https://{self.host}:{webhook_port}", ca)))
        self.cluster.wait_http(component, f"http://{self.host}:{health_port}/readyz", timeout)
        # The webhooks answer once the certificate is loaded: a dry-run LWS goes through both.
        probe = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                 "metadata": {"name": "lws-webhook-probe", "namespace": "default"},
                 "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": {"containers": [
                     {"name": "c", "image": "registry.example/none:0"}]}}}}}
        wait_for("the LWS webhooks", lambda: self.cluster.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe), check=False).returncode == 0,
            timeout, interval=0.5, on_timeout=lambda: f"\n{component.tail()}")

    def stop(self) -> None:
        self.cluster.kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration",
                             "-l", "app.kubernetes.io/part-of=tpusync-e2e-lws", "--ignore-not-found", check=False)
        if self.component is not None:
            self.component.stop()


def _webhook_configurations(base_url: str, ca: bytes) -> list[dict]:
    by_kind: dict[str, list[dict]] = {"mutating": [], "validating": []}
    for name, path, kind, group, resource, operations in WEBHOOKS:
        pod = resource == "pods"
        hook = {
            "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "clientConfig": {"url": base_url + path, "caBundle": base64.b64encode(ca).decode()},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"],
                       "operations": operations, "resources": [resource]}],
        }
        if pod:
            hook["objectSelector"] = {"matchExpressions": [{"key": LWS_SET_LABEL, "operator": "Exists"}]}
        by_kind[kind].append(hook)
    meta = {"labels": {"app.kubernetes.io/part-of": "tpusync-e2e-lws"}}
    return [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
             "metadata": {"name": "tpusync-e2e-lws-mutating", **meta}, "webhooks": by_kind["mutating"]},
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
             "metadata": {"name": "tpusync-e2e-lws-validating", **meta}, "webhooks": by_kind["validating"]}]
