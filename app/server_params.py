"""What the OpenAI-compatible routes read from a request body, and the errors they answer.

One parser for what chat and text completions share (sampling, streaming, the model
name, the parameters this server refuses rather than ignores), so that
`POST /v1/chat/completions` and `POST /v1/completions` read them the same way.
Every mistake is an `ApiError` with a 4xx status naming the parameter, as the OpenAI
API does (`{"error": {"message", "type", "code", "param"}}`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from starlette.responses import JSONResponse

from engine.service_events import ModelLoadedEvent
from engine.text import SamplingParams

#: our stop reasons -> OpenAI finish_reason ("cancelled" has none: it is reported as an error)
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length", "context_full": "length"}

MAX_STOP_STRINGS = 16
_INT_LIMIT = 2**64  # integer parameters beyond this are a client's mistake, not a number to use
DEMO_MODEL_ID = "expertdesk-demo"


class ApiError(Exception):
    """An error answered to the client as OpenAI-style JSON.

    close: also close the connection (the request body was not read to its end).
    param: the request parameter at fault, when there is one.
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, *, close: bool = False, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = int(status), message, type_, code
        self.param = param
        self.headers = dict(headers or {})
        if close:
            self.headers["Connection"] = "close"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, self.headers)


def short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def number(body: dict, key: str, *, integer: bool = False) -> Any:
    """body[key] as a finite number (None when absent); ApiError(400) naming `key` otherwise."""
    value = body.get(key)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        raise ApiError(400, f"'{key}' must be {kind}, got {short(value)}", code="invalid_value", param=key)
    if isinstance(value, int) and not -_INT_LIMIT < value < _INT_LIMIT:
        raise ApiError(400, f"'{key}' is out of range", code="invalid_value", param=key)
    if not integer and not math.isfinite(value):
        raise ApiError(400, f"'{key}' must be a finite number, got {value!r}", code="invalid_value", param=key)
    return value


def unicode_text(value: str, where: str) -> str:
    """`value` unchanged if it is valid Unicode text (no lone surrogates), else ApiError(400)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where} is not valid Unicode text (it holds a lone surrogate escape)",
                       code="invalid_value") from None
    return value


def refuse_unsupported(body: dict, *, completions: bool = False) -> None:
    """ApiError(400) naming the first parameter this server would otherwise have to ignore."""
    n = number(body, "n", integer=True)
    if n not in (None, 1):
        raise ApiError(400, f"'n' is {n}: this server generates one choice per request (n=1); send the request "
                            f"{n} times with different seeds instead", code="unsupported_parameter", param="n")
    if completions:
        best_of = number(body, "best_of", integer=True)
        if best_of not in (None, 1):
            raise ApiError(400, "'best_of' must be 1: this server generates one choice per request",
                           code="unsupported_parameter", param="best_of")
        if body.get("echo") not in (None, False):
            raise ApiError(400, "'echo' is not supported: the reply never repeats the prompt",
                           code="unsupported_parameter", param="echo")
        if body.get("suffix") not in (None, ""):
            raise ApiError(400, "'suffix' (fill-in-the-middle) is not supported by these models' completions",
                           code="unsupported_parameter", param="suffix")
    for key in ("logprobs", "top_logprobs"):
        if body.get(key) not in (None, False, 0):
            raise ApiError(400, f"'{key}' is not supported: this server does not return token log-probabilities",
                           code="unsupported_parameter", param=key)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else short(fmt)
        raise ApiError(400, f"'response_format' {kind!r} is not supported: this server cannot constrain the reply "
                            "to JSON; ask for JSON in the prompt and parse the reply", code="unsupported_parameter",
                       param="response_format")


def parse_sampling(body: dict) -> tuple[SamplingParams, bool, bool]:
    """(SamplingParams, stream, include_usage_in_stream) from a chat or text completion body."""
    max_tokens = number(body, "max_completion_tokens", integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", code="invalid_value", param="stop")
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' holds {len(stop)} strings; the limit is {MAX_STOP_STRINGS}", code="invalid_value",
                       param="stop")
    values = {
        "temperature": number(body, "temperature"), "top_p": number(body, "top_p"),
        "top_k": number(body, "top_k", integer=True), "min_p": number(body, "min_p"),
        "repetition_penalty": number(body, "repetition_penalty"), "max_tokens": max_tokens,
        "seed": number(body, "seed", integer=True),
        "stop": tuple(unicode_text(s, "'stop'") for s in stop if s) if stop else None,
    }
    try:
        params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
    except (ValueError, TypeError, OverflowError) as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", code="invalid_value", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage") is True)
    return params, stream, include_usage


def model_id(model: ModelLoadedEvent) -> str:
    """The id clients name the loaded model by: no spaces, lower case (`/v1/models`).

    The display name (the GGUF's general.name) stays in the card's `name` field.
    """
    if model.is_demo:
        return DEMO_MODEL_ID
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.model_name.strip().lower()).strip("-.")
    return slug or "model"


def check_model(body: dict, model: ModelLoadedEvent) -> None:
    """ApiError(404 model_not_found) unless `model` is absent or names the loaded model (id or display name)."""
    wanted = body.get("model")
    if wanted is None:
        return
    if not isinstance(wanted, str):
        raise ApiError(400, f"'model' must be a string, got {short(wanted)}", code="invalid_value", param="model")
    if wanted not in (model_id(model), model.model_name):
        raise ApiError(404, f"the model {short(wanted, 200)} does not exist on this server; it serves "
                            f"{model_id(model)!r} (GET /v1/models)", code="model_not_found", param="model")


def usage(stats: Any) -> dict:
    """OpenAI's usage object of a finished reply's ReplyStats."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}
