"""The tpusync.dev/v1alpha1 API. These pydantic models are the single source of truth:
`python -m tpusync_operator.crdgen` turns them into the CRDs under crds/, and the
reconcilers parse every object through them.

Conventions: field names are camelCase on the wire (aliases); every nested object has
`default: {}` in the CRD so the API server applies nested defaults; cross-field rules
are CEL (`x-kubernetes-validations`) whose messages name the field; rules the schema
cannot express (TPU slice arithmetic, the referenced pool) are checked by the planner,
which raises kopf.PermanentError with the field named.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from .engine_flags import OWNED_FLAGS, flag_pattern
from .quantity import QUANTITY_PATTERN
from .tpu import host_memory_by_slice
from .versions import EPP, ROUTING_PROXY, SIDECAR_IMAGE

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, examples=["64Gi"])]
# GKE's limit on a node pool's name (and a cluster's): 40 characters, a lowercase letter first
# (GKE refuses longer names; e.g. the Terraform provider's users truncate to 40).
GKE_NODE_POOL_MAX = 40
GKEName = Annotated[str, Field(min_length=1, max_length=GKE_NODE_POOL_MAX, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")]
DNSName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
Port = Annotated[int, Field(ge=1, le=65535)]
Topology = Annotated[str, Field(max_length=16, pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$", examples=["2x4", "2x2x2"])]
# A DNS subdomain (storage classes, Secrets' keys are not).
DNSSubdomain = Annotated[str, Field(min_length=1, max_length=253,
                                    pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")]
# A Compute Engine resource name (reservations, resource policies, GKE clusters and node pools).
GCEName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")]
# An image reference: [host[:port]/]path[:tag][@sha256:digest], lowercase path (the grammar of
# distribution/reference, without its rarely used separators).
ImageRef = Annotated[str, Field(
    min_length=1, max_length=512,
    pattern=r"^[a-zA-Z0-9]([-a-zA-Z0-9.]*[a-zA-Z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
            r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")]
Email = Annotated[str, Field(max_length=254, pattern=r"^[a-z0-9][-a-z0-9._]*@[-a-z0-9.]+\.[a-z]+$")]
# A branch, tag or commit (no spaces or shell characters).
GitRef = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]
# An engine argument (bounded, so the CEL rule over them has a bounded cost).
EngineArg = Annotated[str, Field(max_length=2048)]


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """Model-level CEL rules: (rule, message[, messageExpression])."""
    return {"x-kubernetes-validations": [
        {"rule": r[0], "message": r[1], **({"messageExpression": r[2]} if len(r) > 2 else {})} for r in rules]}


def sub(model: type[BaseModel], description: str) -> Any:
    """A nested object that is always present (defaults to {} in the CRD too)."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Resources(Model):
    """Container resource requests and limits (Kubernetes quantities)."""
    requests: dict[str, str] | None = None
    limits: dict[str, str] | None = None


class EnvVar(Model):
    # Kubernetes' rule (RelaxedEnvironmentVariableValidation): printable ASCII but '='.
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[!-<>-~]+$")]
    value: str = ""


# ---------------------------------------------------------------- TPUSyncPool

class TPUSpec(Model):
    """The TPU slice every host of the pool belongs to."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.type == 'v7x' ? self.topology.matches('^[0-9]+x[0-9]+x[0-9]+$') : "
         "self.topology.matches('^[0-9]+x[0-9]+$')",
         "spec.tpu.topology must be AxB for v5e and v6e and AxBxC for v7x"),
    ))
    type: Literal["v5e", "v6e", "v7x"] = Field(
        description="TPU generation. Tensor parallelism counts TensorCores: 1 per chip on v5e and v6e, 2 on v7x.")
    topology: Topology = Field(description="Slice topology, e.g. 2x4 (v5e, v6e) or 2x2x2 (v7x).")


class Autoscaling(Model):
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.minHosts <= self.maxHosts", "spec.capacity.autoscaling.minHosts must not exceed maxHosts"),
    ))
    min_hosts: Annotated[int, Field(ge=0)] = 0
    max_hosts: Annotated[int, Field(ge=1)]


class Capacity(Model):
    """How many hosts; spot or reserved capacity."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("!(has(self.hosts) && has(self.autoscaling))",
         "spec.capacity: set either hosts or autoscaling, not both"),
        ("!(self.spot && has(self.reservation))",
         "spec.capacity: spot and reservation are mutually exclusive"),
    ))
    hosts: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Fixed host count. Defaults to the hosts of one slice of spec.tpu.topology. With a "
                          "multi-host topology, a multiple of the slice's hosts (in mode gke one node pool per slice).")
    autoscaling: Autoscaling | None = Field(
        None, description="Autoscaling range in hosts (mode gke). With a multi-host topology, multiples of the "
                          "slice's hosts: one node pool per slice up to maxHosts, which GKE's autoscaler grows from "
                          "0 to a whole slice when pods wait for it; the first minHosts worth of slices stay up.")
    spot: bool = Field(False, description="Use Spot VMs.")
    reservation: GCEName | None = Field(None, description="Name of a specific Compute Engine reservation to consume.")


QUEUED_PROVISIONING_UNSUPPORTED = (
    "spec.provisioning.gke.queuedProvisioning: true is not supported: a queued node pool gets nodes only through a "
    "ProvisioningRequest (Dynamic Workload Scheduler), which the operator does not create, so its hosts would never "
    "come")


