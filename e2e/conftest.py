"""pytest fixtures for the e2e suite: one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) per test session. See e2e/cluster.py and
docs/e2e.md. Run with `make e2e` (builds the control plane first) or
`.venv/bin/python -m pytest e2e` after `make controlplane`."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import Cluster, ControlPlaneError  # noqa: E402

# Fake GKE TPU node pools created once per session (kwok-managed, Ready, tainted
# google.com/tpu=present:NoSchedule).
DEFAULT_POOLS = (
    dict(pool="v6e-pool", count=2, accelerator="tpu-v6e-slice", topology="2x4",
         chips_per_node=4, machine_type="ct6e-standard-4t"),
    dict(pool="tpu7x-pool", count=1, accelerator="tpu7x", topology="2x2x1",
         chips_per_node=4, machine_type="tpu7x-standard-4t"),
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A running control plane with the default TPU node pools. The components' logs are in
    <workdir>/logs; their last lines are attached to the report of a failing test."""
    workdir = tmp_path_factory.mktemp("cluster")
    error = None
    try:
        cl = Cluster.create(workdir=workdir)
        cl.start()
    except ControlPlaneError as err:
        error = str(err)
    if error is not None:
        pytest.fail(error, pytrace=False)
    try:
        for spec in DEFAULT_POOLS:
            cl.add_tpu_nodes(**spec)
        yield cl
    finally:
        cl.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "cluster" in getattr(item, "funcargs", {}):
        report.sections.append(("control plane logs (tails)", item.funcargs["cluster"].logs()))
    return report


@pytest.fixture(scope="session")
def crds(cluster):
    """Installs the third-party CRDs once; returns their names."""
    return cluster.install_crds()


@pytest.fixture
def namespace(cluster):
    """A fresh namespace (with its default ServiceAccount ready), deleted afterwards."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("wait", "--for=create", "serviceaccount/default",
                    "-n", name, "--timeout=60s")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
