"""The real-node tier (`make cluster-test`): a control plane and two real nodes (kubelet,
containerd, runc, CNI, kube-proxy; CoreDNS; harness/nodes.py), the release pushed to the nodes'
registry by its own steps, and the user's first day run on it. Fails, naming what is missing,
where the machine cannot run it: never skipped."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.controlplane import ControlPlaneError
from harness.lws import LWSController
from harness.nodes import NodesUnavailable, RealCluster, default_node, tpu_node
from harness.polling import WaitTimeout
from harness.processes import ProcessExited
from harness.release import pushed, release_step
from tests.conftest import not_collected

if not os.environ.get("TPUSYNC_IMAGES"):
    collect_ignore_glob = not_collected(
        "tests/cluster", "no image archives (TPUSYNC_IMAGES); `make cluster-test` builds and runs it")

from .kube import (
    API,
    CPU_NODE,
    MODEL_NAME,
    NODE_POOL,
    NODES,
    NS,
    OPERATOR_NS,
    POOL,
    RELEASE,
    SERVING,
    VERSION,
    diagnosis,
    pods_of,
    wait_ready,
)


@pytest.fixture(scope="session")
def archives() -> Path:
    path = Path(os.environ["TPUSYNC_IMAGES"]).resolve()
    found = {p.name for p in path.glob("*.oci.tar")}
    wanted = {"tpusync-operator.oci.tar", "tpusync-sidecar.oci.tar", "tpusync-serving.oci.tar"}
    if not wanted <= found:
        pytest.fail(f"{path} lacks {sorted(wanted - found)} (`make image-archives` builds them)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def real() -> Iterator[RealCluster]:
    """A CPU node and four v6e 2x2 hosts of one GKE TPU node pool, each a real node."""
    workdir = Path(tempfile.mkdtemp(prefix="tpusync-cluster-"))
    rc = RealCluster([default_node(CPU_NODE), *(tpu_node(n, NODE_POOL) for n in NODES)], workdir)
    try:
        rc.start()
    except (ControlPlaneError, NodesUnavailable, ProcessExited, WaitTimeout) as err:
        rc.stop()
        pytest.fail(f"the real cluster did not start: {err}", pytrace=False)
    try:
        yield rc
    finally:
        rc.stop()
        if os.environ.get("TPUSYNC_KEEP_CLUSTER_LOGS"):
            print(f"cluster logs kept in {workdir / 'logs'}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# ----- the first day's steps, in docs/gke.md's order: every test module builds on them ----

@pytest.fixture(scope="session")
def released(real: RealCluster, archives: Path) -> dict[str, str]:
    """The release workflow's steps: every image and the chart, into the nodes' registry."""
    assert real.cluster is not None
    helm = str(real.cluster.bin / "helm")
    work = real.workdir / "release"
    out = release_step(work, "--plain-http", "push-images", real.registry, VERSION,
                       *(str(p) for p in sorted(archives.glob("*.oci.tar"))), helm=helm)
    out += release_step(work, "--plain-http", "chart", real.registry, VERSION, str(work / "dist"), helm=helm)
    return pushed(out)


@pytest.fixture(scope="session")
def lws(real: RealCluster) -> Iterator[LWSController]:
    """LeaderWorkerSet v0.9.0, the prerequisite docs/gke.md installs before the chart (Lockstep
    rollouts): its CRDs, and its controller beside the control plane (RealCluster.start_lws)."""
    try:
        controller = real.start_lws()
    except (ControlPlaneError, ProcessExited, WaitTimeout) as err:
        pytest.fail(f"the LWS controller did not start: {err}", pytrace=False)
    yield controller
    controller.stop()


@pytest.fixture(scope="session")
def installed(real: RealCluster, released: dict[str, str], lws: LWSController) -> Iterator[dict[str, Any]]:
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


@pytest.fixture(scope="session")
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
