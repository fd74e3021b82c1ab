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
5. The operator pod reads both engines' KV-path counters over the pod network: the serving's
   status.kvPath holds the blocks decode pulled, its KVPath condition says Pulling.
6. The pods' KV events, read by llm-d's own indexer (v0.9.0) at the pods' addresses: it scores
   the pod holding a prefix highest.

What is not run here, and why (docs/e2e.md): llm-d's endpoint picker and P/D proxy, whose
module (github.com/llm-d/llm-d-router) the Go module proxy does not serve and whose images no
reachable registry holds; the serving runs with routing off and the test sends the proxy's two
requests itself. The engine runs on the CPU (JAX_PLATFORMS=cpu in the serving's env): a node's
google.com/tpu is advertised, no TPU is there.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from harness.llmd_fleet import Indexer, PublisherAt, connect, parameters, served
from harness.llmd_indexer import indexer_binary
from harness.nodes import RealCluster
from harness.polling import wait_for

from .kube import (
    CPU_NODE,
    ENGINE,
    MODEL,
    MODEL_NAME,
    NODES,
    NS,
    OPERATOR_NS,
    PROMPT_TOKENS,
    RELEASE,
    ROLE,
    SERVING,
    SIDECAR,
    condition,
    diagnosis,
    get_text,
    kubectl_json,
    metric,
    monolithic,
    pods_of,
    port_named,
    service_url,
)

pytestmark = pytest.mark.timeout(1500)


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
    hosts = {p["spec"]["nodeName"] for p in pods}
    assert len(hosts) == 2 and hosts <= set(NODES), hosts
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
    expected = monolithic(prompt)
    (decode_pod,) = pods_of(real, NS, f"app.kubernetes.io/instance={SERVING},{ROLE}=decode")
    sidecar_metrics = f"http://{decode_pod['status']['podIP']}:{port_named(decode_pod, SIDECAR, 'sidecar-http')}"

    def pulled_bytes() -> float:
        return metric(get_text(sidecar_metrics + "/metrics"), "tpusync_transfer_bytes_total", direction="in", op="pull")
    pulled_before = pulled_bytes()

    body = json.dumps({"prompt": prompt, "max_tokens": len(expected)})
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


def test_the_serving_says_its_kv_path_pulls(real: RealCluster, serving: dict[str, Any]) -> None:
    """The operator pod read both engine pods' KV-path counters over the pod network, after the
    P/D requests above: status.kvPath holds the blocks decode pulled, and KVPath says Pulling."""
    def pulling() -> dict[str, Any] | None:
        obj = kubectl_json(real, "get", "disaggregatedserving", SERVING, "-n", NS)
        return obj if condition(obj, "KVPath").get("reason") == "Pulling" else None

    def detail() -> str:
        obj = kubectl_json(real, "get", "disaggregatedserving", SERVING, "-n", NS)
        return f"\n{json.dumps(obj.get('status'), indent=1)}{diagnosis(real)}"
    obj = wait_for("KVPath Pulling", pulling, 120, interval=2.0, on_timeout=detail)
    kv = obj["status"]["kvPath"]
    assert kv["enginesRead"] == 2 and kv["enginesUnread"] == 0, kv
    assert kv["decode"]["handoffs"] >= 1 and kv["decode"]["pulledBlocks"] >= PROMPT_TOKENS // MODEL.page_size, kv
    assert kv["prefill"]["savedBlocks"] >= PROMPT_TOKENS // MODEL.page_size, kv
    assert kv["decode"]["pullFailures"] == 0 and kv["decode"]["refusedHandoffs"] == 0, kv


@dataclass
class ServingPod(PublisherAt):
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
