"""`POST /v1/completions`: the text-completion route (editors' code completion, llama.cpp, vLLM).

The prompt is continued as it is: no chat template, no reasoning split, control tokens
typed into it stay text. Sampling, streaming, usage, the model check, cancellation on
disconnect and the refusals are those of chat completions (`app.server_params`, and
the chat route's response machinery with text-completion objects instead of chat ones).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.openai_server import _ChatResponse, _State, check_prompt_size, read_generation_request
from app.server_params import (
    FINISH_REASONS,
    ApiError,
    check_model,
    model_id,
    parse_sampling,
    refuse_unsupported,
    unicode_text,
    usage,
)
from engine.service_events import DoneEvent, GenerateRequest, TokenEvent


def parse_completion_request(body: Any) -> tuple[GenerateRequest, bool, bool]:
    """(GenerateRequest with `prompt`, stream, include_usage_in_stream) from a completions body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (one prompt per request; lists of prompts and token-id arrays "
                            "are not supported)", code="invalid_value", param="prompt")
    refuse_unsupported(body, completions=True)
    params, stream, include_usage = parse_sampling(body)
    return GenerateRequest([], params, prompt=unicode_text(prompt, "'prompt'")), stream, include_usage


async def completions(state: _State, request: Request) -> Response:
    model, body = await read_generation_request(state, request)
    job, stream, include_usage = parse_completion_request(body)
    check_model(body, model)
    # The same no-tokenizing bound as a chat: the prompt as one message.
    check_prompt_size(replace(job, messages=[{"role": "user", "content": job.prompt}]), model,
                      state.engine.max_token_bytes)
    return _CompletionResponse(state, job, model_id(model), stream, include_usage)


class _CompletionResponse(_ChatResponse):
    """A chat response whose objects are text completions (`choices[].text`)."""

    OBJECT = CHUNK_OBJECT = "text_completion"
    ID_PREFIX = "cmpl"

    def _body(self, event: DoneEvent) -> dict:
        choice = {"text": event.text, "logprobs": None, "finish_reason": FINISH_REASONS[event.stats.stop_reason]}
        return self._envelope(self.OBJECT, choice, usage=usage(event.stats))

    def _chunk(self, delta: Any, finish: str | None = None) -> dict:
        return self._envelope(self.CHUNK_OBJECT, {"text": delta, "logprobs": None, "finish_reason": finish})

    def _opening(self) -> list[dict]:
        return []

    def _token_chunks(self, event: TokenEvent) -> list[dict]:
        return [self._chunk(event.text)] if event.text else []

    def _closing(self, event: DoneEvent) -> list[dict]:
        return [self._chunk("", FINISH_REASONS[event.stats.stop_reason])]
