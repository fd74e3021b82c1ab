"""docs/gke.md followed on a control plane of its own: the guide's commands, run as written
with the control plane's kubectl and helm and this clone's python, in the guide's order.

What only GKE can do is played here, and said where: the cluster's nodes (the sample's two
v7x node pools and the store pool, as kwok nodes labelled as the sample's gcloud lines label
them), the CRDs GKE and the prerequisites install (from the same module versions, with the
version in each of the guide's URLs checked against the ones installed, as this machine
reaches no release URL), the volumes a CSI driver would provision (PersistentVolumes of the
sizes and classes the sample asks for), and the operator's pod (the operator runs here as a
process with the chart's ServiceAccount; kwok plays the pod the chart creates). Steps 5 and 6
(a request through GKE's Gateway, its load balancer and Cloud Monitoring) have no
counterpart here. GKE's HealthCheckPolicy and GCPBackendPolicy CRDs come with its Gateway
controller and are published nowhere: the serving reports exactly those as missing, and
everything else Ready."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_operator import conditions, get, items, wait_condition

from harness import REPO
from harness.cluster import Cluster
from harness.lws import LWSController
from harness.operator_process import OperatorProcess
from harness.polling import wait_for
from tpusync_operator import versions
from tpusync_operator.builders.engine import vllm_argv

GUIDE = REPO / "docs" / "gke.md"
SAMPLE = "samples/v7x-multi-host-vllm.yaml"
NS = "inference"
CONVERGE = 180


def guide_blocks() -> dict[str, list[str]]:
    """{section heading: its ```sh blocks}, in the guide's order."""
    sections: dict[str, list[str]] = {}
    heading = ""
    for part in re.split(r"^(## .*)$", GUIDE.read_text(), flags=re.M):
        if part.startswith("## "):
            heading = part[3:].strip()
        else:
            sections[heading] = re.findall(r"```sh\n(.*?)```", part, flags=re.S)
    return sections


BLOCKS = guide_blocks()


def block(prefix: str) -> str:
    (script,) = next(v for k, v in BLOCKS.items() if k.startswith(prefix))
    return script


def run_guide(cluster: Cluster, script: str, timeout: float = 180) -> str:
    """One of the guide's blocks, as a user's shell runs it (stops at the first failure)."""
    env = cluster.env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"      # `python` is this clone's
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=timeout)
    assert res.returncode == 0, f"{script}\nexit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def guide_cluster(tmp_path_factory):
    """A control plane with what the guide's prerequisites give: the sample's nodes and
    CRDs, the LWS controller, and volumes for the sample's claims."""
    cl = Cluster.create(workdir=tmp_path_factory.mktemp("guide-cluster"))
    cl.start()
    lws = None
    try:
        # Two v7x 2x2x2 slices (node pools tpu7x-0, tpu7x-1), labelled as the sample's gcloud
        # lines label them, and the store node pool its storeNodes select.
        for i in range(2):
            nodes = cl.add_tpu_nodes(f"tpu7x-{i}", 2, accelerator="tpu7x", topology="2x2x2",
                                     chips_per_node=4, machine_type="tpu7x-standard-4t")
            cl.kubectl("label", "nodes", *nodes, "tpusync.dev/pool=tpusync-v7x")
        cl.add_cpu_nodes("tpusync-store", 2, memory="512Gi")
        cl.add_cpu_nodes("default-pool", 1)
        cl.install_crds()
        cl.install_llmd_crds()
        cl.kubectl("apply", "-f", str(REPO / "crds"))
        lws = LWSController(cl, tmp_path_factory.mktemp("guide-lws"))
        lws.start()
        # What GKE's CSI driver would provision for the sample's ephemeral volumes.
        pvs = [("premium-rwo", "1Ti")] * 2 + [("hyperdisk-balanced", "600Gi")] * 4 + \
              [("hyperdisk-balanced", "64Gi")] * 4
        cl.apply([{"apiVersion": "v1", "kind": "PersistentVolume",
                   "metadata": {"name": f"guide-pv-{i}"},
                   "spec": {"storageClassName": cls, "capacity": {"storage": size},
                            "accessModes": ["ReadWriteOnce"], "hostPath": {"path": f"/tmp/guide-pv-{i}"}}}
                  for i, (cls, size) in enumerate(pvs)])
        yield cl
    finally:
        if lws is not None:
            lws.stop()
        cl.stop()


def test_the_guides_prerequisites_name_the_versions_installed():
    """The guide's URLs name the versions the operator pins (and e2e installs)."""
    prereq = next(v for k, v in BLOCKS.items() if k.startswith("1."))[0]
    urls = re.findall(r"https://\S+", prereq)
    gie = next(u for u in urls if "gateway-api-inference-extension" in u)
    assert f"/download/{versions.GATEWAY_API_INFERENCE_EXTENSION.version}/" in gie, gie
    objective = next(u for u in urls if "inferenceobjectives" in u)
    assert f"/{versions.INFERENCE_OBJECTIVE.version}/" in objective, objective
    lws = next(u for u in urls if "kubernetes-sigs/lws" in u)
    assert f"/download/{versions.LWS.version}/" in lws, lws


def test_install_render_apply_and_tear_down_as_the_guide_says(guide_cluster, tmp_path_factory):
    cl = guide_cluster
    # 2. Install the operator (the chart; kwok plays its pods) and wait for its rollout.
    run_guide(cl, block("2."))
    release = cl.helm("status", "tpusync-operator", "-n", "tpusync-system", "-o", "json").stdout
    assert '"status":"deployed"' in release.replace(" ", "")
    sa = get(cl, "serviceaccount", "tpusync-system", "tpusync-operator")
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == \
        "tpusync-operator@PROJECT.iam.gserviceaccount.com"
    op = OperatorProcess(cl, service_account="tpusync-operator", namespace="tpusync-system",
                         workdir=tmp_path_factory.mktemp("guide-operator"))
    op.start()
    try:
        # 3. The dry run shows what step 4 creates: tensor parallel 16 on the v7x slices.
        docs = [d for d in yaml.safe_load_all(run_guide(cl, block("3."))) if d]
        lws_args = [vllm_argv(c) for d in docs if d["kind"] == "LeaderWorkerSet"
                    for c in d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
                    if c["name"] == "engine"]
        assert len(lws_args) == 2 and all(a and a[a.index("--tensor-parallel-size") + 1] == "16" for a in lws_args)

        # 4. Apply the sample (the guide's last line watches; here the test does).
        run_guide(cl, block("4.").replace(" -w\n", "\n"))
        pool = wait_condition(cl, "tpusyncpool", NS, "tpusync-v7x", timeout=CONVERGE)
        assert pool["status"]["readyHosts"] == 4, pool["status"]
        # Ready counts hosts; the sidecars' pods turn Ready after, and their events bring a pass.
        wait_for("the pool's sidecars counted ready", lambda: (get(cl, "tpusyncpool", NS, "tpusync-v7x")
                 ["status"].get("readySidecars") or 0) >= 2, CONVERGE)
        ds = wait_for("the serving's replicas ready, only GKE's policy CRDs missing", lambda: (
            lambda d: d if d and d.get("status", {}).get("decode", {}).get("readyReplicas") == 1
            and d["status"].get("prefill", {}).get("readyReplicas") == 1
            and conditions(d).get("Degraded", {}).get("reason") == "MissingCRD" else None)(
                get(cl, "disaggregatedservings", NS, "qwen3-235b")), CONVERGE)
        assert conditions(ds)["Degraded"]["message"] == (
            "CRD not installed in the cluster: GCPBackendPolicy (gcpbackendpolicies.networking.gke.io), "
            "HealthCheckPolicy (healthcheckpolicies.networking.gke.io)")
        for kind, name in (("inferencepool", "qwen3-235b"), ("httproute", "qwen3-235b"),
                           ("leaderworkerset", "qwen3-235b-prefill"), ("leaderworkerset", "qwen3-235b-decode"),
                           ("deployment", "qwen3-235b-epp")):
            assert get(cl, kind, NS, name) is not None, (kind, name)

        # 7. Tear down: the sample's objects and what the operator made for them go; then the
        # chart, whose uninstall stops the operator's pod (here: its process, first).
        teardown = block("7.").splitlines(keepends=True)
        chart = next(i for i, line in enumerate(teardown) if line.startswith("helm uninstall"))
        run_guide(cl, "".join(teardown[:chart]), timeout=300)
        wait_for("the serving's children collected", lambda: not items(
            cl, "deployments,leaderworkersets,inferencepools,services", NS), CONVERGE)
        op.stop()
        assert "Traceback" not in op.log_text(), op.tail()
        run_guide(cl, "".join(teardown[chart:]))
        assert cl.helm("status", "tpusync-operator", "-n", "tpusync-system", check=False).returncode != 0
    finally:
        op.stop()
