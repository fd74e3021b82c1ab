"""The operator on a real control plane, as the chart's ServiceAccount (RBAC enforced):
TPUSyncPool with store nodes, DisaggregatedServing with the reference engine and with
vllm-tpu, update, drift repair, operator restart mid-reconcile, a missing optional CRD,
delete with garbage collection. kwok plays the kubelets (pods become Ready); the real
kube-controller-manager runs the Deployments/StatefulSets and the garbage collector.

The scenarios share one namespace and the six v6e hosts. Each starts from the objects it
takes as fixtures (pool, ref, vllm: created, or put back to their baseline spec and Ready) and
deletes any other serving it makes, so any one runs alone or in any order.
"""

from __future__ import annotations

import base64
import json

import pytest
import yaml
from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, STORE_POOL

from harness.polling import wait_for

API = "tpusync.dev/v1alpha1"
TPU = "google.com/tpu"
POOL = "kv"
POOL7 = "kv7"
REF = "ref"
VLLM = "vl"

# The namespace enforces the restricted Pod Security Standard (module_namespace). Engines with
# TPUs run as root by default, as GKE documents TPU access (their pods fit baseline:
# e2e/test_golden.py), so the servings here run theirs as uid 65532 through
# spec.engine.securityContext, as on nodes that grant that uid the TPU devices; every pod the
# operator makes must still be admitted. kwok runs no engine.
NONROOT_ENGINE = {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}

FINALIZER = "tpusync.dev/operator"
CONVERGE = 90   # seconds: passes follow watch events; kopf retries failed handlers after their delay


# ----- helpers ----------------------------------------------------------------------------

def get(cluster, kind: str, ns: str, name: str) -> dict | None:
    res = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    if res.returncode != 0:
        if "NotFound" in res.stderr or "not found" in res.stderr:
            return None
        raise AssertionError(res.stderr)
    return json.loads(res.stdout)


def items(cluster, kind: str, ns: str, selector: str | None = None) -> list[dict]:
    args = ["get", kind, "-n", ns]
    if selector:
        args += ["-l", selector]
    return cluster.kubectl_json(*args)["items"]


def conditions(obj: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions", [])}


def wait_condition(cluster, kind: str, ns: str, name: str, type_: str = "Ready",
                   status: str = "True", reason: str | None = None,
                   timeout: float = CONVERGE) -> dict:
    """Polls until the object's condition has `status` (and `reason`) for its current
    generation; returns the object."""
    def check():
        obj = get(cluster, kind, ns, name)
        c = conditions(obj).get(type_)
        if (c and c["status"] == status and (reason is None or c["reason"] == reason)
                and c.get("observedGeneration") == obj["metadata"]["generation"]):
            return obj
        return None

    def detail():
        obj = get(cluster, kind, ns, name)
        return "\nstatus: " + json.dumps((obj or {}).get("status"), indent=1)
    return wait_for(f"{kind} {ns}/{name} {type_}={status} {reason or ''}", check, timeout,
                    interval=0.5, on_timeout=detail)


def apply(cluster, obj: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def owned_by(obj: dict, owner: dict) -> bool:
    refs = obj["metadata"].get("ownerReferences", [])
    return any(r["uid"] == owner["metadata"]["uid"] and r.get("controller") for r in refs)


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    key = "initContainers" if init else "containers"
    (c,) = [c for c in pod_spec.get(key, []) if c["name"] == name]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def pool_obj(ns: str, name: str, *, tpu: dict, node_pool: str, hosts: int,
             store: dict | None = None) -> dict:
    spec = {"tpu": tpu, "capacity": {"hosts": hosts},
            "provisioning": {"mode": "existing", "existing": {"nodePoolName": node_pool}},
            "tiers": {"dram": "8Gi", "disk": {"size": "16Gi"}, "blockBytes": "2Mi"}}
    if store:
        spec["storeNodes"] = store
    return {"apiVersion": API, "kind": "TPUSyncPool", "metadata": {"name": name, "namespace": ns},
            "spec": spec}


def serving_obj(ns: str, name: str, *, engine: dict, pool: str, prefill: int = 1,
                decode: int = 1, routing: dict | None = None) -> dict:
    engine = engine if engine.get("cpuOnly") else {"securityContext": NONROOT_ENGINE, **engine}
    return {"apiVersion": API, "kind": "DisaggregatedServing",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"name": "Qwen/Qwen3-0.6B", "uri": "hf://Qwen/Qwen3-0.6B"},
                     "engine": engine, "poolRef": {"name": pool},
                     "prefill": {"replicas": prefill}, "decode": {"replicas": decode},
                     "prefixCache": {"hostDram": "4Gi"},
                     "routing": routing or {}}}


SERVING_CHILDREN = [  # (kind, name suffix) of a serving with routing and a gateway
    ("deployment", "-prefill"), ("deployment", "-decode"), ("service", "-prefill"),
    ("service", "-decode"), ("networkpolicy", "-serving"), ("serviceaccount", "-epp"),
    ("role", "-epp"), ("rolebinding", "-epp"), ("configmap", "-epp"), ("deployment", "-epp"),
    ("service", "-epp"), ("networkpolicy", "-epp"), ("inferencepool", ""),
    ("inferenceobjectives.llm-d.ai", ""),
]


