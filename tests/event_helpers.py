"""Reading a chat service's events in tests: one request's events, up to its idle phase.

A service (EngineService, RemoteService) calls `on_event` on its worker thread; tests
that hand it ``queue.Queue.put`` read the queue back with ``until_idle``.
"""

from __future__ import annotations

import queue
import time

from engine.service_events import LOAD_REQUEST_ID, PhaseEvent


def until_idle(events: queue.Queue, request_id: str, timeout: float = 60.0) -> list:
    """The events of `request_id` taken from `events`, up to and including its idle PhaseEvent.

    Events of other requests are taken and dropped; ModelLoadedEvent (no request_id)
    counts as the load's. queue.Empty when `timeout` seconds pass first.
    """
    out, deadline = [], time.monotonic() + timeout
    while True:
        event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if getattr(event, "request_id", LOAD_REQUEST_ID) != request_id:
            continue
        out.append(event)
        if isinstance(event, PhaseEvent) and event.phase == "idle":
            return out
