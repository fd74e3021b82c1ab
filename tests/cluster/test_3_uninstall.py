"""The last day: deleting the serving and the pool, then `helm uninstall`, leaves nothing behind
on the real nodes — no pod, no finalizer holding a CR, no pool file in a node's volumes."""

from __future__ import annotations

from typing import Any

import pytest

from harness.nodes import RealCluster
from harness.polling import wait_for

from .kube import API, NS, OPERATOR_NS, POOL, RELEASE, SERVING

pytestmark = pytest.mark.timeout(900)


def test_deleting_the_crs_and_uninstalling_leaves_nothing(real: RealCluster, serving: dict[str, Any]) -> None:
    assert real.cluster is not None
    cl = real.cluster
    group = API.split("/")[0]
    cl.kubectl("delete", f"disaggregatedservings.{group}", SERVING, "-n", NS, "--wait=true", "--timeout=180s",
               timeout=200)
    cl.kubectl("delete", f"tpusyncpools.{group}", POOL, "-n", NS, "--wait=true", "--timeout=180s", timeout=200)
    cl.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "180s", timeout=200)

    def pods_left() -> list[str]:
        got = cl.kubectl_json("get", "pods", "-A")["items"]
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in got
                if p["metadata"]["namespace"] in (NS, OPERATOR_NS)]
    left = wait_for("every pod of the pool, the serving and the operator gone", lambda: not pods_left(), 180,
                    interval=1.0, raise_on_timeout=False)
    assert left, pods_left()
    for kind in ("disaggregatedservings", "tpusyncpools"):
        assert cl.kubectl_json("get", f"{kind}.{group}", "-A")["items"] == [], kind
    # The kubelets removed the pods' volumes: no DRAM tier's pool file, no disk tier left on a node.
    def files_left() -> list[str]:
        return [str(p) for p in real.run_dir.glob("n*/kubelet/pods/*/volumes/kubernetes.io~empty-dir/tpusync-*/*")]
    gone = wait_for("the kubelets to remove the pods' volumes", lambda: not files_left(), 120, interval=1.0,
                    raise_on_timeout=False)
    assert gone, files_left()