def ensure(cluster, kind: str, obj: dict) -> dict:
    """obj in place with exactly its spec (created, or its spec replaced whole: what an earlier scenario
    changed is undone) and Ready for that spec; returns it."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    live = get(cluster, kind, ns, name)
    if live is None:
        apply(cluster, obj)
    else:  # the spec replaced whole by a patch: no resourceVersion to race the operator's own writes with
        cluster.kubectl("patch", kind, name, "-n", ns, "--type=json",
                        "-p", json.dumps([{"op": "replace", "path": "/spec", "value": obj["spec"]}]))
    return wait_condition(cluster, kind, ns, name)


@pytest.fixture
def pool(cluster, operator, module_namespace) -> dict:
    """Six v6e hosts and two store nodes lending 32 GiB DRAM and 100 GiB disk each."""
    return ensure(cluster, "tpusyncpool", pool_obj(
        module_namespace, POOL, tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=6,
        store={"enabled": True, "kind": "StatefulSet", "replicas": 2, "dram": "32Gi", "disk": {"size": "100Gi"},
               "nodeSelector": {"cloud.google.com/gke-nodepool": STORE_POOL}}))


@pytest.fixture
def ref(cluster, pool, module_namespace) -> dict:
    """The reference engine on two of the pool's hosts, routed through a gateway."""
    return ensure(cluster, "disaggregatedservings", serving_obj(
        module_namespace, REF, engine={"type": "reference"}, pool=POOL,
        routing={"gatewayRef": {"name": "inference-gw"}, "pdThresholdTokens": 32}))


@pytest.fixture
def vllm(cluster, operator, module_namespace) -> dict:
    """vllm-tpu on a v7x pool of two hosts, no gateway."""
    ns = module_namespace
    ensure(cluster, "tpusyncpool", pool_obj(ns, POOL7, tpu={"type": "v7x", "topology": "2x2x1"},
                                            node_pool="e2e-tpu7x", hosts=2))
    return ensure(cluster, "disaggregatedservings", serving_obj(
        ns, VLLM, engine={"type": "vllm-tpu"}, pool=POOL7, routing={"precisePrefixCache": False}))


# ----- the operator and its identity -------------------------------------------------------

def test_operator_runs_as_the_chart_service_account(cluster, operator):
    """The process authenticates with the chart's ServiceAccount token, so RBAC applies:
    the token is refused what the chart does not grant (listing Secrets), and the operator
    registered itself in the chart's ClusterKopfPeering (patch permission)."""
    token = yaml.safe_load((operator.workdir / "operator.kubeconfig").read_text())[
        "users"][0]["user"]["token"]
    status, body = cluster.api("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                               token=token, method="POST",
                               body={"apiVersion": "authentication.k8s.io/v1",
                                     "kind": "SelfSubjectReview"})
    assert status == 201, body
    assert body["status"]["userInfo"]["username"] == \
        f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_RELEASE}"
    status, _ = cluster.api("/api/v1/secrets", token=token)
    assert status == 403
    status, _ = cluster.api("/apis/apps/v1/replicasets", token=token)
    assert status == 403   # its children are watched; what their controllers make is not
    status, _ = cluster.api("/apis/apps/v1/deployments", token=token)
    assert status == 200
    peering = wait_for("the operator in the ClusterKopfPeering", lambda: (
        cluster.kubectl_json("get", "clusterkopfpeering", "tpusync-operator")
        .get("status", {}).get("e2e-operator")), 30)
    assert peering["priority"] == 100
    assert operator.alive()


# ----- TPUSyncPool ------------------------------------------------------------------------

