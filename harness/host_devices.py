"""Runs a script in a fresh interpreter where JAX has four XLA host (CPU) devices: a device
count is fixed when JAX first initialises, so a test of sharded arrays cannot set it in the
test process itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_on_four_devices(script: str) -> None:
    """Runs `script` (its checks as asserts, "ok" printed at the end) on four host devices."""
    code = 'import os\nos.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"\n' + textwrap.dedent(script)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
