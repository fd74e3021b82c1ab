"""A real Kubernetes control plane for end-to-end tests, without Docker.

Runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (which plays the
kubelets of fake GKE TPU nodes) as local processes bound to 127.0.0.1, from the binaries that
`make controlplane` (e2e/build-controlplane.sh) builds into ~/.cache/tpusync/controlplane/<key>/
(harness/controlplane.py finds them).

Everything a cluster needs lives in one temporary work directory: etcd data, certificates,
service-account keys, the token file, the admin kubeconfig and one log file per component.

Only loopback addresses are used, not even as metadata that something might try to reach:
the service range, the pod IPs that kwok hands out and the node addresses are all in 127/8.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.controlplane import (
    ControlPlaneError,
    check_controlplane,
    controlplane_dir,
    kubectl_binary,
    read_versions,
)
from harness.polling import WaitTimeout, wait_for
from harness.processes import LOOPBACK, Component, ProcessExited, free_port

# Virtual ranges, never routed anywhere; kept in 127/8 so that nothing that tries to reach a
# ClusterIP or a fake pod IP can ever send traffic off this machine.
SERVICE_CIDR = "127.96.0.0/16"
POD_CIDR = "127.64.0.0/16"

FRONT_PROXY_CLIENT = "front-proxy-client"   # the CN of the aggregation layer's client certificate
TPU_TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


@dataclass
class Cluster:
    """A running control plane. Use `Cluster.start()` / `stop()` or as a context manager."""

    cp_dir: Path
    workdir: Path
    versions: dict[str, str]
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    components: list[Component] = field(default_factory=list)
    server: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    etcd_url: str = ""
    kcm_token: str = ""
    sched_token: str = ""
    kwok_token: str = ""
    startup_seconds: float = 0.0
    # Where the control plane listens. The default is loopback on this machine's own network;
    # real nodes (harness/nodes.py) put it on an address inside a network namespace of their
    # own (`netns`), which pods can reach, with a real service range and no kwok.
    address: str = LOOPBACK
    netns: str | None = None
    service_cidr: str = SERVICE_CIDR
    with_kwok: bool = True
    # Static tokens for identities of real nodes, written before the apiserver starts:
    # user name -> (token, groups), e.g. "system:node:n1" in "system:nodes".
    extra_identities: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)

    # ----- paths --------------------------------------------------------------------------
    @property
    def bin(self) -> Path:
        return self.cp_dir / "bin"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        """CA of the apiserver's self-signed serving certificate (extracted at startup)."""
        return self.workdir / "pki" / "apiserver-ca.crt"

    @property
    def front_proxy_ca_file(self) -> Path:
        """CA of the client certificate the apiserver's aggregation layer presents to an
        aggregated API server."""
        return self.workdir / "pki" / "front-proxy-ca.crt"

    @property
    def crd_dir(self) -> Path:
        return self.cp_dir / "crds"

    def env(self) -> dict[str, str]:
        """Environment for subprocesses (kubectl, helm, operators) talking to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.workdir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.workdir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.workdir / "helm" / "data")
        return env

    # ----- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, cp_dir: Path | None = None, workdir: Path | None = None, **placement: Any) -> Cluster:
        """`placement`: address, netns, service_cidr, with_kwok (see the fields)."""
        cp_dir = Path(cp_dir) if cp_dir else controlplane_dir()
        check_controlplane(cp_dir)
        workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="tpusync-e2e-"))
        return cls(cp_dir=cp_dir, workdir=workdir, versions=read_versions(), **placement)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        t0 = time.monotonic()
        try:
            self._write_credentials()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._write_kubeconfigs()
            self._start_controllers(timeout)
            if self.with_kwok:
                self._start_kwok(timeout)
            self._wait_cluster_usable(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop(self) -> None:
        for c in reversed(self.components):
            c.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}: {c.log}\n{c.tail(20)}" for c in self.components)

    # ----- credentials --------------------------------------------------------------------
    def _write_credentials(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        openssl = shutil.which("openssl")
        if not openssl:
            raise ControlPlaneError("openssl is needed to make the service-account keys")

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True)

        # Service-account token signing key pair.
        run("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(pki / "sa.key"))
        run("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
        # A cluster CA for the controller-manager's CSR signer (certificates API).
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=tpusync-e2e-cluster-ca", "-keyout", str(pki / "ca.key"),
            "-out", str(pki / "ca.crt"))
        # The aggregation layer's front proxy, as kubeadm sets it up: a CA of its own and the
        # client certificate the apiserver presents to an aggregated API server (APIService),
        # which checks it against front_proxy_ca_file (harness/custom_metrics.py does).
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=tpusync-e2e-front-proxy-ca", "-keyout", str(pki / "front-proxy-ca.key"),
            "-out", str(self.front_proxy_ca_file))
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={FRONT_PROXY_CLIENT}",
            "-keyout", str(pki / "front-proxy-client.key"), "-out", str(pki / "front-proxy-client.csr"))
        run("x509", "-req", "-days", "2", "-in", str(pki / "front-proxy-client.csr"),
            "-CA", str(self.front_proxy_ca_file), "-CAkey", str(pki / "front-proxy-ca.key"),
            "-CAcreateserial", "-out", str(pki / "front-proxy-client.crt"))
        # The apiserver's client certificate to kubelets (kubectl logs, exec, port-forward), as
        # kubeadm names it: the kubelets trust ca.crt, and system:masters passes their webhook.
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "-keyout", str(pki / "kubelet-client.key"), "-out", str(pki / "kubelet-client.csr"))
        run("x509", "-req", "-days", "2", "-in", str(pki / "kubelet-client.csr"), "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(pki / "kubelet-client.crt"))
        # Static tokens: admin (system:masters) and the two control-plane identities, which
        # the RBAC bootstrap policy already grants what they need.
        self.kcm_token = secrets.token_hex(16)
        self.sched_token = secrets.token_hex(16)
        self.kwok_token = secrets.token_hex(16)
        (pki / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f"{self.kcm_token},system:kube-controller-manager,kcm-uid\n"
            f"{self.sched_token},system:kube-scheduler,scheduler-uid\n"
            f'{self.kwok_token},kwok-controller,kwok-uid,"system:masters"\n'
            + "".join(f"{token},{user},{user}-uid" + (f',"{",".join(groups)}"' if groups else "") + "\n"
                      for user, (token, groups) in self.extra_identities.items()))
        for f in ("sa.key", "ca.key", "tokens.csv", "front-proxy-ca.key", "front-proxy-client.key",
                  "kubelet-client.key"):
            (pki / f).chmod(0o600)

    # ----- etcd ---------------------------------------------------------------------------
    def _start_etcd(self, timeout: float) -> None:
        client, peer = self._port(2379), self._port(2380)
        self.ports["etcd"] = client
        self.etcd_url = f"http://{self.address}:{client}"
        peer_url = f"http://{self.address}:{peer}"
        data = self.workdir / "etcd"
        data.mkdir(mode=0o700, exist_ok=True)
        c = self._add("etcd", [
            str(self.bin / "etcd"), "--name=e2e", f"--data-dir={data}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=e2e={peer_url}", "--initial-cluster-state=new",
            "--unsafe-no-fsync=true", "--log-level=warn",
        ])
        self.wait_http(c, f"{self.etcd_url}/health", timeout,
                        ok=lambda body: json.loads(body).get("health") == "true")

    # ----- kube-apiserver -----------------------------------------------------------------
    def _start_apiserver(self, timeout: float) -> None:
        port = self._port(6443)
        self.ports["kube-apiserver"] = port
        self.server = f"https://{self.address}:{port}"
        pki = self.workdir / "pki"
        c = self._add("kube-apiserver", [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}",
            f"--secure-port={port}",
            f"--cert-dir={pki / 'apiserver'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={self.service_cidr}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'kubelet-client.key'}",
            # Node names resolve nowhere here: dial a kubelet at its node's address.
            "--kubelet-preferred-address-types=InternalIP",
            # The aggregation layer (APIServices): its client certificate to aggregated servers.
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            f"--requestheader-client-ca-file={self.front_proxy_ca_file}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            # The "kubernetes" Endpoints would carry the loopback advertise address, which
            # Endpoints validation rejects; only pods of real nodes need it.
            f"--endpoint-reconciler-type={'none' if self.address == LOOPBACK else 'lease'}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ])
        # With --cert-dir and no --tls-cert-file the apiserver generates a CA and a serving
        # certificate signed by it, and writes both (leaf first) to apiserver.crt. Clients and
        # the controller-manager's --root-ca-file need the CA alone.
        bundle = pki / "apiserver" / "apiserver.crt"

        def ca_written() -> bool:
            c.check()
            pems = _pem_blocks(bundle.read_text()) if bundle.exists() else []
            if len(pems) < 2:
                return False
            self.ca_file.write_text("".join(pems[1:]))
            return True
        wait_for("kube-apiserver serving certificate", ca_written, timeout,
                 on_timeout=lambda: "\n" + c.tail())
        self.wait_http(c, f"{self.server}/readyz", timeout, token=self.admin_token,
                        ok=lambda body: body.strip() == "ok")

    def _kubeconfig_dict(self, user: str, token: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user,
                                                     "namespace": "default"}}],
            "current-context": "e2e",
        }

    def identity_kubeconfig(self, user: str, path: Path) -> Path:
        """A kubeconfig for one of `extra_identities`."""
        path.write_text(yaml.safe_dump(self._kubeconfig_dict(user, self.extra_identities[user][0])))
        path.chmod(0o600)
        return path

    def _write_kubeconfigs(self) -> None:
        for name, user, token in (("admin", "admin", self.admin_token),
                                  ("kcm", "system:kube-controller-manager", self.kcm_token),
                                  ("scheduler", "system:kube-scheduler", self.sched_token),
                                  ("kwok", "kwok-controller", self.kwok_token)):
            path = self.workdir / f"{name}.kubeconfig"
            path.write_text(yaml.safe_dump(self._kubeconfig_dict(user, token)))
            path.chmod(0o600)

    # ----- controller-manager, scheduler ----------------------------------------------------
    def _start_controllers(self, timeout: float) -> None:
        pki = self.workdir / "pki"
        kcm_port, sched_port = self._port(10257), self._port(10259)
        self.ports["kube-controller-manager"] = kcm_port
        self.ports["kube-scheduler"] = sched_port
        kcm = self._add("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.workdir / 'kcm.kubeconfig'}",
            f"--bind-address={self.address}", f"--secure-port={kcm_port}",
            f"--cert-dir={pki / 'kcm'}",
            "--controllers=*", "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={self.service_cidr}",
            "--allocate-node-cidrs=false",
            "--profiling=false",
            "--v=1",
        ])
        sched = self._add("kube-scheduler", [
            str(self.bin / "kube-scheduler"),
            f"--kubeconfig={self.workdir / 'scheduler.kubeconfig'}",
            f"--bind-address={self.address}", f"--secure-port={sched_port}",
            f"--cert-dir={pki / 'scheduler'}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ])
        # /healthz on the components' own secure ports is always allowed unauthenticated.
        self.wait_http(kcm, f"https://{self.address}:{kcm_port}/healthz", timeout, verify=False)
        self.wait_http(sched, f"https://{self.address}:{sched_port}/healthz", timeout, verify=False)

    # ----- kwok ---------------------------------------------------------------------------
    def _start_kwok(self, timeout: float) -> None:
        port = free_port()
        self.ports["kwok"] = port
        stages = self.cp_dir / "stages"
        configs = [*sorted((stages / "node" / "fast").glob("*.yaml")),
                   *sorted((stages / "node" / "heartbeat-with-lease").glob("*.yaml")),
                   *sorted((stages / "pod" / "fast").glob("*.yaml"))]
        if not configs:
            raise ControlPlaneError(f"no kwok stage configs under {stages}; run `make controlplane`")
        env = dict(os.environ)
        env["KWOK_WORKDIR"] = str(self.workdir / "kwok")  # ignore any ~/.kwok/kwok.yaml
        c = self._add("kwok", [
            str(self.bin / "kwok"),
            f"--kubeconfig={self.workdir / 'kwok.kubeconfig'}",
            *(f"--config={p}" for p in configs),
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
            f"--server-address={LOOPBACK}:{port}",
            f"--node-ip={LOOPBACK}",
            f"--cidr={POD_CIDR}",
            "--node-lease-duration-seconds=40",
        ], env=env)
        self.wait_http(c, f"http://{LOOPBACK}:{port}/healthz", timeout)

    def _wait_cluster_usable(self, timeout: float) -> None:
        # Pods need the default ServiceAccount (created by the controller-manager).
        def sa_ready() -> bool:
            for c in self.components:
                c.check()
            return self.kubectl("get", "serviceaccount", "default", "-n", "default",
                                check=False).returncode == 0
        wait_for("the default ServiceAccount", sa_ready, timeout, on_timeout=self.logs)

    # ----- helpers ------------------------------------------------------------------------
    def _port(self, fixed: int) -> int:
        """The component's usual port inside a namespace of its own; a free one on loopback."""
        return free_port() if self.address == LOOPBACK else fixed

    def _add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        if self.netns:   # only the network namespace: mounts stay shared with the caller's
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]
        c = Component(name, argv, self.workdir / "logs" / f"{name}.log", env=env)
        self.components.append(c)
        c.start()
        return c

    def _ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        if not verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        return ssl.create_default_context(cafile=str(self.ca_file))

    def wait_http(self, comp: Component, url: str, timeout: float, *, token: str | None = None,
                   verify: bool = True, ok: Callable[[str], bool] = lambda body: True) -> None:
        def probe() -> bool:
            comp.check()
            req = urllib.request.Request(url)
            if token:
                req.add_header("Authorization", f"Bearer {token}")
            ctx = self._ssl_context(verify) if url.startswith("https") else None
            with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
                return resp.status == 200 and ok(resp.read().decode())
        wait_for(f"{comp.name} at {url}", probe, timeout,
                 on_timeout=lambda: f"\nlast lines of {comp.log}:\n{comp.tail()}")

    def api(self, path: str, *, token: str | None = None, method: str = "GET",
            body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """Raw API request; returns (status, parsed JSON or text). Does not raise on 4xx."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.server}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30, context=self._ssl_context()) as resp:
                status, raw = resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read().decode()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Runs the pinned kubectl against this cluster (admin credentials)."""
        argv = [str(kubectl_binary(self.cp_dir)), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} failed ({res.returncode}):\n"
                                    f"{res.stdout}{res.stderr}")
        return res

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, objs: dict[str, Any] | Sequence[dict[str, Any]], server_side: bool = True) -> None:
        docs = [objs] if isinstance(objs, dict) else list(objs)
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--field-manager=tpusync-e2e"]
        self.kubectl(*args, input=yaml.safe_dump_all(docs))

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *args], check=False,
                             capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and res.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args)} failed ({res.returncode}):\n"
                                    f"{res.stdout}{res.stderr}")
        return res

    # ----- third-party CRDs ---------------------------------------------------------------
    def crd_files(self) -> list[Path]:
        return sorted(self.crd_dir.glob("*.yaml"))

    def install_crds(self, files: Iterable[Path] | None = None, timeout: float = 60) -> list[str]:
        """Installs the third-party CRDs (LeaderWorkerSet, Gateway API, InferencePool,
        InferenceObjective) from their published definitions; waits until Established.
        Returns the CRD names."""
        files = list(files) if files is not None else self.crd_files()
        names: list[str] = []
        for f in files:
            for doc in yaml.safe_load_all(Path(f).read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    names.append(doc["metadata"]["name"])
        if files:
            # Server-side: several of these exceed the client-side last-applied annotation limit.
            self.kubectl("apply", "--server-side", "--force-conflicts",
                         "--field-manager=tpusync-e2e", *(f"--filename={f}" for f in files),
                         timeout=timeout + 60)
        if names:
            self.kubectl("wait", "--for=condition=Established", f"--timeout={int(timeout)}s",
                         *(f"crd/{n}" for n in names), timeout=timeout + 30)
        return names

    def install_llmd_crds(self) -> list[str]:
        """InferenceObjective as llm-d serves it (llm-d.ai/v1alpha2, what the operator writes):
        the published Gateway API Inference Extension CRD with its group renamed; schema
        unchanged. See docs/e2e.md."""
        src = self.crd_dir / "inference.networking.x-k8s.io_inferenceobjectives.yaml"
        path = self.workdir / "llm-d.ai_inferenceobjectives.yaml"
        path.write_text(yaml.safe_dump(llmd_objective_crd(src)))
        return self.install_crds([path])

    # ----- fake GKE nodes -----------------------------------------------------------------
    def add_tpu_nodes(self, pool: str, count: int, *, accelerator: str = "tpu-v6e-slice",
                      topology: str = "2x4", chips_per_node: int = 4,
                      machine_type: str = "ct6e-standard-4t", cpu: str = "180",
                      memory: str = "720Gi", zone: str = "us-east5-b", labels: dict[str, str] | None = None,
                      wait: bool = True, timeout: float = 60) -> list[str]:
        """Creates `count` kwok-managed nodes looking like one GKE TPU node pool (slice), with
        `labels` besides GKE's (a node pool's config.labels). kwok marks them Ready and keeps
        their leases fresh. Returns the node names."""
        return self._add_nodes(
            pool, count, labels={"cloud.google.com/gke-tpu-accelerator": accelerator,
                                 "cloud.google.com/gke-tpu-topology": topology, **(labels or {})},
            resources={"google.com/tpu": str(chips_per_node)}, taints=[dict(TPU_TAINT)],
            machine_type=machine_type, cpu=cpu, memory=memory, zone=zone, pods=110,
            wait=wait, timeout=timeout)

    def add_cpu_nodes(self, pool: str, count: int, *, machine_type: str = "n2-standard-32",
                      cpu: str = "32", memory: str = "128Gi", pods: int = 110,
                      zone: str = "us-east5-b", wait: bool = True,
                      timeout: float = 60) -> list[str]:
        """Creates `count` untainted kwok nodes of a plain GKE CPU node pool (store nodes,
        endpoint pickers, cpuOnly engines)."""
        return self._add_nodes(pool, count, labels={}, resources={}, taints=[],
                               machine_type=machine_type, cpu=cpu, memory=memory, zone=zone,
                               pods=pods, wait=wait, timeout=timeout)

    def _add_nodes(self, pool: str, count: int, *, labels: dict[str, str],
                   resources: dict[str, str], taints: list[dict[str, str]], machine_type: str, cpu: str,
                   memory: str, zone: str, pods: int, wait: bool, timeout: float) -> list[str]:
        names = [f"gke-{pool}-{i}" for i in range(count)]
        res = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "100Gi",
               **resources}
        nodes = [{
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                                "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": machine_type,
                    "topology.kubernetes.io/zone": zone,
                    "type": "kwok",
                    "cloud.google.com/gke-nodepool": pool,
                    **labels,
                },
            },
            "spec": {"taints": list(taints)} if taints else {},
            # Nodes may carry status on create; kwok's node-initialize stage keeps these.
            "status": {"capacity": dict(res), "allocatable": dict(res)},
        } for name in names]
        self.kubectl("create", "-f", "-", input=yaml.safe_dump_all(nodes))
        if wait:
            self.kubectl("wait", "--for=condition=Ready", f"--timeout={int(timeout)}s",
                         *(f"node/{n}" for n in names), timeout=timeout + 30)
        return names

    def service_account_kubeconfig(self, name: str, namespace: str, path: Path,
                                   duration: str = "6h") -> Path:
        """Writes a kubeconfig authenticating as ServiceAccount namespace/name with a bound
        token from the TokenRequest API (what a pod of that ServiceAccount would get)."""
        token = self.kubectl("create", "token", name, "-n", namespace,
                             f"--duration={duration}").stdout.strip()
        path.write_text(yaml.safe_dump(self._kubeconfig_dict(
            f"system:serviceaccount:{namespace}:{name}", token)))
        path.chmod(0o600)
        return path


