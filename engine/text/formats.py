"""What the engine needs to know about each built-in chat format, in one table.

The built-in formats (`chat_template.BUILTIN_FORMATS`, found from a model's vocabulary
by `builtin_format_for_vocab`) differ in three facts that matter once the prompt is
rendered: whether reasoning is on when a request does not say, whether the reply's
markup consists of control tokens (so the detokenizer must keep them for the
reasoning splitter to see), and which splitter separates reasoning from the answer.
`CHAT_FORMATS` holds these facts; `reply_splitter` and `skips_special_tokens` are
what the chat service asks, so it holds no per-format special case.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chat_template import BUILTIN_FORMATS, ReasoningSplitter, reasoning_splitter_for

_THINK_OPEN = "<think>"


@dataclass(frozen=True)
class ChatFormat:
    """The facts of one built-in chat format.

    default_thinking: reasoning is on when a request leaves `thinking` unset.
    control_token_markup: the reply's reasoning/answer markup are control tokens (Kimi-K3's
        `<|open|>think<|sep|>` ...): the reply is decoded with special tokens kept, and it is
        split by this format's tags even when the model's own template rendered the prompt.
    """

    name: str
    default_thinking: bool = False
    control_token_markup: bool = False

    def splitter(self, thinking: bool | None) -> ReasoningSplitter:
        """The reasoning splitter for a prompt this format rendered (`thinking` None: the default)."""
        return reasoning_splitter_for(self.name, thinking=self.default_thinking if thinking is None else thinking)


CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    ChatFormat("deepseek-v4"),
    ChatFormat("kimi-k3", default_thinking=True, control_token_markup=True),
    ChatFormat("kimi-k2"),
)}
assert set(CHAT_FORMATS) == set(BUILTIN_FORMATS), "every built-in format needs its row in CHAT_FORMATS"


def reply_splitter(fmt: str | None, prompt: str, *, own_template: bool, thinking: bool | None) -> ReasoningSplitter:
    """The splitter for a reply to `prompt`.

    fmt: the built-in format matching the model's vocabulary (None: none matches);
    own_template: the model's own (Jinja) template rendered the prompt, not `fmt`;
    thinking: the request's reasoning switch (None: the format's default).
    A prompt from the model's own template is split on `<think>` tags, open from the
    start when the prompt ends inside one, unless the format's markup are control tokens.
    """
    chat_format = CHAT_FORMATS.get(fmt) if fmt is not None else None
    if chat_format is not None and (not own_template or chat_format.control_token_markup):
        return chat_format.splitter(thinking)
    return ReasoningSplitter(start_in_reasoning=prompt.rstrip().endswith(_THINK_OPEN))


def skips_special_tokens(fmt: str | None) -> bool:
    """Whether a reply is decoded without its special tokens (False where the markup needs them)."""
    chat_format = CHAT_FORMATS.get(fmt) if fmt is not None else None
    return not (chat_format is not None and chat_format.control_token_markup)
