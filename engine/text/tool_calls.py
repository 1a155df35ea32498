"""Tool calls in DeepSeek-V4's own format (DSML), both ways.

DeepSeek-V4 was trained to see its tools as a "## Tools" section at the end of the
system prompt and to call them with a DSML block after its answer text::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

(string="true": the value as is; "false": a JSON value.) This module renders the tool
section and earlier calls for the prompt (`render_tools`, `encode_tool_calls`, used by
the built-in deepseek-v4 chat format) and turns a reply back into OpenAI-style calls
(`parse_tool_calls` for a whole reply, `ToolCallStream` while it streams: answer text
is passed on at once, the block is held back and parsed at the end). The layout follows
DeepSeek-V4's reference encoder (`encoding_dsv4.py` in the model's repository).

Kimi-K3's built-in format declares no tool syntax, so only DeepSeek-V4 has one here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DSML = "｜DSML｜"
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_CLOSE = f"</{DSML}tool_calls>"

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*?)</{DSML}invoke>', re.DOTALL)
_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</{DSML}parameter>',
                        re.DOTALL)


class ToolFormatError(ValueError):
    """A tool declaration or an earlier tool call that cannot be written in the prompt."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as JSON object text (OpenAI's shape)."""

    name: str
    arguments: str


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_function(tool: Any, index: int) -> dict:
    """The function schema of an OpenAI tool (`{"type": "function", "function": {...}}`)."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise ToolFormatError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolFormatError(f"tools[{index}].function.name must be a non-empty string")
    return dict(function)


def render_tools(tools: Sequence[Any]) -> str:
    """The "## Tools" section DeepSeek-V4 reads at the end of its system prompt."""
    schemas = "\n".join(_json(tool_function(tool, i)) for i, tool in enumerate(tools))
    return _TOOLS_SECTION.replace("{dsml}", DSML).replace("{schemas}", schemas)


def _arguments(call: Mapping[str, Any], index: int) -> tuple[str, dict]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ToolFormatError(f"tool_calls[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\"}}}}")
    raw = function.get("arguments", "{}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        arguments = None
    if not isinstance(arguments, Mapping):  # as the reference encoder: the text under one name
        arguments = {"arguments": raw if isinstance(raw, str) else _json(raw)}
    return function["name"], dict(arguments)


def encode_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant message's earlier calls as the DSML block that follows its text."""
    invokes = []
    for i, call in enumerate(tool_calls):
        name, arguments = _arguments(call, i)
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
            for key, value in arguments.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{parameters}\n</{DSML}invoke>')
    return "\n\n" + BLOCK_OPEN + "\n" + "\n".join(invokes) + "\n" + BLOCK_CLOSE


def _parse_block(body: str) -> list[ToolCall] | None:
    """The calls in the text between BLOCK_OPEN and BLOCK_CLOSE; None if it is not well formed."""
    calls, at = [], 0
    for invoke in _INVOKE.finditer(body):
        if body[at:invoke.start()].strip():
            return None
        at = invoke.end()
        arguments: dict[str, Any] = {}
        inner = invoke.group(2)
        spot = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[spot:parameter.start()].strip():
                return None
            spot = parameter.end()
            key, is_string, value = parameter.groups()
            if is_string == "false":
                try:
                    arguments[key] = json.loads(value)
                except ValueError:
                    return None
            else:
                arguments[key] = value
        if inner[spot:].strip():
            return None
        calls.append(ToolCall(invoke.group(1), _json(arguments)))
    if body[at:].strip() or not calls:
        return None
    return calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(answer text, calls) of a whole reply; a block that is cut off or malformed stays text."""
    at = text.find(BLOCK_OPEN)
    if at < 0:
        return text, []
    end = text.find(BLOCK_CLOSE, at)
    calls = _parse_block(text[at + len(BLOCK_OPEN):end]) if end >= 0 else None
    if calls is None:
        return text, []
    rest = text[end + len(BLOCK_CLOSE):]
    return text[:at].rstrip() + (rest if rest.strip() else ""), calls


class ToolCallStream:
    """Answer text as it streams, with the DSML block held back until the reply ends.

    `feed(delta)` returns the text that is surely answer (never a possible start of the
    block, nor whitespace that would precede one); `finish()` returns the held-back
    text that turned out to be answer and the calls, exactly as `parse_tool_calls`
    would split the whole reply.
    """

    def __init__(self) -> None:
        self._text = ""  # everything fed
        self._sent = 0  # how much of it feed() has returned

    def feed(self, delta: str) -> str:
        self._text += delta
        if BLOCK_OPEN in self._text[self._sent:]:
            return ""
        hold = _partial_open(self._text)
        safe_end = len(self._text) - hold
        out = self._text[self._sent:safe_end].rstrip()
        self._sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_tool_calls(self._text)
        return content[self._sent:], calls


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that could still become BLOCK_OPEN."""
    for n in range(min(len(BLOCK_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(BLOCK_OPEN[:n]):
            return n
    return 0
