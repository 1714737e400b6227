"""The Tinker REST API over HTTP: routes under ``/api/v1/``, the API key, JSON and protobuf bodies, errors.

A :class:`ThreadingHTTPServer` answers each connection on a thread of its own, for at most ``max_connections``
connections at once (one more is answered 503 and closed: the SDK retries it); a connection silent for
``idle_timeout`` seconds (between requests, or inside one: half a request line, a body that stops coming) is closed,
so that no client holds a thread by saying nothing. Every request must carry the service's key in ``X-API-Key``
(compared in constant time), checked before its body is read; a wrong key is a 401, and the connection closes.
Bodies are JSON, except ``forward_backward``'s (protobuf), and the results of forward/backward and sampling futures
(protobuf, as the SDK expects). A request that fails before it becomes a future is answered with a JSON error body
(never an empty one: the SDK would take an empty 400 for a dropped connection and retry it for minutes): 400 for a
bad request (a body nested deeper than the parser follows included), 404 for an unknown model, sampler or future,
500 otherwise. A failure inside a future is reported by ``retrieve_future`` with its category. Whatever a handler
raises, the connection's thread answers and goes on.

This module routes; what each call does is :mod:`llmrl.engine.tinker.service`'s.
"""

from __future__ import annotations

import hmac
import json
import re
import sys
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from llmrl.engine.tinker.futures import Outcome
from llmrl.engine.transport.capped_http import CappedHTTPServer

MAX_BODY = 64 << 20  # bytes of a request body (the SDK sends forward_backward in chunks of about 5 MB)
IDLE_TIMEOUT = 10.0  # seconds a connection may stay silent (a pooled client connection closed meanwhile is reopened)
MAX_CONNECTIONS = 256  # connections served at once, each on a thread of its own