class GKEProvisioning(Model):
    """Create and own a GKE node pool through the GKE REST API (never one the operator did not create)."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.queuedProvisioning) || !self.queuedProvisioning", QUEUED_PROVISIONING_UNSUPPORTED),
    ))
    project: Annotated[str, Field(min_length=6, max_length=100,
                                  pattern=r"^([a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")] = Field(
        description="Project ID (not the number), e.g. my-project or example.com:my-project.")
    location: Annotated[str, Field(max_length=64, pattern=r"^[a-z]+-[a-z]+[0-9]+(-[a-z])?$")] = Field(
        description="Region or zone of the cluster, e.g. us-east5 or us-east5-b.")
    cluster: Annotated[str, Field(max_length=GKE_NODE_POOL_MAX, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")]
    node_locations: list[Annotated[str, Field(max_length=64, pattern=r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")]] | None = Field(
        None, description="Zones of the node pool (the TPU zone). Required in a regional cluster: there GKE "
                          "would otherwise create the hosts, and count autoscaling limits, in every zone.")
    node_pool_name: GKEName | None = Field(
        None, description="Defaults to the TPUSyncPool name; at most 40 characters, as GKE allows, slices beyond "
                          "the first adding -<i>. A node pool of that name that the operator did not "
                          "create for this TPUSyncPool is never changed or deleted (Degraded/NodePoolNotOwned).")
    workload_policy: GCEName | None = Field(
        None, description="Workload policy (placementPolicy.policyName); required for v7x multi-host slices.")
    queued_provisioning: bool = Field(False, description="Queued provisioning (Dynamic Workload Scheduler): not "
                                                         "supported, true is refused (the operator creates no "
                                                         "ProvisioningRequest).")
    service_account: Email | None = Field(None, description="Node service account e-mail.")
    # No API endpoint here: the operator sends its Google access token to the GKE API it is
    # configured with (TPUSYNC_GKE_ENDPOINT, the chart's gke.endpoint), never to one an
    # object names.


class ExistingProvisioning(Model):
    """Use nodes that already exist, selected by node pool name or labels."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("has(self.nodePoolName) || has(self.nodeSelector)",
         "spec.provisioning.existing needs nodePoolName or nodeSelector"),
    ))
    node_pool_name: GKEName | None = None
    node_selector: dict[str, str] | None = None


class Provisioning(Model):
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.mode != 'gke' || has(self.gke)", "spec.provisioning.gke is required when mode is gke"),
        ("self.mode != 'existing' || has(self.existing)",
         "spec.provisioning.existing is required when mode is existing"),
        ("self.mode == 'gke' || !has(self.gke)", "spec.provisioning.gke applies only to mode gke"),
        ("self.mode == 'existing' || !has(self.existing)", "spec.provisioning.existing applies only to mode existing"),
        ("self.mode == oldSelf.mode", "spec.provisioning.mode is immutable"),
    ))
    mode: Literal["gke", "existing"] = Field("existing", description="gke: create and own a node pool.")
    gke: GKEProvisioning | None = None
    existing: ExistingProvisioning | None = None


class DiskTier(Model):
    """Local disk tier. No hostPath: an emptyDir (node ephemeral storage, e.g. local SSD)
    or a generic ephemeral volume from a storage class."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.medium != 'EphemeralVolume' || has(self.storageClassName)",
         "spec.tiers.disk.storageClassName is required when medium is EphemeralVolume"),
    ))
    size: Quantity
    medium: Literal["EmptyDir", "EphemeralVolume"] = "EmptyDir"
    storage_class_name: DNSSubdomain | None = None


class SharedTier(Model):
    """A filesystem every host of the pool mounts (a ReadWriteMany volume): blocks any serving pod
    of the pool wrote are read by all of them, with no transfer between sidecars, and outlive
    every host. Managed Lustre (lustre.csi.storage.gke.io) is the documented store for KV caches
    on GKE; Filestore and GCS FUSE work too (docs/gke.md weighs them)."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("has(self.claimName) != has(self.storageClassName)",
         "spec.tiers.shared needs exactly one of claimName (an existing ReadWriteMany claim) and storageClassName "
         "(a claim the operator creates)"),
        ("!has(self.storageClassName) || has(self.size)",
         "spec.tiers.shared.size is required with storageClassName: the claim's request"),
        ("self.lowWatermarkPercent < self.highWatermarkPercent",
         "spec.tiers.shared.lowWatermarkPercent must be below highWatermarkPercent"),
        ("!has(self.claimName) || !has(self.size)",
         "spec.tiers.shared.size applies only with storageClassName (the claim the operator creates): the claim of "
         "claimName has its own size"),
        ("!has(self.size) || !has(self.capacity) || "
         "quantity(self.capacity).asInteger() <= quantity(self.size).asInteger()",
         "spec.tiers.shared.capacity must not exceed spec.tiers.shared.size, the claim's request"),
    ))
    claim_name: DNSName | None = Field(
        None, description="An existing ReadWriteMany PersistentVolumeClaim in the pool's namespace.")
    storage_class_name: DNSSubdomain | None = Field(
        None, description="The operator creates the ReadWriteMany claim <pool>-shared of this class (e.g. a Managed "
                          "Lustre class) and keeps it while the pool exists.")
    size: Quantity | None = Field(None, description="The created claim's request.")
    capacity: Quantity | None = Field(
        None, description="The tier's share of the filesystem (its evictor keeps it under this); the whole "
                          "filesystem when empty.")
    policy: Literal["WriteThrough", "Demote"] = Field(
        "WriteThrough", description="WriteThrough: every block a pod stores is written to the tier; Demote: blocks "
                                    "are written when they leave a pod's DRAM.")
    high_watermark_percent: Annotated[int, Field(ge=1, le=100)] = Field(
        85, description="Eviction of the least recently read blocks (of every host) starts above this share...")
    low_watermark_percent: Annotated[int, Field(ge=0, le=99)] = Field(70, description="...and stops at this one.")


_BLOCK = "quantity(self.blockBytes).asInteger()"


class Tiers(Model):
    # has(): the API server checks the rules against the CRD's default ({}) too.
    model_config = ConfigDict(json_schema_extra=cel(
        (f"!has(self.blockBytes) || ({_BLOCK} >= 4096 && {_BLOCK} % 4096 == 0)",
         "spec.tiers.blockBytes must be a multiple of 4096 bytes (4Ki), e.g. 1Mi: the sidecar's tiers read and "
         "write whole pages"),
        (f"!has(self.dram) || !has(self.blockBytes) || quantity(self.dram).asInteger() >= {_BLOCK}",
         "spec.tiers.dram must hold at least one block of spec.tiers.blockBytes"),
        # One extent (a block and its 4Ki header) and 1Mi for the tier's own files
        # (builders/sidecar.py disk_tier_bytes): what the tier's directory needs on the volume.
        (f"!has(self.disk) || !has(self.blockBytes) || quantity(self.disk.size).asInteger() >= "
         f"{_BLOCK} + 4096 + 1048576",
         "spec.tiers.disk.size must hold at least one block of spec.tiers.blockBytes, its 4Ki header and 1Mi "
         "for the tier's own files"),
        ("!has(self.shared) || !has(self.shared.capacity) || !has(self.blockBytes) || "
         f"quantity(self.shared.capacity).asInteger() >= {_BLOCK}",
         "spec.tiers.shared.capacity must hold at least one block of spec.tiers.blockBytes"),
    ))
    dram: Quantity = Field("16Gi", description="Host DRAM each sidecar lends to the pool (/dev/shm).")
    disk: DiskTier | None = None
    shared: SharedTier | None = None
    block_bytes: Quantity = Field("1Mi", description="Transfer block size.")


