"""pytest fixtures for the e2e suite: one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) per test session. The machinery is in
harness/ (cluster.py, lws.py, operator_process.py); see docs/e2e.md. Run with
`make e2e` (builds the control plane first) or `.venv/bin/python -m pytest e2e` after
`make controlplane`."""

from __future__ import annotations

import uuid

import pytest

from harness import REPO
from harness.cluster import running_cluster
from harness.lws import LWSController
from harness.operator_process import OperatorProcess, helm_install_operator

# Fake GKE TPU node pools created once per session (kwok-managed, Ready, tainted
# google.com/tpu=present:NoSchedule).
DEFAULT_POOLS = (
    {"pool": "v6e-pool", "count": 2, "accelerator": "tpu-v6e-slice", "topology": "2x4",
         "chips_per_node": 4, "machine_type": "ct6e-standard-4t"},
    {"pool": "tpu7x-pool", "count": 1, "accelerator": "tpu7x", "topology": "2x2x1",
         "chips_per_node": 4, "machine_type": "tpu7x-standard-4t"},
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A running control plane with the default TPU node pools. The components' logs are in
    <workdir>/logs; their last lines are attached to the report of a failing test."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as cl:
        for spec in DEFAULT_POOLS:
            cl.add_tpu_nodes(**spec)
        yield cl


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    funcargs = getattr(item, "funcargs", {})
    if report.failed and "cluster" in funcargs:
        report.sections.append(("control plane logs (tails)", funcargs["cluster"].logs()))
    if report.failed and "operator" in funcargs:
        report.sections.append(("tpusync operator log (tail)", funcargs["operator"].tail(80)))
    return report


@pytest.fixture(scope="session")
def crds(cluster):
    """Installs the third-party CRDs once; returns their names."""
    return cluster.install_crds()


def _new_namespace(cluster, prefix: str = "e2e", *, restricted: bool = False) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    if restricted:  # the API server's PodSecurity admission rejects pods that do not comply
        cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    cluster.kubectl("wait", "--for=create", "serviceaccount/default",
                    "-n", name, "--timeout=60s")
    return name


@pytest.fixture
def namespace(cluster):
    """A fresh namespace (with its default ServiceAccount ready), deleted afterwards."""
    name = _new_namespace(cluster)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def module_namespace(cluster):
    """One namespace for all tests of a module (scenarios that build on each other), under
    the restricted Pod Security Standard: every pod the operator makes must comply."""
    name = _new_namespace(cluster, restricted=True)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# ----- tpusync: CRDs, the chart, the operator ---------------------------------------------

OPERATOR_NAMESPACE = "tpusync-system"
OPERATOR_RELEASE = "tpusync-operator"     # fullname = release name: SA "tpusync-operator"
# Extra kwok node pools for the operator scenarios: single-host v6e (2x2: 4 chips, one
# host) and v7x (2x2x1) slices the TPUSyncPools select by node pool, plus an untainted CPU
# pool of two nodes for store nodes and the endpoint pickers.
OPERATOR_POOLS = (
    {"pool": "e2e-v6e-2x2", "count": 6, "accelerator": "tpu-v6e-slice", "topology": "2x2",
         "chips_per_node": 4, "machine_type": "ct6e-standard-4t"},
    {"pool": "e2e-tpu7x", "count": 2, "accelerator": "tpu7x", "topology": "2x2x1",
         "chips_per_node": 4, "machine_type": "tpu7x-standard-4t"},
)
STORE_POOL = "tpusync-store"


@pytest.fixture(scope="session")
def tpusync_crds(cluster):
    """`kubectl apply -f crds/` (TPUSyncPool, DisaggregatedServing, kopf peerings), Established."""
    res = cluster.kubectl("apply", "-f", str(REPO / "crds"))
    names = [line.split()[0].split("/", 1)[1] for line in res.stdout.splitlines() if line.strip()]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    *(f"crd/{n}" for n in names), timeout=90)
    return names


@pytest.fixture(scope="session")
def llmd_crds(cluster, crds):
    """InferenceObjective as llm-d serves it (llm-d.ai/v1alpha2, what the operator writes):
    the published Gateway API Inference Extension CRD with its group renamed; schema
    unchanged. See docs/e2e.md."""
    return cluster.install_llmd_crds()


@pytest.fixture(scope="session")
def operator_nodes(cluster):
    names = [n for spec in OPERATOR_POOLS for n in cluster.add_tpu_nodes(**spec)]
    return names + cluster.add_cpu_nodes(STORE_POOL, 2)   # two: the endpoint pickers keep apart


@pytest.fixture(scope="session")
def lws(cluster, crds, tmp_path_factory):
    """The LeaderWorkerSet controller and its webhooks (harness/lws.py)."""
    controller = LWSController(cluster, tmp_path_factory.mktemp("lws"))
    try:
        controller.start()
        yield controller
    finally:
        controller.stop()


@pytest.fixture(scope="session")
def operator(cluster, crds, llmd_crds, tpusync_crds, operator_nodes, tmp_path_factory):
    """The chart installed (release tpusync-operator in tpusync-system; kwok plays its pods),
    and the operator running here as a process with the chart's ServiceAccount token,
    peered through the chart's ClusterKopfPeering, polling GKE-mode pools every 3 s."""
    helm_install_operator(cluster, OPERATOR_RELEASE, OPERATOR_NAMESPACE)
    op = OperatorProcess(cluster, service_account=OPERATOR_RELEASE, namespace=OPERATOR_NAMESPACE,
                         workdir=tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
