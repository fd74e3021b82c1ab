"""The user's first day, on real nodes: what docs/gke.md tells a platform engineer to run, in its
order, with every pod a real container started by a kubelet from the release's images.

1. The release's own steps push the image archives of `make images` and the chart to the nodes'
   registry (images/release.sh, as tests/release does on 127.0.0.1).
2. `helm install` of the chart from that registry, `imageRegistry` pointing there: the operator
   runs as a pod under the chart's ServiceAccount and reaches the API server through the
   `kubernetes` Service (kube-proxy).
3. A TPUSyncPool (mode existing) over the two nodes' GKE node pool, and a DisaggregatedServing
   of the reference engine (one prefill, one decode): their pods become Ready, each engine
   beside its sidecar, on different nodes.
4. Completion requests through the serving's Services, in the dialect llm-d's P/D proxy speaks
   (the prefill engine first with `do_remote_decode`, then the decode engine with the
   `kv_transfer_params` it answered): the tokens equal a monolithic engine's on this machine;
   the decode pod's sidecar pulled the prefill's blocks over the pod network (its /metrics say
   how many bytes), and the same prompt again is a DRAM hit.
5. The pods' KV events, read by llm-d's own indexer (v0.9.0) at the pods' addresses: it scores
   the pod holding a prefix highest.

What is not run here, and why (docs/e2e.md): llm-d's endpoint picker and P/D proxy, whose
module (github.com/llm-d/llm-d-router) the Go module proxy does not serve and whose images no
reachable registry holds; the serving runs with routing off and the test sends the proxy's two
requests itself. The engine runs on the CPU (JAX_PLATFORMS=cpu in the serving's env): a node's
google.com/tpu is advertised, no TPU is there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.controlplane import ControlPlaneError
from harness.llmd_fleet import Indexer, connect, parameters, served
from harness.llmd_fleet import post as fleet_post
from harness.llmd_indexer import indexer_binary
from harness.nodes import RealCluster
from harness.polling import wait_for
from harness.release import pushed, release_step
from tpusync.demo import post
from tpusync.engines.reference.model import ModelConfig
from tpusync.local.servers import start_server
from tpusync_operator import versions

from .conftest import CPU_NODE, NODE_POOL, NODES

pytestmark = pytest.mark.timeout(1500)

VERSION = versions.TPUSYNC_VERSION
RELEASE, OPERATOR_NS, NS = "tpusync-operator", "tpusync-system", "inference"
POOL, SERVING = "tpusync-v6e", "tiny"
MODEL_NAME = "tpusync/tiny"
ROLE, ENGINE, SIDECAR = "tpusync.dev/role", "engine", "tpusync-sidecar"
API = "tpusync.dev/v1alpha1"
MODEL = ModelConfig()          # the engine's default model: what the serving runs, with no --model-config
PROMPT_TOKENS, MAX_TOKENS = 384, 8


# ----- helpers ---------------------------------------------------------------------------

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


# ----- the first day ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def released(real: RealCluster, archives: Path) -> dict[str, str]:
    """The release workflow's steps: every image and the chart, into the nodes' registry."""
    assert real.cluster is not None
    helm = str(real.cluster.bin / "helm")
    work = real.workdir / "release"
    out = release_step(work, "--plain-http", "push-images", real.registry, VERSION,
                       *(str(p) for p in sorted(archives.glob("*.oci.tar"))), helm=helm)
    out += release_step(work, "--plain-http", "chart", real.registry, VERSION, str(work / "dist"), helm=helm)
    return pushed(out)


@pytest.fixture(scope="module")
def installed(real: RealCluster, released: dict[str, str]) -> Iterator[dict[str, Any]]:
    """`helm install oci://...` from the registry, as docs/gke.md says; the operator's pod."""
    assert real.cluster is not None
    chart = f"oci://{real.registry}/charts/tpusync-operator"
    try:
        real.cluster.helm("install", RELEASE, chart, "--version", VERSION, "--plain-http", "--namespace",
                          OPERATOR_NS, "--create-namespace", "--set", f"imageRegistry={real.registry}", "--wait",
                          "--timeout", "300s", timeout=400)
    except ControlPlaneError as err:
        pytest.fail(f"{err}{diagnosis(real)}", pytrace=False)
    (pod,) = [p for p in pods_of(real, OPERATOR_NS, f"app.kubernetes.io/instance={RELEASE}")
              if p["metadata"].get("deletionTimestamp") is None][:1] or [None]
    assert pod is not None, "no operator pod after helm install --wait"
    yield pod
    real.cluster.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s", check=False)