def test_namespace_enforces_the_restricted_pod_security_standard(cluster, module_namespace):
    """Every pod below runs in a namespace where the API server rejects non-compliant pods,
    so their becoming Ready shows the operator's workloads fit the restricted standard."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root", "namespace": module_namespace},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    res = cluster.kubectl("apply", "-f", "-", input=json.dumps(pod), check=False)
    assert res.returncode != 0 and 'violates PodSecurity "restricted' in res.stderr, res.stderr


def test_pool_with_store_nodes_becomes_ready(cluster, pool, module_namespace):
    ns = module_namespace
    st = pool["status"]
    assert st["hosts"] == 6 and st["readyHosts"] == 6
    assert st["sidecars"] == 2 and st["readySidecars"] == 2          # the two store nodes
    assert st["dramBytes"] == 2 * 32 * 2**30 and st["diskBytes"] == 2 * 100 * 2**30
    assert st["peersService"] == f"{POOL}-peers.{ns}.svc"
    assert st["nodePool"] == {"name": "e2e-v6e-2x2", "state": "Existing"}
    # Only GKE-mode pools (a cloud node pool to delete) carry the operator's finalizer.
    assert FINALIZER not in pool["metadata"].get("finalizers", [])
    conds = conditions(pool)
    assert conds["Progressing"]["status"] == "False" and conds["Degraded"]["status"] == "False"

    sts = get(cluster, "statefulset", ns, f"{POOL}-store")
    assert owned_by(sts, pool) and sts["spec"]["replicas"] == 2
    assert sts["status"]["readyReplicas"] == 2
    store_pod = sts["spec"]["template"]["spec"]
    assert store_pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": STORE_POOL}
    side = container(store_pod, "tpusync-sidecar")
    assert f"--dram-bytes={32 * 2**30}" in side["args"]
    assert f"--peers-dns={POOL}-peers.{ns}.svc" in side["args"]
    svc = get(cluster, "service", ns, f"{POOL}-peers")
    assert owned_by(svc, pool) and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    netpol = get(cluster, "networkpolicy", ns, f"{POOL}-data")
    assert owned_by(netpol, pool)
    assert netpol["spec"]["podSelector"] == {"matchLabels": {"tpusync.dev/pool": POOL}}
    secret = get(cluster, "secret", ns, f"{POOL}-auth")
    assert owned_by(secret, pool) and len(base64.b64decode(secret["data"]["token"])) == 32
    assert get(cluster, "configmap", ns, f"{POOL}-config") is None     # no settings nothing reads
    # Every child is server-side applied by the operator's field manager.
    full = cluster.kubectl_json("get", "statefulset", f"{POOL}-store", "-n", ns,
                                "--show-managed-fields")
    managers = {(m["manager"], m["operation"]) for m in full["metadata"]["managedFields"]}
    assert ("tpusync-operator", "Apply") in managers, managers
    events = items(cluster, "events", ns)
    reasons = {e["reason"] for e in events if e["involvedObject"]["name"] == POOL}
    assert {"SecretGenerated", "Ready"} <= reasons, reasons


# ----- DisaggregatedServing ----------------------------------------------------------------

def test_serving_reference_engine(cluster, operator, ref, module_namespace):
    ns, ds = module_namespace, ref
    st = ds["status"]
    assert st["prefill"] == {"kind": "Deployment", "replicas": 1, "readyReplicas": 1}
    assert st["decode"] == {"kind": "Deployment", "replicas": 1, "readyReplicas": 1}
    assert st["routingReady"] is True
    assert st["endpoint"] == f"gateway/{ns}/inference-gw"

    for kind, suffix in SERVING_CHILDREN + [("httproute", "")]:
        child = get(cluster, kind, ns, REF + suffix)
        assert child is not None, (kind, REF + suffix)
        assert owned_by(child, ds), (kind, REF + suffix)

    for role in ("prefill", "decode"):
        dep = get(cluster, "deployment", ns, f"{REF}-{role}")
        tpl = dep["spec"]["template"]
        labels = tpl["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role
        assert labels["llm-d.ai/inference-serving"] == "true"
        assert labels["tpusync.dev/pool"] == POOL and labels["tpusync.dev/serving"] == REF
        spec = tpl["spec"]
        eng = container(spec, "engine")
        assert eng["command"] == ["python", "-m", "tpusync.serving"]
        assert eng["args"][eng["args"].index("--role") + 1] == role
        assert eng["resources"]["limits"][TPU] == "4" and eng["resources"]["requests"][TPU] == "4"
        env = env_of(eng)
        assert env["PYTHONHASHSEED"] == "0"
        assert env["TPUSYNC_CONTROL_SOCKET"] == "/run/tpusync/control.sock"
        assert "envFrom" not in eng      # every variable the engine gets is one a process reads
        side = container(spec, "tpusync-sidecar", init=True)
        assert side["restartPolicy"] == "Always"       # native sidecar
        assert f"--dram-bytes={4 * 2**30}" in side["args"]
        assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "e2e-v6e-2x2",
                                        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                        "cloud.google.com/gke-tpu-topology": "2x2"}
        assert {"key": TPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        proxies = [c for c in spec["initContainers"] if c["name"] == "routing-proxy"]
        assert len(proxies) == (1 if role == "decode" else 0)
        # The pods really run on the pool's TPU hosts (kwok made them Ready).
        pods = items(cluster, "pods", ns, f"tpusync.dev/serving={REF},tpusync.dev/role={role}")
        assert len(pods) == 1 and pods[0]["spec"]["nodeName"].startswith("gke-e2e-v6e-2x2-")
        assert conditions(pods[0])["Ready"]["status"] == "True"

    ipool = get(cluster, "inferencepool", ns, REF)
    assert ipool["spec"]["selector"]["matchLabels"] == {"tpusync.dev/serving": REF,
                                                         "llm-d.ai/inference-serving": "true"}
    assert ipool["spec"]["endpointPickerRef"]["name"] == f"{REF}-epp"
    route = get(cluster, "httproute", ns, REF)
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gw"
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": REF, "weight": 1}
    cfg = yaml.safe_load(get(cluster, "configmap", ns, f"{REF}-epp")["data"]["config.yaml"])
    assert cfg["kind"] == "EndpointPickerConfig"
    decider = [p for p in cfg["plugins"] if p["type"] == "prefix-based-pd-decider"]
    assert decider[0]["parameters"]["nonCachedTokens"] == 32
    epp = get(cluster, "deployment", ns, f"{REF}-epp")
    assert epp["spec"]["replicas"] == 2   # kwok makes both ready; on a node only the leader is
    # The pool now also counts the serving pods' sidecars.
    pool = wait_for("pool capacity with the serving's sidecars", lambda: (
        lambda p: p if p["status"]["readySidecars"] == 4 else None)(
            get(cluster, "tpusyncpool", ns, POOL)), CONVERGE)
    assert pool["status"]["dramBytes"] == 2 * 32 * 2**30 + 2 * 4 * 2**30
    assert operator.metric("tpusync_operator_object_ready", kind="DisaggregatedServing",
                           namespace=ns, name=REF) == 1.0


def test_router_survives_losing_an_endpoint_picker(cluster, ref, module_namespace):
    """The endpoint picker as llm-d runs it for HA: two replicas under the router's leader
    election, each on a node of its own (the real scheduler keeps them apart). kwok runs no
    router, so both report ready here where on a cluster only the leader does; the serving needs
    one. Deleting a replica leaves the serving Ready, its Ready condition never flipping, and
    a ready pod behind the picker's Service at every look until the replacement runs (the pods
    its EndpointSlice would list: this harness's pod IPs are loopback addresses, which
    EndpointSlices refuse). The picker's ServiceAccount may take its own Lease and no other."""
    ns = module_namespace
    selector = f"tpusync.dev/serving={REF},app.kubernetes.io/component=endpoint-picker"
    pods = items(cluster, "pods", ns, selector)
    assert len(pods) == 2 and len({p["spec"]["nodeName"] for p in pods}) == 2
    args = container(pods[0]["spec"], "epp")["args"]
    assert "--ha-enable-leader-election=true" in args

    account = f"--as=system:serviceaccount:{ns}:{REF}-epp"

    def can(verb: str, what: str) -> bool:
        res = cluster.kubectl("auth", "can-i", verb, what, "-n", ns, account, check=False)
        return res.stdout.strip() == "yes"
    lease = f"leases.coordination.k8s.io/epp-{ns}-{REF}.llm-d.ai"
    assert can("create", "leases.coordination.k8s.io") and can("get", lease) and can("update", lease)
    assert not can("update", "leases.coordination.k8s.io/another-lease") and not can("delete", lease)
    assert not can("list", "leases.coordination.k8s.io")

    ready_since = conditions(get(cluster, "disaggregatedservings", ns, REF))["Ready"]["lastTransitionTime"]
    victim = pods[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
    service_selector = ",".join(f"{k}={v}" for k, v in
                                get(cluster, "service", ns, f"{REF}-epp")["spec"]["selector"].items())
    looks: list[tuple[str, bool, int]] = []   # (serving Ready, routingReady, ready pods behind the Service)

    def serving(pod: dict) -> bool:
        return "deletionTimestamp" not in pod["metadata"] and conditions(pod).get("Ready", {}).get("status") == "True"

    def replaced() -> bool:
        ds = get(cluster, "disaggregatedservings", ns, REF)
        behind = [p for p in items(cluster, "pods", ns, service_selector) if serving(p)]
        looks.append((conditions(ds)["Ready"]["status"], ds["status"]["routingReady"], len(behind)))
        now = items(cluster, "pods", ns, selector)
        return (len(now) == 2 and victim not in {p["metadata"]["name"] for p in now}
                and all(serving(p) for p in now))
    wait_for("a replacement endpoint picker", replaced, CONVERGE, interval=0.2)
    assert looks and all(look == ("True", True, look[2]) and look[2] >= 1 for look in looks), looks
    ds = get(cluster, "disaggregatedservings", ns, REF)
    assert conditions(ds)["Ready"]["lastTransitionTime"] == ready_since
    assert len({p["spec"]["nodeName"] for p in items(cluster, "pods", ns, selector)}) == 2


def test_active_active_pickers_are_evicted_one_at_a_time(cluster, ref, module_namespace):
    """ActiveActive: every replica routes, and their PodDisruptionBudget lets the eviction API
    (what a node drain and a GKE upgrade call) take one at a time: with one replica gone and its
    replacement unable to schedule, the API server refuses to evict the other."""
    ns = module_namespace
    cluster.kubectl("patch", "disaggregatedservings", REF, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"routing": {"eppHighAvailability": "ActiveActive"}}}))
    selector = f"tpusync.dev/serving={REF},app.kubernetes.io/component=endpoint-picker"

    def settled():
        pdb = get(cluster, "poddisruptionbudget", ns, f"{REF}-epp")
        pods = items(cluster, "pods", ns, selector)
        rolled = all("--ha-enable-leader-election=true" not in container(p["spec"], "epp")["args"]
                     and conditions(p).get("Ready", {}).get("status") == "True" for p in pods)
        return pdb if (pdb and len(pods) == 2 and rolled
                       and pdb["status"].get("disruptionsAllowed") == 1) else None
    pdb = wait_for("the pickers rolled to active-active under their budget", settled, CONVERGE)
    assert pdb["spec"]["maxUnavailable"] == 1
    pods = items(cluster, "pods", ns, selector)
    nodes = [p["spec"]["nodeName"] for p in pods]
    cluster.kubectl("cordon", *nodes)
    try:
        def evict(pod: dict):
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": pod["metadata"]["name"], "namespace": ns}}
            return cluster.kubectl("create", "--raw",
                                   f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/eviction",
                                   "-f", "-", input=json.dumps(body), check=False)
        first = evict(pods[0])
        assert first.returncode == 0, first.stderr
        wait_for("the budget spent", lambda: get(cluster, "poddisruptionbudget", ns, f"{REF}-epp")[
            "status"].get("disruptionsAllowed") == 0, CONVERGE)
        second = evict(pods[1])
        assert second.returncode != 0 and "disruption budget" in second.stderr, second.stderr
    finally:
        cluster.kubectl("uncordon", *nodes)
    wait_for("both pickers back", lambda: len([p for p in items(cluster, "pods", ns, selector)
                                               if conditions(p).get("Ready", {}).get("status") == "True"]) == 2,
             CONVERGE)
    cluster.kubectl("patch", "disaggregatedservings", REF, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"routing": {"eppHighAvailability": "ActivePassive"}}}))
    wait_for("the budget pruned with ActivePassive",
             lambda: get(cluster, "poddisruptionbudget", ns, f"{REF}-epp") is None, CONVERGE)
    wait_condition(cluster, "disaggregatedservings", ns, REF)


