"""KVStore: the block store API that every tpusync backend offers.

- `KVStore.local(...)` runs the native engine in this process: a shared-memory DRAM pool
  (which survives a restart of this process) in front of an optional disk tier. It is the
  embedded default used by the tests and the demo, with no sidecar.
- `KVStore.connect("unix:///run/tpusync/control.sock")` talks to the sidecar in this pod:
  blocks are copied straight into and out of the sidecar's shared-memory pool.
- `KVStore.connect("tpusync://host:port", secret=...)` talks to a sidecar's data port.
"""


from __future__ import annotations

import contextlib
import enum
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from tpusync import _native, errors

Keys = Any  # Sequence[int | bytes] or a numpy uint64 array of shape (n, 2)


class Tier(enum.IntEnum):
    """Where a block lives; LookupResult.tiers holds these codes as uint8."""

    NONE = 0
    DRAM = 1
    DISK = 2
    DRAM_AND_DISK = 3


class LookupResult(NamedTuple):
    prefix_len: int
    """How many leading keys are present in some tier."""
    tiers: np.ndarray
    """Per key, a Tier code (uint8): NONE, DRAM, DISK or DRAM_AND_DISK."""


class KVStore:
    """A content-addressed store of fixed-size blocks keyed by 128-bit hashes.

    Thread-safe. Calls that copy or touch the disk release the GIL. Keys are ints in
    [0, 2**128), 16-byte big-endian bytes, or a uint64 array of shape (n, 2) [hi, lo].
    Buffers are any objects with the buffer protocol (numpy arrays, bytearrays, memoryviews,
    CPU jax arrays through ``np.asarray``); nothing is copied on the way to the engine.
    """

    def __init__(self, native: Any, *, secret: bytes | None = None, streams: int = 4,
                 private_pool: str | None = None) -> None:
        self._native = native
        self._private_pool = private_pool  # a pool file of our own, removed (with its side files) on close
        self._secret = secret
        self._streams = streams
        self._peers: dict[str, _native.PeerClient] = {}

    @classmethod
    def local(
        cls,
        *,
        dram_bytes: int,
        block_bytes: int,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        pool_path: str | os.PathLike[str] | None = None,
        hugepages: bool = False,
        mlock: bool = False,
        io_threads: int = 2,
        secret: bytes | None = None,
        streams: int = 4,
    ) -> KVStore:
        """Opens an in-process store.

        With ``pool_path`` the DRAM pool lives in that shared-memory file and survives the
        process: opening the same path again finds every committed block. Without it a
        private file under /dev/shm is used and removed on close. ``disk_dir`` adds a disk
        tier of ``disk_bytes`` that evicted blocks are written behind to. ``secret`` is the
        pool's shared secret, needed by read_remote() to authenticate to peers.
        """
        if block_bytes <= 0 or dram_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"dram_bytes ({dram_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        if disk_dir is not None and disk_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"disk_bytes ({disk_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        private = pool_path is None
        path = os.fspath(pool_path) if pool_path else f"/dev/shm/tpusync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        native = _native.Store(
            path,
            block_bytes=block_bytes,
            num_slots=dram_bytes // block_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else None,
            disk_bytes=disk_bytes,
            hugepages=hugepages,
            mlock=mlock,
            unlink_on_close=private,
            io_threads=io_threads,
        )
        return cls(native, secret=secret, streams=streams, private_pool=path if private else None)

    @classmethod
    def connect(cls, url: str, *, secret: bytes | None = None, secret_file: str | os.PathLike[str] | None = None,
                streams: int = 4, timeout: float = 300.0) -> KVStore:
        """Connects to a sidecar: ``unix:///path/control.sock`` (this pod) or ``tpusync://host:port``.

        The data port needs the pool's shared secret (``secret`` or ``secret_file``); the control
        socket is protected by file permissions instead.
        """
        if secret_file is not None:
            secret = _read_secret(secret_file)
        if url.startswith("unix://"):
            return cls(_native.SidecarClient(url[len("unix://"):], timeout_ms=int(timeout * 1000)))
        if url.startswith("tpusync://"):
            if secret is None:
                raise errors.InvalidArgumentError("tpusync:// needs the pool's shared secret (secret= or secret_file=)")
            client = _native.PeerClient(url[len("tpusync://"):], secret=secret, streams=streams,
                                        timeout_ms=int(timeout * 1000))
            return cls(_RemoteBackend(client))
        raise errors.InvalidArgumentError(f"unsupported store URL {url!r}: use unix://PATH or tpusync://HOST:PORT")

    # -- blocks ---------------------------------------------------------------------------

    def put(self, keys: Keys, buffers: Sequence[Any]) -> None:
        """Stores each buffer (1..block_bytes bytes) under its key. Present keys are skipped.

        Raises CapacityError when DRAM is full of pinned blocks; blocks stored before that
        stay stored.
        """
        self._native.put(keys, buffers)

    def get(self, keys: Keys, buffers: Sequence[Any]) -> list[bool]:
        """Copies each present block into its writable buffer; returns which were found.

        A disk block that fails its checksum is reported in stats() and counted as a miss.
        """
        found: list[bool] = self._native.get(keys, buffers)
        return found

    def lookup(self, keys: Keys, *, pin: bool = False) -> LookupResult:
        """Returns the present prefix length and per-key tiers; pins the prefix if asked."""
        prefix_len, tiers = self._native.lookup(keys, pin=pin)
        return LookupResult(prefix_len, tiers)

    def pin(self, keys: Keys, *, for_host: bool = False) -> None:
        """Keeps blocks from eviction until released. NotFoundError if any key is absent.

        Through a sidecar, pins belong to this connection and go when it closes (an engine
        that crashes holds nothing); for_host=True pins for the host instead, until some
        client releases them for_host. An in-process store's pins are always the host's.
        """
        self._native.pin(keys, for_host=for_host)

    def release(self, keys: Keys, *, for_host: bool = False) -> None:
        """Drops one pin per key. PreconditionError if any key is not pinned (through a sidecar:
        by this connection, or with for_host, for the host)."""
        self._native.release(keys, for_host=for_host)

    def evict(self, keys: Keys) -> None:
        """Moves blocks one tier down now: DRAM to disk (or out without a disk tier), disk out."""
        self._native.evict(keys)

    def flush(self) -> None:
        """Waits for write-behind to disk; raises the first demotion error since the last flush."""
        self._native.flush()

    def stats(self) -> dict[str, Any]:
        """Occupancy, hit and eviction counters, integrity and I/O error counts."""
        stats: dict[str, Any] = self._native.stats()
        return stats

    # -- peers ----------------------------------------------------------------------------

    def read_remote(self, peer: str, keys: Keys) -> list[bool]:
        """Pulls the blocks this store lacks from a peer sidecar ("host:port" or tpusync://...).

        Only missing blocks travel (prefix-aware). Returns, per key, whether the block is held
        locally afterwards. A dead peer raises UnavailableError after the blocks that did
        arrive were kept; nothing partial is ever stored.
        """
        held: list[bool] = self._pull(peer, keys, digests=False)
        return held

    def read_remote_digests(self, peer: str, keys: Keys) -> tuple[list[bool], list[bool], np.ndarray]:
        """read_remote, and what landed: (held, landed, digests). landed[i] is True for the
        blocks that arrived in this pull, and digests[i] is then the XXH3-64 of the bytes that
        landed, computed as they arrived, so they can be checked against known checksums
        without a second pass over them."""
        landed: tuple[list[bool], list[bool], np.ndarray] = self._pull(peer, keys, digests=True)
        return landed

    def _pull(self, peer: str, keys: Keys, *, digests: bool) -> Any:
        peer = peer.removeprefix("tpusync://")
        if isinstance(self._native, _native.SidecarClient):
            return self._native.read_remote_digests(peer, keys) if digests else self._native.read_remote(peer, keys)
        if isinstance(self._native, _RemoteBackend):
            raise errors.PreconditionError(
                "read_remote needs a local store or the pod's sidecar, not a data-port client")
        if self._secret is None:
            raise errors.PreconditionError("read_remote needs the pool's secret: KVStore.local(secret=...)")
        try:
            return self._native.pull_from(self._peer(peer), keys, digests=digests)
        except errors.UnavailableError:
            self._peers.pop(peer, None)  # reconnect next time
            raise

    def _peer(self, peer: str) -> Any:
        client = self._peers.get(peer)
        if self._secret is None:  # the callers check first, with their own message
            raise errors.PreconditionError("a peer needs the pool's secret: KVStore.local(secret=...)")
        if client is None:
            client = self._peers[peer] = _native.PeerClient(peer, secret=self._secret, streams=self._streams)
        return client

    def exists_remote(self, peer: str, keys: Keys) -> list[bool]:
        """Whether a peer sidecar holds each block (any tier); nothing moves."""
        peer = peer.removeprefix("tpusync://")
        if isinstance(self._native, _native.SidecarClient):
            return [bool(t) for t in self._native.exists_remote(peer, keys)]
        if isinstance(self._native, _RemoteBackend) or self._secret is None:
            raise errors.PreconditionError("exists_remote needs the pod's sidecar or KVStore.local(secret=...)")
        try:
            return [bool(t) for t in self._peer(peer).exists(keys)]
        except errors.UnavailableError:
            self._peers.pop(peer, None)
            raise

    # -- zero-copy ------------------------------------------------------------------------

    def reserve(self, key: int | bytes) -> _native.WriteLease:
        """Reserves a DRAM slot to write in place (``memoryview(lease)``), then ``lease.commit(n)``."""
        lease: _native.WriteLease = self._native.reserve(key)
        return lease

    def acquire(self, key: int | bytes) -> _native.ReadLease:
        """Holds a block in DRAM and exposes it read-only in place; drop the lease to release."""
        lease: _native.ReadLease = self._native.acquire(key)
        return lease

    @contextlib.contextmanager
    def reserve_many(self, keys: Sequence[int | bytes]) -> Iterator[list[_Slot | None]]:
        """Slots to write blocks in place: ``np.frombuffer(slot.view, ...)``, fill, ``slot.commit(n)``.

        None for keys already stored. Committed slots are published when the block exits;
        the others are given back. CapacityError if no slot can be had.
        """
        keys = list(keys)
        if isinstance(self._native, _native.SidecarClient):
            slots = [None if v is None else _Slot(v) for v in self._native.reserve(keys)]
            try:
                yield slots
            finally:
                for s in slots:
                    if s is not None:
                        s.view.release()
                done = [(k, s.length) for k, s in zip(keys, slots) if s is not None and s.length]
                self._native.abort([k for k, s in zip(keys, slots) if s is not None and not s.length])
                self._native.commit([k for k, _ in done], [n for _, n in done])
            return
        leases: list[Any] = []
        for key in keys:
            try:
                leases.append(self._native.reserve(key))
            except errors.PreconditionError:
                leases.append(None)  # already stored
        slots = [None if lease is None else _Slot(memoryview(lease), lease) for lease in leases]
        try:
            yield slots
        finally:
            for slot in slots:
                if slot is not None and slot.length:
                    slot.lease.commit(slot.length)
                if slot is not None:
                    slot.view.release()
            del leases, slots  # uncommitted leases give their slots back

    @contextlib.contextmanager
    def acquire_many(self, keys: Sequence[int | bytes]) -> Iterator[list[memoryview | None]]:
        """Read-only views of present blocks, held in DRAM until the block exits; None if absent."""
        keys = list(keys)
        sidecar = isinstance(self._native, _native.SidecarClient)
        leases: list[Any] = []
        if sidecar:
            views = self._native.acquire(keys)
        else:
            for key in keys:
                try:
                    leases.append(self._native.acquire(key))
                except errors.NotFoundError:
                    leases.append(None)
            views = [None if lease is None else memoryview(lease) for lease in leases]
        try:
            yield views
        finally:
            for view in views:
                if view is not None:
                    view.release()
            if sidecar:
                self._native.unacquire([k for k, v in zip(keys, views) if v is not None])
            leases.clear()  # local leases give their blocks back

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        block_bytes: int = self._native.block_bytes
        return block_bytes

    @property
    def pool_path(self) -> str:
        path: str = self._native.pool_path
        return path

    def close(self) -> None:
        """Unmaps the pool. A store opened with pool_path keeps its blocks for the next open."""
        self._peers.clear()
        if hasattr(self._native, "close"):
            self._native.close()
            if self._private_pool:  # e.g. the weight synchronizer's head files beside the pool
                shutil.rmtree(self._private_pool + ".weights", ignore_errors=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class _Slot:
    """A reserved block slot: write through ``view``, then ``commit(length)``."""

    def __init__(self, view: memoryview, lease: Any = None):
        self.view = view
        self.lease = lease
        self.length = 0

    def commit(self, length: int) -> None:
        if not 0 < length <= len(self.view):
            raise errors.InvalidArgumentError(f"commit: length {length} outside 1..{len(self.view)}")
        self.length = length


def _read_secret(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        return f.read().rstrip(b"\r\n")


class _RemoteBackend:
    """The KVStore surface over a sidecar's data port: put pushes, get pulls, lookup asks."""

    def __init__(self, client: _native.PeerClient):
        self._client = client
        self.block_bytes = client.block_bytes
        self.pool_path = None

    def put(self, keys: Keys, buffers: Sequence[Any]) -> None:
        stored = self._client.push(keys, buffers)
        if not all(stored):
            raise errors.CapacityError(f"the peer stored {sum(stored)} of {len(stored)} blocks (DRAM full of pins?)")

    def get(self, keys: Keys, buffers: Sequence[Any]) -> list[bool]:
        return self._client.pull(keys, buffers)

    def lookup(self, keys: Keys, *, pin: bool = False) -> tuple[int, np.ndarray]:
        if pin:
            raise errors.PreconditionError(
                "pins are held through the pod's control socket (unix://), not the data port")
        tiers = self._client.exists(keys)
        missing = np.flatnonzero(tiers == Tier.NONE)
        return (int(missing[0]) if missing.size else len(tiers)), tiers

    def _local_only(self, *_: Any, **__: Any) -> None:
        raise errors.PreconditionError("this operation needs the pod's control socket (unix://), not the data port")

    pin = release = evict = _local_only

    def flush(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"block_bytes": self.block_bytes, "peer": self._client.address}
