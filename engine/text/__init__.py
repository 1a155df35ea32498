"""Text side of the chat engine: GGUF tokenizer, chat prompt rendering, sampling and stops.

Headless: depends on ``tokenizers``, ``jinja2`` and ``torch`` only (never Qt or the app).
"""

from .chat_template import (
    BUILTIN_FORMATS,
    ChatTemplateError,
    ReasoningDelta,
    ReasoningSplitter,
    builtin_format_for_vocab,
    reasoning_splitter_for,
    render_builtin,
    render_chat,
    split_reasoning,
)
from .sampling import Sampler, SamplingParams, StopChecker, StopReason, StopStep
from .tokenizer import SUPPORTED_PRE_TOKENIZERS, GGUFTokenizer, StreamDecoder, TokenizerError, TokenType

__all__ = [
    "BUILTIN_FORMATS",
    "ChatTemplateError",
    "GGUFTokenizer",
    "ReasoningDelta",
    "ReasoningSplitter",
    "SUPPORTED_PRE_TOKENIZERS",
    "Sampler",
    "SamplingParams",
    "StopChecker",
    "StopReason",
    "StopStep",
    "StreamDecoder",
    "TokenType",
    "TokenizerError",
    "builtin_format_for_vocab",
    "reasoning_splitter_for",
    "render_builtin",
    "render_chat",
    "split_reasoning",
]
