"""The pause around a weight update, made safe: ASGI middleware for vLLM's API server.

    vllm serve MODEL --weight-transfer-config '{"backend": "tpusync"}' \\
        --middleware tpusync.vllm.pause_guard.PauseGuard          (docs/weights.md)

vLLM's trainer flow is POST /pause?mode=wait, the weight update (/start_weight_update,
/update_weights, /finish_weight_update), POST /resume. In vLLM 0.32.0 it has two gaps, which
this middleware closes in the API server, where those routes are served and the engine client
lives (the weight-transfer backend runs in a worker, which can neither see the requests nor
resume the scheduler):

- **"wait" does not wait for preempted requests.** The pause sets the scheduler to PAUSED_NEW
  and completes once it has no unfinished requests (vllm/v1/engine/core.py:2094-2102,
  `_pause_complete` = not `has_work()`, core.py:1534-1540). Under PAUSED_NEW the scheduler
  counts, and schedules from its waiting queues, only the requests holding KV blocks
  (vllm/v1/core/sched/scheduler.py:2803-2811 `get_num_unfinished_requests`, :912-917). A
  request the scheduler preempts while draining (KV cache full) frees its blocks and goes
  back to the plain waiting queue (scheduler.py:1571-1614 `_preempt_request`: blocks freed,
  `num_computed_tokens = 0`, `waiting.prepend_request`), so the pause completes without it;
  after /resume it finishes on the new weights from a prefix the old ones generated. So
  when vLLM's pause returns and a request that has begun generating is still unfinished, the
  guard resumes the engine and pauses it again, the same way, until none is left: the
  preempted requests are first in line (prepended), run, and are drained like the others.
  The pause's answer waits for that.
- **A weight update is refused (409) while any request that has begun generating is
  unfinished** (paused with mode=keep, or not paused at all): it would finish on other weights.
- **A pause holds a lease.** A trainer that dies between /pause and /resume would leave the
  engine paused for good. Each of the trainer's calls (the routes above, /is_paused as a
  heartbeat) renews the lease, which cannot lapse while one is in progress; when it lapses,
  the guard finishes a weight update left open (a whole tpusync version is loaded within one
  /update_weights call, so the engine holds one version either way) and resumes the engine.
  TPUSYNC_PAUSE_LEASE_S (default 60) sets its length.

"Begun generating" is the front end's own record: a request's state stops prefilling at its
first output (vllm/v1/engine/output_processor.py:180, 733-743). One that was preempted before
any output restarts from its prompt on the new weights, whole. The front end processes the
engine's outputs a moment after they arrive; vLLM's pause waits 20 ms for them
(vllm/v1/engine/async_llm.py:978-984) before it answers, and the guard reads the record then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from vllm.logger import init_logger

log = init_logger("vllm.tpusync")

LEASE_ENV = "TPUSYNC_PAUSE_LEASE_S"
DEFAULT_LEASE_S = 60.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

UPDATES = ("/start_weight_update", "/update_weights")
# A call to any of these is the trainer's sign of life while the engine is paused.
TRAINER_ROUTES = frozenset({"/pause", "/resume", "/is_paused", "/init_weight_transfer_engine", *UPDATES,
                            "/finish_weight_update", "/update_weight_version", "/weight_info"})


class PauseGuard:
    """Added by vLLM with `app.add_middleware(PauseGuard)` (--middleware). All its state is the
    server's event loop's: no lock."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.lease_s = float(os.environ.get(LEASE_ENV, DEFAULT_LEASE_S))
        if self.lease_s <= 0:
            raise ValueError(f"{LEASE_ENV} must be a positive number of seconds, not {self.lease_s}")
        self.paused = False        # by a /pause through this server, not resumed since
        self.update_open = False   # /start_weight_update answered, /finish_weight_update not yet
        self.deadline = 0.0        # when the pause lapses, unless a trainer call renews it
        self.calls = 0             # trainer calls in progress
        self._watchdog: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path not in TRAINER_ROUTES:
            await self.app(scope, receive, send)
            return
        engine = scope["app"].state.engine_client
        self.calls += 1
        try:
            if path in UPDATES and (begun := started(engine)):
                await _answer(send, 409, f"{begun} requests began generating on the weights this engine serves and "
                                         "have not finished: updating now would finish them on other weights. "
                                         "Pause with mode=wait (which waits for them), or abort them, first"
                                         + (" (and end this update with /finish_weight_update)"
                                            if path == "/update_weights" else ""))
                return
            if path == "/pause":
                status = await self._pause(scope, receive, send, engine)
            else:
                status = await _status_of(self.app, scope, receive, send)
        finally:
            self.calls -= 1
            self.deadline = time.monotonic() + self.lease_s
        if status == 200:
            self._after(path, engine)
        elif path == "/update_weights":
            # vLLM's worker ends the update when it fails (vllm/v1/worker/gpu_worker.py:1582-1585).
            self.update_open = False

    async def _pause(self, scope: Scope, receive: Receive, send: Send, engine: Any) -> int:
        """vLLM's /pause, then (mode=wait) again until no request that began generating is
        left unfinished; its answer is sent once that is so."""
        request = dict(scope)  # as it came: vLLM's router notes its match in the scope
        status, answer = await _held(self.app, scope, receive)
        if status == 200 and _query(scope, "mode") == "wait":
            while status == 200 and (begun := started(engine)):
                log.warning("tpusync: %d requests were preempted while the pause drained the engine; resuming "
                            "so that they finish on the weights they began with, then pausing again", begun)
                await engine.resume_generation()
                status, answer = await _held(self.app, dict(request), _no_body)
        for message in answer:
            await send(message)
        return status

    def _after(self, path: str, engine: Any) -> None:
        if path == "/pause":
            self.paused = True
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.get_running_loop().create_task(self._watch(engine))
        elif path == "/resume":
            self.paused = False
        elif path == "/start_weight_update":
            self.update_open = True
        elif path == "/finish_weight_update":
            self.update_open = False

    async def _watch(self, engine: Any) -> None:
        """Resumes the engine once a pause's lease lapses (no trainer call for lease_s, none in progress)."""
        while self.paused:
            left = self.deadline - time.monotonic()
            if self.calls or left > 0:
                await asyncio.sleep(left if left > 0 else self.lease_s)  # a call's end renews the deadline
                continue
            log.warning("tpusync: no call from the trainer that paused this engine for %.0f s: resuming it "
                        "(%s=%g)", self.lease_s, LEASE_ENV, self.lease_s)
            if self.update_open:
                with contextlib.suppress(Exception):  # nothing of it may keep the engine paused
                    await engine.finish_weight_update()
                self.update_open = False
            await engine.resume_generation()
            self.paused = False


def started(engine: Any) -> int:
    """The requests that began generating and have not finished (the front end's record)."""
    return sum(1 for state in engine.output_processor.request_states.values() if not state.is_prefilling)


async def _status_of(app: App, scope: Scope, receive: Receive, send: Send) -> int:
    """Runs the request through vLLM; returns the status it answered."""
    status = 500

    async def noting(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        await send(message)

    await app(scope, receive, noting)
    return status


async def _held(app: App, scope: Scope, receive: Receive) -> tuple[int, list[Message]]:
    """Runs the request through vLLM, keeping its answer: (status, the messages to send)."""
    held: list[Message] = []

    async def hold(message: Message) -> None:
        held.append(message)

    return await _status_of(app, scope, receive, hold), held


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _answer(send: Send, status: int, error: str) -> None:
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _query(scope: Scope, name: str) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode()).get(name)
    return values[-1] if values else None
