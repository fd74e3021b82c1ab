"""A client of a disaggregated serving, as a program, so a test runs it where a client would be
(on a node of a real cluster, resolving Service names through the cluster's DNS):

    python -m harness.pd_client PREFILL_URL DECODE_URL BODY_JSON
    python -m harness.pd_client --until STOP_FILE PREFILL_URL DECODE_URL BODY_JSON

sends the two requests llm-d's P/D proxy sends with its nixlv2 connector (the routing
sidecar's prefill and decode steps): the prompt to the prefill engine with max_tokens 1 and
`kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}`, then to the decode
engine with the `kv_transfer_params` the prefill answered plus `"do_remote_prefill": true`;
then the same body to the decode engine once more with no parameters (a repeated prompt).
Prints one JSON object: per step its final chunk and tokens. With --until, repeats the
prefill and decode steps until STOP_FILE exists, printing a JSON line per exchange as it ends:
{"ok": true, "tokens": [...], "tpusync": {...}} or {"ok": false, "error": "..."} (a client during a rollout,
which counts what it was refused instead of stopping at it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tpusync.demo import post


def prefill(prefill_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[int], dict[str, Any]]:
    """The proxy's first request: the final chunk, the tokens and the kv_transfer_params for decode."""
    p_final, _, p_tokens = post(prefill_url, {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})
    params = p_final.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill engine answered no kv_transfer_params: {p_final}")
    return p_final, p_tokens, {**params, "do_remote_prefill": True}


def exchange(prefill_url: str, decode_url: str, body: dict[str, Any]) -> dict[str, Any]:
    p_final, p_tokens, params = prefill(prefill_url, body)
    d_final, _, d_tokens = post(decode_url, {**body, "kv_transfer_params": params})
    r_final, _, r_tokens = post(decode_url, body)
    return {"prefill": {"final": p_final, "tokens": p_tokens},
            "decode": {"final": d_final, "tokens": d_tokens},
            "repeat": {"final": r_final, "tokens": r_tokens}}


def until(stop: Path, prefill_url: str, decode_url: str, body: dict[str, Any]) -> None:
    while not stop.exists():
        t0 = time.time()
        try:
            params = prefill(prefill_url, body)[2]
            final, _, tokens = post(decode_url, {**body, "kv_transfer_params": params})
            line: dict[str, Any] = {"ok": True, "tokens": tokens, "tpusync": final.get("tpusync")}
        except Exception as err:  # noqa: BLE001 - every failure a client sees is one to count
            line = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps({**line, "start": t0, "end": time.time()}), flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "--until":
        until(Path(argv[1]), argv[2], argv[3], json.loads(argv[4]))
        return 0
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(exchange(argv[0], argv[1], json.loads(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
