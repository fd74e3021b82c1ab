"""Day two on real pods: what the kubelet does to the pool's pods, and what a client sees.

1. The sidecar container of a serving pod killed (every process of its container, SIGKILL):
   the kubelet restarts it in the same pod, and the blocks it held before are served again
   by the restarted sidecar, from the pool file that outlived it in the pod's memory volume.
2. The prefill pod deleted between its answer and the decode request (the window llm-d's
   proxy's hand-off crosses): the decode engine finds the prefill's data port gone,
   recomputes the prompt and answers the client with the monolithic engine's tokens; the
   Deployment puts a new prefill pod in its place and the serving is Ready again.

A Lockstep rollout to a new engine image under traffic: test_2_lockstep.py.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest

from harness.nodes import RealCluster
from harness.polling import wait_for
from tpusync.demo import post

from .kube import (
    ENGINE,
    MAX_TOKENS,
    MODEL,
    NS,
    PROMPT_TOKENS,
    ROLE,
    SERVING,
    SIDECAR,
    condition,
    container_status,
    get_text,
    kubectl_json,
    metric,
    monolithic,
    pods_of,
    port_named,
    wait_ready,
)

pytestmark = pytest.mark.timeout(900)


def role_pod(real: RealCluster, role: str) -> dict[str, Any]:
    (pod,) = [p for p in pods_of(real, NS, f"app.kubernetes.io/instance={SERVING},{ROLE}={role}")
              if p["metadata"].get("deletionTimestamp") is None]
    return pod


def engine_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{port_named(pod, ENGINE, 'http')}"


def test_a_killed_sidecar_is_restarted_and_serves_what_it_held(real: RealCluster, serving: dict[str, Any]) -> None:
    pod = role_pod(real, "decode")
    name, url = pod["metadata"]["name"], engine_url(pod)
    prompt = np.random.default_rng(21).integers(0, MODEL.vocab, PROMPT_TOKENS).tolist()
    first, _, tokens = post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
    assert first["tpusync"]["computed_tokens"] == PROMPT_TOKENS, first["tpusync"]   # a prompt new to the pool

    before = container_status(pod, SIDECAR)
    pids = real.container_pids(before["containerID"].removeprefix("containerd://"))
    assert pids, f"no processes of the sidecar container {before['containerID']}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        p = kubectl_json(real, "get", "pod", name, "-n", NS)
        s = container_status(p, SIDECAR)
        fresh = s["restartCount"] > before["restartCount"] and s["containerID"] != before["containerID"]
        return p if fresh and s["ready"] and condition(p, "Ready").get("status") == "True" else None
    after = wait_for("the kubelet to restart the sidecar in the same pod", restarted, 180, interval=1.0)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]

    again, _, again_tokens = post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
    assert again_tokens == tokens
    stats = again["tpusync"]
    assert stats["cached_tokens"] > 0 and stats["pulled_bytes"] == 0, stats
    sidecar = f"http://{after['status']['podIP']}:{port_named(after, SIDECAR, 'sidecar-http')}/metrics"
    assert metric(get_text(sidecar), "tpusync_hits_total") > 0, "the restarted sidecar served no block"


def test_a_deleted_prefill_pod_makes_decode_recompute(real: RealCluster, serving: dict[str, Any]) -> None:
    assert real.cluster is not None
    prefill, decode = role_pod(real, "prefill"), role_pod(real, "decode")
    prompt = np.random.default_rng(22).integers(0, MODEL.vocab, PROMPT_TOKENS).tolist()
    expected = monolithic(prompt)
    p_final, _, _ = post(engine_url(prefill), {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})
    params = p_final["kv_transfer_params"]
    assert params and params["remote_host"] == prefill["status"]["podIP"], params

    real.cluster.kubectl("delete", "pod", prefill["metadata"]["name"], "-n", NS, "--wait=true", "--timeout=120s")
    d_final, _, d_tokens = post(engine_url(decode), {"prompt": prompt, "max_tokens": len(expected),
                                                     "kv_transfer_params": {**params, "do_remote_prefill": True}})
    assert d_tokens == expected, "decode without its prefill differs from the monolithic engine"
    stats = d_final["tpusync"]
    assert stats["pulled_bytes"] == 0 and stats["computed_tokens"] == PROMPT_TOKENS, stats

    wait_ready(real, "disaggregatedserving", SERVING, NS, 300)
    replaced = role_pod(real, "prefill")
    assert replaced["metadata"]["uid"] != prefill["metadata"]["uid"]
