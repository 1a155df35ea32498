"""`expertdesk serve` against hostile or broken clients: only its user gets in, every client
mistake is a 4xx, slow clients cannot starve it, a disconnect cancels, loading is visible.

Every request goes to 127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from app.cli import main
from app.openai_server import ServerEngine, create_server
from engine.options import RuntimeOptions
from server_helpers import cancel_spy, slow_model

CPU = RuntimeOptions(device="cpu")
MESSAGES = [{"role": "user", "content": "What does json.dumps do?"}]
CHAT = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 2}).encode()


# --------------------------------------------------------------------------- helpers

def _serve(engine, **kwargs):
    server = create_server(engine, "127.0.0.1", 0, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def _stop(server, thread):
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def engine(demo_home):
    engine = ServerEngine(CPU)
    engine.load("demo")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    """The default server: loopback, no API key (what `expertdesk serve demo` runs)."""
    srv, thread = _serve(engine)
    yield srv
    _stop(srv, thread)


def _end_process(proc: subprocess.Popen) -> None:
    """Stop a `serve` subprocess: terminate, then kill if it has not ended after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _port(server) -> int:
    return server.server_address[1]


def raw(server, data: bytes, timeout: float = 30.0, *, send_all: bool = True) -> tuple[int, dict, bytes]:
    """Send `data` on a fresh connection and read the whole response (the server closes it:
    every request here says `Connection: close`). Returns (status, headers, body)."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as sock:
        if send_all:
            sock.sendall(data)
        else:
            sock.send(data)
        return _read_response(sock, timeout)


def _read_response(sock: socket.socket, timeout: float) -> tuple[int, dict, bytes]:
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else 0
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    length = headers.get("content-length")
    body = _recv_while(sock, body, lambda got: length is None or len(got) < int(length))
    return status, headers, body


def _recv_while(sock: socket.socket, data: bytes, more: Callable[[bytes], bool]) -> bytes:
    """`data` plus what `sock` sends while `more(data)` holds, up to its end, a reset or a timeout."""
    while more(data):
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return data


def request(server, method: str, path: str, body: bytes = b"", *, host: str | None = None,
            headers: dict[str, str] | None = None, content_type: str | None = "application/json") -> bytes:
    """A raw HTTP/1.1 request with a Host of our choosing (a browser's, a rebinding page's)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host or f'127.0.0.1:{_port(server)}'}", "Connection: close"]
    if content_type is not None and (body or method == "POST"):
        lines.append(f"Content-Type: {content_type}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    for key, value in (headers or {}).items():
        lines.append(f"{key}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _error(body: bytes) -> dict:
    data = json.loads(body)
    assert set(data) == {"error"}, data
    error = data["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"], error
    return error


class _SubmitSpy:
    """Records what reaches EngineService.submit (nothing may, for a refused request)."""

    def __init__(self, monkeypatch, engine):
        self.requests = []
        submit = engine.service.submit

        def spy(req):
            self.requests.append(req)
            return submit(req)

        monkeypatch.setattr(engine.service, "submit", spy)


# --------------------------------------------------------------------------- browsers: Host, Origin, Content-Type

def test_browser_text_plain_post_is_refused(server, engine, monkeypatch):
    """A web page's `fetch(..., {mode: "no-cors", body: JSON, headers: text/plain})` needs no
    preflight: it must not make the model generate."""
    spy = _SubmitSpy(monkeypatch, engine)
    status, headers, body = raw(server, request(server, "POST", "/v1/chat/completions", CHAT,
                                                content_type="text/plain;charset=UTF-8",
                                                headers={"Origin": "https://evil.example"}))
    assert status in (403, 415), body
    _error(body)
    assert "access-control-allow-origin" not in headers
    assert spy.requests == []


def test_foreign_origin_refused_even_with_json(server, engine, monkeypatch):
    spy = _SubmitSpy(monkeypatch, engine)
    for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", b""),
                               ("OPTIONS", "/v1/chat/completions", b"")):
        status, headers, text = raw(server, request(server, method, path, body, headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}))
        assert status == 403, (method, path, text)
        assert _error(text)["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in headers
    assert spy.requests == []


def test_content_type_must_be_json(server, engine, monkeypatch):
    spy = _SubmitSpy(monkeypatch, engine)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         None):
        status, _, body = raw(server, request(server, "POST", "/v1/chat/completions", CHAT,
                                              content_type=content_type))
        assert status == 415, (content_type, body)
        assert _error(body)["code"] == "unsupported_media_type"
    assert spy.requests == []
    status, _, body = raw(server, request(server, "POST", "/v1/chat/completions", CHAT,
                                          content_type="Application/JSON; charset=utf-8"))
    assert status == 200, body


