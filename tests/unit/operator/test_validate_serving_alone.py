"""`validate` of a serving without its pool in the files (an ML team holds only the serving):
the pool-dependent checks reported as not run, exit 3, when there is no cluster to read it
from; and our kinds in a mistyped group refused, not skipped. The pool read from a real API
server: e2e/test_validate_cluster.py."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from harness import REPO
from harness.operator_cli import operator_cli
from tpusync_operator.cluster_pools import ClusterReadError, choose, default_namespace

SAMPLE = REPO / "samples" / "v6e-single-host-reference.yaml"


def docs(kind: str | None = None) -> list[dict]:
    return [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and (kind is None or d["kind"] == kind)]


def cli(tmp_path, *args: str, docs_: list[dict], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """validate on docs_, with no kubeconfig and outside any pod (unless env says)."""
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(docs_))
    return operator_cli("validate", str(path), *args, home=tmp_path, env=env)


@pytest.mark.parametrize("flags", [(), ("--cluster", "none")])
def test_a_serving_alone_reports_its_pool_checks_as_not_run(tmp_path, flags):
    res = cli(tmp_path, *flags, docs_=docs("DisaggregatedServing"))
    assert res.returncode == 3, res.stderr
    assert "the checks that need its TPUSyncPool inference/tpusync-v6e (spec.poolRef.name) were not run" in res.stderr
    assert ("--cluster none" if flags else "no kubeconfig") in res.stderr


def test_a_serving_alone_still_gets_its_schema_checked(tmp_path):
    serving = docs("DisaggregatedServing")[0]
    serving["spec"]["kvTransfer"] = {"connector": "tpu-inference"}
    res = cli(tmp_path, "--cluster", "none", docs_=[serving])
    assert res.returncode == 1, res.stderr
    assert "spec.kvTransfer.connector tpu-inference needs spec.engine.type vllm-tpu" in res.stderr


def test_with_its_pool_a_serving_is_fully_checked(tmp_path):
    res = cli(tmp_path, "--cluster", "none", docs_=docs())
    assert (res.returncode, res.stderr) == (0, "")


def test_a_chosen_cluster_that_is_not_there_is_an_error(tmp_path):
    res = cli(tmp_path, "--cluster", "kubeconfig", docs_=docs("DisaggregatedServing"))
    assert res.returncode == 1 and "--cluster kubeconfig: no kubeconfig at" in res.stderr, res.stderr
    (tmp_path / "kc").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    res = cli(tmp_path, "--kubeconfig", str(tmp_path / "kc"), docs_=docs("DisaggregatedServing"))
    assert res.returncode == 1, res.stderr
    assert "reading TPUSyncPool inference/tpusync-v6e from the cluster of kubeconfig" in res.stderr, res.stderr


@pytest.mark.parametrize("api_version,kind", [
    ("tpusync.dv/v1alpha1", "DisaggregatedServing"),     # the group misspelled
    ("tpusnyc.dev/v1alpha1", "TPUSyncPool"),
    ("tpusync.io/v1alpha1", "DisaggregatedServing"),
    ("apps/v1", "DisaggregatedServing"),                 # our kind, a foreign group
    ("tpusync.dev/v1", "TPUSyncPool"),                   # our group, a version that does not exist
])
def test_our_kinds_in_a_mistyped_group_are_errors(tmp_path, api_version, kind):
    objs = docs()
    mistyped = next(d for d in objs if d["kind"] == kind)
    mistyped["apiVersion"] = api_version
    res = cli(tmp_path, "--cluster", "none", docs_=objs)
    assert res.returncode == 1, res.stderr
    assert f"kind: {api_version}/{kind} is not a kind of tpusync.dev/v1alpha1" in res.stderr
    assert "skipped" not in res.stderr


def test_any_kind_in_a_near_miss_of_our_group_is_an_error(tmp_path):
    res = cli(tmp_path, "--cluster", "none", docs_=docs() + [
        {"apiVersion": "tpusync.io/v1alpha1", "kind": "TPUSyncPol", "metadata": {"name": "p"}}])
    assert res.returncode == 1 and "kind: tpusync.io/v1alpha1/TPUSyncPol is not a kind of" in res.stderr, res.stderr


def test_foreign_objects_are_still_skipped(tmp_path):
    foreign = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
               {"apiVersion": "disaggregatedset.x-k8s.io/v1", "kind": "DisaggregatedSet", "metadata": {"name": "d"}}]
    res = cli(tmp_path, "--cluster", "none", docs_=docs() + foreign)
    assert res.returncode == 0, res.stderr
    assert "skipped" in res.stderr and "v1 ConfigMap c" in res.stderr and "DisaggregatedSet d" in res.stderr


def test_auto_takes_a_kubeconfig_then_the_pod_then_none(tmp_path):
    kc = tmp_path / "kc"
    assert choose("auto", environ={"HOME": str(tmp_path)}).mode == "none"
    assert choose("auto", environ={"HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}).mode == "in-cluster"
    kc.write_text("{}")
    env = {"HOME": str(tmp_path), "KUBECONFIG": f"{tmp_path / 'absent'}{os.pathsep}{kc}",
           "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert choose("auto", environ=env).kubeconfig == str(kc)
    assert choose("none", environ=env).mode == "none"
    assert choose("in-cluster", environ={}).mode == "in-cluster"
    with pytest.raises(ClusterReadError):
        choose("kubeconfig", environ={"HOME": str(tmp_path / "nohome")})


def kubeconfig(path, current: str | None, namespaces: dict[str, str | None]) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", **({"current-context": current} if current else {}),
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": n, "context": {"cluster": "c", "user": "u", **({"namespace": ns} if ns else {})}}
                     for n, ns in namespaces.items()]}))
    return str(path)


def test_objects_without_a_namespace_go_where_kubectl_would_put_them(tmp_path):
    """A serving without metadata.namespace is checked against the pool of the namespace kubectl
    apply would create it in: the kubeconfig context's (the pool is read there), or -n's."""
    serving = docs("DisaggregatedServing")[0]
    del serving["metadata"]["namespace"]
    kc = kubeconfig(tmp_path / "kc", "team", {"team": "ml-team", "other": None})
    res = cli(tmp_path, "--kubeconfig", kc, docs_=[serving])
    assert "reading TPUSyncPool ml-team/tpusync-v6e from the cluster of kubeconfig" in res.stderr, res.stderr
    res = cli(tmp_path, "--kubeconfig", kc, "--context", "other", docs_=[serving])
    assert "reading TPUSyncPool default/tpusync-v6e" in res.stderr, res.stderr
    res = cli(tmp_path, "--kubeconfig", kc, "-n", "prod", docs_=[serving])
    assert "reading TPUSyncPool prod/tpusync-v6e" in res.stderr, res.stderr
    res = cli(tmp_path, "--cluster", "none", docs_=[serving])
    assert "TPUSyncPool default/tpusync-v6e (spec.poolRef.name) were not run" in res.stderr, res.stderr


def test_default_namespace_merges_kubeconfigs_as_kubectl_does(tmp_path):
    """$KUBECONFIG lists several files: the first current-context set wins, and the first
    definition of a context; in a pod, the service account's namespace."""
    first = kubeconfig(tmp_path / "a", None, {"team": "from-a"})
    second = kubeconfig(tmp_path / "b", "team", {"team": "from-b"})
    env = {"KUBECONFIG": os.pathsep.join([first, second]), "HOME": str(tmp_path)}
    assert default_namespace(choose("auto", environ=env)) == "from-a"
    sa = tmp_path / "namespace"
    sa.write_text("serving-ns\n")
    assert default_namespace(choose("in-cluster"), sa_namespace=sa) == "serving-ns"
    assert default_namespace(choose("in-cluster"), sa_namespace=tmp_path / "absent") == "default"
    assert default_namespace(choose("none")) == "default"
