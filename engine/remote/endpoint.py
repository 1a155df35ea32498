"""Where a remote model lives and what went wrong talking to it (no I/O but the connection check).

An OpenAI-compatible server (SGLang, vLLM, llama.cpp's llama-server, another
`expertdesk serve`) is named by its base URL, the part before ``/chat/completions``:
``http://gpu-box:8000/v1``. A *model ref* for one of its models is that URL, ``#`` and
the model id (``http://gpu-box:8000/v1#deepseek-ai/DeepSeek-V4-Flash``), so a remote
model travels through the app (picker, history, bridge) like a pack path does. The
API key is never part of the ref: the front end hands it to the service separately.

Every failure is turned into an ``EndpointProblem``: a short ``reason`` (unreachable,
tls, unauthorized, no_models, model_not_found, http) and a message that says what the
server said (status and its own message) and what to do.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: ``EndpointProblem.reason`` values.
REASONS = ("unreachable", "tls", "timeout", "unauthorized", "no_models", "model_not_found", "http", "bad_url")

#: ErrorEvent.kind (engine.service_events.ERROR_KINDS) for each reason: the network is the
#: remote model's "drive" (io); a model that cannot be used at all is a bad model (bad_pack).
ERROR_KIND = {"unreachable": "io", "tls": "io", "timeout": "io", "unauthorized": "bad_pack",
              "no_models": "bad_pack", "model_not_found": "bad_pack", "bad_url": "bad_pack", "http": "internal"}


class EndpointProblem(Exception):
    """Talking to the server failed; ``reason`` is one of REASONS, ``status`` the HTTP status (0: none)."""

    def __init__(self, reason: str, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status

    @property
    def kind(self) -> str:
        """The ErrorEvent kind of this problem (context_full for a server's context-length error)."""
        if self.reason == "http" and self.status == 400 and "context" in self.message.lower():
            return "context_full"
        return ERROR_KIND[self.reason]


def is_endpoint_ref(ref: object) -> bool:
    """True for a remote model ref or base URL (http:// or https://), False for a pack, GGUF or demo."""
    return isinstance(ref, str) and ref.lower().startswith(("http://", "https://"))


def normalize_base_url(url: str) -> str:
    """The base URL as the client uses it: no trailing slash, ``/v1`` added when no path is given.

    EndpointProblem("bad_url") for anything that is not an http(s) URL with a host.
    """
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise EndpointProblem("bad_url", f"{url!r} is not a server URL: give http://HOST:PORT/v1 (or https://...), "
                                         "the address the server prints when it starts")
    if parts.username or parts.password:
        raise EndpointProblem("bad_url", "put the API key in the API key field (or --api-key-env), not in the URL")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise EndpointProblem("bad_url", f"{url!r} has an invalid port: give http://HOST:PORT/v1") from None
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme.lower(), parts.netloc, path, "", ""))


def endpoint_ref(base_url: str, model: str) -> str:
    """The model ref of `model` on the server at `base_url`."""
    return f"{normalize_base_url(base_url)}#{model}"


def parse_endpoint_ref(ref: str) -> tuple[str, str | None]:
    """(base URL, model id or None) of a ref made by endpoint_ref, or of a bare base URL."""
    url, _, model = ref.partition("#")
    return normalize_base_url(url), (model or None)


