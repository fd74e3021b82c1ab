"""The engine core of a simulated tpu-inference engine whose workers are `slice_host.py` processes
(one per host, as tpu-inference's Ray executor runs one worker per host): tpusync's real scheduler
half, every step sent to every host, their outputs merged by vLLM's own KVOutputAggregator and
handed back to the scheduler half, as vLLM's engine core does. Requests run one at a time
through vLLM's connector calls in vLLM's order: get_num_new_matched_tokens until it answers
(empty steps meanwhile), update_state_after_alloc, the step that loads and computes the rest,
steps that recompute blocks the workers could not load, request_finished."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from harness.processes import free_port
from tests.tpu_inference.slice_host import expected_kv

HOST = Path(__file__).with_name("slice_host.py")


@dataclass
class Served:
    params: dict[str, Any] | None  # request_finished's kv_transfer_params
    loaded: int                    # prompt blocks loaded from the store
    recomputed: int                # blocks the workers could not load after all (vLLM recomputes them)
    pages: list[int]


class SliceEngine:
    """`hosts`: one (sidecar control socket, data address) per host; `devices` per host."""

    def __init__(self, role: str, hosts: list[tuple[str, str]], *, devices: int, page_tokens: int = 16,
                 layers: int = 2, kv_heads: int = 4, head_dim: int = 128, pages: int = 64,
                 engine_id: str = "engine", kv_events: bool = False) -> None:
        from vllm.config import KVEventsConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        from tpusync.engines.connector.config import ConnectorConfig
        from tpusync.engines.connector.scheduler import SchedulerSide
        from tpusync.engines.tpu_inference.shards import shard_links
        from tpusync.kv.handoff import FORMAT_TPU_INFERENCE
        from tpusync.kv.keys import BlockScope

        self.page_tokens, self.layers, self.kv_heads, self.head_dim = page_tokens, layers, kv_heads, head_dim
        self.procs: list[subprocess.Popen] = []
        coordinator = f"127.0.0.1:{free_port()}"
        for i, (socket, address) in enumerate(hosts):
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPUSYNC_DATA_ADDRESS": address}
            self.procs.append(subprocess.Popen(
                [sys.executable, str(HOST), "--process-id", str(i), "--num-processes", str(len(hosts)),
                 "--coordinator", coordinator, "--devices", str(devices), "--control-socket", socket,
                 "--pages", str(pages), "--page-tokens", str(page_tokens), "--layers", str(layers),
                 "--kv-heads", str(kv_heads), "--head-dim", str(head_dim)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        shards = devices * len(hosts)
        block_bytes = layers * page_tokens * 2 * kv_heads * head_dim * 2  # K and V, bfloat16
        cfg = ConnectorConfig(control_socket=hosts[0][0], store="sidecar", data_address=hosts[0][1], retry_s=0.0,
                              timeout_s=10.0)
        scope = BlockScope(model="tiny", dtype="bfloat16", layers=layers, kv_heads=kv_heads, head_size=head_dim,
                           page_tokens=page_tokens, format=FORMAT_TPU_INFERENCE, shards=shards)
        self.sched = SchedulerSide(
            cfg, scope, block_bytes=block_bytes, engine_id=engine_id, save=role != "decode",
            pull=role != "prefill", hosts=len(hosts),
            kv_events=KVEventsConfig(enable_kv_cache_events=True) if kv_events else None)
        shard_links(self.sched, cfg, block_bytes // shards, shards)
        self.sched.kv_cache_manager = self
        self.aggregator = KVOutputAggregator(expected_finished_count=len(hosts))
        self.block_ids: dict[str, list[int]] = {}
        self.next_page = 0
        self.pages = pages
        self.empty_steps = 0

    def ready(self) -> SliceEngine:
        """Waits until every host has its cache and worker (engines start side by side)."""
        ready = [self._read(p) for p in self.procs]
        assert sorted(r["ready"] for r in ready) == list(range(len(self.procs)))
        return self

    # -- the workers ------------------------------------------------------------------------

    @staticmethod
    def _read(p: subprocess.Popen) -> Any:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"slice host {p.args} exited with {p.wait()}")
        return pickle.loads(bytes.fromhex(line.strip()))

    def _all(self, cmd: dict[str, Any]) -> list[Any]:
        data = pickle.dumps(cmd).hex() + "\n"
        for p in self.procs:
            p.stdin.write(data)
            p.stdin.flush()
        return [self._read(p) for p in self.procs]

    def step(self, scheduler_output: Any, compute: list[tuple[list[int], list[int], int]]) -> set[int]:
        """One engine step: the connector metadata and the forward's work to every host; returns
        the block ids the workers could not load."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        meta = self.sched.build_meta(scheduler_output)
        outs = self._all({"op": "step", "meta": meta, "compute": compute})
        merged = self.aggregator.aggregate([
            ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=o["meta"], invalid_block_ids=o["errors"])) for o in outs])
        kv_out = merged.kv_connector_output if merged is not None else None
        if kv_out is not None:
            self.sched.connector_output(kv_out)
        return set(kv_out.invalid_block_ids) if kv_out is not None else set()

    def _empty_step(self) -> None:
        self.sched.pool.submit(lambda: None).result()  # a one-host engine's pull is done
        self._all({"op": "wait_probes"})  # each host's probe thread is done: its answer rides this step
        self.step(_output(), [])
        self.empty_steps += 1

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:  # the KV cache manager's, for saves
        return (self.block_ids[req_id],)

    # -- a request ------------------------------------------------------------------------------

    def serve(self, req_id: str, tokens: list[int], kv_transfer_params: dict[str, Any] | None = None) -> Served:
        from vllm import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        params = {"do_remote_decode": True} if self.sched.save and kv_transfer_params is None else kv_transfer_params
        req = Request(req_id, tokens, SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = params
        for _ in range(8):  # vLLM asks again each step until the connector answers
            n, _async = self.sched.matched(req, 0)
            if n is not None:
                break
            self._empty_step()
        else:
            raise AssertionError("the connector never answered")
        blocks = -(-len(tokens) // self.page_tokens)
        if self.next_page + blocks > self.pages:
            self.next_page = 0
        pages = list(range(self.next_page, self.next_page + blocks))
        self.next_page += blocks
        self.block_ids[req_id] = pages
        self.sched.after_alloc(req, SimpleNamespace(get_block_ids=lambda: (pages,)), n)
        loaded = n // self.page_tokens
        bad = self.step(_output(new=[(req_id, n, len(tokens) - n)]), [(tokens, pages, loaded)])
        recomputed = sorted(pages.index(b) for b in bad if b in pages)
        if recomputed:  # vLLM recomputes from the first block that failed
            self.step(_output(), [(tokens, pages, recomputed[0])])
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        out = self.sched.finished(req)
        self.step(_output(), [])  # the releases of request_finished reach the hosts
        return Served(out, min(loaded, recomputed[0]) if recomputed else loaded, len(recomputed), pages)

    def page_kv(self, pages: list[int]) -> np.ndarray:
        """The cache's pages as the hosts hold them: [layers, pages, page tokens, *width]."""
        parts: dict[int, np.ndarray] = {}
        for out in self._all({"op": "pages", "pages": pages}):
            parts.update(out)
        return np.concatenate([parts[n] for n in sorted(parts)], axis=3)

    def expected(self, tokens: list[int], pages: int) -> np.ndarray:
        width = (self.kv_heads, 2, self.head_dim)
        kv = expected_kv(tokens[:pages * self.page_tokens], self.layers, self.page_tokens, width)
        return kv.reshape((self.layers, pages, self.page_tokens) + width)

    def stop(self) -> None:
        self.sched.shutdown()
        try:
            self._all({"op": "stop"})
        finally:
            for p in self.procs:
                p.wait(timeout=60)


def _output(new: list[tuple[str, int, int]] | None = None) -> Any:
    """A SchedulerOutput as the scheduler half reads it: new requests (id, computed, scheduled)."""
    new = new or []
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r: s for r, _, s in new})
