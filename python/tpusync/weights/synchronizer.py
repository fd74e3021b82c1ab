"""VersionedWeights: trainers publish versioned pytree snapshots; samplers receive them.

Trainer:  sync.publish(params, version)      # d2h into the host pool, manifest last
Sampler:  sync.bind_weights(template)         # leaf names, shapes, dtypes, target shardings
          sync.wait_for_version(v) / poll()   # loads from the host pool, swaps atomically
          params = sync.params                # always one whole version

Every sampler on a host loads from the one copy in that host's shared-memory pool (the
sidecar's /dev/shm pool, reached through the control socket). Versions are swapped by
replacing one reference under a lock: each version's arrays are built completely before
the swap, so a reader holding `sync.current()` sees one version, never a mix.
Slow calls have `_async` forms returning `concurrent.futures.Future`s (wrap them with
`asyncio.wrap_future` inside an event loop).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tpusync import errors
from tpusync.store import KVStore
from tpusync.weights.checksums import CHECKSUM, checksum
from tpusync.weights.head import read_head
from tpusync.weights.inplace import await_version
from tpusync.weights.keys import check_version, commit_key, weight_key
from tpusync.weights.leaves import VersionGoneError, leaf_bytes, leaf_in_place, leaf_leases, single_block
from tpusync.weights.manifest import BlockRef, LeafEntry, Manifest, ShardEntry, tiling_problem
from tpusync.weights.storage import commit_on_host, read_block, read_manifest, version_keys, write_manifest
from tpusync.weights.tensors import HostLeaf, as_torch, dtype_name, host_leaf, is_state_dict, iter_leaves, numpy_dtype

_GROUP = 16  # blocks reserved or acquired at once


class TemplateMismatchError(errors.InvalidArgumentError):
    """The bound template and a published version disagree; the message names the leaf."""


def _flat_bytes(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8)


class VersionedWeights:
    """One process's end of weight synchronization for one model, on one host's pool."""

    def __init__(self, store: KVStore | str, model: str, *, blocks_per_chunk: int = 8, verify: bool = False,
                 workers: int = 1, secret: bytes | None = None):
        self.store = store if isinstance(store, KVStore) else KVStore.connect(store, secret=secret)
        self.model = model
        self.blocks_per_chunk = blocks_per_chunk
        self.verify = verify
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tpusync-weights")
        self._lock = threading.Lock()      # guards the current version (the swap)
        self._load_lock = threading.Lock()  # one load at a time
        self._version: int | None = None
        self._params: Any = None
        self._host: dict[str, np.ndarray] = {}
        self._template: list[tuple[str, Any]] | None = None
        self._treedef: Any = None
        self._cast = False
        self._metrics = {"versions_published": 0, "bytes_published": 0, "last_publish_seconds": 0.0,
                         "versions_loaded": 0, "bytes_loaded": 0, "last_load_seconds": 0.0,
                         "zero_copy_leaves": 0, "load_retries": 0}

    # -- trainer side -----------------------------------------------------------------------

    def d2h(self, params: Any) -> list[HostLeaf]:
        """Host copies of this process's shards of every leaf (zero-copy on the CPU backend)."""
        return [host_leaf(name, leaf) for name, leaf in iter_leaves(params)]

    def publish(self, params: Any, version: int, *, part: tuple[int, int] | None = None,
                on_block: Callable[[int, int], None] | None = None) -> Manifest:
        """Stores a version in this host's pool and commits it; returns its manifest.

        `params` is a JAX pytree or a torch state dict (name -> tensor, or -> `Shard`s of
        the leaf's global array). Data blocks first, then the manifest, then the commit
        record: a trainer that dies before the end leaves the previous version current
        everywhere. `on_block(done, total)` is called after each block (progress; tests use
        it to stop at an exact point).

        A trainer spread over processes on several hosts publishes one part per host:
        `part=(index, count)` (default: the JAX process index and count of a multi-process
        JAX job); the manager's start_transfer over all trainer hosts assembles and
        commits the whole version.
        """
        version = check_version(version)
        state_dict = is_state_dict(params)
        if part is None and not state_dict:
            import jax

            part = (jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None
        if read_block(self.store, commit_key(self.model, version, part)) is not None:
            raise errors.PreconditionError(f"version {version} of {self.model!r} is already committed")
        start = time.perf_counter()
        leaves = self.d2h(params)
        _check_tiling(leaves, whole=part is None)
        treedef = "" if state_dict else _treedef(params)
        bb = self.store.block_bytes
        total = sum(-(-s.data.nbytes // bb) or 1 for leaf in leaves for s in leaf.shards)
        done = 0
        entries = []
        for leaf in leaves:
            shard_entries = []
            for shard in leaf.shards:
                flat = _flat_bytes(shard.data)
                pieces = [flat[i:i + bb] for i in range(0, flat.size, bb)] or [flat[:0]]
                refs = []
                for g in range(0, len(pieces), _GROUP):
                    group = pieces[g:g + _GROUP]
                    sums = [checksum(p) for p in group]
                    keys = [weight_key(self.model, version, "data", leaf.name, [list(d) for d in shard.index],
                                          g + i, c) for i, c in enumerate(sums)]
                    if any(p.size == 0 for p in group):
                        raise errors.InvalidArgumentError(f"leaf {leaf.name!r} is empty; blocks hold 1 byte or more")
                    with self.store.reserve_many(keys) as slots:
                        for slot, piece in zip(slots, group):
                            if slot is None:
                                continue  # stored by an earlier attempt: same key, same content
                            np.copyto(np.frombuffer(slot.view, np.uint8, count=piece.size), piece)
                            slot.commit(piece.size)
                    refs += [BlockRef(k, p.size, c) for k, p, c in zip(keys, group, sums)]
                    for _ in group:
                        done += 1
                        if on_block is not None:
                            on_block(done, total)
                shard_entries.append(ShardEntry(shard.index, tuple(refs)))
            entries.append(LeafEntry(leaf.name, leaf.shape, leaf.dtype, leaf.sharding, tuple(shard_entries)))
        manifest = Manifest(self.model, int(version), bb, self.blocks_per_chunk, CHECKSUM, tuple(entries), treedef)
        missing = len(manifest.blocks()) - self.store.lookup([b.key for b in manifest.blocks()]).prefix_len
        if missing:
            raise errors.CapacityError(f"{missing} blocks of version {version} were evicted before the commit: "
                                       "the pool must hold two versions")
        write_manifest(self.store, manifest, part)
        commit_on_host(self.store, manifest, part)
        with self._lock:
            self._metrics["versions_published"] += 1
            self._metrics["bytes_published"] += manifest.nbytes
            self._metrics["last_publish_seconds"] = time.perf_counter() - start
        return manifest

    def publish_async(self, params: Any, version: int, **kw: Any) -> Future[Manifest]:
        return self._pool.submit(self.publish, params, check_version(version), **kw)

    def push_weights(self, peers: Sequence[str], version: int | None = None) -> Future[int]:
        """Pushes a committed version from this host's sidecar to peer sidecars ("host:port").

        Data first, then the manifest, then the commit record, so a peer commits only a whole
        version; only blocks a peer lacks travel. The future's result is the version pushed.
        """
        if version is not None:
            check_version(version)

        def run() -> int:
            v = self.latest_version() if version is None else version
            if v is None:
                raise errors.NotFoundError(f"no committed version of {self.model!r} on this host")
            manifest = read_manifest(self.store, self.model, v)
            if manifest is None:
                raise VersionGoneError(f"version {v} of {self.model!r} is not committed on this host")
            keys = version_keys(manifest)
            for peer in peers:
                for part in (keys[:-1], keys[-1:]):  # the commit record only after everything else
                    stored = self.store.push_remote(peer, part)
                    if not all(stored):
                        raise errors.UnavailableError(f"{peer} stored {sum(stored)} of {len(stored)} blocks")
            return v

        return self._pool.submit(run)

    # -- sampler side -----------------------------------------------------------------------

    def bind_weights(self, template: Any, *, cast: bool = False) -> None:
        """What to receive into: a pytree whose leaves are jax.Arrays or jax.ShapeDtypeStructs
        (their sharding is the target layout) or numpy arrays (received as host arrays), or
        a torch state dict (received as CPU tensors). With `cast`, a leaf published in
        another dtype (bfloat16 to float32, say) is converted to the template's; without,
        that is a TemplateMismatchError."""
        self._template = list(iter_leaves(template))
        self._treedef = None if is_state_dict(template) else _tree_structure(template)
        self._cast = cast

    def latest_version(self) -> int | None:
        """The newest version committed on this host (the host's head)."""
        return read_head(self.store.pool_path, self.model)

    def poll(self) -> int | None:
        """Loads the host's current version if it is newer than ours; returns it, else None."""
        head = self.latest_version()
        if head is None or (self._version is not None and head <= self._version):
            return None
        return self._load_newest(head)

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Blocks until a version >= `version` is loaded (the newest one present); returns it."""
        version = check_version(version)
        if self._version is not None and self._version >= version:
            return self._version
        return self._load_newest(await_version(self.store, self.model, version, timeout))

    def wait_for_version_async(self, version: int, timeout: float | None = None) -> Future[int]:
        return self._pool.submit(self.wait_for_version, check_version(version), timeout)

    def poll_async(self) -> Future[int | None]:
        return self._pool.submit(self.poll)

    def _load_newest(self, head: int) -> int:
        with self._load_lock:
            for _ in range(8):
                if self._version is not None and head <= self._version:
                    return self._version
                try:
                    self.load(head)
                    return head
                except VersionGoneError:
                    self._metrics["load_retries"] += 1
                    newer = self.latest_version()
                    if newer is None or newer <= head:
                        raise
                    head = newer
            raise VersionGoneError(f"versions of {self.model!r} keep being replaced faster than they load")

    def load(self, version: int) -> None:
        """Loads one committed version from this host's pool and swaps it in."""
        version = check_version(version)
        if self._template is None:
            raise errors.PreconditionError("bind_weights(template) first")
        start = time.perf_counter()
        manifest = read_manifest(self.store, self.model, version)
        if manifest is None:
            raise VersionGoneError(f"version {version} of {self.model!r} is not committed on this host")
        self.check_template(manifest)
        entries = [(name, tmpl, manifest.leaf(name)) for name, tmpl in self._template]
        # The leaves used in place hold their blocks' leases, taken in one round trip.
        leases = leaf_leases(self.store, [entry for _, tmpl, entry in entries if _in_place(entry, tmpl)])
        host, leaves = {}, []
        for name, tmpl, entry in entries:
            arr, buf = self._leaf_from_pool(entry, tmpl, leases.pop(name, None))
            host[name] = buf
            leaves.append(arr)
        params = dict(zip(host, leaves)) if self._treedef is None else _unflatten(self._treedef, leaves)
        with self._lock:  # the swap: one reference, so readers see the old or the new version whole
            self._version, self._params, self._host = version, params, host
            self._metrics["versions_loaded"] += 1
            self._metrics["bytes_loaded"] += manifest.nbytes
            self._metrics["last_load_seconds"] = time.perf_counter() - start

    def check_template(self, manifest: Manifest) -> None:
        """Raises TemplateMismatchError naming the first leaf that differs."""
        if self._template is None:
            raise errors.PreconditionError("bind_weights(template) first")
        published = {leaf.name: leaf for leaf in manifest.leaves}
        bound = {name for name, _ in self._template}
        for name, tmpl in self._template:
            entry = published.get(name)
            where = f"version {manifest.version} of {self.model!r}"
            if entry is None:
                raise TemplateMismatchError(f"leaf {name!r} is in the template but not in {where} "
                                            f"(published leaves: {', '.join(sorted(published)[:8])}...)")
            shape, dtype = tuple(tmpl.shape), dtype_name(tmpl)
            if shape != entry.shape:
                raise TemplateMismatchError(f"leaf {name!r}: the template has shape {shape}, {where} has {entry.shape}")
            if dtype != entry.dtype and not self._cast:
                raise TemplateMismatchError(f"leaf {name!r}: the template has dtype {dtype}, {where} has "
                                            f"{entry.dtype} (bind_weights(..., cast=True) converts it)")
        extra = sorted(set(published) - bound)
        if extra:
            raise TemplateMismatchError(f"leaf {extra[0]!r} is in version {manifest.version} of {self.model!r} "
                                        "but not in the template")

    def _leaf_from_pool(self, entry: LeafEntry, tmpl: Any, lease: Any = None) -> tuple[Any, Any]:
        """(the leaf as the template wants it, its host buffer); `lease`: its block's, when it is
        used in place (_in_place)."""
        if type(tmpl).__module__.startswith("torch"):
            return self._torch_leaf(entry, tmpl, lease)
        import jax
        import jax.numpy as jnp

        dtype = numpy_dtype(entry.dtype)
        want = numpy_dtype(dtype_name(tmpl))
        sharding = getattr(tmpl, "sharding", None)
        local_cpu = _local_cpu(tmpl)
        if sharding is not None and _in_place(entry, tmpl):
            # The pool slot is the buffer: its read lease (held by the view) lives as long as the array.
            view = leaf_in_place(self.store, entry, verify=self.verify, lease=lease)
            host = view.view(dtype).reshape(entry.shape)
            arr = jax.device_put(host, next(iter(sharding.device_set)), may_alias=True)
            weakref.finalize(arr, [view].clear)
            self._metrics["zero_copy_leaves"] += 1
            return arr, host
        host = leaf_bytes(self.store, entry, verify=self.verify).view(dtype).reshape(entry.shape)
        if want != dtype:
            host = host.astype(want)  # the explicit cast bind_weights(cast=True) asked for
        host.flags.writeable = False
        if not isinstance(tmpl, (jax.Array, jax.ShapeDtypeStruct)):
            return host, host
        if sharding is None:
            return jnp.array(host), host
        if local_cpu:  # a fresh buffer per version: the array may alias it
            return jax.device_put(host, next(iter(sharding.device_set)), may_alias=True), host
        # Resharding: each device takes its slice of the global host buffer.
        return jax.make_array_from_callback(entry.shape, sharding, lambda idx: host[idx]), host

    def _torch_leaf(self, entry: LeafEntry, tmpl: Any, lease: Any = None) -> tuple[Any, Any]:
        """A CPU tensor: on the pool slot itself (a lease held while it lives) when the leaf is
        one block in the template's dtype, else on a buffer of its own."""
        if _in_place(entry, tmpl):
            tensor = as_torch(leaf_in_place(self.store, entry, verify=self.verify, lease=lease), entry.dtype,
                              entry.shape)
            self._metrics["zero_copy_leaves"] += 1
            return tensor, tensor
        tensor = as_torch(leaf_bytes(self.store, entry, verify=self.verify), entry.dtype, entry.shape)
        if dtype_name(tmpl) != entry.dtype:
            tensor = tensor.to(tmpl.dtype)  # the explicit cast bind_weights(cast=True) asked for
        return tensor, tensor

    # -- reading ----------------------------------------------------------------------------

    def current(self) -> tuple[int | None, Any]:
        """(version, params) of one version, read together."""
        with self._lock:
            return self._version, self._params

    @property
    def params(self) -> Any:
        return self._params

    @property
    def version(self) -> int | None:
        return self._version

    def h2d(self, host_buffers: dict[str, np.ndarray] | None = None) -> Any:
        """Device arrays laid out like the template from host buffers (default: the current ones)."""
        import jax

        if self._template is None:
            raise errors.PreconditionError("bind_weights(template) first")
        host = self.get_host_buffer() if host_buffers is None else host_buffers
        out = []
        for name, tmpl in self._template:
            sharding = getattr(tmpl, "sharding", None)
            buf = host[name]
            out.append(buf if sharding is None else jax.make_array_from_callback(buf.shape, sharding, buf.__getitem__))
        return jax.tree_util.tree_unflatten(self._treedef, out)

    def get_host_buffer(self) -> dict[str, np.ndarray]:
        """The current version's host buffers by leaf name (read-only; pool views where zero-copy)."""
        with self._lock:
            return dict(self._host)

    def get_metrics(self) -> dict[str, Any]:
        """This end's counters, plus the host pool's (the sidecar's) occupancy and traffic."""
        with self._lock:
            out: dict[str, Any] = dict(self._metrics, model=self.model, version=self._version)
        try:
            out["host"] = self.store.stats()
        except errors.TpuSyncError as e:  # the sidecar is gone: report it, do not fail metrics
            out["host"] = {"error": str(e)}
        out["host_version"] = self.latest_version()
        return out

    def close(self) -> None:
        """Stops the worker and drops this end's version (zero-copy leaves release their leases
        once the caller's references to them are gone too)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            self._params, self._host = None, {}

    def __enter__(self) -> VersionedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _local_cpu(tmpl: Any) -> bool:
    """A JAX template leaf on this process's CPU device, one device: an array on a pool slot can
    alias it."""
    import jax

    sharding = getattr(tmpl, "sharding", None)
    return (isinstance(tmpl, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None
            and len(sharding.device_set) == 1 and next(iter(sharding.device_set)) == jax.devices()[0]
            and jax.devices()[0].platform == "cpu")


def _in_place(entry: LeafEntry, tmpl: Any) -> bool:
    """The leaf is used on its pool slot: one block, in the template's dtype, for a torch CPU
    tensor or a JAX array on this process's CPU device."""
    if not single_block(entry) or dtype_name(tmpl) != entry.dtype:  # names: a torch-only process has no ml_dtypes
        return False
    return type(tmpl).__module__.startswith("torch") or _local_cpu(tmpl)


def _check_tiling(leaves: list[HostLeaf], *, whole: bool) -> None:
    """The shards given must tile every leaf (`manifest.tiling_problem`): inside it, disjoint,
    and for a whole version (not a trainer's part) covering it."""
    for leaf in leaves:
        problem = tiling_problem(leaf.shape, [s.index for s in leaf.shards], whole=whole)
        if problem is not None:
            hint = " (a trainer's part is published with part=(index, count))" if whole else ""
            raise errors.InvalidArgumentError(f"leaf {leaf.name!r}: {problem}{hint}")


def _tree_structure(tree: Any) -> Any:
    import jax

    return jax.tree_util.tree_structure(tree)


def _treedef(params: Any) -> str:
    return str(_tree_structure(params))


def _unflatten(treedef: Any, leaves: list[Any]) -> Any:
    import jax

    return jax.tree_util.tree_unflatten(treedef, leaves)