def test_dns_rebinding_host_is_refused(server, engine, monkeypatch):
    """evil.example resolving to 127.0.0.1 makes the browser send `Host: evil.example:PORT`."""
    spy = _SubmitSpy(monkeypatch, engine)
    port = _port(server)
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"localhost.evil:{port}",
                 f"10.0.0.1:{port}"):
        for method, path, body in (("GET", "/v1/models", b""), ("POST", "/v1/chat/completions", CHAT),
                                   ("GET", "/health", b"")):
            status, _, text = raw(server, request(server, method, path, body, host=host))
            assert status == 403, (host, path, text)
            assert _error(text)["code"] == "host_not_allowed"
    assert spy.requests == []
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", "127.0.0.1"):
        status, _, text = raw(server, request(server, "GET", "/v1/models", host=host))
        assert status == 200, (host, text)


def test_allowed_host_and_cors_origin(engine):
    srv, thread = _serve(engine, allowed_hosts=["mybox.lan"], cors_origins=["http://localhost:3000"])
    try:
        port = _port(srv)
        status, _, text = raw(srv, request(srv, "GET", "/v1/models", host=f"mybox.lan:{port}"))
        assert status == 200, text
        status, _, text = raw(srv, request(srv, "GET", "/v1/models", host=f"other.lan:{port}"))
        assert status == 403, text

        # the preflight a browser sends before its JSON POST with a key
        status, headers, text = raw(srv, request(srv, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}))
        assert status == 204, text
        assert headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
        assert "origin" in headers.get("vary", "").lower()

        status, headers, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT,
                                                 headers={"Origin": "http://localhost:3000"}))
        assert status == 200, text
        assert headers["access-control-allow-origin"] == "http://localhost:3000"

        status, headers, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT,
                                                 headers={"Origin": "http://localhost:3001"}))
        assert status == 403 and "access-control-allow-origin" not in headers
        status, _, text = raw(srv, request(srv, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:3001", "Access-Control-Request-Method": "POST"}))
        assert status == 403
    finally:
        _stop(srv, thread)


def test_serve_flags_for_hosts_and_origins(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--cors-origin" in out and "--allow-host" in out
    for bad in ("localhost:3000", "https://x.example/path", "*"):
        assert main(["serve", "demo", "--cors-origin", bad]) == 2
        assert "--cors-origin" in capsys.readouterr().err


def test_empty_api_key_is_a_usage_error(demo_home):
    """`--api-key ""` (an unset shell variable) must not silently mean "no key"."""
    env = {**os.environ, "EXPERTDESK_HOME": str(demo_home)}
    try:
        proc = subprocess.run([sys.executable, "-m", "app", "serve", "demo", "--device", "cpu", "--port", "0",
                               "--api-key", ""], capture_output=True, text=True, env=env, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"serve ran with an empty key instead of refusing it: {exc.stdout!r}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--api-key" in proc.stderr
    with pytest.raises(ValueError, match="api_key"):
        create_server(None, "127.0.0.1", 0, api_key="")


# --------------------------------------------------------------------------- malformed requests: 4xx, never 500

_NESTED = b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
_NESTED_CONTENT = (b'{"messages": [{"role": "user", "content": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}]}")
_HUGE_LITERAL = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}"
_HUGE_TEMPERATURE = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 400 + b"}"
_HUGE_TOP_P = b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1' + b"0" * 400 + b"}"
_SURROGATE = b'{"messages": [{"role": "user", "content": "\\ud800 hi"}], "max_tokens": 2}'
_NAN = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'


@pytest.mark.parametrize("body", [_NESTED, _NESTED_CONTENT, _HUGE_LITERAL, _HUGE_TEMPERATURE, _HUGE_TOP_P,
                                  _SURROGATE, _NAN, b"\xff\xfe{}", b"[]", b'"text"',
                                  b'{"messages": [{"role": "user"}], "stop": 5}'],
                         ids=["nested-array", "nested-object", "huge-int-literal", "huge-int-temperature",
                              "huge-int-top-p", "lone-surrogate", "nan", "not-utf8", "array", "string", "stop-int"])
def test_malformed_json_is_4xx(server, body):
    status, _, text = raw(server, request(server, "POST", "/v1/chat/completions", body))
    assert 400 <= status < 500, (status, text[:300])
    _error(text)


@pytest.mark.parametrize("length", ["\u00b2", "\u0663", "5, 5", "-1", "+5", "0x10", "1e3", "",
                                    "99999999999999999999999"],
                         ids=["superscript", "arabic-digit", "list", "negative", "plus", "hex", "float", "empty",
                              "huge"])
def test_odd_content_length_is_4xx(server, length):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{_port(server)}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()
    status, _, text = raw(server, head + CHAT, timeout=10)
    assert 400 <= status < 500, (status, text[:300])
    _error(text)


def test_bad_http_is_a_json_4xx(server):
    for data in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\n\r\n",  # no Host
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 40_000):  # a head that never ends
        status, _, text = raw(server, data, timeout=10)
        assert 400 <= status < 500, (data[:40], status, text[:300])
        _error(text)


# --------------------------------------------------------------------------- sizes: body cap, check before tokenizing

def test_body_over_the_cap_is_413_at_once(server, engine, monkeypatch):
    """A declared 9 MiB body is refused from its headers alone: nothing is read or tokenized."""
    spy = _SubmitSpy(monkeypatch, engine)
    size = 9 * 2**20
    head = request(server, "POST", "/v1/chat/completions")
    head = head.replace(b"Content-Length: 0", f"Content-Length: {size}".encode())
    started = time.monotonic()
    status, headers, text = raw(server, head + b'{"messages": [', timeout=10)
    assert status == 413, text
    assert _error(text)["code"] == "request_too_large"
    assert time.monotonic() - started < 5
    assert spy.requests == []


def test_chunked_body_over_the_cap_is_413(engine, monkeypatch):
    srv, thread = _serve(engine, max_body_bytes=64 * 1024)
    try:
        spy = _SubmitSpy(monkeypatch, engine)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{_port(srv)}\r\nConnection: close\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        chunk = b"x" * 16384
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
        status, _, text = raw(srv, head + body, timeout=10)
        assert status == 413, text
        assert spy.requests == []
    finally:
        _stop(srv, thread)


def test_over_long_prompt_is_refused_before_tokenizing(server, engine, monkeypatch):
    """1 MB of text cannot fit the demo's context whatever its tokens: answer 400 without
    handing it to the tokenizer (which would take seconds and much memory)."""
    tokenizer = engine.service._loaded.tokenizer
    encode = tokenizer.encode
    sizes = []

    def spy(text, **kwargs):
        sizes.append(len(text))
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    body = json.dumps({"messages": [{"role": "user", "content": "hello world " * 90_000}]}).encode()
    started = time.monotonic()
    status, _, text = raw(server, request(server, "POST", "/v1/chat/completions", body))
    elapsed = time.monotonic() - started
    assert status == 400, text
    assert _error(text)["code"] == "context_length_exceeded"
    assert not any(size > 100_000 for size in sizes), sizes
    assert elapsed < 5


# --------------------------------------------------------------------------- slow clients

def test_silent_and_trickling_clients_are_dropped(engine):
    srv, thread = _serve(engine, header_timeout_s=1.0, body_timeout_s=1.0)
    try:
        address = srv.server_address[:2]
        started = time.monotonic()
        with socket.create_connection(address, timeout=10) as silent, \
                socket.create_connection(address, timeout=10) as trickle:
            trickle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            closed = False
            for _ in range(40):  # one header byte every 0.1 s: never a whole request
                try:
                    trickle.sendall(b"X")
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
            assert silent.recv(1024) == b""  # the server hung up on the connection that sent nothing
            if not closed:
                trickle.settimeout(5)
                try:
                    rest = trickle.recv(1024)
                except ConnectionResetError:
                    rest = b""
                assert b" 200 " not in rest
            assert time.monotonic() - started < 8

        # a body that never arrives: 408 with a JSON error once body_timeout_s has passed
        head = request(srv, "POST", "/v1/chat/completions").replace(b"Content-Length: 0", b"Content-Length: 100")
        status, _, text = raw(srv, head + b'{"messages"', timeout=10)
        assert status == 408, text
        assert _error(text)["code"] == "request_timeout"
        assert raw(srv, request(srv, "GET", "/health"))[0] == 200
    finally:
        _stop(srv, thread)


def _lower_fd_limit():  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_NOFILE is POSIX")
def test_idle_connections_do_not_starve_health(demo_home):
    """300 idle connections to a server allowed 256 file descriptors: /health still answers."""
    env = {**os.environ, "EXPERTDESK_HOME": str(demo_home)}
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "demo", "--device", "cpu", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            preexec_fn=_lower_fd_limit)
    idle: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        port = int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
        for _ in range(300):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        time.sleep(0.5)

        def health() -> int:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
                return _read_response(sock, 5)[0]

        for _ in range(3):
            try:
                assert health() == 200
            except TimeoutError:
                pytest.fail("/health did not answer while idle connections were open")
        assert proc.poll() is None
    finally:
        for sock in idle:
            sock.close()
        _end_process(proc)


def test_queue_is_bounded(engine, monkeypatch):
    """More waiting chat requests than max_queued are answered 429 at once, not held open."""
    srv, thread = _serve(engine, max_queued=1)
    release = threading.Event()
    model = engine.service._loaded.model
    forward = model.forward

    def held_forward(*args, **kwargs):
        release.wait(20)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", held_forward)
    results = []
    try:
        first = threading.Thread(target=lambda: results.append(raw(srv, request(srv, "POST", "/v1/chat/completions",
                                                                                 CHAT), timeout=60)))
        first.start()
        deadline = time.monotonic() + 20
        while engine.service.snapshot()["phase"] == "idle" and time.monotonic() < deadline:
            time.sleep(0.02)
        status, headers, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT), timeout=10)
        assert status == 429, text
        assert _error(text)["code"] == "server_busy" and "retry-after" in headers
        assert raw(srv, request(srv, "GET", "/health"), timeout=10)[0] == 200
        release.set()
        first.join(60)
        assert results and results[0][0] == 200, results
    finally:
        release.set()
        monkeypatch.undo()
        _stop(srv, thread)


