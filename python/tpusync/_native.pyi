"""
tpusync native engine: one block-store interface over an in-process store, the pod's sidecar and a data port.

Keys (every `keys` argument): a sequence of ints below 2**128 or of 16-byte big-endian bytes, or a uint64 array of shape (n, 2) ([hi, lo] rows). Buffers: objects with the buffer protocol, C-contiguous (writable for get).
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
__all__: list[str] = ['BlockStore', 'ReadLease', 'WriteLease']
class WriteLease:
    """
    A reserved slot, writable in place through the buffer protocol; given back unless committed.
    """
    def __len__(self) -> int:
        ...
    def commit(self, length: typing.SupportsInt) -> None:
        """
        Publishes the first `length` bytes of the slot as the block.
        """
    @property
    def file_offset(self) -> int:
        """
        Offset of the slot in the pool file, for processes that map it.
        """
    @property
    def key(self) -> int:
        ...
class ReadLease:
    """
    A resident block held in DRAM, readable in place; not evicted while alive.
    """
    def __len__(self) -> int:
        ...
    @property
    def file_offset(self) -> int:
        ...
class BlockStore:
    """
    A block store, whichever backend serves it; an operation a backend cannot do raises PreconditionError saying why.
    """
    @staticmethod
    def connect_data_port(address: str, *, secret: bytes, streams: typing.SupportsInt = 4, timeout_ms: typing.SupportsInt = 5000, encrypt: bool = False) -> BlockStore:
        """
        Connects to a sidecar's data port ("host:port") over parallel authenticated streams (encrypted too with `encrypt`).
        """
    @staticmethod
    def connect_sidecar(socket_path: str, *, timeout_ms: typing.SupportsInt = 30000) -> BlockStore:
        """
        Connects to the sidecar of this pod over its control socket and maps its pool.
        """
    @staticmethod
    def open_local(pool_path: str, *, block_bytes: typing.SupportsInt = 0, num_slots: typing.SupportsInt = 0, disk_dir: str | None = None, disk_bytes: typing.SupportsInt = 0, hugepages: bool = False, mlock: bool = False, populate: bool = True, unlink_on_close: bool = False, io_threads: typing.SupportsInt = 2, writeback_watermark: typing.SupportsFloat = 0.05, secret: bytes | None = None, streams: typing.SupportsInt = 4, timeout_ms: typing.SupportsInt = 5000, encrypt: bool = False, shared_dir: str | None = None, shared_layout: str = '', shared_bytes: typing.SupportsInt = 0, shared_policy: str = 'write-through', shared_evict_interval_ms: typing.SupportsInt = 10000) -> BlockStore:
        """
        Opens (or re-attaches to) a store in this process: a shared-memory DRAM pool, an optional disk tier, an optional shared tier; with `secret`, transfers with peers' data ports (encrypted with `encrypt`).
        """
    def abort(self, keys: typing.Any) -> None:
        """
        Gives back reserved slots without committing them.
        """
    def acquire(self, keys: typing.Any) -> list[memoryview | None]:
        """
        Read-only views of present blocks held in DRAM (None where absent).
        """
    def acquire_lease(self, key: typing.Any) -> ReadLease:
        """
        Holds one block in DRAM as a lease object, readable in place.
        """
    def acquire_leases(self, keys: typing.Any) -> list[ReadLease | None]:
        """
        acquire_lease for many keys in one call (None where a block is absent).
        """
    def changes(self, epoch: typing.SupportsInt, seq: typing.SupportsInt, *, wait_ms: typing.SupportsInt, max_keys: typing.SupportsInt = 65536) -> tuple[int, int, bool, list[int]]:
        """
        Keys whose tier changed after the cursor: (epoch, seq, lost, keys) for the next call.
        """
    def close(self) -> None:
        """
        Ends the session or closes the store; refused while leases are held.
        """
    def commit(self, keys: typing.Any, lengths: collections.abc.Sequence[typing.SupportsInt]) -> None:
        """
        Publishes reserved slots as blocks of the given lengths.
        """
    def describe(self, keys: typing.Any, records: collections.abc.Sequence[bytes]) -> None:
        """
        Writes each block's record on the shared tier (kept if there).
        """
    def evict(self, keys: typing.Any) -> None:
        """
        Moves blocks one tier down: DRAM to disk (or out), disk out.
        """
    def exists_at(self, peer: str, keys: typing.Any) -> numpy.typing.NDArray[numpy.uint8]:
        """
        The peer's tier of each block (uint8 codes); nothing moves.
        """
    def flush(self) -> None:
        """
        Waits for queued write-behind; raises the first demotion error since the last flush.
        """
    def get(self, keys: typing.Any, buffers: typing.Any) -> list[bool]:
        """
        Copies present blocks into the buffers; returns found flags.
        """
    def lookup(self, keys: typing.Any, *, pin: bool = False) -> tuple[int, numpy.typing.NDArray[numpy.uint8]]:
        """
        Returns (prefix_len, tiers as uint8 codes); pins the present prefix when pin=True.
        """
    def pin(self, keys: typing.Any, *, for_host: bool = False) -> None:
        ...
    def pool_region(self) -> tuple[int, int] | None:
        """
        The pool as mapped in this process, (address, bytes), every slot's view within it: to register it with a device runtime as page-locked host memory (cudaHostRegister). None for a data port.
        """
    def pull_from(self, peer: str, keys: typing.Any, digests: bool = False) -> tuple[list[bool], list[bool], numpy.typing.NDArray[numpy.uint64]]:
        """
        Pulls the blocks this store lacks from a peer's data port; returns (held, landed, digests): with digests=True, the XXH3-64 of each block that landed in this pull (computed as it arrived), else 0.
        """
    def push_to(self, peer: str, keys: typing.Any) -> list[bool]:
        """
        Pushes stored blocks to a peer; returns which the peer holds.
        """
    def put(self, keys: typing.Any, buffers: typing.Any) -> None:
        """
        Stores each buffer under its key; present keys are skipped.
        """
    def records(self, keys: typing.Any, *, max_keys: typing.SupportsInt = 65536) -> tuple[list[int], list[bytes]]:
        """
        (keys, records) of the shared tier: of these keys, or with none the catalog (b'': no record).
        """
    def release(self, keys: typing.Any, *, for_host: bool = False) -> None:
        ...
    def reserve(self, keys: typing.Any) -> list[memoryview | None]:
        """
        Writable views of freshly reserved slots (None where the block is stored); all or nothing.
        """
    def reserve_lease(self, key: typing.Any) -> WriteLease:
        """
        Reserves one slot as a lease object, to be written in place.
        """
    def stats(self) -> dict[str, typing.Any]:
        ...
    def unacquire(self, keys: typing.Any) -> None:
        """
        Releases blocks held by acquire, once per key.
        """
    def where(self, keys: typing.Any) -> numpy.typing.NDArray[numpy.uint8]:
        """
        The tier of every key (uint8 codes), the shared tier asked about each.
        """
    @property
    def block_bytes(self) -> int:
        ...
    @property
    def pool_path(self) -> str | None:
        """
        The shared-memory pool file, or None for a data port.
        """