def test_serving_vllm_tpu(cluster, vllm, module_namespace):
    ns, ds = module_namespace, vllm
    assert ds["status"]["endpoint"] == f"http://{VLLM}-decode.{ns}.svc:8000"
    assert get(cluster, "httproute", ns, VLLM) is None     # no gatewayRef
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        spec = get(cluster, "deployment", ns, f"{VLLM}-{role}")["spec"]["template"]["spec"]
        eng = container(spec, "engine")
        assert eng["command"] == ["vllm", "serve"]
        args = eng["args"]
        assert args[0] == "Qwen/Qwen3-0.6B"      # the repo id of hf://Qwen/Qwen3-0.6B: what vLLM loads
        # 2x2x1 v7x: 4 chips of 2 TensorCores; tpu-inference's tensor parallelism counts TensorCores
        assert args[args.index("--tensor-parallel-size") + 1] == "8"
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "TPUConnector" and kv["kv_role"] == kv_role
        assert kv["kv_connector_module_path"] == "tpusync.tpu_inference.connector"
        assert eng["resources"]["limits"][TPU] == "4"
        # spec.engine.securityContext over the operator's root default, on the API server's object
        sc = eng["securityContext"]
        assert (sc["runAsUser"], sc["runAsNonRoot"], sc["capabilities"]) == (65532, True, {"drop": ["ALL"]}), sc
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
        assert spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
        container(spec, "tpusync-sidecar", init=True)
    cfg = yaml.safe_load(get(cluster, "configmap", ns, f"{VLLM}-epp")["data"]["config.yaml"])
    assert "approx-prefix-cache-producer" in {p["type"] for p in cfg["plugins"]}
    pods = items(cluster, "pods", ns, f"tpusync.dev/serving={VLLM},llm-d.ai/inference-serving=true")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gke-e2e-tpu7x-0", "gke-e2e-tpu7x-1"]


