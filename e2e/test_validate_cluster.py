"""`python -m tpusync_operator validate` of a serving alone, its TPUSyncPool read from the real
API server (an ML team holds the serving; the platform team applied the pool): the planner's
checks that need the pool run against the pool the cluster has, and what the cluster cannot
answer (no such pool, no right to read it) is an error, not a pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from harness import REPO
from harness.operator_cli import operator_cli

SAMPLE = REPO / "samples" / "v6e-single-host-reference.yaml"


def sample(ns: str) -> tuple[dict, dict]:
    pool, serving = (d for d in yaml.safe_load_all(SAMPLE.read_text()) if d)
    pool["spec"]["provisioning"] = {"mode": "existing", "existing": {"nodePoolName": "e2e-v6e-2x2"}}
    for obj in (pool, serving):
        obj["metadata"]["namespace"] = ns
    return pool, serving


def validate(tmp_path: Path, serving: dict, *args: str,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(serving))
    return operator_cli("validate", str(path), *args, home=tmp_path, env=env)


def test_validate_reads_a_servings_pool_from_the_cluster(cluster, tpusync_crds, namespace, tmp_path):
    pool, serving = sample(namespace)
    cluster.apply(pool)
    kubeconfig = str(cluster.kubeconfig)

    res = validate(tmp_path, serving, "--kubeconfig", kubeconfig)
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    res = validate(tmp_path, serving, env={"KUBECONFIG": kubeconfig})       # --cluster auto finds it
    assert (res.returncode, res.stderr) == (0, ""), res.stderr

    # A check that needs the pool: a single-host 2x4 slice holds no two-host replica.
    serving["spec"]["prefill"]["hostsPerReplica"] = 2
    res = validate(tmp_path, serving, "--cluster", "kubeconfig", "--kubeconfig", kubeconfig)
    assert res.returncode == 1 and "spec.prefill.hostsPerReplica must be 1 for topology 2x4" in res.stderr, \
        res.stderr
    res = validate(tmp_path, serving, "--cluster", "none")                   # not run, and said so
    assert res.returncode == 3 and "were not run" in res.stderr and "hostsPerReplica" not in res.stderr, res.stderr

    serving["spec"]["prefill"]["hostsPerReplica"] = 1
    serving["spec"]["poolRef"]["name"] = "absent"
    res = validate(tmp_path, serving, "--kubeconfig", kubeconfig)
    assert res.returncode == 1 and "spec.poolRef.name 'absent': no TPUSyncPool of that name" in res.stderr
    assert f"nor in the cluster of kubeconfig {kubeconfig}" in res.stderr, res.stderr

    # An identity that may not read pools: the API server's 403, an error.
    serving["spec"]["poolRef"]["name"] = pool["metadata"]["name"]
    no_rights = cluster.service_account_kubeconfig("default", namespace, tmp_path / "sa.kubeconfig")
    res = validate(tmp_path, serving, "--kubeconfig", str(no_rights))
    assert res.returncode == 1 and "Kubernetes API 403" in res.stderr, res.stderr
