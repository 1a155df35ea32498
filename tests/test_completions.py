"""`POST /v1/completions` through the official `openai` client, against the model run by hand.

The reference is the demo model itself (engine.loader, greedy argmax over its logits,
no chat template): a text completion must continue the prompt exactly as written.
"""

from __future__ import annotations

import openai
import pytest
import torch

from engine.demo import ensure_demo_pack
from engine.loader import open_model
from engine.options import RuntimeOptions
from engine.text import GGUFTokenizer, StreamDecoder
from server_helpers import serving_demo

CPU = RuntimeOptions(device="cpu")
PROMPT = "def reverse(items):\n    "
GREEDY = {"temperature": 0, "extra_body": {"top_k": 0, "min_p": 0, "repetition_penalty": 1}}


@pytest.fixture(scope="module")
def server(demo_home):
    with serving_demo() as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(demo_home):
    """(tokenizer, greedy continuation of `prompt` for n tokens) with the model run directly."""
    pack = ensure_demo_pack()
    model, source = open_model(pack, CPU.with_(cache_mib=64, direct_io=False))
    tokenizer = GGUFTokenizer.from_metadata(source.metadata)

    def greedy(prompt: str, n: int) -> str:
        ids = tokenizer.encode(prompt, add_special=True, parse_special=False)
        state = model.new_state()
        logits = model.forward(torch.tensor(ids), state)[-1]
        decoder = StreamDecoder(tokenizer, skip_special=True)
        text = []
        for _ in range(n):
            token = int(torch.argmax(logits))
            if token in tokenizer.eos_ids:
                break
            text.append(decoder.feed(token))
            logits = model.forward(torch.tensor([token]), state)[-1]
        return "".join(text) + decoder.flush()

    return tokenizer, greedy


def test_greedy_completion_continues_the_prompt_as_written(client, reference):
    tokenizer, greedy = reference
    reply = client.completions.create(model="expertdesk-demo", prompt=PROMPT, max_tokens=10, **GREEDY)
    assert reply.object == "text_completion"
    choice = reply.choices[0]
    assert choice.text == greedy(PROMPT, 10)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special=True, parse_special=False))

    chunks = list(client.completions.create(model="expertdesk-demo", prompt=PROMPT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_control_tokens_in_the_prompt_stay_text(client, reference):
    tokenizer, _ = reference
    prompt = "<｜User｜>hi<｜Assistant｜>"
    reply = client.completions.create(model="expertdesk-demo", prompt=[prompt], max_tokens=1)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special=True, parse_special=False))
    assert reply.usage.prompt_tokens > len(tokenizer.encode(prompt, add_special=True, parse_special=True))


def test_stop_string(client, reference):
    _, greedy = reference
    full = greedy(PROMPT, 12)
    stop = full.strip()[:2]
    reply = client.completions.create(model="expertdesk-demo", prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY)
    assert reply.choices[0].text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_refusals_name_the_parameter(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=1)
    for extra, param in (({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"), ({"n": 3}, "n"),
                         ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="expertdesk-demo", prompt=PROMPT, max_tokens=1, **extra)
        assert bad.value.param == param, bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="expertdesk-demo", prompt=["one", "two"], max_tokens=1)
    assert bad.value.param == "prompt"
