"""Chat prompt rendering (Jinja chat templates and built-in formats) and reasoning splitting.

Templates come from downloaded model files, so they are untrusted code. They are
rendered exactly the way ``transformers``' ``apply_chat_template`` renders them (same
Jinja settings, globals, filters and input clean-up; see
``transformers/utils/chat_template_utils.py``: ``_compile_jinja_template`` and
``render_jinja_template``) inside Jinja's ``ImmutableSandboxedEnvironment``. One
deliberate difference: where the sandbox would quietly render an attribute it refuses
(``''.__class__``) as an empty string, we stop with :class:`ChatTemplateError`, so a
template that reaches for Python internals never produces a prompt.

When a model file carries no template, :func:`render_chat` can fall back to a
built-in format (``deepseek-v4``, ``kimi-k3``, ``kimi-k2``), written from the models'
published encoders/templates:

* DeepSeek-V4: ``encoding/encoding_dsv4.py`` shipped with deepseek-ai/DeepSeek-V4-Flash
  (the model has no Jinja template); same layout as DeepSeek-V3.1/V3.2.
* Kimi-K3: the XTML message format of llama.cpp's ``models/templates/Kimi-K3.jinja``.
* Kimi-K2: moonshotai/Kimi-K2-Instruct's template (llama.cpp
  ``models/templates/moonshotai-Kimi-K2.jinja``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Container, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplateError",
    "render_chat",
    "render_builtin",
    "BUILTIN_FORMATS",
    "builtin_format_for_vocab",
    "ReasoningSplitter",
    "ReasoningDelta",
    "split_reasoning",
    "reasoning_splitter_for",
]


class ChatTemplateError(ValueError):
    """A chat prompt could not be rendered (bad/unsafe template or unsupported input)."""


# --------------------------------------------------------------------------- Jinja setup


class _Sandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox, but refused attribute access raises at once.

    Jinja's default returns an Undefined that prints as "" for e.g. ``''.__class__``;
    a template that tries that is hostile or broken, and must not yield a prompt.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it.

    We never need the spans, so the body is rendered as is (what transformers does when
    it is not asked for an assistant mask).
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes) with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - name used by templates
    return datetime.now().strftime(format)


class _TemplateDict:
    # A limited dict() so templates cannot reach dict's class through the global.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces refuse underscore names so they cannot be used to reach internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


# --------------------------------------------------------------------------- input clean-up
# Mirrors transformers: drop None-valued message keys, rebuild everything the template
# sees from plain JSON types (no foreign objects with callable methods reach the
# sandbox), and copy reasoning under the names templates read.

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # numpy / torch scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ChatTemplateError("cannot render an empty conversation: pass a non-empty list of message dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        out.append({k: v for k, v in message.items() if v is not None})
    out = _plain(out)
    aliased = []
    for message in out:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


# --------------------------------------------------------------------------- public entry


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    fallback: str | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` into the prompt text the model expects.

    ``template`` is the GGUF ``tokenizer.chat_template`` (a Jinja template), rendered
    like ``transformers``' ``apply_chat_template(..., tokenize=False)``. ``bos_token``
    / ``eos_token`` are passed to the template as the tokenizer's special tokens.
    ``enable_thinking`` (when not None) is passed both as ``enable_thinking`` and as
    ``thinking`` (DeepSeek and Kimi templates read the latter); ``extra`` keys are
    passed through unchanged and win over both.

    When ``template`` is None or blank, the built-in format named by ``fallback``
    (one of :data:`BUILTIN_FORMATS`) is used. Raises :class:`ChatTemplateError` for a
    broken or unsafe template, or input a format cannot express.
    """
    if template is None or not template.strip():
        if fallback is None:
            raise ChatTemplateError(
                "the model file has no chat template and no built-in format was chosen; pass "
                f"fallback= one of {', '.join(BUILTIN_FORMATS)} (see builtin_format_for_vocab)"
            )
        return render_builtin(
            fallback,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
            enable_thinking=enable_thinking,
            **extra,
        )

    chat = _prepare_messages(messages)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema dicts, got a {type(tool).__name__}")
    kwargs: dict[str, Any] = {}
    if bos_token is not None:
        kwargs["bos_token"] = bos_token
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    if enable_thinking is not None:
        kwargs["enable_thinking"] = bool(enable_thinking)
        kwargs["thinking"] = bool(enable_thinking)
    kwargs.update(extra)
    for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
        if reserved in kwargs:
            raise ChatTemplateError(f"{reserved!r} is set by render_chat itself and cannot be passed as an extra variable")

    try:
        compiled = _compile(template)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template has a Jinja syntax error at line {exc.lineno}: {exc.message}; "
            "the model file's template is broken (pass a fixed template, or none to use a built-in format)"
        ) from exc
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=None,
            add_generation_prompt=bool(add_generation_prompt),
            **_plain(kwargs),
        )
    except SecurityError as exc:
        raise ChatTemplateError(
            f"the chat template tried to reach Python internals and was stopped ({exc}); this template "
            "is unsafe or broken and was not run - use a trusted template or a built-in format"
        ) from exc
    except TemplateError as exc:
        if isinstance(exc, UndefinedError):
            raise ChatTemplateError(f"the chat template failed on the given messages: {exc}") from exc
        raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("the chat template recursed too deeply and was stopped") from exc
    except Exception as exc:  # TypeError, KeyError, ... raised by template expressions
        raise ChatTemplateError(
            f"the chat template failed on the given messages ({type(exc).__name__}: {exc})"
        ) from exc


