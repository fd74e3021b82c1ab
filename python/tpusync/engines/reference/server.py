"""HTTP front end of the reference engine: OpenAI-style /v1/completions, vLLM's
/v1/completions/render, /health, /metrics.

What a client sends is bounded before it is read: every request's body is read whole (within
the body cap) before the request is routed, so no body is ever parsed as the next request on a
kept-alive connection, and a body of bad, unknown or too great a length is refused and the
connection closed. A prompt longer than the prompt cap is refused before it is tokenised, on
every route. A client never sees an exception's text or a peer's error: the server logs them.

Stopping: after shutdown() and server_close() no connection is taken; drain() waits for the
requests being answered to end (the process's SIGTERM does both: __main__).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tpusync import errors
from tpusync.engines.reference import codec
from tpusync.engines.reference.engine import Engine

log = logging.getLogger("tpusync.serving")

DEFAULT_MAX_BODY_BYTES = 1 << 20
# A prompt token in a body: a token id and its separator ("65535, "), or a character escaped
# ("\u00ff"), with room to spare. The default body cap grows with long-context models' prompts.
BODY_BYTES_PER_TOKEN = 16
# After refusing a body it did not read, the server reads and drops what the client still sends
# for this long, or this much (see _Handler._refuse).
_LINGER_SECONDS = 5.0
_LINGER_BYTES = 64 << 20
# What a client is told of an exception: its text may name a peer or a socket (it is logged).
INTERNAL_ERROR = "internal error: the server logged it"


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    protocol_version = "HTTP/1.1"
    # Each read and write on the connection (a request head, a body, an idle keep-alive) gets
    # this long: a client that stops sending holds a thread for a minute, not for ever.
    timeout = 60.0

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs through logging
        log.debug(fmt, *args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        self._send(status, json.dumps({"error": {"message": message, "type": kind}}).encode())

    # -- the body, bounded before it is read -------------------------------------------------

    def _content_length(self) -> int | None:
        """The body's length, checked before any of it is read; None once refused."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._refuse(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
            return None
        values = {v.strip(" \t") for v in self.headers.get_all("Content-Length") or ["0"]}
        # Digits only (int() would also take "-1", "+5", "1_0" or other scripts' digits), one value.
        if not all(v.isascii() and v.isdigit() for v in values) or len({v.lstrip("0") for v in values}) > 1:
            self._refuse(400, "Content-Length must be one number of bytes")
            return None
        digits, cap = values.pop().lstrip("0") or "0", self.server.max_body_bytes
        if len(digits) > len(str(cap)) or int(digits) > cap:  # int() refuses thousands of digits
            self._refuse(413, f"the body is larger than this server takes: at most {cap} bytes")
            return None
        return int(digits)

    def _body(self) -> bytes | None:
        """The request's whole body; None once refused (the connection then closes)."""
        length = self._content_length()
        if length is None:
            return None
        body = self.rfile.read(length)
        if len(body) < length:
            self._refuse(400, f"the body ended after {len(body)} of its {length} bytes")
            return None
        return body

    def _refuse(self, status: int, message: str) -> None:
        """Answers an error and closes the connection: the body was not read, so the connection
        cannot carry another request. What the client still sends is read and dropped for a
        while: closing a socket with unread bytes resets the connection, which would lose the
        answer for a client that sends its whole body before reading one (most do)."""
        self.close_connection = True
        self._error(status, message)
        try:
            self.connection.shutdown(socket.SHUT_WR)  # the answer is whole: the client sees its end now
            deadline, left = time.monotonic() + _LINGER_SECONDS, _LINGER_BYTES
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                dropped = self.connection.recv(min(left, 1 << 16))
                if not dropped:
                    break
                left -= len(dropped)
        except OSError:  # the client went away, or the time is up: close
            pass

    def handle_expect_100(self) -> bool:
        # Refuse a body of bad or too great a length before the client sends it, not after.
        return self._content_length() is not None and super().handle_expect_100()

    # -- routes ------------------------------------------------------------------------------

    def do_GET(self) -> None:
        with self.server.answering():
            self._get()

    def do_POST(self) -> None:
        with self.server.answering():
            self._post()

    def _get(self) -> None:
        if self._body() is None:  # a GET's body is read too: else it would be parsed as the next request
            return
        engine = self.server.engine
        if self.path == "/health":
            self._send(200, b"{}")
        elif self.path == "/metrics":
            self._send(200, self.server.metrics_text().encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            body = {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                "max_model_len": engine.cfg.max_seq}]}
            self._send(200, json.dumps(body).encode())
        else:
            self._error(404, f"no route {self.path}")

    def _post(self) -> None:
        body = self._body()  # read before routing: an unread body would be parsed as the next request
        if body is None:
            return
        if self.path == "/v1/completions/render":
            self._render(body)
        elif self.path == "/v1/completions":
            self._complete(body)
        else:
            self._error(404, f"no route {self.path}")

    def _complete(self, body: bytes) -> None:
        try:
            req = request_object(body)
            tokens = prompt_tokens(req.get("prompt"), self.server.max_prompt_tokens)
            max_tokens = int(req.get("max_tokens", 16))
            if max_tokens < 1:
                raise errors.InvalidArgumentError("max_tokens must be at least 1")
            if float(req.get("temperature", 0) or 0) != 0:
                raise errors.InvalidArgumentError("the reference engine decodes greedily: temperature must be 0")
            kv_params = req.get("kv_transfer_params")
            if kv_params is not None and not isinstance(kv_params, dict):
                raise errors.InvalidArgumentError("kv_transfer_params must be a JSON object")
        except (ValueError, TypeError, OverflowError, errors.TpuSyncError) as e:
            self._error(400, str(e))
            return
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"  # names the request in the server's log too
        if req.get("stream"):
            self._stream(rid, tokens, max_tokens, kv_params)
            return
        try:
            result = self.server.engine.generate(tokens, max_tokens, kv_transfer_params=kv_params, request_id=rid)
        except errors.InvalidArgumentError as e:
            self._error(400, str(e))
            return
        except Exception:  # the client gets a 500 naming nothing of it, the server logs it and keeps serving
            log.exception("request failed")
            self._error(500, INTERNAL_ERROR)
            return
        response = self.server.completion(rid, result.tokens, len(tokens))
        response["kv_transfer_params"] = result.kv_transfer_params
        response["tpusync"] = result.stats.as_dict()
        self._send(200, json.dumps(response).encode())

    def _render(self, body: bytes) -> None:
        """vLLM's render API, which llm-d's token-producer calls to learn a prompt's tokens
        (for precise prefix-cache scoring): one {"token_ids"} per prompt."""
        try:
            prompt = request_object(body).get("prompt")
            prompts = [prompt]
            if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
                prompts = prompt  # several prompts, each text or token ids
            rendered = [{"token_ids": prompt_tokens(p, self.server.max_prompt_tokens)} for p in prompts]
        except (ValueError, TypeError, errors.TpuSyncError) as e:
            self._error(400, str(e))
            return
        self._send(200, json.dumps(rendered).encode())

    def _stream(self, rid: str, tokens: list[int], max_tokens: int, kv_params: dict[str, Any] | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()

        def emit(token: int) -> None:
            chunk = {"id": rid, "object": "text_completion", "model": self.server.model_name,
                     "choices": [{"index": 0, "text": codec.decode([token]), "token_ids": [token],
                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        try:
            result = self.server.engine.generate(tokens, max_tokens, kv_transfer_params=kv_params, on_token=emit,
                                                 request_id=rid)
            final = {"id": rid, "object": "text_completion", "model": self.server.model_name,
                     "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                     "kv_transfer_params": result.kv_transfer_params, "tpusync": result.stats.as_dict()}
            self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        except Exception:  # reported in the stream, naming nothing of it; the server logs it and keeps serving
            log.exception("request failed")
            self.wfile.write(f"data: {json.dumps({'error': {'message': INTERNAL_ERROR}})}\n\n".encode())
        self.close_connection = True


def request_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object ({} when empty)."""
    try:
        req = json.loads(body) if body else {}
    except RecursionError:
        raise errors.InvalidArgumentError("the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise errors.InvalidArgumentError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise errors.InvalidArgumentError(f"the request body must be a JSON object, not {_json_kind(req)}")
    return req


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else "a number"


def prompt_tokens(prompt: object, limit: int) -> list[int]:
    """A completions prompt (text, or token ids) as token ids, at most `limit` of them. Text is
    measured before it is encoded (a character is at least one token) and after (a character
    outside Latin-1 is several)."""
    too_long = errors.InvalidArgumentError(f"the prompt is too long: this server takes at most {limit} tokens")
    if isinstance(prompt, (str, list)) and len(prompt) > limit:
        raise too_long
    tokens = codec.encode(prompt) if isinstance(prompt, str) else prompt
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise errors.InvalidArgumentError("prompt must be a string or a list of token ids")
    if len(tokens) > limit:
        raise too_long
    return tokens


class CompletionServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine, model_name: str, *,
                 max_body_bytes: int | None = None, max_prompt_tokens: int | None = None) -> None:
        """`max_prompt_tokens`: the longest prompt any route takes (default: the model's max_seq).
        `max_body_bytes`: the largest request body, refused with 413 before it is read (default:
        1 MiB, or BODY_BYTES_PER_TOKEN bytes a prompt token if that is more)."""
        self.max_prompt_tokens = engine.cfg.max_seq if max_prompt_tokens is None else max_prompt_tokens
        self.max_body_bytes = (max(DEFAULT_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.max_prompt_tokens)
                               if max_body_bytes is None else max_body_bytes)
        for name, value in (("max_prompt_tokens", self.max_prompt_tokens), ("max_body_bytes", self.max_body_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        super().__init__(address, _Handler)
        self.engine = engine
        self.model_name = model_name
        self._answering = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around one request's answer: what drain() waits for (an idle kept-alive connection is not)."""
        with self._idle:
            self._answering += 1
        try:
            yield
        finally:
            with self._idle:
                self._answering -= 1
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits until no request is being answered; False if some still are after `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._answering == 0, timeout)

    def completion(self, rid: str, tokens: list[int], prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": codec.decode(tokens), "token_ids": tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)},
        }

    def metrics_text(self) -> str:
        """The gauges an llm-d endpoint picker scrapes, under vLLM's metric names, and the KV
        path's counters (tpusync.kv.path_metrics), which the operator reads."""
        e = self.engine
        labels = f'model_name="{self.model_name}"'
        lines = []
        for name, help_, value in (
            ("vllm:num_requests_running", "Requests being computed.", e.running),
            ("vllm:num_requests_waiting", "Requests queued.", e.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use.", e.kv_cache_usage()),
            ("vllm:gpu_cache_usage_perc", "Same as kv_cache_usage_perc (older name).", e.kv_cache_usage()),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        return "\n".join(lines) + "\n" + e.kv_path.prometheus({"model_name": self.model_name})