def test_serving_sglang_jax_native_pd(cluster, ref, module_namespace):
    """sglang-jax's own P/D: the real API server accepts the serving, the operator (under the
    chart's RBAC) generates the P/D secret, runs the bootstrap registry, points both roles at
    it, and the serving is Ready once the registry is available. kwok runs no engine: the
    rendered flags were checked against sglang-jax's own ServerArgs (docs/operator.md)."""
    ns, name = module_namespace, "sg"
    obj = serving_obj(ns, name, engine={"type": "sglang-jax", "image": "registry.example/sglang-jax:main"},
                      pool=POOL, routing={"precisePrefixCache": False})
    obj["spec"]["kvTransfer"] = {"connector": "sglang-jax"}
    apply(cluster, obj)
    wait_condition(cluster, "disaggregatedservings", ns, name)
    boot = get(cluster, "deployment", ns, f"{name}-pd-bootstrap")
    assert boot["status"]["availableReplicas"] == 1
    secret = get(cluster, "secret", ns, f"{name}-pd-secret")
    assert len(base64.b64decode(secret["data"]["secret"])) == 64        # 32 random bytes, hex
    url = f"http://{name}-pd-bootstrap.{ns}.svc:8998"
    for role in ("prefill", "decode"):
        eng = container(get(cluster, "deployment", ns, f"{name}-{role}")["spec"]["template"]["spec"], "engine")
        args = eng["args"]
        assert args[args.index("--disaggregation-mode") + 1] == role
        assert args[args.index("--disaggregation-bootstrap-url") + 1] == url
        assert {"name": "SGL_JAX_PD_SHARED_SECRET",
                "valueFrom": {"secretKeyRef": {"name": f"{name}-pd-secret", "key": "secret"}}} in eng["env"]
    # Deleting it frees its TPU hosts and takes its registry and secret.
    cluster.kubectl("delete", "disaggregatedservings", name, "-n", ns, "--timeout=60s", timeout=90)
    wait_for("garbage collection of the sglang-jax serving", lambda: not any(
        get(cluster, kind, ns, f"{name}{suffix}") for kind, suffix in (
            ("deployment", "-pd-bootstrap"), ("service", "-pd-bootstrap"), ("secret", "-pd-secret"),
            ("deployment", "-decode"))), CONVERGE, interval=1)