@contextlib.contextmanager
def running_cluster(workdir: Path) -> Iterator[Cluster]:
    """A started control plane in workdir, stopped afterwards. A start that fails fails the
    test that asked for it, with the reason (pytest.fail), not a traceback of the fixture."""
    import pytest

    error = None
    try:
        cl = Cluster.create(workdir=workdir)
        cl.start()
    except (ControlPlaneError, ProcessExited, WaitTimeout) as err:
        error = str(err)
    if error is not None:
        pytest.fail(error, pytrace=False)
    try:
        yield cl
    finally:
        cl.stop()


def llmd_objective_crd(published: Path) -> dict[str, Any]:
    """The published InferenceObjective CRD (inference.networking.x-k8s.io) in group llm-d.ai."""
    doc: dict[str, Any] = next(d for d in yaml.safe_load_all(published.read_text())
                               if d and d.get("kind") == "CustomResourceDefinition")
    doc["spec"]["group"] = "llm-d.ai"
    doc["metadata"] = {"name": f"{doc['spec']['names']['plural']}.llm-d.ai"}
    return doc


def _pem_blocks(text: str) -> list[str]:
    end = "-----END CERTIFICATE-----"
    return [block.strip() + "\n" + end + "\n" for block in text.split(end) if "BEGIN" in block]


def _main(argv: list[str]) -> int:
    """`python -m harness.cluster [--keep]` (`make e2e-cluster`) starts a cluster with two
    TPU node pools and runs until SIGINT/SIGTERM, then tears it down (and removes its work
    directory unless --keep)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    cl = Cluster.create()
    try:
        with cl:
            cl.add_tpu_nodes("v6e-pool", 2)
            cl.add_tpu_nodes("tpu7x-pool", 1, accelerator="tpu7x", topology="2x2x1",
                             machine_type="tpu7x-standard-4t")
            print(f"cluster up in {cl.startup_seconds:.1f}s\n"
                  f"  export KUBECONFIG={cl.kubeconfig}\n  logs: {cl.workdir / 'logs'}",
                  flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        if "--keep" not in argv:
            shutil.rmtree(cl.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