class SidecarSpec(Model):
    """The tpusync-sidecar container."""
    image: ImageRef = SIDECAR_IMAGE
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    data_port: Port = 7600
    http_port: Port = 7601
    kv_events_port: Port = 5557
    resources: Resources = sub(Resources, "Sidecar resources.")
    encrypt: bool = Field(False, description="Encrypt every data-port session of the pool's sidecars, both ways "
                                             "(AEGIS-128X2, tpusync-sidecar --encrypt); sessions are authenticated "
                                             "either way. A session is encrypted when either end asks.")


class StoreNodes(Model):
    """Standalone sidecars that lend their DRAM and disk to the pool as a lower tier."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.kind == 'StatefulSet' || !has(self.replicas)",
         "spec.storeNodes.replicas applies only to kind StatefulSet"),
    ))
    enabled: bool = False
    kind: Literal["StatefulSet", "DaemonSet"] = "StatefulSet"
    replicas: Annotated[int, Field(ge=0)] | None = Field(None, description="StatefulSet replicas (default 1).")
    dram: Quantity = "32Gi"
    disk: DiskTier | None = None
    node_selector: dict[str, str] | None = None
    resources: Resources = sub(Resources, "Store node resources.")


class AuthSpec(Model):
    secret_name: DNSName | None = Field(
        None, description="Secret with key `token`; generated as <pool>-auth when absent.")


_HOST_MEMORY = "{" + ", ".join(f"'{k}': {v}" for k, v in host_memory_by_slice().items()) + "}"
_SLICE_KEY = "(self.tpu.type == 'v7x' ? 'v7x' : self.tpu.type + '/' + self.tpu.topology)"


class TPUSyncPoolSpec(Model):
    model_config = ConfigDict(json_schema_extra=cel(
        (f"!({_SLICE_KEY} in {_HOST_MEMORY}) || "
         f"quantity(self.tiers.dram).asInteger() < {_HOST_MEMORY}[{_SLICE_KEY}]",
         "spec.tiers.dram must be less than the memory of the TPU host (tpu.py MACHINE_MEMORY_BYTES: e.g. 192 GB "
         "on a 4-chip v5e host, 720 GB on a 4-chip v6e host, 960 GB on a v7x host), which the engine shares"),
        ("!has(self.provisioning.gke) || !has(self.provisioning.gke.workloadPolicy) || (self.tpu.type == 'v7x' && "
         "self.tpu.topology.split('x').size() == 3 && int(self.tpu.topology.split('x')[0]) * "
         "int(self.tpu.topology.split('x')[1]) * int(self.tpu.topology.split('x')[2]) > 4)",
         "spec.provisioning.gke.workloadPolicy applies only to v7x multi-host slices (placementPolicy.policyName); "
         "other multi-host slices are placed by spec.tpu.topology"),
        ("!self.storeNodes.enabled || quantity(self.storeNodes.dram).asInteger() >= "
         "quantity(self.tiers.blockBytes).asInteger()",
         "spec.storeNodes.dram must hold at least one block of spec.tiers.blockBytes"),
        ("!self.storeNodes.enabled || !has(self.storeNodes.disk) || quantity(self.storeNodes.disk.size).asInteger() "
         ">= quantity(self.tiers.blockBytes).asInteger() + 4096 + 1048576",
         "spec.storeNodes.disk.size must hold at least one block of spec.tiers.blockBytes, its 4Ki header and 1Mi "
         "for the tier's own files"),
    ))
    tpu: TPUSpec
    capacity: Capacity = sub(Capacity, "Host count, autoscaling, spot or reservation.")
    provisioning: Provisioning = Field(description="Where the hosts come from.")
    tiers: Tiers = sub(Tiers, "Memory and storage tiers.")
    sidecar: SidecarSpec = sub(SidecarSpec, "Transfer sidecar image, ports and resources.")
    store_nodes: StoreNodes = sub(StoreNodes, "Optional store nodes.")
    auth: AuthSpec = sub(AuthSpec, "Shared secret for the data plane.")


_MAP_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str


class NodePoolStatus(Model):
    name: str | None = None
    state: str | None = Field(None, description="GKE node pool status, or Existing.")
    operation: str | None = Field(None, description="Pending GKE operation name.")
    node_count: int | None = Field(
        None, description="Node count the operator last set on a fixed-size node pool (GKE reports "
                          "none); empty while GKE's autoscaler sizes the pool or when not known.")


class TPUSyncPoolStatus(Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_MAP_LIST)
    node_pool: NodePoolStatus | None = Field(None, description="The node pool (mode gke: of the first slice).")
    node_pools: list[NodePoolStatus] | None = Field(
        None, description="Mode gke: every node pool, one per multi-host slice (and any being deleted).")
    hosts: int | None = Field(None, description="Desired hosts.")
    ready_hosts: int | None = None
    sidecars: int | None = Field(None, description="Sidecar pods in the pool.")
    ready_sidecars: int | None = None
    dram_bytes: int | None = Field(None, description="DRAM lent by ready sidecars.")
    disk_bytes: int | None = Field(None, description="Disk lent by ready sidecars.")
    peers_service: str | None = None


# --------------------------------------------------------- DisaggregatedServing

class SecretKeyRef(Model):
    name: DNSName = Field(description="A Secret in the serving's namespace.")
    key: Annotated[str, Field(min_length=1)] = "token"


MODEL_URI_PATTERN = (r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+"       # a Hugging Face repo id
                     r"|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]/.+"               # a Cloud Storage prefix
                     r"|/.+)$")                                                     # an absolute path


class RopeScaling(Model):
    """RoPE scaling for a context longer than the model's max_position_embeddings: YaRN, as
    the model's card documents it (e.g. Qwen3: factor 4.0 over 32768 tokens for 131072, 2.0
    for 65536). vLLM gets it as --hf-overrides: rope_parameters (with ropeTheta: vLLM
    replaces the model's rope_parameters whole, and without rope_theta falls back to 10000)
    and max_position_embeddings = originalMaxPositionEmbeddings x factor, the length YaRN
    serves."""
    type: Literal["yarn"] = Field("yarn", description="The RoPE scaling method (rope_type).")
    factor: Annotated[float, Field(ge=1)] = Field(description="YaRN scaling factor.")
    original_max_position_embeddings: Annotated[int, Field(ge=1)] = Field(
        description="The context length the model was pretrained with (YaRN's original_max_position_embeddings).")
    rope_theta: Annotated[float, Field(ge=1)] = Field(
        description="The model's rope_theta (its config.json), kept in the rope_parameters vLLM is given.")


MAX_MODEL_LEN_UNDECLARED = ("spec.model.maxModelLen needs spec.model.maxPositionEmbeddings (max_position_embeddings "
                            "in the model's config.json) or spec.model.ropeScaling: the operator does not render a "
                            "length it cannot check against the model")
MAX_MODEL_LEN_TOO_LONG = ("spec.model.maxModelLen must not exceed spec.model.maxPositionEmbeddings without "
                          "spec.model.ropeScaling: the engine refuses to start with a longer context")
MAX_MODEL_LEN_BEYOND_SCALING = ("spec.model.maxModelLen must not exceed spec.model.ropeScaling."
                                "originalMaxPositionEmbeddings x factor, the length the RoPE scaling serves")
LENGTH_NEEDS_VLLM = ("spec.model.maxModelLen and spec.model.ropeScaling apply only to spec.engine.type vllm-tpu "
                     "(vLLM's --max-model-len and --hf-overrides); pass other engines their own flags in "
                     "spec.prefill.args / spec.decode.args")


class ModelRef(Model):
    """Where the weights come from. hf://ORG/NAME is a Hugging Face repo id, downloaded by the
    engine into the weights volume (spec.storage.weights); gs://BUCKET/PATH is streamed from
    Cloud Storage by vLLM's Run:ai model streamer (engine vllm-tpu only; the pod's Kubernetes
    service account needs read access, e.g. through Workload Identity); /PATH is a directory
    inside the engine container, e.g. on a weights volume of kind PersistentVolumeClaim."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.revision) || self.uri.startsWith('hf://')",
         "spec.model.revision applies only to hf:// models"),
        ("!has(self.tokenSecretRef) || self.uri.startsWith('hf://')",
         "spec.model.tokenSecretRef applies only to hf:// models"),
        ("!has(self.maxModelLen) || has(self.maxPositionEmbeddings) || has(self.ropeScaling)",
         MAX_MODEL_LEN_UNDECLARED),
        ("!has(self.maxModelLen) || !has(self.maxPositionEmbeddings) || has(self.ropeScaling) "
         "|| self.maxModelLen <= self.maxPositionEmbeddings", MAX_MODEL_LEN_TOO_LONG),
        ("!has(self.maxModelLen) || !has(self.ropeScaling) || double(self.maxModelLen) <= "
         "double(self.ropeScaling.originalMaxPositionEmbeddings) * self.ropeScaling.factor",
         MAX_MODEL_LEN_BEYOND_SCALING),
    ))
    # In the KV-event topic kv@<pod>:<port>@<model> that llm-d parses, and on engine command lines.
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/+-]*$")] = Field(
        description="Served model name (the OpenAI model id), e.g. Qwen/Qwen3-8B: letters, digits and . _ : / + -.")
    uri: Annotated[str, Field(min_length=1, max_length=1024, pattern=MODEL_URI_PATTERN)] = Field(
        description="Weights: hf://ORG/NAME (a Hugging Face repo id), gs://BUCKET/PATH, or an absolute path.")
    revision: GitRef | None = Field(
        None, description="hf:// only: the branch, tag or commit to load (engine --revision).")
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="hf:// only: a Secret key holding a Hugging Face token (gated or private models); "
                          "given to the engine as HF_TOKEN.")
    max_model_len: Annotated[int, Field(ge=1)] | None = Field(
        None, description="vllm-tpu: the context length (prompt and output tokens) the engines serve, vLLM's "
                          "--max-model-len; vLLM's default when empty (the model's). Needs maxPositionEmbeddings "
                          "or ropeScaling, and is refused beyond what they allow (the engine would not start).")
    max_position_embeddings: Annotated[int, Field(ge=1)] | None = Field(
        None, description="max_position_embeddings in the model's config.json (e.g. 40960 for Qwen3-235B-A22B): "
                          "the longest maxModelLen without ropeScaling.")
    rope_scaling: RopeScaling | None = Field(
        None, description="vllm-tpu: RoPE scaling (YaRN) for a maxModelLen beyond maxPositionEmbeddings, "
                          "rendered as vLLM's --hf-overrides.")


