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

import pytest

from harness.controlplane import ControlPlaneError
from harness.nodes import NodesUnavailable, RealCluster, default_node, tpu_node
from harness.polling import WaitTimeout
from harness.processes import ProcessExited
from tests.conftest import not_collected

if not os.environ.get("TPUSYNC_IMAGES"):
    collect_ignore_glob = not_collected(
        "tests/cluster", "no image archives (TPUSYNC_IMAGES); `make cluster-test` builds and runs it")

NODE_POOL = "tpu-pool"
NODES = ("gke-tpu-pool-0", "gke-tpu-pool-1")
CPU_NODE = "gke-default-pool-0"   # GKE's default pool: the operator's pods (they tolerate no TPU taint)


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
    """A CPU node and two v6e 2x2 hosts of one GKE TPU node pool, each a real node."""
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
