"""API keys of remote servers, kept in the system keyring (``keyring``), never in settings or logs.

One key per server base URL (``http://gpu-box:8000/v1``): the model refs of that server
(``URL#model``) share it. The keyring is the desktop's own secret store (Secret Service
on Linux, Keychain on macOS, Credential Manager on Windows); without one, storing a key
fails with ``KeyStoreError`` saying so, and nothing is written anywhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import keyring
import keyring.errors

from engine.remote import normalize_base_url

log = logging.getLogger(__name__)

SERVICE = "ExpertDesk remote servers"


class KeyStoreError(RuntimeError):
    """The system keyring cannot store (or give back) a key; the message says what to do."""


def store_api_key(base_url: str, key: str) -> None:
    """Keep `key` for the server at `base_url` in the keyring (KeyStoreError if there is none usable)."""
    try:
        keyring.set_password(SERVICE, normalize_base_url(base_url), key)
    except keyring.errors.KeyringError as exc:
        raise KeyStoreError(f"the API key could not be stored in the system keyring ({exc}). Unlock or install a "
                            "keyring (e.g. GNOME Keyring / KWallet on Linux), or use a server without a key; the key "
                            "was not saved anywhere") from None


def api_key_for(base_url: str) -> str | None:
    """The stored key of the server at `base_url`, None when there is none (or no keyring)."""
    try:
        return keyring.get_password(SERVICE, normalize_base_url(base_url))
    except keyring.errors.KeyringError as exc:
        log.warning("the system keyring could not be read (%s); connecting without an API key", type(exc).__name__)
        return None


def forget_api_key(base_url: str) -> None:
    """Delete the stored key of the server at `base_url` (nothing happens when there is none)."""
    try:
        keyring.delete_password(SERVICE, normalize_base_url(base_url))
    except keyring.errors.PasswordDeleteError:
        pass
    except keyring.errors.KeyringError as exc:
        raise KeyStoreError(f"the API key could not be removed from the system keyring ({exc})") from None


def forget_key_unless_used(ref: str, refs_in_use: Iterable[str]) -> None:
    """After a server model `ref` was removed: forget its server's key when no model in use is on that server."""
    from engine.remote import is_endpoint_ref, parse_endpoint_ref

    server = parse_endpoint_ref(ref)[0]
    if not any(is_endpoint_ref(other) and parse_endpoint_ref(other)[0] == server for other in refs_in_use):
        forget_api_key(server)