class VolumeSpec(Model):
    """A volume of an engine pod. EmptyDir: node ephemeral storage (the boot disk unless the
    node has local SSD) with a size limit; EphemeralVolume: a disk of storageClassName created
    with the pod and deleted with it; PersistentVolumeClaim: an existing claim (claimName),
    e.g. pre-staged weights, mounted read-only when it holds weights."""
    model_config = ConfigDict(json_schema_extra=cel(
        # has(): the API server also checks the rules against the field's default value.
        ("!has(self.medium) || self.medium != 'EphemeralVolume' || has(self.storageClassName)",
         "spec.storage.weights/compileCache: storageClassName is required when medium is EphemeralVolume"),
        ("!has(self.medium) || self.medium != 'PersistentVolumeClaim' || has(self.claimName)",
         "spec.storage.weights/compileCache: claimName is required when medium is PersistentVolumeClaim"),
    ))
    size: Quantity
    medium: Literal["EmptyDir", "EphemeralVolume", "PersistentVolumeClaim"] = "EmptyDir"
    storage_class_name: DNSSubdomain | None = None
    claim_name: DNSName | None = None


class Storage(Model):
    """Engine pod volumes besides the sidecar's tiers."""
    weights: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(size="256Gi"),
        description="Model weights, mounted at /models (HF_HOME=/models/huggingface). Size it for the checkpoint "
                    "plus headroom: a 235B bf16 model is ~470 GB. On TPU nodes prefer EphemeralVolume with a "
                    "Hyperdisk storage class over EmptyDir (the node's boot disk).",
        json_schema_extra={"default": {"size": "256Gi", "medium": "EmptyDir"}})
    compile_cache: VolumeSpec = Field(
        default_factory=lambda: VolumeSpec(size="32Gi"),
        description="XLA/JAX compile cache, mounted at /cache/xla (VLLM_XLA_CACHE_PATH, JAX_COMPILATION_CACHE_DIR): "
                    "compiled programs for every bucket size, several GiB per model and topology.",
        json_schema_extra={"default": {"size": "32Gi", "medium": "EmptyDir"}})


