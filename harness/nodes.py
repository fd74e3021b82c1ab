"""A real Kubernetes cluster on one machine: the control plane of harness/cluster.py plus real
nodes, each a kubelet with containerd and runc that starts real containers.

Layout (every address lives inside network namespaces this module creates and removes):

    ctl netns   bridge br0 10.250.0.1/24: etcd, kube-apiserver, controller-manager, scheduler,
                CoreDNS (the cluster's DNS server, :53) and the image registry (:5000)
    node netns  eth0 10.250.0.(10+i) on br0: containerd, kubelet, kube-proxy (iptables); pods
                on the node's CNI bridge in 10.244.i.0/24, routed between nodes by their
                addresses (no overlay), each pod in a network namespace of its own
    this host   one veth into br0 (10.250.0.254) with routes to the pod range, so a test talks
                to the API server and to pod addresses directly; nothing listens on it

Node binaries: kubelet and kube-proxy from the control plane's one Go build (`make
controlplane`); containerd v2, its runc shim, a CoreDNS with the plugins a cluster needs and a
pause program for the pod sandbox and runc from `make nodes` (e2e/build-nodes.sh); CNI plugins,
iptables and conntrack from Debian (`make node-deps`). Why each version: e2e/versions.env.

The kubelet runs on cgroup v1 (this machine's hierarchy) with failCgroupV1: false, the cgroupfs
driver and a cgroup root of its own per node; the nodes share the machine's mount namespace (a
volume the kubelet mounts is what runc bind-mounts into the container).

Teardown kills every process of the nodes' cgroups and namespaces, unmounts everything under
the nodes' directories and deletes the namespaces; a new RealCluster first removes what a dead
creator left behind (names carry the creator's pid).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from harness import REPO
from harness.cluster import Cluster
from harness.controlplane import ControlPlaneError, controlplane_dir
from harness.fabric import alive, kill_namespace
from harness.lws import LWSController
from harness.polling import wait_for
from harness.processes import Component

PREFIX = "tsk-"
SUBNET = "10.250.0"
CTL_ADDRESS = f"{SUBNET}.1"
HOST_ADDRESS = f"{SUBNET}.254"
POD_RANGE = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
REGISTRY_PORT = 5000
CLUSTER_DOMAIN = "cluster.local"
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")              # `ip netns exec` binds /etc/netns/<ns>/* over /etc/*
CGROUP_ROOT = Path("/sys/fs/cgroup")
RUN_ROOT = Path("/run/tpusync-nodes")       # short: containerd's shim sockets live under it
CNI_BIN_DIR = "/usr/lib/cni"
NODE_TOOLS = ("ip", "iptables", "conntrack", "curl", f"{CNI_BIN_DIR}/bridge", f"{CNI_BIN_DIR}/host-local",
              f"{CNI_BIN_DIR}/loopback", f"{CNI_BIN_DIR}/portmap", "skopeo", "docker-registry")
PAUSE_IMAGE = "tpusync-e2e/pause"
NODE_BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "coredns", "pause")
BUILD_SCRIPT = REPO / "e2e" / "build-nodes.sh"


class NodesUnavailable(RuntimeError):
    """This machine cannot run real nodes; the message says what is missing."""


# ----- what a test asks for --------------------------------------------------------------

@dataclass(frozen=True)
class NodeSpec:
    """One node: its GKE-like name and node-pool labels, taints, and extended resources
    advertised in its status as a device plugin would (google.com/tpu)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()
    extended: dict[str, str] = field(default_factory=dict)


