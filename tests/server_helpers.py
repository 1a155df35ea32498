"""A demo-model server for the HTTP tests, and the spies they watch it with.

`serving_demo()` runs `app.openai_server` in this process on a free loopback port (the
engine on the CPU, the demo built once per session); `slow_model` and `cancel_spy`
make a reply long enough to be interrupted and record what the server cancelled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from app.openai_server import OpenAIServer, ServerEngine, create_server
from engine.options import RuntimeOptions


@contextlib.contextmanager
def serving_demo(api_key: str | None = None) -> Iterator[OpenAIServer]:
    """The demo model served on 127.0.0.1 (port 0: a free one) until the block ends."""
    engine = ServerEngine(RuntimeOptions(device="cpu"))
    engine.load("demo")
    server = create_server(engine, "127.0.0.1", 0, api_key=api_key)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        engine.close()


def slow_model(monkeypatch, engine: ServerEngine, delay: float = 0.05) -> None:
    """Every forward pass of the loaded model takes `delay` seconds longer."""
    model = engine.service._loaded.model
    forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_forward)


def cancel_spy(monkeypatch, engine: ServerEngine) -> list:
    """The request ids the engine is asked to cancel, appended as it happens."""
    cancelled: list = []
    cancel = engine.service.cancel
    monkeypatch.setattr(engine.service, "cancel", lambda rid=None: (cancelled.append(rid), cancel(rid)))
    return cancelled