# --------------------------------------------------------------------------- built-in formats

BUILTIN_FORMATS: tuple[str, ...] = ("deepseek-v4", "kimi-k3", "kimi-k2")

_DS_BOS = "<｜begin▁of▁sentence｜>"
_DS_EOS = "<｜end▁of▁sentence｜>"
_DS_USER = "<｜User｜>"
_DS_ASSISTANT = "<｜Assistant｜>"
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

_K2_SYSTEM = "<|im_system|>"
_K2_USER = "<|im_user|>"
_K2_ASSISTANT = "<|im_assistant|>"
_K2_MIDDLE = "<|im_middle|>"
_K2_END = "<|im_end|>"
_K2_DEFAULT_SYSTEM = "You are a helpful assistant"

_K3_OPEN = "<|open|>"
_K3_SEP = "<|sep|>"
_K3_CLOSE = "<|close|>"
_K3_END_OF_MSG = "<|end_of_msg|>"
_K3_EFFORTS = ("low", "medium", "high", "max")


def builtin_format_for_vocab(tokens: Container[str]) -> str | None:
    """Name of the built-in format whose control tokens are all in ``tokens``, or None.

    ``tokens`` is any container of vocabulary entries (a set, or a ``GGUFTokenizer``). Kimi-K3 is checked before Kimi-K2 because its vocabulary may keep the older
    ``<|im_*|>`` markers.
    """
    if all(t in tokens for t in (_DS_USER, _DS_ASSISTANT, _DS_EOS)):
        return "deepseek-v4"
    if all(t in tokens for t in (_K3_OPEN, _K3_SEP, _K3_CLOSE, _K3_END_OF_MSG)):
        return "kimi-k3"
    if all(t in tokens for t in (_K2_USER, _K2_ASSISTANT, _K2_MIDDLE, _K2_END)):
        return "kimi-k2"
    return None


