"""Fixtures for the chart tests: the pinned helm, found like the e2e suite finds it. A missing
helm fails the tests (never skips them): run `make controlplane`."""

from __future__ import annotations

import pytest

from harness.helm import Helm, HelmNotBuilt, helm_binary


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    try:
        binary = helm_binary()
    except HelmNotBuilt as e:
        pytest.fail(str(e), pytrace=False)
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))
