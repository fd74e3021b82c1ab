"""Names of pytree leaves, as the manifest records them ('layers/0/w')."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def iter_leaf_names(tree: Any) -> Iterator[tuple[str, Any]]:
    """(name, leaf) for every leaf of a pytree, names like 'layers/0/w'."""
    import jax  # only callers that hold pytrees need JAX

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in flat:
        yield "/".join(_key_name(k) for k in path) or "<root>", leaf


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)
