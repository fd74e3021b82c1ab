"""The vLLM connector's configuration and kv_transfer_params contract (no vLLM needed)."""

from __future__ import annotations

import pytest

from tpusync import errors
from tpusync.connector.config import (
    ConnectorConfig,
    join_address,
    kv_layout,
    producer_params,
    remote_peer,
    split_address,
)


@pytest.mark.parametrize("extra, env, want", [
    ({"control_socket": "/run/s.sock"}, {}, {"store": "sidecar", "control_socket": "/run/s.sock", "layerwise": True}),
    ({}, {"TPUSYNC_CONTROL_SOCKET": "/e.sock"}, {"store": "sidecar", "control_socket": "/e.sock"}),
    ({}, {}, {"store": "local", "control_socket": None}),
    ({"layerwise": "false", "peers": "a:1, b:2"}, {"TPUSYNC_CONTROL_SOCKET": "/e.sock"},
     {"layerwise": False, "peers": ("a:1", "b:2")}),
    ({"control_socket": "/s"}, {"POD_IP": "10.0.0.7", "TPUSYNC_DATA_PORT": "7600"}, {"data_address": "10.0.0.7:7600"}),
    ({"control_socket": "/s", "data_address": "h:1"}, {"TPUSYNC_DATA_ADDRESS": "e:2"}, {"data_address": "h:1"}),
    ({"control_socket": "/s"}, {"POD_IP": "10.0.0.7"}, {"data_address": None}),  # no port: nothing to advertise
])
def test_config_from_extra_and_environment(extra, env, want):
    cfg = ConnectorConfig.from_extra(extra, env)
    assert {k: getattr(cfg, k) for k in want} == want


@pytest.mark.parametrize("extra", [
    {"control_sockets": "/typo"},
    {"store": "sidecar"},              # no control socket anywhere
    {"store": "s3"},
    {"timeout_s": 0},
    {"kv_events_endpoint": "http://router:5557"},
    {"kv_events_endpoint": 5557},
])
def test_bad_config_is_refused_at_startup(extra):
    with pytest.raises(errors.InvalidArgumentError):
        ConnectorConfig.from_extra(extra, {})


def test_producer_params_are_what_the_consumer_reads():
    params = producer_params(data_address="10.1.2.3:7600", engine_id="e", request_id="r", num_tokens=320,
                             block_size=32, last_key=0xABC)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("10.1.2.3", 7600)
    assert params["remote_block_ids"] == [] and params["tpusync_last_key"] == f"{0xABC:032x}"
    remote = remote_peer(params)
    assert (remote.peer, remote.num_tokens, remote.block_size, remote.last_key) == ("10.1.2.3:7600", 320, 32, 0xABC)
    assert remote.layout is None
    layout = kv_layout(model="m", layers=2, kv_heads=2, head_size=64, dtype="float32", shards=2)
    with_layout = producer_params(data_address=None, engine_id="e", request_id="r", num_tokens=64, block_size=32,
                                  last_key=None, layout=layout)
    assert remote_peer(with_layout).layout == layout
    assert remote_peer({**with_layout, "tpusync_kv_layout": "2 shards"}).layout is None  # not a layout


def test_a_multi_host_prefill_names_each_host_and_its_shards():
    layout = kv_layout(model="m", layers=2, kv_heads=4, head_size=64, dtype="bfloat16", shards=4)
    params = producer_params(data_address="10.0.0.1:7600", engine_id="e", request_id="r", num_tokens=64,
                             block_size=16, last_key=None, layout=layout,
                             hosts=[("10.0.0.1:7600", [0, 1]), ("10.0.0.2:7600", [2, 3])])
    assert params["remote_addresses"] == ["10.0.0.1:7600", "10.0.0.2:7600"]
    assert params["tpusync_kv_layout"] == {**layout, "hosts": [[0, 1], [2, 3]]}
    remote = remote_peer(params)
    assert remote.addresses == ["10.0.0.1:7600", "10.0.0.2:7600"] and remote.hosts == [[0, 1], [2, 3]]
    # Each decode host pulls what its shards need from the hosts holding it.
    assert remote.pulls([0, 1], 0) == [("10.0.0.1:7600", [0, 1])]
    assert remote.pulls([1, 2], 1) == [("10.0.0.1:7600", [1]), ("10.0.0.2:7600", [2])]
    # A malformed address is never dialled; a shard map that is not one (a shard past the split)
    # is dropped: every needed shard is then asked of each valid host, this host's counterpart first.
    hostile = remote_peer({**params, "remote_addresses": ["10.0.0.1:7600", "-oProxyCommand=x"],
                           "tpusync_kv_layout": {**layout, "hosts": [[0, 1], [2, 9]]}})
    assert hostile.addresses == ["10.0.0.1:7600", None] and hostile.hosts is None
    assert hostile.pulls([2, 3], 1) == [("10.0.0.1:7600", [2, 3])]
    single = remote_peer(producer_params(data_address="10.0.0.1:7600", engine_id="e", request_id="r",
                                         num_tokens=64, block_size=16, last_key=None, layout=layout))
    assert single.addresses is None and single.pulls([0, 1], 1) == [("10.0.0.1:7600", [0, 1])]


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": False}])
def test_requests_without_a_remote_prefill(params):
    assert remote_peer(params) is None


def test_a_remote_prefill_without_an_address_looks_locally():
    remote = remote_peer({"do_remote_prefill": True, "remote_num_tokens": "64"})
    assert remote.peer is None and remote.num_tokens == 64


@pytest.mark.parametrize("host, port, address", [("10.0.0.1", 7600, "10.0.0.1:7600"),
                                                  ("fd00::1", 7600, "[fd00::1]:7600")])
def test_addresses(host, port, address):
    assert join_address(host, port) == address
    assert split_address(address) == (host, port)
    assert split_address("tpusync://" + address) == (host, port)
