"""llm-d wiring of a DisaggregatedServing: the endpoint picker (EPP) with its
EndpointPickerConfig, InferencePool, InferenceObjective and HTTPRoute.

Formats and versions: ..versions (EPP, GATEWAY_API_INFERENCE_EXTENSION, INFERENCE_OBJECTIVE,
GKE_GATEWAY_POLICIES), each with the upstream file it follows. EndpointPickerConfig
llm-d.ai/v1alpha1 (strict decoding); InferencePool inference.networking.k8s.io/v1;
InferenceObjective llm-d.ai/v1alpha2; HTTPRoute gateway.networking.k8s.io/v1; GKE's
HealthCheckPolicy and GCPBackendPolicy networking.gke.io/v1.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from .. import versions
from ..models import DisaggregatedServingSpec
from . import names
from .common import LLMD_SERVING_LABEL, SERVING_LABEL, Owner, base_labels, metadata
from .security import container_security_context, pod_security_context

EPP_GRPC_PORT = 9002
# How llm-d weighs a prefix block by the tier an engine holds it on: the accelerator's own
# cache, then host DRAM, then disk, then the shared tier (what it costs the engine to load it).
# A medium missing here would score 1.0 at llm-d-kv-cache v0.9.0, as much as the accelerator.
TIER_WEIGHTS = (("gpu", 1.0), ("cpu", 0.8), ("disk", 0.5), ("shared_storage", 0.4))
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_KEY = "config.yaml"
INFERENCE_POOL_API = versions.INFERENCE_POOL_API
INFERENCE_OBJECTIVE_API = versions.INFERENCE_OBJECTIVE_API
HTTPROUTE_API = versions.HTTPROUTE_API
GKE_POLICY_API = versions.GKE_POLICY_API
CONFIG_HASH_ANNOTATION = "tpusync.dev/epp-config-hash"


def serving_pod_labels(owner: Owner) -> dict[str, str]:
    """The InferencePool's selector: serving pods (Deployment pods, LWS leaders) of this object."""
    return {SERVING_LABEL: owner.name, LLMD_SERVING_LABEL: "true"}


def build_epp_config(owner: Owner, spec: DisaggregatedServingSpec, kv_events_port: int) -> dict[str, Any]:
    """The EndpointPickerConfig: P/D profiles chosen by disagg-profile-handler with a
    prefix-based-pd-decider; prefix-cache scoring either precise (KV events the engines
    publish on the pool's kvEventsPort, tokens from their /v1/completions/render) or
    approximate."""
    r = spec.routing
    w = r.scorer_weights
    plugins: list[dict[str, Any]] = []
    data_layer: dict[str, Any] | None = None
    if r.precise_prefix_cache:
        selector = ",".join(f"{k}={v}" for k, v in serving_pod_labels(owner).items())
        decode_url = f"http://{names.role(owner.name, 'decode')}.{owner.namespace}.svc:{spec.port}"
        plugins += [
            {"type": "token-producer",
             "parameters": {"modelName": spec.model.name,
                            "vllm": {"url": decode_url}}},
            {"type": "endpoint-notification-source"},
            {"type": "metrics-data-source"},
            {"type": "core-metrics-extractor"},
            {"type": "precise-prefix-cache-producer",
             "parameters": {
                 # blockSizeTokens: the pinned router's name (blockSize is deprecated there;
                 # versions.EPP_CONFIG_SOURCES).
                 "tokenProcessorConfig": {"blockSizeTokens": r.block_size_tokens},
                 "kvEventsConfig": {
                     "topicFilter": "kv@",
                     "discoverPods": True,
                     "podDiscoveryConfig": {"podLabelSelector": selector, "podNamespace": owner.namespace,
                                            "socketPort": kv_events_port},
                 },
                 # Unlisted tiers weigh 1.0 in llm-d: without these, a block on disk would
                 # outrank one in host DRAM (llm-d-kv-cache v0.9.0 pkg/kvcache/backend.go).
                 "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True},
                                   "kvCacheBackendConfigs": [{"name": name, "weight": weight}
                                                             for name, weight in TIER_WEIGHTS]},
             }},
            {"type": "prefix-cache-scorer",
             "parameters": {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}},
        ]
        data_layer = {"sources": [
            {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]},
            {"pluginRef": "endpoint-notification-source",
             "extractors": [{"pluginRef": "precise-prefix-cache-producer"}]},
        ]}
    else:
        plugins += [{"type": "approx-prefix-cache-producer",
                     "parameters": {"blockSizeTokens": r.block_size_tokens}},
                    {"type": "prefix-cache-scorer"}]
    if lockstep(spec):
        plugins.append(rollout_screener(owner))
    plugins += [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "max-score-picker"},
        {"type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": r.pd_threshold_tokens}},
        {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "prefix-based-pd-decider"}}},
    ]

    def profile(name: str, role_filter: str) -> dict[str, Any]:
        refs: list[dict[str, Any]] = [{"pluginRef": role_filter}, {"pluginRef": "max-score-picker"}]
        for ref, weight in (("prefix-cache-scorer", w.prefix_cache), ("queue-scorer", w.queue),
                            ("kv-cache-utilization-scorer", w.kv_cache_utilization)):
            if weight > 0:
                refs.append({"pluginRef": ref, "weight": weight})
        return {"name": name, "plugins": refs}

    config: dict[str, Any] = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "schedulingProfiles": [profile("prefill", "prefill-filter"), profile("decode", "decode-filter")],
    }
    if data_layer is not None:
        config["dataLayer"] = data_layer
    return config