class Capabilities(Model):
    add: list[Annotated[str, Field(min_length=1)]] | None = None
    drop: list[Annotated[str, Field(min_length=1)]] | None = None


ENGINE_PRIVILEGED_ESCALATION = ("spec.engine.securityContext.privileged: true needs allowPrivilegeEscalation: true "
                                "(the operator's default is false, and Kubernetes refuses a privileged container "
                                "that may not escalate)")
ENGINE_NONROOT_UID = ("spec.engine.securityContext.runAsNonRoot: true needs a runAsUser other than 0: engines "
                      "with TPUs run as uid 0 by default (GKE documents TPU access for root containers)")


class EngineSecurityContext(Model):
    """Replaces fields of the engine container's securityContext (capabilities as a whole).
    By default an engine with TPUs runs as root (uid 0), not privileged, without privilege
    escalation, with seccomp RuntimeDefault and no capability but DAC_OVERRIDE (to open the
    sidecar's pool file and control socket, which belong to its uid 65532): GKE gives a
    container the TPU devices it requests without privileged mode (1.28 and later) and
    documents no access to them for another uid. Set runAsUser, runAsGroup and runAsNonRoot
    (and capabilities {drop: [ALL]}) where the nodes grant the devices to a non-root uid; add
    capabilities (e.g. IPC_LOCK) or privileged where a workload needs them. A cpuOnly engine
    runs as the pod's uid 65532 by default."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.privileged) || !self.privileged || "
         "(has(self.allowPrivilegeEscalation) && self.allowPrivilegeEscalation)", ENGINE_PRIVILEGED_ESCALATION),
    ))
    run_as_user: Annotated[int, Field(ge=0)] | None = None
    run_as_group: Annotated[int, Field(ge=0)] | None = None
    run_as_non_root: bool | None = None
    privileged: bool | None = None
    allow_privilege_escalation: bool | None = None
    capabilities: Capabilities | None = None


class EngineSpec(Model):
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.cpuOnly) || !self.cpuOnly || self.type == 'reference'",
         "spec.engine.cpuOnly is only valid with type reference"),
        ("!has(self.securityContext) || !has(self.securityContext.runAsNonRoot) || "
         "!self.securityContext.runAsNonRoot || (has(self.securityContext.runAsUser) ? "
         "self.securityContext.runAsUser != 0 : (has(self.cpuOnly) && self.cpuOnly))", ENGINE_NONROOT_UID),
    ))
    type: Literal["vllm-tpu", "sglang-jax", "reference"] = "vllm-tpu"
    image: ImageRef | None = Field(None, description="Engine image; a pinned default per type when empty.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    cpu_only: bool = Field(False, description="Reference engine only: request no TPUs (tests, kind/kwok).")
    env: list[EnvVar] | None = Field(
        None, description="Extra engine environment variables; values are taken as written ($(VAR) is not expanded).")
    security_context: EngineSecurityContext | None = Field(
        None, description="Fields of the engine container's securityContext to replace. By default engines with "
                          "TPUs run as root, not privileged, with no capability but DAC_OVERRIDE (GKE's documented "
                          "TPU access); cpuOnly engines as uid 65532.")


class PoolRef(Model):
    name: DNSName = Field(description="A TPUSyncPool in the same namespace.")


class RoleSpec(Model):
    replicas: Annotated[int, Field(ge=0)] = Field(
        1, description="Replicas of this role per unit of the serving: it runs spec.replicas times as many, "
                       "within minReplicas and maxReplicas (a multi-host replica is a whole slice).")
    min_replicas: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Fewest replicas of this role, whatever spec.replicas is.")
    max_replicas: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Most replicas of this role, whatever spec.replicas is.")
    pool_ref: PoolRef | None = Field(
        None, description="The TPUSyncPool this role runs on, when it is not spec.poolRef: another TPU type or "
                          "slice shape than the other role's (e.g. prefill on v7x, decode on v6e). KV moves "
                          "between the two pools' sidecars, so both must authenticate with one Secret "
                          "(spec.auth.secretName) and agree on spec.tiers.blockBytes and spec.sidecar.kvEventsPort; "
                          "connectors other than tpusync need the same slice shape on both roles.")
    topology: Topology | None = Field(None, description="TPU topology per replica; defaults to the role's pool's.")
    hosts_per_replica: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Hosts per replica; derived from the topology when empty. >1 uses a LeaderWorkerSet.")
    args: Annotated[list[EngineArg], Field(max_length=64)] | None = Field(
        None, description="Extra engine arguments, passed as written: Kubernetes does not expand $(VAR) in them "
                          "(nor in any other spec string the operator puts on a command line).")
    resources: Resources = sub(Resources, "Engine resources (TPU chips are added).")


class KVTransfer(Model):
    connector: Literal["tpusync", "tpu-inference", "tpu-sync-compatible", "sglang-jax"] = Field(
        "tpusync", description="tpusync: tpusync's data path (the reference engine's; for vllm-tpu, tpusync's "
                               "connector for tpu-inference: P/D and the DRAM/disk prefix tiers through the "
                               "pool's sidecars; each tensor-parallel shard of a block stored and pulled as a part "
                               "of its own, on each host's sidecar of a multi-host slice). "
                               "tpu-inference: tpu_inference's own TPUConnector (vllm-tpu only; "
                               "P/D only, with the fix vLLM 0.32 needs for correct decode tokens). "
                               "tpu-sync-compatible: tpu_inference's own connector for upstream TPU Sync "
                               "(tpu_raiden_connector, P/D) running on tpusync's sidecars through tpusync.upstream "
                               "(vllm-tpu only; docs/migrating.md). "
                               "sglang-jax: sglang-jax's own P/D (a bootstrap registry per serving, "
                               "jax.experimental.transfer); required by, and only for, engine sglang-jax.")


class PrefixCache(Model):
    host_dram: Quantity | None = Field(None, description="Host-DRAM prefix cache per pod; the pool's dram when empty.")
    disk: Quantity | None = Field(None, description="Disk prefix cache per pod; the pool's spec.tiers.disk.size when "
                                                     "empty (none when the pool has no disk tier).")


class ScorerWeights(Model):
    prefix_cache: Annotated[float, Field(ge=0)] = 2.0
    queue: Annotated[float, Field(ge=0)] = 1.0
    kv_cache_utilization: Annotated[float, Field(ge=0)] = 1.0


class GatewayRef(Model):
    name: DNSName
    namespace: DNSName | None = None
    section_name: DNSName | None = None


class Objective(Model):
    priority: int = 0


# The routing proxy's --kv-connector values: supportedKVConnectors in llm-d-router's
# pkg/sidecar/proxy/options.go (versions.ROUTING_PROXY.values, checked against it by test_versions.py).
ProxyKVConnector = Literal["mooncake", "nixlv2", "offloading", "sglang", "shared-storage"]


class Routing(Model):
    """llm-d routing: endpoint picker, InferencePool, InferenceObjective, HTTPRoute."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("!has(self.gatewayRef) || self.enabled", "spec.routing.gatewayRef requires spec.routing.enabled"),
        ("!has(self.gkeGatewayPolicies) || !self.gkeGatewayPolicies || self.enabled",
         "spec.routing.gkeGatewayPolicies requires spec.routing.enabled"),
        ("!has(self.eppHighAvailability) || self.eppHighAvailability != 'ActiveActive' || "
         "!has(self.precisePrefixCache) || self.precisePrefixCache",
         "spec.routing.eppHighAvailability ActiveActive needs spec.routing.precisePrefixCache: replicas share no "
         "approximate prefix state (llm-d-router docs/operations.md)"),
        ("!has(self.eppHighAvailability) || self.eppHighAvailability != 'ActiveActive' || "
         "(self.enabled && self.eppReplicas > 1)",
         "spec.routing.eppHighAvailability ActiveActive needs spec.routing.enabled and spec.routing.eppReplicas above "
         "1: with one endpoint picker, or none, there is nothing to run active-active"),
    ))
    enabled: bool = True
    scorer_weights: ScorerWeights = sub(ScorerWeights, "Scheduling profile scorer weights.")
    pd_threshold_tokens: Annotated[int, Field(ge=0)] = Field(
        16, description="prefix-based-pd-decider nonCachedTokens: disaggregate above this many uncached tokens.")
    precise_prefix_cache: bool = Field(True, description="Route on KV events from the sidecars (port 5557).")
    block_size_tokens: Annotated[int, Field(ge=1)] = Field(
        16, description="llm-d's block size in tokens. It must divide the page size of every engine the serving "
                        "runs (the reference engine's pages are 32 tokens, sglang-jax's 128), or prefixes drop out of "
                        "llm-d's index (docs/block-keys.md).")
    gateway_ref: GatewayRef | None = None
    objective: Objective = sub(Objective, "InferenceObjective priority.")
    gke_gateway_policies: bool = Field(
        False, description="The Gateway is GKE's: create its HealthCheckPolicy (HTTP /health on the serving port) "
                           "and GCPBackendPolicy (300 s timeout) for the InferencePool (GKE's default health check "
                           "gets 404 from a model server and marks every backend unhealthy), and leave the "
                           "HTTPRoute's timeouts out (GKE's Gateway does not admit them; elsewhere 300 s).")
    epp_image: ImageRef = Field(EPP.image, description="llm-d endpoint picker image; its flags and plugin types are "
                                                  f"those of llm-d-router {EPP.version}.")
    proxy_image: ImageRef = Field(ROUTING_PROXY.image, description="llm-d P/D routing proxy (decode pods); flags of "
                                                              f"llm-d-router {ROUTING_PROXY.version}.")
    epp_replicas: Annotated[int, Field(ge=1, le=5)] = Field(
        2, description="Endpoint picker replicas, each on a node of its own (required pod anti-affinity on the "
                       "hostname). With more than one, the router keeps routing while a replica restarts.")
    epp_high_availability: Literal["ActivePassive", "ActiveActive"] = Field(
        "ActivePassive", description="With eppReplicas above 1: ActivePassive (llm-d's default) runs the router's "
                                     "leader election, only the leader is ready and routes, a standby takes its "
                                     "lease when it stops; ActiveActive routes on every replica (precise prefix "
                                     "cache only) and adds a PodDisruptionBudget of one.")
    proxy_kv_connector: ProxyKVConnector | None = Field(
        None, description="P/D protocol the decode routing proxy speaks (the --kv-connector values of llm-d-router "
                          f"{ROUTING_PROXY.version}); when empty: sglang for engine sglang-jax, nixlv2 "
                          "(kv_transfer_params) otherwise. sglang is the protocol of, and only of, sglang-jax.")


