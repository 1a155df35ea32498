"""Chat with `expertdesk serve demo` through the endpoint path: RemoteService, the CLI's --endpoint, /metrics.

The server is the real one (tests/test_serve.py's fixture, on a free port); the
references are independent of our client: the official openai client's answers and
prometheus_client's parser.
"""

from __future__ import annotations

import json
import queue
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.cli import main
from engine.remote import endpoint_ref
from engine.remote.service import RemoteService
from engine.service_events import (
    LOAD_REQUEST_ID,
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    ModelLoadedEvent,
    PhaseEvent,
    TokenEvent,
)
from engine.text import SamplingParams
from event_helpers import until_idle
from server_helpers import cancel_spy, slow_model
from test_serve import KEY, MESSAGES, server  # noqa: F401  (the live `expertdesk serve demo` fixture)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def base_url(server) -> str:
    return server.url + "/v1"


def reference(server, max_tokens: int = 12, messages=MESSAGES):
    """The official openai client's non-streaming answer to the same greedy request."""
    client = openai.OpenAI(base_url=base_url(server), api_key=KEY, max_retries=0)
    with client:
        model = client.models.list().data[0].id
        return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)


class Events:
    """A RemoteService whose events land in a queue, read until a request's idle phase."""

    def __init__(self, **kwargs) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.service = RemoteService(self.queue.put, **kwargs)

    def until_idle(self, rid: str, timeout: float = 60.0) -> list:
        return until_idle(self.queue, rid, timeout)

    def load(self, ref: str) -> list:
        self.service.load(ref)
        return self.until_idle(LOAD_REQUEST_ID)

    def close(self) -> None:
        self.service.shutdown()


@pytest.fixture
def remote(server):
    events = Events(api_key=KEY, metrics_interval_s=0.2)
    loaded = events.load(base_url(server))
    assert isinstance(loaded[-2], ModelLoadedEvent), loaded
    yield events
    events.close()


def test_stream_matches_the_servers_own_answer(server, remote):
    expected = reference(server)
    rid = remote.service.submit(GenerateRequest(MESSAGES, GREEDY))
    events = remote.until_idle(rid)
    phases = [e.phase for e in events if isinstance(e, PhaseEvent)]
    assert phases[0] == "prefill" and "decoding" in phases and phases[-1] == "idle"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-2]
    assert isinstance(done, DoneEvent), events
    assert "".join(t.text for t in tokens if not t.reasoning) == done.text == expected.choices[0].message.content
    stats = done.stats
    assert stats.prompt_tokens == expected.usage.prompt_tokens  # the server's usage chunk
    assert stats.completion_tokens == expected.usage.completion_tokens
    assert stats.stop_reason == {"length": "max_tokens", "stop": "eos"}[expected.choices[0].finish_reason]
    assert 0 < stats.ttft_s <= stats.elapsed_s
    assert stats.decode_tok_s > 0 if stats.completion_tokens > 1 else True
    assert stats.hit_rate != stats.hit_rate  # NaN: a server reply has no local cache numbers
    card = remote.service.snapshot()["model"]
    assert card["name"] == openai.OpenAI(base_url=base_url(server), api_key=KEY).models.list().data[0].id
    assert card["is_demo"] is True and card["context_length"] > 0


def test_cancel_mid_stream_disconnects_the_server(server, remote, monkeypatch):
    service = server.engine.service
    slow_model(monkeypatch, server.engine)
    seen = cancel_spy(monkeypatch, server.engine)
    rid = remote.service.submit(GenerateRequest(MESSAGES, SamplingParams(temperature=0.0, max_tokens=200)))
    while not isinstance(event := remote.queue.get(timeout=60), TokenEvent):
        pass
    started = time.monotonic()
    remote.service.cancel(rid)
    events = remote.until_idle(rid, timeout=30)
    done = events[-2]
    assert isinstance(done, DoneEvent) and done.stats.stop_reason == "cancelled", events
    assert time.monotonic() - started < 5  # not after the remaining ~190 tokens
    assert done.text.startswith(event.text) or done.reasoning.startswith(event.text)
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and seen[0], "the server never saw the client go away"
    assert service.wait_idle(30)
    assert service.snapshot()["completion_tokens"] < 200


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_error(ref: str, **kwargs) -> ErrorEvent:
    events = Events(metrics_interval_s=None, **kwargs)
    try:
        loaded = events.load(ref)
    finally:
        events.close()
    errors = [e for e in loaded if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and not any(isinstance(e, ModelLoadedEvent) for e in loaded), loaded
    return errors[0]


def test_connection_problems_say_what_went_wrong(server):
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=base_url(server), api_key="wrong", max_retries=0).models.list()
    error = _load_error(base_url(server), api_key="wrong")
    assert error.kind == "bad_pack" and "401" in error.message and refused.value.body["message"] in error.message

    error = _load_error(f"http://127.0.0.1:{_free_port()}/v1")
    assert error.kind == "io" and "cannot reach" in error.message

    host, port = server.server_address[:2]
    error = _load_error(f"https://{host}:{port}/v1", api_key=KEY)  # the server speaks plain HTTP
    assert error.kind == "io" and "TLS error" in error.message

    error = _load_error(endpoint_ref(base_url(server), "no-such-model"), api_key=KEY)
    assert "no model 'no-such-model'" in error.message and "demo" in error.message


