"""Local engine or server by the model ref (BackendRouter), and API keys in the keyring only (app.remote_keys)."""

from __future__ import annotations

import keyring
import keyring.backends.fail
import pytest

from app.remote_keys import (
    SERVICE,
    KeyStoreError,
    api_key_for,
    forget_api_key,
    forget_key_unless_used,
    store_api_key,
)
from engine.remote.router import BackendRouter
from engine.service_events import ModelLoadedEvent
from test_remote_gui import memory_keyring  # noqa: F401  (a keyring of this test process)


class FakeService:
    """Records what the router asks; `say(event)` speaks as this backend would, on its own."""

    def __init__(self, on_event, options=None, **kwargs) -> None:
        self.say, self.options, self.kwargs = on_event, options, kwargs
        self.loads: list[str] = []
        self.closed = False

    def load(self, ref, options=None) -> None:
        self.loads.append(ref)

    def shutdown(self, timeout=10.0) -> None:
        self.closed = True


def _loaded(name: str) -> ModelLoadedEvent:
    return ModelLoadedEvent(name, "x", False, 1, "cpu")


def test_router_switches_backends_and_silences_the_old_one():
    heard: list = []
    lookup = object()
    router = BackendRouter(heard.append, key_lookup=lookup, local_factory=FakeService, remote_factory=FakeService)
    local = router.backend
    router.load("demo")
    assert local.loads == ["demo"] and not router.is_remote
    router.load("http://gpu-box:8000/v1#m")
    remote = router.backend
    assert router.is_remote and remote is not local and local.closed  # the local model is released
    assert remote.loads == ["http://gpu-box:8000/v1#m"] and remote.kwargs == {"key_lookup": lookup}
    local.say(_loaded("late local load"))  # finished after the switch: must not pass for the server's
    remote.say(_loaded("server"))
    assert [e.model_name for e in heard] == ["server"]
    router.load("http://other:1/v1#n")  # remote to remote: the same backend connects elsewhere
    assert router.backend is remote and remote.loads[-1] == "http://other:1/v1#n"
    router.load("/packs/model.expertpack")
    assert not router.is_remote and remote.closed and router.backend is not local  # a fresh local engine


def test_keys_are_kept_per_server_in_the_keyring(memory_keyring):
    store_api_key("http://gpu-box:8000", "k1")  # no path: the same server as .../v1
    assert memory_keyring.passwords == {(SERVICE, "http://gpu-box:8000/v1"): "k1"}
    assert api_key_for("http://gpu-box:8000/v1/") == "k1" and api_key_for("http://other:8000/v1") is None
    forget_api_key("http://gpu-box:8000/v1")
    forget_api_key("http://gpu-box:8000/v1")  # already gone: nothing to do
    assert api_key_for("http://gpu-box:8000/v1") is None


def test_a_servers_key_goes_with_its_last_model(memory_keyring):
    store_api_key("http://gpu-box:8000/v1", "k1")
    forget_key_unless_used("http://gpu-box:8000/v1#a", ["demo", "http://gpu-box:8000/v1#b", "/packs/x.expertpack"])
    assert api_key_for("http://gpu-box:8000/v1") == "k1"  # model b still uses it
    forget_key_unless_used("http://gpu-box:8000/v1#b", ["demo", "http://other:8000/v1#b"])
    assert api_key_for("http://gpu-box:8000/v1") is None


def test_without_a_keyring_the_key_is_refused_not_kept_elsewhere():
    previous = keyring.get_keyring()
    keyring.set_keyring(keyring.backends.fail.Keyring())
    try:
        with pytest.raises(KeyStoreError, match="system keyring"):
            store_api_key("http://gpu-box:8000/v1", "k1")
        assert api_key_for("http://gpu-box:8000/v1") is None  # connecting without a key still works
    finally:
        keyring.set_keyring(previous)


def test_a_shut_down_remote_service_closes_its_loop():
    """Its event loop and metrics poller are released at shutdown, not at garbage collection."""
    from engine.remote.service import RemoteService

    services = [RemoteService(lambda e: None, metrics_interval_s=1.0) for _ in range(3)]
    for service in services:
        service.shutdown()
        assert not service._thread.is_alive() and service._loop.is_closed()
