"""An OpenAI-compatible HTTP server around one EngineService (Starlette on uvicorn).

    engine = ServerEngine(RuntimeOptions(device="auto"))   # owns the EngineService
    server = create_server(engine, "127.0.0.1", 8080)      # binds the port now (OSError if taken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine.start_loading("demo")                           # /health shows progress; chat is 503 until ready
    engine.wait_loaded()                                   # ModelLoadedEvent, or raises ModelLoadError
    ...
    server.shutdown(); server.server_close(); engine.close()

Part of the app (`expertdesk serve`), not of the engine: it is one more front end of
`engine.service.EngineService`, like the terminal (`app.cli_chat`) and the desktop app.

Routes:

- ``GET /health`` (no key needed): 200 ``{"status": "ok", "model": NAME}`` once the model is
  loaded; before that 503 ``{"status": "loading", "progress": {done, total, detail,
  elapsed_s}}`` or, after a failed load, 503 ``{"status": "error", "error": MESSAGE}``;
- ``GET /v1/models`` and ``GET /v1/models/{id}``: the loaded model, with the extra fields
  ``is_demo``, ``architecture`` and ``context_length``;
- ``POST /v1/chat/completions``: ``messages`` (roles system/user/assistant; content a
  string or a list of ``{"type": "text"}`` parts), ``temperature``, ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``seed``, ``stop`` (string or list),
  ``stream`` (+ ``stream_options.include_usage``), and the common extensions ``top_k``,
  ``min_p``, ``repetition_penalty`` and ``chat_template_kwargs.enable_thinking``. Sampling
  fields left out take the engine's defaults (``SamplingParams``), not OpenAI's.
  ``model`` must name the loaded model (its ``/v1/models`` id or display name; another
  name is 404 ``model_not_found``, none at all is the loaded one). ``tools`` (+
  ``tool_choice`` "auto"/"none", ``tool_calls`` and ``tool`` messages in the history)
  are rendered in the model's own tool syntax and the reply's calls come back as
  ``tool_calls`` (``app.server_tools``; DeepSeek-V4 models). Parameters this server
  cannot honour are a 400 naming them, never ignored: ``n`` > 1, ``logprobs``,
  ``top_logprobs``, a ``response_format`` other than text, a forced ``tool_choice``.
  Reasoning is returned as ``reasoning_content``;
- ``POST /v1/completions`` (``app.server_completions``): ``prompt`` (one string) continued
  as it is, with the same sampling, streaming and usage as chat.

Every request is logged at INFO when it ends: method, path, status, prompt+completion
tokens and seconds (``access_line``).

Requests run one at a time in arrival order: the EngineService queues them (a second
concurrent request waits its turn; more than ``max_queued`` waiting get 429). A client
that disconnects cancels its request, streaming or not. A reply cancelled by anything
else (the server stopping) is never reported as finished: a stream ends with an error
event of code ``cancelled``, a non-streaming request gets 503.

Who gets in (docs/security.md, "The local server"): every request's ``Host`` must name
the bound address (a loopback IP or ``localhost`` on loopback) or a name given in
``allowed_hosts`` (DNS rebinding); a request with an ``Origin`` (a web page) is refused
unless that origin is in ``cors_origins``, which also answers its CORS preflight; a chat
request must be ``application/json`` (a page's "simple" text/plain POST never reaches the
engine); with ``api_key`` every ``/v1`` request needs ``Authorization: Bearer KEY``.

Limits (``ServerLimits``): the body size (413, from the Content-Length alone when it
says so), a prompt that cannot fit the context is refused before it is tokenized (400
``context_length_exceeded``), the time to send the request headers and the body (the
connection is dropped, 408), the time one write to a client may block, the number of
connections (idle ones are closed first so ``/health`` is always reachable) and of
waiting chat requests.

Errors are always ``{"error": {"message", "type", "code"}}`` with a 4xx status for a
client's mistake (400 bad JSON, HTTP or parameters, 401 key, 403 host/origin, 404, 405,
408, 413, 415, 429) and 5xx only for the server's side (500 engine error with the
engine's message, 503 not loaded yet / stopping / cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.server_params import (
    FINISH_REASONS,
    ApiError,
    check_model,
    model_id,
    parse_sampling,
    refuse_unsupported,
)
from app.server_params import short as _short
from app.server_params import unicode_text as _text
from app.server_params import usage as _usage
from app.server_tools import StreamedTools, check_tools_supported, final_message, parse_message_tools, parse_tools
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
from engine.text import ChatTemplateError, message_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """How much one client may take. Times in seconds.

    max_body_bytes: the request body (413 beyond it). header_timeout_s: from connecting (or
    the previous response) to a complete request head; the connection is closed after it.
    body_timeout_s: from the head to the complete body (408). write_timeout_s: how long one
    write may wait for a client that stopped reading (its request is cancelled).
    keep_alive_s: an idle kept-alive connection. max_connections: open connections; past it
    the longest-idle ones (no request, or a body still arriving) are closed, and a new one
    is refused only when every connection is being answered. max_queued: chat requests
    running or waiting in the engine (429 beyond). max_header_bytes: the request head.
    """

    max_body_bytes: int = 8 * 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 64
    max_queued: int = 8
    max_header_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerLimits.{item.name} must be a positive number, got {value!r}")


class ModelLoadError(RuntimeError):
    """The model could not be loaded (the message is the engine's)."""


class RemoteHostError(ValueError):
    """A non-loopback host was asked for without allow_remote."""


# --------------------------------------------------------------------------- the engine side

class ServerEngine:
    """The server's EngineService, whose events are routed to per-request listeners.

    The service's ``on_event`` is ``_route``: it runs on the engine's worker thread and
    only hands events on (to a queue, or to an event loop with call_soon_threadsafe).
    ``options`` go to the EngineService unchanged (ValueError for a device or dtype this
    machine cannot use); ``service_kwargs`` too (prefill_chunk, context_limit).
    """

    def __init__(self, options: RuntimeOptions = RuntimeOptions(), **service_kwargs: Any) -> None:
        from engine.service import EngineService

        self._lock = threading.Lock()
        self._listeners: dict[str, Callable[[Event], None]] = {}
        self.model: ModelLoadedEvent | None = None
        #: longest token of the loaded vocabulary in bytes (None when unknown): the prompt-size bound
        self.max_token_bytes: int | None = None
        self._loading: dict[str, Any] = {"state": "idle", "ref": None, "done": 0, "total": 0, "detail": "",
                                         "started": 0.0, "error": None}
        self._loaded = threading.Event()
        self._progress: Callable[[str], None] | None = None
        #: called with every engine event before its listener (app.server_metrics counts replies)
        self.observers: list[Callable[[Event], None]] = []
        self.service = EngineService(self._route, options, **service_kwargs)

    def _route(self, event: Event) -> None:
        for observer in self.observers:
            observer(event)
        rid = getattr(event, "request_id", LOAD_REQUEST_ID)  # ModelLoadedEvent answers the load
        with self._lock:
            listener = self._listeners.get(rid)
        if listener is not None:
            listener(event)

    def listen(self, rid: str, listener: Callable[[Event], None]) -> None:
        """Call `listener(event)` (on the engine's thread) for every event of request `rid`."""
        with self._lock:
            self._listeners[rid] = listener

    def unlisten(self, rid: str) -> None:
        with self._lock:
            self._listeners.pop(rid, None)

    # ---------------------------------------------------------------- loading

    def start_loading(self, ref: str, progress: Callable[[str], None] | None = None) -> None:
        """Queue loading `ref` (pack folder, GGUF file or "demo") and return at once.

        `progress(detail)` is called on the engine's thread with each step's text;
        `load_status()` and `wait_loaded()` tell how it goes.
        """
        with self._lock:
            self._loading.update(state="loading", ref=str(ref), done=0, total=0, detail="", error=None,
                                 started=time.monotonic())
            self.model = None
        self._loaded.clear()
        self._progress = progress
        self.listen(LOAD_REQUEST_ID, self._on_load_event)
        self.service.load(ref)

    def _on_load_event(self, event: Event) -> None:
        if isinstance(event, ModelLoadedEvent):
            max_bytes = _max_token_bytes(self.service)
            with self._lock:
                self.max_token_bytes = max_bytes
                self.model = event
                self._loading.update(state="ready", error=None)
        elif isinstance(event, ErrorEvent):
            with self._lock:
                self._loading.update(state="error", error=event.message)
        elif isinstance(event, PhaseEvent):
            if event.phase == "idle":
                with self._lock:
                    if self._loading["state"] == "loading":  # no ModelLoadedEvent nor ErrorEvent
                        self._loading.update(state="error", error=f"loading {self._loading['ref']} gave no model")
                self._loaded.set()
            elif event.phase == "loading":
                with self._lock:
                    self._loading.update(done=event.done, total=event.total, detail=event.detail)
                if event.detail and self._progress is not None:
                    self._progress(event.detail)

    def wait_loaded(self, timeout: float | None = None) -> ModelLoadedEvent | None:
        """The loaded model once the load has ended (ModelLoadError if it failed); None on timeout."""
        if not self._loaded.wait(timeout):
            return None
        with self._lock:
            model, error = self.model, self._loading["error"]
        if model is None:
            raise ModelLoadError(error or "no model was loaded")
        return model

    def load(self, ref: str, progress: Callable[[str], None] | None = None) -> ModelLoadedEvent:
        """Load `ref` and wait for it; raises ModelLoadError with the engine's message."""
        self.start_loading(ref, progress)
        model = self.wait_loaded()
        assert model is not None  # no timeout
        return model

    def load_status(self) -> dict[str, Any]:
        """{"state": "idle"|"loading"|"ready"|"error", "ref", "done", "total", "detail", "elapsed_s", "error"}."""
        with self._lock:
            data = dict(self._loading)
        started = data.pop("started")
        data["elapsed_s"] = round(time.monotonic() - started, 3) if started else 0.0
        return data

    def close(self) -> None:
        self.service.shutdown()


def _max_token_bytes(service: Any) -> int | None:
    """Bytes of the longest token of the service's loaded vocabulary, None when unknown.

    Every token of a prompt stands for at most this many of its UTF-8 bytes (the
    tokenizer is byte-level BPE with no normalizer, and special tokens are their text), so
    a prompt of more than context_length * this bytes cannot fit, whatever its tokens.
    """
    loaded = getattr(service, "_loaded", None)  # runs on the engine's thread, right after the load
    tokenizer = getattr(loaded, "tokenizer", None)
    if tokenizer is None:
        return None
    try:
        return max((len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)), default=None)
    except Exception:  # a bound we cannot compute is no bound, never a failed load
        log.exception("could not measure the vocabulary's longest token")
        return None


