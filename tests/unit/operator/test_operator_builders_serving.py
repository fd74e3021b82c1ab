"""Serving and llm-d builders: golden YAML per case plus targeted invariants."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from op_helpers import PoolBody, ServingBody, assert_golden

from tpusync_operator import versions
from tpusync_operator.builders import llmd
from tpusync_operator.builders.common import Owner, pod_templates
from tpusync_operator.builders.serving import PoolInfo, engine_port, unit_pod_labels
from tpusync_operator.builders.sidecar import disk_tier_bytes
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.pool_plan import PlanError
from tpusync_operator.serving_plan import plan_serving
from tpusync_operator.tpu import slice_for

ALL = {"LeaderWorkerSet", "DisaggregatedSet", "InferencePool", "InferenceObjective", "HTTPRoute"}


def pool_info(body):
    spec = TPUSyncPoolSpec.model_validate(body["spec"])
    return PoolInfo(body["metadata"]["name"], spec, slice_for(spec.tpu.type, spec.tpu.topology))


def plan(serving, pool, available=ALL, role_pools=None):
    body = serving.build()
    return plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]),
                        pool_info(pool.build()), set(available),
                        {role: pool_info(p.build()) for role, p in (role_pools or {}).items()})


CASES = {
    "serving-reference-v6e": (ServingBody(), PoolBody()),
    "serving-reference-cpu-only": (ServingBody().spec(engine={"cpuOnly": True}, routing={"enabled": False}),
                                   PoolBody()),
    "serving-vllm-v7x-lws-gateway": (
        ServingBody().spec(engine={"type": "vllm-tpu"}, prefill={"replicas": 2, "args": ["--x"]},
                           prefixCache={"hostDram": "8Gi", "disk": "50Gi"},
                           routing={"gatewayRef": {"name": "gw", "namespace": "gw-ns"}}),
        PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")),
    "serving-sglang-jax-pd": (
        ServingBody().spec(engine={"type": "sglang-jax", "image": "registry.example/sglang-jax:main"},
                           kvTransfer={"connector": "sglang-jax"},
                           routing={"precisePrefixCache": False,
                                                                   "scorerWeights": {"queue": 0}}),
        PoolBody()),
    "serving-vllm-v6e-lockstep": (
        ServingBody().spec(engine={"type": "vllm-tpu"}, replicas=2, decode={"replicas": 2},
                           rollout={"strategy": "Lockstep", "maxSurge": 1, "maxUnavailable": 0}),
        PoolBody().spec(capacity={"hosts": 8})),
    "serving-vllm-v7x-prefill-v6e-decode": (
        ServingBody().spec(engine={"type": "vllm-tpu"}, decode={"poolRef": {"name": "v6e"}}),
        PoolBody().v7x().spec(auth={"secretName": "kv-auth"})),
}
# The pools of roles that name their own (spec.<role>.poolRef).
ROLE_POOLS = {
    "serving-vllm-v7x-prefill-v6e-decode": {
        "decode": PoolBody("v6e").spec(tpu={"topology": "2x2"}, auth={"secretName": "kv-auth"},
                                       provisioning={"existing": {"nodePoolName": "v6e-np"}})},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_serving_children_golden(case):
    serving, pool = CASES[case]
    p = plan(serving, pool, role_pools=ROLE_POOLS.get(case))
    assert_golden(case, p.apply)


def _pods(objs):
    for o in objs:
        if o["kind"] in ("LeaderWorkerSet", "DisaggregatedSet") or (
                o["kind"] == "Deployment" and o["metadata"]["name"].endswith(("prefill", "decode"))):
            yield from pod_templates(o)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_run_restricted_with_native_sidecar(case):
    """Every container but a TPU engine fits the restricted Pod Security Standard; a TPU engine
    runs as root, not privileged (test_tpu_engines_run_as_gke_documents), so its pod fits baseline."""
    serving, pool = CASES[case]
    pods = list(_pods(plan(serving, pool, role_pools=ROLE_POOLS.get(case)).apply))
    assert pods
    for name, tpl in pods:
        spec = tpl["spec"]
        sidecar = spec["initContainers"][0]
        assert sidecar["name"] == "tpusync-sidecar" and sidecar["restartPolicy"] == "Always", name
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["initContainers"] + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert "privileged" not in sc or sc["privileged"] is False
            tpu_engine = c["name"] == "engine" and "google.com/tpu" in c.get("resources", {}).get("limits", {})
            if tpu_engine:
                assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}, (name, c["name"])
            else:
                assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
                assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 65532) != 0, (name, c["name"])
        assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
        shm = next(v for v in spec["volumes"] if v["name"] == "tpusync-shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert not any("hostPath" in v for v in spec["volumes"])
        engine = spec["containers"][0]
        assert {"name": "tpusync-shm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
        assert {"name": "tpusync-shm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]


def _selected_pods(objs, selector):
    """How many pods the workloads in objs run that carry every label of selector: a
    Deployment's template times its replicas; per LeaderWorkerSet group (a DisaggregatedSet
    role's too) its leader and size - 1 workers."""
    def matches(tpl):
        labels = tpl["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in selector.items())
    count = 0
    for o in objs:
        if o["kind"] == "Deployment":
            count += o["spec"]["replicas"] * matches(o["spec"]["template"])
        groups = [o["spec"]] if o["kind"] == "LeaderWorkerSet" else \
            [r["spec"] for r in o["spec"]["roles"]] if o["kind"] == "DisaggregatedSet" else []
        for g in groups:
            lwt = g["leaderWorkerTemplate"]
            leader = matches(lwt.get("leaderTemplate", lwt["workerTemplate"]))
            workers = (lwt["size"] - 1) * matches(lwt["workerTemplate"])
            count += g["replicas"] * (leader + workers)
    return count


@pytest.mark.parametrize(("units", "roles", "pool"), [
    (3, {}, PoolBody().spec(capacity={"hosts": 6})),
    (2, {"prefill": {"replicas": 2}}, PoolBody().spec(capacity={"hosts": 6})),
    (2, {"decode": {"replicas": 3}}, PoolBody().spec(capacity={"hosts": 8})),
    (4, {"prefill": {"replicas": 0}}, PoolBody().spec(capacity={"hosts": 4})),
    (2, {"engine": {"type": "vllm-tpu"}, "decode": {"replicas": 2}}, PoolBody().v7x("2x2x2")),   # multi-host LWS
    (2, {"engine": {"type": "vllm-tpu"}, "decode": {"replicas": 2},
         "rollout": {"strategy": "Lockstep"}}, PoolBody().spec(capacity={"hosts": 8})),
])
def test_scale_selector_selects_one_pod_per_unit(units, roles, pool):
    """The HPA scales a /scale target to ceil(usage ratio x the pods status.selector selects)
    (k8s.io/kubernetes pkg/controller/podautoscaler/replica_calculator.go): it must select one
    pod per unit, not every engine pod, as LWS selects one per group (its leader)."""
    serving = ServingBody().spec(replicas=units, routing={"enabled": False}, **roles)
    body = serving.build()
    labels = unit_pod_labels(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]))
    assert _selected_pods(plan(serving, pool).apply, labels) == units


