"""bench/device_check.py (bench/device/run.sh on a lent GPU machine) run here on the CPU, the same
steps with CPU arrays (`--quick` sizes), so it does not rot between loans (its torch steps run in
the vLLM tier, tests/vllm/test_torch_pages.py, where torch is): the demo's P/D with
its servers on the given platform, the page round trips (the resharded one from a cache split
over two CPU devices), the device <-> pool cases and the Qwen3-235B move, each with its
baseline and the device named. Its comparison of pages is held to fail on a flipped byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "device_check.py"


@pytest.mark.timeout(900)
def test_the_device_check_runs_its_steps_on_the_cpu(tmp_path):
    out = tmp_path / "device.json"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--platform", "cpu", "--frameworks", "jax", "--quick",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=850, env=env)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    results = {r["case"]: r for r in json.loads(out.read_text())}
    assert results["pd-reference"]["tokens_equal"] is True
    assert results["pages-jax"]["bytes_equal"] is True
    probe = results["dma-map-jax"]  # the CPU's PJRT client maps no host memory for DMA
    assert probe["supported"] is False and "UNIMPLEMENTED" in probe["error"], probe
    rates = [c for c in results if c not in ("pd-reference", "pages-jax", "dma-map-jax")]
    for size in ("64k", "1m"):
        for layout in ("contiguous", "8-layers"):
            assert {f"d2h-jax-{size}-{layout}", f"h2d-jax-{size}-{layout}"} <= set(rates)
    assert "pd-qwen3-235b-256t" in rates
    for case in rates:
        r = results[case]
        assert r["device"] == "cpu" and r["reps"] == 2, r
        assert r["seconds"] > 0 and r["baseline_seconds"] > 0, r
        assert r["ratio"] == pytest.approx(r["baseline_seconds"] / r["seconds"]), r
        assert r["baseline"] == ("copy out + raw-tcp-4s + copy in" if case.startswith("pd-") else "memcpy"), r


def test_the_page_comparison_fails_on_one_flipped_byte(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import device_check

    check = device_check.Check("cpu", device_check.QUICK)
    want = [np.arange(64, dtype=np.uint16).reshape(4, 16).view(np.float16)]
    got = [want[0].copy()]
    check.expect_equal("same", got, want, 4)
    assert check.problems == []
    got[0].view(np.uint8).reshape(-1)[3 * 32 + 5] ^= 1  # page 3
    check.expect_equal("flipped", got, want, 4)
    assert check.problems == ["flipped: layer 0: the loaded pages differ from the saved ones"]
    check.problems = []
    check.expect_equal("only the first three pages", got, want, 3)
    assert check.problems == []