# --------------------------------------------------------------------------- request parsing

_ROLES = ("system", "user", "assistant", "tool")


def _content(message: dict, index: int) -> str:
    """The message's text (`engine.text.message_text`, the parser the chat formats use too)."""
    where = f"messages[{index}].content"
    try:
        return _text(message_text(message.get("content"), where), where)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None


def parse_chat_request(body: Any) -> tuple[GenerateRequest, bool, bool]:
    """(GenerateRequest, stream, include_usage_in_stream) from a chat.completions body; ApiError(400) if bad."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                       code="invalid_value", param="messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", code="invalid_value", param="messages")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if not isinstance(role, str) or role not in _ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {_short(role)}",
                           code="invalid_value", param="messages")
        clean.append({"role": role, "content": _content(message, i), **parse_message_tools(message, role, i)})
    refuse_unsupported(body)
    params, stream, include_usage = parse_sampling(body)
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false", code="invalid_value",
                       param="chat_template_kwargs")
    return (GenerateRequest(clean, params, thinking=thinking, tools=parse_tools(body)), stream, include_usage)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body; ApiError(400) for anything that is not strict UTF-8 JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply",
                       code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, an integer of too many digits, NaN/Infinity
        raise ApiError(400, f"the request body is not valid JSON: {_short(str(exc), 200)}",
                       code="invalid_json") from None


def check_prompt_size(request: GenerateRequest, model: ModelLoadedEvent, max_token_bytes: int | None) -> None:
    """ApiError(400, context_length_exceeded) when the messages cannot fit the context, before any tokenizing.

    No token stands for more than `max_token_bytes` bytes of text, so a prompt holding more
    than context_length * max_token_bytes bytes has more tokens than the context holds. The
    engine still checks the exact token count of what passes.
    """
    if not max_token_bytes:
        return
    limit = model.context_length * max_token_bytes
    # Everything the chat format renders into the prompt counts: the messages' text, the
    # tool declarations and earlier calls' names and arguments (as JSON: what is rendered
    # is at least that long).
    parts = [m["content"] for m in request.messages]
    parts += [json.dumps(t, ensure_ascii=False) for t in request.tools or ()]
    parts += [json.dumps(call, ensure_ascii=False) for m in request.messages for call in m.get("tool_calls") or ()]
    size = 0
    for part in parts:
        size += len(part.encode("utf-8"))
        if size > limit:
            raise ApiError(
                400, f"the messages hold more than {limit} bytes of text: {model.model_name} holds "
                f"{model.context_length} tokens of context and none of its tokens is longer than {max_token_bytes} "
                "bytes, so they cannot fit; start a new conversation or remove earlier messages",
                code="context_length_exceeded")


def _engine_error(event: ErrorEvent) -> ApiError:
    if event.kind == "context_full":
        return ApiError(400, event.message, "invalid_request_error", "context_length_exceeded")
    if event.kind == "bad_request":  # the chat format refused this conversation: the client's to change
        return ApiError(400, event.message, "invalid_request_error", "unsupported_request")
    return ApiError(500, event.message, "server_error", event.kind)


# --------------------------------------------------------------------------- who may connect

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


def check_api_key(key: str | None) -> str | None:
    """`key` if usable as a bearer token (None: no key); ValueError for "" or odd characters."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError("api_key is empty: give a key (e.g. from `openssl rand -hex 16`), or leave it out for "
                         "no key; an empty value is refused so that an unset variable never means 'no key'")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("api_key must be printable ASCII without spaces (it travels in an HTTP header)")
    return key


