"""The prefill-to-decode contract (`tpusync.kv.handoff`), which every engine speaks: its one parser
checks every field a client can send in kv_transfer_params by type and range, a malformed one is
refused naming the field (MalformedParams), and nothing else is ever raised, whatever the value;
its one layout check, its record of what the prefill stored, its pull plan and its pull loop."""

from __future__ import annotations

import ast
import contextlib
import itertools
import logging
from pathlib import Path

import pytest

from tpusync import errors
from tpusync.kv import handoff
from tpusync.kv.handoff import (
    MalformedParams,
    RemotePrefill,
    kv_layout,
    layout_refusal,
    producer_params,
    pull,
    pull_plan,
    stored_blocks,
    vllm_prefill,
    wants_decode,
)

LAYOUT = kv_layout(model="org/model", layers=2, kv_heads=4, head_size=64, dtype="bfloat16", shards=2,
                   format="vllm-torch")
GOOD = producer_params(data_address="10.0.0.1:7600", engine_id="e", request_id="r", num_tokens=320, block_size=32,
                       last_key=0xABC, layout=LAYOUT, hosts=[("10.0.0.1:7600", [0]), ("10.0.0.2:7600", [1])])

# Values that are no address a sidecar may be asked to pull from: names (the sidecar would
# resolve them for the client), ports out of range, injections, other types.
BAD_ADDRESSES = ["prefill-0.pool.svc:7600", "localhost:7600", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536",
                 "10.0.0.1:x", "10.0.0.1:76 00", "10.0.0.1:7600\r\nX: 1", "-oProxyCommand=x:1", "[fd00::1:7600",
                 "[::1]x:7600", "fe80::1%eth0:7600", "010.0.0.1:7600", "a" * 300 + ":1", 7600, ["10.0.0.1:7600"],
                 {"host": "10.0.0.1"}, True]

# (field, malformed values, the field MalformedParams names); each on top of GOOD.
VLLM_TABLE = [
    ("do_remote_prefill", ["true", 1, "yes", [True], {}], "do_remote_prefill"),
    ("remote_host", ["prefill-0.svc", "10.0.0.1:7600", "", "localhost", "1.2.3", 3232235777, ["10.0.0.1"],
                     "fe80::1%eth0", "10.0.0.1\n"], "remote_host"),
    ("remote_port", ["x", "7600", 0, 65536, -1, 7600.0, True, [7600], 10**30], "remote_port"),
    ("remote_num_tokens", ["64", -1, 1 << 40, 1.0, False, [1]], "remote_num_tokens"),
    ("tpusync_block_size", ["32", 0, -32, 1 << 20, 32.0, True, {}], "tpusync_block_size"),
    ("tpusync_last_key", ["zz", "", "0xabc", "abc", "0_" * 16, "g" * 32, "a" * 33, 0xABC, ["a" * 32]],
     "tpusync_last_key"),
    ("tpusync_kv_layout", ["2 shards", [1, 2], 2, True], "tpusync_kv_layout"),
    ("remote_addresses", ["10.0.0.1:7600", [], ["10.0.0.1:7600"] * 1025, {"0": "10.0.0.1:7600"},
                          ["10.0.0.1:7600"]], "remote_addresses"),  # the last: one address, two hosts
]
LAYOUT_TABLE = [
    ("shards", [0, -1, 4097, "2", 2.0, True, None, [2]], "shards"),
    ("layers", [0, "2", 2.5, False, 1 << 30], "layers"),
    ("kv_heads", [0, "4", [4]], "kv_heads"),
    ("head_size", [-64, "64"], "head_size"),
    ("model", [5, ["m"], "m" * 5000, {}], "model"),
    ("dtype", [16, ["bf16"]], "dtype"),
    ("format", [1, ["k-v"], "f" * 1025], "format"),
    ("hosts", ["0,1", [], [[0], 1], [[0], [2]], [[0], [-1]], [[0], [True]], [[0], ["1"]], [[0, 1, 1], [1]],
               [[0]] * 1025], "hosts"),
]


def _cases(table):
    for name, values, field in table:
        for value in values:
            yield pytest.param(name, value, field, id=f"{name}={value!r:.40}")


def _refused(parse, params, field):
    with pytest.raises(MalformedParams) as e:
        parse(params)
    named = e.value.field
    assert named == field or named.startswith((field + "[", field + ".")), (named, field)
    assert (f"kv_transfer_params.{named} is " if named else "kv_transfer_params is ") in str(e.value)
    return e.value


