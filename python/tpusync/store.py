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
from tpusync.backend import BlockBackend, Keys


class Tier(enum.IntEnum):
    """Where a block lives; LookupResult.tiers holds these codes as uint8."""

    NONE = 0
    DRAM = 1
    DISK = 2
    DRAM_AND_DISK = 3
    SHARED = 4  # only on the shared tier (a filesystem every host of the pool mounts)


class LookupResult(NamedTuple):
    prefix_len: int
    """How many leading keys are present in some tier."""
    tiers: np.ndarray
    """Per key, a Tier code (uint8): NONE, DRAM, DISK or DRAM_AND_DISK."""


class Changes(NamedTuple):
    """What `KVStore.changes` found after a cursor: pass `cursor` to the next call."""

    cursor: tuple[int, int]
    """(epoch, seq): the store instance and the position of the next change."""
    lost: bool
    """Changes were missed (a cursor of another store instance, or one that fell too far
    behind): reread every block of interest."""
    keys: list[int]
    """Keys whose tier changed (entered or left DRAM or the disk, removed from the shared tier
    by this store, or found published or removed there by another host at a scan), oldest
    first; a key may repeat."""


class KVStore:
    """A content-addressed store of fixed-size blocks keyed by 128-bit hashes.

    Thread-safe. Calls that copy or touch the disk release the GIL. Keys are ints in
    [0, 2**128), 16-byte big-endian bytes, or a uint64 array of shape (n, 2) [hi, lo].
    Buffers are any objects with the buffer protocol (numpy arrays, bytearrays, memoryviews,
    CPU jax arrays through ``np.asarray``); nothing is copied on the way to the engine.

    Every backend serves the same contract (tpusync.backend.BlockBackend); what one cannot
    do (the data port has no pool here: no pins, slots or transfers between peers) raises
    PreconditionError saying why.
    """

    def __init__(self, backend: BlockBackend, *, private_pool: str | None = None) -> None:
        self._backend = backend
        self._private_pool = private_pool  # a pool file of our own, removed (with its side files) on close

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
        encrypt: bool = False,
        shared_dir: str | os.PathLike[str] | None = None,
        shared_layout: str = "",
        shared_bytes: int = 0,
        shared_policy: str = "write-through",
        shared_scan_interval_s: float = 10.0,
    ) -> KVStore:
        """Opens an in-process store.

        With ``pool_path`` the DRAM pool lives in that shared-memory file and survives the
        process: opening the same path again finds every committed block. Without it a
        private file under /dev/shm is used and removed on close. ``disk_dir`` adds a disk
        tier of ``disk_bytes`` that evicted blocks are written behind to. ``secret`` is the
        pool's shared secret, needed by read_remote() to authenticate to peers; sessions with
        peers are authenticated frame by frame, and encrypted too with ``encrypt``.
        ``shared_dir`` adds the shared tier: a directory every host of the pool mounts (it must
        exist), where blocks any host wrote are found. Its files are bound to the pool's
        ``secret``, which it needs: nothing written without the secret is ever read, and pools
        with other secrets never see each other's blocks (``shared_layout`` names what changes a block's bytes,
        so engines of another layout never read them; ``shared_bytes`` caps it, 0 = the
        filesystem; ``shared_policy`` "write-through" writes every block, "demote" those leaving
        DRAM; every ``shared_scan_interval_s`` the tier is scanned: its evictor runs, and the
        blocks other hosts published or removed reach `changes`).
        """
        if block_bytes <= 0 or dram_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"dram_bytes ({dram_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        if disk_dir is not None and disk_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"disk_bytes ({disk_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        if shared_dir is not None and not secret:
            raise errors.InvalidArgumentError(
                "shared_dir needs the pool's secret (secret=...): the shared tier's files are bound to it")
        private = pool_path is None
        path = os.fspath(pool_path) if pool_path else f"/dev/shm/tpusync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        backend = _native.BlockStore.open_local(
            path,
            block_bytes=block_bytes,
            num_slots=dram_bytes // block_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else None,
            disk_bytes=disk_bytes,
            hugepages=hugepages,
            mlock=mlock,
            unlink_on_close=private,
            io_threads=io_threads,
            secret=secret,
            streams=streams,
            encrypt=encrypt,
            shared_dir=os.fspath(shared_dir) if shared_dir is not None else None,
            shared_layout=shared_layout,
            shared_bytes=shared_bytes,
            shared_policy=shared_policy,
            shared_evict_interval_ms=round(shared_scan_interval_s * 1000),
        )
        return cls(backend, private_pool=path if private else None)

    @classmethod
    def connect(cls, url: str, *, secret: bytes | None = None, secret_file: str | os.PathLike[str] | None = None,
                streams: int = 4, timeout: float = 300.0, encrypt: bool = False) -> KVStore:
        """Connects to a sidecar: ``unix:///path/control.sock`` (this pod) or ``tpusync://host:port``.

        The data port needs the pool's shared secret (``secret`` or ``secret_file``); the control
        socket is protected by file permissions instead. Every frame on the data port is
        authenticated; ``encrypt`` encrypts them too (a sidecar run with --encrypt always does).
        """
        if secret_file is not None:
            secret = _read_secret(secret_file)
        if url.startswith("unix://"):
            return cls(_native.BlockStore.connect_sidecar(url[len("unix://"):], timeout_ms=int(timeout * 1000)))
        if url.startswith("tpusync://"):
            if secret is None:
                raise errors.InvalidArgumentError("tpusync:// needs the pool's shared secret (secret= or secret_file=)")
            return cls(_native.BlockStore.connect_data_port(url[len("tpusync://"):], secret=secret, streams=streams,
                                                            timeout_ms=int(timeout * 1000), encrypt=encrypt))
        raise errors.InvalidArgumentError(f"unsupported store URL {url!r}: use unix://PATH or tpusync://HOST:PORT")

    # -- blocks ---------------------------------------------------------------------------

    def put(self, keys: Keys, buffers: Sequence[Any]) -> None:
        """Stores each buffer (1..block_bytes bytes) under its key. Present keys are skipped.

        Raises CapacityError when DRAM is full of pinned blocks; blocks stored before that
        stay stored.
        """
        self._backend.put(keys, buffers)

    def get(self, keys: Keys, buffers: Sequence[Any]) -> list[bool]:
        """Copies each present block into its writable buffer; returns which were found.

        A disk block that fails its checksum is reported in stats() and counted as a miss.
        """
        return self._backend.get(keys, buffers)

    def lookup(self, keys: Keys, *, pin: bool = False) -> LookupResult:
        """Returns the present prefix length and per-key tiers; pins the prefix if asked."""
        prefix_len, tiers = self._backend.lookup(keys, pin=pin)
        return LookupResult(prefix_len, tiers)

    def where(self, keys: Keys) -> np.ndarray:
        """The Tier code of every key (uint8), the shared tier asked about each key held neither
        in DRAM nor on disk: lookup asks it only up to the end of the present prefix. Where
        announced blocks are now, for KV events. On the data port, the peer's lookup."""
        return self._backend.where(keys)

    def pin(self, keys: Keys, *, for_host: bool = False) -> None:
        """Keeps blocks from eviction until released. NotFoundError if any key is absent.

        Through a sidecar, pins belong to this connection and go when it closes (an engine
        that crashes holds nothing); for_host=True pins for the host instead, until some
        client releases them for_host. An in-process store's pins are always the host's.
        """
        self._backend.pin(keys, for_host=for_host)

    def release(self, keys: Keys, *, for_host: bool = False) -> None:
        """Drops one pin per key. PreconditionError if any key is not pinned (through a sidecar:
        by this connection, or with for_host, for the host)."""
        self._backend.release(keys, for_host=for_host)

    def evict(self, keys: Keys) -> None:
        """Moves blocks one tier down now: DRAM to disk (or out without a disk tier), disk out."""
        self._backend.evict(keys)

    def flush(self) -> None:
        """Waits for write-behind to disk; raises the first demotion error since the last flush."""
        self._backend.flush()

    def stats(self) -> dict[str, Any]:
        """Occupancy, hit and eviction counters, integrity and I/O error counts."""
        return self._backend.stats()

    def changes(self, cursor: tuple[int, int] = (0, 0), *, wait_s: float = 0.0, max_keys: int = 65536) -> Changes:
        """The keys whose tier changed after `cursor` (from an earlier call; (0, 0) the first
        time, which reads as lost), waiting up to `wait_s` (at most 60) for the first one.

        What KV events are announced from: the sidecar records each block entering or leaving
        a tier as it happens. Through a sidecar the wait holds this connection: poll on a
        KVStore of its own. PreconditionError on the data port."""
        if not 0 <= wait_s <= 60:
            raise errors.InvalidArgumentError(f"changes: wait_s must be within 0..60, not {wait_s}")
        epoch, seq, lost, keys = self._backend.changes(cursor[0], cursor[1], wait_ms=round(wait_s * 1000),
                                                       max_keys=max_keys)
        return Changes((epoch, seq), lost, keys)

    # -- the shared tier's block records ----------------------------------------------------

    def describe(self, keys: Keys, records: Sequence[bytes]) -> None:
        """Writes a record beside each block on the shared tier (at most 16 KiB each; a record
        already there is kept), for every host to read back: what an engine needs to announce a
        block that another host stored (tpusync.kv.events). PreconditionError without a
        shared tier."""
        self._backend.describe(keys, list(records))

    def records(self, keys: Keys | None = None, *, max_keys: int = 65536) -> dict[int, bytes]:
        """The records of these keys (b"" where there is none), or with no keys the shared
        tier's catalog: the blocks it held at its last scan, most recently read first, at most
        max_keys, with their records. PreconditionError without a shared tier."""
        got_keys, got = self._backend.records([] if keys is None else keys, max_keys=max_keys)
        return dict(zip(got_keys, got))

    # -- peers ----------------------------------------------------------------------------

    def read_remote(self, peer: str, keys: Keys) -> list[bool]:
        """Pulls the blocks this store lacks from a peer sidecar ("host:port" or tpusync://...).

        Only missing blocks travel (prefix-aware). Returns, per key, whether the block is held
        locally afterwards. A dead peer raises UnavailableError after the blocks that did
        arrive were kept; nothing partial is ever stored.
        """
        held, _, _ = self._backend.pull_from(_address(peer), keys)
        return held

    def read_remote_digests(self, peer: str, keys: Keys) -> tuple[list[bool], list[bool], np.ndarray]:
        """read_remote, and what landed: (held, landed, digests). landed[i] is True for the
        blocks that arrived in this pull, and digests[i] is then the XXH3-64 of the bytes that
        landed, computed as they arrived, so they can be checked against known checksums
        without a second pass over them."""
        return self._backend.pull_from(_address(peer), keys, digests=True)

    def push_remote(self, peer: str, keys: Keys) -> list[bool]:
        """Pushes stored blocks to a peer sidecar; returns, per key, whether the peer holds it
        afterwards. Only blocks the peer lacks travel."""
        return self._backend.push_to(_address(peer), keys)

    def exists_remote(self, peer: str, keys: Keys) -> list[bool]:
        """Whether a peer sidecar holds each block (any tier); nothing moves."""
        return [bool(t) for t in self.where_remote(peer, keys)]

    def where_remote(self, peer: str, keys: Keys) -> np.ndarray:
        """A peer sidecar's Tier code of every key (uint8), as `where` answers there; nothing moves."""
        return np.asarray(self._backend.exists_at(_address(peer), keys), np.uint8)

    # -- zero-copy ------------------------------------------------------------------------

    def reserve(self, key: int | bytes) -> _native.WriteLease:
        """Reserves a DRAM slot to write in place (``memoryview(lease)``), then ``lease.commit(n)``."""
        return self._backend.reserve_lease(key)

    def acquire(self, key: int | bytes) -> _native.ReadLease:
        """Holds a block in DRAM and exposes it read-only in place; drop the lease to release."""
        return self._backend.acquire_lease(key)

    def acquire_each(self, keys: Sequence[int | bytes]) -> list[_native.ReadLease | None]:
        """acquire() for many blocks at once (one round trip to a sidecar): a lease each, None
        where a block is absent; each lease is dropped on its own."""
        return self._backend.acquire_leases(list(keys))

    @contextlib.contextmanager
    def reserve_many(self, keys: Sequence[int | bytes]) -> Iterator[list[_Slot | None]]:
        """Slots to write blocks in place: ``np.frombuffer(slot.view, ...)``, fill, ``slot.commit(n)``.

        None for keys already stored. Committed slots are published when the block exits;
        the others are given back. CapacityError if no slot can be had.
        """
        keys = list(keys)
        slots = [None if v is None else _Slot(v) for v in self._backend.reserve(keys)]
        try:
            yield slots
        finally:
            for s in slots:
                if s is not None:
                    s.view.release()
            done = [(k, s.length) for k, s in zip(keys, slots) if s is not None and s.length]
            self._backend.abort([k for k, s in zip(keys, slots) if s is not None and not s.length])
            self._backend.commit([k for k, _ in done], [n for _, n in done])

    @contextlib.contextmanager
    def acquire_many(self, keys: Sequence[int | bytes]) -> Iterator[list[memoryview | None]]:
        """Read-only views of present blocks, held in DRAM until the block exits; None if absent."""
        keys = list(keys)
        views = self._backend.acquire(keys)
        try:
            yield views
        finally:
            for view in views:
                if view is not None:
                    view.release()
            self._backend.unacquire([k for k, v in zip(keys, views) if v is not None])

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._backend.block_bytes

    @property
    def pool_path(self) -> str:
        """The shared-memory pool file behind the store ("" for a data port: it has none here)."""
        return self._backend.pool_path or ""

    def pool_region(self) -> tuple[int, int] | None:
        """The pool as mapped in this process, (address, bytes), every slot's view within it: what
        to register with a device runtime as page-locked host memory (tpusync.kv.torch_pages does
        for CUDA). None for a data port, and for a local store once it is closed."""
        return self._backend.pool_region()

    def close(self) -> None:
        """Unmaps the pool. A store opened with pool_path keeps its blocks for the next open."""
        self._backend.close()
        if self._private_pool:  # e.g. the weight synchronizer's head files beside the pool
            shutil.rmtree(self._private_pool + ".weights", ignore_errors=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(peer: str) -> str:
    return peer.removeprefix("tpusync://")


class _Slot:
    """A reserved block slot: write through ``view``, then ``commit(length)``."""

    def __init__(self, view: memoryview):
        self.view = view
        self.length = 0

    def commit(self, length: int) -> None:
        if not 0 < length <= len(self.view):
            raise errors.InvalidArgumentError(f"commit: length {length} outside 1..{len(self.view)}")
        self.length = length


def _read_secret(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        return f.read().rstrip(b"\r\n")


def connect_sidecar(control_socket: str | None, *, secret_file: str | None = None) -> KVStore:
    """A client of this host's sidecar: `control_socket` is its socket's path or a URL
    (unix://, tcp://), by default $TPUSYNC_CONTROL_SOCKET (set in the pods the operator renders)."""
    address = control_socket or os.environ.get("TPUSYNC_CONTROL_SOCKET")
    if not address:
        raise errors.InvalidArgumentError("no sidecar: pass its control socket (or set $TPUSYNC_CONTROL_SOCKET)")
    return KVStore.connect(address if "://" in address else f"unix://{address}", secret_file=secret_file)