# --------------------------------------------------------------------------- disconnects and cancelled replies

def test_non_streaming_request_cancelled_when_client_disconnects(server, engine, monkeypatch):
    slow_model(monkeypatch, engine)
    cancelled = cancel_spy(monkeypatch, engine)
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 400}).encode()
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(request(server, "POST", "/v1/chat/completions", body))
        deadline = time.monotonic() + 30
        while engine.service.snapshot()["phase"] != "decoding" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.service.snapshot()["phase"] == "decoding"
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(cancelled) == 1 and cancelled[0], "the disconnect did not cancel the request"
    assert engine.service.wait_idle(10)
    assert engine.service.snapshot()["completion_tokens"] < 200


def test_stalled_stream_reader_is_cancelled(engine, monkeypatch):
    """A client that stops reading its stream is given write_timeout_s, then its request is cancelled."""
    from app.openai_server import ServerLimits, _ChatResponse, _State, parse_chat_request

    slow_model(monkeypatch, engine, 0.02)
    cancelled = cancel_spy(monkeypatch, engine)
    state = _State(engine, None, ServerLimits(write_timeout_s=0.5))
    chat, _, _ = parse_chat_request({"messages": MESSAGES, "temperature": 0, "max_tokens": 400})
    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) >= 3:
            await asyncio.sleep(60)  # the socket's buffers are full: the client reads nothing

    async def receive():
        await asyncio.sleep(60)  # never disconnects either
        return {"type": "http.disconnect"}

    async def run():
        await asyncio.wait_for(_ChatResponse(state, chat, "m", True, False)({"type": "http"}, receive, send), 10)

    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 5
    assert cancelled == [chat.request_id]
    assert engine.service.wait_idle(10)
    assert engine.service.snapshot()["completion_tokens"] < 200