@pytest.mark.parametrize(("name", "value", "field"), list(_cases(VLLM_TABLE)))
def test_a_malformed_vllm_field_is_refused_naming_it(name, value, field):
    _refused(vllm_prefill, {**GOOD, name: value}, field)


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_a_remote_address_that_is_no_literal_ip_and_port_is_refused(address):
    _refused(vllm_prefill, {**GOOD, "remote_addresses": ["10.0.0.1:7600", address]}, "remote_addresses[1]")
    _refused(vllm_prefill, {**GOOD, "remote_addresses": [address, "10.0.0.2:7600"]}, "remote_addresses[0]")


@pytest.mark.parametrize(("name", "value", "field"), list(_cases(LAYOUT_TABLE)))
def test_a_malformed_layout_field_is_refused_naming_it(name, value, field):
    layout = {**GOOD["tpusync_kv_layout"], name: value}
    if value is None:
        del layout[name]  # absent: shards is required
    _refused(vllm_prefill, {**GOOD, "tpusync_kv_layout": layout}, f"tpusync_kv_layout.{field}")


@pytest.mark.parametrize(("params", "field"), [
    ({"remote_host": "10.0.0.1", "remote_port": None}, "remote_port"),   # one without the other
    ({"remote_host": None, "remote_port": 7600}, "remote_host"),
    ({"remote_addresses": ["10.0.0.1:7600", None, "10.0.0.3:7600"]}, "remote_addresses"),  # 3 addresses, 2 hosts
])
def test_fields_that_come_together(params, field):
    _refused(vllm_prefill, {**GOOD, **params}, field)


@pytest.mark.parametrize("params", [[GOOD], "do_remote_prefill", 5, True])
def test_kv_transfer_params_that_are_no_object_are_refused(params):
    for parse in (vllm_prefill, wants_decode):
        assert _refused(parse, params, "").field == ""


@pytest.mark.parametrize("value", ["true", 1, [True], {"x": 1}])
def test_do_remote_decode_must_be_a_boolean(value):
    _refused(wants_decode, {"do_remote_decode": value}, "do_remote_decode")


def test_well_formed_params_round_trip_from_the_producer():
    remote = vllm_prefill(GOOD)
    assert remote is not None
    assert (remote.peer, remote.num_tokens, remote.block_size, remote.last_key) == ("10.0.0.1:7600", 320, 32, 0xABC)
    assert remote.layout == LAYOUT and remote.shards == 2 and remote.hosts == [[0], [1]]
    assert remote.addresses == ["10.0.0.1:7600", "10.0.0.2:7600"]
    assert remote.pulls([0, 1], 0) == [("10.0.0.1:7600", [0]), ("10.0.0.2:7600", [1])]
    assert wants_decode({"do_remote_decode": True}) and not wants_decode({}) and not wants_decode(None)


def test_a_multi_host_prefill_names_each_host_and_its_shards():
    layout = kv_layout(model="m", layers=2, kv_heads=4, head_size=64, dtype="bfloat16", shards=4, format="f")
    params = producer_params(data_address="10.0.0.1:7600", engine_id="e", request_id="r", num_tokens=64,
                             block_size=16, last_key=None, layout=layout,
                             hosts=[("10.0.0.1:7600", [0, 1]), ("10.0.0.2:7600", [2, 3])])
    assert params["remote_addresses"] == ["10.0.0.1:7600", "10.0.0.2:7600"]
    assert params["tpusync_kv_layout"] == {**layout, "hosts": [[0, 1], [2, 3]]}
    remote = vllm_prefill(params)
    assert remote is not None and remote.hosts == [[0, 1], [2, 3]]
    # Each decode host pulls what its shards need from the hosts holding it.
    assert remote.pulls([0, 1], 0) == [("10.0.0.1:7600", [0, 1])]
    assert remote.pulls([1, 2], 1) == [("10.0.0.1:7600", [1]), ("10.0.0.2:7600", [2])]
    single = vllm_prefill(producer_params(data_address="10.0.0.1:7600", engine_id="e", request_id="r",
                                          num_tokens=64, block_size=16, last_key=None, layout=layout))
    assert single is not None and single.addresses is None and single.pulls([0, 1], 1) == [("10.0.0.1:7600", [0, 1])]


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": False}])
def test_requests_without_a_remote_prefill(params):
    assert vllm_prefill(params) is None


