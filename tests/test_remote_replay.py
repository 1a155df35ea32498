"""The remote client on SGLang's and vLLM's answers: recorded streams replayed by a local Starlette server.

tests/fixtures/remote/README.md says what each file is. The expected text, reasoning and
usage are read from the fixtures here with json, and the expected metric values with
prometheus_client's parser, independently of the client under test.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from engine.remote import EndpointProblem, check_connection, endpoint_ref
from engine.remote.service import RemoteService
from engine.service_events import LOAD_REQUEST_ID, DoneEvent, ErrorEvent, GenerateRequest, ModelLoadedEvent
from engine.text import SamplingParams
from event_helpers import until_idle

FIXTURES = Path(__file__).parent / "fixtures" / "remote"
KEY = "replay-key"


class Replay:
    """A Starlette app on uvicorn in a thread that answers with one server's recorded files."""

    def __init__(self, name: str, *, models: dict | None = None, chat_status: int = 200) -> None:
        self.name = name
        self.models = models if models is not None else json.loads((FIXTURES / f"{name}_models.json").read_text())
        self.chat_status = chat_status
        self.bodies: list[dict] = []
        app = Starlette(routes=[Route("/v1/models", self._models), Route("/metrics", self._metrics),
                                Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Replay:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def _authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    async def _models(self, request: Request):
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "Unauthorized", "type": "invalid_request_error"}}, 401)
        return JSONResponse(self.models)

    async def _metrics(self, request: Request):
        return PlainTextResponse((FIXTURES / f"{self.name}_metrics.txt").read_text(),
                                 media_type="text/plain; version=0.0.4")

    async def _chat(self, request: Request):
        self.bodies.append(await request.json())
        if self.chat_status != 200:
            return JSONResponse(json.loads((FIXTURES / f"{self.name}_error_{self.chat_status}.json").read_text()),
                                self.chat_status)
        blocks = (FIXTURES / f"{self.name}_stream.sse").read_text().split("\n\n")

        async def replay():
            for block in blocks:
                if block:
                    yield block + "\n\n"
                    await asyncio.sleep(0.002)  # one network write per chunk, as a server sends them

        return StreamingResponse(replay(), media_type="text/event-stream")


def expected_reply(name: str) -> tuple[str, str, dict]:
    """(answer, reasoning, usage) of a fixture stream, read with json."""
    answer, reasoning, usage = [], [], None
    for block in (FIXTURES / f"{name}_stream.sse").read_text().split("\n\n"):
        data = block.removeprefix("data: ")
        if not block or data == "[DONE]":
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            answer.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
    return "".join(answer), "".join(reasoning), usage


@pytest.fixture
def connect():
    services = []

    def make(replay: Replay, ref: str | None = None, **kwargs):
        events: queue.Queue = queue.Queue()
        service = RemoteService(events.put, api_key=KEY, **kwargs)
        services.append(service)
        service.load(ref or replay.url)
        return service, events, until_idle(events, LOAD_REQUEST_ID)

    yield make
    for service in services:
        service.shutdown()


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_reasoning_answer_and_usage_from_the_stream(name, connect):
    answer, reasoning, usage = expected_reply(name)
    assert answer and reasoning and usage  # the fixture has all three
    with Replay(name) as replay:
        card = replay.models["data"][0]
        service, events, loaded = connect(replay, endpoint_ref(replay.url, card["id"]), metrics_interval_s=None)
        model = next(e for e in loaded if isinstance(e, ModelLoadedEvent))
        assert model.model_name == card["id"] and model.context_length == card["max_model_len"]
        rid = service.submit(GenerateRequest([{"role": "user", "content": "hi"}],
                                             SamplingParams(temperature=0.0, top_k=0, max_tokens=64), thinking=True))
        reply = until_idle(events, rid)
    done = reply[-2]
    assert isinstance(done, DoneEvent), reply
    assert done.text == answer and done.reasoning == reasoning
    tokens = [e for e in reply if hasattr(e, "reasoning") and hasattr(e, "text") and not isinstance(e, DoneEvent)]
    assert "".join(t.text for t in tokens if t.reasoning) == reasoning  # streamed as the reasoning section
    assert [t.reasoning for t in tokens] == sorted((t.reasoning for t in tokens), reverse=True)  # thinking first
    assert done.stats.prompt_tokens == usage["prompt_tokens"]
    assert done.stats.completion_tokens == usage["completion_tokens"]
    assert done.stats.stop_reason == "eos" and done.stats.ttft_s > 0 and done.stats.decode_tok_s > 0
    body = replay.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == card["id"] and body["temperature"] == 0 and body["max_tokens"] == 64
    assert "top_k" not in body  # 0 (off here) is left to the server's own default
    assert body["chat_template_kwargs"]["thinking"] is True and body["chat_template_kwargs"]["enable_thinking"] is True


def _samples(name: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families((FIXTURES / f"{name}_metrics.txt").read_text()):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@pytest.mark.parametrize("name, queue_name, tokens_name", [
    ("sglang", "sglang:num_queue_reqs", "sglang:generation_tokens_total"),
    ("vllm", "vllm:num_requests_waiting", "vllm:generation_tokens_total"),
])
def test_metrics_of_each_server_are_mapped_and_the_rest_named(name, queue_name, tokens_name, connect):
    samples = _samples(name)
    with Replay(name) as replay:
        service, _, loaded = connect(replay, metrics_interval_s=0.2)
        assert any(isinstance(e, ModelLoadedEvent) for e in loaded), loaded
        runtime = service.snapshot()["runtime"]
    assert runtime["queue_depth"] == samples[queue_name]
    assert runtime["server_tokens_generated"] == samples[tokens_name]
    remote = runtime["remote_metrics"]
    assert remote["available"] and {"queue depth", "tokens generated", "KV cache usage"} <= set(remote["offered"])
    assert {"expert cache hits", "SSD bytes read"} <= set(remote["missing"])  # a GPU server has no SSD experts
    assert "cache_hits" not in runtime and "pack_read_bytes" not in runtime
    if name == "vllm":
        hit_rate = samples["vllm:prefix_cache_hits_total"] / samples["vllm:prefix_cache_queries_total"]
        assert runtime["prefix_cache_hit_rate"] == pytest.approx(hit_rate)


def test_connection_test_and_its_failures():
    with Replay("vllm") as replay:
        report = check_connection(replay.url, KEY)
        assert [m.id for m in report.models] == [m["id"] for m in replay.models["data"]] and report.metrics
        assert "1 model(s)" in report.summary() and "publishes /metrics" in report.summary()
        with pytest.raises(EndpointProblem) as refused:
            check_connection(replay.url, "wrong")
        assert refused.value.reason == "unauthorized" and "401" in refused.value.message
        assert "Unauthorized" in refused.value.message  # the server's own words
    with Replay("vllm", models={"object": "list", "data": []}) as replay:
        with pytest.raises(EndpointProblem) as empty:
            check_connection(replay.url, KEY)
        assert empty.value.reason == "no_models" and "lists no models" in empty.value.message


def test_a_servers_error_body_is_shown_as_it_gave_it(connect):
    said = json.loads((FIXTURES / "vllm_error_400.json").read_text())["message"]
    with Replay("vllm", chat_status=400) as replay:
        service, events, _ = connect(replay, metrics_interval_s=None)
        rid = service.submit(GenerateRequest([{"role": "user", "content": "hi"}]))
        error = until_idle(events, rid)[-2]
    assert isinstance(error, ErrorEvent), error
    assert error.message == f"the server answered 400: {said}"
    assert error.kind == "context_full"  # "maximum context length": the same kind as the local engine's