def test_units_scale_prefill_and_decode_together(cluster, ref, module_namespace):
    """spec.replicas counts units of the serving (one prefill and one decode replica each, on the
    pool's four free hosts): `kubectl scale` and a HorizontalPodAutoscaler move it through the
    /scale subresource, and the operator scales both roles, holding the ratio within the bounds
    (prefill at most 1 for the autoscaler). The real kube-controller-manager's HPA controller
    raises it to its minReplicas (it scales below that bound without asking any metric, and no
    metrics API runs here). The pool's four hosts beside ref's two hold three decodes and a prefill."""
    ns = module_namespace
    name = "sc"
    apply(cluster, serving_obj(ns, name, engine={"type": "reference"}, pool=POOL, routing={"enabled": False}))

    def roles_at(units: int, prefill: int, decode: int) -> dict:
        want = ({"kind": "Deployment", "replicas": prefill, "readyReplicas": prefill},
                {"kind": "Deployment", "replicas": decode, "readyReplicas": decode})

        def check() -> dict | None:
            d = get(cluster, "disaggregatedservings", ns, name)
            ready = conditions(d).get("Ready") or {}
            st = d.get("status") or {}
            return d if (ready.get("status") == "True"
                         and ready.get("observedGeneration") == d["metadata"]["generation"]
                         and st.get("replicas") == units
                         and (st.get("prefill"), st.get("decode")) == want) else None
        return wait_for(f"{name} at {units} units: prefill {prefill}, decode {decode}", check, CONVERGE,
                        on_timeout=lambda: json.dumps(get(cluster, "disaggregatedservings", ns, name).get("status")))

    roles_at(1, 1, 1)
    cluster.kubectl("scale", "disaggregatedservings", name, "-n", ns, "--replicas=2")
    ds = roles_at(2, 2, 2)
    assert get(cluster, "deployment", ns, f"{name}-decode")["spec"]["replicas"] == 2
    scale = json.loads(cluster.kubectl(
        "get", "--raw", f"/apis/{API}/namespaces/{ns}/disaggregatedservings/{name}/scale").stdout)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == ds["status"]["selector"]
    cluster.kubectl("scale", "disaggregatedservings", name, "-n", ns, "--replicas=1")
    roles_at(1, 1, 1)

    cluster.kubectl("patch", "disaggregatedservings", name, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"prefill": {"maxReplicas": 1}}}))
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"scaleTargetRef": {"apiVersion": API, "kind": "DisaggregatedServing", "name": name},
                    "minReplicas": 3, "maxReplicas": 4,
                    "metrics": [{"type": "Resource", "resource": {
                        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}}
    apply(cluster, hpa)
    roles_at(3, 1, 3)   # prefill held at its maxReplicas
    got = get(cluster, "horizontalpodautoscaler", ns, name)
    assert got["status"]["desiredReplicas"] == 3, got["status"]
    cluster.kubectl("delete", "horizontalpodautoscaler", name, "-n", ns)
    cluster.kubectl("delete", "disaggregatedservings", name, "-n", ns, "--timeout=60s", timeout=90)
    wait_for(f"{name}'s pods gone", lambda: not items(cluster, "pods", ns, f"tpusync.dev/serving={name}"),
             CONVERGE, interval=1)


# ----- update and drift ---------------------------------------------------------------------

def test_update_scale_decode_and_scorer_weights(cluster, ref, module_namespace):
    ns = module_namespace
    epp_before = get(cluster, "deployment", ns, f"{REF}-epp")
    hash_before = epp_before["spec"]["template"]["metadata"]["annotations"]["tpusync.dev/epp-config-hash"]
    generation = get(cluster, "disaggregatedservings", ns, REF)["metadata"]["generation"]
    cluster.kubectl("patch", "disaggregatedservings", REF, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"decode": {"replicas": 3},
                                         "routing": {"scorerWeights": {"prefixCache": 5,
                                                                       "queue": 0}}}}))
    ds = wait_condition(cluster, "disaggregatedservings", ns, REF)
    assert ds["metadata"]["generation"] == generation + 1 == ds["status"]["observedGeneration"]
    assert ds["status"]["decode"] == {"kind": "Deployment", "replicas": 3, "readyReplicas": 3}
    assert get(cluster, "deployment", ns, f"{REF}-decode")["spec"]["replicas"] == 3
    pods = items(cluster, "pods", ns, f"tpusync.dev/serving={REF},tpusync.dev/role=decode")
    assert len(pods) == 3 and len({p["spec"]["nodeName"] for p in pods}) == 3   # 4 chips each
    cfg = yaml.safe_load(get(cluster, "configmap", ns, f"{REF}-epp")["data"]["config.yaml"])
    for profile in cfg["schedulingProfiles"]:
        weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
        assert weights["prefix-cache-scorer"] == 5
        assert "queue-scorer" not in weights              # weight 0 drops the scorer
        assert weights["kv-cache-utilization-scorer"] == 1
    epp = get(cluster, "deployment", ns, f"{REF}-epp")
    assert epp["spec"]["template"]["metadata"]["annotations"]["tpusync.dev/epp-config-hash"] != hash_before


