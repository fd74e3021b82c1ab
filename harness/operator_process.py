"""The tpusync operator as a local process against the e2e control plane, authenticated as
the Helm chart's ServiceAccount (a bound token from the TokenRequest API), so every request
it makes goes through the chart's RBAC. Used by the e2e fixtures and bench/operator_bench.py.

Everything it listens on is 127.0.0.1: kopf's liveness endpoint and the metrics server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import REPO
from harness.cluster import Cluster
from harness.polling import wait_for
from harness.processes import LOOPBACK, Component, free_port

PEER_ID = "e2e-operator"   # fixed kopf peer id: a restarted process is the same peer


@dataclass
class OperatorProcess:
    """`python -m tpusync_operator` with the chart's ServiceAccount. start()/stop()/kill()."""

    cluster: Cluster
    service_account: str
    namespace: str
    workdir: Path
    peering: str | None = "tpusync-operator"     # None: --standalone
    namespaces: list[str] = field(default_factory=list)   # --namespace each (the chart's watchNamespaces)
    priority: int = 100
    resync_seconds: float = 3
    extra_env: dict[str, str] = field(default_factory=dict)
    component: Component | None = None
    health_port: int = 0
    metrics_port: int = 0
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.workdir / "logs" / "tpusync-operator.log"

    @property
    def pid(self) -> int:
        assert self.component is not None and self.component.proc is not None
        return self.component.proc.pid

    def start(self, timeout: float = 60) -> None:
        """Starts the operator with a fresh token and waits until kopf's probe answers."""
        kubeconfig = self.cluster.service_account_kubeconfig(
            self.service_account, self.namespace, self.workdir / "operator.kubeconfig")
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update({"KUBECONFIG": str(kubeconfig), "POD_ID": PEER_ID,
                    "TPUSYNC_RESYNC_SECONDS": str(self.resync_seconds),
                    "PYTHONPATH": str(REPO / "operator"), "PYTHONUNBUFFERED": "1",
                    # Nothing may reach for the GCE metadata server or GKE from here.
                    "TPUSYNC_METADATA_URL": f"http://{LOOPBACK}:9",
                    "TPUSYNC_GKE_ENDPOINT": f"http://{LOOPBACK}:9", **self.extra_env})
        mode = (["--peering", self.peering, "--priority", str(self.priority)] if self.peering
                else ["--standalone"])
        scope = [arg for ns in self.namespaces for arg in ("--namespace", ns)]
        argv = [sys.executable, "-m", "tpusync_operator", *mode, *scope,
                "--liveness", f"http://{LOOPBACK}:{self.health_port}/healthz",
                "--metrics-port", str(self.metrics_port), "--metrics-address", LOOPBACK]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(f"\n===== start #{self.starts + 1}: {' '.join(argv)}\n")
        component = Component("tpusync-operator", argv, self.log, env=env)
        self.component = component
        component.start()
        self.starts += 1
        wait_for("the operator's liveness endpoint", self._healthy, timeout,
                 on_timeout=lambda: "\n" + component.tail())

    def _healthy(self) -> bool:
        assert self.component is not None
        self.component.check()
        url = f"http://{LOOPBACK}:{self.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200

    def alive(self) -> bool:
        return self.component is not None and self.component.alive()

    def stop(self) -> None:
        """SIGTERM (kopf finishes or cancels its handlers and leaves the peering)."""
        if self.component is not None:
            self.component.stop(grace=15)

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies under the operator."""
        if self.component is not None and self.component.proc is not None:
            self.component.proc.kill()
            self.component.proc.wait(timeout=10)

    def metrics(self) -> str:
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, metric: str, /, **labels: str) -> float | None:
        """The value of one sample of the Prometheus text exposition, or None."""
        for line in self.metrics().splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
            if not m or m.group(1) != metric:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
        return None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # ----- resource usage (bench) ---------------------------------------------------------
    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process so far."""
        assert self.component is not None
        return self.component.cpu_seconds()

    def peak_rss_bytes(self) -> int:
        """Peak resident set size (VmHWM) of the process."""
        assert self.component is not None
        return self.component.peak_rss_bytes()


def helm_install_operator(cluster: Cluster, release: str, namespace: str, *,
                          values: dict[str, Any] | None = None, wait: bool = True,
                          timeout: str = "120s") -> subprocess.CompletedProcess[str]:
    """`helm install` the repo's chart with its CI values; kwok plays the operator pods
    (they tolerate the fake nodes' TPU taint), so --wait checks the Deployment too."""
    chart = REPO / "charts" / "tpusync-operator"
    vals = {"tolerations": [{"key": "google.com/tpu", "operator": "Exists",
                             "effect": "NoSchedule"}], **(values or {})}
    vfile = cluster.workdir / f"values-{release}.yaml"
    vfile.write_text(yaml.safe_dump(vals))
    args = ["install", release, str(chart), "-n", namespace, "--create-namespace",
            "-f", str(chart / "ci" / "ci-values.yaml"), "-f", str(vfile)]
    if wait:
        args += ["--wait", "--timeout", timeout]
    return cluster.helm(*args)
