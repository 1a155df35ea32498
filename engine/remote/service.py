"""RemoteService: a model on an OpenAI-compatible server behind the EngineService interface.

    service = RemoteService(on_event, api_key=os.environ.get("MY_KEY"))
    service.load("http://gpu-box:8000/v1#deepseek-ai/DeepSeek-V4-Flash")  # or a bare base URL
    rid = service.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    service.cancel(rid)        # closes the stream at once; the server sees the disconnect
    service.snapshot(); service.wait_idle(); service.shutdown()

It answers with exactly the events of ``engine.service_events``, in the same order as
the local engine (load: loading progress, ModelLoadedEvent or ErrorEvent, idle; reply:
prefill (waiting for the first token), decoding, TokenEvents, DoneEvent or ErrorEvent,
idle), so the terminal, the desktop app and the bench drive it unchanged. Loading means
connecting: ``GET /v1/models`` must list the model (a bare base URL takes the first).

One worker thread runs an asyncio loop with the official ``openai`` client; requests
run one at a time in submission order. ``cancel`` cancels the running stream's task from
any thread, which closes its HTTP response: the reply ends with DoneEvent
(stop_reason "cancelled") and the text so far. A server's error arrives as ErrorEvent
with the server's status and message (``engine.remote.endpoint.problem_from``).

Where the server publishes Prometheus ``/metrics``, they are read every
``metrics_interval_s`` and ``snapshot()["runtime"]`` carries them under the telemetry
names (``engine.remote.metrics``), with ``remote_metrics`` saying what it offers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.options import RuntimeOptions
from engine.remote.chat_stream import StreamedReply, stream_reply
from engine.remote.endpoint import (
    EndpointProblem,
    ModelCard,
    cards_from,
    metrics_url,
    parse_endpoint_ref,
    problem_from,
)
from engine.remote.metrics import RemoteTelemetry, fetch_metrics
from engine.service_base import Job, QueuedService  # the same requests and bookkeeping as the local engine's
from engine.service_events import (
    LOAD_REQUEST_ID,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    ModelLoadedEvent,
    TokenEvent,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 600.0  # longest silence inside a reply (a long prefill on a busy server)


@dataclass
class _Connected:
    ref: str
    base_url: str
    api_key: str | None
    card: ModelCard
    client: Any  # openai.AsyncOpenAI
    has_metrics: bool


class RemoteService(QueuedService):
    """The EngineService interface over an OpenAI-compatible server (see the module docstring).

    on_event: called on the worker thread, as EngineService's. options: accepted for the
    interface (a server runs its own model). api_key: the bearer key; key_lookup(base_url)
    is asked when api_key is None (the app's keyring). metrics_interval_s: how often
    /metrics is read while connected (None: never; the CLI).
    """

    _what = "remote service"

    def __init__(self, on_event: Callable[[Event], None], options: RuntimeOptions = RuntimeOptions(), *,
                 api_key: str | None = None, key_lookup: Callable[[str], str | None] | None = None,
                 metrics_interval_s: float | None = 1.0, reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        super().__init__(on_event, options)
        self._api_key = api_key
        self._key_lookup = key_lookup
        self._metrics_interval_s = metrics_interval_s
        self._reply_timeout_s = reply_timeout_s
        self._connected: _Connected | None = None
        self._telemetry: RemoteTelemetry | None = None
        self._running: tuple[str, asyncio.Task] | None = None  # touched on the loop thread only
        self._loop = asyncio.new_event_loop()
        self._jobs: asyncio.Queue[Job] = asyncio.Queue()
        self._thread = threading.Thread(target=self._run_loop, name="expertdesk-remote", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)

    def load(self, model_ref: str, options: RuntimeOptions | None = None) -> None:
        """Queue connecting to `model_ref` (base URL, optionally ``#model``); answered like a load."""
        if options is not None:
            self._options = options
        self._put(Job("load", str(model_ref)))

    def set_options(self, options: RuntimeOptions) -> None:
        """Store `options`; when connected, connect again (answered like a load, as EngineService does)."""
        self._options = options
        self._put(Job("options"))

    def cancel(self, request_id: str | None = None) -> None:
        """Stop a reply (None: all); the running one's stream is closed at once."""
        super().cancel(request_id)
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._cancel_running)
            except RuntimeError:  # the loop just closed: nothing is running
                pass

    def snapshot(self) -> dict[str, Any]:
        """The same keys as EngineService.snapshot(); ``runtime`` holds the server's metrics."""
        now = time.time()
        data = self._status_snapshot(now)
        connected, telemetry = self._connected, self._telemetry
        data["model"] = None if connected is None else {
            "name": connected.card.id, "architecture": _architecture(connected.card), "is_demo": connected.card.is_demo,
            "context_length": connected.card.context_length, "device": connected.base_url, "ref": connected.ref}
        data["context_used"] = 0
        runtime: dict[str, Any] = {}
        if connected is not None:
            runtime = dict(telemetry.values) if telemetry is not None else {}
            runtime["remote_metrics"] = {
                "url": metrics_url(connected.base_url), "available": telemetry is not None,
                "offered": list(telemetry.offered) if telemetry is not None else [],
                "missing": list(telemetry.missing) if telemetry is not None else []}
        data["runtime"] = runtime
        data["time"] = now
        return data

    def expert_map(self) -> None:
        """No expert heat map: the server's experts are not ours to see (EngineService has one for packs)."""
        return None

    @property
    def device(self) -> str:
        """Where replies are computed: the server's base URL ("" before a connection)."""
        connected = self._connected
        return connected.base_url if connected is not None else ""

    # ------------------------------------------------------------------ plumbing

    def _enqueue(self, job: Job) -> None:
        self._loop.call_soon_threadsafe(self._jobs.put_nowait, job)

    def _cancel_running(self) -> None:  # on the loop thread
        if self._running is not None and self._is_cancelled(self._running[0]):
            self._running[1].cancel()

    def _run_loop(self) -> None:
        """The worker thread: the loop runs until the stop job, then is closed (its poller and
        connections are released, not left to the garbage collector)."""
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _main(self) -> None:
        poller = asyncio.ensure_future(self._poll_metrics()) if self._metrics_interval_s else None
        while True:
            job = await self._jobs.get()
            try:
                if job.kind == "stop":
                    break
                if job.kind == "load":
                    await self._do_load(job.payload)
                elif job.kind == "options":
                    if self._connected is not None:
                        await self._do_load(self._connected.ref)
                else:
                    await asyncio.ensure_future(self._do_generate(job))
            except BaseException:  # the worker must survive anything
                log.exception("remote worker failed on a %s job", job.kind)
            finally:
                if job.kind != "stop":
                    self._job_finished()
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)  # its httpx client closes on the way out
        await self._disconnect()
        self._worker_stopped()

    async def _disconnect(self) -> None:
        connected, self._connected, self._telemetry = self._connected, None, None
        if connected is not None:
            try:
                await connected.client.close()
            except Exception:
                log.exception("closing the connection to %s failed", connected.base_url)

    # ------------------------------------------------------------------ connecting

    def _key_for(self, base_url: str) -> str | None:
        if self._api_key is not None:
            return self._api_key
        return self._key_lookup(base_url) if self._key_lookup is not None else None

    async def _do_load(self, ref: str) -> None:
        import openai

        rid = LOAD_REQUEST_ID
        await self._disconnect()
        client = None
        try:
            base_url, wanted = parse_endpoint_ref(ref)
            self._set_phase(rid, "loading", detail=f"connecting to {base_url}")
            key = self._key_for(base_url)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=key or "none", max_retries=0,
                                        timeout=openai.Timeout(self._reply_timeout_s, connect=CONNECT_TIMEOUT_S))
            try:
                cards = cards_from(await client.models.list(), base_url)
            except Exception as exc:
                raise problem_from(exc, base_url) from exc
            card = next((c for c in cards if c.id == wanted), None) if wanted else cards[0]
            if card is None:
                raise EndpointProblem("model_not_found", f"{base_url} has no model {wanted!r}; it has: "
                                      f"{', '.join(c.id for c in cards)}")
            has_metrics = await self._scrape(base_url, key) if self._metrics_interval_s else False
        except EndpointProblem as problem:
            if client is not None:
                await client.close()
            self._emit(ErrorEvent(rid, problem.kind, f"cannot use {ref}: {problem.message}"))
        except Exception as exc:
            if client is not None:
                await client.close()
            log.exception("connecting to %s failed", ref)
            self._emit(ErrorEvent(rid, "internal", f"connecting to {ref} failed unexpectedly "
                                  f"({type(exc).__name__}: {exc}); this is a bug, please report it with the log"))
        else:
            self._connected = _Connected(ref, base_url, key, card, client, has_metrics)
            self._emit(ModelLoadedEvent(card.id, _architecture(card), card.is_demo, card.context_length, base_url))
        finally:
            self._to_idle(rid)

    async def _scrape(self, base_url: str, key: str | None) -> bool:
        import httpx

        async with httpx.AsyncClient() as http:
            self._telemetry = await fetch_metrics(http, base_url, key)
        return self._telemetry is not None

    async def _poll_metrics(self) -> None:
        import httpx

        assert self._metrics_interval_s
        async with httpx.AsyncClient() as http:
            while True:
                await asyncio.sleep(self._metrics_interval_s)
                connected = self._connected
                if connected is not None and connected.has_metrics:
                    telemetry = await fetch_metrics(http, connected.base_url, connected.api_key)
                    if telemetry is not None and self._connected is connected:
                        self._telemetry = telemetry

    # ------------------------------------------------------------------ generation

    async def _do_generate(self, job: Job) -> None:
        request: GenerateRequest = job.payload
        rid = request.request_id
        self._start_request(rid)
        reply = StreamedReply(job.submitted)
        try:
            connected = self._connected
            if self._is_cancelled(rid):
                self._emit(DoneEvent(rid, reply.stats("cancelled")))
                return
            if connected is None:
                self._emit(ErrorEvent(rid, "bad_pack", "no server is connected: connect to one first (the last "
                                      "connection failed, or none was requested)"))
                return
            self._update_status(prompt_tokens=0, completion_tokens=0)
            self._set_phase(rid, "prefill", 0, 0, f"waiting for {connected.base_url}")

            def first() -> None:
                self._set_phase(rid, "decoding", 0, request.sampling.max_tokens)

            def text(delta: str, reasoning: bool) -> None:
                self._update_status(completion_tokens=reply.pieces, done=reply.pieces)
                self._emit(TokenEvent(rid, delta, reasoning))

            # From here on a cancel is thrown into the stream (the check above and this line run
            # without a pause, on the loop thread that runs _cancel_running too).
            self._running = (rid, asyncio.current_task())  # type: ignore[assignment]
            try:
                await stream_reply(connected.client, connected.card.id, request, reply, text, first)
            except asyncio.CancelledError:
                self._emit(DoneEvent(rid, reply.stats("cancelled"), reply.text, reply.reasoning_text))
                return
            except Exception as exc:
                problem = problem_from(exc, connected.base_url)
                if self._is_cancelled(rid):  # the close raced the read: it is still a cancel
                    self._emit(DoneEvent(rid, reply.stats("cancelled"), reply.text, reply.reasoning_text))
                else:
                    self._emit(ErrorEvent(rid, problem.kind, problem.message))
                return
            self._emit(DoneEvent(rid, reply.stats("cancelled" if self._is_cancelled(rid) and reply.finish_reason
                                                  is None else None), reply.text, reply.reasoning_text))
        finally:
            self._running = None
            self._end_request(rid)


def _architecture(card: ModelCard) -> str:
    """What the server says the model is (ExpertDesk: its architecture), else "remote"."""
    value = card.extra.get("architecture")
    return str(value) if isinstance(value, str) and value else "remote"
