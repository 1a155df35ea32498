"""The icon set: every SVG is a registered, themed line icon, and the dialogs' buttons carry one beside their text.

Buttons checked: Preferences (add pack, add GGUF, remove), the model library (its row of
actions and "delete the pack" in the remove question), "Add a server" (test, add) and the
composer (Send, Stop). An icon must be drawn (non-transparent pixels), dark on the light
theme and light on the dark one, and change with ``theme.apply_theme``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QMessageBox, QPushButton, QWidget

from app.gui import icons
from app.gui.composer import Composer
from app.gui.model_library import ModelLibraryDialog
from app.gui.preferences_dialog import PreferencesDialog
from app.gui.remote_server_dialog import AddServerDialog
from app.gui.settings import AppSettings
from app.gui.theme import apply_theme
from app.models_registry import ModelRegistry
from engine.resources import resource_path

SVG = "{http://www.w3.org/2000/svg}svg"


def _mean_lightness(icon: QIcon) -> tuple[int, float]:
    """(number of drawn pixels, their mean lightness 0..255) of the icon at 24 px."""
    image = icon.pixmap(24, 24).toImage()
    drawn = [image.pixelColor(x, y) for x in range(image.width()) for y in range(image.height())]
    drawn = [c for c in drawn if c.alpha() > 200]
    return len(drawn), sum(c.lightness() for c in drawn) / max(1, len(drawn))


def test_every_svg_is_a_registered_cc0_line_icon():
    folder = resource_path(f"icons/{icons.APP_ICON}.svg").parent  # where the installed app finds them
    files = {p.stem for p in folder.glob("*.svg")} - {icons.APP_ICON}
    assert files == set(icons.ICON_NAMES)
    for name in icons.ICON_NAMES:
        text = (folder / f"{name}.svg").read_text(encoding="utf-8")
        assert "CC0-1.0" in text, name
        root = ET.fromstring(text)
        assert root.tag == SVG and root.get("viewBox") == "0 0 24 24" and root.get("stroke") == "currentColor", name
        assert root.get("fill") == "none", name


def test_icons_are_drawn_in_the_theme_colour(qapp):
    for name in icons.ICON_NAMES:
        light_pixels, light = _mean_lightness(icons.icon(name, False))
        dark_pixels, dark = _mean_lightness(icons.icon(name, True))
        assert light_pixels > 10 and dark_pixels > 10, name
        assert light < 110 < 160 < dark, (name, light, dark)
    with pytest.raises(KeyError, match="no icon 'nope'"):
        icons.icon("nope")


def _text_buttons(widget: QWidget) -> list[QPushButton]:
    return [b for b in widget.findChildren(QPushButton) if b.text() and b.isVisibleTo(widget)]


def test_dialog_and_composer_buttons_have_icons_and_keep_their_text(qtbot, tmp_path):
    preferences = PreferencesDialog(AppSettings())
    library = ModelLibraryDialog(AppSettings(), ModelRegistry(tmp_path / "models.json"))
    server = AddServerDialog()
    composer = Composer()
    expected = {
        preferences: {"Add pack folder…", "Add GGUF file…", "Remove"},
        library: {"Rename…", "Remove…", "Verify (quick)", "Verify (full)", "Open folder", "Add existing pack…",
                  "Add a server…"},
        server: {"Test connection", "Add"},
        composer: {"Send"},
    }
    for widget, labels in expected.items():
        qtbot.addWidget(widget)
        buttons = {b.text(): b for b in _text_buttons(widget)}
        assert labels <= set(buttons), (type(widget).__name__, sorted(buttons))
        for label in labels:
            assert not buttons[label].icon().isNull(), f"{label!r} in {type(widget).__name__} has no icon"
            assert buttons[label].sizeHint().width() > buttons[label].fontMetrics().horizontalAdvance(label) + 16
    composer.set_generating(True)
    assert composer.stop_button.text() == "Stop" and not composer.stop_button.icon().isNull()
    # Each dialog uses its icons once, and the two verify buttons look different.
    library_icons = [b.icon().pixmap(24, 24).toImage() for b in _text_buttons(library) if b.text() in expected[library]]
    assert len({bytes(image.constBits()) for image in library_icons}) == len(library_icons)


def test_button_icons_follow_the_theme(qtbot):
    composer = Composer()
    qtbot.addWidget(composer)
    try:
        apply_theme("light")
        _, light = _mean_lightness(composer.send_button.icon())
        apply_theme("dark")
        _, dark = _mean_lightness(composer.send_button.icon())
    finally:
        apply_theme("system")
    assert light < 110 < 160 < dark


def test_remove_question_marks_the_destructive_button(qtbot, tmp_path, monkeypatch):
    pack = tmp_path / "pack.xpack"
    seen = {}

    def fake_exec(box: QMessageBox) -> int:
        seen.update({b.text(): b.icon().isNull() for b in box.buttons()})
        return 0

    monkeypatch.setattr(QMessageBox, "exec", fake_exec)
    library = ModelLibraryDialog(AppSettings(), ModelRegistry(tmp_path / "models.json"))
    qtbot.addWidget(library)
    entry = type("Entry", (), {"name": "Alpha", "location": pack, "can_delete_files": True})()
    pack.mkdir()
    (pack / "weights.bin").write_bytes(b"x" * 1000)
    assert library.ask_remove(entry) is None
    delete = next(text for text in seen if text.startswith("Remove and delete"))
    assert seen[delete] is False