def normalize_origin(origin: str) -> str:
    """A browser origin, as browsers send it ("http://localhost:3000"); ValueError if it is not one."""
    text = origin.strip()
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or port == -1 \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{origin!r} is not a web origin: give scheme://host[:port], e.g. http://localhost:3000 "
                         "(no path, no wildcard)")
    scheme, host = parts.scheme.lower(), parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or (scheme, port) in (("http", 80), ("https", 443)):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def check_host_name(name: str) -> str:
    """`name` in lower case if it is a bare host name (for allowed_hosts); ValueError if not."""
    text = name.strip().lower()
    if not text or any(c in text for c in " /:@[]") or not text.isascii():
        raise ValueError(f"{name!r} is not a host name: give a bare name such as mybox.lan (no port, no scheme)")
    return text


def _host_name(value: str) -> str | None:
    """The host part of a Host header value (lower case), None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
        rest = ":" + port
    elif ":" in value:
        return None
    else:
        name, rest = value, ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and rest[1:].isascii()):
        return None
    return name or None


class _HostPolicy:
    """Which Host headers name this server: see docs/security.md, "The local server"."""

    def __init__(self, bound_host: str, allowed_hosts: Iterable[str]) -> None:
        self.loopback_only = is_loopback(bound_host)
        names = {"localhost", *(check_host_name(h) for h in allowed_hosts)}
        try:
            ipaddress.ip_address(bound_host)
        except ValueError:
            names.add(bound_host.lower())
        self.names = frozenset(names)

    def allows(self, header: str) -> bool:
        name = _host_name(header)
        if name is None:
            return False
        if name in self.names:
            return True
        try:
            address = ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            return False  # a DNS name nobody allowed: what a rebinding page sends
        return address.is_loopback or not self.loopback_only


_PREFLIGHT_HEADERS = "authorization, content-type"
ACCESS_KEY = "expertdesk.access"  # the scope key of a request's access-log facts


def access_line(method: str, path: str, access: dict[str, Any], seconds: float) -> str:
    """One access-log line: method, path, status, tokens (prompt+completion) and time."""
    tokens = access.get("tokens")
    told = f"{tokens[0]}+{tokens[1]} tokens" if tokens else "- tokens"
    stop = f" ({access['stop']})" if access.get("stop") not in (None, "eos") else ""
    return f"{method} {path[:200]} {access.get('status', '-')} {told}{stop} {seconds:.3f} s"


class _Guard:
    """ASGI middleware in front of the routes: Host and Origin checks, CORS, one path form, a log line."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], hosts: _HostPolicy,
                 cors_origins: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts
        self.cors_origins = cors_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        origins = [v for k, v in scope["headers"] if k == b"origin"]
        method = scope["method"]
        if len(hosts) != 1 or not self.hosts.allows(hosts[0].decode("latin-1")):
            given = hosts[0].decode("latin-1")[:100] if hosts else "none"
            error = ApiError(403, f"Host {given!r} is not this server's address: use 127.0.0.1 or localhost, or "
                                  "start the server with --allow-host NAME for another name (this check stops "
                                  "DNS-rebinding web pages)", "invalid_request_error", "host_not_allowed", close=True)
            return await _send_error(send, error, method)
        origin = None
        if origins:
            origin = origins[0].decode("latin-1").strip().lower()
            if len(origins) != 1 or origin not in self.cors_origins:
                error = ApiError(403, f"requests from web pages (Origin {origin[:100]!r}) are refused; start the "
                                      "server with --cors-origin ORIGIN to let that page use it",
                                 "invalid_request_error", "origin_not_allowed", close=True)
                return await _send_error(send, error, method)
            if method == "OPTIONS":
                return await self._preflight(scope, send, origin)
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}

        started = time.monotonic()
        access: dict[str, Any] = {}  # the routes add what they know (tokens) under ACCESS_KEY
        scope = {**scope, ACCESS_KEY: access}

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                if origin is not None:
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
                access["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            log.info("%s", access_line(method, scope["path"], access, time.monotonic() - started))

    async def _preflight(self, scope: Scope, send: Send, origin: str) -> None:
        requested = next((v for k, v in scope["headers"] if k == b"access-control-request-headers"), b"")
        names = [n.strip() for n in requested.decode("latin-1").split(",") if n.strip()]
        allowed = ", ".join(n for n in names if n.replace("-", "").isalnum() and n.isascii()) or _PREFLIGHT_HEADERS
        headers = [*_cors_headers(origin), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                   (b"access-control-allow-headers", allowed.encode("latin-1")),
                   (b"access-control-max-age", b"600"), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _send_json(send: Send, status: int, data: Any, headers: dict[str, str] | None = None,
                     method: str = "GET") -> None:
    payload = json.dumps(data, ensure_ascii=False).encode("utf-8")
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else payload})


