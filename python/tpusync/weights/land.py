"""Landing a chunk of a weight version on a host: pull it from a parent, check it."""

from __future__ import annotations

from tpusync.store import KVStore
from tpusync.weights.checksums import WIRE_CHECKSUM
from tpusync.weights.manifest import BlockRef
from tpusync.weights.storage import verify_blocks


def pull_chunk(store: KVStore, peer: str, blocks: list[BlockRef], algo: str, *, verify: bool) -> bool:
    """Pulls the chunk's blocks this host lacks from `peer`; True when all are held (and, with
    verify, match the manifest). A block that landed in this pull is checked by the digest the
    sidecar computed as it arrived, when the manifest uses the same XXH3-64, so checking costs
    no second pass over the bytes; blocks held before are read back and checked. Blocks that
    fail are evicted, so the next pull fetches them again."""
    keys = [b.key for b in blocks]
    if not verify:
        return all(store.read_remote(peer, keys))
    held, landed, digests = store.read_remote_digests(peer, keys)
    if not all(held):
        return False
    by_wire = algo == WIRE_CHECKSUM
    bad = [b for b, now, d in zip(blocks, landed, digests) if by_wire and now and int(d) != b.checksum]
    rest = [b for b, now in zip(blocks, landed) if not (by_wire and now)]
    if rest:
        bad += verify_blocks(store, rest, algo)
    if bad:
        store.evict([b.key for b in bad])
    return not bad
