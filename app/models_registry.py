"""The model registry: what the app knows about each model beyond its name (Qt-free).

The picker's list of models (which refs, under which names, the last one used) stays
in ``AppSettings.models`` (settings.json). This module keeps the facts about each of
them that the setup wizard and the model library need, in its own file
``models.json`` next to settings.json (``$EXPERTDESK_CONFIG_DIR`` in tests):
architecture, size on disk, the cache sizes the wizard recommended, where the source
GGUF was and whether it was deleted, and when the pack was last verified.

    registry = ModelRegistry()                       # loads models.json (missing: empty)
    registry.upsert(ModelRecord(ref=str(pack), name="DeepSeek-V4-Flash", ...))
    settings = settings_with_model(settings, record) # in the picker, selected, named

Writes are atomic (temp file + fsync + rename), so a crash never leaves half a file;
an unreadable file gives an empty registry (the picker still works from settings).
Every method is thread-safe: a verification running on a worker thread records its
result with ``mark_verified`` while the GUI thread reads.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from app.gui.settings import DEMO_REF, AppSettings, KnownModel, config_dir
from engine.remote import is_endpoint_ref

REGISTRY_NAME = "models.json"
PACK_SUFFIX = ".expertpack"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class ModelRecord:
    """One registered model. ``ref`` is what the engine loads: a pack folder, a GGUF file or "demo"."""

    ref: str
    name: str
    architecture: str = ""
    size_bytes: int = 0  # the pack on disk when it was registered (the library re-measures)
    parameters: int = 0  # sum of tensor elements of the source model (0: unknown)
    quant_types: str = ""  # e.g. "MXFP4 ×129, Q8_0 ×330" (from the source GGUF)
    cache_vram_mib: int = 0  # GPU expert cache for this model; 0: the app's default (Preferences)
    cache_host_mib: int = 0  # host-RAM tier for this model; 0: the app's default
    added_at: float = 0.0
    source_files: tuple[str, ...] = ()
    source_deleted: bool = False
    last_verified_at: float | None = None
    last_verified_mode: str = ""  # "quick" or "full"
    last_verified_ok: bool | None = None
    last_verified_summary: str = ""

    @property
    def is_demo(self) -> bool:
        return self.ref == DEMO_REF

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["source_files"] = list(self.source_files)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["ref"] = str(values["ref"])
        values["name"] = str(values.get("name") or Path(values["ref"]).name or values["ref"])
        values["source_files"] = tuple(str(s) for s in values.get("source_files") or ())
        for key in ("size_bytes", "parameters", "cache_vram_mib", "cache_host_mib"):
            values[key] = max(0, int(values.get(key) or 0))
        return cls(**values)


class ModelRegistry:
    """models.json: ref -> ModelRecord, saved atomically after every change."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else config_dir() / REGISTRY_NAME
        self._lock = threading.RLock()
        self._records: dict[str, ModelRecord] = {}
        self.load_error = ""
        self.reload()

    # Reading ------------------------------------------------------------------------
    def reload(self) -> None:
        """Read the file again (missing: empty; unreadable: empty, and ``load_error`` says why)."""
        records: dict[str, ModelRecord] = {}
        error = ""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            items = data.get("models", []) if isinstance(data, dict) else []
            for item in items:
                try:
                    record = ModelRecord.from_json(item)
                except (TypeError, KeyError, ValueError, AttributeError):
                    continue  # one hand-damaged entry must not lose the others
                records[record.ref] = record
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            error = f"{self.path} could not be read ({exc}); model details start empty"
        with self._lock:
            self._records = records
            self.load_error = error

    def get(self, ref: str) -> ModelRecord | None:
        with self._lock:
            return self._records.get(str(ref))

    def records(self) -> list[ModelRecord]:
        with self._lock:
            return list(self._records.values())

    def __contains__(self, ref: object) -> bool:
        with self._lock:
            return str(ref) in self._records

    # Changing -------------------------------------------------------------------------
    def upsert(self, record: ModelRecord) -> ModelRecord:
        """Add or replace the record of ``record.ref`` (``added_at`` defaults to now) and save."""
        if not record.added_at:
            record = replace(record, added_at=time.time())
        with self._lock:
            self._records[record.ref] = record
            self.save()
        return record

    def rename(self, ref: str, name: str) -> ModelRecord:
        name = name.strip()
        if not name:
            raise ValueError("a model needs a name")
        with self._lock:
            record = replace(self._records.get(ref) or ModelRecord(ref, name), name=name)
            self._records[ref] = record
            self.save()
        return record

    def forget(self, ref: str) -> None:
        """Drop the record of ``ref`` (its files stay); saving only when something changed."""
        with self._lock:
            if self._records.pop(str(ref), None) is not None:
                self.save()

    def mark_verified(self, ref: str, ok: bool, mode: str, summary: str = "", when: float | None = None,
                      name: str | None = None) -> ModelRecord:
        """Record a verification result (safe to call from a worker thread)."""
        with self._lock:
            record = self._records.get(ref) or ModelRecord(ref, name or Path(ref).name or ref)
            record = replace(record, last_verified_at=time.time() if when is None else when,
                             last_verified_mode=mode, last_verified_ok=bool(ok), last_verified_summary=summary)
            self._records[ref] = record
            self.save()
        return record

    def save(self) -> None:
        """Write models.json atomically (temp file, fsync, rename)."""
        with self._lock:
            data = {"version": 1, "models": [r.to_json() for r in self._records.values()]}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


# --- the picker's list (AppSettings.models) -------------------------------------------


