"""A fault-injecting proxy in front of the e2e kube-apiserver, for tests of a client (the
operator) under API faults: on command it answers chosen requests with an error status,
closes their connections unanswered, or drops every connection for a while.

It listens on 127.0.0.1 only, in plain HTTP (the client's bearer token travels over loopback
and is passed on as it came), and forwards each request over TLS, verified with the cluster's
CA, to the API server. Responses are streamed as they arrive, so watches work through it.
Nothing is rewritten: the client authenticates as itself and RBAC applies.

    proxy = FaultProxy(cluster.server, cluster.ca_file)
    proxy.start()
    fault = proxy.fail("GET", r"/api/v1/namespaces/ns/pods", status=500)   # lists, not watches
    ... wait until fault.hits > 0 ...
    proxy.clear()
    proxy.stop()

The proxy runs its own asyncio loop in a thread; its methods may be called from any thread.
`kubeconfig()` writes a kubeconfig that reaches the API server through it.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from harness.processes import LOOPBACK

# Not forwarded either way (RFC 9110 7.6.1), plus what the two HTTP stacks set themselves.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}


def _bytes_re(pattern: str | None) -> re.Pattern[bytes] | None:
    return re.compile(pattern.encode()) if pattern is not None else None


@dataclass
class Fault:
    """Requests this fault takes: `method` ("*" for any) and `path` (a regular expression the
    whole path, without the query, must match), and when `body` is given, a body it is found
    in; watches only when `watch`. `status` None: the connection is closed without an answer.
    `hits` counts the requests it took."""
    method: str
    path: re.Pattern[str]
    status: int | None
    watch: bool = False
    body: re.Pattern[bytes] | None = None
    hits: int = 0

    def matches(self, method: str, path: str, watch: bool, body: bytes) -> bool:
        return (self.method in ("*", method) and watch <= self.watch
                and self.path.fullmatch(path) is not None
                and (self.body is None or self.body.search(body) is not None))


@dataclass
class FaultProxy:
    upstream: str                      # https://127.0.0.1:PORT of the API server
    ca_file: Path | None = None        # its CA (None: the system's)
    port: int = 0                      # 0: any free port on 127.0.0.1
    faults: list[Fault] = field(default_factory=list)
    forwarded: int = 0                 # requests passed on to the API server
    dropped: int = 0                   # connections closed by drop_all() or while dropping
    _dropping: bool = False
    _open: set[asyncio.Transport] = field(default_factory=set)   # connections with a request in flight
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # ----- control (any thread) -----------------------------------------------------------
    def fail(self, method: str, path: str, status: int = 500, *, watch: bool = False,
             body: str | None = None) -> Fault:
        """Answer matching requests with `status` (a Kubernetes Status body) until cleared."""
        return self._add(Fault(method.upper(), re.compile(path), status, watch, _bytes_re(body)))

    def reset(self, method: str, path: str, *, watch: bool = False, body: str | None = None) -> Fault:
        """Close the connection of matching requests without an answer until cleared."""
        return self._add(Fault(method.upper(), re.compile(path), None, watch, _bytes_re(body)))

    def drop_all(self) -> None:
        """Close every connection with a request in flight (watches included) and every new
        request's, until restore()."""
        with self._lock:
            self._dropping = True
        self._call(self._abort_open())

    def restore(self) -> None:
        with self._lock:
            self._dropping = False

    def clear(self) -> None:
        """No faults any more; connections are accepted again."""
        with self._lock:
            self.faults.clear()
            self._dropping = False

    def _add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def kubeconfig(self, source: Path, dest: Path) -> Path:
        """A copy of kubeconfig `source` (one cluster) whose server is this proxy."""
        cfg = yaml.safe_load(source.read_text())
        for cluster in cfg["clusters"]:
            cluster["cluster"] = {"server": self.url}
        dest.write_text(yaml.safe_dump(cfg))
        dest.chmod(0o600)
        return dest

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the fault proxy did not start")

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def _call(self, coro) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        # Bytes pass through as the API server sent them (gzip included); no overall timeout:
        # watches last minutes.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client gone (or dropped here) cancels its handler, which closes the upstream request:
        # a watch must not outlive its client.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        await self._abort_open()
        if self._session is not None:      # ends the watches still streaming upstream
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _abort_open(self) -> None:
        for transport in list(self._open):
            transport.abort()
            self.dropped += 1
        self._open.clear()

    # ----- requests (the proxy's loop) ----------------------------------------------------
    def _decide(self, method: str, path: str, watch: bool, body: bytes) -> tuple[bool, Fault | None]:
        with self._lock:
            if self._dropping:
                return True, None
            for fault in self.faults:
                if fault.matches(method, path, watch, body):
                    fault.hits += 1
                    return False, fault
        return False, None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        watch = request.query.get("watch") in ("true", "1")
        body = await request.read()
        drop, fault = self._decide(request.method, request.path, watch, body)
        if drop or (fault is not None and fault.status is None):
            if transport is not None:
                transport.abort()
            if drop:
                self.dropped += 1
            raise asyncio.CancelledError()      # nothing to answer on an aborted connection
        if fault is not None:
            return web.json_response(status=fault.status, data={
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"injected by the e2e fault proxy: {request.method} {request.path}",
                "reason": "InternalError", "code": fault.status})
        if transport is not None:
            self._open.add(transport)
        try:
            return await self._forward(request, body)
        except (ConnectionResetError, aiohttp.ClientError):
            # Dropped here, or the API server's side broke: the client sees its connection end.
            if transport is not None:
                transport.abort()
            raise asyncio.CancelledError() from None
        finally:
            self._open.discard(transport)

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        self.forwarded += 1
        async with self._session.request(request.method, self.upstream + request.rel_url.raw_path_qs,
                                         headers=headers, data=body or None,
                                         allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