def metrics_url(base_url: str) -> str:
    """Where a server with this base URL publishes Prometheus metrics: the root's ``/metrics``."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urlunsplit((parts.scheme, parts.netloc, f"{path}/metrics", "", ""))


@dataclass(frozen=True)
class ModelCard:
    """One entry of a server's ``GET /v1/models``; ``context_length`` 0 when it does not say."""

    id: str
    owned_by: str = ""
    context_length: int = 0
    is_demo: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def model_card(item: Any) -> ModelCard:
    """A ModelCard from an openai ``Model`` (extra fields: vLLM's max_model_len, ExpertDesk's context_length)."""
    extra = dict(getattr(item, "model_extra", None) or {})
    context = extra.get("context_length") or extra.get("max_model_len") or extra.get("max_context_length") or 0
    try:
        context = int(context)
    except (TypeError, ValueError):
        context = 0
    return ModelCard(str(item.id), str(getattr(item, "owned_by", "") or ""), max(0, context),
                     extra.get("is_demo") is True, extra)


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while (exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in out:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _server_message(body: object, fallback: str) -> str:
    """The server's own error message from an error body (OpenAI style, vLLM style, or text)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
        if isinstance(body.get("detail"), str):  # FastAPI's own errors
            return body["detail"]
    if isinstance(body, str) and body.strip():
        return body.strip()[:500]
    return fallback


def problem_from(exc: BaseException, base_url: str) -> EndpointProblem:
    """What `exc`, raised by the openai client (or httpx) talking to `base_url`, means for the user."""
    import openai

    if isinstance(exc, EndpointProblem):
        return exc
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        said = _server_message(exc.body, exc.response.text[:500] if exc.response is not None else str(exc))
        if status in (401, 403):
            return EndpointProblem("unauthorized", f"{base_url} refused the API key ({status}: {said}). Give the "
                                   "key the server was started with (--api-key), or none if it has none", status)
        if status == 404 and "model" in said.lower():
            return EndpointProblem("model_not_found", f"{base_url} has no such model ({status}: {said}); pick one "
                                   "of its GET /v1/models", status)
        return EndpointProblem("http", f"the server answered {status}: {said}", status)
    if isinstance(exc, openai.APITimeoutError) or any(type(e).__name__.endswith("Timeout") or
                                                      isinstance(e, TimeoutError) for e in _chain(exc)):
        return EndpointProblem("timeout", f"{base_url} did not answer in time; is the server busy or the network "
                               "slow? Try again")
    tls = next((e for e in _chain(exc) if isinstance(e, ssl.SSLError)), None)
    if tls is not None:
        return EndpointProblem("tls", f"TLS error talking to {base_url}: {getattr(tls, 'reason', None) or tls}. "
                               "Check the certificate (is it for this host name, and trusted here?), or use "
                               "http:// if the server does not speak TLS")
    if isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIConnectionError):
        # An error event inside a stream: the server's own words.
        return EndpointProblem("http", f"the server reported an error: {_server_message(exc.body, exc.message)}")
    cause = _root_cause(exc)
    detail = str(cause) or type(cause).__name__
    return EndpointProblem("unreachable", f"cannot reach {base_url}: {detail}. Is the server running, and is the "
                           "URL right (http://HOST:PORT/v1)?")


def cards_from(models: Any, base_url: str) -> tuple[ModelCard, ...]:
    """The cards of a ``models.list()`` answer; EndpointProblem("no_models") when it lists none."""
    cards = tuple(model_card(item) for item in getattr(models, "data", None) or ())
    if not cards:
        raise EndpointProblem("no_models", f"{base_url} answered but lists no models (GET /v1/models is empty); "
                              "is the model still loading? Wait for the server to finish starting")
    return cards


@dataclass(frozen=True)
class ConnectionReport:
    """A successful connection test: the server's models and whether it publishes /metrics."""

    base_url: str
    models: tuple[ModelCard, ...]
    metrics: bool
    seconds: float

    def summary(self) -> str:
        names = ", ".join(card.id for card in self.models[:5]) + (" …" if len(self.models) > 5 else "")
        metrics = "publishes /metrics" if self.metrics else "no /metrics (telemetry will show the reply stats only)"
        return f"Connected in {self.seconds:.2f} s: {len(self.models)} model(s) ({names}); {metrics}"


def check_connection(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> ConnectionReport:
    """Connect to the server, list its models and look for /metrics; EndpointProblem naming what failed."""
    import time

    import openai

    url = normalize_base_url(base_url)
    started = time.monotonic()
    client = openai.OpenAI(base_url=url, api_key=api_key or "none", timeout=timeout_s, max_retries=0)
    try:
        cards = cards_from(client.models.list(), url)
    except Exception as exc:
        raise problem_from(exc, url) from exc
    finally:
        client.close()
    from engine.remote.metrics import fetch_metrics_sync

    metrics = fetch_metrics_sync(url, api_key, timeout_s) is not None
    return ConnectionReport(url, cards, metrics, time.monotonic() - started)
