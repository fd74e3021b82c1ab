"""Day two on real pods, continued: the serving switched to Lockstep rollouts, then rolled to a
new engine image while a client keeps sending P/D requests through its Services.

1. `spec.rollout: {strategy: Lockstep, maxSurge: 1, maxUnavailable: 0}` on the first day's
   serving: the operator replaces its Deployments by one DisaggregatedSet, whose controller
   (LWS v0.9.0's, beside the control plane) runs each role as a LeaderWorkerSet; their pods are
   real containers started by the kubelets, and the serving is Ready again.
2. `spec.engine.image` set to a new tag of the release's serving image (same bytes: what the
   rollout sees is a new pod template) while a client on a node sends llm-d's P/D proxy's two
   requests through the Services' DNS names, one exchange after another: the DisaggregatedSet
   grows the new revision's prefill and decode together on the spare hosts, drains the old
   ones together, and deletes the old LeaderWorkerSets. At every look both roles have a Ready
   pod; every exchange of the client answers the monolithic engine's tokens, some of them while
   the new revision's pods start beside the old ones; the serving reports the rollout
   (Progressing LockstepRollout, two revisions) and stays Ready throughout.

Without llm-d's router (docs/e2e.md) the Services pick a pod per request, so an exchange may
pair a prefill of one revision with a decode of the other: the same model and KV layout here,
so the decode pulls across revisions; the endpoint picker's revision screener, which keeps a
request within one revision, is held on the control-plane tier (e2e/test_operator_topologies.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from harness.nodes import RealCluster
from harness.polling import wait_for

from .kube import (
    ENGINE,
    MODEL,
    NODES,
    NS,
    PROMPT_TOKENS,
    SERVING,
    condition,
    container_status,
    diagnosis,
    kubectl_json,
    monolithic,
    pods_of,
    service_url,
    wait_ready,
)

pytestmark = pytest.mark.timeout(1200)

REVISION = "disaggregatedset.x-k8s.io/revision"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LOCKSTEP = {"strategy": "Lockstep", "maxSurge": 1, "maxUnavailable": 0}


def serving_pods(real: RealCluster) -> list[dict[str, Any]]:
    return [p for p in pods_of(real, NS, f"app.kubernetes.io/instance={SERVING}")
            if p["metadata"].get("deletionTimestamp") is None]


def is_ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready").get("status") == "True"


def patch_serving(real: RealCluster, spec: dict[str, Any]) -> None:
    assert real.cluster is not None
    real.cluster.kubectl("patch", "disaggregatedserving", SERVING, "-n", NS, "--type=merge",
                         "-p", json.dumps({"spec": spec}))


def lockstep_pods(real: RealCluster, revision: str | None = None) -> list[dict[str, Any]] | None:
    """Both roles' pods, Ready, all of one revision (`revision` when given) and run by LWS; else None."""
    pods = serving_pods(real)
    revisions = {p["metadata"]["labels"].get(REVISION) for p in pods}
    roles = sorted(p["metadata"]["labels"].get("llm-d.ai/role", "") for p in pods)
    if (len(pods) != 2 or roles != ["decode", "prefill"] or len(revisions) != 1 or None in revisions
            or (revision is not None and revisions != {revision})):
        return None
    if not all(is_ready(p) and p["metadata"]["labels"].get(LWS_NAME) for p in pods):
        return None
    return pods


