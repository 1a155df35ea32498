"""The main window: conversations on the left, the chat in the middle, settings and telemetry docked right.

The window builds the widgets, menus and shortcuts and owns the long-lived objects
(settings, history store, engine bridge); the chat flow itself lives in
``ChatController``.
"""

from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QFont, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QDockWidget,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from app import __version__
from app.gui import icons
from app.gui.chat_controller import ChatController
from app.gui.chat_view import ChatView
from app.gui.composer import Composer
from app.gui.conversation_list import ConversationList
from app.gui.conversation_settings import ConversationSettingsPanel
from app.gui.engine_bridge import EngineBridge, ServiceFactory
from app.gui.markdown_render import MarkdownRenderer
from app.gui.model_library import ModelLibraryDialog
from app.gui.preferences_dialog import PreferencesDialog
from app.gui.qt_compat import protect_none_refcount
from app.gui.settings import (
    DEFAULT_FONT_POINTS,
    MAX_FONT_POINTS,
    MIN_FONT_POINTS,
    THEMES,
    AppSettings,
    load_settings,
    save_settings,
)
from app.gui.status_panel import EngineStatus
from app.gui.telemetry_panel import TelemetryPanel
from app.gui.theme import ERROR_COLOR, WARNING_COLOR, apply_theme, html_colors, style_sheet
from app.gui.wizard import SetupWizard
from app.history import HistoryError, HistoryStore, default_history_path, export_json, export_markdown, open_history
from app.models_registry import ModelRecord, ModelRegistry, settings_with_model

NOTICE_MS = 4000
ADD_MODEL = "__add__"  # picker entry: the setup wizard (GGUF -> pack)
LIBRARY_MODELS = "__library__"  # picker entry: the model library
SETUP_LINK = "expertdesk:setup"  # link in the first-run text

# Bubble colours per theme, on top of the palette (Qt style sheets, theme-dependent).
_STYLE = {
    False: """
        QFrame#userMessage { background-color: #e8f0fe; border-radius: 10px; }
        QFrame#assistantMessage { background-color: #ffffff; border: 1px solid #e1e4e8; border-radius: 10px; }
        QLabel#stats { color: #59636e; }
        QWidget#chatHolder { background-color: #f6f7f9; }
        QLabel#placeholder { color: #59636e; }
    """,
    True: """
        QFrame#userMessage { background-color: #1c2b41; border-radius: 10px; }
        QFrame#assistantMessage { background-color: #161b22; border: 1px solid #30363d; border-radius: 10px; }
        QLabel#stats { color: #9198a1; }
        QWidget#chatHolder { background-color: #0d1117; }
        QLabel#placeholder { color: #9198a1; }
    """,
}


