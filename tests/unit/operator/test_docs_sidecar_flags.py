"""docs/operator.md lists the sidecar flags the operator renders: exactly those
builders/sidecar.py renders for a pool with every tier and a serving with a pool per role, and
each a flag tpusync-sidecar itself describes in --help. (The list said no flag existed for the
shared tier and named an environment variable nothing sets.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from op_helpers import PoolBody

from tpusync.local.sidecars import sidecar_binary
from tpusync_operator.builders.sidecar import build_sidecar_container
from tpusync_operator.models import TPUSyncPoolSpec

DOC = Path(__file__).resolve().parents[3] / "docs" / "operator.md"


def documented() -> set[str]:
    bullet = re.search(r"^- Sidecar flags.*?(?=^- |^#|\Z)", DOC.read_text(), re.M | re.S)
    assert bullet is not None, "docs/operator.md has no 'Sidecar flags' item"
    return set(re.findall(r"--[a-z][a-z-]*[a-z]", bullet.group(0)))


def rendered() -> set[str]:
    body = PoolBody().spec(tiers={"disk": {"size": "100Gi"}, "shared": {"claimName": "kv", "capacity": "1Ti"}},
                           sidecar={"encrypt": True})
    spec = TPUSyncPoolSpec.model_validate(body.build()["spec"])
    container = build_sidecar_container("pool", "ns", spec, dram_bytes=1 << 30, disk=spec.tiers.disk, native=True,
                                        shared_layout="model", peers=["other-peers.ns.svc:7600"])
    return {a.split("=", 1)[0] for a in container["args"]}


def test_the_documented_sidecar_flags_are_the_rendered_ones():
    assert documented() == rendered(), (sorted(documented() - rendered()), sorted(rendered() - documented()))


def test_the_documented_sidecar_flags_are_the_sidecars():
    usage = subprocess.run([sidecar_binary(), "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    flags = set(re.findall(r"^  (--[a-z-]+)$", usage, re.M))
    assert "--shared-dir" in flags and documented() <= flags, sorted(documented() - flags)
