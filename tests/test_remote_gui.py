"""The desktop app on a model served by `expertdesk serve demo`: add the server, test it, chat, telemetry.

The server is the real one (tests/test_serve.py's fixture); the API key goes to a
keyring backend of this test (keyring.set_keyring), and the test checks that no file
the app writes holds it.
"""

from __future__ import annotations

import keyring
import keyring.backend
import keyring.errors
import openai
import pytest

from app.remote_keys import SERVICE
from gui_helpers import gui_env, open_window, send_and_wait, set_sampling  # noqa: F401 (fixtures)
from test_serve import KEY, server  # noqa: F401  (the live `expertdesk serve demo` fixture)


class MemoryKeyring(keyring.backend.KeyringBackend):
    """A keyring that keeps passwords in this process (the test's stand-in for the desktop's)."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def set_password(self, service, username, password):
        self.passwords[(service, username)] = password

    def get_password(self, service, username):
        return self.passwords.get((service, username))

    def delete_password(self, service, username):
        if self.passwords.pop((service, username), None) is None:
            raise keyring.errors.PasswordDeleteError(username)


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def _test_connection(qtbot, dialog, url: str, key: str) -> str:
    dialog.url_edit.setText(url)
    dialog.key_edit.setText(key)
    dialog.test_button.click()
    qtbot.waitUntil(lambda: dialog.test_button.isEnabled(), timeout=30_000)
    return dialog.result.text()


def test_add_a_server_and_chat_with_its_model(qtbot, open_window, server, memory_keyring, gui_env, log_dir):
    base_url = server.url + "/v1"
    model_id = openai.OpenAI(base_url=base_url, api_key=KEY).models.list().data[0].id
    window = open_window()  # the local demo first: switching to the server must release it
    library = window.open_model_library()
    dialog = library.add_server()

    refused = _test_connection(qtbot, dialog, base_url, "wrong-key")
    assert "API key refused" in refused and "401" in refused and not dialog.add_button.isEnabled()
    result = _test_connection(qtbot, dialog, base_url, KEY)
    assert "Connected" in result and "publishes /metrics" in result, result
    assert dialog.model_combo.currentData() == model_id
    dialog.add_button.click()

    ref = f"{base_url}#{model_id}"
    assert memory_keyring.passwords == {(SERVICE, base_url): KEY}
    assert library.entry(ref) is not None and library.row_text(ref)[3] == base_url
    assert ref in [m.ref for m in window.app_settings.models]

    window.load_model(ref)
    qtbot.waitUntil(lambda: window.bridge.loaded is not None and window.bridge.model_ref == ref, timeout=30_000)
    assert window.bridge.loaded.model_name == model_id and window.bridge._service.is_remote
    set_sampling(window, max_tokens=6, temperature=0.0)
    message_id = send_and_wait(qtbot, window, "What does json.dumps do?")
    reply = window.history.messages(window.controller.current_id)[-1]
    assert reply.id == message_id and reply.status == "finished" and reply.model_ref == ref
    assert reply.stats["completion_tokens"] == 6 and reply.stats["stop_reason"] == "max_tokens"
    assert reply.content or reply.reasoning
    stats_line = window.chat_view.widgets[-1].stats_text
    assert "6 tokens" in stats_line and "TTFT" in stats_line and "hit rate" not in stats_line  # unknown: left out

    qtbot.waitUntil(lambda: "From the server's /metrics" in window.telemetry.remote_label.text(), timeout=10_000)
    note = window.telemetry.remote_label.text()
    assert "expert cache hits" in note and "Not offered by this server: KV cache usage" in note

    written = [p for folder in (gui_env, log_dir) for p in folder.rglob("*") if p.is_file()]
    assert written and not [p for p in written if KEY.encode() in p.read_bytes()]  # the key is only in the keyring
