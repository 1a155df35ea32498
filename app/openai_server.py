"""An OpenAI-compatible HTTP server around one EngineService (standard library only).

    engine = ServerEngine(RuntimeOptions(device="auto"))  # owns the EngineService
    loaded = engine.load("demo")                    # ModelLoadedEvent, or raises ModelLoadError
    server = create_server(engine, "127.0.0.1", 8080, api_key=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ...
    server.shutdown(); server.server_close(); engine.close()

Part of the app (`expertdesk serve`), not of the engine: it is one more front end of
`engine.service.EngineService`, like the terminal (`app.cli_chat`) and the desktop app.

Routes:

- ``GET /health``: ``{"status": "ok", "model": NAME}`` (no key needed);
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the loaded model, with the extra fields
  ``is_demo``, ``architecture`` and ``context_length``;
- ``POST /v1/chat/completions``: ``messages`` (roles system/user/assistant; content a
  string or a list of ``{"type": "text"}`` parts), ``temperature``, ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``seed``, ``stop`` (string or list),
  ``stream`` (+ ``stream_options.include_usage``), and the common extensions ``top_k``,
  ``min_p``, ``repetition_penalty`` and ``chat_template_kwargs.enable_thinking``. Sampling
  fields left out take the engine's defaults (``SamplingParams``), not OpenAI's.
  ``model`` is accepted and ignored (there is one model); ``n`` must be 1; other
  unknown fields are ignored. Reasoning is returned as ``reasoning_content``.

Requests run one at a time in arrival order: the EngineService queues them (a second
concurrent request waits its turn). A client that disconnects mid-stream cancels its
request. Errors are ``{"error": {"message", "type", "code"}}``: 400 bad JSON or
parameters (and a prompt larger than the context, code ``context_length_exceeded``),
401 missing/wrong bearer key when a key is set, 404 unknown route, 405 wrong method,
413 body too large, 500 engine error with the engine's message.

The server is meant for 127.0.0.1: ``create_server`` refuses a non-loopback host unless
``allow_remote=True``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.options import RuntimeOptions
from engine.service_events import (
    LOAD_REQUEST_ID,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    ModelLoadedEvent,
    PhaseEvent,
    TokenEvent,
)
from engine.text import ChatTemplateError, SamplingParams, message_text

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20

#: our stop reasons -> OpenAI finish_reason
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length", "cancelled": "stop",
                  "context_full": "length"}


class ModelLoadError(RuntimeError):
    """The model could not be loaded (the message is the engine's)."""


class RemoteHostError(ValueError):
    """A non-loopback host was asked for without allow_remote."""


class ApiError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = int(status), message, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


# --------------------------------------------------------------------------- the engine side

class ServerEngine:
    """The server's EngineService, whose events are routed to per-request queues.

    The service's ``on_event`` is ``_route``: it runs on the engine's worker thread and
    only puts events on queues. ``options`` go to the EngineService unchanged (ValueError
    for a device or dtype this machine cannot use); ``service_kwargs`` too
    (prefill_chunk, context_limit).
    """

    def __init__(self, options: RuntimeOptions = RuntimeOptions(), **service_kwargs: Any) -> None:
        from engine.service import EngineService

        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}
        self.model: ModelLoadedEvent | None = None
        self.service = EngineService(self._route, options, **service_kwargs)

    def _route(self, event: Event) -> None:
        rid = getattr(event, "request_id", LOAD_REQUEST_ID)  # ModelLoadedEvent answers the load
        with self._lock:
            target = self._queues.get(rid)
        if target is not None:
            target.put(event)

    def _open(self, rid: str) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._queues[rid] = q
        return q

    def _close(self, rid: str) -> None:
        with self._lock:
            self._queues.pop(rid, None)

    def load(self, ref: str, progress: Callable[[str], None] | None = None) -> ModelLoadedEvent:
        """Load `ref` (pack folder, GGUF file or "demo"); raises ModelLoadError with the engine's message."""
        q = self._open(LOAD_REQUEST_ID)
        loaded: ModelLoadedEvent | None = None
        error: ErrorEvent | None = None
        try:
            self.service.load(ref)
            while True:
                event = q.get()
                if isinstance(event, ModelLoadedEvent):
                    loaded = event
                elif isinstance(event, ErrorEvent):
                    error = event
                elif isinstance(event, PhaseEvent):
                    if event.phase == "idle":
                        break
                    if event.phase == "loading" and event.detail and progress is not None:
                        progress(event.detail)
        finally:
            self._close(LOAD_REQUEST_ID)
        if loaded is None:
            raise ModelLoadError(error.message if error is not None else f"loading {ref} gave no model")
        self.model = loaded
        return loaded

    def run(self, request: GenerateRequest, poll_s: float = 0.5) -> Iterator[TokenEvent | DoneEvent | ErrorEvent]:
        """Submit `request`; yield its TokenEvents, then exactly one DoneEvent or ErrorEvent.

        Closing the generator early (the client went away) cancels the request.
        """
        rid = request.request_id
        q = self._open(rid)
        finished = False
        try:
            self.service.submit(request)
            while True:
                try:
                    event = q.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if isinstance(event, TokenEvent):
                    yield event
                elif isinstance(event, (DoneEvent, ErrorEvent)):
                    finished = True
                    yield event
                    return
        finally:
            if not finished:
                self.service.cancel(rid)
            self._close(rid)

    def close(self) -> None:
        self.service.shutdown()


