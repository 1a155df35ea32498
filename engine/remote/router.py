"""BackendRouter: one service interface for local models and server models, by the model ref.

The desktop app's bridge holds one service. A pack folder, a GGUF file or ``demo`` is
loaded by an ``EngineService``; a ref that is an ``http(s)://`` URL by a
``RemoteService``. Switching between them shuts the other down (releasing the local
model's memory), and events from a backend that is no longer in use are dropped, so a
late ModelLoadedEvent of the previous one can never be taken for the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.options import RuntimeOptions
from engine.remote.endpoint import is_endpoint_ref
from engine.service_events import Event


class BackendRouter:
    """EngineService or RemoteService behind the EngineService interface, chosen per load.

    key_lookup(base_url) gives a server's API key (the app's keyring). The factories
    exist for tests; by default they build the real services.
    """

    def __init__(self, on_event: Callable[[Event], None], options: RuntimeOptions = RuntimeOptions(), *,
                 key_lookup: Callable[[str], str | None] | None = None,
                 local_factory: Callable[..., Any] | None = None,
                 remote_factory: Callable[..., Any] | None = None) -> None:
        self._on_event = on_event
        self._options = options
        self._key_lookup = key_lookup
        self._local_factory = local_factory or _engine_service
        self._remote_factory = remote_factory or _remote_service
        self._active: Any = self._start(remote=False)  # ValueError for a bad device, as EngineService
        self._remote = False

    def _start(self, remote: bool) -> Any:
        holder: list[Any] = []

        def forward(event: Event) -> None:  # only the backend in use may speak
            if holder and holder[0] is self._active:
                self._on_event(event)

        service = (self._remote_factory(forward, self._options, key_lookup=self._key_lookup) if remote
                   else self._local_factory(forward, self._options))
        holder.append(service)
        return service

    def load(self, model_ref: Any, options: RuntimeOptions | None = None) -> None:
        """Load a local model or connect to a server model, switching backends when needed."""
        remote = is_endpoint_ref(str(model_ref))
        if options is not None:
            self._options = options
        if remote != self._remote:
            previous = self._active
            self._active = self._start(remote)  # a ValueError here leaves the previous backend in use
            self._remote = remote
            previous.shutdown(timeout=0)  # it finishes its job on its own thread, then releases the model
        self._active.load(model_ref, options)

    @property
    def is_remote(self) -> bool:
        return self._remote

    @property
    def backend(self) -> Any:
        """The service in use."""
        return self._active

    def set_options(self, options: RuntimeOptions) -> None:
        self._options = options
        self._active.set_options(options)

    def submit(self, request: Any) -> str:
        return self._active.submit(request)

    def cancel(self, request_id: str | None = None) -> None:
        self._active.cancel(request_id)

    def snapshot(self) -> dict[str, Any]:
        return self._active.snapshot()

    def expert_map(self) -> Any:
        return self._active.expert_map()

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._active.wait_idle(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._active.shutdown(timeout)

    @property
    def device(self) -> str:
        return self._active.device

    @property
    def options(self) -> RuntimeOptions:
        return self._options


def _engine_service(on_event: Callable[[Event], None], options: RuntimeOptions) -> Any:
    from engine.service import EngineService

    return EngineService(on_event, options)


def _remote_service(on_event: Callable[[Event], None], options: RuntimeOptions, **kwargs: Any) -> Any:
    from engine.remote.service import RemoteService

    return RemoteService(on_event, options, **kwargs)