def _sse_events(sock: socket.socket, timeout: float, data: bytes = b"") -> list[str]:
    """The `data:` lines of a streamed response; `data` is what was already received of it."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    data = _recv_while(sock, data, lambda _: time.monotonic() < deadline)
    _, _, body = data.partition(b"\r\n\r\n")
    text = body.decode("utf-8", "replace")
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_stream_cut_by_server_stop_is_not_reported_as_stop(engine, monkeypatch):
    """Ctrl+C on `serve` mid-reply: the client must learn the reply was cut, not "stop"."""
    srv, thread = _serve(engine)
    slow_model(monkeypatch, engine)
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 400, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    try:
        with socket.create_connection(srv.server_address[:2], timeout=30) as sock:
            sock.sendall(request(srv, "POST", "/v1/chat/completions", body))
            first = sock.recv(4096)
            assert b" 200 " in first.split(b"\r\n", 1)[0], first
            time.sleep(0.3)  # a few tokens
            stopper = threading.Thread(target=srv.shutdown)  # what Ctrl+C runs
            stopper.start()
            events = _sse_events(sock, 15, first)
            stopper.join(15)
        data = [json.loads(e) for e in events if e != "[DONE]"]
        finishes = [c["choices"][0]["finish_reason"] for c in data if c.get("choices")]
        assert "stop" not in finishes and "length" not in finishes, finishes
        errors = [c["error"] for c in data if "error" in c]
        assert errors and errors[-1]["code"] == "cancelled", data[-3:]
    finally:
        monkeypatch.undo()
        srv.server_close()
        thread.join(10)
        engine.service.wait_idle(30)


def test_stream_cancelled_by_the_engine_is_not_stop(server, engine, monkeypatch):
    """A reply the engine cancelled (not the client: shutdown, another front end) ends honestly."""
    slow_model(monkeypatch, engine)
    body = json.dumps({"messages": MESSAGES, "temperature": 0, "max_tokens": 400, "stream": True}).encode()
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(request(server, "POST", "/v1/chat/completions", body))
        first = sock.recv(4096)
        assert b" 200 " in first.split(b"\r\n", 1)[0], first
        time.sleep(0.3)
        engine.service.cancel(None)
        events = _sse_events(sock, 15, first)
    data = [json.loads(e) for e in events if e != "[DONE]"]
    finishes = [c["choices"][0]["finish_reason"] for c in data if c.get("choices")]
    assert "stop" not in finishes, finishes
    assert any(c.get("error", {}).get("code") == "cancelled" for c in data), data[-3:]
    assert engine.service.wait_idle(10)


# --------------------------------------------------------------------------- bind first, then load

def test_binds_first_and_reports_loading(demo_home, monkeypatch):
    import engine.demo

    gate = threading.Event()
    build = engine.demo.ensure_demo_pack

    def slow_pack(home=None, progress=None):
        for step in range(3):
            if progress is not None:
                progress(step, 3, f"demo step {step}")
            if step == 1:
                gate.wait(30)
        return build(home, progress)

    monkeypatch.setattr(engine.demo, "ensure_demo_pack", slow_pack)
    eng = ServerEngine(CPU)
    srv, thread = _serve(eng)
    try:
        eng.start_loading("demo")
        deadline = time.monotonic() + 20
        health = {}
        while time.monotonic() < deadline:
            status, _, text = raw(srv, request(srv, "GET", "/health"))
            health = json.loads(text)
            if health.get("progress", {}).get("detail") == "demo step 1":
                break
            time.sleep(0.05)
        assert status == 503 and health["status"] == "loading", health
        assert health["progress"]["done"] == 1 and health["progress"]["total"] == 3
        status, headers, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT))
        assert status == 503 and _error(text)["code"] == "model_loading" and "retry-after" in headers
        assert raw(srv, request(srv, "GET", "/v1/models"))[0] == 503
        gate.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, _, text = raw(srv, request(srv, "GET", "/health"))
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200 and json.loads(text)["status"] == "ok", text
        status, _, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT))
        assert status == 200, text
    finally:
        gate.set()
        _stop(srv, thread)
        eng.close()


def test_failed_load_is_reported(tmp_path):
    eng = ServerEngine(CPU)
    srv, thread = _serve(eng)
    try:
        eng.start_loading(str(tmp_path / "missing.gguf"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, _, text = raw(srv, request(srv, "GET", "/health"))
            if json.loads(text)["status"] != "loading":
                break
            time.sleep(0.05)
        health = json.loads(text)
        assert status == 503 and health["status"] == "error" and "missing.gguf" in health["error"], health
        status, _, text = raw(srv, request(srv, "POST", "/v1/chat/completions", CHAT))
        assert status == 503 and _error(text)["code"] == "no_model"
    finally:
        _stop(srv, thread)
        eng.close()


def test_serve_command_listens_before_loading(demo_home):
    env = {**os.environ, "EXPERTDESK_HOME": str(demo_home)}
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "demo", "--device", "cpu", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("[loaded]"):
                break
        listening = [i for i, line in enumerate(lines) if line.startswith("[listening] http://127.0.0.1:")]
        loaded = [i for i, line in enumerate(lines) if line.startswith("[loaded]")]
        assert listening and loaded and listening[0] < loaded[0], lines
        assert "Serving" in proc.stdout.readline()
    finally:
        _end_process(proc)


@pytest.mark.parametrize("where", ["tool call arguments", "tool declarations"])
def test_tools_count_towards_the_prompt_bound(where):
    """The chat format renders tools and earlier calls into the prompt: they count against
    the bytes-per-token bound like message text, or 8 MiB bodies reach the tokenizer."""
    from app.openai_server import check_prompt_size, parse_chat_request
    from app.server_params import ApiError
    from engine.service_events import ModelLoadedEvent

    model = ModelLoadedEvent("ds4", "deepseek4", False, context_length=100, device="cpu", chat_format="deepseek-v4")
    big = "x" * 10_000  # the bound: 100 tokens x 8 bytes = 800 bytes
    messages = [{"role": "user", "content": "hi"}]
    body: dict = {"messages": messages}
    if where == "tool call arguments":
        call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + big + '"}'}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": big}}]
    chat, _, _ = parse_chat_request(body)
    check_prompt_size(parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})[0], model, 8)  # fits
    with pytest.raises(ApiError, match="more than 800 bytes"):
        check_prompt_size(chat, model, 8)