def tpu_node(name: str, pool: str, *, accelerator: str = "tpu-v6e-slice", topology: str = "2x2",
             chips: int = 4) -> NodeSpec:
    """A node as GKE labels one of a TPU node pool (the labels and taint the operator selects
    and tolerates)."""
    return NodeSpec(name, labels={"cloud.google.com/gke-nodepool": pool,
                                  "cloud.google.com/gke-tpu-accelerator": accelerator,
                                  "cloud.google.com/gke-tpu-topology": topology},
                    taints=({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"},),
                    extended={"google.com/tpu": str(chips)})


def default_node(name: str, pool: str = "default-pool") -> NodeSpec:
    """A node of a GKE cluster's CPU node pool: no taint, no TPU; where the operator (and
    anything else that tolerates no TPU taint) runs."""
    return NodeSpec(name, labels={"cloud.google.com/gke-nodepool": pool})


# ----- binaries --------------------------------------------------------------------------

def nodes_dir(print_only: bool = True) -> Path:
    """~/.cache/tpusync/nodes/<key>/ of `make nodes` (its key hashes versions and sources)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def preflight(cp_dir: Path, node_dir: Path) -> None:
    """Raises NodesUnavailable naming everything missing."""
    def found(tool: str) -> bool:
        return os.access(tool, os.X_OK) if "/" in tool else shutil.which(tool) is not None
    missing = [t for t in NODE_TOOLS if not found(t)]
    if os.geteuid() != 0:
        missing.insert(0, "root")
    missing += [f"{cp_dir}/bin/{b}" for b in ("kubelet", "kube-proxy") if not os.access(cp_dir / "bin" / b, os.X_OK)]
    missing += [f"{node_dir}/bin/{b}" for b in NODE_BINARIES if not os.access(node_dir / "bin" / b, os.X_OK)]
    if not (CGROUP_ROOT / "memory").is_dir():
        missing.append("a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    if missing:
        raise NodesUnavailable("real nodes need: " + ", ".join(missing)
                               + " (make node-deps nodes controlplane installs and builds them)")


# ----- plumbing --------------------------------------------------------------------------

def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False, input=input)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", "netns", "exec", ns, *argv, check=check)


def _in_net(ns: str, argv: Sequence[str]) -> list[str]:
    """argv run in the network namespace `ns` only (the mount namespace stays this machine's)."""
    return ["nsenter", f"--net={NETNS_DIR / ns}", "--", *argv]


def _hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, ..., name=systemd)."""
    return sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir() and p.name != "unified" and not p.is_symlink())


def _make_cgroup(name: str) -> None:
    for h in _hierarchies():
        d = h / name
        d.mkdir(exist_ok=True)
        if h.name == "cpuset":   # a new cpuset has no CPUs or memory nodes until given its parent's
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not (d / f).read_text().strip():
                    (d / f).write_text((h / f).read_text())


def _kill_cgroup(name: str) -> None:
    """Kills every process under the cgroup, then removes it bottom-up in every hierarchy."""
    for _ in range(50):
        pids = set()
        for h in _hierarchies():
            for procs in (h / name).rglob("cgroup.procs") if (h / name).is_dir() else ():
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)   # the kernel empties cgroup.procs once the processes are reaped
    for h in _hierarchies():
        root = h / name
        if root.is_dir():
            for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def _unmount_under(*roots: Path) -> None:
    """Unmounts every mount point under the roots, deepest first (overlay rootfs, tmpfs
    volumes, pod network namespaces)."""
    prefixes = tuple(str(r) + "/" for r in roots)
    for _ in range(5):
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        ours = sorted({p for p in points if p.startswith(prefixes)}, key=lambda p: -p.count("/"))
        if not ours:
            return
        for p in ours:
            _run("umount", "-l", p, check=False)


def _creator(name: str) -> int | None:
    try:
        return int(name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return None


def cleanup_stale() -> list[str]:
    """Removes what real clusters whose creating process is gone left behind: processes,
    cgroups, mounts, namespaces, the host's link and the run directory."""
    stale: set[int] = set()
    for entry in [*(NETNS_DIR.iterdir() if NETNS_DIR.is_dir() else ()),
                  *(RUN_ROOT.iterdir() if RUN_ROOT.is_dir() else ()),
                  *(ETC_NETNS.iterdir() if ETC_NETNS.is_dir() else ())]:
        pid = _creator(entry.name)
        if entry.name.startswith(PREFIX) and pid is not None and not alive(pid):
            stale.add(pid)
    for pid in stale:
        _teardown(f"{PREFIX}{pid}")
    return [f"{PREFIX}{pid}" for pid in sorted(stale)]


def _teardown(tag: str) -> None:
    run_dir = RUN_ROOT / tag
    for h in _hierarchies():
        for cg in h.glob(f"{tag}-*"):
            _kill_cgroup(cg.name)
    for entry in NETNS_DIR.glob(f"{tag}-*") if NETNS_DIR.is_dir() else ():
        kill_namespace(entry.name)
    _unmount_under(run_dir)
    for d in ETC_NETNS.glob(f"{tag}-*") if ETC_NETNS.is_dir() else ():
        shutil.rmtree(d, ignore_errors=True)
    _run("ip", "link", "delete", _host_link(tag), check=False)
    shutil.rmtree(run_dir, ignore_errors=True)


def _host_link(tag: str) -> str:
    return tag.replace("-", "")[:13] + "h"   # interface names: at most 15 characters


# ----- images ----------------------------------------------------------------------------

def oci_archive_of_binary(binary: Path, out: Path, tag: str) -> Path:
    """An OCI image archive (one layer: the static binary as /pause, its entrypoint) for
    skopeo to push, written without a builder."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tar.gettarinfo(str(binary), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        with open(binary, "rb") as f:
            tar.addfile(info, f)
    layer_bytes = layer.getvalue()
    layer_digest = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                                      "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                       "digest": f"sha256:{layer_digest}", "size": len(layer_bytes)}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}).encode()
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", index)
        for blob in (layer_bytes, config, manifest):
            add(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", blob)
    return out


# ----- one node --------------------------------------------------------------------------

@dataclass
class Node:
    spec: NodeSpec
    index: int
    netns: str
    cgroup: str
    dir: Path
    components: list[Component] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd.sock"

    def logs(self) -> str:
        return "\n".join(f"--- {self.spec.name} {c.name}: {c.log}\n{c.tail(30)}" for c in self.components)

    def check(self) -> None:
        for c in self.components:
            c.check()

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def restart(self, name: str) -> None:
        c = self.component(name)
        c.stop()
        c.start()

    def stop(self) -> None:
        for c in reversed(self.components):
            c.stop(grace=5)


# ----- the cluster -----------------------------------------------------------------------

@dataclass
class RealCluster:
    """The control plane plus `specs` real nodes. Use as a context manager."""

    specs: Sequence[NodeSpec]
    workdir: Path
    cp_dir: Path = field(default_factory=controlplane_dir)
    node_dir: Path = field(default_factory=nodes_dir)
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    cluster: Cluster | None = None
    nodes: list[Node] = field(default_factory=list)
    services: list[Component] = field(default_factory=list)
    startup_seconds: float = 0.0

    @property
    def ctl_netns(self) -> str:
        return f"{self.tag}-ctl"

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.tag

    @property
    def registry(self) -> str:
        """host:port of the image registry, as image references name it."""
        return f"{CTL_ADDRESS}:{REGISTRY_PORT}"

    @property
    def pause_image(self) -> str:
        return f"{self.registry}/{PAUSE_IMAGE}:1"

    def __enter__(self) -> RealCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> None:
        t0 = time.monotonic()
        preflight(self.cp_dir, self.node_dir)
        cleanup_stale()
        try:
            self._network()
            identities = {f"system:node:{s.name}": (secrets.token_hex(16), ("system:nodes",)) for s in self.specs}
            identities["system:kube-proxy"] = (secrets.token_hex(16), ())
            identities["system:coredns"] = (secrets.token_hex(16), ())
            self.cluster = Cluster.create(self.cp_dir, self.workdir, address=CTL_ADDRESS, netns=self.ctl_netns,
                                          service_cidr=SERVICE_CIDR, with_kwok=False,
                                          extra_identities=identities)
            self.cluster.start(timeout)
            self._start_registry(timeout)
            self._start_coredns(timeout)
            for node in self.nodes:
                self._start_node(node)
            for node in self.nodes:
                self._wait_node(node, timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        for c in reversed(self.services):
            c.stop(grace=5)
        if self.cluster is not None:
            self.cluster.stop()
        _teardown(self.tag)

    def logs(self) -> str:
        parts = [n.logs() for n in self.nodes] + [f"--- {c.name}: {c.log}\n{c.tail(20)}" for c in self.services]
        if self.cluster is not None:
            parts.append(self.cluster.logs())
        return "\n".join(parts)

    # ----- network ------------------------------------------------------------------------
    def _network(self) -> None:
        ctl = self.ctl_netns
        _run("ip", "netns", "add", ctl)
        _run("ip", "-n", ctl, "link", "set", "lo", "up")
        _run("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ctl, "addr", "add", f"{CTL_ADDRESS}/24", "dev", "br0")
        _run("ip", "-n", ctl, "link", "set", "br0", "up")
        _ns(ctl, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        host = _host_link(self.tag)
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", "host0", "netns", ctl)
        _run("ip", "-n", ctl, "link", "set", "host0", "master", "br0", "up")
        _run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", host)
        _run("ip", "link", "set", host, "up")
        _run("ip", "route", "add", POD_RANGE, "via", CTL_ADDRESS)
        for i, spec in enumerate(self.specs, start=1):
            node = Node(spec, i, f"{self.tag}-n{i}", f"{self.tag}-n{i}", self.run_dir / f"n{i}")
            self.nodes.append(node)
            _run("ip", "netns", "add", node.netns)
            _run("ip", "-n", node.netns, "link", "set", "lo", "up")
            _run("ip", "-n", ctl, "link", "add", f"n{i}", "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _run("ip", "-n", ctl, "link", "set", f"n{i}", "master", "br0", "up")
            _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _run("ip", "-n", node.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", node.netns, "route", "add", "default", "via", CTL_ADDRESS)
            _run("ip", "-n", ctl, "route", "add", node.pod_cidr, "via", node.address)
            _ns(node.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            # Bridged pod traffic through iptables: a Service's reply from a pod on the same
            # bridge is un-NATed (kube-proxy's requirement).
            _ns(node.netns, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1", check=False)
            # A process started by node_command resolves names as a pod would: cluster DNS.
            etc = ETC_NETNS / node.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(
                f"nameserver {CTL_ADDRESS}\nsearch svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\noptions ndots:5\n")
        for node in self.nodes:   # pod ranges of the other nodes, straight to their node
            for other in self.nodes:
                if other is not node:
                    _run("ip", "-n", node.netns, "route", "add", other.pod_cidr, "via", other.address)

    # ----- registry and DNS ---------------------------------------------------------------
    def _service(self, name: str, argv: list[str]) -> Component:
        c = Component(name, _in_net(self.ctl_netns, argv), self.workdir / "logs" / f"{name}.log")
        self.services.append(c)
        c.start()
        return c

    def _start_registry(self, timeout: float) -> None:
        root = self.workdir / "registry"
        root.mkdir(parents=True, exist_ok=True)
        config = {"version": "0.1", "log": {"level": "warn"},
                  "storage": {"filesystem": {"rootdirectory": str(root / "storage")}},
                  "http": {"addr": self.registry, "secret": secrets.token_hex(16)}}
        (root / "config.yml").write_text(yaml.safe_dump(config))
        c = self._service("registry", [shutil.which("docker-registry") or "docker-registry", "serve",
                                       str(root / "config.yml")])
        wait_for(f"the registry at {self.registry}", lambda: self._registry_answers(c), timeout,
                 on_timeout=lambda: "\n" + c.tail())
        archive = oci_archive_of_binary(self.node_dir / "bin" / "pause", self.workdir / "pause.oci.tar", "1")
        self.push(archive, f"{PAUSE_IMAGE}:1")

    def _registry_answers(self, c: Component) -> bool:
        c.check()
        return _run("curl", "-sf", "--noproxy", "*", f"http://{self.registry}/v2/", check=False).returncode == 0

    def push(self, archive: Path, name: str) -> str:
        """Pushes an OCI archive's image to the registry as NAME:TAG; returns its reference."""
        ref = f"{self.registry}/{name}"
        _run("skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci-archive:{archive}", f"docker://{ref}")
        return ref

    def _start_coredns(self, timeout: float) -> None:
        assert self.cluster is not None
        cl = self.cluster
        cl.apply([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "system:coredns"},
             "rules": [{"apiGroups": [""], "resources": ["services", "namespaces"], "verbs": ["list", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                        "verbs": ["list", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "system:coredns"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}]},
        ])
        kubeconfig = cl.identity_kubeconfig("system:coredns", self.workdir / "coredns.kubeconfig")
        corefile = self.workdir / "Corefile"
        corefile.write_text(
            f".:53 {{\n    bind {CTL_ADDRESS}\n    errors\n    health {CTL_ADDRESS}:8080\n"
            f"    ready {CTL_ADDRESS}:8181\n"
            f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n        kubeconfig {kubeconfig}\n"
            f"        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n    }}\n    cache 30\n}}\n")
        c = self._service("coredns", [str(self.node_dir / "bin" / "coredns"), "-conf", str(corefile)])
        wait_for("CoreDNS ready", lambda: c.check() or _run(
            "curl", "-sf", "--noproxy", "*", f"http://{CTL_ADDRESS}:8181/ready", check=False).returncode == 0,
            timeout, on_timeout=lambda: "\n" + c.tail())

    # ----- nodes --------------------------------------------------------------------------
    def _start_node(self, node: Node) -> None:
        assert self.cluster is not None
        d = node.dir
        for sub in ("containerd/root", "containerd/state", "cni", "certs.d", "kubelet", "pods-logs"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        _make_cgroup(node.cgroup)
        self._write_containerd_config(node)
        self._write_cni_config(node)
        containerd = Component("containerd", _in_net(node.netns, [
            str(self.node_dir / "bin" / "containerd"), "--config", str(d / "containerd.toml")]),
            self.workdir / "logs" / f"{node.spec.name}-containerd.log",
            env={**os.environ, "PATH": f"{self.node_dir / 'bin'}:{os.environ.get('PATH', '')}"})
        node.components.append(containerd)
        containerd.start()
        wait_for(f"containerd of {node.spec.name}", lambda: containerd.check() or node.containerd_socket.exists(),
                 60, on_timeout=lambda: "\n" + containerd.tail())
        kubeconfig = self.cluster.identity_kubeconfig(f"system:node:{node.spec.name}", d / "kubelet.kubeconfig")
        (d / "kubelet.yaml").write_text(yaml.safe_dump(self._kubelet_config(node)))
        labels = ",".join(f"{k}={v}" for k, v in node.spec.labels.items())
        kubelet = Component("kubelet", _in_net(node.netns, [
            str(self.cp_dir / "bin" / "kubelet"), f"--config={d / 'kubelet.yaml'}",
            f"--kubeconfig={kubeconfig}", f"--hostname-override={node.spec.name}",
            f"--node-ip={node.address}", f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'kubelet' / 'pki'}",
            *([f"--node-labels={labels}"] if labels else []), "--v=1"]),
            self.workdir / "logs" / f"{node.spec.name}-kubelet.log")
        node.components.append(kubelet)
        kubelet.start()
        proxy_kubeconfig = self.cluster.identity_kubeconfig("system:kube-proxy", d / "kube-proxy.kubeconfig")
        (d / "kube-proxy.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(proxy_kubeconfig)},
            "mode": "iptables", "clusterCIDR": POD_RANGE, "hostnameOverride": node.spec.name,
            "bindAddress": node.address, "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # The kernel's conntrack table is the machine's: leave its size alone.
            "conntrack": {"maxPerCore": 0},
            "nodePortAddresses": [f"{node.address}/32"],
        }))
        proxy = Component("kube-proxy", _in_net(node.netns, [
            str(self.cp_dir / "bin" / "kube-proxy"), f"--config={d / 'kube-proxy.yaml'}", "--v=1"]),
            self.workdir / "logs" / f"{node.spec.name}-kube-proxy.log")
        node.components.append(proxy)
        proxy.start()

    def _write_containerd_config(self, node: Node) -> None:
        d = node.dir
        hosts = d / "certs.d" / self.registry
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{self.registry}"\n\n[host."http://{self.registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n')
        (d / "containerd.toml").write_text(f"""version = 3
root = "{d / 'containerd/root'}"
state = "{d / 'containerd/state'}"

[grpc]
  address = "{node.containerd_socket}"

[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  # This machine's root lacks CAP_SYS_RESOURCE (not in the bounding set), so no process may
  # lower its oom_score_adj below 0, as the kubelet asks for sandboxes (-998) and Guaranteed
  # pods (-997): containerd's own option for such hosts keeps scores at or above its own.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{self.node_dir / 'bin' / 'runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{d / 'cni'}"

[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{self.pause_image}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{d / 'certs.d'}"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
""")

    def _write_cni_config(self, node: Node) -> None:
        (node.dir / "cni" / "10-pods.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "pods",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": node.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(node.dir / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
                {"type": "loopback"},
            ]}, indent=1))

    def _kubelet_config(self, node: Node) -> dict[str, Any]:
        assert self.cluster is not None
        resolv = node.dir / "resolv.conf"
        resolv.write_text(f"nameserver {CTL_ADDRESS}\n")
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # v1.37 refuses cgroup v1 unless told otherwise (pkg/kubelet/apis/config/v1beta1/defaults.go)
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{node.cgroup}",
            "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
            "address": node.address, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.workdir / "pki" / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "clusterDNS": [CTL_ADDRESS], "clusterDomain": CLUSTER_DOMAIN, "resolvConf": str(resolv),
            "podLogsDir": str(node.dir / "pods-logs"),
            "failSwapOn": False, "protectKernelDefaults": False,
            # The machine's disk and memory are shared with the rest of the test run: no
            # eviction or image garbage collection on its thresholds.
            "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%",
                             "nodefs.inodesFree": "0%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "registerWithTaints": list(node.spec.taints),
            "serializeImagePulls": False,
            "maxPods": 32,
        }

    def _wait_node(self, node: Node, timeout: float) -> None:
        assert self.cluster is not None
        cl = self.cluster

        def ready() -> bool:
            node.check()
            got = cl.kubectl("get", "node", node.spec.name, "-o", "json", check=False)
            if got.returncode != 0:
                return False
            conds = {c["type"]: c["status"] for c in json.loads(got.stdout)["status"].get("conditions", [])}
            return conds.get("Ready") == "True"
        wait_for(f"node {node.spec.name} Ready", ready, timeout, interval=1.0, on_timeout=node.logs)
        if node.spec.extended:
            patch = {"status": {"capacity": dict(node.spec.extended)}}
            cl.kubectl("patch", "node", node.spec.name, "--subresource=status", "--type=merge",
                       "-p", json.dumps(patch))

    # ----- helpers for tests --------------------------------------------------------------
    def container_pids(self, container_id: str) -> list[int]:
        """The processes of a container, found in the cgroup the kubelet's cgroupfs driver
        made for it under its node's cgroup root (empty: not a container of these nodes)."""
        memory = CGROUP_ROOT / "memory"
        for node in self.nodes:
            for d in (memory / node.cgroup).rglob(container_id) if (memory / node.cgroup).is_dir() else ():
                return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        return []

    def node_command(self, node: Node, argv: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """argv on the node as a client there: its network namespace (Service IPs through
        kube-proxy's rules, pod addresses through the node's routes) and the cluster's DNS
        server in its resolv.conf; no proxy from this machine's environment."""
        return subprocess.run(["ip", "netns", "exec", node.netns, *argv], capture_output=True, text=True,
                              timeout=timeout, check=False, env=_client_env())

    def node_process(self, node: Node, argv: Sequence[str], stdout: IO[bytes]) -> subprocess.Popen[bytes]:
        """node_command's client left running (stderr into stdout); the caller stops it."""
        return subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=subprocess.STDOUT, env=_client_env())

    def start_lws(self) -> LWSController:
        """LeaderWorkerSet's CRDs and controller, as docs/gke.md installs them before the chart.
        The controller runs as a process in the control plane's network namespace, its webhooks
        on CTL_ADDRESS, not as the pod of LWS's manifests.yaml: no reachable registry holds its
        image. The caller stops it."""
        assert self.cluster is not None
        crds = [f for f in self.cluster.crd_files()
                if f.name.startswith(("leaderworkerset.x-k8s.io_", "disaggregatedset.x-k8s.io_"))]
        if len(crds) != 2:
            raise ControlPlaneError(f"LWS's two CRDs are not in {self.cluster.crd_dir}: {crds}")
        self.cluster.install_crds(crds)
        controller = LWSController(self.cluster, self.workdir / "lws", host=CTL_ADDRESS,
                                   wrap=lambda argv: _in_net(self.ctl_netns, argv))
        try:
            controller.start()
        except BaseException:
            controller.stop()
            raise
        return controller