def test_drift_is_repaired(cluster, ref, module_namespace):
    ns = module_namespace
    old_cm = get(cluster, "configmap", ns, f"{REF}-epp")
    cluster.kubectl("delete", "configmap", f"{REF}-epp", "-n", ns)
    cluster.kubectl("delete", "networkpolicy", f"{REF}-serving", "-n", ns)
    # Edit fields the operator manages, as another field manager would.
    cluster.kubectl("scale", "deployment", f"{REF}-prefill", "-n", ns, "--replicas=2")
    cluster.kubectl("patch", "service", f"{REF}-decode", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"selector": {"tpusync.dev/role": "prefill"}}}))
    cluster.kubectl("patch", "service", f"{POOL}-peers", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"publishNotReadyAddresses": False}}))

    def repaired():
        cm = get(cluster, "configmap", ns, f"{REF}-epp")
        np_ = get(cluster, "networkpolicy", ns, f"{REF}-serving")
        dep = get(cluster, "deployment", ns, f"{REF}-prefill")
        svc = get(cluster, "service", ns, f"{REF}-decode")
        peers = get(cluster, "service", ns, f"{POOL}-peers")
        return (cm is not None and cm["metadata"]["uid"] != old_cm["metadata"]["uid"]
                and cm["data"] == old_cm["data"] and np_ is not None
                and dep["spec"]["replicas"] == 1
                and svc["spec"]["selector"]["tpusync.dev/role"] == "decode"
                and peers["spec"]["publishNotReadyAddresses"] is True)
    wait_for("drift repaired by the passes its events trigger", repaired, CONVERGE, interval=0.5)
    wait_condition(cluster, "disaggregatedservings", ns, REF)
    wait_for("prefill back to one pod", lambda: len(items(
        cluster, "pods", ns, f"tpusync.dev/serving={REF},tpusync.dev/role=prefill")) == 1, CONVERGE)


# ----- restart, missing CRD ----------------------------------------------------------------

def test_operator_restart_mid_reconcile(cluster, operator, ref, module_namespace):
    """SIGKILL the operator while it is creating a serving's children, start it again: the
    serving converges with exactly one of each child, the pool's generated Secret is not
    rotated, and no workload was rolled by the second pass."""
    starts = operator.starts
    ns = module_namespace
    name = "rst"
    token_before = get(cluster, "secret", ns, f"{POOL}-auth")["data"]["token"]
    apply(cluster, serving_obj(ns, name, engine={"type": "reference"}, pool=POOL, decode=1))
    wait_for("the first child of the new serving", lambda: get(
        cluster, "deployment", ns, f"{name}-prefill"), 30, interval=0.05)
    operator.kill()
    assert not operator.alive()
    half = {kind + suffix: get(cluster, kind, ns, name + suffix) is not None
            for kind, suffix in SERVING_CHILDREN}
    operator.start()
    ds = wait_condition(cluster, "disaggregatedservings", ns, name)
    for kind, suffix in SERVING_CHILDREN:
        assert get(cluster, kind, ns, name + suffix) is not None, (kind, suffix, half)
    deps = items(cluster, "deployments", ns, f"tpusync.dev/serving={name}")
    assert sorted(d["metadata"]["name"] for d in deps) == [f"{name}-decode", f"{name}-epp",
                                                           f"{name}-prefill"]
    for d in deps:
        rs = [r for r in items(cluster, "replicasets", ns)
              if any(o["uid"] == d["metadata"]["uid"] for o in r["metadata"].get("ownerReferences", []))]
        assert len(rs) == 1, (d["metadata"]["name"], [r["metadata"]["name"] for r in rs])
        assert d["metadata"]["generation"] == 1, d["metadata"]["name"]   # not re-rolled
    pods = items(cluster, "pods", ns, f"tpusync.dev/serving={name},llm-d.ai/inference-serving=true")
    assert len(pods) == 2
    assert get(cluster, "secret", ns, f"{POOL}-auth")["data"]["token"] == token_before
    assert ds["status"]["prefill"]["readyReplicas"] == 1
    # The earlier objects were resumed by the new process and are still Ready.
    wait_condition(cluster, "disaggregatedservings", ns, REF)
    wait_condition(cluster, "tpusyncpool", ns, POOL)
    assert operator.starts == starts + 1
    cluster.kubectl("delete", "disaggregatedservings", name, "-n", ns, "--timeout=60s", timeout=90)
    wait_for(f"{name}'s pods gone", lambda: not items(cluster, "pods", ns, f"tpusync.dev/serving={name}"),
             CONVERGE, interval=1)


