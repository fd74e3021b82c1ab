"""Kubernetes Events about our objects, posted by the operator itself.

kopf.event works only inside a kopf handler (it reads the queue of the object's own worker
from a context variable): a pass started by the watch of another object or by the KV-path
observer would raise LookupError there, after its status was written. So the reconcile passes
post their events here, from any task: `emit` is synchronous (a pass never waits on it) and a
post that fails is a warning in the log, never a failed pass."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from datetime import datetime
from typing import Any

from .kube import Kube, KubeError
from .status import Clock

log = logging.getLogger(__name__)

COMPONENT = "tpusync-operator"
# The API server's limit on an Event's message (NoteLengthLimit), enforced on the new form; the
# legacy form is held to it too, as kopf and client-go's recorder do.
MAX_MESSAGE = 1024


def event_body(obj: dict[str, Any], type_: str, reason: str, message: str, now: datetime,
               instance: str) -> dict[str, Any]:
    """A core/v1 Event about obj, in the legacy form (no eventTime: firstTimestamp, lastTimestamp
    and count, as `kubectl describe` lists it). Kubernetes v1.37.2's
    pkg/apis/core/validation/events.go (legacyValidateEvent) then asks only that its namespace be
    the involved object's; the e2e suite posts these to the real kube-apiserver."""
    meta = obj["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 3] + "..."
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    # Named as client-go's recorder names them (<object>.<hex>), with random bits: two events of
    # one object within the clock's resolution must not collide.
    name = f"{meta['name']}.{int(now.timestamp() * 1e9):x}{secrets.token_hex(4)}"
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"namespace": meta["namespace"], "name": name},
        "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "namespace": meta["namespace"],
                           "name": meta["name"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT, "reportingInstance": instance,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


class EventPoster:
    """Posts each emitted event in a task of its own; `drain` waits for those in flight."""

    def __init__(self, kube: Kube, now: Clock, instance: str | None = None):
        self.kube = kube
        self.now = now
        self.instance = instance or os.environ.get("HOSTNAME", COMPONENT)
        self._posting: set[asyncio.Task[None]] = set()

    def emit(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        body = event_body(obj, type_, reason, message, self.now(), self.instance)
        task = asyncio.get_running_loop().create_task(self._post(body), name=f"event {reason}")
        self._posting.add(task)
        task.add_done_callback(self._posting.discard)

    async def _post(self, body: dict[str, Any]) -> None:
        try:
            await self.kube.create(body)
        except KubeError as e:
            obj = body["involvedObject"]
            log.warning("event %s of %s %s/%s not posted: %s", body["reason"], obj["kind"], obj["namespace"],
                        obj["name"], e)

    async def drain(self) -> None:
        while self._posting:
            await asyncio.gather(*self._posting, return_exceptions=True)