JSON_ROUTES = {  # POST path -> the service method taking the JSON body
    "create_session": "create_session", "create_model": "create_model", "get_info": "get_info",
    "optim_step": "optim_step", "save_weights": "save_weights", "save_weights_for_sampler": "save_weights_for_sampler",
    "load_weights": "load_weights", "create_sampling_session": "create_sampling_session", "asample": "asample",
}
ANSWERS = {  # POST path -> a fixed answer (what the service has nothing to do for)
    "client/config": {}, "client/dynamic_config": {"refresh_interval_sec": 300},
    "session_heartbeat": {"type": "session_heartbeat"}, "telemetry": {"status": "accepted"},
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def make_server(service, host: str, port: int, api_key: str, idle_timeout: float = IDLE_TIMEOUT,
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """The HTTP server of ``service`` on ``host:port`` (port 0: a free one), refusing any other key; connections
    silent for ``idle_timeout`` seconds are closed, and at most ``max_connections`` are served at once."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = idle_timeout  # every read and write of the connection's socket (StreamRequestHandler.setup)

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass

        def do_GET(self) -> None:
            self._answer(self._get)

        def do_POST(self) -> None:
            self._answer(self._post)

        def do_DELETE(self) -> None:
            self._answer(self._delete)

        def _answer(self, route) -> None:
            self.body_read = False
            try:
                if not hmac.compare_digest(self.headers.get("X-API-Key", "").encode(), api_key.encode()):
                    self.close_connection = True  # a client without the key keeps no connection
                    raise HTTPError(401, "wrong or missing API key (X-API-Key; TINKER_API_KEY for the SDK)")
                path = self.path.split("?", 1)[0]
                if not path.startswith("/api/v1/"):
                    raise HTTPError(404, f"{path} is not served; the API is under /api/v1/")
                self._send(200, route(path[len("/api/v1/"):]))
            except HTTPError as err:
                self._send(err.status, {"detail": str(err)})
            except (LookupError, KeyError) as err:  # an unknown model, sampler or future (a missing field: _Body)
                self._send(404, {"detail": f"{type(err).__name__}: {err}"})
            except ValueError as err:
                self._send(400, {"detail": f"{type(err).__name__}: {err}"})
            except RecursionError:  # a body nested deeper than a handler follows (JSON's parser: about 1000 deep)
                self._send(400, {"detail": "the request nests too deeply (the API's bodies nest a few levels)"})
            except (TypeError, AttributeError) as err:  # a field of another type than the API's: not retried
                traceback.print_exc(file=sys.stderr)
                self._send(400, {"detail": f"a field of the request has the wrong type ({type(err).__name__}: {err})"})
            except Exception as err:  # noqa: BLE001 - a handler's bug answers 500; the server goes on
                if type(err).__name__ == "DecodeError":  # protobuf's: a body that is not the API's message
                    self._send(400, {"detail": f"the body is not the API's protobuf message: {err}"})
                    return
                traceback.print_exc(file=sys.stderr)
                self._send(500, {"detail": f"{type(err).__name__}: {err}"})

        def _body(self) -> bytes:
            text = self.headers.get("Content-Length") or "0"
            length = int(text) if text.strip().isdigit() else -1
            if length < 0:
                raise HTTPError(400, f"Content-Length {text!r} is not a number of bytes")
            if length > MAX_BODY:
                raise HTTPError(413, f"request body of {length} bytes is over this service's {MAX_BODY}: send fewer "
                                "datums per request (the tinker SDK splits its requests in chunks of about 5 MB)")
            try:
                data = self.rfile.read(length)
            except OSError:  # silent for idle_timeout (TimeoutError), or gone: the connection ends here
                self.close_connection = True
                raise HTTPError(408, f"the body did not come: {length} bytes announced, silence for {idle_timeout} s"
                                ) from None
            self.body_read = True
            if len(data) < length:
                self.close_connection = True
                raise HTTPError(400, f"the body ended after {len(data)} of the {length} bytes of its Content-Length")
            return data

        def _body_left_unread(self) -> bool:
            """Whether the request announced a body that was not read (answered before it: a wrong key, an
            unknown route, a refused length): the connection's next bytes are that body, not the next request."""
            return not getattr(self, "body_read", True) and (self.headers.get("Content-Length") or "0").strip() != "0"

        def _json(self) -> dict:
            raw = self._body()
            try:
                body = json.loads(raw or b"{}", object_hook=_Body)
            except json.JSONDecodeError as err:
                raise HTTPError(400, f"the body is not JSON: {err}") from None
            except RecursionError:
                raise HTTPError(400, "the body nests JSON more deeply than the parser follows (about 1000 levels; the "
                                "API's bodies nest a few)") from None
            if not isinstance(body, dict):
                raise HTTPError(400, "the body must be a JSON object")
            return body

        def _get(self, path: str):
            match = re.fullmatch(r"samplers/([^/]+)", path)
            if match:
                return service.get_sampler(match.group(1))
            if path == "training_runs":
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                limit, offset = (_int(query, "limit", 20), _int(query, "offset", 0))
                return service.registry.list_runs(limit, offset)
            match = re.fullmatch(r"training_runs/([^/]+)(/checkpoints)?", path)
            if match:
                run_id = urllib.parse.unquote(match.group(1))
                registry = service.registry
                return registry.list_checkpoints(run_id) if match.group(2) else registry.training_run(run_id)
            if path == "get_server_capabilities":
                return service.get_server_capabilities()
            if path == "healthz":
                return {"status": "ok"}
            raise HTTPError(404, f"GET /api/v1/{path} is not served by llmrl's Tinker service")

        def _delete(self, path: str):
            match = re.fullmatch(r"training_runs/([^/]+)/checkpoints/(.+)", path)
            if match:
                return service.delete_checkpoint(urllib.parse.unquote(match.group(1)),
                                                 urllib.parse.unquote(match.group(2)))
            raise HTTPError(404, f"DELETE /api/v1/{path} is not served by llmrl's Tinker service")

        def _post(self, path: str):
            if path in ANSWERS:
                self._body()
                return ANSWERS[path]
            if path == "forward_backward":
                return service.forward_backward(self._body())
            if path == "retrieve_future":
                return service.retrieve_future(self._json())
            if re.fullmatch(r"sessions/[^/]+/finish", path):
                self._body()
                return {}
            if path in JSON_ROUTES:
                return getattr(service, JSON_ROUTES[path])(self._json())
            raise HTTPError(404, f"POST /api/v1/{path} is not served by llmrl's Tinker service")

        def _send(self, status: int, value) -> None:
            if isinstance(value, Outcome):
                value = value.value if value.kind != "proto" else value
            if isinstance(value, Outcome):  # protobuf bytes
                data, kind = value.value, "application/x-protobuf"
            else:
                data, kind = json.dumps(value).encode(), "application/json"
            if self._body_left_unread():
                self.close_connection = True  # the client opens a fresh connection for its next request
            try:
                self.send_response(status)
                if self.close_connection:  # told, the client does not send its next request on this one
                    self.send_header("Connection", "close")
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away, or read nothing for idle_timeout: nothing more to answer
                self.close_connection = True

    busy = json.dumps({"detail": f"the service is serving its {max_connections} connections at once: retry "
                                 "shortly"}).encode()
    return CappedHTTPServer((host, port), Handler, max_connections, busy)


def _int(query: dict, key: str, default: int) -> int:
    """A non-negative int query parameter."""
    values = query.get(key)
    if not values:
        return default
    try:
        value = int(values[0])
    except ValueError:
        raise HTTPError(400, f"query parameter {key}={values[0]!r} must be an int") from None
    if value < 0:
        raise HTTPError(400, f"query parameter {key}={value} must be >= 0")
    return value


class _Body(dict):
    """A JSON object of a request body: a field the handler needs but the request lacks is a 400 naming it (a plain
    dict's KeyError would read as an unknown model, a 404)."""

    def __missing__(self, key):
        raise HTTPError(400, f"the request has no field {key!r}")