async def _send_error(send: Send, error: ApiError, method: str = "GET") -> None:
    await _send_json(send, error.status, error.body(), error.headers, method)


# --------------------------------------------------------------------------- the HTTP side

class _State:
    """What the routes share: the engine, the key, the limits, the replies in progress."""

    def __init__(self, engine: ServerEngine, api_key: str | None, limits: ServerLimits) -> None:
        self.engine = engine
        self.api_key = api_key
        self.limits = limits
        self.stopping = False
        self._lock = threading.Lock()
        self.replies: dict[str, _Reply] = {}

    def admit(self, reply: _Reply) -> None:
        with self._lock:
            if self.stopping:
                raise ApiError(503, "the server is stopping", "server_error", "server_stopping")
            if len(self.replies) >= self.limits.max_queued:
                raise ApiError(429, f"the server is busy: {len(self.replies)} requests are running or waiting "
                                    f"(the limit is {self.limits.max_queued}); try again shortly",
                               "server_error", "server_busy", {"Retry-After": "5"})
            self.replies[reply.rid] = reply

    def release(self, reply: _Reply) -> None:
        with self._lock:
            self.replies.pop(reply.rid, None)

    def stop_all(self) -> None:
        """Refuse new chat requests and cancel those in progress (any thread)."""
        with self._lock:
            self.stopping = True
            rids = list(self.replies)
        for rid in rids:
            self.engine.service.cancel(rid)

    def busy(self) -> bool:
        with self._lock:
            return bool(self.replies)


