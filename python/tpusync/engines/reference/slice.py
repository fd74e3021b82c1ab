"""A multi-host slice of the reference engine: one JAX process per host, one sidecar per host.

The processes form one JAX program (`jax.distributed`; on the CPU with gloo collectives, as
JAX's own multi-process tests run), with the KV cache sharded over every device of the slice
on its kv-heads axis: each host holds its heads of every page. Process 0, the leader, serves
HTTP; every request goes to all processes in order (`Slice.broadcast`), and all run it in
lockstep (the same jitted computations, in the same order).

Each host saves and loads its own shards through its own sidecar (`tpusync.kv.pages`: a shard's
part of a block has its own key). What the slice holds is what every host holds: each host
looks up, pulls and loads its shards, and the slice takes the smallest prefix of them
(`agree`) and computes the rest, so a host whose sidecar failed makes the slice recompute,
never load a page in part.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync import errors

AXIS = "tp"
_NOOP = {"op": "noop"}


@dataclass(frozen=True)
class SliceConfig:
    coordinator: str      # host:port of process 0's coordination service (bound there)
    processes: int
    process_id: int
    cpu_devices: int = 0  # on the CPU: devices per process (jax_num_cpu_devices); 0 leaves JAX's default

    def validate(self) -> None:
        if self.processes < 2:
            raise errors.InvalidArgumentError("a slice has at least 2 processes (one per host)")
        if not 0 <= self.process_id < self.processes:
            raise errors.InvalidArgumentError(f"--process-id must be within 0..{self.processes - 1}")


class Slice:
    """This process's place in the slice. Construct before any other JAX call."""

    def __init__(self, cfg: SliceConfig) -> None:
        cfg.validate()
        if cfg.cpu_devices:
            jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(cfg.coordinator, num_processes=cfg.processes, process_id=cfg.process_id,
                                   coordinator_bind_address=_bind_address(cfg.coordinator) if cfg.process_id == 0
                                   else None)
        self.cfg = cfg
        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))
        self.leader = cfg.process_id == 0

    @property
    def devices(self) -> int:
        return int(self.mesh.size)

    def sharding(self, axis: int | None, ndim: int) -> NamedSharding:
        """Sharded over the slice on `axis` (None: replicated)."""
        spec: list[str | None] = [None] * ndim
        if axis is not None:
            spec[axis] = AXIS
        return NamedSharding(self.mesh, P(*spec))

    def broadcast(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """The leader's `message` on every process (the others pass None): a JSON object."""
        data = json.dumps(message if message is not None else _NOOP).encode() if self.leader else b""
        size = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64), is_source=self.leader)[0])
        width = 1 << max(size - 1, 0).bit_length()  # a few padded shapes, each compiled once
        buf = np.zeros(width, np.uint8)
        if self.leader:
            buf[:size] = np.frombuffer(data, np.uint8)
        got = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.leader))
        out: dict[str, Any] = json.loads(got[:size].tobytes())
        return out

    def agree(self, counts: Sequence[int]) -> list[int]:
        """Each of `counts`, the smallest any process has: what the whole slice has."""
        return [int(x) for x in self.gather(np.array(counts, np.int64)).min(axis=0)]

    def gather(self, row: np.ndarray) -> np.ndarray:
        """Every process's `row` (one shape on all), stacked in process order."""
        return np.asarray(multihost_utils.process_allgather(row)).reshape(self.cfg.processes, *row.shape)

    def gather_text(self, text: str) -> list[str]:
        """Every process's `text`, in process order (short strings: addresses)."""
        raw = text.encode()
        if len(raw) > 255:
            raise errors.InvalidArgumentError(f"{text[:40]!r}...: at most 255 bytes")
        buf = np.zeros(256, np.uint8)
        buf[0] = len(raw)
        buf[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
        rows = self.gather(buf)
        return [bytes(r[1:1 + int(r[0])]).decode() for r in rows]


def _bind_address(coordinator: str) -> str:
    """Where process 0 binds the coordinator: the address it is reached at when that is an IP
    (JAX's default binds every address), every address when it is a name (a pod's DNS name, as
    LWS_LEADER_ADDRESS is: the pod's NetworkPolicy admits only its group)."""
    host, _, port = coordinator.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"[::]:{port}"
    return coordinator
