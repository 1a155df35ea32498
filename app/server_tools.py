"""OpenAI tool calling on this server: `tools`, `tool_choice`, `tool_calls` and tool results.

A request's tools are rendered by the model's chat format in its own syntax (DeepSeek-V4's
DSML, `engine.text.tool_calls`), and the calls in the reply are parsed back into OpenAI
`tool_calls` (with `finish_reason: "tool_calls"`); reasoning stays in
`reasoning_content`. What cannot be honoured is refused with a 400 naming the parameter:
a model whose format has no tool syntax, and a `tool_choice` that would need constrained
decoding ("required", or one named function).
"""

from __future__ import annotations

import uuid
from typing import Any

from app.server_params import ApiError, short
from engine.service_events import GenerateRequest, ModelLoadedEvent
from engine.text.tool_calls import ToolCall, ToolCallStream, ToolFormatError, parse_tool_calls, tool_function

#: chat formats whose tool-call syntax this server can parse
TOOL_FORMATS = ("deepseek-v4",)
MAX_TOOLS = 128


def parse_tools(body: dict) -> list[dict] | None:
    """The request's tool declarations (None: no tools, or tool_choice "none"); ApiError(400) if bad."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        what = "required" if choice == "required" else f"a named function ({short(choice)})"
        raise ApiError(400, f"'tool_choice' {what} is not supported: this server cannot force a tool call; use "
                            "\"auto\" (the model decides) or \"none\"", code="unsupported_parameter",
                       param="tool_choice")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                       code="invalid_value", param="tools")
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' holds {len(tools)} tools; the limit is {MAX_TOOLS}", code="invalid_value",
                       param="tools")
    try:
        functions = [tool_function(tool, i) for i, tool in enumerate(tools)]
    except ToolFormatError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param="tools") from None
    if choice == "none":
        return None
    return [{"type": "function", "function": f} for f in functions]


def parse_message_tools(message: dict, role: str, index: int) -> dict:
    """The tool fields of one message: an assistant's `tool_calls`, a tool result's `tool_call_id`."""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(400, f"messages[{index}] has role tool but no 'tool_call_id' (the id of the call it "
                                "answers)", code="invalid_value", param="messages")
        return {"tool_call_id": call_id}
    calls = message.get("tool_calls")
    if role != "assistant" or not calls:
        return {}
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{index}].tool_calls must be a list", code="invalid_value", param="messages")
    clean = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), str):
            raise ApiError(400, f"messages[{index}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                "\"function\": {\"name\", \"arguments\": JSON text}}", code="invalid_value",
                           param="messages")
        clean.append({"id": str(call.get("id") or ""), "type": "function",
                      "function": {"name": function["name"], "arguments": function.get("arguments") or "{}"}})
    return {"tool_calls": clean}


def check_tools_supported(request: GenerateRequest, model: ModelLoadedEvent) -> None:
    """ApiError(400) when the request uses tools and the model's format has no tool syntax here."""
    uses = request.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in request.messages)
    if uses and model.chat_format not in TOOL_FORMATS:
        raise ApiError(400, f"'tools': {model.model_name} ({model.chat_format or 'no built-in chat format'}) has no "
                            f"tool-call syntax this server can read; tools work with {', '.join(TOOL_FORMATS)} "
                            "models", code="unsupported_parameter", param="tools")


def openai_calls(calls: list[ToolCall], *, stream: bool = False) -> list[dict]:
    """Parsed calls as OpenAI `tool_calls` entries (with `index` in a stream's delta)."""
    out = []
    for i, call in enumerate(calls):
        entry: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": i, **entry} if stream else entry)
    return out


def final_message(text: str, reasoning: str, tools: bool) -> tuple[dict, bool]:
    """(the assistant message of a finished reply, whether it called tools)."""
    content, calls = parse_tool_calls(text) if tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = openai_calls(calls)
    return message, bool(calls)


class StreamedTools:
    """The answer deltas of a streamed reply, with tool calls held back and sent as one delta at the end."""

    def __init__(self) -> None:
        self._stream = ToolCallStream()

    def feed(self, text: str) -> str:
        return self._stream.feed(text)

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas (held-back text, then the calls) and whether there were calls."""
        rest, calls = self._stream.finish()
        deltas: list[dict] = [{"content": rest}] if rest else []
        if calls:
            deltas.append({"tool_calls": openai_calls(calls, stream=True)})
        return deltas, bool(calls)

