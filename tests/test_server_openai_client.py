"""`expertdesk serve` through the official `openai` Python client, on the demo model.

The client is the reference for the wire format: what it parses (chat, streaming,
usage, tool calls, errors with their parameter) is what agents and editors see.
Tool calls need a model that writes DeepSeek-V4's DSML block; the demo does not, so
those tests script the sampler with the block's tokens and everything after it (the
engine's detokenizer and reasoning split, the server's parser, the client) runs for real.
"""

from __future__ import annotations

import json
import logging
import re
import time

import openai
import pytest

from engine.text import render_chat
from engine.text.tool_calls import BLOCK_OPEN, ToolCallStream, encode_tool_calls, parse_tool_calls
from server_helpers import cancel_spy, serving_demo, slow_model

KEY = "sk-client-test"
MESSAGES = [{"role": "user", "content": "What does json.dumps do?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL_TEXT = ("Let me check.\n\n" + BLOCK_OPEN + "\n"
             '<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
             "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


@pytest.fixture(scope="module")
def server(demo_home):
    with serving_demo(api_key=KEY) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def scripted(monkeypatch, server, text: str) -> None:
    """Make the engine's sampler write `text` (then end the turn) whatever the logits say."""
    import engine.service as service_module

    tokenizer = server.engine.service._loaded.tokenizer
    ids = tokenizer.encode(text, add_special=False, parse_special=False)

    class Script:
        def __init__(self, params):
            self.left = [*ids, tokenizer.eos_id]

        def sample(self, logits, recent=()):
            return self.left.pop(0)

    monkeypatch.setattr(service_module, "Sampler", Script)


# --------------------------------------------------------------------------- models and chat

def test_model_id_is_clean_and_retrievable(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["expertdesk-demo"]
    assert not re.search(r"\s", models[0].id)
    assert "demo" in models[0].model_extra["name"]  # the display name stays in the card
    assert client.models.retrieve("expertdesk-demo").id == "expertdesk-demo"


def test_chat_stream_and_non_stream_agree(client):
    args = dict(model="expertdesk-demo", messages=MESSAGES, temperature=0, max_tokens=12)
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_errors_name_the_parameter(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert missing.value.code == "model_not_found" and "expertdesk-demo" in missing.value.message
    refused = [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2, "logprobs": True}, "logprobs"),
               ({"response_format": {"type": "json_object"}}, "response_format"),
               ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
               ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools")]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, max_tokens=2, **extra)
        assert bad.value.param == param, (extra, bad.value.body)
        assert param in bad.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    # text is the one response_format that needs nothing: accepted
    ok = client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, max_tokens=2,
                                        response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_closing_a_stream_cancels_the_reply(client, server, monkeypatch):
    service = server.engine.service
    slow_model(monkeypatch, server.engine, 0.03)
    cancelled = cancel_spy(monkeypatch, server.engine)
    stream = client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, temperature=0,
                                            max_tokens=300, stream=True, extra_body={"min_p": 0, "top_k": 0})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled, "closing the stream did not cancel the request"
    assert service.wait_idle(30)
    assert service.snapshot()["completion_tokens"] < 300


def test_access_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="app.openai_server"):
        client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, max_tokens=3)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=MESSAGES, max_tokens=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "app.openai_server"]
    assert any(re.fullmatch(r"POST /v1/chat/completions 200 \d+\+[1-3] tokens( \(\w+\))? \d+\.\d{3} s", line)
               for line in lines), lines
    assert any(re.fullmatch(r"POST /v1/chat/completions 404 - tokens \d+\.\d{3} s", line) for line in lines), lines


# --------------------------------------------------------------------------- tool calls

def _weather_call(call) -> None:
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_tool_call_non_streaming(client, server, monkeypatch):
    scripted(monkeypatch, server, "I need the forecast.</think>" + CALL_TEXT)
    reply = client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, tools=[WEATHER],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "I need the forecast."
    (call,) = choice.message.tool_calls
    _weather_call(call)

    # The next turn carries the call and its result back; the answer is plain text again.
    scripted(monkeypatch, server, "Sunny in Paris.")
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    again = client.chat.completions.create(model="expertdesk-demo", messages=history, tools=[WEATHER])
    assert again.choices[0].message.content == "Sunny in Paris." and not again.choices[0].message.tool_calls
    assert again.choices[0].finish_reason == "stop"


def test_tool_call_streaming(client, server, monkeypatch):
    scripted(monkeypatch, server, CALL_TEXT)
    chunks = list(client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, tools=[WEATHER],
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert not any("DSML" in (d.content or "") for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0
    _weather_call(calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_text_without_calls(client, server, monkeypatch):
    scripted(monkeypatch, server, "Just text, no " + BLOCK_OPEN[:6])  # a start of the block that never completes
    reply = client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, tools=[WEATHER],
                                           tool_choice="auto")
    assert reply.choices[0].message.content == "Just text, no " + BLOCK_OPEN[:6]
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls


def test_dsml_round_trip_and_stream_split():
    """The history encoder and the parser agree, and a stream cut anywhere splits like the whole reply."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 3}'}},
             {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    block = encode_tool_calls(calls)
    content, parsed = parse_tool_calls("Checking." + block)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                   ("noop", {})]
    assert parse_tool_calls(CALL_TEXT)[0] == "Let me check."
    cut = CALL_TEXT[:-5]  # the block never closed (max_tokens): it stays text
    assert parse_tool_calls(cut) == (cut, [])
    for size in (1, 3, 7, 50):
        stream = ToolCallStream()
        sent = "".join(stream.feed(CALL_TEXT[i:i + size]) for i in range(0, len(CALL_TEXT), size))
        rest, streamed = stream.finish()
        assert sent + rest == "Let me check." and [c.name for c in streamed] == ["get_weather"]


def test_deepseek_v4_prompt_holds_tools_and_calls():
    """The built-in DeepSeek-V4 format: the tool section ends the system prompt, calls follow their text."""
    prompt = render_chat(None, [{"role": "system", "content": "Be brief."}, *MESSAGES,
                                {"role": "assistant", "content": "", "tool_calls": [
                                    {"id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                         fallback="deepseek-v4", tools=[WEATHER])
    assert prompt.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in prompt
    assert ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>') in prompt
    assert prompt.endswith("<｜User｜><tool_result>sunny</tool_result><｜Assistant｜></think>")


def test_a_template_that_refuses_the_request_is_a_400(client, server):
    """A chat template that runs past its limits is the request's problem to report, never a 500."""
    loaded = server.engine.service._loaded
    previous, loaded.chat_template = loaded.chat_template, (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    try:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, max_tokens=2)
    finally:
        loaded.chat_template = previous
    assert bad.value.code == "unsupported_request" and "loop iterations" in bad.value.message
    assert client.chat.completions.create(model="expertdesk-demo", messages=MESSAGES, max_tokens=2).choices
