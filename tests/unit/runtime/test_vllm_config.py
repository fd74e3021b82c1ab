"""The vLLM connector's configuration (no vLLM needed); its kv_transfer_params contract is
tpusync.kv.handoff's (test_kv_handoff.py)."""

from __future__ import annotations

import pytest

from tpusync import errors
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.kv.handoff import join_address, split_address


@pytest.mark.parametrize("extra, env, want", [
    ({"control_socket": "/run/s.sock"}, {}, {"store": "sidecar", "control_socket": "/run/s.sock", "layerwise": True}),
    ({}, {"TPUSYNC_CONTROL_SOCKET": "/e.sock"}, {"store": "sidecar", "control_socket": "/e.sock"}),
    ({}, {}, {"store": "local", "control_socket": None}),
    ({"layerwise": "false", "peers": "a:1, b:2"}, {"TPUSYNC_CONTROL_SOCKET": "/e.sock"},
     {"layerwise": False, "peers": ("a:1", "b:2")}),
    ({"control_socket": "/s"}, {"POD_IP": "10.0.0.7", "TPUSYNC_DATA_PORT": "7600"}, {"data_address": "10.0.0.7:7600"}),
    ({"control_socket": "/s", "data_address": "10.0.0.1:1"}, {"TPUSYNC_DATA_ADDRESS": "10.0.0.2:2"},
     {"data_address": "10.0.0.1:1"}),
    ({"control_socket": "/s"}, {"POD_IP": "fd00::7", "TPUSYNC_DATA_PORT": "7600"}, {"data_address": "fd00::7:7600"}),
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
    {"control_socket": "/s", "data_address": "prefill-0.pool.svc:7600"},  # decode engines would refuse a name
    {"control_socket": "/s", "data_address": "10.0.0.1"},
])
def test_bad_config_is_refused_at_startup(extra):
    with pytest.raises(errors.InvalidArgumentError):
        ConnectorConfig.from_extra(extra, {})


@pytest.mark.parametrize("host, port, address", [("10.0.0.1", 7600, "10.0.0.1:7600"),
                                                  ("fd00::1", 7600, "[fd00::1]:7600")])
def test_addresses(host, port, address):
    assert join_address(host, port) == address
    assert split_address(address) == (host, port)
    assert split_address("tpusync://" + address) == (host, port)
