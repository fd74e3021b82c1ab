"""Keep kopf running when the CRD of a watched kind is removed or not served yet.

kopf (1.45.2, pinned in pyproject.toml) treats any error of a watch stream as fatal: the
watcher task fails, its orchestrator re-raises and the whole operator stops. When a CRD we
watch (LeaderWorkerSet, InferencePool, HTTPRoute...) is deleted, the API server ends its
watches; kopf's watcher reconnects before kopf's own CRD observer has stopped it, gets 404,
and the operator exits. kopf documents the gap in `_update_resources` (kopf/_core/reactor/
observation.py: "we miss the CRD deletion event and continue the watching attempts (and
fail with HTTP 404)"). A CRD just installed and not yet served gives the same 404.

`tolerate_removed_crds` wraps kopf's `infinite_watch` so that 404 means "not served right
now": the stream waits and lists again, exactly what a new watcher would do. kopf's observer
still stops the watcher when it sees the CRD gone, and starts one when it comes back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0


def tolerate_removed_crds(retry_seconds: float = RETRY_SECONDS) -> None:
    from kopf._cogs.clients import watching
    from kopf._cogs.clients.errors import APINotFoundError

    original = watching.infinite_watch
    if getattr(original, "tolerates_removed_crds", False):
        return

    async def infinite_watch(**kwargs: Any) -> AsyncIterator[Any]:
        while True:
            try:
                async for event in original(**kwargs):
                    yield event
                return
            except APINotFoundError:
                log.warning("the API server does not serve %s (its CRD was removed or is not "
                            "established yet); listing it again in %g s", kwargs["resource"], retry_seconds)
                await asyncio.sleep(retry_seconds)

    infinite_watch.tolerates_removed_crds = True  # type: ignore[attr-defined]
    watching.infinite_watch = infinite_watch