def test_missing_optional_crd_degrades_then_recovers(cluster, operator, vllm, module_namespace):
    """Without the InferencePool CRD the serving reports Degraded/MissingCRD naming it,
    keeps the rest applied, and converges by itself once the CRD is installed: the CRD's
    event triggers a pass, and a pass that still finds it unserved is retried in 60 s (no
    restart, no crash loop)."""
    ns, starts = module_namespace, operator.starts
    crd_file = cluster.crd_dir / "inference.networking.k8s.io_inferencepools.yaml"
    cluster.kubectl("delete", "crd", "inferencepools.inference.networking.k8s.io", "--wait=true",
                    timeout=120)
    try:
        ds = wait_condition(cluster, "disaggregatedservings", ns, VLLM, "Degraded", "True",
                            reason="MissingCRD")
        msg = conditions(ds)["Degraded"]["message"]
        assert "InferencePool (inferencepools.inference.networking.k8s.io)" in msg, msg
        assert conditions(ds)["Ready"]["status"] == "False"
        assert ds["status"]["routingReady"] is False
        # The rest is still there and owned (the pass applied it; nothing was pruned).
        for kind, suffix in SERVING_CHILDREN[:-2]:
            assert get(cluster, kind, ns, VLLM + suffix) is not None, (kind, suffix)
        assert operator.alive()
        # Events follow the status write: wait for it rather than read once.
        wait_for("the MissingCRD event", lambda: any(
            e["reason"] == "MissingCRD" and e["involvedObject"]["name"] == VLLM
            for e in items(cluster, "events", ns)), 30)
    finally:
        cluster.install_crds([crd_file])
    ds = wait_condition(cluster, "disaggregatedservings", ns, VLLM, timeout=CONVERGE)
    assert ds["status"]["routingReady"] is True
    assert conditions(ds)["Degraded"]["status"] == "False"
    ipool = get(cluster, "inferencepool", ns, VLLM)
    assert ipool is not None and owned_by(ipool, ds)
    assert operator.starts == starts      # recovered without a restart


# ----- delete -------------------------------------------------------------------------------

def test_delete_garbage_collects_children(cluster, operator, ref, vllm, module_namespace):
    ns = module_namespace
    for ds in (ref, vllm):
        assert FINALIZER not in ds["metadata"].get("finalizers", [])
    # No finalizer: the objects are gone at once, and the garbage collector takes their children.
    cluster.kubectl("delete", "disaggregatedservings", REF, VLLM, "-n", ns, "--timeout=60s", timeout=90)
    assert items(cluster, "disaggregatedservings", ns) == []

    def serving_children_left():
        left = []
        for kind in ("deployments", "replicasets", "pods", "services", "configmaps",
                     "networkpolicies", "roles", "rolebindings", "inferencepools",
                     "inferenceobjectives.llm-d.ai", "httproutes"):
            left += [f"{kind}/{o['metadata']['name']}" for o in items(cluster, kind, ns)
                     if o["metadata"]["name"].startswith((REF, VLLM))]
        left += [f"serviceaccounts/{o['metadata']['name']}" for o in items(
            cluster, "serviceaccounts", ns) if o["metadata"]["name"].endswith("-epp")]
        return left
    wait_for("garbage collection of the servings' children", lambda: not serving_children_left(),
             CONVERGE, interval=1, on_timeout=lambda: f"\nleft: {serving_children_left()}")

    cluster.kubectl("delete", "tpusyncpools", POOL, POOL7, "-n", ns, "--timeout=60s", timeout=90)
    assert items(cluster, "tpusyncpools", ns) == []

    def pool_children_left():
        return [f"{kind}/{o['metadata']['name']}"
                for kind in ("statefulsets", "pods", "services", "configmaps", "secrets",
                             "networkpolicies")
                for o in items(cluster, kind, ns) if o["metadata"]["name"].startswith(POOL)]
    wait_for("garbage collection of the pools' children", lambda: not pool_children_left(),
             CONVERGE, interval=1, on_timeout=lambda: f"\nleft: {pool_children_left()}")
    assert operator.alive()
    assert "Forbidden" not in operator.log_text(), [
        line for line in operator.log_text().splitlines() if "Forbidden" in line][:5]


def test_no_unexpected_errors_in_operator_log(operator):
    """No handler raised an unexpected exception in the whole module: retries are expected
    (the missing CRD), tracebacks are not."""
    log = operator.log_text()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000):][:4000]
