"""What the real-node tier's tests share: the names of the first day's objects and the
kubectl-level helpers a user would reach for (tests/cluster)."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from typing import Any

from harness.nodes import RealCluster
from harness.polling import wait_for
from tpusync.demo import post
from tpusync.engines.reference.model import ModelConfig
from tpusync.local.servers import start_server
from tpusync_operator import versions

NODE_POOL = "tpu-pool"
# Four v6e 2x2 hosts: a prefill and a decode, and one slice of surge per role for a Lockstep
# rollout that keeps serving (docs/gke.md: "give TPU-scarce servings one spare slice per role").
NODES = tuple(f"gke-tpu-pool-{i}" for i in range(4))
CPU_NODE = "gke-default-pool-0"   # GKE's default pool: the operator's pods (they tolerate no TPU taint)
VERSION = versions.TPUSYNC_VERSION
RELEASE, OPERATOR_NS, NS = "tpusync-operator", "tpusync-system", "inference"
POOL, SERVING = "tpusync-v6e", "tiny"
MODEL_NAME = "tpusync/tiny"
ROLE, ENGINE, SIDECAR = "tpusync.dev/role", "engine", "tpusync-sidecar"
API = "tpusync.dev/v1alpha1"
MODEL = ModelConfig()          # the engine's default model: what the serving runs, with no --model-config
PROMPT_TOKENS, MAX_TOKENS = 384, 8


def monolithic(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """The tokens a monolithic reference engine on this machine gives (the serving's model: the defaults)."""
    mono = start_server("both", model_config={}, prefix_cache=False, stderr=subprocess.DEVNULL,
                        extra_args=["--model", MODEL_NAME])
    try:
        return post(mono.url, {"prompt": prompt, "max_tokens": max_tokens})[2]
    finally:
        mono.stop()


def kubectl_json(real: RealCluster, *args: str) -> Any:
    assert real.cluster is not None
    return real.cluster.kubectl_json(*args)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def wait_ready(real: RealCluster, kind: str, name: str, ns: str, timeout: float) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = kubectl_json(real, "get", kind, name, "-n", ns)
        return obj if condition(obj, "Ready").get("status") == "True" else None

    def detail() -> str:
        assert real.cluster is not None
        return "\n" + real.cluster.kubectl("get", kind, name, "-n", ns, "-o", "yaml", check=False).stdout + \
            diagnosis(real)
    return wait_for(f"{kind}/{name} Ready", ready, timeout, interval=2.0, on_timeout=detail)


def diagnosis(real: RealCluster) -> str:
    """What a user would look at first: every pod, the events, the components' log tails."""
    assert real.cluster is not None
    pods = real.cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    events = real.cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout
    return f"\n{pods}\n{events[-6000:]}\n{real.logs()[-6000:]}"


def pods_of(real: RealCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return kubectl_json(real, "get", "pods", "-n", ns, "-l", selector)["items"]


def service_url(real: RealCluster, ns: str, name: str) -> str:
    svc = kubectl_json(real, "get", "service", name, "-n", ns)
    port = svc["spec"]["ports"][0]["port"]
    return f"http://{name}.{ns}.svc.cluster.local:{port}"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def get_text(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as resp:
        return str(resp.read().decode())


def port_named(pod: dict[str, Any], container: str, name: str) -> int:
    (c,) = [c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"] if c["name"] == container]
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """A container's status, native sidecars (init containers that keep running) included."""
    statuses = pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", [])
    (status,) = [s for s in statuses if s["name"] == name]
    return status
