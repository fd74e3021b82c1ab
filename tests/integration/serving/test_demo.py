"""`make demo` (python -m tpusync.demo), run as a user runs it: real sidecars and servers. Its
table is explained, and the explanation holds for the numbers the run printed: what `mono` is,
why request 0 (cold) computes and pulls everything, why a prefix hit still computes a chunk,
and that the model is a tiny one on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys

from tpusync import demo
from tpusync.engines.reference.model import ModelConfig

CFG = ModelConfig(**demo.MODEL)
PROMPT = demo.SHARED_PREFIX + demo.SUFFIX
BLOCK = -(-CFG.page_bytes // 4096) * 4096


def mib(tokens: int) -> str:
    return f"{tokens // CFG.page_size * BLOCK / 2**20:.1f} MiB"


def test_the_demo_explains_what_it_shows():
    done = subprocess.run([sys.executable, "-m", "tpusync.demo", "--requests", "2"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    text = " ".join(done.stdout.split())   # rich wraps long lines
    for said in (demo.model_note(CFG), *demo.legend(CFG).splitlines()):
        assert " ".join(said.split()) in text, said
    assert "a tiny model on the CPU" in text and "mono: one server that prefills and decodes itself" in text
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in done.stdout.splitlines()
            if re.match(r"│\s+\d+ │", line)]
    header = ["req", "mono TTFT", "P/D TTFT", "prefill computed", "KV pulled", "transfer ms", "hit TTFT",
              "hit computed", "tokens"]
    table = [dict(zip(header, r)) for r in rows]
    assert [t["req"] for t in table] == ["0", "1"], done.stdout
    # Request 0 is cold: the whole prompt computed, every page pulled.
    assert table[0]["prefill computed"] == str(PROMPT) and table[0]["KV pulled"] == mib(PROMPT)
    # Then only what follows the shared prefix.
    assert table[1]["prefill computed"] == str(demo.SUFFIX) and table[1]["KV pulled"] == mib(demo.SUFFIX)
    # A hit computes the chunk holding the last prompt token, as the legend says.
    assert {t["hit computed"] for t in table} == {str(CFG.chunk)}
    assert {t["tokens"] for t in table} == {"equal"}