class Rollout(Model):
    """How a change to the engine pods (image, args, model revision, connector) reaches them."""
    model_config = ConfigDict(json_schema_extra=cel(
        ("(has(self.maxSurge) ? self.maxSurge : 0) + (has(self.maxUnavailable) ? self.maxUnavailable : 1) >= 1",
         "spec.rollout: maxSurge + maxUnavailable must be at least 1, or a rollout cannot make progress"),
    ))
    strategy: Literal["Independent", "Lockstep"] = Field(
        "Independent", description="Independent: each role's Deployment or LeaderWorkerSet rolls on its own, so "
                                   "for a while new prefill pods pair with old decode pods. Lockstep: one "
                                   "DisaggregatedSet (LeaderWorkerSet v0.9.0 or later) rolls both roles as a pair, "
                                   "every pod carries its revision, and the endpoint picker pairs prefill and "
                                   "decode of one revision only (llm-d's disaggregatedset-rollout-screener), so KV "
                                   "written by one revision is never loaded by another. Changing the strategy "
                                   "replaces the engine pods.")
    max_surge: Annotated[int, Field(ge=0)] = Field(
        0, description="Replicas of a role above its target during a rollout (TPU hosts are scarce: 0 replaces in "
                       "place, and a single-unit Lockstep serving is unavailable while it rolls).")
    max_unavailable: Annotated[int, Field(ge=0)] = Field(
        1, description="Replicas of a role below its target during a rollout.")