class _Reply:
    """One request submitted to the engine, its events delivered on the event loop."""

    def __init__(self, state: _State, request: GenerateRequest) -> None:
        self.state = state
        self.request = request
        self.rid = request.request_id
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.client_gone = False
        self.finished = False
        self.cancelled = False

    def _put(self, event: Event) -> None:  # on the engine's thread
        if isinstance(event, (TokenEvent, DoneEvent, ErrorEvent)):
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def submit(self) -> None:
        self.state.engine.listen(self.rid, self._put)
        self.state.engine.service.submit(self.request)

    async def next(self) -> TokenEvent | DoneEvent | ErrorEvent:
        event = await self.events.get()
        if isinstance(event, (DoneEvent, ErrorEvent)):
            self.finished = True
        return event  # type: ignore[return-value]

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self.state.engine.service.cancel(self.rid)

    def close(self) -> None:
        self.cancel()
        self.state.engine.unlisten(self.rid)

    async def watch_disconnect(self, receive: Receive) -> None:
        """Wait for the client to go away, then cancel (the request's body is already read)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self.client_gone = True
        self.cancel()


def _check_key(state: _State, request: Request) -> None:
    key = state.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                                             key.encode("utf-8")):
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                       "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"}, close=True)


def _ready_model(state: _State) -> ModelLoadedEvent:
    model = state.engine.model
    if model is not None:
        return model
    status = state.engine.load_status()
    if status["state"] == "loading":
        detail = f" ({status['detail']})" if status["detail"] else ""
        raise ApiError(503, f"the model is still loading{detail}; GET /health shows the progress", "server_error",
                       "model_loading", {"Retry-After": "2"}, close=True)
    reason = f": {status['error']}" if status.get("error") else ""
    raise ApiError(503, f"no model is loaded{reason}", "server_error", "no_model", close=True)


def _model_card(model: ModelLoadedEvent) -> dict:
    return {"id": model_id(model), "object": "model", "created": 0, "owned_by": "expertdesk",
            "name": model.model_name, "is_demo": model.is_demo, "architecture": model.architecture,
            "context_length": model.context_length}


def _endpoint(handler: Callable[[_State, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A route whose ApiErrors (and bugs, as 500) become OpenAI-style JSON responses."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request.app.state.server, request)
        except ApiError as error:
            return error.response()
        except ClientDisconnect:
            return Response(status_code=400, headers={"Connection": "close"})  # nobody is there to read it
        except Exception as exc:  # a bug: answer 500 rather than dropping the connection
            log.exception("request %s %s failed", request.method, request.url.path)
            return ApiError(500, f"internal server error ({type(exc).__name__}: {exc})", "server_error",
                            "internal", close=True).response()

    return endpoint


async def _health(state: _State, request: Request) -> Response:
    model = state.engine.model
    if model is not None:
        return JSONResponse({"status": "ok", "model": model.model_name})
    status = state.engine.load_status()
    if status["state"] == "loading":
        progress = {k: status[k] for k in ("done", "total", "detail", "elapsed_s")}
        return JSONResponse({"status": "loading", "model": None, "progress": progress}, 503, {"Retry-After": "2"})
    if status["state"] == "error":
        return JSONResponse({"status": "error", "model": None, "error": status["error"]}, 503)
    return JSONResponse({"status": "no_model", "model": None}, 503)


async def _models(state: _State, request: Request) -> Response:
    _check_key(state, request)
    return JSONResponse({"object": "list", "data": [_model_card(_ready_model(state))]})


async def _model(state: _State, request: Request) -> Response:
    _check_key(state, request)
    card = _model_card(_ready_model(state))
    wanted = request.path_params["model_id"]
    if not {wanted, unquote(wanted)} & {card["id"], card["name"]}:
        raise ApiError(404, f"no model {wanted[:200]!r}; this server has {card['id']!r}", code="model_not_found")
    return JSONResponse(card)


def _require_json(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise ApiError(415, f"the body must be JSON sent as 'Content-Type: application/json', not "
                            f"{content_type[:100] or 'no Content-Type'!r}", code="unsupported_media_type", close=True)


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    limit = limits.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {length} bytes; the limit is {limit}", code="request_too_large",
                       close=True)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large",
                               close=True)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout", close=True) from None


async def read_generation_request(state: _State, request: Request) -> tuple[ModelLoadedEvent, Any]:
    """(the loaded model, the JSON body) of a request that generates: key, JSON, model ready, body read."""
    _check_key(state, request)
    _require_json(request)
    model = _ready_model(state)
    return model, parse_json_body(await _read_body(request, state.limits))


async def _chat_completions(state: _State, request: Request) -> Response:
    model, body = await read_generation_request(state, request)
    chat, stream, include_usage = parse_chat_request(body)
    check_model(body, model)
    check_tools_supported(chat, model)
    check_prompt_size(chat, model, state.engine.max_token_bytes)
    return _ChatResponse(state, chat, model_id(model), stream, include_usage)


class _ChatResponse(Response):
    """Runs one chat request in the engine while it answers: JSON, or SSE chunks.

    The client's disconnect cancels the engine's job; so does a write that waits longer
    than write_timeout_s. A reply the engine cancelled for another reason is an error.
    """

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, state: _State, request: GenerateRequest, model: str, stream: bool, include_usage: bool):
        self.state, self.chat, self.model = state, request, model
        self.stream, self.include_usage = stream, include_usage
        self.status_code = 200
        self.background = None
        self.cid = f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.access: dict[str, Any] = {}
        self.tools = StreamedTools() if request.tools else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.access = scope.get(ACCESS_KEY, self.access)
        reply = _Reply(self.state, self.chat)
        try:
            self.state.admit(reply)
        except ApiError as error:
            return await _send_error(send, error)
        try:
            reply.submit()
        except RuntimeError:  # the engine was shut down: the server is stopping
            self.state.release(reply)
            self.state.engine.unlisten(reply.rid)
            return await _send_error(send, ApiError(503, "the server is stopping", "server_error", "server_stopping"))
        watcher = asyncio.ensure_future(reply.watch_disconnect(receive))
        try:
            if self.stream:
                await self._stream(reply, send)
            else:
                await self._complete(reply, send)
        except _ClientStalled:
            log.warning("a client stopped reading its stream for %g s: its request was cancelled",
                        self.state.limits.write_timeout_s)
        finally:
            watcher.cancel()
            reply.close()
            self.state.release(reply)

    def _cancelled_error(self) -> ApiError:
        why = "the server is stopping" if self.state.stopping else "the server cancelled it"
        return ApiError(503, f"the reply was cut short before it finished: {why}", "server_error", "cancelled")

    # ---------------------------------------------------------------- what the client is sent

    def _envelope(self, kind: str, choice: dict | None, **extra: Any) -> dict:
        """A response object around one choice (None: no choices, the usage chunk)."""
        return {"id": self.cid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": [] if choice is None else [{"index": 0, **choice}], **extra}

    def _body(self, event: DoneEvent) -> dict:
        """The JSON of a finished reply."""
        message, called = final_message(event.text, event.reasoning, self.chat.tools is not None)
        finish = "tool_calls" if called else FINISH_REASONS[event.stats.stop_reason]
        return self._envelope(self.OBJECT, {"message": message, "logprobs": None, "finish_reason": finish},
                              usage=_usage(event.stats))

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        return self._envelope(self.CHUNK_OBJECT, {"delta": delta, "logprobs": None, "finish_reason": finish})

    def _opening(self) -> list[dict]:
        """The chunks before the first token."""
        return [self._chunk({"role": "assistant", "content": ""})]

    def _token_chunks(self, event: TokenEvent) -> list[dict]:
        if event.reasoning:
            return [self._chunk({"reasoning_content": event.text})]
        text = self.tools.feed(event.text) if self.tools is not None else event.text
        return [self._chunk({"content": text})] if text else []

    def _closing(self, event: DoneEvent) -> list[dict]:
        """The chunks of a reply that finished: held-back text and tool calls, then the finish reason."""
        deltas, called = self.tools.finish() if self.tools is not None else ([], False)
        finish = "tool_calls" if called else FINISH_REASONS[event.stats.stop_reason]
        return [*(self._chunk(d) for d in deltas), self._chunk({}, finish)]

    def _note(self, event: DoneEvent | ErrorEvent) -> None:
        """What the access log line says about the reply."""
        if isinstance(event, DoneEvent):
            self.access["tokens"] = (event.stats.prompt_tokens, event.stats.completion_tokens)
            self.access["stop"] = event.stats.stop_reason

    async def _complete(self, reply: _Reply, send: Send) -> None:
        while True:
            event = await reply.next()
            if isinstance(event, (DoneEvent, ErrorEvent)):
                break
        self._note(event)
        if reply.client_gone:
            return  # nobody to answer
        if isinstance(event, ErrorEvent):
            return await _send_error(send, _engine_error(event))
        if event.stats.stop_reason not in FINISH_REASONS:
            return await _send_error(send, self._cancelled_error())
        await _send_json(send, 200, self._body(event))

    async def _stream(self, reply: _Reply, send: Send) -> None:
        # Wait for the first event before the headers, so an error before any text (e.g. a
        # prompt larger than the context) still gets its proper HTTP status.
        event = await reply.next()
        if reply.client_gone:
            return
        if isinstance(event, ErrorEvent):
            return await _send_error(send, _engine_error(event))
        if isinstance(event, DoneEvent) and event.stats.stop_reason not in FINISH_REASONS:
            self._note(event)
            return await _send_error(send, self._cancelled_error())
        timeout = self.state.limits.write_timeout_s

        async def write(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                reply.client_gone = True  # it stopped reading: treat it as gone
                reply.cancel()
                raise _ClientStalled from None

        async def data(payload: Any) -> None:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            await write({"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True})

        await write({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        for chunk in self._opening():
            await data(chunk)
        while True:
            if reply.client_gone:
                while not reply.finished:  # drain until the engine confirms the cancel
                    event = await reply.next()
                if isinstance(event, DoneEvent):
                    self._note(event)
                return
            if isinstance(event, TokenEvent):
                for chunk in self._token_chunks(event):
                    await data(chunk)
            elif isinstance(event, DoneEvent):
                self._note(event)
                if event.stats.stop_reason in FINISH_REASONS:
                    for chunk in self._closing(event):
                        await data(chunk)
                    if self.include_usage:
                        await data(self._envelope(self.CHUNK_OBJECT, None, usage=_usage(event.stats)))
                else:
                    await data(self._cancelled_error().body())
                break
            elif isinstance(event, ErrorEvent):
                await data(_engine_error(event).body())
                break
            event = await reply.next()
        await data("[DONE]")
        await write({"type": "http.response.body", "body": b"", "more_body": False})


class _ClientStalled(Exception):
    """A client stopped reading its stream; uvicorn closes the connection."""


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 404:
        return ApiError(404, f"unknown route {request.method} {path[:200]}; this server has GET /health, "
                             "GET /v1/models, POST /v1/chat/completions and POST /v1/completions",
                        code="not_found").response()
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return ApiError(405, f"{path[:200]} takes {allow}, not {request.method}", code="method_not_allowed",
                        headers={"Allow": allow}).response()
    return ApiError(exc.status_code, str(exc.detail), code="http_error").response()


def build_app(state: _State, hosts: _HostPolicy, cors_origins: frozenset[str]) -> _Guard:
    """The ASGI application: the guard in front of Starlette's routes."""
    from app.server_completions import completions  # it builds on this module's chat response
    from app.server_metrics import ServerMetrics

    metrics = ServerMetrics(state.engine)
    app = Starlette(routes=[
        Route("/metrics", _endpoint(metrics.endpoint), methods=["GET"]),
        Route("/health", _endpoint(_health), methods=["GET"]),
        Route("/v1/models", _endpoint(_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint(_model), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(_chat_completions), methods=["POST"]),
        Route("/v1/completions", _endpoint(completions), methods=["POST"]),
    ], exception_handlers={HTTPException: _http_error})
    app.state.server = state
    return _Guard(app, hosts, cors_origins)


# --------------------------------------------------------------------------- connections

class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits a slow or flooding client needs.

    - a request head must be complete header_timeout_s after connecting (or after the
      previous response), else the connection is closed (uvicorn has no such timer: an
      idle new connection would stay open for ever);
    - at most max_connections: past it the longest-idle connections (no request, or a body
      still arriving) are closed; a new one is refused only when all are being answered;
    - a malformed request gets an OpenAI-style JSON 400, not uvicorn's text/plain one.
    """

    limits: ServerLimits  # set by create_server on a subclass

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = time.monotonic()
        super().connection_made(transport)
        self._arm_header_timer()
        self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_request():
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = time.monotonic()
        if self._waiting_for_request():
            self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        payload = json.dumps(ApiError(400, f"bad HTTP request: {msg}", code="bad_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        try:
            output = self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
            output += self.conn.send(h11.Data(data=payload))
            output += self.conn.send(h11.EndOfMessage())
            self.transport.write(output)
        except h11.LocalProtocolError:  # a response is under way: nothing valid can be said any more
            pass
        self.transport.close()

    # ---------------------------------------------------------------- helpers

    def _waiting_for_request(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _evictable(self) -> bool:
        """Idle, or still receiving (a request whose body is arriving has taken nothing yet)."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._waiting_for_request():
            self._drop()

    def _drop(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        connections = [c for c in self.connections if isinstance(c, _Protocol) and not c.transport.is_closing()]
        excess = len(connections) - self.limits.max_connections
        if excess <= 0:
            return
        idle = sorted((c for c in connections if c is not self and c._evictable()), key=lambda c: c._idle_since)
        for victim in idle[:excess]:
            victim._drop()
        if len(idle) < excess:
            log.warning("refusing a connection: %d connections are being answered", len(connections) - 1)
            self._drop()


# --------------------------------------------------------------------------- the server

class OpenAIServer:
    """The bound socket and the uvicorn server on it; the socketserver-like surface the CLI and tests use."""

    def __init__(self, sock: socket.socket, state: _State, app: _Guard, limits: ServerLimits) -> None:
        self.socket = sock
        self.state = state
        self.engine = state.engine
        self.api_key = state.api_key
        self.server_address = sock.getsockname()
        protocol = type("ExpertDeskProtocol", (_Protocol,), {"limits": limits})
        config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", interface="asgi3", log_config=None,
                                access_log=False, proxy_headers=False, server_header=False,
                                timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                                timeout_graceful_shutdown=5, h11_max_incomplete_event_size=limits.max_header_bytes)
        self._server = uvicorn.Server(config)
        self._started = threading.Event()
        self._finished = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve on this thread (its own event loop) until shutdown()."""
        self._started.set()
        try:
            if not self._server.should_exit:
                asyncio.run(self._server.serve(sockets=[self.socket]))
        finally:
            self._finished.set()

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop serving: cancel the replies in progress (their clients are told), close, wait for serve_forever."""
        self.state.stop_all()
        deadline = time.monotonic() + timeout
        while self.state.busy() and time.monotonic() < deadline - 5:
            time.sleep(0.05)  # the cancelled replies tell their clients
        self._server.should_exit = True
        if self._started.is_set():
            self._finished.wait(max(0.0, deadline - time.monotonic()))

    def server_close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.close()


def create_server(engine: ServerEngine, host: str = "127.0.0.1", port: int = 8080, *, api_key: str | None = None,
                  allow_remote: bool = False, cors_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = (),
                  limits: ServerLimits | None = None, **limit_values: Any) -> OpenAIServer:
    """Bind (not yet serving) an OpenAIServer; port 0 picks a free port (see server.url).

    RemoteHostError for a non-loopback host without allow_remote, ValueError for an empty
    or unusable api_key, an origin that is not one or a bad host name, OSError when the
    address cannot be bound. `limit_values` override fields of `limits` (ServerLimits).
    """
    check_host(host, allow_remote)
    key = check_api_key(api_key)
    origins = frozenset(normalize_origin(o) for o in cors_origins)
    hosts = _HostPolicy(host, allowed_hosts)
    limits = replace(limits or ServerLimits(), **limit_values)
    limits = replace(limits, max_connections=_connection_cap(limits.max_connections))
    state = _State(engine, key, limits)
    app = build_app(state, hosts, origins)
    sock = _bind(host, port)
    return OpenAIServer(sock, state, app, limits)


def _connection_cap(wanted: int) -> int:
    """`wanted`, lowered so that connections can never use up this process's file descriptors."""
    try:
        import resource
    except ImportError:  # Windows: no per-process descriptor limit to respect
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(4, min(wanted, (soft - 64) // 2))  # the model's files, the engine and the log need some


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if sys.platform != "win32":  # on Windows SO_REUSEADDR would let another process take the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