def lockstep(spec: DisaggregatedServingSpec) -> bool:
    return spec.rollout.strategy == "Lockstep"


def rollout_screener(owner: Owner) -> dict[str, Any]:
    """llm-d's DisaggregatedSet rollout screener (versions.EPP_SCREENER_SOURCES): of the serving
    pods of this serving's DisaggregatedSet, only revisions with a Ready prefill and a Ready decode
    take requests, each in proportion to its Ready pods (sum), and a request's prefill and decode
    come from one revision."""
    scope = {versions.DS_NAME_LABEL: owner.name, **serving_pod_labels(owner)}
    return {"type": "disaggregatedset-rollout-screener",
            "parameters": {"scope": {"labelSelector": ",".join(f"{k}={v}" for k, v in scope.items())},
                           "revisionGating": {"mode": "sum", "revisionLabelKey": versions.DS_REVISION_LABEL,
                                              "roleLabelKey": versions.DS_ROLE_LABEL,
                                              "requireRoles": {"values": ["prefill", "decode"]}}}}


def epp_config_text(owner: Owner, spec: DisaggregatedServingSpec, kv_events_port: int) -> str:
    return yaml.safe_dump(build_epp_config(owner, spec, kv_events_port), sort_keys=False)


def build_epp_config_map(owner: Owner, spec: DisaggregatedServingSpec, kv_events_port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker")),
            "data": {EPP_CONFIG_KEY: epp_config_text(owner, spec, kv_events_port)}}


def build_epp_service_account(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker"))}


EPP_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["llm-d.ai", "inference.networking.x-k8s.io"],
     "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": ["get", "list", "watch"]},
]


def leader_election(spec: DisaggregatedServingSpec) -> bool:
    """More than one replica, active-passive: the router's leader election decides which routes."""
    return spec.routing.epp_replicas > 1 and spec.routing.epp_high_availability == "ActivePassive"


def epp_leader_election_rules(owner: Owner) -> list[dict[str, Any]]:
    """What client-go's Lease lock does (get, create, update: a release is an update) on the one
    Lease the router names (versions.EPP_HA_SOURCES), and the events its recorder posts. Less than
    upstream's chart grants (every Lease in the namespace, list/watch/patch/delete too)."""
    return [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"],
             "resourceNames": [versions.epp_lease_name(owner.namespace, owner.name)]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}]


def build_epp_role(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    rules = EPP_RULES + (epp_leader_election_rules(owner) if leader_election(spec) else [])
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker")),
            "rules": rules}


def build_epp_role_binding(owner: Owner) -> dict[str, Any]:
    name = names.epp(owner.name)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": metadata(owner, name, base_labels(owner, "endpoint-picker")),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}


def _epp_selector(owner: Owner) -> dict[str, str]:
    return {SERVING_LABEL: owner.name, "app.kubernetes.io/component": "endpoint-picker"}