def test_server_errors_arrive_as_the_server_gave_them(server, remote):
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as reference_error:
        reference(server, messages=bad)
    rid = remote.service.submit(GenerateRequest(bad, GREEDY))
    error = remote.until_idle(rid)[-2]
    assert isinstance(error, ErrorEvent), error
    assert "400" in error.message and reference_error.value.body["message"] in error.message


def scrape(server, key=KEY) -> tuple[int, dict[str, float]]:
    response = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    if response.status_code != 200:
        return response.status_code, {}
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{label}}}" if label else "")] = sample.value
    return 200, samples


def test_metrics_count_what_the_server_did(server):
    assert scrape(server, key=None)[0] == 401
    status, before = scrape(server)
    assert status == 200
    answer = reference(server, max_tokens=6)
    _, after = scrape(server)
    assert after["expertdesk_tokens_generated_total"] - before["expertdesk_tokens_generated_total"] \
        == answer.usage.completion_tokens
    assert after["expertdesk_prompt_tokens_total"] - before["expertdesk_prompt_tokens_total"] \
        == answer.usage.prompt_tokens
    assert after["expertdesk_requests_total{outcome=finished}"] \
        == before["expertdesk_requests_total{outcome=finished}"] + 1
    hits, misses = after["expertdesk_cache_hits_total"], after["expertdesk_cache_misses_total"]
    assert hits + misses > before["expertdesk_cache_hits_total"] + before["expertdesk_cache_misses_total"]
    assert after["expertdesk_cache_hit_rate"] == pytest.approx(hits / (hits + misses))
    read = after["expertdesk_ssd_read_bytes_total"]
    assert read > 0 and after["expertdesk_cache_bytes"] > 0  # the demo's experts stream from its pack
    tokens = after["expertdesk_tokens_generated_total"]
    assert 0 < after["expertdesk_ssd_bytes_per_token"] <= read / tokens * 1.0001  # replies' reads, not loads'
    assert after["expertdesk_queue_depth"] == 0 and after["expertdesk_requests_running"] == 0


def test_remote_snapshot_carries_the_servers_metrics(server, remote):
    deadline = time.monotonic() + 10
    while "cache_hits" not in (runtime := remote.service.snapshot()["runtime"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    offered = runtime["remote_metrics"]
    assert offered["available"] and offered["url"] == server.url + "/metrics"
    assert {"expert cache hits", "SSD bytes read", "tokens generated", "queue depth"} <= set(offered["offered"])
    assert "KV cache usage" in offered["missing"]  # a vLLM/SGLang quantity ExpertDesk does not have
    _, samples = scrape(server)
    assert runtime["cache_hits"] <= samples["expertdesk_cache_hits_total"]


# ----------------------------------------------------------------------------- the CLI

@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv("EXPERTDESK_TEST_KEY", KEY)
    return ["--api-key-env", "EXPERTDESK_TEST_KEY"]


def test_generate_through_the_endpoint(server, key_env, capsys):
    expected = reference(server, max_tokens=8).choices[0].message.content
    code = main(["generate", "--endpoint", base_url(server), *key_env, "--prompt", MESSAGES[0]["content"],
                 "--temperature", "0", "--max-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == expected + "\n"
    assert "[loaded]" in captured.err and base_url(server) in captured.err and "hit rate n/a" in captured.err


def test_chat_through_the_endpoint(server, key_env, capsys, monkeypatch):
    lines = iter([MESSAGES[0]["content"], "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--endpoint", base_url(server), *key_env, "--temperature", "0", "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "model> " + reference(server, max_tokens=8).choices[0].message.content in captured.out
    assert "stop:" in captured.err


def test_bench_seed10_against_the_endpoint(server, key_env, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--endpoint", base_url(server), *key_env, "--model", reference(server, 1).model,
                 "--suite", "seed10", "--max-tokens", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    text = out.read_text()
    assert KEY not in text  # the key never lands in a record
    record = json.loads(text)
    assert len(record["prompts"]) == 10 and all(r["error"] is None for r in record["prompts"])
    assert all(1 <= r["completion_tokens"] <= 2 and r["prompt_tokens"] > 0 for r in record["prompts"])
    assert all(r["hit_rate"] is None for r in record["prompts"])  # not known for a server model
    assert record["summary"]["Alpaca"]["requests"] == 5 and record["summary"]["MMLU"]["hit_rate"] is None
    assert record["command"].startswith(f"expertdesk bench --endpoint {base_url(server)} --api-key-env")
    assert record["model"]["device"] == base_url(server)


@pytest.mark.parametrize("argv, why", [
    (["generate", "demo", "--endpoint", "http://127.0.0.1:1/v1", "--prompt", "x"], "not both"),
    (["generate", "--prompt", "x"], "--endpoint URL"),
    (["generate", "--endpoint", "ftp://host/v1", "--prompt", "x"], "is not a server URL"),
    (["bench", "--endpoint", "http://127.0.0.1:1/v1", "--api-key-env", "EXPERTDESK_UNSET_KEY"], "is not set"),
    (["chat", "demo", "--model", "m"], "go with --endpoint"),
])
def test_endpoint_usage_errors(argv, why, capsys, monkeypatch):
    monkeypatch.delenv("EXPERTDESK_UNSET_KEY", raising=False)
    assert main(argv) == 2
    assert why in capsys.readouterr().err