# --------------------------------------------------------------------------- request parsing

_ROLES = ("system", "user", "assistant")


def _number(body: dict, key: str, *, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}",
                       code="invalid_value")
    return value


def _content(message: dict, index: int) -> str:
    """The message's text (`engine.text.message_text`, the parser the chat formats use too)."""
    try:
        return message_text(message.get("content"), f"messages[{index}].content")
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None


def parse_chat_request(body: Any) -> tuple[GenerateRequest, bool, bool]:
    """(GenerateRequest, stream, include_usage_in_stream) from a chat.completions body; ApiError(400) if bad."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                       code="invalid_value")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", code="invalid_value")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                           code="invalid_value")
        clean.append({"role": role, "content": _content(message, i)})
    n = _number(body, "n", integer=True)
    if n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", code="invalid_value")
    max_tokens = _number(body, "max_completion_tokens", integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", code="invalid_value")
    values = {
        "temperature": _number(body, "temperature"), "top_p": _number(body, "top_p"),
        "top_k": _number(body, "top_k", integer=True), "min_p": _number(body, "min_p"),
        "repetition_penalty": _number(body, "repetition_penalty"), "max_tokens": max_tokens,
        "seed": _number(body, "seed", integer=True), "stop": tuple(s for s in stop if s) if stop else None,
    }
    try:
        params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", code="invalid_value")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", code="invalid_value")
    return GenerateRequest(clean, params, thinking=thinking), stream, include_usage


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def _engine_error(event: ErrorEvent) -> ApiError:
    if event.kind == "context_full":
        return ApiError(400, event.message, "invalid_request_error", "context_length_exceeded")
    return ApiError(500, event.message, "server_error", event.kind)


# --------------------------------------------------------------------------- HTTP

class OpenAIServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the ServerEngine and the API key for its handlers."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], engine: ServerEngine, api_key: str | None) -> None:
        self.engine = engine
        self.api_key = api_key
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"


class _OpenAIServer6(OpenAIServer):
    address_family = socket.AF_INET6


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_host(host: str, allow_remote: bool) -> None:
    """Raise RemoteHostError for a non-loopback host unless allow_remote."""
    if not allow_remote and not is_loopback(host):
        raise RemoteHostError(
            f"refusing to listen on {host!r}: it is not a loopback address, so other machines could use this "
            "model (and your GPU) without asking. Use 127.0.0.1, or pass --allow-remote (ideally with --api-key) "
            "if you really want that")


def create_server(engine: ServerEngine, host: str = "127.0.0.1", port: int = 8080, *, api_key: str | None = None,
                  allow_remote: bool = False) -> OpenAIServer:
    """Bind (not yet serving) an OpenAIServer; port 0 picks a free port (see server.url)."""
    check_host(host, allow_remote)
    cls = _OpenAIServer6 if ":" in host else OpenAIServer
    return cls((host, port), engine, api_key or None)


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIServer
    protocol_version = "HTTP/1.1"
    server_version = "ExpertDesk"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        log.info("%s %s", self.address_string(), format % args)

    # ---------------------------------------------------------------- plumbing

    def _send_json(self, status: int, data: dict, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(data).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, error.body(), error.headers)

    def _check_key(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self.close_connection = True
            raise ApiError(400, "the request needs a Content-Length header and a JSON body")
        size = int(length)
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"the request body is {size} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(size)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _dispatch(self, method: str) -> None:
        try:
            path = self._path()
            routes = {"/health": ("GET",), "/v1/models": ("GET",), "/v1/chat/completions": ("POST",)}
            allowed = routes.get(path, ("GET",) if path.startswith("/v1/models/") else None)
            if allowed is None:
                if method == "POST":
                    self._discard_body()
                raise ApiError(404, f"unknown route {method} {path}; this server has GET /health, GET /v1/models "
                                    "and POST /v1/chat/completions", code="not_found")
            if method not in allowed:
                if method == "POST":
                    self._discard_body()
                raise ApiError(405, f"{path} takes {', '.join(allowed)}, not {method}", code="method_not_allowed",
                               headers={"Allow": ", ".join(allowed)})
            if path == "/health":
                model = self.server.engine.model
                self._send_json(200, {"status": "ok", "model": model.model_name if model else None})
                return
            self._check_key()
            if path == "/v1/chat/completions":
                self._chat_completions()
            elif path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self._model_card()]})
            else:
                card = self._model_card()
                wanted = path[len("/v1/models/"):]
                if wanted != card["id"]:
                    from urllib.parse import unquote

                    if unquote(wanted) != card["id"]:
                        raise ApiError(404, f"no model {wanted!r}; this server has {card['id']!r}",
                                       code="model_not_found")
                self._send_json(200, card)
        except ApiError as error:
            if method == "POST" and error.status == 401:
                self._discard_body()
            self._send_error(error)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug: answer 500 rather than dropping the connection
            log.exception("request %s %s failed", method, self.path)
            self._send_error(ApiError(500, f"internal server error ({type(exc).__name__}: {exc})", "server_error",
                                      "internal"))

    def _discard_body(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.strip().isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    # ---------------------------------------------------------------- routes

    def _model_card(self) -> dict:
        model = self.server.engine.model
        if model is None:
            raise ApiError(503, "no model is loaded", "server_error", "no_model")
        return {"id": model.model_name, "object": "model", "created": 0, "owned_by": "expertdesk",
                "is_demo": model.is_demo, "architecture": model.architecture,
                "context_length": model.context_length}

    def _chat_completions(self) -> None:
        body = self._read_json()
        request, stream, include_usage = parse_chat_request(body)
        model = self._model_card()["id"]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        events = self.server.engine.run(request)
        try:
            if stream:
                self._stream(events, cid, created, model, include_usage)
            else:
                self._complete(events, cid, created, model)
        finally:
            events.close()  # cancels the request if it has not finished (client gone)

    def _complete(self, events: Iterator, cid: str, created: int, model: str) -> None:
        end = None
        for event in events:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                end = event
        if isinstance(end, ErrorEvent) or end is None:
            raise _engine_error(end) if end is not None else ApiError(500, "no reply", "server_error", "internal")
        message: dict[str, Any] = {"role": "assistant", "content": end.text}
        if end.reasoning:
            message["reasoning_content"] = end.reasoning
        self._send_json(200, {
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": FINISH_REASONS.get(end.stats.stop_reason, "stop")}],
            "usage": _usage(end.stats), "system_fingerprint": None,
        })

    def _stream(self, events: Iterator, cid: str, created: int, model: str, include_usage: bool) -> None:
        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        # Wait for the first event before the headers, so an error before any text (e.g. a
        # prompt larger than the context) still gets its proper HTTP status.
        first = next(events)
        if isinstance(first, ErrorEvent):
            raise _engine_error(first)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            self.wfile.write(f"data: {text}\n\n".encode("utf-8"))
            self.wfile.flush()

        send(chunk({"role": "assistant", "content": ""}))
        event = first
        while True:
            if isinstance(event, TokenEvent):
                send(chunk({"reasoning_content": event.text} if event.reasoning else {"content": event.text}))
            elif isinstance(event, DoneEvent):
                send(chunk({}, FINISH_REASONS.get(event.stats.stop_reason, "stop")))
                if include_usage:
                    send({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": [], "usage": _usage(event.stats)})
                break
            elif isinstance(event, ErrorEvent):
                send(_engine_error(event).body())
                break
            event = next(events)
        send("[DONE]")
