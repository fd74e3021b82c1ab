"""vLLM on tpu-inference, on the CPU, computes what HF transformers computes: greedy tokens of
the tiny random Qwen3 equal, token for token, for a batch of prompts of different lengths and
again when vLLM's own prefix cache serves part of a prompt."""

from __future__ import annotations

from harness.engines import prompt

PROMPTS = [prompt(1, 100), prompt(2, 300), prompt(3, 64)]  # partial last block, 9 blocks + 12, exactly 2 blocks


def test_greedy_tokens_equal_transformers(engines, reference):
    out = engines["plain"].call("generate", prompts=PROMPTS, max_tokens=16)["outputs"]
    for p, o in zip(PROMPTS, out):
        assert o["token_ids"] == reference(p)


def test_prefix_cache_hit_gives_the_same_tokens(engines, reference):
    shared = PROMPTS[1][:256] + prompt(4, 40)  # 8 blocks already in vLLM's prefix cache
    engines["plain"].generate(PROMPTS[1])
    assert engines["plain"].generate(shared)["token_ids"] == reference(shared)
