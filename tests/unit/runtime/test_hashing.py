"""Block keys: the vLLM sha256_cbor prefix chain that llm-d recomputes from KV events."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from tpusync.kv.keys import BlockHasher, event_hash_of, key_of


def test_first_block_matches_a_hand_encoded_cbor_vector():
    h = BlockHasher(block_size=3, seed="tpusync")
    # CBOR by hand (RFC 8949): text "tpusync" = 0x67 + bytes.
    root = hashlib.sha256(b"\x67tpusync").digest()
    assert h.root == root
    # [bytes(32) root, [1, 2, 3], null] = 0x83, 0x58 0x20 + root, 0x83 01 02 03, 0xf6
    first = hashlib.sha256(b"\x83\x58\x20" + root + b"\x83\x01\x02\x03\xf6").digest()
    assert h.digests([1, 2, 3, 4]) == [first]  # the partial block [4] has no key
    second = hashlib.sha256(b"\x83\x58\x20" + first + b"\x83\x18\x64\x19\x01\x2c\x1a\x00\x01\x86\xa0\xf6").digest()
    assert h.digests([1, 2, 3, 100, 300, 100000])[1] == second  # 1-, 2- and 4-byte integer heads


def test_fixed_vectors():
    h = BlockHasher(block_size=4)
    assert [hex(k) for k in h.keys([1, 2, 3, 4, 5, 6, 7, 8, 9])] == [
        "0x5079138724714da8419619c94d52af26", "0x3aa844dfce37c363696e5c32f6a64667"]


def test_keys_and_event_hashes_are_the_digest_low_bits():
    d = BlockHasher(2).digests([5, 6])[0]
    assert key_of(d) == int.from_bytes(d[16:], "big")
    assert event_hash_of(d) == key_of(d) & (2**64 - 1)


def test_chain_depends_on_the_whole_prefix_and_on_extra_keys():
    h = BlockHasher(2)
    a, b = h.keys([1, 2, 3, 4]), h.keys([9, 2, 3, 4])
    assert a[1] != b[1]  # same block tokens, different parent
    assert h.keys([1, 2], extra=["lora-a"]) != h.keys([1, 2], extra=["lora-b"]) != h.keys([1, 2])
    assert BlockHasher(2, seed="other").keys([1, 2]) != h.keys([1, 2])


def test_keys_do_not_depend_on_pythonhashseed():
    code = "from tpusync.kv.keys import BlockHasher; print(BlockHasher(4).keys(list(range(12))))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "random")}
    assert len(outs) == 1
