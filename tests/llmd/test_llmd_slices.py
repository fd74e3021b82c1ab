"""KV events of a multi-host slice of reference engines (two JAX processes, 2 devices each, one
sidecar per host; tpusync.engines.reference.slice), read by llm-d's own indexer: a block is the slice's
only while every host holds its part of it, and the slice's leader announces it once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.llmd_fleet import MODEL_NAME, Host, PublisherAt, connect, eventually, model_config, served
from harness.processes import free_port
from tpusync import KVStore
from tpusync.kv.keys import BlockHasher, shard_key
from tpusync.local.servers import SliceProcesses, start_slice

PAGE = 32
SHARDS = 4  # 2 hosts x 2 devices, one kv head each
PARAMETERS = {"tokenProcessorConfig": {"blockSizeTokens": PAGE},
              "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": False},
              "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": False}}}


@dataclass
class SliceEngine(PublisherAt):
    """A slice as the tier's helpers see an engine: its leader's pod and KV-events endpoint."""

    ip = "127.0.0.1"  # a class attribute, not a field
    processes: SliceProcesses
    events_port: int
    page_size: int = PAGE

    @classmethod
    def start(cls, hosts: list[Host]) -> SliceEngine:
        events_port = free_port()
        processes = start_slice(
            "both", [(h.sidecar.control_socket, h.sidecar.address) for h in hosts],
            model_config={**model_config(PAGE), "heads": 4, "kv_heads": 4, "head_dim": 32},
            coordinator=f"127.0.0.1:{free_port()}", cpu_devices=2,
            extra_args=["--served-model-name", MODEL_NAME, "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
                        "--kv-events-audit-s", "0.2", "--no-warm-up"])
        return cls(processes, events_port)

    @property
    def port(self) -> int:  # the leader serves HTTP
        return self.processes.leader.port


def test_a_slice_announces_a_block_while_every_host_holds_its_part(cluster, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    hosts = [cluster.host(PAGE), cluster.host(PAGE)]
    engine = SliceEngine.start(hosts)
    try:
        ix = cluster.indexer(PARAMETERS)
        connect(ix, engine, np.random.default_rng(990).integers(0, 256, 64).tolist())
        prompt = np.random.default_rng(991).integers(0, 256, 320).tolist()
        served(ix, engine, prompt)  # announced after every host saved its shards
        assert ix.score(prompt)["pods"][engine.pod]["tiers"] == {"cpu": 10}

        # Host 1's sidecar drops its shards of the last four blocks: those are no longer the
        # slice's, though host 0 still holds its part; the leader's lockstep audit tells llm-d.
        keys = BlockHasher(PAGE).keys(prompt)
        with KVStore.connect(f"unix://{hosts[1].sidecar.control_socket}") as store:
            store.evict([shard_key(k, n, SHARDS) for k in keys[6:] for n in (2, 3)])
        with KVStore.connect(f"unix://{hosts[0].sidecar.control_socket}") as store:
            assert store.lookup([shard_key(k, n, SHARDS) for k in keys for n in (0, 1)]).prefix_len == 20
        got = eventually(lambda: ix.score(prompt)["pods"].get(engine.pod, {}).get("tiers") == {"cpu": 6})
        assert got, ix.score(prompt)

        # The same prompt again: the slice recomputes the lost blocks, saves them on both hosts
        # and announces them again.
        again = served(ix, engine, prompt)
        assert again["tpusync"]["cached_tokens"] == 128  # 6 whole blocks, resumed at a chunk boundary
        assert ix.score(prompt)["pods"][engine.pod]["tiers"] == {"cpu": 10}
    finally:
        engine.processes.stop()
