"""Which weights an engine serves, for the keys of the KV blocks it saves and loads.

KV computed under one version of the weights must never be loaded by an engine serving
another: after an in-place update (tpusync.engines.vllm.weight_transfer) the connector keys blocks
under the version loaded, so engines on the same version share them and no engine finds
blocks of another. The weight-transfer backend runs in the workers and the connector's
scheduler half, which keys blocks, in the engine core, maybe another process: the version
travels in a file named by the engine's id. An engine updated by another backend gets a
fresh key space each time vLLM resets the connector (it does on pause with clear_cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid


def _path(engine_id: str) -> str:
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"tpusync-served-weights-{digest}")


def record(engine_id: str, identity: str) -> None:
    """The engine now serves the weights `identity` names (model, version and manifest digest)."""
    path = _path(engine_id)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(identity)
    os.replace(tmp, path)


def forget(engine_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(engine_id))


class ServedWeights:
    """The connector's view: the tag to key blocks under (None: the weights the engine started with)."""

    def __init__(self, engine_id: str) -> None:
        self._path = _path(engine_id)
        self._stamp: tuple[int, int] | None = None
        self._recorded: str | None = None
        self._epoch: str | None = None

    def tag(self) -> str | None:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return self._epoch
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            with open(self._path) as f:
                self._recorded, self._stamp = f.read(), stamp
        return self._recorded

    def reset(self) -> None:
        """vLLM reset the connector: unless a tpusync update names the weights, key apart from now on."""
        self._epoch = f"epoch:{uuid.uuid4().hex}"
