"""The desktop app's settings: known models, cache sizes, theme, font size.

A small typed object stored as JSON in the platformdirs user config dir (or
``$EXPERTDESK_CONFIG_DIR``, which the tests point at a fresh temporary folder). Qt-free:
the window reads it at start and writes it when the user changes something. The
engine's part of it (device, cache sizes, reply precision) reaches the engine as one
``engine.options.RuntimeOptions`` (``AppSettings.runtime_options``).
Per-conversation settings (system prompt, sampling) live in the history database, not here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.models_registry import ModelRecord
    from engine.options import RuntimeOptions

DEMO_REF = "demo"
THEMES = ("system", "light", "dark")
DEVICES = ("auto", "cuda", "cpu")
DEFAULT_FONT_POINTS = 11
MIN_FONT_POINTS, MAX_FONT_POINTS = 7, 28


@dataclass(frozen=True)
class KnownModel:
    """A model the picker offers: a pack folder, a GGUF file, or the built-in demo."""

    ref: str
    name: str

    @property
    def is_demo(self) -> bool:
        return self.ref == DEMO_REF

    @property
    def label(self) -> str:
        """What the picker shows; the demo says plainly that it is not a real model."""
        return "Demo (tiny built-in model, not a real LLM)" if self.is_demo else self.name


DEMO_MODEL = KnownModel(DEMO_REF, "Demo model")


@dataclass(frozen=True)
class AppSettings:
    """Everything the app remembers between runs (except conversations)."""

    models: tuple[KnownModel, ...] = (DEMO_MODEL,)
    last_model: str = DEMO_REF
    device: str = "auto"
    # Stored under these names (settings.json); the engine's are cache_mib / host_cache_mib.
    cache_vram_mib: int = 0  # 0: the engine's default (the demo's deliberately small cache)
    cache_host_mib: int = 0  # 0: off
    verify_reads: bool = False  # hash every expert block read from the drive (a diagnostic: costs CPU)
    float32_replies: bool = False  # decode steps (and the KV state) in float32; prompts stay in the default dtype
    theme: str = "system"
    font_points: int = DEFAULT_FONT_POINTS
    show_telemetry: bool = True

    def runtime_options(self, model: ModelRecord | None = None) -> RuntimeOptions:
        """How the engine runs a model with these settings: the device, and the cache sizes
        set here, else `model`'s own (proposed by the setup wizard), else the engine's
        defaults (0 MiB means "not set")."""
        from engine.options import RuntimeOptions

        cache = self.cache_vram_mib or (model.cache_vram_mib if model is not None else 0)
        host = self.cache_host_mib or (model.cache_host_mib if model is not None else 0)
        return RuntimeOptions(device=self.device, cache_mib=cache or None, host_cache_mib=host or None,
                              verify_reads=self.verify_reads,
                              decode_dtype="float32" if self.float32_replies else None)

    def with_model(self, ref: str, name: str | None = None) -> AppSettings:
        """These settings with one more known model (no duplicates), selected as the last used."""
        ref = str(ref)
        models = self.models if any(m.ref == ref for m in self.models) else (
            *self.models, KnownModel(ref, name or Path(ref).name or ref))
        return replace(self, models=models, last_model=ref)

    def without_model(self, ref: str) -> AppSettings:
        """These settings with a model removed from the picker (the demo always stays)."""
        models = tuple(m for m in self.models if m.ref != ref or m.is_demo)
        last = self.last_model if any(m.ref == self.last_model for m in models) else DEMO_REF
        return replace(self, models=models, last_model=last)

    def clamped(self) -> AppSettings:
        """The same settings with every value inside its allowed range (hand-edited files stay usable)."""
        models = tuple(self.models) if self.models else ()
        if not any(m.is_demo for m in models):
            models = (DEMO_MODEL, *models)
        return replace(
            self,
            models=models,
            device=self.device if self.device in DEVICES else "auto",
            theme=self.theme if self.theme in THEMES else "system",
            cache_vram_mib=max(0, int(self.cache_vram_mib)),
            cache_host_mib=max(0, int(self.cache_host_mib)),
            verify_reads=self.verify_reads is True,
            float32_replies=self.float32_replies is True,
            font_points=min(MAX_FONT_POINTS, max(MIN_FONT_POINTS, int(self.font_points))),
        )


def config_dir() -> Path:
    """``$EXPERTDESK_CONFIG_DIR`` or the platformdirs user config dir."""
    override = os.environ.get("EXPERTDESK_CONFIG_DIR")
    if override:
        return Path(override)
    from platformdirs import user_config_dir

    return Path(user_config_dir("ExpertDesk", "ExpertDesk"))


def settings_path() -> Path:
    return config_dir() / "settings.json"


def load_settings(path: Path | None = None) -> AppSettings:
    """Read the settings; a missing or unreadable file gives the defaults (never a crash at start)."""
    path = path or settings_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return AppSettings()
    if not isinstance(data, dict):
        return AppSettings()
    known = {f.name for f in fields(AppSettings)}
    values = {k: v for k, v in data.items() if k in known}
    try:
        if "models" in values:
            values["models"] = tuple(KnownModel(str(m["ref"]), str(m.get("name") or m["ref"]))
                                     for m in values["models"])
        return AppSettings(**values).clamped()
    except (TypeError, KeyError, ValueError):
        return AppSettings()


def save_settings(settings: AppSettings, path: Path | None = None) -> None:
    """Write the settings atomically (temp file + rename), so a crash never leaves half a file."""
    path = path or settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(settings)
    data["models"] = [asdict(m) for m in settings.models]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = [
    "AppSettings", "KnownModel", "DEMO_MODEL", "DEMO_REF", "THEMES", "DEVICES",
    "config_dir", "settings_path", "load_settings", "save_settings",
]
