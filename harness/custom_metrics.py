"""A custom metrics API (custom.metrics.k8s.io/v1beta2) for the real HorizontalPodAutoscaler
controller: a small aggregated API server, registered as an APIService, that answers per-pod
metrics with values a test chooses. Not a metrics adapter: no Prometheus behind it.

It listens on 127.0.0.1 only. The APIService's Service is of type ExternalName, 127.0.0.1,
which the aggregation layer dials directly (k8s.io/apiserver pkg/util/proxy ResolveCluster):
Endpoints validation refuses loopback addresses, and this needs none. It speaks TLS with a
certificate for the Service's name (what the aggregator verifies, against the APIService's
caBundle) and takes only the aggregator's client certificate (the cluster's front proxy,
harness/cluster.py): the apiserver has authenticated and authorized the caller before it
proxies the request.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from harness.cluster import FRONT_PROXY_CLIENT, Cluster
from harness.json_http import JsonHandler
from harness.polling import wait_for
from harness.processes import LOOPBACK

GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta2"
APISERVICE = f"{VERSION}.{GROUP}"
_POD_METRIC = re.compile(rf"^/apis/{GROUP}/{VERSION}/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/(?P<metric>[^/]+)$")

# What a pod reports for a metric: (pod, metric name) -> value.
PodValue = Callable[[dict[str, Any], str], float]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _serving_cert(pki: Path, dns_name: str) -> bytes:
    """A CA and a serving certificate for dns_name signed by it in pki/; returns the CA (PEM)."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=custom-metrics-ca",
             "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={dns_name}", "-keyout", str(pki / "tls.key"),
             "-out", str(pki / "tls.csr"))
    (pki / "san.ext").write_text(f"subjectAltName=DNS:{dns_name}\n")
    _openssl("x509", "-req", "-days", "2", "-in", str(pki / "tls.csr"), "-CA", str(pki / "ca.crt"),
             "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-extfile", str(pki / "san.ext"),
             "-out", str(pki / "tls.crt"))
    return (pki / "ca.crt").read_bytes()


class CustomMetricsServer:
    """custom.metrics.k8s.io/v1beta2 for pods: `metrics` are the metric names it serves, `value`
    gives each pod's. Every request it answers is recorded in `requests` (path and query)."""

    def __init__(self, cluster: Cluster, workdir: Path, namespace: str, metrics: list[str], value: PodValue,
                 service: str = "custom-metrics"):
        self.cluster, self.namespace, self.service = cluster, namespace, service
        self.metrics, self.value = metrics, value
        self.requests: list[str] = []
        self.ca = _serving_cert(workdir / "custom-metrics-pki", f"{service}.{namespace}.svc")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(workdir / "custom-metrics-pki" / "tls.crt", workdir / "custom-metrics-pki" / "tls.key")
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cluster.front_proxy_ca_file)
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = ThreadingHTTPServer((LOOPBACK, 0), handler)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # ----- what the aggregator asks ----------------------------------------------------------
    def discovery(self) -> dict[str, Any]:
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
                "resources": [{"name": f"pods/{m}", "singularName": "", "namespaced": True,
                               "kind": "MetricValueList", "verbs": ["get"]} for m in self.metrics]}

    def pod_metrics(self, namespace: str, name: str, metric: str, selector: str) -> dict[str, Any] | None:
        if metric not in self.metrics:
            return None
        path = f"/api/v1/namespaces/{namespace}/pods"
        if name != "*":
            path += f"/{name}"
        elif selector:
            path += f"?labelSelector={quote(selector)}"
        status, body = self.cluster.api(path)
        if status != 200:
            return None
        pods = body["items"] if name == "*" else [body]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {},
                "items": [{"describedObject": {"kind": "Pod", "namespace": namespace, "apiVersion": "/v1",
                                               "name": p["metadata"]["name"]},
                           "metric": {"name": metric}, "timestamp": now, "windowSeconds": 60,
                           "value": f"{round(self.value(p, metric) * 1000)}m"} for p in pods]}

    # ----- lifecycle -------------------------------------------------------------------------
    def register(self, timeout: float = 60) -> None:
        """Starts serving; creates the ExternalName Service and the APIService; waits until the
        aggregator finds it Available."""
        self.thread.start()
        self.cluster.apply([
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": self.service, "namespace": self.namespace},
             "spec": {"type": "ExternalName", "externalName": LOOPBACK}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
             "spec": {"group": GROUP, "version": VERSION, "groupPriorityMinimum": 100, "versionPriority": 100,
                      "caBundle": base64.b64encode(self.ca).decode(),
                      "service": {"name": self.service, "namespace": self.namespace, "port": self.port}}},
        ])

        def available() -> bool:
            got = self.cluster.kubectl_json("get", "apiservice", APISERVICE)
            return any(c["type"] == "Available" and c["status"] == "True"
                       for c in (got.get("status") or {}).get("conditions", []))
        wait_for(f"APIService {APISERVICE} Available", available, timeout, interval=0.5,
                 on_timeout=lambda: json.dumps(self.cluster.kubectl_json("get", "apiservice", APISERVICE)
                                               .get("status")))

    def close(self) -> None:
        self.cluster.kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        self.cluster.kubectl("delete", "service", self.service, "-n", self.namespace, "--ignore-not-found",
                             check=False)
        if self.thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(JsonHandler):
    owner: CustomMetricsServer

    def do_GET(self) -> None:
        cert = self.request.getpeercert() if isinstance(self.request, ssl.SSLSocket) else None
        subject = dict(item for rdn in (cert or {}).get("subject", ()) for item in rdn)
        if subject.get("commonName") != FRONT_PROXY_CLIENT:
            self.reply_json(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                  "message": "only the aggregation layer's front proxy may ask"})
            return
        url = urlsplit(self.path)
        path = unquote(url.path)    # the aggregator forwards the client's escaping: pods/%2A/...
        self.owner.requests.append(f"{path}?{url.query}")
        body: dict[str, Any] | None = None
        if path == f"/apis/{GROUP}/{VERSION}":
            body = self.owner.discovery()
        elif m := _POD_METRIC.match(path):
            selector = parse_qs(url.query).get("labelSelector", [""])[0]
            body = self.owner.pod_metrics(m["ns"], m["name"], m["metric"], selector)
        if body is None:
            self.reply_json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                  "reason": "NotFound", "message": f"{path} not found"})
        else:
            self.reply_json(200, body)



@contextlib.contextmanager
def custom_metrics_api(cluster: Cluster, workdir: Path, namespace: str, metrics: list[str],
                       value: PodValue) -> Iterator[CustomMetricsServer]:
    """A registered, Available custom metrics API for the test's duration; removed afterwards."""
    server = CustomMetricsServer(cluster, workdir, namespace, metrics, value)
    try:
        server.register()
        yield server
    finally:
        server.close()
