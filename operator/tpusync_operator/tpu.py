"""TPU slice arithmetic for GKE (pure). Facts: REFERENCE.md section 3; GKE's TPU docs (machine
types, accelerator labels, topologies per generation); TensorCores per chip as tpu-inference
counts them (versions.TPU_INFERENCE)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"

_ACCELERATOR = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v7x": "tpu7x"}
# Single-host machine types by chip count; multi-host v5e/v6e slices use 4-chip hosts.
_SINGLE_HOST = {
    "v5e": {1: "ct5lp-hightpu-1t", 4: "ct5lp-hightpu-4t", 8: "ct5lp-hightpu-8t"},
    "v6e": {1: "ct6e-standard-1t", 4: "ct6e-standard-4t", 8: "ct6e-standard-8t"},
}
_2D_TOPOLOGIES = {"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"}
# TensorCores per chip: what --tensor-parallel-size counts on tpu-inference (a JAX device is a
# TensorCore). v5e and v6e chips have one, v7x chips two (tpu_info.get_num_cores_per_chip).
TENSORCORES_PER_CHIP = {"v5e": 1, "v6e": 1, "v7x": 2}


# Memory of each TPU machine type in bytes (GB = 10^9), the most a sidecar's DRAM tier can lend.
# docs.cloud.google.com/tpu/docs/v5e "VM types" (ct5lp: 48, 192, 384 GB); .../tpu/docs/tpu7x
# "RAM (GB) (4-chip VM)" (v6e 720 GB, TPU7x 960 GB); .../tpu/docs/v6e "DRAM per host" for the
# 8-chip host (1536 GiB). The 1-chip v6e VM's memory is not on those pages: it is bounded by
# the 4-chip VM's, more than it has, so the rule only refuses what cannot fit on any v6e host.
MACHINE_MEMORY_BYTES = {
    "ct5lp-hightpu-1t": 48 * 10**9, "ct5lp-hightpu-4t": 192 * 10**9, "ct5lp-hightpu-8t": 384 * 10**9,
    "ct6e-standard-1t": 720 * 10**9, "ct6e-standard-4t": 720 * 10**9, "ct6e-standard-8t": 1536 * 2**30,
    "tpu7x-standard-4t": 960 * 10**9,
}


def host_memory_by_slice() -> dict[str, int]:
    """'<type>/<topology>' (v5e, v6e) or 'v7x' -> the memory of the slice's machine type."""
    out = {f"{t}/{topo}": MACHINE_MEMORY_BYTES[slice_for(t, topo).machine_type]
           for t in _SINGLE_HOST for topo in sorted(_2D_TOPOLOGIES, key=_chips)}
    out["v7x"] = MACHINE_MEMORY_BYTES[slice_for("v7x", "2x2x1").machine_type]
    return out


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


class TopologyError(ValueError):
    """A TPU type/topology combination that GKE cannot provision."""


@dataclass(frozen=True)
class Slice:
    tpu_type: str
    topology: str
    chips: int
    chips_per_host: int
    hosts: int
    machine_type: str
    accelerator: str

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def cores_per_chip(self) -> int:
        return TENSORCORES_PER_CHIP[self.tpu_type]

    def tensor_parallel(self, chips: int) -> int:
        """The tensor-parallel size of an engine spanning `chips` chips: one per TensorCore."""
        return chips * self.cores_per_chip


def slice_for(tpu_type: str, topology: str) -> Slice:
    """Describe one slice; raises TopologyError (with the field named) when invalid."""
    try:
        dims = [int(d) for d in topology.split("x")]
    except ValueError:
        raise TopologyError(f"spec.tpu.topology {topology!r} is not of the form AxB or AxBxC") from None
    if any(d < 1 for d in dims):
        raise TopologyError(f"spec.tpu.topology {topology!r} has a zero dimension")
    chips = math.prod(dims)
    if tpu_type in _SINGLE_HOST:
        if len(dims) != 2 or topology not in _2D_TOPOLOGIES:
            raise TopologyError(
                f"spec.tpu.topology {topology!r} is not a {tpu_type} topology "
                f"(one of {', '.join(sorted(_2D_TOPOLOGIES, key=_chips))})")
        machines = _SINGLE_HOST[tpu_type]
        if chips in machines:
            return Slice(tpu_type, topology, chips, chips, 1, machines[chips], _ACCELERATOR[tpu_type])
        return Slice(tpu_type, topology, chips, 4, chips // 4, machines[4], _ACCELERATOR[tpu_type])
    if tpu_type == "v7x":
        if len(dims) != 3 or chips % 4 != 0:
            raise TopologyError(
                f"spec.tpu.topology {topology!r} is not a v7x topology (AxBxC with a multiple of 4 chips)")
        return Slice("v7x", topology, chips, 4, chips // 4, "tpu7x-standard-4t", _ACCELERATOR["v7x"])
    raise TopologyError(f"spec.tpu.type {tpu_type!r} is not supported (v5e, v6e, v7x)")
