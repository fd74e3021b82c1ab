"""Every argument of the weight API is checked where it enters, before anything is stored or
waited for: versions by one rule (keys.check_version: an integer >= 1) at every entry point,
receive_version's hosts before the manifest wait."""

from __future__ import annotations

import numpy as np
import pytest

import tpusync
from tpusync import errors
from tpusync.weights import VersionedWeights, WeightDistributor, receive_version
from tpusync.weights.head import read_head
from tpusync.weights.inplace import await_version, pinned_version
from tpusync.weights.keys import check_version, commit_key, weight_key
from tpusync.weights.receive import check_hosts

BLOCK = 64 << 10
BAD_VERSIONS = [0, -1, True, 1.0, "1", np.float32(2)]


@pytest.fixture
def store(local_store):
    return local_store(16 << 20, BLOCK)


def params(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)}


def refused(call, what: str = "version") -> str:
    with pytest.raises(errors.InvalidArgumentError) as e:
        call()
    assert str(e.value).startswith(f"{what} must be an integer >= 1, not "), e.value
    return str(e.value)


@pytest.mark.parametrize("bad", BAD_VERSIONS)
def test_the_rule_refuses_what_is_not_an_integer_from_1(bad):
    message = refused(lambda: check_version(bad))
    assert "versions count published updates from 1" in message
    refused(lambda: weight_key("m", bad, "data"))   # no key of such a version is ever derived
    refused(lambda: commit_key("m", bad))


def test_the_rule_keeps_integers_from_1():
    assert check_version(1) == 1 and check_version(np.int64(7)) == 7 and type(check_version(np.int64(7))) is int
    refused(lambda: check_version(0, "uuid"), "uuid")


@pytest.mark.parametrize("bad", [0, -1])
def test_every_entry_point_refuses_a_version_below_1(store, bad):
    """Version 0 was published and committed (head 0, which await_version reads as none) and
    wait_for_version(0) returned whatever was there; each is refused now, nothing stored."""
    trainer = VersionedWeights(store, "m")
    refused(lambda: trainer.publish(params(0), bad))
    refused(lambda: trainer.publish_async(params(0), bad))     # at the call, not in the future
    assert store.stats()["blocks"] == 0 and read_head(store.pool_path, "m") is None

    trainer.publish(params(1), 1)
    sampler = VersionedWeights(store, "m")
    sampler.bind_weights(params(0))
    refused(lambda: sampler.wait_for_version(bad, timeout=0))
    refused(lambda: sampler.wait_for_version_async(bad, timeout=0))
    refused(lambda: sampler.load(bad))
    refused(lambda: trainer.push_weights(["127.0.0.1:1"], bad))
    refused(lambda: await_version(store, "m", bad, 0))
    with pytest.raises(errors.InvalidArgumentError), pinned_version(store, "m", bad):
        pass
    refused(lambda: WeightDistributor().start_transfer(["trainer"], None, "m", bad))
    refused(lambda: receive_version(store, "m", bad, host="127.0.0.1:2", sources=["127.0.0.1:1"],
                                    destinations=["127.0.0.1:2"], timeout=300))
    assert sampler.version is None and sampler.wait_for_version(1, timeout=5) == 1   # the good path still works


@pytest.mark.parametrize("host, sources, destinations, message", [
    ("a:1", ["s:1", "s:1"], ["a:1"], "sources s:1 is given twice"),
    ("a:1", ["s:1", "tpusync://s:1"], ["a:1"], "sources s:1 is given twice"),
    ("a:1", ["s:1"], ["a:1", "b:1", "a:1"], "destinations a:1 is given twice"),
    ("c:1", ["s:1"], ["a:1", "b:1"], "host c:1 is not one of the destinations ['a:1', 'b:1']"),
    ("s:1", ["s:1"], ["s:1", "a:1"], "host s:1 is one of the sources"),
    ("a", ["s:1"], ["a"], "destinations 'a' is not host:port"),
    ("a:1", ["s:0"], ["a:1"], "sources 's:0' is not host:port"),
    ("a:1", ["s:65536"], ["a:1"], "sources 's:65536' is not host:port"),
    ("a:1", ["fd00::1:9400"], ["a:1"], "sources 'fd00::1:9400' is not host:port"),
    ("a:1", ["s:1"], ["a:1", "b c:1"], "destinations 'b c:1' is not host:port"),
    ("a:1", [], ["a:1"], "sources: at least one address is needed"),
])
def test_receive_checks_its_hosts_before_it_waits(store, host, sources, destinations, message):
    """The old receiver waited the whole timeout for the manifest with any of these (a source
    given twice was read as a two-part trainer) and failed, if at all, only after it."""
    with pytest.raises(errors.InvalidArgumentError) as e:
        check_hosts(host, sources, destinations)
    assert message in str(e.value)
    with pytest.raises(errors.InvalidArgumentError) as e:
        receive_version(store, "m", 1, host=host, sources=sources, destinations=destinations, timeout=300)
    assert message in str(e.value)


def test_receive_keeps_good_hosts_in_order():
    got = check_hosts("tpusync://[fd00::2]:9400", ["10.0.0.1:9400"],
                      ["pod-b.ns:9400", "[fd00::2]:9400", "tpusync://10.0.0.3:9400"])
    assert got == ("[fd00::2]:9400", ["10.0.0.1:9400"], ["pod-b.ns:9400", "[fd00::2]:9400", "10.0.0.3:9400"])


def test_receive_refuses_a_host_its_sidecar_cannot_reach(shm_path):
    """Nothing listens at the host's address: refused at once with the reason, before the wait
    for the manifest (the source, this store's own pool, is never asked)."""
    store = tpusync.KVStore.local(dram_bytes=16 << 20, block_bytes=BLOCK, pool_path=shm_path, secret=b"s" * 32)
    try:
        with pytest.raises(errors.InvalidArgumentError) as e:
            receive_version(store, "m", 1, host="127.0.0.1:1", sources=["127.0.0.1:2"],
                            destinations=["127.0.0.1:1"], timeout=300)
        assert str(e.value) == ("127.0.0.1:1 (this host's address) cannot be reached from this host's sidecar: "
                                "connect 127.0.0.1:1: Connection refused")
    finally:
        store.close()