def epp_args(owner: Owner, spec: DisaggregatedServingSpec) -> list[str]:
    """The EPP's command line (flags: versions.EPP). Boolean flags take `=`: pflag reads a
    separate word as a positional argument."""
    args = ["--pool-name", owner.name, "--pool-namespace", owner.namespace,
            "--pool-group", "inference.networking.k8s.io",
            "--config-file", f"/config/{EPP_CONFIG_KEY}",
            "--grpc-health-port", str(EPP_HEALTH_PORT), "--zap-encoder", "json",
            # Metrics without a bearer token (upstream's chart default): with auth the EPP
            # would need TokenReview/SubjectAccessReview rights and Prometheus a token.
            f"--metrics-endpoint-auth={str(versions.EPP_METRICS_AUTH).lower()}"]
    if leader_election(spec):
        args.append("--ha-enable-leader-election=true")
    if lockstep(spec):    # the rollout screener is an Alpha plugin
        args.append("--allow-experimental-plugins=true")
    return args


def build_epp_deployment(owner: Owner, spec: DisaggregatedServingSpec, kv_events_port: int) -> dict[str, Any]:
    """The endpoint picker. Its pod template carries a hash of the config so a config change
    rolls it (the EPP reads the file once at start)."""
    name = names.epp(owner.name)
    config_hash = hashlib.sha256(epp_config_text(owner, spec, kv_events_port).encode()).hexdigest()[:16]
    labels = {**base_labels(owner, "endpoint-picker"), **_epp_selector(owner)}

    # Under leader election only the leader answers "readiness" (so the Service sends ext-proc to
    # it alone) and every replica "liveness" (a standby is not restarted); without it any name.
    ha = leader_election(spec)

    def grpc_probe(check: str, **extra: Any) -> dict[str, Any]:
        service = versions.EPP_HA_HEALTH_SERVICES[check] if ha else "inference-extension"
        return {"grpc": {"port": EPP_HEALTH_PORT, "service": service}, **extra}

    container = {
        "name": "epp",
        "image": spec.routing.epp_image,
        "imagePullPolicy": "IfNotPresent",
        "args": epp_args(owner, spec),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT}],
        "livenessProbe": grpc_probe("liveness", initialDelaySeconds=5, periodSeconds=10),
        "readinessProbe": grpc_probe("readiness", periodSeconds=2),
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
    }
    pod: dict[str, Any] = {"serviceAccountName": name,
                           "terminationGracePeriodSeconds": 130,
                           "securityContext": pod_security_context(),
                           "containers": [container],
                           "volumes": [{"name": "config", "configMap": {"name": name}}]}
    deployment_spec: dict[str, Any] = {"replicas": spec.routing.epp_replicas,
                                       "selector": {"matchLabels": _epp_selector(owner)}}
    if spec.routing.epp_replicas > 1:
        # One replica per node: draining a node never takes the router down. A rollout surges
        # no pod, so it needs no spare node either.
        pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": _epp_selector(owner)}, "topologyKey": "kubernetes.io/hostname"}]}}
        # Under leader election a new replica never turns ready while the old leader holds the
        # Lease, so a rollout that waits for one never retires the leader: all go at once
        # (upstream's chart uses Recreate for this, versions.EPP_HA_SOURCES; a rolling update of
        # 100 % starts the new pods without waiting for the old to finish their drain, and
        # needs no change of strategy type, which server-side apply cannot make).
        deployment_spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": 0, "maxUnavailable": "100%" if ha else 1}}
    deployment_spec["template"] = {
        "metadata": {"labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: config_hash}}, "spec": pod}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(owner, name, labels), "spec": deployment_spec}


def build_epp_disruption_budget(owner: Owner) -> dict[str, Any]:
    """Active-active replicas are all ready: a voluntary eviction (a node drain, an upgrade) takes
    one at a time. Active-passive gets none: a budget counts ready pods, the standby never is, so
    any budget that kept the leader would stop its node's drain for good; the leader gives its
    Lease up on SIGTERM instead and keeps serving through --drain-timeout."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker")),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _epp_selector(owner)}}}


def epp_disruption_budget_wanted(spec: DisaggregatedServingSpec) -> bool:
    r = spec.routing
    return r.enabled and r.epp_replicas > 1 and r.epp_high_availability == "ActiveActive"


def build_epp_service(owner: Owner) -> dict[str, Any]:
    """The ext-proc port speaks cleartext HTTP/2 (gRPC): appProtocol kubernetes.io/h2c, the
    pinned router chart's (versions.EPP_EXT_PROC_APP_PROTOCOL)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker")),
            "spec": {"selector": _epp_selector(owner),
                     "ports": [{"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "protocol": "TCP",
                                "appProtocol": versions.EPP_EXT_PROC_APP_PROTOCOL},
                               {"name": "http-metrics", "port": EPP_METRICS_PORT, "protocol": "TCP"}]}}


def build_epp_network_policy(owner: Owner) -> dict[str, Any]:
    """The gateway reaches the EPP's ext-proc port and Prometheus its metrics, from wherever
    they run; the gRPC health port is open too: the kubelet's probes pass any policy, but
    GKE's Gateway health-checks the EPP backend on it from Google's health-check ranges."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, names.epp(owner.name), base_labels(owner, "endpoint-picker")),
            "spec": {"podSelector": {"matchLabels": _epp_selector(owner)},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": EPP_GRPC_PORT},
                                            {"protocol": "TCP", "port": EPP_HEALTH_PORT},
                                            {"protocol": "TCP", "port": EPP_METRICS_PORT}]}]}}


def build_inference_pool(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": metadata(owner, owner.name, base_labels(owner, "inference-pool")),
            "spec": {"selector": {"matchLabels": serving_pod_labels(owner)},
                     "targetPorts": [{"number": spec.port}],
                     "endpointPickerRef": {"name": names.epp(owner.name), "kind": "Service",
                                           "port": {"number": EPP_GRPC_PORT}, "failureMode": "FailClose"}}}


def build_inference_objective(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    return {"apiVersion": INFERENCE_OBJECTIVE_API, "kind": "InferenceObjective",
            "metadata": metadata(owner, owner.name, base_labels(owner, "inference-objective")),
            "spec": {"priority": spec.routing.objective.priority,
                     "poolRef": {"group": "inference.networking.k8s.io", "name": owner.name}}}


def build_http_route(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    """The route from the Gateway to the InferencePool. On GKE's Gateway
    (routing.gkeGatewayPolicies) the rule has no timeouts: GKE's Gateway controller does not
    admit rules[].timeouts, and the backend timeout is the GCPBackendPolicy's timeoutSec, as
    the upstream charts render it for provider gke (versions.GKE_GATEWAY_POLICIES)."""
    gw = spec.routing.gateway_ref
    assert gw is not None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw.name}
    if gw.namespace:
        parent["namespace"] = gw.namespace
    if gw.section_name:
        parent["sectionName"] = gw.section_name
    rule: dict[str, Any] = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                            "backendRefs": [{"group": "inference.networking.k8s.io",
                                             "kind": "InferencePool", "name": owner.name}]}
    if not spec.routing.gke_gateway_policies:
        rule["timeouts"] = {"request": versions.HTTPROUTE_REQUEST_TIMEOUT}
    return {"apiVersion": HTTPROUTE_API, "kind": "HTTPRoute",
            "metadata": metadata(owner, owner.name, base_labels(owner, "http-route")),
            "spec": {"parentRefs": [parent], "rules": [rule]}}


def _pool_target_ref(owner: Owner) -> dict[str, str]:
    return {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": owner.name}


def build_gke_health_check_policy(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    """GKE Gateway's health check of the InferencePool's endpoints: HTTP /health on the serving
    port (the engine's, or on decode pods the routing proxy's own /health). Without it GKE
    probes / and marks every model server unhealthy."""
    return {"apiVersion": GKE_POLICY_API, "kind": "HealthCheckPolicy",
            "metadata": metadata(owner, owner.name, base_labels(owner, "inference-pool")),
            "spec": {"targetRef": _pool_target_ref(owner),
                     "default": {**versions.GKE_HEALTH_CHECK_DEFAULTS,
                                 "config": {"type": "HTTP",
                                            "httpHealthCheck": {"requestPath": "/health", "port": spec.port}}}}}


def build_gke_backend_policy(owner: Owner) -> dict[str, Any]:
    """GKE Gateway's backend settings for the InferencePool: a timeout long enough for a
    generation (GKE's default is 30 s)."""
    return {"apiVersion": GKE_POLICY_API, "kind": "GCPBackendPolicy",
            "metadata": metadata(owner, owner.name, base_labels(owner, "inference-pool")),
            "spec": {"targetRef": _pool_target_ref(owner),
                     "default": {"timeoutSec": versions.GKE_BACKEND_TIMEOUT_SEC}}}