def test_llmd_labels_only_on_serving_pods():
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    pods = dict(_pods(plan(serving, pool).apply))
    leader = pods["llm-decode-leader"]["metadata"]["labels"]
    worker = pods["llm-decode-worker"]["metadata"]["labels"]
    assert leader["llm-d.ai/role"] == "decode" and leader["llm-d.ai/inference-serving"] == "true"
    assert "llm-d.ai/role" not in worker and "llm-d.ai/inference-serving" not in worker
    assert leader["tpusync.dev/pool"] == worker["tpusync.dev/pool"] == "pool"
    # routing proxy on decode leaders only
    init = pods["llm-decode-leader"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["tpusync-sidecar", "routing-proxy"]
    assert [c["name"] for c in pods["llm-decode-worker"]["spec"]["initContainers"]] == ["tpusync-sidecar"]
    assert [c["name"] for c in pods["llm-prefill-leader"]["spec"]["initContainers"]] == ["tpusync-sidecar"]


def test_tpu_requests_and_selectors():
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    pods = dict(_pods(plan(serving, pool).apply))
    spec = pods["llm-prefill-leader"]["spec"]
    assert spec["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "pool",
                                    "cloud.google.com/gke-tpu-accelerator": "tpu7x",
                                    "cloud.google.com/gke-tpu-topology": "2x2x2"}
    assert spec["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    cpu = dict(_pods(plan(*CASES["serving-reference-cpu-only"]).apply))["llm-prefill"]["spec"]
    assert "resources" not in cpu["containers"][0] and "tolerations" not in cpu
    assert cpu["nodeSelector"] == {"cloud.google.com/gke-nodepool": "tpu-np"}


def test_vllm_kv_transfer_config():
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    pods = dict(_pods(plan(serving, pool).apply))
    args = pods["llm-prefill-leader"]["spec"]["containers"][0]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    # vLLM on TPU: tpusync's connector for tpu-inference, under the one name its platform accepts.
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == ("TPUConnector", "tpusync.tpu_inference.connector")
    assert kv["kv_connector"] in versions.TPU_INFERENCE.values["connector_names"]
    # The engine image carries tpusync (upstream's vllm-tpu has no tpusync to load the connector from).
    assert pods["llm-prefill-leader"]["spec"]["containers"][0]["image"] == versions.VLLM_TPU_IMAGE
    assert kv["kv_role"] == "kv_producer"
    # The prefill engine advertises its sidecar's data port to decode engines.
    assert kv["kv_connector_extra_config"]["data_address"] == "$(POD_IP):7600"
    assert kv["kv_load_failure_policy"] == "recompute"
    # 2x2x2 v7x: 8 chips of 2 TensorCores each; tensor parallelism counts TensorCores.
    assert args[args.index("--tensor-parallel-size") + 1] == "16"
    assert args[-1] == "--x"
    dargs = pods["llm-decode-leader"]["spec"]["containers"][0]["args"]
    assert json.loads(dargs[dargs.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert dargs[dargs.index("--port") + 1] == "8200"
    # KV events for precise prefix-cache routing, on the pool's port, where the connector relays
    # vLLM's in-process publisher beside its own; the topic names the pod as llm-d routes to it:
    # the serving port (8000), not the engine's behind the routing proxy
    events = json.loads(dargs[dargs.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "inproc://tpusync-vllm-kv-events",
                      "topic": "kv@$(POD_IP):8000@m"}
    dkv = json.loads(dargs[dargs.index("--kv-transfer-config") + 1])
    assert dkv["kv_connector_extra_config"]["kv_events_endpoint"] == "tcp://*:5557"
    env = {e["name"] for e in pods["llm-decode-leader"]["spec"]["containers"][0]["env"]}
    assert "POD_IP" in env   # what $(POD_IP) expands from


def test_engine_port_behind_proxy():
    spec = DisaggregatedServingSpec.model_validate(ServingBody().build()["spec"])
    assert engine_port(spec, "prefill") == 8000 and engine_port(spec, "decode") == 8200
    spec = DisaggregatedServingSpec.model_validate(ServingBody().spec(port=8200).build()["spec"])
    assert engine_port(spec, "decode") == 8201


def test_sidecar_tier_sizes_follow_prefix_cache():
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    tpl = dict(_pods(plan(serving, pool).apply))["llm-prefill-leader"]
    args = tpl["spec"]["initContainers"][0]["args"]
    assert "--dram-bytes=8589934592" in args and f"--disk-bytes={disk_tier_bytes(50 * 2**30, 2**20)}" in args
    assert tpl["metadata"]["annotations"]["tpusync.dev/dram-bytes"] == "8589934592"


def _owner_spec(serving):
    body = serving.build()
    return Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"])


def test_epp_config_pd_and_precise_prefix_cache():
    owner, spec = _owner_spec(ServingBody().spec(routing={"pdThresholdTokens": 77}))
    cfg = llmd.build_epp_config(owner, spec, 5557)
    assert cfg["apiVersion"] == "llm-d.ai/v1alpha1" and cfg["kind"] == "EndpointPickerConfig"
    by_type = {p["type"]: p for p in cfg["plugins"]}
    assert by_type["prefix-based-pd-decider"]["parameters"] == {"nonCachedTokens": 77}
    assert by_type["disagg-profile-handler"]["parameters"] == {"deciders": {"prefill": "prefix-based-pd-decider"}}
    kv = by_type["precise-prefix-cache-producer"]["parameters"]["kvEventsConfig"]
    assert kv["podDiscoveryConfig"]["socketPort"] == 5557
    # the port the engines publish on is the pool's, whatever it is
    other = llmd.build_epp_config(owner, spec, 6000)["plugins"]
    assert next(p for p in other if p["type"] == "precise-prefix-cache-producer")[
        "parameters"]["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 6000
    assert kv["podDiscoveryConfig"]["podLabelSelector"] == "tpusync.dev/serving=llm,llm-d.ai/inference-serving=true"
    assert by_type["prefix-cache-scorer"]["parameters"] == {
        "prefixMatchInfoProducerName": "precise-prefix-cache-producer"}
    profiles = {p["name"]: [r["pluginRef"] for r in p["plugins"]] for p in cfg["schedulingProfiles"]}
    assert profiles["prefill"][0] == "prefill-filter" and profiles["decode"][0] == "decode-filter"
    # every pluginRef names a declared plugin (strict decoding upstream)
    declared = set(by_type)
    refs = {r["pluginRef"] for p in cfg["schedulingProfiles"] for r in p["plugins"]}
    refs |= {s["pluginRef"] for s in cfg["dataLayer"]["sources"]}
    refs |= {e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]}
    assert refs <= declared
    assert set(cfg) <= {"apiVersion", "kind", "plugins", "schedulingProfiles", "dataLayer", "featureGates"}


def test_epp_config_approx_and_zero_weight():
    owner, spec = _owner_spec(ServingBody().spec(routing={"precisePrefixCache": False,
                                                          "scorerWeights": {"queue": 0}}))
    cfg = llmd.build_epp_config(owner, spec, 5557)
    types = [p["type"] for p in cfg["plugins"]]
    assert "approx-prefix-cache-producer" in types and "precise-prefix-cache-producer" not in types
    assert "dataLayer" not in cfg
    for profile in cfg["schedulingProfiles"]:
        assert "queue-scorer" not in [r["pluginRef"] for r in profile["plugins"]]


def test_epp_deployment_rolls_on_config_change():
    owner, a = _owner_spec(ServingBody())
    _, b = _owner_spec(ServingBody().spec(routing={"pdThresholdTokens": 5}))
    ha = llmd.build_epp_deployment(owner, a, 5557)["spec"]["template"]["metadata"]["annotations"]
    hb = llmd.build_epp_deployment(owner, b, 5557)["spec"]["template"]["metadata"]["annotations"]
    assert ha != hb
    cm = llmd.build_epp_config_map(owner, a, 5557)
    assert yaml.safe_load(cm["data"]["config.yaml"]) == llmd.build_epp_config(owner, a, 5557)


def _epp(serving):
    owner, spec = _owner_spec(serving)
    deployment = llmd.build_epp_deployment(owner, spec, 5557)
    return owner, spec, deployment, deployment["spec"]["template"]["spec"]


def test_epp_active_passive_by_default_as_the_pinned_router_runs_it():
    owner, spec, deployment, pod = _epp(ServingBody())
    assert deployment["spec"]["replicas"] == 2
    container = pod["containers"][0]
    assert "--ha-enable-leader-election=true" in container["args"]
    assert "--ha-enable-leader-election" in versions.EPP.flags
    # Only the leader answers "readiness": the Service sends ext-proc to it alone.
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    # A standby never turns ready, so a rollout that waits for one could never retire the leader.
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"}}
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti == [{"labelSelector": deployment["spec"]["selector"], "topologyKey": "kubernetes.io/hostname"}]
    rules = llmd.build_epp_role(owner, spec)["rules"]
    lease = [r for r in rules if r["resources"] == ["leases"]]
    assert lease == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                     {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"],
                      "resourceNames": ["epp-ns-llm.llm-d.ai"]}]
    assert not llmd.epp_disruption_budget_wanted(spec)


def test_epp_active_active_routes_on_every_replica_with_a_budget_of_one():
    owner, spec, deployment, pod = _epp(ServingBody().spec(routing={"eppReplicas": 3,
                                                                    "eppHighAvailability": "ActiveActive"}))
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert not any(a.startswith("--ha-enable-leader-election") for a in container["args"])
    assert container["readinessProbe"]["grpc"]["service"] == "inference-extension"
    assert "podAntiAffinity" in pod["affinity"]
    assert not [r for r in llmd.build_epp_role(owner, spec)["rules"] if r["resources"] == ["leases"]]
    assert llmd.epp_disruption_budget_wanted(spec)
    pdb = llmd.build_epp_disruption_budget(owner)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}


def test_one_epp_replica_has_no_election_affinity_or_budget():
    _, spec, deployment, pod = _epp(ServingBody().spec(routing={"eppReplicas": 1,
                                                                    "eppHighAvailability": "ActiveActive"}))
    assert deployment["spec"]["replicas"] == 1 and "affinity" not in pod and "strategy" not in deployment["spec"]
    assert not any(a.startswith("--ha-enable") for a in pod["containers"][0]["args"])
    assert not llmd.epp_disruption_budget_wanted(spec)


def test_the_planner_prunes_the_budget_when_it_is_not_wanted():
    pdb = ("policy/v1", "PodDisruptionBudget", "llm-epp")
    active = plan(ServingBody().spec(routing={"eppHighAvailability": "ActiveActive"}), PoolBody())
    assert pdb in {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in active.apply}
    passive = plan(ServingBody(), PoolBody())
    assert pdb in {(r.api_version, r.kind, r.name) for r in passive.delete}
    assert "PodDisruptionBudget" not in {o["kind"] for o in passive.apply}


def test_inference_pool_and_route():
    owner, spec = _owner_spec(ServingBody().spec(routing={"gatewayRef": {"name": "gw", "sectionName": "http"}}))
    pool = llmd.build_inference_pool(owner, spec)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"] == {
        "matchLabels": {"tpusync.dev/serving": "llm", "llm-d.ai/inference-serving": "true"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "llm-epp", "kind": "Service", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    route = llmd.build_http_route(owner, spec)
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw",
                                            "sectionName": "http"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                                         "kind": "InferencePool", "name": "llm"}]
    obj = llmd.build_inference_objective(owner, spec)
    assert obj["apiVersion"] == "llm-d.ai/v1alpha2" and obj["spec"]["poolRef"]["name"] == "llm"


def test_lws_shape():
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    lws = next(o for o in plan(serving, pool).apply if o["kind"] == "LeaderWorkerSet"
               and o["metadata"]["name"] == "llm-prefill")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"


def test_vllm_tpu_inference_connector():
    """connector tpu-inference: tpu_inference's own TPUConnector with the fix vLLM 0.32 needs
    (tests/tpu_inference/test_tpu_connector.py shows the shipped one decodes wrong tokens); its
    ports are declared."""
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    serving = copy.deepcopy(serving).spec(kvTransfer={"connector": "tpu-inference"})
    c = dict(_pods(plan(serving, pool).apply))["llm-decode-leader"]["spec"]["containers"][0]
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "TPUConnector", "kv_connector_module_path": "tpusync.tpu_inference.upstream_fix",
                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
    events = json.loads(c["args"][c["args"].index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557"  # no tpusync connector to relay it: vLLM binds the pod's port
    assert {p["name"]: p["containerPort"] for p in c["ports"]}.items() >= {"tpu-kv": 9100, "tpu-kv-side": 9600}.items()


def test_vllm_tpu_sync_compatible_connector():
    """connector tpu-sync-compatible: tpu_inference's own upstream-TPU-Sync connector, served by
    tpusync.engines.upstream (tests/tpu_inference/test_upstream_pd.py runs real engines on this config):
    the opt-in, and the sidecar's data port as the port the prefill pod advertises, at the pod IP."""
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    serving = copy.deepcopy(serving).spec(kvTransfer={"connector": "tpu-sync-compatible"})
    c = dict(_pods(plan(serving, pool).apply))["llm-decode-leader"]["spec"]["containers"][0]
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "TPUConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                  "kv_connector_module_path": "tpu_inference.distributed.tpu_raiden_connector"}
    env = [e["name"] for e in c["env"]]
    values = {e["name"]: e.get("value") for e in c["env"]}
    assert values["TPUSYNC_UPSTREAM_API"] == "1" and values["VLLM_HOST_IP"] == "$(POD_IP)"
    assert env.index("POD_IP") < env.index("VLLM_HOST_IP")  # the kubelet expands references to earlier entries
    assert values["TPU_KV_TRANSFER_PORT"] == str(pool_info(pool.build()).spec.sidecar.data_port)


def test_sglang_jax_runs_its_own_pd_against_the_servings_bootstrap():
    """sglang-jax's contract (sglang_pd.py): mode and bootstrap URL per role, transfer and side
    ports published on the pod IP, page size >= 128, no radix cache, the shared secret from
    the serving's Secret, and llm-d's proxy speaking the sglang protocol."""
    serving, pool = CASES["serving-sglang-jax-pd"]
    pods = dict(_pods(plan(serving, pool).apply))
    for role in ("prefill", "decode"):
        spec = pods[f"llm-{role}"]["spec"]
        c = spec["containers"][0]
        a = c["args"]
        flag = {k: a[a.index(k) + 1] for k in ("--disaggregation-mode", "--disaggregation-bootstrap-url",
                                                "--disaggregation-host-ip", "--page-size")}
        assert flag == {"--disaggregation-mode": role,
                        "--disaggregation-bootstrap-url": "http://llm-pd-bootstrap.ns.svc:8998",
                        "--disaggregation-host-ip": "$(POD_IP)", "--page-size": "128"}
        assert "--disable-radix-cache" in a and c["image"] == "registry.example/sglang-jax:main"
        assert {p["name"]: p["containerPort"] for p in c["ports"]}.items() >= {"pd-transfer": 30001,
                                                                              "pd-side": 9600}.items()
        assert {"name": "SGL_JAX_PD_SHARED_SECRET",
                "valueFrom": {"secretKeyRef": {"name": "llm-pd-secret", "key": "secret"}}} in c["env"]
    proxy = next(i for i in pods["llm-decode"]["spec"]["initContainers"] if i["name"] == "routing-proxy")
    assert "--kv-connector=sglang" in proxy["args"]


def _engine(serving, pool=None, name="llm-decode"):
    pods = dict(_pods(plan(serving, pool or PoolBody()).apply))
    key = name if name in pods else name + "-leader"
    return pods[key]["spec"]


@pytest.mark.parametrize("tpu,topology,tp", [("v5e", "2x2", 4), ("v6e", "2x4", 8), ("v7x", "2x2x1", 8),
                                             ("v7x", "2x2x2", 16), ("v6e", "1x1", 1)])
def test_tensor_parallel_counts_tensorcores(tpu, topology, tp):
    """tpu-inference's --tensor-parallel-size is in JAX devices: 1 per chip on v5e/v6e, 2 on v7x."""
    pool = PoolBody().spec(tpu={"type": tpu, "topology": topology})
    if tpu == "v7x":
        pool = pool.gke(workloadPolicy="wp")
    engines = [{"type": "vllm-tpu"}] + ([{"type": "sglang-jax", "image": "r.example/sgl:main"}]
                                        if slice_for(tpu, topology).hosts == 1 else [])   # single-host only
    for engine in engines:
        serving = ServingBody().spec(engine=engine, kvTransfer={"connector": "sglang-jax"}
                                     if engine["type"] == "sglang-jax" else {},
                                     routing={"precisePrefixCache": engine["type"] != "sglang-jax"})
        args = _engine(serving, pool)["containers"][0]["args"]
        flag = "--tensor-parallel-size" if engine["type"] == "vllm-tpu" else "--tp-size"
        assert args[args.index(flag) + 1] == str(tp), (engine, args)


def test_engine_volumes_default_sized_and_separate_from_the_sidecar_tmp():
    spec = _engine(ServingBody())
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["model-weights"] == {"name": "model-weights", "emptyDir": {"sizeLimit": "256Gi"}}
    assert vols["compile-cache"] == {"name": "compile-cache", "emptyDir": {"sizeLimit": "32Gi"}}
    assert vols["engine-tmp"]["emptyDir"]["sizeLimit"] == "2Gi"
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/tmp"] == "engine-tmp" and mounts["/models"] == "model-weights"
    assert mounts["/cache/xla"] == "compile-cache"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["HF_HOME"] == "/models/huggingface"
    assert env["VLLM_XLA_CACHE_PATH"] == env["JAX_COMPILATION_CACHE_DIR"] == "/cache/xla"


def test_engine_volumes_ephemeral_and_claim():
    serving = ServingBody().spec(
        model={"uri": "/models/qwen"},
        storage={"weights": {"size": "600Gi", "medium": "PersistentVolumeClaim", "claimName": "weights"},
                 "compileCache": {"size": "64Gi", "medium": "EphemeralVolume", "storageClassName": "hd"}})
    spec = _engine(serving)
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["model-weights"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert vols["compile-cache"]["ephemeral"]["volumeClaimTemplate"]["spec"] == {
        "accessModes": ["ReadWriteOnce"], "storageClassName": "hd", "resources": {"requests": {"storage": "64Gi"}}}
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model-weights")
    assert mount["readOnly"] is True
    # a claim that hf:// downloads into stays writable
    spec = _engine(ServingBody().spec(storage={"weights": {"size": "1Ti", "medium": "PersistentVolumeClaim",
                                                           "claimName": "hf-cache"}}))
    assert "readOnly" not in next(v for v in spec["volumes"] if v["name"] == "model-weights")["persistentVolumeClaim"]


@pytest.mark.parametrize("model,expect_args,absent", [
    ({"uri": "hf://Qwen/Qwen3-8B", "revision": "main", "tokenSecretRef": {"name": "hf", "key": "tok"}},
     ["Qwen/Qwen3-8B", "--revision", "main"], ["--load-format"]),
    ({"uri": "gs://bucket/qwen3"}, ["gs://bucket/qwen3", "--load-format", "runai_streamer"], ["--revision"]),
    ({"uri": "/models/qwen3"}, ["/models/qwen3"], ["--revision", "--load-format"]),
])
def test_vllm_model_sources(model, expect_args, absent):
    spec = _engine(ServingBody().spec(engine={"type": "vllm-tpu"}, model=model), name="llm-prefill")
    c = spec["containers"][0]
    args = c["args"]
    assert args[0] == expect_args[0] and "hf://" not in " ".join(args)
    for flag, value in zip(expect_args[1::2], expect_args[2::2]):
        assert args[args.index(flag) + 1] == value
    assert not set(absent) & set(args)
    token = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    if "tokenSecretRef" in model:
        assert token == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}]
    else:
        assert token == []


def test_sglang_and_reference_get_the_repo_id():
    spec = _engine(ServingBody().spec(engine={"type": "sglang-jax", "image": "r.example/sgl:main"},
                                      kvTransfer={"connector": "sglang-jax"}, routing={"precisePrefixCache": False},
                                      model={"uri": "hf://org/m", "revision": "abc"}))
    args = spec["containers"][0]["args"]
    assert args[args.index("--model-path") + 1] == "org/m" and args[args.index("--revision") + 1] == "abc"
    args = _engine(ServingBody())["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "org/m"


def test_gs_models_need_vllm():
    with pytest.raises(PlanError, match="gs://"):
        plan(ServingBody().spec(model={"uri": "gs://bkt/m"}), PoolBody())


def test_gke_gateway_policies_for_the_pool():
    serving = ServingBody().spec(routing={"gatewayRef": {"name": "gw"}, "gkeGatewayPolicies": True})
    objs = {o["kind"]: o for o in plan(serving, PoolBody(), ALL | {"HealthCheckPolicy", "GCPBackendPolicy"}).apply}
    hc, be = objs["HealthCheckPolicy"], objs["GCPBackendPolicy"]
    target = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm"}
    assert hc["apiVersion"] == be["apiVersion"] == "networking.gke.io/v1"
    assert hc["spec"]["targetRef"] == be["spec"]["targetRef"] == target
    # /health on the InferencePool's target port (the decode proxy answers it itself)
    assert hc["spec"]["default"]["config"] == {"type": "HTTP", "httpHealthCheck": {"requestPath": "/health",
                                                                                  "port": 8000}}
    assert be["spec"]["default"]["timeoutSec"] == 300
    # off: not applied, and pruned where the CRDs exist
    p = plan(ServingBody(), PoolBody(), ALL | {"HealthCheckPolicy", "GCPBackendPolicy"})
    assert not {"HealthCheckPolicy", "GCPBackendPolicy"} & {o["kind"] for o in p.apply}
    assert {r.kind for r in p.delete} >= {"HealthCheckPolicy", "GCPBackendPolicy"}
    # asked for but not installed: reported as missing CRDs
    p = plan(serving, PoolBody(), ALL)
    assert {"HealthCheckPolicy", "GCPBackendPolicy"} <= set(p.missing_kinds)


def test_epp_metrics_without_auth_and_health_port_admitted():
    owner, spec = _owner_spec(ServingBody())
    args = llmd.build_epp_deployment(owner, spec, 5557)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-endpoint-auth=false" in args
    ports = llmd.build_epp_network_policy(owner)["spec"]["ingress"][0]["ports"]
    assert {p["port"] for p in ports} == {llmd.EPP_GRPC_PORT, llmd.EPP_HEALTH_PORT, llmd.EPP_METRICS_PORT}


def test_routing_proxy_flags():
    spec = _engine(ServingBody())
    proxy = next(c for c in spec["initContainers"] if c["name"] == "routing-proxy")
    assert proxy["image"] == "ghcr.io/llm-d/llm-d-router-disagg-sidecar:v0.10.0"
    assert proxy["args"] == ["--port=8000", "--model-server-port=8200", "--kv-connector=nixlv2",
                             "--secure-proxy=false"]


def test_multi_host_vllm_is_one_ray_cluster_per_replica():
    """tpu-inference's multi-host layout: the LWS leader starts the Ray head and `vllm serve`
    over the whole slice (TP 16 on 2x2x2 v7x), workers only join the head; both run with
    TPU_MULTIHOST_BACKEND=ray; only the leader serves HTTP and is probed."""
    from tpusync_operator.builders import engine
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    pods = dict(_pods(plan(serving, pool).apply))
    leader = pods["llm-decode-leader"]["spec"]["containers"][0]
    worker = pods["llm-decode-worker"]["spec"]["containers"][0]
    assert leader["command"] == ["sh", "-c", engine.RAY_LEADER_SCRIPT, "vllm"]
    argv = engine.vllm_argv(leader)
    assert leader["args"][0] == "serve" and argv[0] == "org/m"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "16"
    assert worker["command"] == ["sh", "-c", engine.RAY_WORKER_SCRIPT] and worker["args"] == []
    assert engine.vllm_argv(worker) is None
    for c in (leader, worker):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TPU_MULTIHOST_BACKEND"] == "ray" and env["JAX_PLATFORMS"] == ""
        # tpusync's connector: each host's Ray worker names its own pod's sidecar to decode
        # engines ($(POD_IP) defined before it, so the kubelet expands it), and finds it by socket.
        names = [e["name"] for e in c["env"]]
        assert env["TPUSYNC_DATA_ADDRESS"] == "$(POD_IP):7600" and names.index("POD_IP") < names.index(
            "TPUSYNC_DATA_ADDRESS")
        assert env["TPUSYNC_CONTROL_SOCKET"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "tpusync.tpu_inference.connector"
    assert "readinessProbe" in leader and "readinessProbe" not in worker and "startupProbe" not in worker
    # single-host vLLM is unchanged: vllm serve directly, no Ray
    single = _engine(ServingBody().spec(engine={"type": "vllm-tpu"}))["containers"][0]
    assert single["command"] == ["vllm", "serve"]
    assert "TPU_MULTIHOST_BACKEND" not in {e["name"] for e in single["env"]}


def test_a_multi_host_reference_replica_is_one_slice_with_a_sidecar_per_host():
    """The reference engine on a multi-host slice (2x2x2 v7x: two hosts): one process per LWS pod,
    each with its own sidecar, joined as one JAX program whose coordinator is the leader; only
    the leader serves HTTP. The rendered args read by the engine's own parser."""
    from harness.kube_expansion import command_line
    from tpusync.engines.reference.__main__ import parse_args

    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    serving = copy.deepcopy(serving).spec(engine={"type": "reference"})
    pods = dict(_pods(plan(serving, pool).apply))
    for name, index in (("llm-decode-leader", "0"), ("llm-decode-worker", "1")):
        spec = pods[name]["spec"]
        c = spec["containers"][0]
        assert spec["initContainers"][0]["name"] == "tpusync-sidecar"  # this host's own
        env = {"LWS_WORKER_INDEX": index, "LWS_LEADER_ADDRESS": "llm-decode-0.llm-decode",
               "POD_IP": f"10.0.0.{index}"}
        args = parse_args(command_line(c, env)[3:])  # as the kubelet expands them
        assert (args.num_processes, args.process_id) == (2, int(index))
        assert args.coordinator == "llm-decode-0.llm-decode:7620"
        assert args.data_address == f"10.0.0.{index}:7600" and args.control_socket
        assert ("readinessProbe" in c) == (index == "0")


def _stub(bin_dir, name, body):
    """A stand-in for a program of the engine image, so that the real shell runs our script."""
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_ray_leader_script_runs_vllm_with_the_rendered_args(tmp_path):
    """The leader's script under a real sh: `ray start --head` with our options, then the wait
    for the group (stubbed as joined), then exec vllm with the rendered args, JSON intact."""
    import subprocess

    from tpusync_operator.builders import engine
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    leader = dict(_pods(plan(serving, pool).apply))["llm-decode-leader"]["spec"]["containers"][0]
    bins = tmp_path / "bin"
    bins.mkdir()
    log = tmp_path / "calls"
    _stub(bins, "ray", f'echo "ray $*" >> {log}\n')
    _stub(bins, "python3", "exit 0\n")                          # every host has joined
    _stub(bins, "vllm", f'for a in "$@"; do echo "$a"; done > {tmp_path}/argv\n')
    env = {"PATH": f"{bins}:/usr/bin:/bin", "LWS_GROUP_SIZE": "2"}
    res = subprocess.run(leader["command"] + leader["args"], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines() == ["ray start " + " ".join(engine.RAY_HEAD_ARGS)]
    assert (tmp_path / "argv").read_text().splitlines() == leader["args"]


def test_ray_worker_script_waits_for_the_head_then_joins(tmp_path):
    import socket
    import subprocess

    from tpusync_operator.builders import engine
    serving, pool = CASES["serving-vllm-v7x-lws-gateway"]
    worker = dict(_pods(plan(serving, pool).apply))["llm-decode-worker"]["spec"]["containers"][0]
    bins = tmp_path / "bin"
    bins.mkdir()
    _stub(bins, "ray", f'for a in "$@"; do echo "$a"; done > {tmp_path}/argv\n')
    head = socket.socket()
    head.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        head.bind(("127.0.0.1", engine.RAY_PORT))
        head.listen()
    except OSError:
        pass      # something already listens on 127.0.0.1:6379: the wait ends on it just the same
    try:
        env = {"PATH": f"{bins}:/usr/bin:/bin", "LWS_LEADER_ADDRESS": "127.0.0.1"}
        res = subprocess.run(worker["command"], env=env, capture_output=True, text=True, timeout=60)
    finally:
        head.close()
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "argv").read_text().splitlines() == [
        "start", f"--address=127.0.0.1:{engine.RAY_PORT}", f"--object-store-memory={engine.RAY_OBJECT_STORE_BYTES}",
        "--disable-usage-stats", "--block"]


def _engines(objs):
    return [(name, tpl["spec"]["containers"][0]) for name, tpl in _pods(objs)]


def test_tpu_engines_run_as_gke_documents():
    """GKE gives a container the TPU devices of its google.com/tpu request without privileged
    mode (1.28 and later); it documents no non-root access to them, and every upstream TPU
    example runs as root (versions.GKE_TPU). So TPU engines run as uid 0, not privileged, with
    no capability but DAC_OVERRIDE, which root needs to open the sidecar's pool file and control
    socket (owned by uid 65532, mode 0600 and 0755). Engines without TPUs stay non-root."""
    for case in ("serving-reference-v6e", "serving-vllm-v7x-lws-gateway", "serving-sglang-jax-pd"):
        serving, pool = CASES[case]
        for name, engine in _engines(plan(serving, pool).apply):
            assert engine["securityContext"] == {
                "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "privileged": False,
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
                "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]},
                "seccompProfile": {"type": "RuntimeDefault"}}, (case, name)
    serving, pool = CASES["serving-reference-cpu-only"]
    for _, engine in _engines(plan(serving, pool).apply):
        sc = engine["securityContext"]
        assert sc["runAsNonRoot"] is True and "runAsUser" not in sc and sc["capabilities"] == {"drop": ["ALL"]}


def test_the_engine_security_context_is_overridable():
    """spec.engine.securityContext: the fields given replace the operator's, on every engine
    container (capabilities as a whole); the sidecar and the proxy keep theirs."""
    nonroot = {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    serving = ServingBody().spec(engine={"type": "vllm-tpu", "securityContext": nonroot})
    objs = plan(serving, PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")).apply
    engines = _engines(objs)
    assert len(engines) == 4        # LWS leaders and workers of both roles
    for name, engine in engines:
        assert engine["securityContext"] == {
            "runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}, name
    for _, tpl in _pods(objs):
        for c in tpl["spec"]["initContainers"]:
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    privileged = ServingBody().spec(engine={"securityContext": {"privileged": True, "allowPrivilegeEscalation": True,
                                                                 "capabilities": {"add": ["IPC_LOCK"]}}})
    for _, engine in _engines(plan(privileged, PoolBody()).apply):
        sc = engine["securityContext"]
        assert sc["privileged"] is True and sc["allowPrivilegeEscalation"] is True and sc["runAsUser"] == 0
        assert sc["capabilities"] == {"add": ["IPC_LOCK"]}


@pytest.mark.parametrize("security,field", [
    ({"runAsNonRoot": True}, "spec.engine.securityContext.runAsNonRoot"),
    ({"runAsNonRoot": True, "runAsUser": 0}, "spec.engine.securityContext.runAsNonRoot"),
    ({"privileged": True}, "spec.engine.securityContext.privileged"),
])
def test_contradictory_engine_security_contexts_are_refused(security, field):
    """What the kubelet or the API server would refuse for the pod, refused for the serving."""
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        plan(ServingBody().spec(engine={"securityContext": security}), PoolBody())


def test_serving_sidecars_mount_the_pools_shared_tier_with_their_layout():
    pool = PoolBody().spec(tiers={"shared": {"claimName": "kv-lustre", "capacity": "10Ti", "policy": "Demote"}})
    pods = dict(_pods(plan(ServingBody().spec(engine={"type": "vllm-tpu"}), pool).apply))
    layouts = set()
    for name, tpl in pods.items():
        sidecar = tpl["spec"]["initContainers"][0]
        args = sidecar["args"]
        assert "--shared-dir=/var/lib/tpusync/shared" in args and "--shared-policy=demote" in args, name
        assert f"--shared-bytes={10 << 40}" in args
        assert {"name": "tpusync-shared", "mountPath": "/var/lib/tpusync/shared"} in sidecar["volumeMounts"]
        assert {"name": "tpusync-shared", "persistentVolumeClaim": {"claimName": "kv-lustre"}} in tpl["spec"]["volumes"]
        layouts.add(next(a for a in args if a.startswith("--shared-layout=")))
    # Prefill and decode of one serving read each other's blocks: one layout, naming the weights,
    # the engine image and the parallelism.
    (layout,) = layouts
    assert "model=hf://" in layout and "engine=vllm-tpu" in layout and ";tp=" in layout and "image=" in layout
    # A pool without the tier: no flag, no volume.
    plain = dict(_pods(plan(ServingBody(), PoolBody()).apply))
    for tpl in plain.values():
        assert not any(a.startswith("--shared") for a in tpl["spec"]["initContainers"][0]["args"])
        assert all(v["name"] != "tpusync-shared" for v in tpl["spec"]["volumes"])


def test_lockstep_routes_each_request_within_one_revision():
    """The rollout screener as llm-d-router v0.10.0 decodes it (versions.EPP_SCREENER_SOURCES): a
    top-level plugin, never in a profile, scoped to this serving's pods, gating on both roles; an
    Alpha plugin, so the router is started with --allow-experimental-plugins."""
    owner, spec = _owner_spec(ServingBody().spec(rollout={"strategy": "Lockstep"}))
    cfg = llmd.build_epp_config(owner, spec, 5557)
    (screener,) = [p for p in cfg["plugins"] if p["type"] == "disaggregatedset-rollout-screener"]
    params = screener["parameters"]
    assert params["scope"]["labelSelector"] == ("disaggregatedset.x-k8s.io/name=llm,tpusync.dev/serving=llm,"
                                                "llm-d.ai/inference-serving=true")
    assert params["revisionGating"] == {"mode": "sum", "revisionLabelKey": versions.DS_REVISION_LABEL,
                                        "roleLabelKey": versions.DS_ROLE_LABEL,
                                        "requireRoles": {"values": ["prefill", "decode"]}}
    assert set(params) <= {"scope", "headerSelectors", "revisionGating"}
    assert not any(r["pluginRef"] == "disaggregatedset-rollout-screener"
                   for p in cfg["schedulingProfiles"] for r in p["plugins"])
    assert "--allow-experimental-plugins=true" in llmd.epp_args(owner, spec)
    owner, independent = _owner_spec(ServingBody())
    assert "disaggregatedset-rollout-screener" not in {p["type"] for p in
                                                      llmd.build_epp_config(owner, independent, 5557)["plugins"]}
    assert "--allow-experimental-plugins=true" not in llmd.epp_args(owner, independent)


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_service_of_ours_is_named_like_a_leaderworkerset(case):
    """LWS takes a Service named like the set as the set's headless Service (subdomainPolicy
    Shared), so a role Service of that name would lose the pods' DNS and fail the apply;
    UniquePerReplica names one per group after its leader pod, which we never name a Service."""
    serving, pool = CASES[case]
    objs = plan(serving, pool).apply
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    sets = [o["spec"] for o in objs if o["kind"] == "LeaderWorkerSet"]
    sets += [r["spec"] for o in objs if o["kind"] == "DisaggregatedSet" for r in o["spec"]["roles"]]
    for lws in sets:
        assert lws["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert not services & {f"{o['metadata']['name']}-{i}" for o in objs if o["kind"] == "LeaderWorkerSet"
                           for i in range(o["spec"]["replicas"])}