LOCKSTEP_NEEDS_BOTH_ROLES = ("spec.rollout.strategy Lockstep needs spec.prefill.replicas and spec.decode.replicas "
                             "above 0: it rolls a prefill/decode pair")
GS_NEEDS_VLLM = ("spec.model.uri: gs:// models are streamed by vLLM's Run:ai model streamer (spec.engine.type "
                 "vllm-tpu); for other engines stage the weights on a PersistentVolumeClaim "
                 "(spec.storage.weights) and give their path")
SGLANG_IMAGE_REQUIRED = ("spec.engine.image is required with spec.engine.type sglang-jax: its P/D is on its main "
                         "branch only (no release has it), so name an image built from it")


def _owned_flag_rule(role: str) -> tuple[str, str, str]:
    """(rule, message, messageExpression): spec.<role>.args sets no flag the operator renders."""
    pattern = " : ".join(f"self.engine.type == '{engine}' ? '{flag_pattern(engine)}'" for engine in OWNED_FLAGS)
    pattern = f"({pattern} : '^$')"
    owned = "; ".join(f"{engine}: {' '.join(flags)}" for engine, flags in OWNED_FLAGS.items())
    return (f"!has(self.{role}.args) || self.{role}.args.all(a, !a.matches({pattern}))",
            f"spec.{role}.args must not set a flag the operator renders from the spec ({owned})",
            f"'spec.{role}.args: ' + self.{role}.args.filter(a, a.matches({pattern}))[0].split('=')[0] + "
            f"' is rendered by the operator from the spec (the engine would take the last value); set it there'")


REVISION_NEEDS_WEIGHTS = ("spec.model.revision does not apply to spec.engine.type reference: its model is built in "
                          "(it loads no weights from spec.model.uri)")
ROLE_POOLS_BOTH = ("spec.prefill.poolRef and spec.decode.poolRef: set at most one; the other role runs on "
                   "spec.poolRef")
SGLANG_SINGLE_HOST = ("spec.prefill/decode.hostsPerReplica must be 1 with spec.engine.type sglang-jax: the operator "
                      "runs sglang-jax on single-host slices only")
DECODE_CLAMPED_OFF = ("spec.decode.maxReplicas: 0 with spec.decode.replicas above 0 runs no decode pod, and the "
                      "serving's endpoint is its decode pods: it would answer 503 to every request (set "
                      "spec.decode.replicas: 0 for a prefill-only serving)")
NO_ROLE_RUNS = ("spec.prefill and spec.decode: their replicas, minReplicas and maxReplicas leave no replica of either "
                "role at any spec.replicas: nothing would serve")
LOCKSTEP_ALL_OR_NONE = ("spec.rollout.strategy Lockstep runs every role or none (LWS v0.9.0's DisaggregatedSet: "
                        "replicas must be zero for all roles or non-zero for all roles): spec.prefill.minReplicas and "
                        "spec.decode.minReplicas must both be above 0 or both 0 (or unset), and neither role's "
                        "maxReplicas 0")
SGLANG_ONE_PREFILL = ("spec.prefill: at most one prefill replica with spec.engine.type sglang-jax (spec.replicas x "
                      "spec.prefill.replicas, within spec.prefill.minReplicas and maxReplicas): its decode pulls KV "
                      "from prefills[bootstrap_room % N], not from the prefill pod the router chose; set "
                      "spec.prefill.maxReplicas: 1 to scale decode alone")
PROXY_SGLANG_PAIR = ("spec.routing.proxyKvConnector: sglang is the P/D protocol of spec.engine.type sglang-jax, and "
                     "sglang-jax speaks only it")


def _role_off(role: str) -> str:
    """CEL: the role runs no replica at any spec.replicas of 1 or more."""
    r = f"self.{role}"
    return (f"((has({r}.maxReplicas) && {r}.maxReplicas == 0) || "
            f"({r}.replicas == 0 && (!has({r}.minReplicas) || {r}.minReplicas == 0)))")


def _min_above_0(role: str) -> str:
    return f"(has(self.{role}.minReplicas) && self.{role}.minReplicas > 0)"


_LOCKSTEP = "has(self.rollout) && has(self.rollout.strategy) && self.rollout.strategy == 'Lockstep'"