def settings_with_model(settings: AppSettings, ref: str, name: str) -> AppSettings:
    """``settings`` with ``ref`` in the picker under ``name`` (renamed if already there), selected."""
    settings = settings.with_model(ref, name)
    return settings_renamed(settings, ref, name)


def settings_renamed(settings: AppSettings, ref: str, name: str) -> AppSettings:
    """``settings`` with the picker entry of ``ref`` called ``name`` (the demo keeps its label)."""
    models = tuple(KnownModel(m.ref, name) if m.ref == ref and not m.is_demo else m for m in settings.models)
    return replace(settings, models=models)


# --- what the library shows ------------------------------------------------------------


@dataclass(frozen=True)
class LibraryEntry:
    """One row of the model library: the picker's entry plus what the registry knows."""

    ref: str
    name: str
    label: str
    record: ModelRecord | None
    location: Path | None  # the pack folder / GGUF file on disk (None: demo not built yet)
    architecture: str
    is_pack: bool
    exists: bool

    @property
    def is_demo(self) -> bool:
        return self.ref == DEMO_REF

    @property
    def removable(self) -> bool:
        return not self.is_demo

    @property
    def can_delete_files(self) -> bool:
        """Only Expert Packs are ever deleted by the app (never a GGUF or an arbitrary folder)."""
        return not self.is_demo and self.is_pack and self.exists

    @property
    def is_server(self) -> bool:
        """A model on an OpenAI-compatible server (ref ``URL#model``, engine.remote): no files here."""
        return is_endpoint_ref(self.ref)


def demo_pack_location() -> Path | None:
    """Where the built-in demo's pack lives (whether built yet or not); None if the demo is missing."""
    try:
        from engine.demo import PACK_NAME, demo_dir

        return demo_dir() / PACK_NAME
    except Exception:  # weights missing from this install: the demo row just has no folder
        return None


def is_pack_dir(path: Path) -> bool:
    return path.is_dir() and path.name.endswith(PACK_SUFFIX) and (path / MANIFEST_NAME).is_file()


def pack_architecture(path: Path) -> str:
    """The architecture a pack's manifest names ("" if it cannot be read)."""
    try:
        data = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
        return str(data.get("architecture", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def library_entries(settings: AppSettings, registry: ModelRegistry) -> list[LibraryEntry]:
    """The library's rows: every model of the picker, in its order, with the registry's facts."""
    entries = []
    for model in settings.models:
        record = registry.get(model.ref)
        if model.is_demo:
            location = demo_pack_location()
            exists = location is not None and is_pack_dir(location)
            entries.append(LibraryEntry(model.ref, model.name, model.label, record, location,
                                        "deepseek4 (tiny demo)", True, exists))
            continue
        if is_endpoint_ref(model.ref):  # a server's model: nothing on disk to look at
            entries.append(LibraryEntry(model.ref, model.name, model.label, record, None,
                                        record.architecture if record and record.architecture else "remote server",
                                        False, True))
            continue
        location = Path(model.ref).expanduser()
        is_pack = location.name.endswith(PACK_SUFFIX) or (location / MANIFEST_NAME).is_file()
        arch = (record.architecture if record and record.architecture else
                pack_architecture(location) if is_pack else "GGUF file" if location.suffix == ".gguf" else "")
        entries.append(LibraryEntry(model.ref, model.name, model.label, record, location, arch, is_pack,
                                    location.exists()))
    return entries


def disk_bytes(path: Path | None) -> int:
    """Bytes a pack folder or model file really occupies on disk (0 if missing)."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_blocks * 512
        except OSError:
            continue
    return total


def delete_pack(path: Path) -> int:
    """Delete an Expert Pack folder (refuses anything else); returns the bytes freed."""
    path = Path(path)
    if not is_pack_dir(path):
        raise ValueError(f"{path} is not an Expert Pack folder (NAME{PACK_SUFFIX} with a {MANIFEST_NAME}); "
                         "nothing was deleted")
    freed = disk_bytes(path)
    shutil.rmtree(path)
    return freed


def remove_model(settings: AppSettings, registry: ModelRegistry, ref: str, *,
                 delete_files: bool = False) -> tuple[AppSettings, int]:
    """Take ``ref`` out of the picker and the registry; with ``delete_files`` also delete its pack.

    Returns the new settings and the bytes freed. The demo is never removed (ValueError).
    """
    if ref == DEMO_REF:
        raise ValueError("the built-in demo model cannot be removed")
    freed = delete_pack(Path(ref).expanduser()) if delete_files else 0
    registry.forget(ref)
    return settings.without_model(ref), freed


def pack_record(pack_dir: str | os.PathLike, name: str | None = None, **values: Any) -> ModelRecord:
    """A record for an existing pack folder (architecture from its manifest, size measured)."""
    path = Path(pack_dir)
    stem = path.name[: -len(PACK_SUFFIX)] if path.name.endswith(PACK_SUFFIX) else path.name
    values.setdefault("architecture", pack_architecture(path))
    values.setdefault("size_bytes", disk_bytes(path))
    return ModelRecord(ref=str(path), name=name or stem, **values)


def summarize_quant_types(counts: Iterable[tuple[str, int]]) -> str:
    """'MXFP4 ×129, Q8_0 ×330' from (type name, tensor count) pairs."""
    return ", ".join(f"{name} ×{n}" for name, n in counts)


__all__ = [
    "ModelRecord", "ModelRegistry", "LibraryEntry", "REGISTRY_NAME",
    "settings_with_model", "settings_renamed", "library_entries", "remove_model", "delete_pack",
    "pack_record", "disk_bytes", "is_pack_dir", "pack_architecture", "demo_pack_location",
    "summarize_quant_types",
]
