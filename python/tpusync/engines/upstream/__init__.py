"""Upstream TPU Sync's Python API on tpusync's engine, for the engines' own TPU Sync integrations.

tpu-inference 0.32.0 ships consumers of upstream's API (google/tpu-sync, formerly
google/tpu-raiden) that import it under upstream's module paths. `install()` makes those paths
resolve to the modules of this package, so the consumers run unmodified on a tpusync sidecar:

    tpu_raiden                              KVCacheManager, KVCacheStore, RaidenId
    tpu_raiden.api.common                   BlockStatus
    tpu_raiden.api.jax.kv_cache_manager     KVCacheManager    (tpusync.engines.upstream.kv_cache_manager)
    tpu_raiden.api.jax.kv_cache_store       KVCacheStore, RaidenId, RaidenBlockID, BlockStatus
    tpu_sync.api.jax.weight_synchronizer    WeightSynchronizer (tpusync.engines.upstream.weight_synchronizer)

Nothing is aliased unless asked: set TPUSYNC_UPSTREAM_API=1 in the engine's environment (vLLM
then installs the aliases in each of its processes through the `tpusync-upstream` general plugin,
tpusync.engines.upstream.vllm_plugin), or call
`install()` before the consumer imports. tpusync never ships a distribution under upstream's
names, and `install()` refuses when upstream's own package is importable, so a real upstream
install is never shadowed. Semantics and the differences that remain: docs/migrating.md.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

ENV = "TPUSYNC_UPSTREAM_API"
ROOTS = ("tpu_raiden", "tpu_sync")
# Upstream's module path -> the tpusync module that provides it (None: a package of the path).
MODULES: dict[str, str | None] = {
    "tpu_raiden": "tpusync.engines.upstream.raiden",
    "tpu_raiden.api": None,
    "tpu_raiden.api.common": "tpusync.engines.upstream.common",
    "tpu_raiden.api.jax": None,
    "tpu_raiden.api.jax.kv_cache_manager": "tpusync.engines.upstream.kv_cache_manager",
    "tpu_raiden.api.jax.kv_cache_store": "tpusync.engines.upstream.kv_cache_store",
    "tpu_sync": None,
    "tpu_sync.api": None,
    "tpu_sync.api.jax": None,
    "tpu_sync.api.jax.weight_synchronizer": "tpusync.engines.upstream.weight_synchronizer",
}


class UpstreamInstalled(ImportError):
    """Upstream's own package is importable here: tpusync does not shadow it."""


def _is_package(name: str) -> bool:
    return any(other.startswith(f"{name}.") for other in MODULES)


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves upstream's module paths to tpusync's modules: a module is the same object under
    both names; a package is a fresh one holding its target's public names."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=_is_package(name))

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = MODULES[spec.name]
        if not _is_package(spec.name):
            assert target is not None
            return importlib.import_module(target)
        module = types.ModuleType(spec.name,
                                  f"{spec.name}: upstream TPU Sync's path, served by tpusync.engines.upstream")
        module.__path__ = []
        if target is not None:
            source = importlib.import_module(target)
            module.__dict__.update({k: getattr(source, k) for k in source.__all__})
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # create_module made it whole


def installed() -> bool:
    return any(isinstance(f, _Aliases) for f in sys.meta_path)


def upstream_present() -> list[str]:
    """Upstream's top-level packages that this interpreter could import without tpusync."""
    found = []
    for root in ROOTS:
        module = sys.modules.get(root)
        if module is None:  # not imported yet: would the path find it?
            if importlib.machinery.PathFinder.find_spec(root) is not None:
                found.append(root)
        elif not _is_ours(module):
            found.append(root)
    return found


def _is_ours(module: types.ModuleType) -> bool:
    return isinstance(getattr(module, "__loader__", None), _Aliases) or module.__name__.startswith("tpusync.")


def install() -> None:
    """Serves upstream's module paths (MODULES) from tpusync; idempotent. Raises
    UpstreamInstalled, naming what it found, when upstream's own package is importable."""
    if installed():
        return
    present = upstream_present()
    if present:
        raise UpstreamInstalled(
            f"{', '.join(present)} (upstream TPU Sync) is installed in this environment; tpusync does not shadow it. "
            f"Unset {ENV} to use upstream's package, or uninstall it to run its consumers on tpusync.")
    sys.meta_path.insert(0, _Aliases())


def install_if_enabled() -> bool:
    """install() when TPUSYNC_UPSTREAM_API is 1/true/yes; whether the aliases are in place."""
    if os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes"):
        install()
    return installed()
