"""Copy blocks of a torch paged KV cache between its tensors and store blocks, on the CPU or a
CUDA device.

A cache is a list of layers, each a tensor whose dim 0 is the block and whose blocks are each
contiguous (vLLM's per-layer KV caches); one store block holds one block of every layer, layer
after layer (`block_view`: a layer as `[blocks, bytes]`). Copies run on the current stream and
are waited for once per group of blocks, before a slot is committed or given back.

With the pool registered as page-locked host memory (`register_pool`, CUDA), a device's copies
are DMA straight between its memory and the pool's shared memory; without it, CUDA stages them
through its own pinned buffers (the fallback; bench/device_check.py measures both). A load can be
paced (`Pace`): its host-to-device copies cut into chunks with a bound on what is queued, as
upstream TPU Sync does because one large copy held its accelerator's kernels up; whether a GPU's
kernels need it is what the device check's stall cases measure.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from tpusync import errors
from tpusync.store import KVStore

_GROUP = 64  # blocks whose slots are held at once
CUDA_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault (cuda_runtime_api.h)
MIB = 1 << 20

# The regions this process registered with CUDA, and how many holders each has: CUDA refuses a
# second registration of a range (cudaErrorHostMemoryAlreadyRegistered), and one store's pool is
# held by several users at once (a local store's scheduler and worker, a check's steps).
_REGISTERED: dict[int, list[int]] = {}  # address -> [bytes, holders]
_REGISTERED_LOCK = threading.Lock()

# Pool views of present blocks are read-only; torch warns when it wraps one (they are only read).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def block_view(kv: torch.Tensor) -> torch.Tensor:
    """[blocks, bytes] over a per-layer KV cache whose dim 0 is the block and whose blocks are
    contiguous (vLLM's standard [B, H, N, C] view)."""
    if kv.dim() < 2 or not kv[0].is_contiguous() or (kv.shape[0] > 1 and kv.stride(0) < kv[0].numel()):
        raise errors.InvalidArgumentError(
            f"KV cache of shape {tuple(kv.shape)}, strides {kv.stride()}: blocks are not contiguous along dim 0")
    flat = kv.as_strided((kv.shape[0], kv[0].numel()), (kv.stride(0), 1))
    return flat.view(torch.uint8)


def _views(store: KVStore, layers: Sequence[torch.Tensor], keys: Sequence[int],
           block_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[int], int]:
    """The layers' block views, each layer's bytes in a block, and a block's bytes."""
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
    if not layers:
        raise errors.InvalidArgumentError("a cache of no layers")
    views = [block_view(layer) for layer in layers]
    sizes = [int(v.shape[1]) for v in views]
    if sum(sizes) > store.block_bytes:
        raise errors.InvalidArgumentError(f"a block of this cache is {sum(sizes)} bytes, the store's blocks hold "
                                          f"{store.block_bytes}")
    return views, sizes, sum(sizes)


def _copy_block(slot: memoryview, views: list[torch.Tensor], sizes: list[int], block_id: int, *,
                load: _Pacer | None = None) -> None:
    """Block `block_id` of every layer into a slot's memory, layer after layer, or with `load`,
    back out through it."""
    pool = torch.frombuffer(slot, dtype=torch.uint8, count=sum(sizes))  # freed on return, before the slot's view
    offset = 0
    for v, size in zip(views, sizes):
        part = pool[offset:offset + size]
        if load is None:
            part.copy_(v[block_id], non_blocking=True)
        else:
            load.copy(v[block_id], part)
        offset += size


def _wait(device: torch.device) -> None:
    """The copies queued on the current stream have finished (before a slot is handed over)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@contextlib.contextmanager
def register_pool(store: KVStore) -> Iterator[bool]:
    """The store's pool registered with CUDA as page-locked host memory for the block's duration;
    yields whether it is (False without a CUDA device, or for a data port, which maps no pool).
    Registrations of one pool nest: the last to exit unregisters it. The store must stay open
    until the block exits."""
    region = store.pool_region()
    if region is None or not torch.cuda.is_available():
        yield False
        return
    _hold(*region)
    try:
        yield True
    finally:
        _drop(region[0])


def _hold(address: int, size: int) -> None:
    with _REGISTERED_LOCK:
        held = _REGISTERED.get(address)
        if held is not None and held[0] == size:
            held[1] += 1
            return
        if held is not None:
            raise errors.PreconditionError(f"the pool at {address:#x} is registered with {held[0]} bytes, not {size}")
        err = torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_DEFAULT)
        if int(err) != 0:
            raise errors.UnavailableError(f"cudaHostRegister of the pool ({size} bytes at {address:#x}) failed: "
                                          f"CUDA error {int(err)}")
        _REGISTERED[address] = [size, 1]


def _drop(address: int) -> None:
    with _REGISTERED_LOCK:
        held = _REGISTERED[address]
        held[1] -= 1
        if held[1] == 0:
            del _REGISTERED[address]
            torch.cuda.cudart().cudaHostUnregister(address)


@dataclass(frozen=True)
class Pace:
    """A load's host-to-device copies cut into `chunk_bytes` pieces, with at most
    `in_flight_bytes` queued on the device and not yet done (upstream TPU Sync's 16 MiB and
    64 MiB): kernels on other streams are not held up behind one large copy."""

    chunk_bytes: int = 16 * MIB
    in_flight_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= self.in_flight_bytes:
            raise errors.InvalidArgumentError(f"Pace(chunk_bytes={self.chunk_bytes}, in_flight_bytes="
                                              f"{self.in_flight_bytes}): 0 < chunk_bytes <= in_flight_bytes")


class _Pacer:
    """Copies cut per a Pace (none: each copy whole). On a CUDA device, an event after each
    chunk's bytes, the oldest waited for while more than in_flight_bytes are queued; on the CPU,
    whose copies are done when issued, the chunks alone."""

    def __init__(self, pace: Pace | None, device: torch.device) -> None:
        self.pace = pace
        self.device = device
        self.queued: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
        self.in_flight = 0
        self.since_event = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src, both flat uint8."""
        if self.pace is None:
            dst.copy_(src, non_blocking=True)
            return
        step = self.pace.chunk_bytes
        for a in range(0, int(src.shape[0]), step):
            piece = src[a:a + step]
            dst[a:a + step].copy_(piece, non_blocking=True)
            self.since_event += int(piece.shape[0])
            if self.since_event >= step and self.device.type == "cuda":
                self._mark()

    def drained(self) -> None:
        """The stream was waited for: nothing queued is in flight any more."""
        self.queued.clear()
        self.in_flight = self.since_event = 0

    def _mark(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.queued.append((event, self.since_event))
        self.in_flight += self.since_event
        self.since_event = 0
        assert self.pace is not None
        while self.in_flight > self.pace.in_flight_bytes:
            done, nbytes = self.queued.popleft()
            done.synchronize()
            self.in_flight -= nbytes


def save_blocks(store: KVStore, keys: Sequence[int], layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> int:
    """Stores block block_ids[i] of every layer under keys[i] (blocks already stored are
    skipped). Returns the bytes written."""
    views, sizes, nbytes = _views(store, layers, keys, block_ids)
    written = 0
    for g in range(0, len(keys), _GROUP):
        with store.reserve_many(keys[g:g + _GROUP]) as slots:
            filled = [(slot, block_ids[g + j]) for j, slot in enumerate(slots) if slot is not None]
            for slot, block_id in filled:  # a stored key has no slot: content-addressed, skipped
                _copy_block(slot.view, views, sizes, block_id)
            _wait(views[0].device)
            for slot, _ in filled:
                slot.commit(nbytes)
            written += nbytes * len(filled)
    return written


def load_blocks(store: KVStore, keys: Sequence[int], layers: Sequence[torch.Tensor], block_ids: Sequence[int], *,
                pace: Pace | None = None) -> int:
    """Loads stored blocks into block block_ids[i] of every layer; returns how many leading
    blocks loaded: loading stops at the first block the store lacks, or holds with another
    length than a block of this cache's (never loaded in part). `pace`: the copies paced (Pace)."""
    views, sizes, nbytes = _views(store, layers, keys, block_ids)
    pacer = _Pacer(pace, views[0].device)
    loaded = 0
    for g in range(0, len(keys), _GROUP):
        with store.acquire_many(keys[g:g + _GROUP]) as stored:
            present = next((i for i, s in enumerate(stored) if s is None or len(s) != nbytes), len(stored))
            for i in range(present):
                _copy_block(cast(memoryview, stored[i]), views, sizes, block_ids[g + i], load=pacer)
            _wait(views[0].device)  # the slots are read before they are given back
            pacer.drained()
        loaded += present
        if present < len(stored):
            break
    return loaded