def _client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "no_proxy": "*", "NO_PROXY": "*"}


@contextlib.contextmanager
def real_cluster(specs: Sequence[NodeSpec], workdir: Path) -> Iterator[RealCluster]:
    rc = RealCluster(specs, workdir)
    with rc:
        yield rc


def _main(argv: list[str]) -> int:
    """`python -m harness.nodes` (`make cluster`): a CPU node and four TPU nodes of one pool and
    LWS's controller, as tests/cluster runs them, until SIGINT."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    import tempfile
    workdir = Path(tempfile.mkdtemp(prefix="tpusync-cluster-"))
    specs = [default_node("gke-default-pool-0"), *(tpu_node(f"gke-tpu-pool-{i}", "tpu-pool") for i in range(4))]
    try:
        with RealCluster(specs, workdir) as rc:
            assert rc.cluster is not None
            lws = rc.start_lws()
            try:
                print(f"cluster up in {rc.startup_seconds:.1f}s\n  export KUBECONFIG={rc.cluster.kubeconfig}\n"
                      f"  registry: {rc.registry}\n  logs: {workdir / 'logs'}", flush=True)
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
            finally:
                lws.stop()
    except (ControlPlaneError, NodesUnavailable) as err:
        print(err)
        return 1
    finally:
        if "--keep" not in argv:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
