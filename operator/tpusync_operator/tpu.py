"""TPU slice arithmetic for GKE (pure). Facts: REFERENCE.md section 3."""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"

_ACCELERATOR = {"v6e": "tpu-v6e-slice", "v7x": "tpu7x"}
# v6e single-host machine types by chip count; multi-host v6e slices use 4-chip hosts.
_V6E_SINGLE_HOST = {1: "ct6e-standard-1t", 4: "ct6e-standard-4t", 8: "ct6e-standard-8t"}
_V6E_TOPOLOGIES = {"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"}


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


def slice_for(tpu_type: str, topology: str) -> Slice:
    """Describe one slice; raises TopologyError (with the field named) when invalid."""
    try:
        dims = [int(d) for d in topology.split("x")]
    except ValueError:
        raise TopologyError(f"spec.tpu.topology {topology!r} is not of the form AxB or AxBxC") from None
    if any(d < 1 for d in dims):
        raise TopologyError(f"spec.tpu.topology {topology!r} has a zero dimension")
    chips = math.prod(dims)
    if tpu_type == "v6e":
        if len(dims) != 2 or topology not in _V6E_TOPOLOGIES:
            raise TopologyError(
                f"spec.tpu.topology {topology!r} is not a v6e topology "
                f"(one of {', '.join(sorted(_V6E_TOPOLOGIES, key=_chips))})")
        if chips in _V6E_SINGLE_HOST:
            return Slice("v6e", topology, chips, chips, 1, _V6E_SINGLE_HOST[chips], _ACCELERATOR["v6e"])
        return Slice("v6e", topology, chips, 4, chips // 4, "ct6e-standard-4t", _ACCELERATOR["v6e"])
    if tpu_type == "v7x":
        if len(dims) != 3 or chips % 4 != 0:
            raise TopologyError(
                f"spec.tpu.topology {topology!r} is not a v7x topology (AxBxC with a multiple of 4 chips)")
        return Slice("v7x", topology, chips, 4, chips // 4, "tpu7x-standard-4t", _ACCELERATOR["v7x"])
    raise TopologyError(f"spec.tpu.type {tpu_type!r} is not supported (v6e, v7x)")
