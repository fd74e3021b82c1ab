"""A trainer's weights as host bytes, and stored bytes as a sampler's arrays.

Trainers hold JAX pytrees or torch state dicts (whole tensors, or the shards an FSDP-style
trainer holds: `Shard`); samplers want JAX arrays, torch tensors or numpy arrays. The
manifest records each leaf's dtype by name, the same name in both frameworks ('float32',
'bfloat16', 'float8_e4m3fn', ...), so a JAX trainer feeds torch samplers and back; DTYPES
lists the names either side carries. Bytes are never converted implicitly: a sampler that
wants another dtype than the one published asks for it (`cast`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync import errors

# The dtype names a version can carry, with their sizes: numpy's (ml_dtypes' for the
# narrow floats, as JAX uses) and torch's names agree on every one of them.
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
          "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def itemsize(name: str) -> int:
    """The size of one element of a manifest dtype name."""
    return DTYPES[name] if name in DTYPES else np.dtype(name).itemsize


@dataclass(frozen=True)
class Shard:
    """One piece of a leaf a trainer process holds: `data` (a torch tensor or numpy array) is
    the region starting at `offsets` of a global array of `global_shape` (an FSDP or DTensor
    shard: `Shard(t.to_local(), tuple(t.shape), offsets)`). A leaf may be a list of them."""

    data: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class HostShard:
    index: tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the global array
    data: np.ndarray  # C-contiguous host bytes (or a zero-copy view of a CPU buffer)


@dataclass
class HostLeaf:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    shards: list[HostShard]


def dtype_name(x: Any) -> str:
    """The manifest's name of an array's, a tensor's or a dtype's element type."""
    dt = getattr(x, "dtype", x)
    name = str(dt).removeprefix("torch.") if type(dt).__module__ == "torch" else np.dtype(dt).name
    if name not in DTYPES:
        raise errors.InvalidArgumentError(f"dtype {name!r} cannot be published (supported: {', '.join(DTYPES)})")
    return name


def is_state_dict(tree: Any) -> bool:
    """A flat mapping of names to torch tensors or shards (not a JAX pytree)."""
    return isinstance(tree, Mapping) and bool(tree) and all(_is_torch_leaf(v) for v in tree.values())


def _is_torch_leaf(v: Any) -> bool:
    if isinstance(v, Shard):
        return True
    if isinstance(v, (list, tuple)):
        return bool(v) and all(isinstance(s, Shard) for s in v)
    return type(v).__module__.startswith("torch") and hasattr(v, "untyped_storage")


def iter_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """(name, leaf): a state dict's keys, or a pytree's paths ('layers/0/w')."""
    if is_state_dict(tree):
        yield from ((str(k), v) for k, v in tree.items())
        return
    from tpusync.weights.pytree import iter_leaf_names

    yield from iter_leaf_names(tree)


def host_leaf(name: str, leaf: Any) -> HostLeaf:
    """The shards of one leaf this process holds, as host bytes (one copy off each device)."""
    if isinstance(leaf, (Shard, list, tuple)) and _is_torch_leaf(leaf):
        return _shards_to_host(name, [leaf] if isinstance(leaf, Shard) else list(leaf))
    if type(leaf).__module__.startswith("torch"):
        return HostLeaf(name, tuple(leaf.shape), dtype_name(leaf), "host",
                        [HostShard(tuple((0, n) for n in leaf.shape), torch_bytes(leaf))])
    import jax

    if isinstance(leaf, jax.Array):
        shape = tuple(leaf.shape)
        shards = []
        for s in sorted(leaf.addressable_shards, key=lambda s: norm_index(s.index, shape)):
            if s.replica_id != 0:
                continue  # a replica: publish each distinct piece once
            data = np.asarray(s.data)  # CPU: the device buffer itself; TPU: one D2H transfer
            shards.append(HostShard(norm_index(s.index, shape), np.ascontiguousarray(data)))
        return HostLeaf(name, shape, dtype_name(leaf), repr(leaf.sharding), shards)
    arr = np.ascontiguousarray(np.asarray(leaf))
    return HostLeaf(name, arr.shape, dtype_name(arr), "host", [HostShard(tuple((0, n) for n in arr.shape), arr)])


def _shards_to_host(name: str, shards: Sequence[Shard]) -> HostLeaf:
    shape = tuple(int(n) for n in shards[0].global_shape)
    dtype = dtype_name(shards[0].data)
    out = []
    for s in shards:
        local = tuple(int(n) for n in s.data.shape)
        if tuple(s.global_shape) != shape or dtype_name(s.data) != dtype:
            raise errors.InvalidArgumentError(f"leaf {name!r}: its shards disagree on global shape or dtype")
        if len(s.offsets) != len(shape) or len(local) != len(shape) or \
                any(o < 0 or o + n > g for o, n, g in zip(s.offsets, local, shape)):
            raise errors.InvalidArgumentError(f"leaf {name!r}: shard of shape {local} at {tuple(s.offsets)} "
                                              f"is outside the global shape {shape}")
        data = torch_bytes(s.data) if type(s.data).__module__.startswith("torch") \
            else np.ascontiguousarray(np.asarray(s.data))
        out.append(HostShard(tuple((int(o), int(o) + n) for o, n in zip(s.offsets, local)), data))
    out.sort(key=lambda h: h.index)
    return HostLeaf(name, shape, dtype, "shards", out)


def torch_bytes(t: Any) -> np.ndarray:
    """A torch tensor's bytes as a flat uint8 array (no copy for a contiguous CPU tensor)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    out: np.ndarray = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return out


def norm_index(index: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A JAX shard's index (slices) as [start, stop) pairs."""
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise errors.InvalidArgumentError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    return tuple(out)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a manifest name (the narrow floats through ml_dtypes, as JAX has them)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # JAX's dependency: bfloat16 and the float8s

        return np.dtype(getattr(ml_dtypes, name))  # type: ignore[no-any-return]


def as_torch(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """Stored bytes (a buffer or uint8 array) as a torch tensor of `dtype` and `shape`, no copy.
    Read-only in fact when the bytes are: callers copy out of it (engines' weight loaders do)."""
    import torch

    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # torch warns that the pool's views are not writable
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(getattr(torch, dtype)).reshape(shape)
