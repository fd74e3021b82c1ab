"""The transfer plan is a pure function: shapes of chains and trees, rerouting, predictions."""

from __future__ import annotations

import pytest

from tpusync.weights import plan as p

HOSTS = [f"h{i}" for i in range(1, 8)]


def test_chain_is_a_line_from_the_source_in_order():
    plan = p.build_plan(["t"], HOSTS[:4], chunks=5, topology=p.CHAIN)
    assert plan.parents["t"] == {"h1": "t", "h2": "h1", "h3": "h2", "h4": "h3"}
    assert plan.path("t", "h4") == ["t", "h1", "h2", "h3", "h4"]
    assert plan.depth("t") == 4 and plan.max_fanout() == 1
    assert plan.chunks == {"t": 5}


@pytest.mark.parametrize("k", [2, 3])
def test_tree_has_fanout_k_and_log_depth(k):
    plan = p.build_plan(["t"], HOSTS, chunks=1, topology=p.TREE, fanout=k)
    assert plan.max_fanout() == k
    assert set(plan.parents["t"]) == set(HOSTS)
    assert plan.children("t", "t") == HOSTS[:k]
    assert plan.depth("t") == p.tree_depth(len(HOSTS), k)
    for h in HOSTS:  # every host reaches the source, no cycles
        assert plan.path("t", h)[0] == "t"


def test_one_copy_per_host_sources_and_duplicates_dropped():
    plan = p.build_plan(["t"], ["h1", "t", "h1", "h2"], chunks=2)
    assert plan.destinations == ("h1", "h2")


def test_several_sources_enter_at_different_hosts():
    plan = p.build_plan(["a", "b"], HOSTS[:4], chunks={"a": 3, "b": 2})
    first = {s: next(h for h, par in plan.parents[s].items() if par == s) for s in ("a", "b")}
    assert first["a"] != first["b"]
    assert set(plan.parents["a"]) == set(plan.parents["b"]) == set(HOSTS[:4])


def test_reroute_around_a_dead_relay_goes_to_the_nearest_live_ancestor():
    plan = p.build_plan(["t"], HOSTS[:4], chunks=3)
    after = p.reroute(plan, ["h2"])
    assert after.parents["t"] == {"h1": "t", "h3": "h1", "h4": "h3"}
    after2 = p.reroute(after, ["h1", "h3"])
    assert after2.parents["t"] == {"h4": "t"}
    assert after2.destinations == ("h4",) and after2.dead == {"h1", "h2", "h3"}


def test_reroute_in_a_tree_keeps_the_subtree():
    plan = p.build_plan(["t"], HOSTS, chunks=1, topology=p.TREE, fanout=2)
    after = p.reroute(plan, ["h1"])  # h1's children h3, h4 move up to t
    assert after.parents["t"]["h3"] == "t" and after.parents["t"]["h4"] == "t"
    assert after.parents["t"]["h7"] == plan.parents["t"]["h7"]


def test_dead_source_cannot_be_routed_around():
    plan = p.build_plan(["t"], HOSTS[:2], chunks=1)
    with pytest.raises(ValueError, match="source host t is dead"):
        p.reroute(plan, ["t"])


@pytest.mark.parametrize("kw", [{"topology": "ring"}, {"topology": p.TREE, "fanout": 0}, {"chunks": 0}])
def test_bad_arguments(kw):
    args = {"chunks": 1} | kw
    with pytest.raises(ValueError):
        p.build_plan(["t"], HOSTS[:2], **args)
    with pytest.raises(ValueError):
        p.build_plan([], HOSTS[:2], chunks=1)


def test_predict_chain_pipelines_and_naive_scales_with_hosts():
    gb = 10**9
    chain = p.predict(470 * gb, 16, link_bytes_per_s=50 * gb, chunk_bytes=64 << 20)
    assert chain.depth == 16 and chain.link_copies == 1
    # 470 GB at 50 GB/s is 9.4 s, plus 15 chunk-hops of pipeline fill.
    assert chain.seconds == pytest.approx(9.4 + 15 * (64 << 20) / (50 * gb))
    assert chain.naive_seconds == pytest.approx(16 * 9.4)
    tree = p.predict(470 * gb, 16, link_bytes_per_s=50 * gb, chunk_bytes=64 << 20, topology=p.TREE, fanout=2)
    assert tree.depth == 4 and tree.seconds == pytest.approx(2 * (9.4 + 3 * (64 << 20) / (50 * gb)))
    assert p.predict(1, 0, link_bytes_per_s=1, chunk_bytes=1).seconds == 0


def test_chunk_ranges_cover_every_block_once():
    ranges = p.chunk_ranges(10, 4)
    assert [list(r) for r in ranges] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError):
        p.chunk_ranges(3, 0)


def test_cli_plan_prints_the_prediction(capsys):
    from tpusync.weights.__main__ import main

    assert main(["plan", "--params-b", "235", "--hosts", "16", "--link-gb-per-s", "50"]) == 0
    out = capsys.readouterr().out
    assert "470.0 GB to 16 hosts" in out and "plan:  9.42 s" in out and "naive: 150.40 s" in out


def test_chunk_order_takes_the_sources_in_turns():
    assert p.chunk_order({"a": 3, "b": 1}) == [("a", 0), ("b", 0), ("a", 1), ("a", 2)]


def test_live_parent_skips_dead_relays_up_to_the_source():
    plan = p.build_plan(["t"], ["h1", "h2", "h3"], chunks=1)
    assert p.live_parent(plan, "t", "h3", set()) == "h2"
    assert p.live_parent(plan, "t", "h3", {"h2"}) == "h1"
    assert p.live_parent(plan, "t", "h3", {"h1", "h2"}) == "t"
