"""Text side of the chat engine: GGUF tokenizer, chat prompt rendering, sampling and stops.

Headless: depends on ``tokenizers``, ``jinja2`` and ``torch`` only (never Qt or the app).
"""

from .chat_template import (
    BUILTIN_FORMATS,
    ChatTemplateError,
    ReasoningDelta,
    ReasoningSplitter,
    RenderedPrompt,
    TemplateLimitError,
    TemplateLimits,
    TemplateRenderCancelled,
    builtin_format_for_vocab,
    message_text,
    reasoning_splitter_for,
    render_builtin,
    render_chat,
    render_prompt,
    split_reasoning,
)
from .formats import CHAT_FORMATS, ChatFormat, reply_splitter, skips_special_tokens
from .sampling import Sampler, SamplingParams, StopChecker, StopReason, StopStep
from .tokenizer import SUPPORTED_PRE_TOKENIZERS, GGUFTokenizer, StreamDecoder, TokenizerError, TokenType

__all__ = [
    "BUILTIN_FORMATS",
    "CHAT_FORMATS",
    "ChatFormat",
    "ChatTemplateError",
    "GGUFTokenizer",
    "ReasoningDelta",
    "ReasoningSplitter",
    "RenderedPrompt",
    "SUPPORTED_PRE_TOKENIZERS",
    "Sampler",
    "SamplingParams",
    "StopChecker",
    "StopReason",
    "StopStep",
    "StreamDecoder",
    "TemplateLimitError",
    "TemplateLimits",
    "TemplateRenderCancelled",
    "TokenType",
    "TokenizerError",
    "builtin_format_for_vocab",
    "message_text",
    "reasoning_splitter_for",
    "render_builtin",
    "render_chat",
    "render_prompt",
    "reply_splitter",
    "skips_special_tokens",
    "split_reasoning",
]
