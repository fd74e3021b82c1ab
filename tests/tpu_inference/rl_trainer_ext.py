"""A vLLM worker extension for the RL tier's trainer stand-in: an engine loaded with the new
checkpoint publishes its live weights as a tpusync version, as a JAX trainer holding the same
layout would. The list is the one tpu-inference's RL sampler binds (its own flatten and
filter, in tree order), so leaf i of the version lands in bound array i of the sampler."""

from __future__ import annotations

from typing import Any


class PublishWeights:
    def publish_weights(self: Any, version: int, model: str = "rollout") -> int:
        import numpy as np
        from tpu_inference.rl import raiden_worker_sync as rws

        from tpusync.store import connect_sidecar
        from tpusync.weights import VersionedWeights

        _, arrays = rws._filter_bindable(*rws.flatten_weights(self.get_weights_state()))
        with VersionedWeights(connect_sidecar(None), model) as sync:
            sync.publish([np.asarray(a) for a in arrays], version)
        return len(arrays)

