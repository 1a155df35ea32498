"""One chat reply streamed from an OpenAI-compatible server, turned into the engine's events and stats.

``request_arguments`` maps a ``GenerateRequest`` onto ``chat.completions.create``
arguments (the common extensions ``top_k``, ``min_p``, ``repetition_penalty`` and
``chat_template_kwargs`` that SGLang, vLLM, llama-server and ``expertdesk serve`` read);
``stream_reply`` reads the stream (``stream_options.include_usage``), hands every text
delta on as it arrives (``reasoning_content`` — or vLLM's newer ``reasoning`` — as the
reasoning section) and measures the reply as the local engine does: TTFT from the
submit, decode tok/s between the first and the last token, usage from the server's
final usage chunk. Quantities a server does not report (the expert cache hit rate and
SSD traffic of the local engine) are NaN: unknown, never a made-up 0 or 100%.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.service_events import GenerateRequest, ReplyStats

#: OpenAI finish_reason -> our stop reason (engine.service_events.STOP_REASONS)
STOP_REASON = {"stop": "eos", "length": "max_tokens", "content_filter": "eos", "tool_calls": "eos"}

UNKNOWN = math.nan


def request_arguments(request: GenerateRequest, model: str) -> dict[str, Any]:
    """Keyword arguments of ``client.chat.completions.create`` for `request` (streaming, with usage)."""
    params = request.sampling
    extra: dict[str, Any] = {"min_p": params.min_p}
    if params.top_k > 0:  # 0 is "off" here; servers disagree on how to say off, so leave it out
        extra["top_k"] = params.top_k
    if params.repetition_penalty != 1:
        extra["repetition_penalty"] = params.repetition_penalty
    if request.thinking is not None:
        # Qwen-style templates read enable_thinking, DeepSeek's and Kimi's read thinking.
        extra["chat_template_kwargs"] = {"enable_thinking": request.thinking, "thinking": request.thinking}
    arguments: dict[str, Any] = {
        "model": model, "messages": [dict(m) for m in request.messages], "stream": True,
        "stream_options": {"include_usage": True}, "temperature": params.temperature, "top_p": params.top_p,
        "max_tokens": params.max_tokens, "extra_body": extra,
    }
    if params.seed is not None:
        arguments["seed"] = params.seed
    if params.stop:
        arguments["stop"] = list(params.stop)
    return arguments


def _delta_reasoning(delta: Any) -> str:
    """The reasoning text of a delta: SGLang's and ExpertDesk's reasoning_content, vLLM's reasoning."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(delta, name, None)
        if isinstance(value, str) and value:
            return value
    return ""


@dataclass
class StreamedReply:
    """What a stream delivered so far; ``stats`` turns it into ReplyStats."""

    submitted: float
    answer: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    pieces: int = 0  # deltas that carried text: the token count when the server sends no usage
    first: float | None = None
    last: float | None = None
    usage: Any = None
    finish_reason: str | None = None
    stop_string: bool = False

    @property
    def text(self) -> str:
        return "".join(self.answer)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def completion_tokens(self) -> int:
        used = getattr(self.usage, "completion_tokens", None)
        return int(used) if isinstance(used, int) else self.pieces

    def stats(self, stop_reason: str | None = None) -> ReplyStats:
        """The reply's stats; `stop_reason` overrides the server's (e.g. "cancelled")."""
        now = time.perf_counter()
        prompt = getattr(self.usage, "prompt_tokens", None)
        prompt = int(prompt) if isinstance(prompt, int) else 0
        completion = self.completion_tokens
        reason = stop_reason or ("stop_string" if self.stop_string else STOP_REASON.get(self.finish_reason or "stop",
                                                                                         "eos"))
        ttft = (self.first - self.submitted) if self.first is not None else 0.0
        decode_s = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        return ReplyStats(
            prompt_tokens=prompt, completion_tokens=completion, ttft_s=ttft,
            # The server's prefill (and the network) until the first token: what a user waits for.
            prefill_tok_s=prompt / ttft if prompt and ttft > 0 else 0.0,
            decode_tok_s=(completion - 1) / decode_s if completion > 1 and decode_s > 0 else 0.0,
            hit_rate=UNKNOWN, ssd_gb_per_token=UNKNOWN, stop_reason=reason, elapsed_s=now - self.submitted)


async def stream_reply(client: Any, model: str, request: GenerateRequest, reply: StreamedReply,
                       on_text: Callable[[str, bool], None], on_first: Callable[[], None]) -> None:
    """Stream `request` into `reply`, calling on_text(delta, reasoning) per delta and on_first() once.

    Cancelling the task that runs this closes the HTTP response (the ``async with``), which
    the server sees as a disconnect and takes as a cancel. openai's errors propagate.
    """
    stream = await client.chat.completions.create(**request_arguments(request, model))
    async with stream:
        async for chunk in stream:
            if getattr(chunk, "usage", None) is not None:
                reply.usage = chunk.usage
            for choice in chunk.choices or ():
                delta = choice.delta
                for text, is_reasoning in ((_delta_reasoning(delta), True), (delta.content or "", False)):
                    if not text:
                        continue
                    reply.last = time.perf_counter()
                    if reply.first is None:
                        reply.first = reply.last
                        on_first()
                    reply.pieces += 1
                    (reply.reasoning if is_reasoning else reply.answer).append(text)
                    on_text(text, is_reasoning)
                if choice.finish_reason:
                    reply.finish_reason = choice.finish_reason
                    # vLLM and SGLang name the stop string that ended the reply (a token id is an EOS)
                    matched = (getattr(choice, "model_extra", None) or {}).get("stop_reason")
                    reply.stop_string = isinstance(matched, str) and matched in tuple(request.sampling.stop)
