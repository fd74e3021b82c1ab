"""Weight synchronization for RL: trainers publish versioned pytrees, samplers receive them.

See docs/weights.md. `plan` is pure (no I/O, no JAX); `manifest` is the data model of a
version, `codec` its stored form, `keys` its block keys, `storage` reading and writing it
through a KVStore, `head` the host's current version.
"""

from tpusync.weights.leaves import VersionGoneError
from tpusync.weights.manager import TransferReport, WeightDistributor, WorkUnit
from tpusync.weights.plan import Plan, build_plan, predict, reroute
from tpusync.weights.receive import ReceiveReport, receive_version
from tpusync.weights.synchronizer import TemplateMismatchError, VersionedWeights
from tpusync.weights.tensors import Shard

__all__ = [
    "Plan",
    "ReceiveReport",
    "Shard",
    "TemplateMismatchError",
    "TransferReport",
    "VersionGoneError",
    "VersionedWeights",
    "WeightDistributor",
    "WorkUnit",
    "build_plan",
    "predict",
    "receive_version",
    "reroute",
]
