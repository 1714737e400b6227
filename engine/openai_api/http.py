"""The OpenAI-compatible API over HTTP: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(and ``/v1/models/<id>``), the key, JSON bodies, errors, and streams.

A :class:`~llmrl.engine.transport.capped_http.CappedHTTPServer` answers each connection on a thread of its own, for
at most ``max_connections`` connections at once (one more is answered 503 and closed); a connection silent for
``idle_timeout`` seconds is closed, so that no client holds a thread by saying nothing. Every request must carry
``Authorization: Bearer <key>`` (what the OpenAI SDK sends), compared in constant time before its body is read: a
wrong or missing key is a 401 and the connection closes. Errors have OpenAI's shape (``{"error": {"message",
"type", "param", "code"}}``): 400 for a bad request, naming the field in ``param`` and in the message, 401, 404 for
an unknown route or model, 413 for a body over :data:`MAX_BODY`, 500 for a bug (its traceback on stderr). Whatever a
handler raises, the connection's thread answers and the server goes on. A request with ``stream: true`` is answered
as server-sent events once its generation is done: one ``data:`` chunk per choice with the whole text, one with its
``finish_reason``, then ``data: [DONE]``.

This module routes; what each call does is :mod:`llmrl.engine.openai_api.service`'s.
"""

from __future__ import annotations

import hmac
import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmrl.engine.openai_api.params import Refused
from llmrl.engine.transport.capped_http import CappedHTTPServer

MAX_BODY = 16 << 20  # bytes of a request body (a long conversation with tools is well under a megabyte)
IDLE_TIMEOUT = 30.0  # seconds a connection may stay silent
MAX_CONNECTIONS = 256  # connections served at once, each on a thread of its own (one more is answered 503)
ROLLOUT_HEADER = "X-Rollout-Id"
POST_ROUTES = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}


def make_server(service, host: str, port: int, api_key: str, idle_timeout: float = IDLE_TIMEOUT,
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """The HTTP server of ``service`` on ``host:port`` (port 0: a free one), refusing any other key; connections
    silent for ``idle_timeout`` seconds are closed, and at most ``max_connections`` are served at once."""
    if not api_key:
        raise ValueError("the endpoint needs a non-empty API key")
    expected = f"Bearer {api_key}".encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = idle_timeout  # every read and write of the connection's socket

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass

        def do_GET(self) -> None:
            self._answer(self._get)

        def do_POST(self) -> None:
            self._answer(self._post)

        def _answer(self, route) -> None:
            self.body_read = False
            try:
                if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                    self.close_connection = True  # a client without the key keeps no connection
                    raise Refused("wrong or missing API key: send 'Authorization: Bearer <key>' (the OpenAI SDK's "
                                  "api_key)", None, 401)
                route(self.path.split("?", 1)[0].rstrip("/"))
            except Refused as err:
                self._error(err.status, str(err), err.param)
            except RecursionError:
                self._error(400, "the body nests JSON more deeply than the parser follows", None)
            except Exception as err:  # noqa: BLE001 - a handler's bug answers 500; the server goes on
                traceback.print_exc(file=sys.stderr)
                self._error(500, f"{type(err).__name__}: {err}", None, "server_error")

        def _get(self, path: str) -> None:
            models = service.models()
            if path == "/v1/models":
                return self._send(200, models)
            if path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                for model in models["data"]:
                    if model["id"] == name:
                        return self._send(200, model)
                raise Refused(f"model {name!r} is not served here (GET /v1/models lists them)", "model", 404)
            raise Refused(f"GET {path} is not served; the endpoint serves GET /v1/models", None, 404)

        def _post(self, path: str) -> None:
            if path not in POST_ROUTES:
                raise Refused(f"POST {path} is not served; the endpoint serves POST {', '.join(POST_ROUTES)}", None,
                              404)
            body = self._json()
            answer = getattr(service, POST_ROUTES[path])(body, self.headers.get(ROLLOUT_HEADER))
            if body.get("stream") is True:
                return self._stream(answer)
            self._send(200, answer)

        def _json(self) -> dict:
            text = self.headers.get("Content-Length") or "0"
            length = int(text) if text.strip().isdigit() else -1
            if length < 0:
                raise Refused(f"Content-Length {text!r} is not a number of bytes", None)
            if length > MAX_BODY:
                raise Refused(f"the request body of {length} bytes is over the endpoint's {MAX_BODY}", None, 413)
            try:
                data = self.rfile.read(length)
            except OSError:  # silent for idle_timeout, or gone: the connection ends here
                self.close_connection = True
                raise Refused(f"the body did not come: {length} bytes announced", None, 408) from None
            self.body_read = True
            if len(data) < length:
                self.close_connection = True
                raise Refused(f"the body ended after {len(data)} of its {length} bytes", None)
            try:
                body = json.loads(data or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise Refused(f"the body is not JSON: {err}", None) from None
            if not isinstance(body, dict):
                raise Refused("the body must be a JSON object", None)
            return body

        def _error(self, status: int, message: str, param: str | None, kind: str = "invalid_request_error") -> None:
            code = {401: "invalid_api_key", 404: "not_found"}.get(status)
            self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})

        def _send(self, status: int, value) -> None:
            data = json.dumps(value).encode()
            if not self.body_read and (self.headers.get("Content-Length") or "0").strip() != "0":
                self.close_connection = True  # the unread body would be read as the next request
            try:
                self.send_response(status)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away: nothing more to answer
                self.close_connection = True

        def _stream(self, answer: dict) -> None:
            self.close_connection = True  # the stream's end is the connection's
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in stream_chunks(answer):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:
                pass

    busy = json.dumps({"error": {"message": f"the endpoint is serving its {max_connections} connections at once: "
                                            "retry shortly", "type": "server_busy", "param": None,
                                 "code": 503}}).encode()
    return CappedHTTPServer((host, port), Handler, max_connections, busy)


def stream_chunks(answer: dict) -> list[dict]:
    """A whole answer as the chunks of OpenAI's stream: per choice, its delta (role, text, tool calls, log-probs),
    then its ``finish_reason``."""
    chat = answer["object"] == "chat.completion"
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    chunks = []
    for choice in answer["choices"]:
        if chat:
            delta = dict(choice["message"])
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta["tool_calls"])]
            body = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
            end = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            body = {**choice, "finish_reason": None}
            end = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        chunks += [{**head, "choices": [body]}, {**head, "choices": [end]}]
    return chunks
