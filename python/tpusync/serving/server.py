"""HTTP front end of the reference engine: OpenAI-style /v1/completions, vLLM's
/v1/completions/render, /health, /metrics."""

from __future__ import annotations

import json
import logging
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tpusync import errors
from tpusync.serving import codec
from tpusync.serving.engine import Engine

log = logging.getLogger("tpusync.serving")


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs through logging
        log.debug(fmt, *args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode())

    def do_GET(self) -> None:
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

    def do_POST(self) -> None:
        if self.path == "/v1/completions/render":
            self._render()
            return
        if self.path != "/v1/completions":
            self._error(404, f"no route {self.path}")
            return
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            tokens = prompt_tokens(req.get("prompt"))
            max_tokens = int(req.get("max_tokens", 16))
            if max_tokens < 1:
                raise errors.InvalidArgumentError("max_tokens must be at least 1")
            if float(req.get("temperature", 0) or 0) != 0:
                raise errors.InvalidArgumentError("the reference engine decodes greedily: temperature must be 0")
        except (ValueError, TypeError, errors.TpuSyncError) as e:
            self._error(400, str(e))
            return
        if req.get("stream"):
            self._stream(req, tokens, max_tokens)
            return
        try:
            result = self.server.engine.generate(tokens, max_tokens, kv_transfer_params=req.get("kv_transfer_params"))
        except errors.InvalidArgumentError as e:
            self._error(400, str(e))
            return
        except Exception as e:  # the client gets a 500, the server keeps serving
            log.exception("request failed")
            self._error(500, f"{type(e).__name__}: {e}")
            return
        body = self.server.completion(result.tokens, len(tokens))
        body["kv_transfer_params"] = result.kv_transfer_params
        body["tpusync"] = result.stats.as_dict()
        self._send(200, json.dumps(body).encode())

    def _render(self) -> None:
        """vLLM's render API, which llm-d's token-producer calls to learn a prompt's tokens
        (for precise prefix-cache scoring): one {"token_ids"} per prompt."""
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            prompt = req.get("prompt")
            many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
            rendered = [{"token_ids": prompt_tokens(p)} for p in (prompt if many else [prompt])]
        except (ValueError, TypeError, errors.TpuSyncError) as e:
            self._error(400, str(e))
            return
        self._send(200, json.dumps(rendered).encode())

    def _stream(self, req: dict[str, Any], tokens: list[int], max_tokens: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"

        def emit(token: int) -> None:
            chunk = {"id": rid, "object": "text_completion", "model": self.server.model_name,
                     "choices": [{"index": 0, "text": codec.decode([token]), "token_ids": [token],
                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        try:
            result = self.server.engine.generate(tokens, max_tokens, kv_transfer_params=req.get("kv_transfer_params"),
                                                 on_token=emit)
            final = {"id": rid, "object": "text_completion", "model": self.server.model_name,
                     "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                     "kv_transfer_params": result.kv_transfer_params, "tpusync": result.stats.as_dict()}
            self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        except Exception as e:  # reported in the stream, the server keeps serving
            log.exception("request failed")
            self.wfile.write(f"data: {json.dumps({'error': {'message': f'{type(e).__name__}: {e}'}})}\n\n".encode())
        self.close_connection = True


def prompt_tokens(prompt: object) -> list[int]:
    """A completions prompt (text, or token ids) as token ids."""
    tokens = codec.encode(prompt) if isinstance(prompt, str) else prompt
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise errors.InvalidArgumentError("prompt must be a string or a list of token ids")
    return tokens


class CompletionServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine, model_name: str):
        super().__init__(address, _Handler)
        self.engine = engine
        self.model_name = model_name

    def completion(self, tokens: list[int], prompt_tokens: int) -> dict[str, Any]:
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": codec.decode(tokens), "token_ids": tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)},
        }

    def metrics_text(self) -> str:
        """The gauges an llm-d endpoint picker scrapes, under vLLM's metric names."""
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
        return "\n".join(lines) + "\n"