class MainWindow(QMainWindow):
    """Top-level window of the app.

    ``history_path`` and ``service_factory`` exist for tests and embedding; by default
    the history lives under the platformdirs data dir and the engine is
    ``engine.service.EngineService``. ``autoload`` loads the last used model at start.
    """

    def __init__(
        self,
        *,
        settings: AppSettings | None = None,
        history_path: str | Path | None = None,
        service_factory: ServiceFactory | None = None,
        autoload: bool = True,
    ) -> None:
        protect_none_refcount()  # before any Qt callback can run (see qt_compat)
        super().__init__()
        self.setWindowTitle(f"ExpertDesk {__version__}")
        self.setWindowIcon(icons.app_icon())
        self.resize(1280, 800)
        self.app_settings = settings or load_settings()
        self._startup_errors: list[str] = []
        self.model_registry = ModelRegistry()
        if self.model_registry.load_error:
            self._startup_errors.append(self.model_registry.load_error)
        self.setup_wizard: SetupWizard | None = None
        self.model_library: ModelLibraryDialog | None = None
        # Tests (and "what if" runs) replace the wizard's preflight probes and builder options.
        self.wizard_probes: dict = {}
        self.wizard_builder_options: dict = {}
        self.history = self._open_history(history_path)
        self.bridge = self._start_engine(service_factory)

        # Widgets -----------------------------------------------------------------
        self.conversation_list = ConversationList(self.history, self)
        self.chat_view = ChatView(self)
        self.composer = Composer(self)
        self.banner = QLabel(self)
        self.banner.setObjectName("banner")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner.setContentsMargins(16, 8, 16, 8)
        self.banner.setAccessibleName("Error")
        self.banner.setVisible(False)
        # The history's state (read-only, replaced after damage, saving delayed): its own line, which a
        # model load does not hide; what was said at start can be dismissed, a delay clears by itself.
        self.history_banner = QLabel(self)
        self.history_banner.setObjectName("historyBanner")
        self.history_banner.setWordWrap(True)
        self.history_banner.setTextFormat(Qt.TextFormat.RichText)
        self.history_banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                                    | Qt.TextInteractionFlag.LinksAccessibleByMouse
                                                    | Qt.TextInteractionFlag.LinksAccessibleByKeyboard)
        self.history_banner.setContentsMargins(16, 8, 16, 8)
        self.history_banner.setAccessibleName("Chat history")
        self.history_banner.linkActivated.connect(self._dismiss_history_note)
        self._history_runtime_note = ""
        self._update_history_banner()
        # The first-run text links to the setup wizard.
        self.chat_view.placeholder.setTextInteractionFlags(Qt.TextInteractionFlag.LinksAccessibleByMouse
                                                           | Qt.TextInteractionFlag.LinksAccessibleByKeyboard)
        self.chat_view.placeholder.setOpenExternalLinks(False)
        self.chat_view.placeholder.linkActivated.connect(self._on_placeholder_link)
        chat_column = QWidget(self)
        column = QVBoxLayout(chat_column)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self.banner)
        column.addWidget(self.history_banner)
        column.addWidget(self.chat_view, 1)
        column.addWidget(self.composer)
        splitter = QSplitter(Qt.Orientation.Horizontal, self)
        splitter.addWidget(self.conversation_list)
        splitter.addWidget(chat_column)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([240, 760])
        splitter.setChildrenCollapsible(False)
        self.setCentralWidget(splitter)

        self.settings_panel = ConversationSettingsPanel(self)
        self.settings_dock = QDockWidget("Conversation settings", self)
        self.settings_dock.setObjectName("settingsDock")
        self.settings_dock.setWidget(self.settings_panel)
        self.telemetry = TelemetryPanel(self)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.telemetry)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.settings_dock)
        self.tabifyDockWidget(self.telemetry, self.settings_dock)
        self.resizeDocks([self.telemetry], [370], Qt.Orientation.Horizontal)
        self.telemetry.raise_()
        self.telemetry.setVisible(self.app_settings.show_telemetry)

        self.engine_status = EngineStatus(self)
        self.model_info = QLabel(self)
        self.model_info.setAccessibleName("Loaded model")
        self.notice_label = QLabel(self)
        self.notice_label.setAccessibleName("Notice")
        self._notice_timer = QTimer(self)
        self._notice_timer.setSingleShot(True)
        self._notice_timer.timeout.connect(lambda: self.notice_label.setText(""))
        # All permanent: QStatusBar.showMessage would hide the phase line, which must stay visible.
        self.statusBar().addPermanentWidget(self.engine_status, 1)
        self.statusBar().addPermanentWidget(self.notice_label)
        self.statusBar().addPermanentWidget(self.model_info)

        self.controller = ChatController(self.history, self.bridge, self.chat_view, self.composer, self.engine_status,
                                         self.settings_panel, self.conversation_list, self)
        self.controller.notice.connect(self.show_notice)
        self.controller.historyStateChanged.connect(self._on_history_state)
        self.controller.conversationChanged.connect(self._on_conversation_changed)
        self.controller.busyChanged.connect(self._on_busy_changed)

        self.model_picker = QComboBox(self)
        self.model_picker.setAccessibleName("Model")
        self.model_picker.setToolTip("The model to chat with")
        self.model_picker.setMinimumContentsLength(40)
        self.model_picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self._fill_model_picker()
        self.model_picker.activated.connect(self._on_model_picked)

        self._build_actions()
        self._apply_font()
        self._apply_theme()
        hints = QGuiApplication.styleHints()
        if hints is not None:
            hints.colorSchemeChanged.connect(self._on_color_scheme_changed)

        if self.bridge is not None:
            self.bridge.modelLoaded.connect(self._on_model_loaded)
            self.bridge.loadFailed.connect(self._on_load_failed)
            self.bridge.phaseChanged.connect(self._on_load_phase)
            self.bridge.snapshotTaken.connect(self.telemetry.show_snapshot)
            self.telemetry.set_expert_map_source(self.bridge.expert_map)
        self._update_send_state()
        for error in self._startup_errors:
            self.show_error(error)

        try:
            latest = self.history.conversations(limit=1)
        except HistoryError as exc:
            latest = []
            self.controller.report_history_error(exc, "The chats could not be listed")
        if latest:
            self.conversation_list.select(latest[0].id)
        else:
            self.controller.new_chat()
        if autoload and self.bridge is not None:
            self.load_model(self.app_settings.last_model)

    # Start-up ----------------------------------------------------------------
    def _open_history(self, path: str | Path | None) -> HistoryStore:
        """The history store; never fails (a damaged, unwritable or locked one is dealt with by open_history).

        Checkpoints (the fsync of WAL) run on a worker after each reply, not on commit, and the
        store never waits for a lock on the GUI thread (busy timeout 0): refused writes are
        retried from a timer (ChatController's SaveQueue).
        """
        self.history_opened = open_history(path or default_history_path(), busy_timeout_s=0.0, autocheckpoint=False)
        self._history_startup_note = self.history_opened.message
        return self.history_opened.store

    def _start_engine(self, factory: ServiceFactory | None) -> EngineBridge | None:
        settings = self.app_settings
        try:
            return EngineBridge(service_factory=factory, parent=self, options=settings.runtime_options())
        except Exception as exc:  # a broken install must still open the window and say what is wrong
            self._startup_errors.append(
                f"The engine could not start: {exc}. Chats can be read and exported, but no model can run; "
                "reinstall ExpertDesk (pip install -e .) or report this error."
            )
            return None

    def _build_actions(self) -> None:
        def action(text: str, slot, shortcut=None, tip: str = "") -> QAction:
            act = QAction(text, self)
            if shortcut is not None:
                act.setShortcuts(shortcut if isinstance(shortcut, list) else [shortcut])
            if tip:
                act.setToolTip(tip)
                act.setStatusTip(tip)
            act.triggered.connect(slot)
            self.addAction(act)
            return act

        key = QKeySequence
        self.new_action = action("&New chat", self.controller.new_chat, key(key.StandardKey.New), "Start a new chat")
        self.send_action = action("&Send", self.composer.request_send, key("Ctrl+Return"), "Send the message")
        self.stop_action = action("S&top", self.controller.stop, key(Qt.Key.Key_Escape), "Stop the reply (Esc)")
        self.regenerate_action = action("&Regenerate", lambda: self.controller.regenerate(), key("Ctrl+Shift+R"),
                                        "Write the last reply again (Ctrl+Shift+R)")
        self.search_action = action("&Search chats", self._focus_search, key(key.StandardKey.Find),
                                    "Search conversations (Ctrl+F)")
        self.export_md_action = action("Export as &Markdown…", lambda: self.export_dialog("md"),
                                       tip="Save this conversation as a Markdown file")
        self.export_json_action = action("Export as &JSON…", lambda: self.export_dialog("json"),
                                         tip="Save this conversation as a JSON file")
        self.rename_action = action("&Rename chat…", lambda: self.conversation_list.rename(self.controller.current_id))
        self.delete_action = action("&Delete chat…", lambda: self.conversation_list.delete(self.controller.current_id))
        self.preferences_action = action("&Preferences…", self.open_preferences, key("Ctrl+,"))
        self.quit_action = action("&Quit", self.close, key(key.StandardKey.Quit))
        self.zoom_in_action = action("&Bigger text", lambda: self.change_font_size(+1),
                                     [key(key.StandardKey.ZoomIn), key("Ctrl+=")])
        self.zoom_out_action = action("&Smaller text", lambda: self.change_font_size(-1), key(key.StandardKey.ZoomOut))
        self.zoom_reset_action = action("&Normal text size", lambda: self.change_font_size(0), key("Ctrl+0"))
        self.setup_model_action = action("&Set up a model from a GGUF…", self.open_setup_wizard, key("Ctrl+Shift+N"),
                                         "Turn a DeepSeek-V4-Flash or Kimi-K3 GGUF into an Expert Pack (wizard)")
        self.library_action = action("Model &library…", self.open_model_library, key("Ctrl+Shift+L"),
                                     "Rename, remove, verify and locate your models")
        self.add_by_hand_action = action("&Add a pack or GGUF by path…", self.open_preferences,
                                         tip="Add an existing pack folder or GGUF file to the list (Preferences)")
        self.stop_action.setEnabled(False)

        self.telemetry_action = self.telemetry.toggleViewAction()
        self.telemetry_action.setText("&Telemetry")
        self.telemetry_action.setShortcut(key("Ctrl+T"))
        self.telemetry_action.setToolTip("Show or hide the telemetry panel (Ctrl+T)")
        self.telemetry_action.toggled.connect(self._on_telemetry_toggled)
        self.addAction(self.telemetry_action)
        self.settings_action = self.settings_dock.toggleViewAction()
        self.settings_action.setText("Conversation &settings")
        self.settings_action.setShortcut(key("Ctrl+Shift+S"))
        for act, name in ((self.new_action, "new-chat"), (self.send_action, "send"), (self.stop_action, "stop"),
                          (self.regenerate_action, "regenerate"), (self.search_action, "search"),
                          (self.export_md_action, "export"), (self.export_json_action, "export"),
                          (self.rename_action, "rename"), (self.delete_action, "delete"),
                          (self.preferences_action, "preferences"), (self.quit_action, "quit"),
                          (self.zoom_in_action, "zoom-in"), (self.zoom_out_action, "zoom-out"),
                          (self.setup_model_action, "add-model"), (self.library_action, "library"),
                          (self.add_by_hand_action, "folder"), (self.telemetry_action, "telemetry"),
                          (self.settings_action, "settings")):
            icons.bind(act, name)

        menu = self.menuBar()
        file_menu = menu.addMenu("&File")
        for act in (self.new_action, self.export_md_action, self.export_json_action, None, self.preferences_action,
                    None, self.quit_action):
            file_menu.addSeparator() if act is None else file_menu.addAction(act)
        chat_menu = menu.addMenu("&Chat")
        for act in (self.send_action, self.stop_action, self.regenerate_action, None, self.rename_action,
                    self.delete_action, self.search_action):
            chat_menu.addSeparator() if act is None else chat_menu.addAction(act)
        models_menu = menu.addMenu("&Models")
        for act in (self.setup_model_action, self.library_action, None, self.add_by_hand_action):
            models_menu.addSeparator() if act is None else models_menu.addAction(act)
        view_menu = menu.addMenu("&View")
        view_menu.addAction(self.telemetry_action)
        view_menu.addAction(self.settings_action)
        view_menu.addSeparator()
        for act in (self.zoom_in_action, self.zoom_out_action, self.zoom_reset_action):
            view_menu.addAction(act)
        theme_menu = view_menu.addMenu("T&heme")
        self.theme_group = QActionGroup(self)
        for theme in THEMES:
            act = QAction(theme.capitalize() if theme != "system" else "Follow the system", self.theme_group)
            act.setCheckable(True)
            act.setData(theme)
            act.setChecked(theme == self.app_settings.theme)
            act.triggered.connect(lambda _checked=False, t=theme: self.set_theme(t))
            theme_menu.addAction(act)

        toolbar = QToolBar("Main", self)
        toolbar.setObjectName("mainToolbar")
        toolbar.setMovable(False)
        toolbar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        toolbar.setIconSize(QSize(18, 18))
        toolbar.addWidget(QLabel(" Model: ", self))
        toolbar.addWidget(self.model_picker)
        toolbar.addSeparator()
        toolbar.addAction(self.new_action)
        toolbar.addAction(self.regenerate_action)
        toolbar.addAction(self.stop_action)
        toolbar.addSeparator()
        toolbar.addAction(self.settings_action)
        toolbar.addAction(self.telemetry_action)
        self.addToolBar(toolbar)

    # Models --------------------------------------------------------------------
    def _fill_model_picker(self) -> None:
        self.model_picker.clear()
        for model in self.app_settings.models:
            self.model_picker.addItem(model.label, model.ref)
            self.model_picker.setItemData(self.model_picker.count() - 1, model.ref, Qt.ItemDataRole.ToolTipRole)
        self.model_picker.insertSeparator(self.model_picker.count())
        self.model_picker.addItem("Add a model (set up a GGUF)…", ADD_MODEL)
        self.model_picker.addItem("Model library…", LIBRARY_MODELS)
        current = (self.bridge.loading_ref or self.bridge.model_ref) if self.bridge else None
        self._select_in_picker(current or self.app_settings.last_model)

    def _select_in_picker(self, ref: str | None) -> None:
        index = self.model_picker.findData(ref or self.app_settings.last_model)
        if index >= 0:
            self.model_picker.setCurrentIndex(index)

    def _on_model_picked(self, index: int) -> None:
        ref = self.model_picker.itemData(index)
        if ref in (ADD_MODEL, LIBRARY_MODELS):
            self._select_in_picker((self.bridge.loading_ref or self.bridge.model_ref) if self.bridge else None)
            self.open_setup_wizard() if ref == ADD_MODEL else self.open_model_library()
            return
        if self.bridge is None or ref in (self.bridge.model_ref, self.bridge.loading_ref):
            return
        if self.controller.busy:
            self.show_notice("Stop the reply before switching models.")
            self._select_in_picker(self.bridge.model_ref)
            return
        self.load_model(ref)

    def load_model(self, ref: str) -> None:
        """Start loading a model; the status bar shows progress, the composer waits for it."""
        if self.bridge is None:
            return
        self.banner.setVisible(False)
        self._select_in_picker(ref)
        self.model_info.setText("")
        self.telemetry.reset()
        self.engine_status.start("loading", self.model_picker.currentText())
        try:
            self.bridge.configure(self._engine_options_for(ref))  # this model's cache sizes, if it has its own
            self.bridge.load(ref)
        except Exception as exc:  # e.g. a device in Preferences that this machine does not have
            self.engine_status.stop("No model loaded")
            self.show_error(f"The engine could not start with the settings in Preferences: {exc}. "
                            "Change the device or cache sizes there and pick the model again.")
        self._update_send_state()

    def _on_load_phase(self, event) -> None:
        if self.bridge is not None and self.bridge.loading_ref and not self.controller.busy:
            self.engine_status.show_phase(event)

    def _on_model_loaded(self, event) -> None:
        demo = " (demo, not a real model)" if event.is_demo and "demo" not in event.model_name.lower() else ""
        precision = f" · {event.precision}" if event.precision else ""
        self.model_info.setText(f"{event.model_name}{demo} · {event.architecture} · {event.device}{precision} · "
                                f"context {event.context_length:,}")
        self.engine_status.stop("Ready")
        self.chat_view.set_model_label(event.model_name)
        ref = self.bridge.model_ref
        if ref and ref != self.app_settings.last_model:
            self.app_settings = self.app_settings.with_model(ref)
            self._save_settings()
        self._update_send_state()

    def _on_load_failed(self, event) -> None:
        self.engine_status.stop("No model loaded")
        self.show_error(f"The model could not be loaded. {event.message}")
        self._update_send_state()

    def _update_send_state(self) -> None:
        ok, why = self.controller.can_send()
        self.composer.set_can_send(ok, why)
        self.chat_view.set_placeholder(self._placeholder_html(why))

    def _placeholder_html(self, why: str) -> str:
        text = ("<h2>Start a conversation</h2><p>Type below: Enter sends, Shift+Enter adds a line.<br>"
                "Ctrl+N new chat · Esc stops · Ctrl+Shift+R regenerates · Ctrl+T telemetry</p>")
        if self.bridge is not None and self.bridge.loaded is not None and self.bridge.loaded.is_demo:
            text += ("<p>You are using the <b>built-in demo model</b>: a tiny model that exercises the whole "
                     "path (pack, SSD streaming, telemetry) but is not a real LLM. Its answers are "
                     "recognisable but often wrong. Add a real model from the model list.</p>")
        elif why:
            text += f"<p>{html.escape(why)}</p>"
        if not any(not m.is_demo for m in self.app_settings.models):
            text += (f'<p><a href="{SETUP_LINK}"><b>Set up DeepSeek-V4-Flash or Kimi-K3…</b></a><br>'
                     "The setup wizard turns the model's GGUF into an Expert Pack on your SSD "
                     "(checks, build, verify) and adds it to the model list.</p>")
        return text

    # Setup wizard and model library ------------------------------------------------
    def _on_placeholder_link(self, link: str) -> None:
        if link == SETUP_LINK:
            self.open_setup_wizard()

    def open_setup_wizard(self, source: str | Path | None = None) -> SetupWizard:
        """Show the setup wizard (window-modal, not blocking); Finish registers the model and loads it."""
        if self.setup_wizard is not None and self.setup_wizard.isVisible():
            self.setup_wizard.raise_()
            self.setup_wizard.activateWindow()
            return self.setup_wizard
        if self.setup_wizard is not None:
            self.setup_wizard.deleteLater()
        wizard = SetupWizard(self, source=source, probes=self.wizard_probes,
                             builder_options=self.wizard_builder_options,
                             options=self.app_settings.runtime_options())
        wizard.modelReady.connect(self.register_model)
        self.setup_wizard = wizard
        wizard.open()
        return wizard

    def register_model(self, record: ModelRecord) -> None:
        """Add a model to the registry and the picker, select it and load it."""
        try:
            self.model_registry.upsert(record)
        except OSError as exc:
            self.show_notice(f"Model details not saved: {exc.strerror or exc}")
        self.app_settings = settings_with_model(self.app_settings, record.ref, record.name)
        self._save_settings()
        self._fill_model_picker()
        if self.controller.busy:
            self._select_in_picker(self.bridge.model_ref if self.bridge else None)
            self.show_notice(f"{record.name} is ready: pick it once this reply has finished.")
        else:
            self.load_model(record.ref)
        self._update_send_state()

    def open_model_library(self) -> ModelLibraryDialog:
        """Show the model library (window-modal, not blocking)."""
        if self.model_library is not None and self.model_library.isVisible():
            self.model_library.raise_()
            return self.model_library
        if self.model_library is not None:
            self.model_library.deleteLater()
        dialog = ModelLibraryDialog(self.app_settings, self.model_registry, self, release_model=self._release_model)
        dialog.setWindowModality(Qt.WindowModality.WindowModal)
        dialog.settingsChanged.connect(self._on_library_changed)
        self.model_library = dialog
        dialog.open()
        return dialog

    def _release_model(self, ref: str) -> None:
        """Before a model's files are removed: switch to the demo if that model is in use."""
        if self.bridge is not None and ref in (self.bridge.model_ref, self.bridge.loading_ref):
            if self.controller.busy:
                self.controller.stop()
            self.load_model("demo")

    def _on_library_changed(self, settings: AppSettings) -> None:
        self.app_settings = settings
        self._save_settings()
        self._fill_model_picker()
        self._update_send_state()

    def _engine_options_for(self, ref: str):
        """RuntimeOptions for loading ``ref``: sizes set in Preferences, else the model's own (from the wizard)."""
        return self.app_settings.runtime_options(self.model_registry.get(ref))

    # Busy state ----------------------------------------------------------------
    def _on_busy_changed(self, busy: bool) -> None:
        if not busy:
            self.telemetry.flush()  # the reply's last points, without waiting for the next redraw
        self.stop_action.setEnabled(busy)
        self.regenerate_action.setEnabled(not busy)
        self.model_picker.setEnabled(not busy)

    def _on_conversation_changed(self, conversation_id) -> None:
        try:
            conversation = self.history.conversation(conversation_id) if conversation_id is not None else None
        except HistoryError:
            conversation = None  # the controller has said why
        title = conversation.title if conversation else "New chat"
        self.setWindowTitle(f"{title} — ExpertDesk {__version__}")
        has = conversation is not None
        for act in (self.export_md_action, self.export_json_action, self.rename_action, self.delete_action):
            act.setEnabled(has)

    # Export --------------------------------------------------------------------
    def export_conversation(self, path: str | Path, fmt: str) -> Path:
        """Write the current conversation to ``path`` as "md" or "json"."""
        conversation = self.history.conversation(self.controller.current_id) if self.controller.current_id else None
        if conversation is None:
            raise ValueError("there is no saved conversation to export; send a message first")
        messages = self.history.messages(conversation.id)
        text = export_markdown(conversation, messages) if fmt == "md" else export_json(conversation, messages)
        path = Path(path)
        path.write_text(text, encoding="utf-8")
        return path

    def export_dialog(self, fmt: str) -> None:
        try:
            conversation = (self.history.conversation(self.controller.current_id) if self.controller.current_id
                            else None)
        except HistoryError as exc:
            QMessageBox.warning(self, "Export failed", f"The chat could not be read from the history: {exc}.")
            return
        if conversation is None:
            self.show_notice("Nothing to export yet: send a message first.")
            return
        suffix, kind = (".md", "Markdown (*.md)") if fmt == "md" else (".json", "JSON (*.json)")
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in conversation.title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / (name + suffix)), kind)
        if not path:
            return
        try:
            written = self.export_conversation(path, fmt)
        except HistoryError as exc:
            QMessageBox.warning(self, "Export failed", f"The chat could not be read from the history: {exc}.")
            return
        except OSError as exc:
            QMessageBox.warning(self, "Export failed",
                                f"Could not write {path}: {exc.strerror or exc}. "
                                "Choose another folder or free some space.")
            return
        self.show_notice(f"Exported to {written}")

    # Preferences, theme, fonts --------------------------------------------------
    def open_preferences(self) -> None:
        dialog = PreferencesDialog(self.app_settings, self)
        if dialog.exec():
            self.app_settings = dialog.result_settings()
            self._save_settings()
            ref = self.bridge.model_ref if self.bridge is not None else None  # every load takes the new options
            if ref is not None and not self.controller.busy and self._engine_options_for(ref) != self.bridge.options:
                self.load_model(ref)  # new device or sizes: the engine reloads the model with them
            self._fill_model_picker()
            self._apply_theme()
            self._apply_font()

    def set_theme(self, theme: str) -> None:
        """Use "system", "light" or "dark" from now on (saved)."""
        self.app_settings = replace(self.app_settings, theme=theme)
        self._save_settings()
        self._apply_theme()

    def _on_color_scheme_changed(self, _scheme) -> None:
        if self.app_settings.theme == "system":
            self._apply_theme()

    def _apply_theme(self) -> None:
        dark = apply_theme(self.app_settings.theme)
        self.dark = dark
        self.banner.setStyleSheet(f"color: {ERROR_COLOR[dark]};")
        self.history_banner.setStyleSheet(f"color: {WARNING_COLOR[dark]};")
        self._apply_font()
        self.chat_view.set_theme(MarkdownRenderer(html_colors(dark)), dark)
        self.telemetry.set_dark(dark)
        for act in self.theme_group.actions():
            act.setChecked(act.data() == self.app_settings.theme)

    def change_font_size(self, step: int) -> None:
        """Bigger (+1), smaller (-1) or default (0) text in the whole window."""
        points = DEFAULT_FONT_POINTS if step == 0 else self.app_settings.font_points + step
        points = max(MIN_FONT_POINTS, min(MAX_FONT_POINTS, points))
        self.app_settings = replace(self.app_settings, font_points=points)
        self._save_settings()
        self._apply_font()

    def _apply_font(self) -> None:
        # Set on the application too: dialogs, menus and style-sheet re-polishes then follow it.
        font = QFont(QApplication.font())
        font.setPointSize(self.app_settings.font_points)
        QApplication.setFont(font)
        self.setFont(font)
        # The type scale's point sizes follow the body font; and widgets polished by the style
        # sheet hold the font they had then: polishing again hands them the new one.
        dark = getattr(self, "dark", False)
        self.setStyleSheet(_STYLE[dark] + style_sheet(dark, font.pointSizeF()))

    def _on_telemetry_toggled(self, shown: bool) -> None:
        if getattr(self, "_shut_down", False) or not self.isVisible():
            return  # closing the window hides every dock; that is not the user's choice
        if shown != self.app_settings.show_telemetry:
            self.app_settings = replace(self.app_settings, show_telemetry=shown)
            self._save_settings()

    def _save_settings(self) -> None:
        try:
            save_settings(self.app_settings)
        except OSError as exc:
            self.show_notice(f"Settings not saved: {exc.strerror or exc}")

    # Messages to the user ------------------------------------------------------------
    def show_notice(self, text: str) -> None:
        """A short note in the status bar that fades after a few seconds."""
        self.notice_label.setText(text)
        self._notice_timer.start(NOTICE_MS)

    def show_error(self, text: str) -> None:
        """An error above the chat that stays until the next model load."""
        self.banner.setText(f"<b>Error:</b> {html.escape(text)}")
        self.banner.setVisible(True)

    def _on_history_state(self, text: str) -> None:
        self._history_runtime_note = text
        self._update_history_banner()

    def _dismiss_history_note(self, _link: str) -> None:
        self._history_startup_note = ""
        self._update_history_banner()

    def _update_history_banner(self) -> None:
        """The history line above the chat: what start-up found (dismissable), then what happens now."""
        parts = []
        if self._history_startup_note:
            parts.append(f"<b>Chat history:</b> {html.escape(self._history_startup_note)} "
                         '<a href="dismiss">Dismiss</a>')
        if self._history_runtime_note:
            parts.append(f"<b>Chat history:</b> {html.escape(self._history_runtime_note)}")
        self.history_banner.setText("<br>".join(parts))
        self.history_banner.setVisible(bool(parts))

    def _focus_search(self) -> None:
        self.conversation_list.search.setFocus()
        self.conversation_list.search.selectAll()

    # Closing ---------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt naming
        self.shutdown()
        super().closeEvent(event)

    def shutdown(self) -> None:
        """Stop the engine and close the history (idempotent)."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        if self.setup_wizard is not None and self.setup_wizard.build_page.running:
            self.setup_wizard.build_page.cancel_build()  # stops at the next safe point; a later run resumes
        hints = QGuiApplication.styleHints()
        if hints is not None:
            hints.colorSchemeChanged.disconnect(self._on_color_scheme_changed)
        self.settings_panel.flush()
        if self.bridge is not None:
            self.bridge.shutdown()
        self.controller.shutdown()
        self.history.close()