def message_text(content: Any, where: str = "the message") -> str:
    """One chat message's ``content`` as text, in the shapes the OpenAI API allows: a
    string as is, None as "", or a list of ``{"type": "text", "text": ...}`` parts joined.

    ``where`` names the message in errors ("message 2", "messages[2].content"). Raises
    :class:`ChatTemplateError` for other parts (images, audio) or another type. The chat
    formats and the OpenAI-compatible server both read content through this function.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"{where} has a {kind!r} content part; only text parts are supported "
                    '({"type": "text", "text": ...})'
                )
        return "".join(parts)
    raise ChatTemplateError(f"{where}: content is a {type(content).__name__}; expected a string or a list of text parts")


def _text_content(fmt: str, index: int, content: Any) -> str:
    return message_text(content, f"message {index} (built-in {fmt} format)")


def _reject_unsupported(fmt: str, messages: list[dict], tools: Any, extra: Mapping[str, Any], allowed_extra: Iterable[str]) -> None:
    if tools:
        raise ChatTemplateError(
            f"the built-in {fmt} format does not render tool declarations; tool use needs the model "
            "file's own chat template"
        )
    unknown = set(extra) - set(allowed_extra)
    if unknown:
        raise ChatTemplateError(f"the built-in {fmt} format does not take {', '.join(sorted(unknown))}")
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            raise ChatTemplateError(f"message {i} has tool_calls; the built-in {fmt} format does not render tool calls")


def render_builtin(
    fmt: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    **extra: Any,
) -> str:
    """Render with a built-in format (see :data:`BUILTIN_FORMATS`); no tools or images."""
    if fmt not in BUILTIN_FORMATS:
        raise ChatTemplateError(f"unknown built-in chat format {fmt!r}; available: {', '.join(BUILTIN_FORMATS)}")
    chat = _prepare_messages(messages)
    if fmt == "deepseek-v4":
        _reject_unsupported(fmt, chat, tools, extra, ())
        return _render_deepseek_v4(chat, add_generation_prompt, bool(enable_thinking), bos_token or _DS_BOS, eos_token or _DS_EOS)
    if fmt == "kimi-k3":
        _reject_unsupported(fmt, chat, tools, extra, ("thinking_effort",))
        thinking = True if enable_thinking is None else bool(enable_thinking)
        effort = extra.get("thinking_effort", "max")
        if thinking and effort is not None and effort not in _K3_EFFORTS:
            raise ChatTemplateError(f"thinking_effort={effort!r} is not supported; use one of {', '.join(_K3_EFFORTS)}")
        return _render_kimi_k3(chat, add_generation_prompt, thinking, effort)
    _reject_unsupported(fmt, chat, tools, extra, ())
    if enable_thinking:
        raise ChatTemplateError("the Kimi-K2 (Instruct) format has no reasoning channel; use enable_thinking=False/None")
    return _render_kimi_k2(chat, add_generation_prompt)


def _render_deepseek_v4(chat: list[dict], add_generation_prompt: bool, thinking: bool, bos: str, eos: str) -> str:
    # Layout of encoding_dsv4.encode_messages (drop_thinking=True, no context):
    #   BOS, system text as is, "<｜User｜>"+text, then after a user turn that is followed by
    #   an assistant turn (or ends the chat) "<｜Assistant｜>" + "<think>" (thinking mode,
    #   last user turn) or "</think>"; an assistant turn is [reasoning "</think>"] text EOS,
    #   with reasoning kept only after the last user turn. Tool results are user turns
    #   made of <tool_result> blocks.
    merged: list[dict] = []
    for i, m in enumerate(chat):
        role = m.get("role")
        if role == "tool":
            block = "<tool_result>" + _text_content("deepseek-v4", i, m.get("content")) + "</tool_result>"
            if merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
                merged[-1]["_blocks"].append(block)
            else:
                merged.append({"role": "user", "_blocks": [block]})
        elif role == "user":
            text = _text_content("deepseek-v4", i, m.get("content"))
            if merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
                merged[-1]["_blocks"].append(text)
            else:
                merged.append({"role": "user", "_blocks": [text]})
        elif role in ("system", "assistant"):
            merged.append({**m, "content": _text_content("deepseek-v4", i, m.get("content"))})
        else:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; the built-in deepseek-v4 format knows system, user, assistant and tool"
            )
    last_user = max((i for i, m in enumerate(merged) if m["role"] == "user"), default=-1)

    out = [bos]
    for i, m in enumerate(merged):
        role = m["role"]
        if role == "system":
            out.append(m["content"])
        elif role == "user":
            out.append(_DS_USER + "\n\n".join(m["_blocks"]))
        else:  # assistant
            if thinking and i > last_user:
                out.append((m.get("reasoning_content") or "") + _THINK_CLOSE)
            out.append(m["content"] + eos)
        nxt = merged[i + 1]["role"] if i + 1 < len(merged) else None
        if role == "user" and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            out.append(_DS_ASSISTANT + (_THINK_OPEN if thinking and i >= last_user else _THINK_CLOSE))
    return "".join(out)


def _k3_open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> str:
    body = "".join(
        f' {key}="' + str(value).replace("&", "&amp;").replace('"', "&quot;") + '"' for key, value in attrs
    )
    return _K3_OPEN + tag + body + _K3_SEP


def _k3_close(tag: str) -> str:
    return _K3_CLOSE + tag + _K3_SEP


def _render_kimi_k3(chat: list[dict], add_generation_prompt: bool, thinking: bool, effort: str | None) -> str:
    # XTML layout of Kimi-K3.jinja: every message is <|open|>message role="..."<|sep|>
    # ... <|close|>message<|sep|><|end_of_msg|>; an assistant message holds a think
    # block (when thinking) and a response block; thinking mode announces the effort in
    # an internal system message first.
    out = []
    if thinking and effort in _K3_EFFORTS:
        body = (
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`."
        )
        out.append(_k3_open("message", [("role", "system"), ("type", "thinking-effort")]) + body.strip())
        out.append(_k3_close("message") + _K3_END_OF_MSG)
    for i, m in enumerate(chat):
        role = m.get("role")
        attrs: list[tuple[str, Any]] = [("role", role)]
        if m.get("name"):
            attrs.append(("name", m["name"]))
        if role in ("user", "system"):
            out.append(_k3_open("message", attrs) + _text_content("kimi-k3", i, m.get("content")))
        elif role == "assistant":
            out.append(_k3_open("message", attrs))
            if thinking:
                reasoning = m.get("reasoning_content") or m.get("reasoning")
                out.append(_k3_open("think"))
                if reasoning is not None and str(reasoning).strip():
                    out.append(str(reasoning))
                out.append(_k3_close("think"))
            out.append(_k3_open("response") + _text_content("kimi-k3", i, m.get("content")) + _k3_close("response"))
        else:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; the built-in kimi-k3 format renders system, user and assistant "
                "(tool results need the model file's own template)"
            )
        out.append(_k3_close("message") + _K3_END_OF_MSG)
    if add_generation_prompt:
        out.append(_k3_open("message", [("role", "assistant")]) + _k3_open("think" if thinking else "response"))
    return "".join(out)


def _render_kimi_k2(chat: list[dict], add_generation_prompt: bool) -> str:
    # Kimi-K2-Instruct: default system turn when the chat does not start with one,
    # "<|im_X|>role<|im_middle|>content<|im_end|>" per message, tool results under im_system.
    markers = {"system": _K2_SYSTEM, "user": _K2_USER, "assistant": _K2_ASSISTANT, "tool": _K2_SYSTEM}
    out = []
    if chat[0].get("role") != "system":
        out.append(f"{_K2_SYSTEM}system{_K2_MIDDLE}{_K2_DEFAULT_SYSTEM}{_K2_END}")
    for i, m in enumerate(chat):
        role = m.get("role")
        if role not in markers:
            raise ChatTemplateError(f"message {i} has role {role!r}; the built-in kimi-k2 format knows {', '.join(markers)}")
        out.append(f"{markers[role]}{role}{_K2_MIDDLE}{_text_content('kimi-k2', i, m.get('content'))}{_K2_END}")
    if add_generation_prompt:
        out.append(f"{_K2_ASSISTANT}assistant{_K2_MIDDLE}")
    return "".join(out)


# --------------------------------------------------------------------------- reasoning split


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    """Text newly assigned to the reasoning channel and to the answer channel."""

    reasoning: str = ""
    answer: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.answer)


class ReasoningSplitter:
    """Streams model output into reasoning and answer text, tag by tag.

    ``open_tag``/``close_tag`` delimit reasoning (``<think>``/``</think>`` by default).
    Use ``start_in_reasoning=True`` when the prompt already opened the block (DeepSeek
    thinking mode ends the prompt with ``<think>``). Otherwise an ``open_tag`` counts
    only at the very start of the output (after optional whitespace), so an answer that
    merely mentions the tag is not swallowed. ``answer_drop`` lists markup removed from
    the answer (Kimi-K3's response block tags). Tags split across deltas are handled:
    text that could be the start of a tag is held back until it is decided.
    """

    def __init__(
        self,
        *,
        start_in_reasoning: bool = False,
        open_tag: str = _THINK_OPEN,
        close_tag: str = _THINK_CLOSE,
        answer_drop: Sequence[str] = (),
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must be non-empty strings")
        self._open = open_tag
        self._close = close_tag
        self._drop = tuple(d for d in answer_drop if d)
        self._state = "reasoning" if start_in_reasoning else "start"
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside the reasoning block."""
        return self._state == "reasoning"

    def feed(self, delta: str) -> ReasoningDelta:
        """Add a chunk of model output; returns what can be assigned so far."""
        self._buf += delta
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self._open):
                    self._buf = stripped[len(self._open) :]
                    self._state = "reasoning"
                    continue
                if stripped == "" or self._open.startswith(stripped):
                    break  # still undecided: wait for more text
                self._state = "answer"
                continue
            if self._state == "reasoning":
                at = self._buf.find(self._close)
                if at >= 0:
                    reasoning.append(self._buf[:at])
                    self._buf = self._buf[at + len(self._close) :]
                    self._state = "answer"
                    continue
                keep = _partial_suffix(self._buf, (self._close,))
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            # answer
            if self._drop:
                hits = [(self._buf.find(d), d) for d in self._drop]
                hits = [(at, d) for at, d in hits if at >= 0]
                if hits:
                    at, d = min(hits)
                    answer.append(self._buf[:at])
                    self._buf = self._buf[at + len(d) :]
                    continue
                keep = _partial_suffix(self._buf, self._drop)
            else:
                keep = 0
            answer.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return ReasoningDelta("".join(reasoning), "".join(answer))

    def flush(self) -> ReasoningDelta:
        """End of output: held-back text goes to the channel it was in."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(answer=rest)


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def split_reasoning(text: str, **kwargs: Any) -> tuple[str, str]:
    """Split a complete output into ``(reasoning, answer)``; same options as :class:`ReasoningSplitter`."""
    splitter = ReasoningSplitter(**kwargs)
    a = splitter.feed(text)
    b = splitter.flush()
    return a.reasoning + b.reasoning, a.answer + b.answer


def reasoning_splitter_for(fmt: str, *, thinking: bool) -> ReasoningSplitter:
    """Splitter matching a built-in format's generation prompt.

    ``deepseek-v4``: thinking prompts end with ``<think>`` so output starts in the
    reasoning block. ``kimi-k3``: thinking prompts end inside the think block; the
    response block's tags are removed from the answer (decode with control tokens
    kept so the tags are visible). ``kimi-k2``: no prompt-opened block.
    """
    if fmt == "deepseek-v4":
        return ReasoningSplitter(start_in_reasoning=thinking)
    if fmt == "kimi-k3":
        return ReasoningSplitter(
            start_in_reasoning=thinking,
            open_tag=_k3_open("think"),
            close_tag=_k3_close("think"),
            answer_drop=(_k3_open("response"), _k3_close("response"), _k3_close("message"), _K3_END_OF_MSG),
        )
    if fmt == "kimi-k2":
        return ReasoningSplitter(start_in_reasoning=False)
    raise ValueError(f"unknown built-in chat format {fmt!r}; available: {', '.join(BUILTIN_FORMATS)}")
