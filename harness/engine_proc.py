"""One vLLM engine (offline LLM API, in-process executor) driven over stdin/stdout.

    python engine_proc.py '{"model": DIR, "kv_transfer_config": {...} or null, "kv_events_config": {...},
                            "worker_extension_cls": "module.Class" or null}'

Reads one JSON command per line on stdin and answers one JSON line on stdout (vLLM's own
output goes to stderr):

    {"op": "generate", "prompts": [[ids...]], "max_tokens": 16, "kv_transfer_params": [{...} or null]}
        -> {"outputs": [{"token_ids": [...], "kv_transfer_params": {...} or null}], "stats": {...}}
    {"op": "stats"} -> {"stats": {...}}            the connector's counters in this process
    {"op": "reset_prefix_cache"} -> {}             empties vLLM's own prefix cache
    {"op": "weights", "call": NAME, "arg": ..., "kwargs": {...}} -> {"result": ...}
        LLM.NAME(arg, **kwargs): init_weight_transfer_engine, start_weight_update, update_weights,
        finish_weight_update, get_weight_version (the weight-transfer API, RLOfflineMixin)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
BLOCK_SIZE = 32


def protocol_stream() -> TextIO:
    """The protocol's own stdout; whatever else the engine prints goes to stderr from here on."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return proto


def sampling_params(cmd: dict, sampling_params_class: Any) -> list:
    """A generate command's greedy sampling, one per prompt, each with its kv_transfer_params."""
    params = cmd.get("kv_transfer_params") or [None] * len(cmd["prompts"])
    return [sampling_params_class(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True,
                                  extra_args={"kv_transfer_params": p} if p else None) for p in params]


def serve(proto: TextIO, llm: Any, ops: dict[str, Callable[[dict], dict]]) -> None:
    """The command loop of both engine scripts (this one and tpu_engine_proc.py): "ready", then one
    answer per command until "exit". `ops` answers the engine's own commands; reset_prefix_cache and
    weights are the LLM API's and the same in both."""
    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    def reset_prefix_cache(cmd: dict) -> dict:
        llm.reset_prefix_cache()
        return {}

    def weights(cmd: dict) -> dict:
        call = getattr(llm, cmd["call"])
        return {"result": call(*([cmd["arg"]] if "arg" in cmd else []), **cmd.get("kwargs", {}))}

    ops = {"reset_prefix_cache": reset_prefix_cache, "weights": weights, **ops}
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "exit":
                reply({})
                break
            op = ops.get(cmd["op"])
            reply(op(cmd) if op else {"error": f"unknown op {cmd['op']!r}"})
        except Exception:  # noqa: BLE001 - the harness gets the traceback; the engine keeps serving
            reply({"error": traceback.format_exc()})


def main() -> int:
    proto = protocol_stream()
    spec = json.loads(sys.argv[1])

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    events = spec.get("kv_events_config")

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
              kv_cache_memory_bytes=spec.get("kv_cache_bytes", 16 << 20), distributed_executor_backend="uni",
              max_model_len=1024,
              max_num_seqs=4, max_num_batched_tokens=1024, enable_prefix_caching=True, seed=0,
              kv_transfer_config=spec.get("kv_transfer_config"),
              kv_events_config=KVEventsConfig(**events) if events else None,
              weight_transfer_config=spec.get("weight_transfer_config"),
              worker_extension_cls=spec.get("worker_extension_cls") or "")

    def counters() -> dict:
        if not spec.get("kv_transfer_config"):
            return {}
        from tpusync.engines.vllm import connector

        return connector.stats()

    def generate(cmd: dict) -> dict:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]],
                            sampling_params(cmd, SamplingParams), use_tqdm=False)
        return {"outputs": [{"token_ids": list(o.outputs[0].token_ids),
                             "finish_reason": o.outputs[0].finish_reason,
                             "kv_transfer_params": o.kv_transfer_params} for o in outs],
                "stats": counters()}

    serve(proto, llm, {"generate": generate, "stats": lambda cmd: {"stats": counters()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
