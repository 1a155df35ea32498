"""Every screen rendered offscreen in light and dark, at 100% and 200%, and checked for clipped text.

Screens: the chat with a conversation, the telemetry panel (charts, counters, heat map),
the model library, preferences and each setup-wizard page. Each is checked for text that
does not fit its widget: a label, button or check box whose text is wider than its
rectangle (``fontMetrics().horizontalAdvance`` against ``contentsRect``; a button's or
check box's ``sizeHint`` against its size), a word-wrapped label taller than its room,
or a text widget cut off by a parent (its visible part narrower than itself).
``ElidedLabel``s are checked by the text they show (ending in "…" is their way to fit).

200% is a second pass: ``test_every_screen_at_200_percent_fits_its_text`` runs the two
screen tests again in a fresh process with ``QT_SCALE_FACTOR=2``, the way Qt scales a
window on a 200% screen (fonts, icons, style metrics and layout all at device pixel ratio
2), with the same clipped-text check; a screen rendered there is saved as ``NAME@2x.png``.
A Qt application's scale is fixed when it starts, hence the separate process.

The PNGs go to the test's temporary folder; with ``EXPERTDESK_SCREENSHOTS_DIR`` set (the
README's docs/screenshots), the 100% set and three 200% ones (DOCS_AT_200: the chat and
the wizard's checks; all of them would make the folder heavy) go there as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QImage, QPixmap, QTextDocument
from PySide6.QtGui import Qt as GuiQt
from PySide6.QtWidgets import (
    QAbstractButton,
    QApplication,
    QLabel,
    QPushButton,
    QScrollArea,
    QToolButton,
    QWidget,
)

from app.gui.elided_label import ElidedLabel
from app.gui.preferences_dialog import PreferencesDialog
from app.gui.theme import apply_theme, style_sheet
from app.gui.wizard import PAGE_FINISH, SetupWizard
from app.history import HistoryStore, default_history_path
from gui_helpers import gui_env, open_window, send_and_wait, set_sampling  # noqa: F401 (fixtures)
from pack_fixtures import write_deepseek4
from packer.diskio import GIB
from packer.preflight import GpuInfo, ODirectProbe, RamInfo

THEMES = ("light", "dark")
DOCS_AT_200 = {"chat-light", "chat-dark", "wizard-2-checks-light"}  # docs/screenshots stays under 3 MB
SCREEN_TESTS = ("test_main_screens_in_both_themes_fit_their_text", "test_wizard_pages_in_both_themes_fit_their_text")
LONG_TITLE = "A very long conversation title about expert caching, SSD bandwidth and NVMe queue depths"
QUESTION = "How do I read a JSON file in Python and print it nicely?"
ANSWER = ("Use the standard library's `json` module:\n\n```python\nimport json\n\nwith open('data.json') as f:\n"
          "    print(json.dumps(json.load(f), indent=2))\n```\n\n`indent=2` puts each key on its own line.")
PROBES = dict(free_space_fn=lambda _p: (1800 * 10**9, 2000 * 10**9),
              odirect_fn=lambda _p: ODirectProbe(True, True, "aligned O_DIRECT write and read work"),
              gpu_fn=lambda: GpuInfo("NVIDIA GeForce RTX 5090", free_bytes=31 * GIB, total_bytes=32 * GIB),
              ram_fn=lambda: RamInfo(available_bytes=26 * GIB, total_bytes=32 * GIB))


# --- the clipped-text check -----------------------------------------------------------------------

def _plain(label: QLabel) -> str:
    text = label.text()
    if label.textFormat() == Qt.TextFormat.PlainText or not GuiQt.mightBeRichText(text):
        return text
    document = QTextDocument()
    document.setHtml(text)
    return document.toPlainText()


def _needed_width(widget: QWidget) -> int | None:
    """How wide the widget must be for its text, or None if it has no text to check."""
    if isinstance(widget, ElidedLabel):
        shown = widget.shown_text()
        return widget.fontMetrics().horizontalAdvance(shown) if shown else None
    if isinstance(widget, QLabel):
        if widget.wordWrap() or not widget.text() or widget.pixmap() is not None and not widget.pixmap().isNull():
            return None
        lines = _plain(widget).splitlines() or [""]
        return max(widget.fontMetrics().horizontalAdvance(line) for line in lines)
    if isinstance(widget, QToolButton) and widget.toolButtonStyle() == Qt.ToolButtonStyle.ToolButtonIconOnly:
        return None  # its text is a name for screen readers, not drawn
    if isinstance(widget, QAbstractButton) and widget.text():
        return widget.sizeHint().width()
    return None


def clipped_texts(root: QWidget) -> list[str]:
    """Every visible text widget under ``root`` whose text does not fit (see the module docstring)."""
    offenders = []
    for widget in [root, *root.findChildren(QWidget)]:
        if not widget.isVisibleTo(root) or widget.width() <= 0:
            continue
        name = f"{type(widget).__name__} {widget.objectName() or widget.accessibleName() or ''}".strip()
        where = f"in {type(widget.window()).__name__}"
        needed = _needed_width(widget)
        if needed is not None:
            room = widget.width() if isinstance(widget, QAbstractButton) else widget.contentsRect().width()
            if needed > room + 1:
                text = widget.text() if not isinstance(widget, QLabel) else _plain(widget)
                offenders.append(f"{name} {where}: {text[:60]!r} needs {needed} px, has {room}")
                continue
        if isinstance(widget, QLabel) and widget.wordWrap() and widget.text():
            needed_h = widget.heightForWidth(widget.width())
            if needed_h > widget.height() + 1:
                offenders.append(f"{name} {where}: {_plain(widget)[:60]!r} needs {needed_h} px of height, "
                                 f"has {widget.height()}")
                continue
        if (needed is not None or isinstance(widget, QLabel) and widget.text()) and not _inside_scroll_view(widget):
            shown = widget.visibleRegion().boundingRect()
            if not shown.isEmpty() and shown.width() < widget.width() - 1:
                offenders.append(f"{name} {where}: cut by its parent ({shown.width()} of {widget.width()} px "
                                 "visible)")
    return offenders


def _inside_scroll_view(widget: QWidget) -> bool:
    """Inside a scroll area that scrolls sideways (text out of view there can be scrolled to)."""
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QScrollArea) and parent.horizontalScrollBar().isVisible():
            return True
        parent = parent.parentWidget()
    return False


# --- rendering --------------------------------------------------------------------------------------

def _targets(tmp_path: Path) -> list[Path]:
    folders = [tmp_path]
    extra = os.environ.get("EXPERTDESK_SCREENSHOTS_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        folders.append(Path(extra))
    return folders


def render(widget: QWidget) -> QImage:
    """The widget as an image at its screen's device pixel ratio (2.0 in the 200% pass)."""
    QApplication.processEvents()
    ratio = widget.devicePixelRatioF()
    pixmap = QPixmap(round(widget.width() * ratio), round(widget.height() * ratio))
    pixmap.setDevicePixelRatio(ratio)
    widget.render(pixmap)
    return pixmap.toImage()


