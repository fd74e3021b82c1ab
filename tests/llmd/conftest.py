"""The llm-d tier: reference engines with real sidecars publish KV events; llm-d's own indexer
(github.com/llm-d/llm-d-kv-cache, built by tests/llmd/build-indexer.sh into
~/.cache/tpusync/llmd-indexer/) subscribes to them and answers which pod holds how much of a
prompt, at which tier. `make llmd-test` builds it and runs this tier; without the binary
(TPUSYNC_LLMD_INDEXER unset, e.g. a plain `pytest`) the folder collects nothing. The engines,
hosts and indexers are harness/llmd_fleet.py's (bench/router_lag_bench.py runs them too).
"""

from __future__ import annotations

import os

import pytest

from harness.llmd_fleet import Cluster
from tests.conftest import not_collected

INDEXER = os.environ.get("TPUSYNC_LLMD_INDEXER", "")
if not INDEXER:
    collect_ignore_glob = not_collected("tests/llmd", "no llm-d indexer (TPUSYNC_LLMD_INDEXER); `make llmd-test` "
                                        "builds it and runs the tier")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("llmd"))
    try:
        yield c
    finally:
        c.stop()
