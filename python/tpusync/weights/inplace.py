"""Loading a version into a running engine's own weights, in place, one leaf at a time.

An engine's weights cannot be swapped by one reference the way `VersionedWeights` swaps a
pytree: they are copied into the engine's parameters leaf by leaf. So nothing is touched
until the whole version is on this host, committed, and pinned for the length of the load
(no eviction can take a block from under it), and the leaves are read off the pool as they
are copied: no second full copy of the weights in host memory, one leaf at most.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from tpusync import errors
from tpusync.weights.head import read_head
from tpusync.weights.keys import check_version
from tpusync.weights.leaves import VersionGoneError, leaf_bytes, leaf_in_place, leaf_leases, single_block
from tpusync.weights.manifest import Manifest
from tpusync.weights.polling import backoff
from tpusync.weights.storage import commit_on_host, read_manifest, version_keys
from tpusync.weights.tensors import as_torch

log = logging.getLogger(__name__)

_LEASE_GROUP = 16  # one-block leaves whose read leases iter_torch takes in one round trip


def await_version(store: Any, model: str, version: int | None, timeout: float | None) -> int:
    """The newest version of `model` committed on this host that is >= `version` (any, for
    None), waiting up to `timeout` seconds for one. Versions a peer pushed here (their commit
    records, no head yet) are committed first, so a sampler that missed some catches up."""
    if version is not None:
        version = check_version(version)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = backoff()
    while True:
        head = read_head(store.pool_path, model) or 0
        if version is not None and version > head and _commit_pushed(store, model, version):
            head = version
        head = _newest_pushed(store, model, head)
        if head and (version is None or head >= version):
            return head
        if deadline is not None and time.monotonic() >= deadline:
            want = "a version" if version is None else f"version {version}"
            raise errors.DeadlineExceededError(
                f"{want} of {model!r} did not arrive within {timeout} s (this host has {head or None})")
        pause()  # waiting on another process's commit or a peer's push


def _commit_pushed(store: Any, model: str, version: int) -> bool:
    manifest = read_manifest(store, model, version)
    if manifest is not None:
        commit_on_host(store, manifest)
    return manifest is not None


def _newest_pushed(store: Any, model: str, head: int) -> int:
    """Commits the versions pushed after `head`, in order; returns the newest. A pushed version
    whose manifest is refused (not a tiling of its leaves, say) stops the walk there: nothing
    from it is committed, and the newest good version before it is the answer."""
    while True:
        try:
            if not _commit_pushed(store, model, head + 1):
                return head
        except errors.CorruptionError as e:
            log.warning("version %d of %r refused: %s", head + 1, model, e)
            return head
        head += 1


@contextlib.contextmanager
def pinned_version(store: Any, model: str, version: int) -> Iterator[Manifest]:
    """A committed version's manifest, every block of the version pinned by this process
    until the block exits. Raises VersionGoneError if it left the pool already."""
    manifest = read_manifest(store, model, check_version(version))
    if manifest is None:
        raise VersionGoneError(f"version {version} of {model!r} is not committed on this host")
    keys = version_keys(manifest)
    try:
        store.pin(keys)
    except errors.NotFoundError:
        raise VersionGoneError(f"version {version} of {model!r} left this host's pool") from None
    try:
        yield manifest
    finally:
        with contextlib.suppress(errors.TpuSyncError):
            store.release(keys)


def iter_torch(store: Any, manifest: Manifest, *, verify: bool = False,
               zero_copy: bool = True) -> Iterator[tuple[str, Any]]:
    """(leaf name, CPU tensor) for every leaf, in the manifest's order. With `zero_copy`, a
    one-block leaf is the pool slot itself (its read lease lives as long as the tensor: for
    consumers that copy out of it; the leases of up to _LEASE_GROUP such leaves are asked for in
    one round trip to the sidecar); any other leaf is assembled in a buffer of its own, freed
    once the consumer lets go of it."""
    leaves = manifest.leaves
    for g in range(0, len(leaves), _LEASE_GROUP):
        group = leaves[g:g + _LEASE_GROUP]
        leases = leaf_leases(store, [leaf for leaf in group if zero_copy and single_block(leaf)])
        for leaf in group:
            if leaf.name in leases:  # a block gone since the pin: leaf_in_place asks again, then says so
                data = leaf_in_place(store, leaf, verify=verify, lease=leases.pop(leaf.name))
            else:
                data = leaf_bytes(store, leaf, verify=verify)
            yield leaf.name, as_torch(data, leaf.dtype, leaf.shape)
        del data
