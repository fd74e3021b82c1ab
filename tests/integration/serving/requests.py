"""Requests to reference servers, shared by the serving tiers' tests."""

from __future__ import annotations

import json
import urllib.request

import numpy as np


def post(url: str, body: dict, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def tokens(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def pd(mono: str, prefill: str, decode: str, p: list[int], max_tokens: int) -> tuple[list[int], dict, dict]:
    """The monolithic server's tokens, the prefill server's response and the decode server's,
    given the prefill's kv_transfer_params."""
    want = tokens(post(mono, {"prompt": p, "max_tokens": max_tokens}))
    first = post(prefill, {"prompt": p, "max_tokens": 1})
    decoded = post(decode, {"prompt": p, "max_tokens": max_tokens, "kv_transfer_params": first["kv_transfer_params"]})
    return want, first, decoded
