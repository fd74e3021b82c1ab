"""One vLLM engine on tpu-inference (offline LLM API, in-process executor) driven over stdin/stdout.

    python tpu_engine_proc.py '{"model": DIR, "kv_transfer_config": {...} or null, "kv_events_config": {...} or null,
                                "tensor_parallel_size": 1}'

The protocol of harness/engine_proc.py (one JSON command per line on stdin, one JSON answer
per line on stdout, vLLM's own output on stderr), so harness/engines.py's Engine drives it:

    {"op": "generate", "prompts": [[ids...]], "max_tokens": 16, "kv_transfer_params": [{...} or null]}
        -> {"outputs": [{"token_ids": [...], "kv_transfer_params": {...} or null, "seconds": s,
                         "num_cached_tokens": n}]}
        (seconds: the engine's time for the batch, from submission to the last output;
        num_cached_tokens: the prompt tokens vLLM did not compute, local and external hits; the
        prefill's, if kv_transfer_params carry remote_prefill_cached_tokens)
    {"op": "stats"} -> {"stats": {...}}   tpusync's connector counters in this process, and
        tpusync.engines.upstream's KVCacheManager's as upstream_<name>
    {"op": "reset_prefix_cache"} -> {}   empties vLLM's own prefix cache
    {"op": "page_digests"} -> {"shards": S, "digests": [[hex per page] per shard]}
        the bytes of each KV cache page, per shard of the `model` axis, every layer's part in
        layer order: what tpusync stores as one shard's part of a block
    {"op": "weights", "call": NAME, "arg": ..., "kwargs": {...}} -> {"result": ...}
        LLM.NAME(arg, **kwargs): start_weight_update, finish_weight_update, collective_rpc
        (a worker extension's method: "arg" is its name)
    {"op": "exit"} -> {}

Runs with JAX_PLATFORMS=cpu, where the test plugin tpusync_cpu_shim stands in for the TPU-only
kernels. vLLM's async scheduling stays off: it overlaps a step's scheduling with the previous
step's forward, and on this CPU setup it changed greedy tokens now and then.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
BLOCK_SIZE = 32
NUM_BLOCKS = 96  # KV cache pages of BLOCK_SIZE tokens (as many tokens at another page size): vLLM would
# otherwise size the cache from the "HBM" the shim reports


def page_digests(layers: list) -> dict:
    import hashlib

    import numpy as np

    from tpusync.kv.pages import shard_number

    parts: dict[int, list[np.ndarray]] = {}
    for layer in layers:
        shard_shape = layer.sharding.shard_shape(layer.shape)
        seen = set()
        for s in layer.addressable_shards:
            n = shard_number(s.index, layer.shape, shard_shape)
            if n not in seen:
                seen.add(n)
                parts.setdefault(n, []).append(np.asarray(s.data))
    digests = []
    for n in sorted(parts):
        pages = parts[n][0].shape[0]
        digests.append([hashlib.blake2b(b"".join(a[p].tobytes() for a in parts[n]), digest_size=16).hexdigest()
                        for p in range(pages)])
    return {"shards": len(parts), "digests": digests}


def main() -> int:
    # The sibling script's protocol loop: run as a script, this file's folder is sys.path[0].
    from engine_proc import protocol_stream, sampling_params, serve

    proto = protocol_stream()
    spec = json.loads(sys.argv[1])

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    events = spec.get("kv_events_config")

    block_size = spec.get("block_size", BLOCK_SIZE)
    llm = LLM(model=spec["model"], dtype="float32", block_size=block_size,
              num_gpu_blocks_override=NUM_BLOCKS * BLOCK_SIZE // block_size, distributed_executor_backend="uni",
              max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024,
              enable_prefix_caching=True, seed=0, async_scheduling=False,
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              kv_transfer_config=spec.get("kv_transfer_config"),
              kv_events_config=KVEventsConfig(**events) if events else None,
              worker_extension_cls=spec.get("worker_extension_cls") or "")

    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore

    def settle() -> None:
        """One more step while requests finished in the last one: the API server's engine loop
        runs it at once (`EngineCore.run_busy_loop`, while `scheduler.has_requests()`), and it is
        the step that hands a prefill connector the requests to send. The offline API stops at
        the last output, before it. (Later steps only free what was sent.)"""
        while core.scheduler.finished_req_ids:
            llm.llm_engine.step()

    def generate(cmd: dict) -> dict:
        sps = sampling_params(cmd, SamplingParams)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sps, use_tqdm=False)
        seconds = time.perf_counter() - start  # the whole batch, before the settling step
        settle()
        return {"outputs": [{"token_ids": list(o.outputs[0].token_ids), "seconds": seconds,
                             "num_cached_tokens": o.num_cached_tokens,
                             "kv_transfer_params": o.kv_transfer_params} for o in outs]}

    def counters(cmd: dict) -> dict:  # tpusync's connector counters in this process
        from tpusync.engines.connector.common import stats
        from tpusync.engines.upstream.counters import stats as upstream_stats

        return {"stats": stats() | {f"upstream_{k}": v for k, v in upstream_stats().items()}}

    def digests(cmd: dict) -> dict:
        return page_digests(core.model_executor.driver_worker.worker.model_runner.kv_caches)

    serve(proto, llm, {"generate": generate, "stats": counters, "page_digests": digests})
    proto.flush()
    os._exit(0)  # vLLM's exit hooks expect torch modules (tpu-inference's models are JAX) and only add noise


if __name__ == "__main__":
    sys.exit(main())
