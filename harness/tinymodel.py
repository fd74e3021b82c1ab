"""A tiny random-weight Qwen3 with a byte-level BPE tokenizer, built locally (no model hub).

Weights are drawn with a large init range (0.2) so that greedy decoding does not collapse
onto one token: a wrong KV block then shows as different output tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

BLOCK_SIZE = 32   # vLLM block size in tokens (the CPU attention backend needs a multiple of 32)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
VOCAB = 512
# One store block: every layer's [kv_heads, block_size, 2 * head_dim] float32 page.
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 4


def build(path: str | Path, seed: int = 0, **sizes: int) -> Path:
    """The model at `path`; another `seed` gives other weights of the same shapes, `sizes`
    (Qwen3Config fields: hidden_size=1024, ...) a larger model (bench/inplace_bench.py)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    fields = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": LAYERS,
              "num_attention_heads": 2, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": True,
              "initializer_range": 0.2}
    cfg = Qwen3Config(**(fields | sizes))
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