class DisaggregatedServingSpec(Model):
    model_config = ConfigDict(json_schema_extra=cel(
        ("self.prefill.replicas + self.decode.replicas > 0",
         "spec.prefill.replicas + spec.decode.replicas must be at least 1"),
        ("!has(self.prefill.minReplicas) || !has(self.prefill.maxReplicas) || "
         "self.prefill.minReplicas <= self.prefill.maxReplicas",
         "spec.prefill.minReplicas must not exceed spec.prefill.maxReplicas"),
        ("!has(self.decode.minReplicas) || !has(self.decode.maxReplicas) || "
         "self.decode.minReplicas <= self.decode.maxReplicas",
         "spec.decode.minReplicas must not exceed spec.decode.maxReplicas"),
        ("self.kvTransfer.connector != 'tpu-inference' || self.engine.type == 'vllm-tpu'",
         "spec.kvTransfer.connector tpu-inference needs spec.engine.type vllm-tpu"),
        ("self.kvTransfer.connector != 'tpu-sync-compatible' || self.engine.type == 'vllm-tpu'",
         "spec.kvTransfer.connector tpu-sync-compatible needs spec.engine.type vllm-tpu"),
        ("(self.kvTransfer.connector == 'sglang-jax') == (self.engine.type == 'sglang-jax')",
         "spec.kvTransfer.connector: sglang-jax is required by spec.engine.type sglang-jax (it transfers KV "
         "with its own P/D) and valid only with it"),
        # Another engine means other workloads, ports and helpers (sglang-jax's registry):
        # re-creating the serving replaces them all and leaves nothing behind.
        ("self.engine.type == oldSelf.engine.type",
         "spec.engine.type is immutable: delete and re-create the serving to change engines"),
        ("self.engine.type != 'sglang-jax' || has(self.engine.image)", SGLANG_IMAGE_REQUIRED),
        ("!self.model.uri.startsWith('gs://') || self.engine.type == 'vllm-tpu'", GS_NEEDS_VLLM),
        ("!has(self.model.revision) || self.engine.type != 'reference'", REVISION_NEEDS_WEIGHTS),
        ("self.engine.type != 'sglang-jax' || !self.routing.enabled || !self.routing.precisePrefixCache",
         "spec.routing.precisePrefixCache must be false with spec.engine.type sglang-jax: it publishes no KV events"),
        ("(!has(self.model.maxModelLen) && !has(self.model.ropeScaling)) || self.engine.type == 'vllm-tpu'",
         LENGTH_NEEDS_VLLM),
        ("!has(self.rollout) || !has(self.rollout.strategy) || self.rollout.strategy != 'Lockstep' || "
         "(self.prefill.replicas > 0 && self.decode.replicas > 0)", LOCKSTEP_NEEDS_BOTH_ROLES),
        ("self.engine.type != 'sglang-jax' || ((!has(self.prefill.hostsPerReplica) || "
         "self.prefill.hostsPerReplica == 1) && (!has(self.decode.hostsPerReplica) || "
         "self.decode.hostsPerReplica == 1))", SGLANG_SINGLE_HOST),
        ("!has(self.prefill.poolRef) || !has(self.decode.poolRef)", ROLE_POOLS_BOTH),
        _owned_flag_rule("prefill"), _owned_flag_rule("decode"),
        ("!has(self.decode.maxReplicas) || self.decode.maxReplicas > 0 || self.decode.replicas == 0",
         DECODE_CLAMPED_OFF),
        (f"!({_role_off('prefill')} && {_role_off('decode')})", NO_ROLE_RUNS),
        (f"!({_LOCKSTEP}) || ({_min_above_0('prefill')} == {_min_above_0('decode')} && "
         "(!has(self.prefill.maxReplicas) || self.prefill.maxReplicas > 0) && "
         "(!has(self.decode.maxReplicas) || self.decode.maxReplicas > 0))", LOCKSTEP_ALL_OR_NONE),
        ("self.engine.type != 'sglang-jax' || ((self.replicas * self.prefill.replicas <= 1 || "
         "(has(self.prefill.maxReplicas) && self.prefill.maxReplicas <= 1)) && "
         "(!has(self.prefill.minReplicas) || self.prefill.minReplicas <= 1))", SGLANG_ONE_PREFILL),
        ("!has(self.routing.proxyKvConnector) || "
         "(self.routing.proxyKvConnector == 'sglang') == (self.engine.type == 'sglang-jax')", PROXY_SGLANG_PAIR),
    ))
    model: ModelRef
    engine: EngineSpec = sub(EngineSpec, "Inference engine.")
    pool_ref: PoolRef = Field(description="The TPUSyncPool the serving runs on; a role with a poolRef of its own "
                                          "runs on that one.")
    replicas: Annotated[int, Field(ge=0)] = Field(
        1, description="Units of the serving, each spec.prefill.replicas prefill and spec.decode.replicas decode "
                       "replicas, so scaling keeps their ratio (within each role's bounds). The /scale "
                       "subresource: `kubectl scale` and a HorizontalPodAutoscaler set it.")
    prefill: RoleSpec = sub(RoleSpec, "Prefill role.")
    decode: RoleSpec = sub(RoleSpec, "Decode role.")
    kv_transfer: KVTransfer = sub(KVTransfer, "KV transfer between roles.")
    prefix_cache: PrefixCache = sub(PrefixCache, "Prefix cache offload.")
    routing: Routing = sub(Routing, "llm-d routing.")
    storage: Storage = sub(Storage, "Weights and compile-cache volumes of the engine pods.")
    rollout: Rollout = sub(Rollout, "How prefill and decode roll forward when the engine pods change.")
    port: Port = 8000

    def role(self, role: str) -> RoleSpec:
        """spec.prefill or spec.decode."""
        return self.prefill if role == "prefill" else self.decode


class RoleStatus(Model):
    kind: str | None = None
    replicas: int = 0
    ready_replicas: int = 0


class RevisionStatus(Model):
    revision: str
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    decode: RoleStatus = Field(default_factory=RoleStatus)


class RolloutStatus(Model):
    strategy: str
    revision: str | None = Field(None, description="Lockstep: the newest revision, the one being rolled to.")
    revisions: list[RevisionStatus] = Field(
        default_factory=list, description="Lockstep: every revision with pods, newest first; more than one while "
                                          "a rollout drains the older ones.")


class KVCounters(Model):
    """A role's KV-path counters, summed over its serving pods (tpusync_kv_*_total on each engine's /metrics)."""
    requests: int = 0
    handoffs: int = Field(0, description="Requests that came with a prefill engine's kv_transfer_params.")
    refused_handoffs: int = 0
    pulled_blocks: int = 0
    pull_failures: int = 0
    loaded_blocks: int = Field(0, description="Blocks loaded from the store instead of computed.")
    recomputed_blocks: int = Field(0, description="Blocks whose load failed, computed again.")
    saved_blocks: int = 0


class KVPathStatus(Model):
    """What the serving's engines say their KV path did; the KVPath condition judges the change
    between two passes."""
    prefill: KVCounters | None = None
    decode: KVCounters | None = None
    engines_read: int = Field(0, description="Serving pods whose counters were read at the last pass.")
    engines_unread: int = Field(0, description="Serving pods that could not be read.")


class DisaggregatedServingStatus(Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_MAP_LIST)
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None
    endpoint: str | None = None
    routing_ready: bool | None = None
    replicas: int | None = Field(None, description="Units running at the last pass (spec.replicas as applied).")
    selector: str | None = Field(None, description="For the /scale subresource, what an autoscaler measures: one "
                                                   "pod per unit, the serving pods of the role with fewer replicas "
                                                   "per unit (decode on a tie).")
    rollout: RolloutStatus | None = None
    kv_path: KVPathStatus | None = Field(None, description="The KV path's counters, read from the engines.")
