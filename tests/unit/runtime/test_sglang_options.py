"""The SGLang backend's extra config (`tpusync.engines.sglang.options`, no SGLang needed): every option is
checked by type and range when the backend is built, and a malformed one is refused naming it."""

from __future__ import annotations

import pytest

from tpusync import errors
from tpusync.engines.sglang.options import LocalStore, StorageOptions

FACTORY = {"backend_name": "tpusync", "module_path": "tpusync.sglang.storage", "class_name": "TPUSyncHiCacheStorage",
           "interface_v1": 1}
LOCAL = {"dram_bytes": 1 << 20, "block_bytes": 4096}

BAD = [
    ("peers", "10.0.0.2:7600"),          # a string: once read as the peers "1", "0", ".", ...
    ("peers", ["10.0.0.2"]),             # no port
    ("peers", ["10.0.0.2:0"]),
    ("peers", ["10.0.0.2:65536"]),
    ("peers", [7600]),
    ("peers", ["-oProxyCommand=x:1"]),
    ("peers", ["a:1"] * 1025),
    ("peers", {"a": "10.0.0.2:7600"}),
    ("reconnect_interval_s", "x"),
    ("reconnect_interval_s", -1),
    ("reconnect_interval_s", True),
    ("reconnect_interval_s", float("nan")),
    ("timeout_s", 0),
    ("timeout_s", "30"),
    ("model", 5),
    ("model", ""),
    ("control_socket", ["/run/s.sock"]),
    ("store_url", 7600),
    ("secret_file", {}),
    ("local", "yes"),
    ("local", {"dram_bytes": "1G", "block_bytes": 4096}),
    ("local", {"dram_bytes": 1 << 20}),                       # block_bytes missing
    ("local", {**LOCAL, "disk_bytes": -1}),
    ("local", {**LOCAL, "pool_path": 5}),
    ("local", {**LOCAL, "dram_byte": 1}),                     # a typo in its own object
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r:.30}" for n, v in BAD])
def test_a_malformed_option_is_refused_naming_it(name, value):
    with pytest.raises(errors.InvalidArgumentError, match=rf"\b{name}\b"):
        StorageOptions.parse({**FACTORY, name: value})


def test_two_stores_at_once_are_refused():
    with pytest.raises(errors.InvalidArgumentError, match="local and store_url"):
        StorageOptions.parse({"local": LOCAL, "store_url": "tpusync://10.0.0.2:7600"})


def test_well_formed_options():
    opts = StorageOptions.parse({**FACTORY, "peers": ["10.0.0.2:7600", "prefill-0.pool.svc:7600", "[fd00::2]:7600",
                                                      "tpusync://10.0.0.3:7600"],
                                 "reconnect_interval_s": 0, "model": "org/m", "local": {**LOCAL, "disk_bytes": 0},
                                 "kv_events": {"anything": "checked by EventsConfig"}})
    # Names are allowed in peers: the operator (or an admin) chose them, no client can.
    assert opts.peers[1] == "prefill-0.pool.svc:7600" and opts.reconnect_interval_s == 0.0
    assert opts.local == LocalStore(1 << 20, 4096) and opts.model == "org/m" and opts.ignored == ()
    assert StorageOptions.parse({}) == StorageOptions()


def test_keys_no_one_reads_are_reported_not_refused():
    """SGLang takes its own keys from the same object; a typo of ours is logged by the backend."""
    assert StorageOptions.parse({**FACTORY, "peer": ["10.0.0.2:7600"], "prefetch_threshold": 256}).ignored == (
        "peer", "prefetch_threshold")