class Shots:
    """Renders screens, saves them and collects clipped-text offenders."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.targets = _targets(tmp_path)
        self.offenders: list[str] = []
        self.saved: list[Path] = []

    def take(self, widget: QWidget, name: str) -> None:
        for _ in range(3):  # a text set just now: its re-layout is a posted event, and may post another
            QApplication.processEvents()
        ratio = widget.devicePixelRatioF()
        self.offenders += [f"{name} at {ratio:.0%}: {o}" for o in clipped_texts(widget)]
        image = render(widget)
        assert image.width() == round(widget.width() * ratio)
        file_name = f"{name}.png" if ratio == 1.0 else f"{name}@{ratio:g}x.png"
        folders = self.targets if ratio == 1.0 or ratio == 2.0 and name in DOCS_AT_200 else [self.tmp_path]
        for folder in folders:
            path = folder / file_name
            assert image.save(str(path)), f"could not write {path}"
            self.saved.append(path)

    def check(self) -> None:
        assert not self.offenders, "text does not fit its widget:\n" + "\n".join(self.offenders)


def _brightness(image: QImage) -> float:
    values = [image.pixelColor(x, y).lightness() for x in range(0, image.width(), 29)
              for y in range(0, image.height(), 29)]
    return sum(values) / len(values)


def _seed_history() -> None:
    history = HistoryStore(default_history_path())
    history.create_conversation(LONG_TITLE)
    conversation = history.create_conversation("Read and print JSON", model_ref="demo")
    history.add_message(conversation.id, "user", QUESTION)
    reply = history.add_message(conversation.id, "assistant", "", status="streaming", model_ref="demo")
    history.update_message(reply.id, content=ANSWER, status="finished",
                           stats={"prompt_tokens": 31, "completion_tokens": 60, "ttft_s": 0.4, "decode_tok_s": 11.6,
                                  "hit_rate": 0.9, "ssd_gb_per_token": 0.18, "stop_reason": "eos"})
    history.close()


# --- the tests ----------------------------------------------------------------------------------------

def test_main_screens_in_both_themes_fit_their_text(qtbot, open_window, tmp_path):
    _seed_history()
    window = open_window()
    window.resize(1280, 800)
    set_sampling(window, max_tokens=24)
    send_and_wait(qtbot, window, "And what does json.dumps do with non-ASCII text?")
    panel = window.telemetry
    qtbot.waitUntil(lambda: panel.heatmap.map is not None, timeout=5_000)  # the heat map's first refresh
    # The long title is elided in the list, with the whole title as tooltip.
    items = [window.conversation_list.list.item(i) for i in range(window.conversation_list.list.count())]
    long_item = next(item for item in items if item.text() == LONG_TITLE)
    assert LONG_TITLE in long_item.toolTip()
    assert window.conversation_list.list.textElideMode() == Qt.TextElideMode.ElideRight
    shots = Shots(tmp_path)
    brightness = {}
    for theme in THEMES:
        window.set_theme(theme)
        window.chat_view.scroll_to_bottom()
        qtbot.wait(100)
        shots.take(window, f"chat-{theme}")
        brightness[theme] = _brightness(render(window))
        body = panel.widget().widget()  # the whole telemetry column, also what needs scrolling
        shots.take(body, f"telemetry-{theme}")
        library = window.open_model_library()
        qtbot.waitExposed(library)
        shots.take(library, f"library-{theme}")
        library.close()
        preferences = PreferencesDialog(window.app_settings, window)
        qtbot.addWidget(preferences)
        preferences.show()
        qtbot.waitExposed(preferences)
        shots.take(preferences, f"preferences-{theme}")
        preferences.close()
    window.set_theme("system")
    shots.check()
    assert brightness["light"] > 170 > 90 > brightness["dark"]
    assert all(path.stat().st_size > 5_000 for path in shots.saved)


def test_wizard_pages_in_both_themes_fit_their_text(qtbot, tmp_path):
    source = write_deepseek4(tmp_path / "models")
    shots = Shots(tmp_path)
    for theme in THEMES:
        dark = apply_theme(theme)
        wizard = SetupWizard(probes=PROBES, builder_options=dict(buffer_bytes=2 * 24576, threads=3))
        wizard.setStyleSheet(style_sheet(dark, QApplication.font().pointSizeF()))  # the main window's, in the app
        qtbot.addWidget(wizard)
        wizard.show()
        qtbot.waitExposed(wizard)
        with qtbot.waitSignal(wizard.source_page.checked, timeout=10_000):
            wizard.source_page.set_path(source)
        shots.take(wizard, f"wizard-1-model-{theme}")
        wizard.target_page.folder_edit.setText(str(tmp_path / f"packs-{theme}"))
        with qtbot.waitSignal(wizard.target_page.checked, timeout=10_000):
            wizard.next()
        shots.take(wizard, f"wizard-2-checks-{theme}")
        with qtbot.waitSignal(wizard.build_page.buildFinished, timeout=30_000):
            wizard.next()
        shots.take(wizard, f"wizard-3-build-{theme}")
        wizard.next()
        assert wizard.currentId() == PAGE_FINISH
        shots.take(wizard, f"wizard-4-finish-{theme}")
        wizard.close()
    apply_theme("system")
    shots.check()


def test_the_checker_finds_clipped_text(qtbot):
    """The check itself: a label, a button and a word-wrapped label that do not fit are reported."""
    holder = QWidget()
    qtbot.addWidget(holder)
    holder.resize(400, 200)
    narrow = QLabel("This text is much wider than forty pixels", holder)
    narrow.setGeometry(0, 0, 40, 20)
    button = QPushButton("A button with a long caption", holder)
    button.setGeometry(0, 30, 50, 24)
    wrapped = QLabel(" ".join(["word"] * 60), holder)
    wrapped.setWordWrap(True)
    wrapped.setGeometry(0, 60, 120, 20)
    fits = QLabel("ok", holder)
    fits.setGeometry(0, 100, 100, 20)
    elided = ElidedLabel("An elided label is fine however long it is", holder)
    elided.setGeometry(0, 130, 60, 20)
    holder.show()
    offenders = clipped_texts(holder)
    assert len(offenders) == 3, offenders
    assert any("forty pixels" in o for o in offenders) and any("long caption" in o for o in offenders)
    assert any("of height" in o for o in offenders)
    assert elided.is_elided() and elided.shown_text().endswith("…") and elided.toolTip() == elided.text()



def test_every_screen_at_200_percent_fits_its_text(tmp_path):
    """The screen tests again in a process started with QT_SCALE_FACTOR=2 (see the module docstring)."""
    scaling = ("QT_SCALE", "QT_SCREEN_SCALE", "QT_ENABLE_HIGHDPI", "QT_FONT_DPI")  # one scale: ours
    env = {name: value for name, value in os.environ.items() if not name.startswith(scaling)}
    env.update(QT_SCALE_FACTOR="2", QT_QPA_PLATFORM="offscreen")
    inner = tmp_path / "at-200"
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={inner}",
               *(f"{__file__}::{name}" for name in SCREEN_TESTS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the 200% pass failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    shots = {path.name: path for path in inner.rglob("*.png")}
    assert not [name for name in shots if "@" not in name], "the 200% pass wrote a 100% screenshot"
    for theme in THEMES:
        chat = QImage(str(shots[f"chat-{theme}@2x.png"]))
        assert (chat.width(), chat.height()) == (2560, 1600)  # the 1280 x 800 window, at twice the pixels
        for screen in ("telemetry", "library", "preferences", "wizard-1-model", "wizard-2-checks", "wizard-3-build",
                       "wizard-4-finish"):
            image = QImage(str(shots[f"{screen}-{theme}@2x.png"]))
            assert image.width() > 600 and image.width() % 2 == 0 == image.height() % 2, screen