def test_a_remote_prefill_without_an_address_looks_locally():
    remote = vllm_prefill({"do_remote_prefill": True, "remote_num_tokens": 64})
    assert remote is not None and remote.peer is None and remote.num_tokens == 64 and remote.pulls([0], 0) == []


@pytest.mark.parametrize(("address", "normalised"), [
    ("127.0.0.1:9400", "127.0.0.1:9400"), ("tpusync://10.0.0.5:9400", "10.0.0.5:9400"),
    ("[fd00::5]:9400", "[fd00::5]:9400"), ("fd00::5:9400", "[fd00::5]:9400"),  # $(POD_IP):port on an IPv6 pod
    ("[FD00:0::5]:9400", "[fd00::5]:9400"),
])
def test_literal_addresses_are_accepted_and_normalised(address, normalised):
    host, port = normalised.rsplit(":", 1)
    v = vllm_prefill({"do_remote_prefill": True, "remote_host": host.strip("[]"), "remote_port": int(port)})
    assert v is not None and v.peer == normalised


def test_what_is_not_read_is_not_refused():
    """Keys of other connectors and of vLLM itself pass, and a request that asks for no remote
    prefill is not read further."""
    foreign = {**GOOD, "remote_engine_id": 5, "remote_block_ids": "x", "remote_prefill_cached_tokens": "x",
               "tp_size": [], "unknown": object()}
    assert vllm_prefill(foreign) == vllm_prefill(GOOD)
    assert vllm_prefill({"do_remote_decode": True, "remote_port": "x"}) is None
    assert vllm_prefill({"do_remote_prefill": False, "tpusync_last_key": "zz"}) is None
    assert vllm_prefill(None) is None
    # null and "" are absent: a multi-host prefill's host without a data port
    remote = vllm_prefill({**GOOD, "remote_addresses": ["10.0.0.1:7600", None]})
    assert remote is not None and remote.addresses == ["10.0.0.1:7600", None]
    assert remote.pulls([0, 1], 1) == [("10.0.0.1:7600", [0])]
    layout = {**LAYOUT, "future_field": [1, 2]}  # a layout field this release does not know: ignored
    assert vllm_prefill({**GOOD, "tpusync_kv_layout": {**layout, "hosts": [[0], [1]]}}) == vllm_prefill(GOOD)


_ODD = [None, True, False, 0, -1, 1, 65535, 65536, 2**64, 1.5, float("nan"), "", "x", "zz", "a" * 32, "10.0.0.1:1",
        "10.0.0.1", [], [None], [[0]], ["10.0.0.1:1"], {}, {"shards": 1}, {"shards": 1, "hosts": [[0]]}]


@pytest.mark.parametrize("name", sorted(set(GOOD) | {"tpusync_kv_layout"}))
def test_no_value_of_any_field_raises_anything_but_a_refusal(name):
    for value, base in itertools.product(_ODD, (GOOD, {"do_remote_prefill": True})):
        for parse in (vllm_prefill, wants_decode):
            with contextlib.suppress(MalformedParams):  # anything else fails the test
                parse({**base, name: value})


def test_a_refusal_is_one_warning_naming_the_request_and_field(caplog):
    log = logging.getLogger("tpusync.test")
    with pytest.raises(MalformedParams) as e:
        vllm_prefill({**GOOD, "remote_port": "x\nFAKE LOG LINE"})
    with caplog.at_level(logging.WARNING, "tpusync.test"):
        handoff.log_refusal(log, "cmpl-1", e.value)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    line = record.getMessage()
    assert "cmpl-1" in line and "kv_transfer_params.remote_port" in line and "\n" not in line
    assert isinstance(e.value, errors.InvalidArgumentError)


def test_producer_refuses_a_data_address_decode_engines_would_refuse():
    with pytest.raises(errors.InvalidArgumentError):
        producer_params(data_address="prefill-0.svc:7600", engine_id="e", request_id="r", num_tokens=0, block_size=16,
                        last_key=None)


OURS = kv_layout(model="org/model", layers=2, kv_heads=4, head_size=64, dtype="bfloat16", shards=2,
                 format="vllm-torch")


