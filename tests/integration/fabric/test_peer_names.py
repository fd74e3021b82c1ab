"""A peer a request names is checked as written, before any name is resolved.

A sidecar's peer comes from requests (an engine's read_remote, a completion request's
kv_transfer_params through the connectors). Resolving a name the request chose gave every
client a DNS query per request, to a name of its choosing, before the membership check refused
it. Here the sidecar runs in a simulated host whose resolver is a DNS server of the test's own
(harness/dns_server.py, named by /etc/netns/<ns>/resolv.conf, which `ip netns exec` puts
in place of /etc/resolv.conf), so the test sees every name the sidecar looked up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import fabric as fab
from harness.keys import keys_for
from tests.integration.conftest import BLOCK, engine
from tpusync.errors import PreconditionError


@pytest.fixture
def resolver(make_fabric, tmp_path):
    """(fabric, log of the names host 0 looked up): host 0 resolves through a DNS server that
    knows member.test as host 1."""
    f = make_fabric(2)
    h0, h1 = f.hosts
    etc = Path("/etc/netns") / h0.ns
    etc.mkdir(parents=True)
    try:
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        log = tmp_path / "queries.log"
        log.touch()
        repo = str(Path(__file__).resolve().parents[3])
        server = h0.popen([sys.executable, "-m", "harness.dns_server", str(log), "127.0.0.1",
                           f"member.test={h1.ip}"], stdout=subprocess.PIPE, text=True,
                          cwd=repo, env={**os.environ, "PYTHONPATH": repo})
        assert server.stdout.readline().strip() == "ready"
        yield f, log
    finally:
        shutil.rmtree(etc, ignore_errors=True)


def test_a_name_from_a_request_is_never_looked_up(resolver, secret_file):
    f, log = resolver
    h0, h1 = f.hosts
    member = h1.sidecar(secret_file=secret_file, dram_bytes=16 * BLOCK, block_bytes=BLOCK)
    keys, by_name, by_address = keys_for(1, 4), keys_for(2, 4), keys_for(3, 4)
    with engine(member) as em:
        for k in (keys, by_name, by_address):
            em.put(k, [np.full(BLOCK, i, np.uint8) for i in range(4)])
    # Its only configured member is a name: member.test at the fabric's data port.
    car = h0.sidecar(secret_file=secret_file, dram_bytes=16 * BLOCK, block_bytes=BLOCK,
                     extra=[f"--peers=member.test:{fab.DATA_PORT}"])
    with engine(car) as e:
        for name in ("evil.test", "member.test.evil.test", "MEMBER.test.", "localhost"):
            with pytest.raises(PreconditionError, match="not a member of this pool"):
                e.read_remote(f"{name}:{fab.DATA_PORT}", keys)
        assert log.read_text() == "", "a name a request brought was resolved"
        # Positive controls: the configured name is resolved (that lookup is the pool's
        # configuration, not the request's), and so is it to check a numeric address.
        assert e.read_remote(f"member.test:{fab.DATA_PORT}", by_name) == [True] * 4
        assert e.read_remote(f"{h1.ip}:{fab.DATA_PORT}", by_address) == [True] * 4
        with pytest.raises(PreconditionError, match="not a member of this pool"):
            e.read_remote(f"{h0.ip}:{fab.DATA_PORT}", keys)
    assert set(log.read_text().split()) == {"member.test"}