def test_lockstep_rollout_on_real_pods_keeps_serving(real: RealCluster, serving: dict[str, Any]) -> None:
    assert real.cluster is not None
    patch_serving(real, {"rollout": LOCKSTEP})

    def switched() -> dict[str, Any] | None:
        obj = kubectl_json(real, "get", "disaggregatedserving", SERVING, "-n", NS)
        if obj["status"].get("observedGeneration") != obj["metadata"]["generation"]:
            return None
        rollout = obj["status"].get("rollout") or {}
        pods = lockstep_pods(real, rollout.get("revision"))
        return obj if pods and condition(obj, "Ready").get("status") == "True" else None
    obj = wait_for("the serving on Lockstep, its pods run by LWS", switched, 420, interval=2.0,
                   on_timeout=lambda: diagnosis(real))
    first = obj["status"]["rollout"]["revision"]
    dsets = kubectl_json(real, "get", "disaggregatedsets.disaggregatedset.x-k8s.io", "-n", NS)["items"]
    assert [d["metadata"]["name"] for d in dsets] == [SERVING]
    assert not kubectl_json(real, "get", "deployments", "-n", NS, "-l",
                            f"app.kubernetes.io/instance={SERVING}")["items"], "the Independent Deployments stay"
    old_pods = lockstep_pods(real, first)
    assert old_pods is not None
    (image,) = {c["image"] for p in old_pods for c in p["spec"]["containers"] if c["name"] == ENGINE}
    assert image.startswith(f"{real.registry}/"), image
    for p in old_pods:
        for s in p["status"].get("initContainerStatuses", []) + p["status"]["containerStatuses"]:
            assert s["ready"] and real.container_pids(s["containerID"].removeprefix("containerd://")), s

    # A new engine image: the release's serving image under a new tag, in the nodes' registry.
    new_image = image.rsplit(":", 1)[0] + ":next"
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{image}", f"docker://{new_image}"], check=True, capture_output=True, timeout=300)

    prompt = np.random.default_rng(31).integers(0, MODEL.vocab, PROMPT_TOKENS).tolist()
    expected = monolithic(prompt)
    stop = real.workdir / "lockstep-client.stop"
    out = real.workdir / "lockstep-client.jsonl"
    body = json.dumps({"prompt": prompt, "max_tokens": len(expected)})
    with open(out, "wb") as sink:
        client = real.node_process(real.nodes[0], [
            sys.executable, "-m", "harness.pd_client", "--until", str(stop),
            service_url(real, NS, f"{SERVING}-prefill"), service_url(real, NS, f"{SERVING}-decode"), body], sink)
    try:
        wait_for("the client's first exchange", lambda: out.stat().st_size > 0 or client.poll() is not None, 120)
        rollout_start = time.time()
        patch_serving(real, {"engine": {"image": new_image}})
        looks: list[tuple[str, str, int]] = []   # (Ready, Progressing reason, revisions in status)
        surged = 0     # looks at which the new revision had pods while the old one still served both roles
        gaps: list[list[str]] = []   # looks at which a role had no Ready pod (maxUnavailable 0: never)

        def rolled() -> dict[str, Any] | None:
            nonlocal surged
            assert client.poll() is None, out.read_text()[-3000:]
            now = kubectl_json(real, "get", "disaggregatedserving", SERVING, "-n", NS)
            if now["status"].get("observedGeneration") == now["metadata"]["generation"]:
                revisions = (now["status"].get("rollout") or {}).get("revisions") or []
                looks.append((condition(now, "Ready").get("status", ""),
                              condition(now, "Progressing").get("reason", ""), len(revisions)))
            pods = serving_pods(real)     # one listing: a consistent view of the roles
            ready_roles = {(p["metadata"]["labels"].get("llm-d.ai/role"), p["metadata"]["labels"].get(REVISION))
                           for p in pods if is_ready(p)}
            if {role for role, _ in ready_roles} != {"prefill", "decode"}:
                gaps.append([f"{p['metadata']['name']} ready={is_ready(p)}" for p in pods])
            old_serving = {role for role, rev in ready_roles if rev == first} == {"prefill", "decode"}
            surged += old_serving and any(p["metadata"]["labels"].get(REVISION) not in (None, first) for p in pods)
            revision = (now["status"].get("rollout") or {}).get("revision")
            done = (revision not in (None, first) and condition(now, "Progressing").get("reason") == "Stable"
                    and lockstep_pods(real, revision))
            return now if done else None
        now = wait_for("the Lockstep rollout to the new image", rolled, 600, interval=1.0,
                       on_timeout=lambda: diagnosis(real))
        rollout_end = time.time()
        # One more exchange after the rollout, on the new revision's pods alone.
        wait_for("an exchange after the rollout", lambda: any(
            json.loads(line)["start"] > rollout_end for line in out.read_text().splitlines()), 120)
    finally:
        stop.touch()
        try:
            client.wait(timeout=120)
        except subprocess.TimeoutExpired:
            client.kill()

    exchanges = [json.loads(line) for line in out.read_text().splitlines()]
    failed = [e for e in exchanges if not e["ok"]]
    assert not failed, failed
    assert all(e["tokens"] == expected for e in exchanges), "an exchange differs from the monolithic engine"
    during = [e for e in exchanges if e["start"] >= rollout_start and e["end"] <= rollout_end]
    assert len(during) >= 3, (len(during), rollout_end - rollout_start)
    assert not gaps, gaps
    assert surged > 0, "the new revision's pods never ran beside the old ones: the rollout replaced in place"
    assert all(ready == "True" for ready, _, _ in looks), looks
    assert ("True", "LockstepRollout", 2) in looks, looks

    second = now["status"]["rollout"]["revision"]
    new_pods = lockstep_pods(real, second)
    assert new_pods is not None
    # The new pods run the new tag; the runtime reports the image by the first tag it pulled of
    # those bytes (status.image), so the tag is read from the spec and the bytes from the status.
    assert {c["image"] for p in new_pods for c in p["spec"]["containers"] if c["name"] == ENGINE} == {new_image}
    old_bytes = container_status(old_pods[0], ENGINE)["imageID"]
    assert {container_status(p, ENGINE)["imageID"] for p in new_pods} == {old_bytes}
    assert {p["spec"]["nodeName"] for p in new_pods} <= set(NODES)
    wait_for("the old revision's LeaderWorkerSets deleted", lambda: sorted(
        s["metadata"]["name"] for s in kubectl_json(real, "get", "leaderworkersets.leaderworkerset.x-k8s.io", "-n", NS,
                                                    "-l", f"disaggregatedset.x-k8s.io/name={SERVING}")["items"])
        == [f"{SERVING}-{second}-decode", f"{SERVING}-{second}-prefill"], 120)
    wait_ready(real, "disaggregatedserving", SERVING, NS, 60)
