"""A client of a disaggregated serving, as a program, so a test runs it where a client would be
(on a node of a real cluster, resolving Service names through the cluster's DNS):

    python -m harness.pd_client PREFILL_URL DECODE_URL BODY_JSON

sends the two requests llm-d's P/D proxy sends with its nixlv2 connector (the routing
sidecar's prefill and decode steps): the prompt to the prefill engine with max_tokens 1 and
`kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}`, then to the decode
engine with the `kv_transfer_params` the prefill answered plus `"do_remote_prefill": true`;
then the same body to the decode engine once more with no parameters (a repeated prompt).
Prints one JSON object: per step its final chunk and tokens.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tpusync.demo import post


def exchange(prefill_url: str, decode_url: str, body: dict[str, Any]) -> dict[str, Any]:
    p_final, _, p_tokens = post(prefill_url, {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})
    params = p_final.get("kv_transfer_params")
    if not params:
        raise SystemExit(f"the prefill engine answered no kv_transfer_params: {p_final}")
    d_final, _, d_tokens = post(decode_url, {**body, "kv_transfer_params": {**params, "do_remote_prefill": True}})
    r_final, _, r_tokens = post(decode_url, body)
    return {"prefill": {"final": p_final, "tokens": p_tokens},
            "decode": {"final": d_final, "tokens": d_tokens},
            "repeat": {"final": r_final, "tokens": r_tokens}}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(exchange(argv[0], argv[1], json.loads(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