@pytest.fixture(scope="module")
def serving(real: RealCluster, installed: dict[str, Any]) -> dict[str, Any]:
    """The pool over the two nodes and a reference-engine serving on it, both Ready."""
    assert real.cluster is not None
    real.cluster.kubectl("create", "namespace", NS)
    pool = {"apiVersion": API, "kind": "TPUSyncPool", "metadata": {"name": POOL, "namespace": NS},
            "spec": {"tpu": {"type": "v6e", "topology": "2x2"}, "capacity": {"hosts": len(NODES)},
                     "provisioning": {"mode": "existing", "existing": {"nodePoolName": NODE_POOL}},
                     "tiers": {"dram": "512Mi", "disk": {"size": "1Gi"}}}}
    engine_env = [{"name": "JAX_PLATFORMS", "value": "cpu"}]
    serving = {"apiVersion": API, "kind": "DisaggregatedServing", "metadata": {"name": SERVING, "namespace": NS},
               "spec": {"model": {"name": MODEL_NAME, "uri": f"hf://{MODEL_NAME}"},   # the engine ignores URIs
                        "engine": {"type": "reference", "env": engine_env},
                        "poolRef": {"name": POOL}, "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                        "prefixCache": {"hostDram": "256Mi"}, "routing": {"enabled": False}}}
    real.cluster.apply([pool, serving])
    wait_ready(real, "tpusyncpool", POOL, NS, 300)
    return wait_ready(real, "disaggregatedserving", SERVING, NS, 600)


def test_the_operator_is_a_real_pod_of_the_chart(real: RealCluster, installed: dict[str, Any]) -> None:
    """The operator runs as a container the kubelet started, under the chart's ServiceAccount, on a
    node of this cluster, from the image the release pushed to its registry."""
    pod = kubectl_json(real, "get", "pod", installed["metadata"]["name"], "-n", OPERATOR_NS)
    assert pod["spec"]["serviceAccountName"] == RELEASE
    assert pod["spec"]["nodeName"] == CPU_NODE
    (status,) = pod["status"]["containerStatuses"]
    assert status["ready"] and status["containerID"].startswith("containerd://"), status
    assert status["image"].startswith(f"{real.registry}/"), status["image"]


def test_every_pod_of_the_serving_is_a_real_container(real: RealCluster, serving: dict[str, Any]) -> None:
    """Prefill and decode pods on different nodes, every container started by containerd and
    Ready, each engine beside its sidecar, and their processes in the nodes' cgroups."""
    pods = pods_of(real, NS, f"app.kubernetes.io/instance={SERVING}")
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    assert {p["spec"]["nodeName"] for p in pods} == set(NODES)
    for p in pods:
        # The sidecar is a native sidecar: an init container that keeps running.
        statuses = p["status"].get("initContainerStatuses", []) + p["status"]["containerStatuses"]
        assert {s["name"] for s in statuses} >= {"engine", "tpusync-sidecar"}, statuses
        for s in statuses:
            assert s["ready"] and s["containerID"].startswith("containerd://"), s
            assert s["image"].startswith(f"{real.registry}/"), s["image"]
            assert real.container_pids(s["containerID"].removeprefix("containerd://")), s


def test_pd_through_the_services_equals_a_monolithic_engine(real: RealCluster, serving: dict[str, Any]) -> None:
    """The proxy's two requests, sent from a node through the Services' DNS names; the decode
    sidecar pulled the prefill's blocks across the pod network; the same prompt again is served
    from the decode host's DRAM. Tokens equal a monolithic engine's."""
    prompt = np.random.default_rng(3).integers(0, MODEL.vocab, PROMPT_TOKENS).tolist()
    mono = start_server("both", model_config={}, prefix_cache=False, stderr=subprocess.DEVNULL,
                        extra_args=["--model", MODEL_NAME])   # what the serving runs: the defaults
    try:
        _, _, expected = post(mono.url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
    finally:
        mono.stop()
    (decode_pod,) = pods_of(real, NS, f"app.kubernetes.io/instance={SERVING},{ROLE}=decode")
    sidecar_metrics = f"http://{decode_pod['status']['podIP']}:{port_named(decode_pod, SIDECAR, 'sidecar-http')}"

    def pulled_bytes() -> float:
        return metric(get_text(sidecar_metrics + "/metrics"), "tpusync_transfer_bytes_total", direction="in", op="pull")
    pulled_before = pulled_bytes()

    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS})
    client = real.node_command(real.nodes[0], [sys.executable, "-m", "harness.pd_client",
                                               service_url(real, NS, f"{SERVING}-prefill"),
                                               service_url(real, NS, f"{SERVING}-decode"), body])
    assert client.returncode == 0, client.stderr[-3000:]
    got = json.loads(client.stdout)
    assert got["prefill"]["tokens"] == expected[:1]
    assert got["decode"]["tokens"] == expected, "decode after the hand-off differs from the monolithic engine"
    assert got["repeat"]["tokens"] == expected, "the repeated prompt differs from the monolithic engine"
    d_stats, r_stats = got["decode"]["final"]["tpusync"], got["repeat"]["final"]["tpusync"]
    assert d_stats["pulled_bytes"] > 0, d_stats
    pulled = pulled_bytes() - pulled_before
    assert pulled >= d_stats["pulled_bytes"], (pulled, d_stats)
    assert r_stats["pulled_bytes"] == 0 and r_stats["computed_tokens"] < PROMPT_TOKENS, r_stats


def port_named(pod: dict[str, Any], container: str, name: str) -> int:
    (c,) = [c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"] if c["name"] == container]
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


@dataclass
class ServingPod:
    """A serving pod as llm-d's indexer knows it: the topic's pod (its address and the serving
    port), its engine's KV-event endpoint at the pod address (llm_fleet.Publisher)."""

    ip: str
    port: int
    events_port: int
    page_size: int

    @classmethod
    def of(cls, pod: dict[str, Any]) -> ServingPod:
        return cls(pod["status"]["podIP"], port_named(pod, ENGINE, "http"), port_named(pod, ENGINE, "kv-events"),
                   MODEL.page_size)

    @property
    def pod(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.ip}:{self.events_port}"

    def complete(self, prompt: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
        return fleet_post(f"http://{self.pod}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})


def test_llmd_indexer_scores_the_pod_holding_the_prefix(real: RealCluster, serving: dict[str, Any]) -> None:
    """llm-d's indexer (v0.9.0) subscribed to both pods' KV-event ports at their pod addresses,
    under the topic the operator rendered; a prompt served by the prefill pod alone scores that
    pod highest, the decode pod not at all."""
    by_role = {p["metadata"]["labels"][ROLE]: ServingPod.of(p)
               for p in pods_of(real, NS, f"app.kubernetes.io/instance={SERVING}")}
    ix = Indexer(parameters(MODEL.page_size), indexer_binary())
    try:
        rng = np.random.default_rng(11)
        for i, p in enumerate(by_role.values()):
            connect(ix, p, rng.integers(0, MODEL.vocab, 2 * MODEL.page_size).tolist() + [i])
        prompt = rng.integers(0, MODEL.vocab, 4 * MODEL.page_size).tolist()
        served(ix, by_role["prefill"], prompt)
        got = ix.score(prompt, model=MODEL_NAME)
    finally:
        ix.stop()
    prefill, decode = by_role["prefill"].pod, by_role["decode"].pod
    assert got["order"][0] == prefill, got
    assert got["pods"][prefill]["matchedBlocks"] == 4 and decode not in got["pods"], got
