"""The model registry (Qt-free) and the model library dialog: rename, remove with or without files,
re-verify (updates "last verified"), open folder, add an existing pack; the demo stays."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QUrl

from app.gui.model_library import ModelLibraryDialog
from app.gui.settings import DEMO_REF, AppSettings, load_settings
from app.gui.wizard_workers import running_tasks
from app.models_registry import (
    ModelRecord,
    ModelRegistry,
    delete_pack,
    library_entries,
    pack_record,
    remove_model,
    settings_renamed,
    settings_with_model,
)
from gui_helpers import gui_env, open_window, scripted_factory  # noqa: F401 (fixtures)
from pack_fixtures import write_deepseek4
from packer.builder import build_pack

SHARED_DIR = Path("/tmp/expertdesk-screens")


@pytest.fixture(scope="module")
def built_packs(tmp_path_factory) -> Path:
    """Two finished tiny packs, built once; tests copy them."""
    root = tmp_path_factory.mktemp("library-packs")
    for name, salt in (("alpha", 0), ("beta", 1)):
        src = write_deepseek4(root / "src", name=name, salt=salt)
        build_pack(src, root / "built")
    return root / "built"


@pytest.fixture
def packs(built_packs, tmp_path) -> dict[str, Path]:
    import shutil

    out = {}
    for pack in sorted(built_packs.iterdir()):
        out[pack.name.split(".")[0]] = Path(shutil.copytree(pack, tmp_path / "packs" / pack.name))
    return out


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    for task in running_tasks():
        assert task.wait(30)


def library(qtbot, packs, tmp_path) -> ModelLibraryDialog:  # tests using it take gui_env (isolated dirs)
    registry = ModelRegistry(tmp_path / "config" / "models.json")
    settings = AppSettings()
    for name, pack in packs.items():
        record = registry.upsert(pack_record(pack, name=name.capitalize(), cache_vram_mib=512))
        settings = settings_with_model(settings, record.ref, record.name)
    dialog = ModelLibraryDialog(settings, registry)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


# --- the registry, without Qt -----------------------------------------------------------------


def test_registry_round_trip_atomic_and_forgiving(tmp_path):
    path = tmp_path / "cfg" / "models.json"
    registry = ModelRegistry(path)
    assert registry.records() == [] and not registry.load_error
    registry.upsert(ModelRecord("/p/a.expertpack", "A", architecture="deepseek4", size_bytes=10, cache_vram_mib=4096,
                                source_files=("/m/a.gguf",)))
    registry.rename("/p/a.expertpack", "  Model A ")
    registry.mark_verified("/p/a.expertpack", True, "quick", "ok", when=1000.0)
    again = ModelRegistry(path)
    record = again.get("/p/a.expertpack")
    assert record.name == "Model A" and record.cache_vram_mib == 4096 and record.source_files == ("/m/a.gguf",)
    assert (record.last_verified_at, record.last_verified_mode, record.last_verified_ok) == (1000.0, "quick", True)
    assert record.added_at > 0 and [p.name for p in path.parent.iterdir()] == ["models.json"]  # no temp files left
    with pytest.raises(ValueError):
        registry.rename("/p/a.expertpack", "  ")

    # A hand-damaged entry is skipped, the others stay; an unreadable file gives an empty registry and says why.
    data = json.loads(path.read_text())
    data["models"].append({"name": "no ref"})
    path.write_text(json.dumps(data))
    assert [r.name for r in ModelRegistry(path).records()] == ["Model A"]
    path.write_text("{not json")
    broken = ModelRegistry(path)
    assert broken.records() == [] and "could not be read" in broken.load_error

    # Verifications finishing on worker threads while the GUI thread writes: nothing lost.
    registry = ModelRegistry(tmp_path / "threads.json")
    threads = [threading.Thread(target=registry.mark_verified, args=(f"/p/{i}.expertpack", True, "full"))
               for i in range(8)]
    for t in threads:
        t.start()
    registry.upsert(ModelRecord("/p/x.expertpack", "X"))
    for t in threads:
        t.join()
    assert len(ModelRegistry(tmp_path / "threads.json").records()) == 9


def test_settings_sync_remove_and_delete_only_packs(tmp_path, packs):
    registry = ModelRegistry(tmp_path / "models.json")
    alpha = str(packs["alpha"])
    settings = settings_with_model(AppSettings(), alpha, "Alpha")
    assert settings.last_model == alpha and [m.name for m in settings.models] == ["Demo model", "Alpha"]
    settings = settings_with_model(settings, alpha, "Alpha 2")  # same ref again: renamed, not duplicated
    assert [m.name for m in settings.models] == ["Demo model", "Alpha 2"]
    assert settings_renamed(settings, DEMO_REF, "x").models[0].name == "Demo model"
    registry.upsert(pack_record(alpha))
    entries = library_entries(settings, registry)
    assert [e.ref for e in entries] == [DEMO_REF, alpha]
    assert entries[1].architecture == "deepseek4" and entries[1].can_delete_files and not entries[0].removable
    with pytest.raises(ValueError, match="demo"):
        remove_model(settings, registry, DEMO_REF)
    with pytest.raises(ValueError, match="not an Expert Pack"):
        delete_pack(tmp_path)  # never deletes an arbitrary folder
    settings, freed = remove_model(settings, registry, alpha, delete_files=True)
    assert freed > 0 and not packs["alpha"].exists() and alpha not in registry
    assert [m.ref for m in settings.models] == [DEMO_REF] and settings.last_model == DEMO_REF


# --- the dialog ---------------------------------------------------------------------------------


def test_library_lists_models_and_keeps_the_demo(qtbot, gui_env, packs, tmp_path):
    dialog = library(qtbot, packs, tmp_path)
    assert [e.ref for e in dialog.entries] == [DEMO_REF, str(packs["alpha"]), str(packs["beta"])]
    name, arch, size, where, verified = dialog.row_text(str(packs["alpha"]))
    assert (name, arch, verified) == ("Alpha", "deepseek4", "never") and "KB" in size and where == str(packs["alpha"])
    assert "not a real" in dialog.row_text(DEMO_REF)[0]
    dialog.select(DEMO_REF)
    assert not dialog.remove_button.isEnabled() and not dialog.rename_button.isEnabled()
    assert "cannot be removed" in dialog.remove_button.toolTip()
    assert dialog.remove(DEMO_REF, delete_files=True) == 0
    assert DEMO_REF in [m.ref for m in dialog.settings.models]
    dialog.select(str(packs["beta"]))
    assert dialog.remove_button.isEnabled() and dialog.quick_button.isEnabled()
    SHARED_DIR.mkdir(parents=True, exist_ok=True)
    dialog.grab().save(str(SHARED_DIR / "model-library.png"))


def test_rename(qtbot, gui_env, packs, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QInputDialog

    dialog = library(qtbot, packs, tmp_path)
    ref = str(packs["beta"])
    dialog.select(ref)
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Beta, renamed", True))
    with qtbot.waitSignal(dialog.settingsChanged) as blocker:
        dialog.rename_button.click()
    assert dialog.registry.get(ref).name == "Beta, renamed"
    assert [m.name for m in blocker.args[0].models if m.ref == ref] == ["Beta, renamed"]
    assert dialog.row_text(ref)[0] == "Beta, renamed" and dialog.selected_ref() == ref
    assert ModelRegistry(dialog.registry.path).get(ref).name == "Beta, renamed"  # saved


def test_remove_with_and_without_files(qtbot, gui_env, packs, tmp_path, monkeypatch):
    released = []
    dialog = library(qtbot, packs, tmp_path)
    dialog._release_model = released.append
    alpha, beta = str(packs["alpha"]), str(packs["beta"])

    dialog.select(alpha)
    monkeypatch.setattr(dialog, "ask_remove", lambda entry: None)  # Cancel: nothing happens
    dialog.remove_button.click()
    assert alpha in [m.ref for m in dialog.settings.models]

    monkeypatch.setattr(dialog, "ask_remove", lambda entry: "keep")
    with qtbot.waitSignal(dialog.settingsChanged):
        dialog.remove_button.click()
    assert alpha not in [m.ref for m in dialog.settings.models] and alpha not in dialog.registry
    assert packs["alpha"].is_dir() and "files are kept" in dialog.status.text()

    dialog.select(beta)
    monkeypatch.setattr(dialog, "ask_remove", lambda entry: "delete" if entry.can_delete_files else None)
    with qtbot.waitSignal(dialog.settingsChanged) as blocker:
        dialog.remove_button.click()
    assert not packs["beta"].exists() and "freed" in dialog.status.text()
    assert [m.ref for m in blocker.args[0].models] == [DEMO_REF] and released == [alpha, beta]
    assert [e.ref for e in dialog.entries] == [DEMO_REF]


def test_reverify_quick_and_full_updates_last_verified(qtbot, gui_env, packs, tmp_path):
    dialog = library(qtbot, packs, tmp_path)
    ref = str(packs["alpha"])
    dialog.select(ref)
    with qtbot.waitSignal(dialog.verifyFinished, timeout=20_000) as blocker:
        dialog.quick_button.click()
    assert blocker.args[1].ok and blocker.args[1].quick
    record = dialog.registry.get(ref)
    assert record.last_verified_ok and record.last_verified_mode == "quick" and record.last_verified_at > 0
    assert dialog.row_text(ref)[4].startswith("✔ quick") and "Quick verification: OK" in dialog.status.text()

    # Damage one expert byte: a full verification finds it and says so.
    from expertpack import load_manifest

    at = load_manifest(packs["alpha"]).block_offset(0, 1) + 5
    with open(packs["alpha"] / "experts.bin", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    first = record.last_verified_at
    with qtbot.waitSignal(dialog.verifyFinished, timeout=20_000) as blocker:
        dialog.full_button.click()
        assert not dialog.full_button.isEnabled()  # one verification at a time
    assert not blocker.args[1].ok
    record = ModelRegistry(dialog.registry.path).get(ref)
    assert record.last_verified_ok is False and record.last_verified_mode == "full"
    assert record.last_verified_at >= first and "SHA-256 mismatch" in record.last_verified_summary
    assert dialog.row_text(ref)[4].startswith("✖ FAILED full") and "FAILED" in dialog.status.text()
    assert dialog.full_button.isEnabled()


def test_open_folder_and_add_existing_pack(qtbot, gui_env, packs, tmp_path, monkeypatch):
    from PySide6.QtGui import QDesktopServices

    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url) or True)
    dialog = library(qtbot, packs, tmp_path)
    dialog.select(str(packs["alpha"]))
    dialog.open_button.click()
    assert opened == [QUrl.fromLocalFile(str(packs["alpha"].parent))]

    dialog.remove(str(packs["beta"]))
    assert not dialog.add_pack(tmp_path) and "Not added" in dialog.status.text()
    with qtbot.waitSignal(dialog.settingsChanged) as blocker:
        assert dialog.add_pack(packs["beta"])
    settings = blocker.args[0]
    assert str(packs["beta"]) in [m.ref for m in settings.models] and settings.last_model == DEMO_REF
    assert dialog.registry.get(str(packs["beta"])).architecture == "deepseek4"


def test_library_in_the_main_window(qtbot, gui_env, open_window, packs):
    from app.gui.main_window import LIBRARY_MODELS

    window = open_window(service_factory=scripted_factory(token_delay_s=0))
    menu_titles = [a.text() for a in window.menuBar().actions()]
    assert "&Models" in menu_titles
    models_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Models")
    assert [a.text() for a in models_menu.actions() if a.text()][:2] == ["&Set up a model from a GGUF…",
                                                                         "Model &library…"]
    alpha = str(packs["alpha"])
    window.register_model(pack_record(packs["alpha"], name="Alpha", cache_vram_mib=64))
    qtbot.waitUntil(lambda: window.bridge.model_ref == alpha, timeout=10_000)
    assert window.model_picker.currentData() == alpha and window.bridge.options.cache_mib == 64

    window._on_model_picked(window.model_picker.findData(LIBRARY_MODELS))
    dialog = window.model_library
    assert dialog is not None and dialog.isVisible() and window.model_picker.currentData() == alpha
    dialog.rename_model(alpha, "Alpha prime")
    assert window.model_picker.itemText(window.model_picker.findData(alpha)) == "Alpha prime"
    assert [m.name for m in load_settings().models if m.ref == alpha] == ["Alpha prime"]
    # Removing the model in use (and its files) switches the window back to the demo first.
    dialog.select(alpha)
    dialog.remove(alpha, delete_files=True)
    qtbot.waitUntil(lambda: window.bridge.model_ref == DEMO_REF, timeout=10_000)
    assert window.model_picker.findData(alpha) == -1 and not packs["alpha"].exists()
    assert load_settings().last_model == DEMO_REF