@pytest.mark.parametrize(("theirs", "reshards", "refused"), [
    (OURS, False, None),
    ({**OURS, "hosts": [[0], [1]]}, False, None),                    # hosts are where, not what
    ({**OURS, "dtype": "torch.bfloat16"}, False, None),               # torch's name of the same dtype
    ({**OURS, "model": "org/other"}, True, "model 'org/other', here 'org/model'"),
    ({**OURS, "head_size": 128}, True, "head_size 128, here 64"),
    ({k: v for k, v in OURS.items() if k != "layers"}, True, "layers None, here 2"),  # unsaid is not equal
    ({**OURS, "dtype": "float32"}, True, "dtype 'float32', here 'bfloat16'"),
    ({**OURS, "format": "k-v"}, True, "format 'k-v', here 'vllm-torch'"),     # bytes arranged otherwise
    ({k: v for k, v in OURS.items() if k != "format"}, True, "format None, here 'vllm-torch'"),
    ({**OURS, "shards": 4}, False, "blocks in 4 parts, this engine loads only its own 2"),
    ({**OURS, "shards": 4}, True, None),                                # regrouped on load
    ({**OURS, "shards": 3}, True, "blocks in 3 parts do not split 4 kv heads"),
    ({**OURS, "shards": 8}, True, "blocks in 8 parts do not split 4 kv heads"),
    (None, False, None),                                                # a prefill that does not say
])
def test_the_one_layout_check(theirs, reshards, refused):
    assert layout_refusal(theirs, OURS, reshards=reshards) == refused
    assert layout_refusal(theirs, None, reshards=reshards) is None


def test_what_the_prefill_stored():
    keys = [1, 2, 3, 4]
    said = RemotePrefill(peer="10.0.0.1:1", num_tokens=3 * 16, last_key=3)
    assert stored_blocks(said, keys, 16) == 3
    assert stored_blocks(RemotePrefill(peer=None), keys, 16) == 4                           # unsaid: all
    assert stored_blocks(RemotePrefill(peer=None, num_tokens=16 * 9), keys, 16) == 4
    assert stored_blocks(RemotePrefill(peer=None, num_tokens=3 * 16, last_key=9), keys, 16) is None  # keyed otherwise
    assert stored_blocks(RemotePrefill(peer=None, num_tokens=9 * 16, last_key=4), keys, 16) is None  # past our prompt
    assert stored_blocks(RemotePrefill(peer=None, num_tokens=0, last_key=9), keys, 16) == 0


def test_the_pull_plan_puts_the_prefill_first_then_other_peers_once():
    assert pull_plan(["10.0.0.1:1", "10.0.0.2:1"], [[0], [1]], [0, 1], 0, ["10.0.0.9:1", "10.0.0.1:1", "10.0.0.9:1"]) \
        == [("10.0.0.1:1", [0]), ("10.0.0.2:1", [1]), ("10.0.0.9:1", [0, 1])]
    assert pull_plan(["10.0.0.1:1", "10.0.0.2:1"], None, [0, 1], 1) == [("10.0.0.2:1", [0, 1]), ("10.0.0.1:1", [0, 1])]
    assert pull_plan([None], None, [0], 0, ["10.0.0.9:1"]) == [("10.0.0.9:1", [0])]


def test_the_pull_loop_asks_each_peer_for_what_is_missing_until_all_is_local():
    local = [1]
    asked: list[tuple[str, int, list[int]]] = []
    failures: list[tuple[str, int]] = []
    brings = {"a": 2, "dead": 0, "b": 5, "never": 9}

    def fetch(peer: str, first: int, parts: list[int]) -> None:
        asked.append((peer, first, parts))
        if peer == "dead":
            raise errors.UnavailableError("gone")
        local[0] = max(local[0], brings[peer])

    got = pull([("a", [0]), ("dead", [0, 1]), ("b", [1]), ("never", [0])], 5, lambda: local[0], fetch,
               lambda peer, missing, e: failures.append((peer, missing)))
    assert asked == [("a", 1, [0]), ("dead", 2, [0, 1]), ("b", 2, [1])]  # enough after b: never is not asked
    assert failures == [("dead", 3)]
    assert got.local == 5 and got.blocks == 4 and [(p.peer, p.blocks) for p in got.pulled] == [("a", 1), ("b", 3)]


def test_the_kv_package_imports_only_the_store_and_errors():
    """kv/ is the engine-neutral plane (issue 42): engines import it, never the reverse."""
    root = Path(handoff.__file__).parent
    imported = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module + ("." + node.names[0].name if node.module == "tpusync" else ""))
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
    ours = {m for m in imported if m.startswith("tpusync") and not m.startswith("tpusync.kv")}
    assert ours <= {"tpusync.errors", "tpusync.store"}, ours
