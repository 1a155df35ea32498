"""`expertdesk serve`: the OpenAI-compatible HTTP server on the demo model."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from app.cli import main
from app.openai_server import RemoteHostError, ServerEngine, create_server, is_loopback, parse_chat_request
from engine.options import RuntimeOptions
from engine.service import EngineService
from engine.service_events import DoneEvent, GenerateRequest, PhaseEvent
from engine.text import SamplingParams

CPU = RuntimeOptions(device="cpu")
KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "What does json.dumps do?"}]



def _start(api_key=None):
    engine = ServerEngine(CPU)
    engine.load("demo")
    server = create_server(engine, "127.0.0.1", 0, api_key=api_key)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return engine, server, thread


def _stop(engine, server, thread):
    server.shutdown()
    server.server_close()
    thread.join(10)
    engine.close()


@pytest.fixture(scope="module")
def server(demo_home):
    engine, srv, thread = _start(api_key=KEY)
    yield srv
    _stop(engine, srv, thread)


def call(server, path, body=None, *, key=KEY, raw=None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


def reference_text(max_tokens: int) -> DoneEvent:
    """What EngineService itself answers for the same greedy request."""
    events: queue.Queue = queue.Queue()
    service = EngineService(events.put, CPU)
    try:
        service.load("demo")
        rid = service.submit(GenerateRequest(MESSAGES, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
        done = None
        while True:
            event = events.get(timeout=60)
            if isinstance(event, DoneEvent) and event.request_id == rid:
                done = event
            if isinstance(event, PhaseEvent) and event.phase == "idle" and event.request_id == rid:
                return done
    finally:
        service.shutdown()


def test_models_and_health(server):
    status, headers, text = call(server, "/v1/models")
    assert status == 200 and headers["Content-Type"] == "application/json"
    data = json.loads(text)
    assert data["object"] == "list" and len(data["data"]) == 1
    card = data["data"][0]
    assert card["object"] == "model" and card["is_demo"] is True and "demo" in card["id"]
    status, _, text = call(server, "/health", key=None)
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_greedy_completion_matches_engine_and_stream(server):
    ref = reference_text(16)
    assert isinstance(ref, DoneEvent) and ref.text
    body = {"model": "expertdesk-demo", "messages": MESSAGES, "temperature": 0, "max_tokens": 16}

    status, _, text = call(server, "/v1/chat/completions", body)
    assert status == 200, text
    data = json.loads(text)
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == ref.text
    assert choice["finish_reason"] == {"eos": "stop", "max_tokens": "length"}[ref.stats.stop_reason]
    usage = data["usage"]
    assert usage["prompt_tokens"] == ref.stats.prompt_tokens > 0
    assert usage["completion_tokens"] == ref.stats.completion_tokens > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    status, headers, text = call(server, "/v1/chat/completions",
                                 {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(block[len("data: "):]) for block in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == ref.text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == choice["finish_reason"] and not any(finishes[:-1])
    assert chunks[-1]["usage"] == usage


def test_concurrent_requests_wait_their_turn(server):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    results = []

    def worker():
        results.append(call(server, "/v1/chat/completions", body))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200, 200, 200], results
    texts = {json.loads(r[2])["choices"][0]["message"]["content"] for r in results}
    assert len(texts) == 1  # same greedy answer, one request at a time


def test_client_disconnect_mid_stream_cancels(server, monkeypatch):
    service = server.engine.service
    model = service._loaded.model
    forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_forward)
    cancelled = []
    cancel = service.cancel
    monkeypatch.setattr(service, "cancel", lambda rid=None: (cancelled.append(rid), cancel(rid)))
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 200, "stream": True}).encode()
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        assert b"200" in sock.recv(64)  # the status line: streaming has started
    deadline = time.time() + 30
    while not cancelled and time.time() < deadline:
        time.sleep(0.05)
    assert len(cancelled) == 1 and cancelled[0], "the disconnect did not cancel the request"
    assert service.wait_idle(30)
    full = reference_text(200).stats.completion_tokens
    assert service.snapshot()["completion_tokens"] < full
    monkeypatch.undo()
    status, _, text = call(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200, text  # the server still serves


def test_stop_string_and_length(server):
    status, _, text = call(server, "/v1/chat/completions",
                           {"messages": MESSAGES, "temperature": 0, "max_completion_tokens": 1, "seed": 3})
    assert status == 200, text
    data = json.loads(text)
    assert data["usage"]["completion_tokens"] == 1
    assert data["choices"][0]["finish_reason"] in ("length", "stop")


def test_api_key_enforced(server):
    body = {"messages": MESSAGES, "max_tokens": 1}
    for key in (None, "wrong"):
        status, headers, text = call(server, "/v1/chat/completions", body, key=key)
        assert status == 401, text
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
        assert call(server, "/v1/models", key=key)[0] == 401


def test_bad_requests(server):
    status, _, text = call(server, "/v1/chat/completions", raw=b"{not json")
    assert status == 400
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["type"] == "invalid_request_error"
    for body in ({"messages": []}, {"messages": MESSAGES, "temperature": -1}, {"messages": MESSAGES, "n": 2},
                 {"messages": [{"role": "tool", "content": "x"}]}, {"messages": MESSAGES, "stop": 5}):
        status, _, text = call(server, "/v1/chat/completions", body)
        assert status == 400, (body, text)
        assert json.loads(text)["error"]["message"]
    status, _, text = call(server, "/v1/nothing")
    assert status == 404 and json.loads(text)["error"]["code"] == "not_found"
    assert call(server, "/v1/chat/completions")[0] == 405  # GET on a POST route


def test_parse_maps_openai_fields():
    request, stream, usage = parse_chat_request({
        "messages": [{"role": "developer",
                      "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                     {"role": "user", "content": "hi"}],
        "temperature": 0.2, "top_p": 0.5, "max_tokens": 7, "seed": 1, "stop": "END", "stream": True})
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    p = request.sampling
    assert (p.temperature, p.top_p, p.max_tokens, p.seed, p.stop) == (0.2, 0.5, 7, 1, ("END",))
    assert stream is True and usage is False


def test_non_loopback_host_refused(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    with pytest.raises(RemoteHostError, match="--allow-remote"):
        create_server(None, "0.0.0.0", 0)  # refused before the engine is used
    assert main(["serve", "demo", "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_serve_command_prints_url_and_stops_on_ctrl_c(demo_home):
    env = {**os.environ, "EXPERTDESK_HOME": str(demo_home)}
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "demo", "--device", "cpu", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(url + "/models", timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["is_demo"] is True
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--allow-remote", "--device", "--cache-mib", "--host-cache-mib"):
        assert flag in out
