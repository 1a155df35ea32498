"""The request bookkeeping every chat service shares: jobs, cancel marks, phases, idling.

EngineService (the local engine, `engine.service`) and RemoteService (a server,
`engine.remote.service`) answer the same requests with the same events on one worker
each; what differs is how a job reaches the worker (a `queue.Queue`, an asyncio loop)
and what the worker does with it. ``QueuedService`` holds the rest once, so both count
outstanding jobs, mark cancels, time phases and go back to idle the same way:

    class MyService(QueuedService):
        _what = "my service"                        # named when a shut-down service is used
        def __init__(self, on_event, options):
            super().__init__(on_event, options)
            self._thread = threading.Thread(target=self._run, daemon=True); self._thread.start()
        def _enqueue(self, job): ...                # hand `job` to the worker thread

The worker calls ``_job_finished()`` after every job but "stop", ``_worker_stopped()``
when it leaves, and ends each request with ``_end_request`` (a load with ``_to_idle``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.options import RuntimeOptions
from engine.service_events import LOAD_REQUEST_ID, Event, GenerateRequest, PhaseEvent

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One unit of work for a service's worker, in submission order."""

    kind: str  # "load" | "options" | "generate" | "stop"
    payload: Any = None
    submitted: float = field(default_factory=time.perf_counter)


class QueuedService:
    """The public request API and the thread-safe status both services share (see the module docstring).

    Subclasses set ``_thread`` (the worker) and implement ``_enqueue``. `on_event` is
    called on the worker thread with every event; a listener that raises is logged,
    never allowed to stop the worker.
    """

    _what = "service"  # how the error after shutdown names it ("the engine service")
    _thread: threading.Thread

    def __init__(self, on_event: Callable[[Event], None], options: RuntimeOptions) -> None:
        self._on_event = on_event
        self._options = options
        self._lock = threading.Lock()  # guards the small fields below; never held during compute or I/O
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0  # jobs submitted and not finished (for wait_idle)
        self._pending: list[str] = []  # request ids queued, not started
        self._cancelled: set[str] = set()
        self._status: dict[str, Any] = {
            "phase": "idle", "request_id": None, "done": 0, "total": 0, "detail": "",
            "phase_started": time.time(), "prompt_tokens": 0, "completion_tokens": 0,
        }
        self._closed = False

    # ------------------------------------------------------------------ public API (any thread)

    def submit(self, request: GenerateRequest) -> str:
        """Queue one reply to generate; returns its request_id at once."""
        if not isinstance(request, GenerateRequest):
            raise TypeError(f"submit() takes a GenerateRequest, not {type(request).__name__}")
        with self._lock:
            self._pending.append(request.request_id)
        self._put(Job("generate", request))
        return request.request_id

    def cancel(self, request_id: str | None = None) -> None:
        """Stop a request: a queued one before it starts, the running one within one decode step
        (EngineService) or at once (RemoteService closes its stream).

        None cancels the running request and every queued one. A cancelled request ends
        with DoneEvent(stats.stop_reason="cancelled") carrying the text produced so far.
        """
        with self._lock:
            if request_id is None:
                self._cancelled.update(self._pending)
                current = self._status.get("request_id")
                if current and current != LOAD_REQUEST_ID:
                    self._cancelled.add(current)
            else:
                self._cancelled.add(request_id)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued load/request has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the worker and let it release what it holds (idempotent)."""
        if self._closed:
            return
        self.cancel(None)
        self._closed = True
        self._enqueue(Job("stop"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def options(self) -> RuntimeOptions:
        """The options models are loaded with (as given; `device` says where replies are computed)."""
        return self._options

    # ------------------------------------------------------------------ for the subclass

    def _enqueue(self, job: Job) -> None:
        """Hand `job` to the worker thread (from any thread)."""
        raise NotImplementedError

    def _put(self, job: Job) -> None:
        if self._closed:
            raise RuntimeError(f"the {self._what} was shut down; create a new {type(self).__name__}")
        with self._lock:
            self._outstanding += 1
        self._enqueue(job)

    def _emit(self, event: Event) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken listener must not take the service down
            log.exception("the on_event callback raised while handling %s", type(event).__name__)

    def _set_phase(self, request_id: str | None, phase: str, done: int = 0, total: int = 0, detail: str = "",
                   emit: bool = True, **extra: Any) -> None:
        with self._lock:
            if phase != self._status["phase"] or request_id != self._status["request_id"]:
                self._status["phase_started"] = time.time()
            self._status.update(phase=phase, request_id=request_id, done=done, total=total, detail=detail, **extra)
        if emit:
            self._emit(PhaseEvent(request_id or "", phase, done, total, detail))  # type: ignore[arg-type]

    def _update_status(self, **values: Any) -> None:
        with self._lock:
            self._status.update(values)

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _status_snapshot(self, now: float) -> dict[str, Any]:
        """The shared keys of snapshot(): the status, queued and phase_elapsed_s (at `now`)."""
        with self._lock:
            data = dict(self._status)
            data["queued"] = len(self._pending)
        data["phase_elapsed_s"] = now - data.pop("phase_started")
        return data

    def _start_request(self, request_id: str) -> None:
        """The worker took `request_id` off the queue: it no longer counts as queued."""
        with self._lock:
            if request_id in self._pending:
                self._pending.remove(request_id)

    def _to_idle(self, request_id: str) -> None:
        """Back to idle; the idle PhaseEvent names the load or request that just ended."""
        self._set_phase(None, "idle", emit=False)
        self._emit(PhaseEvent(request_id, "idle"))

    def _end_request(self, request_id: str) -> None:
        """`request_id` has ended (done, failed or cancelled): forget its cancel mark, go idle."""
        with self._lock:
            self._cancelled.discard(request_id)
        self._to_idle(request_id)

    def _job_finished(self) -> None:
        """The worker finished a job (any kind but "stop"): wake wait_idle() when none is left."""
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def _worker_stopped(self) -> None:
        """The worker has left: nothing will run any more, so nobody waits for it."""
        with self._idle:
            self._outstanding = 0
            self._idle.notify_all()
