""""Add a server…": a model on an OpenAI-compatible server (SGLang, vLLM, llama-server, expertdesk serve).

The user gives the base URL and, if the server wants one, an API key; "Test connection"
lists the server's models (``GET /v1/models``, on a worker thread) and says plainly what
failed: unreachable, TLS error, refused key (401), no models. Adding stores the key in
the system keyring (``app.remote_keys``) and returns the model's ref
(``engine.remote.endpoint_ref``); the key never reaches the settings, the registry or a log.
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.gui import icons
from app.gui.qt_compat import protect_none_refcount
from app.gui.theme import ERROR_COLOR
from app.gui.wizard_workers import BackgroundTask
from engine.remote import ConnectionReport, EndpointProblem, check_connection, endpoint_ref, normalize_base_url

QUEUED = Qt.ConnectionType.QueuedConnection
PLACEHOLDER_URL = "http://gpu-box:8000/v1"


class AddServerDialog(QDialog):
    """Base URL, optional API key, model picked from the server's list; ``ref``/``model_name`` once accepted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        protect_none_refcount()
        super().__init__(parent)
        self.setWindowTitle("Add a server")
        self.setObjectName("addServerDialog")
        self.task: BackgroundTask | None = None
        self.report: ConnectionReport | None = None
        self.ref: str | None = None
        self.model_name = ""

        self.url_edit = QLineEdit(self)
        self.url_edit.setPlaceholderText(PLACEHOLDER_URL)
        self.url_edit.setAccessibleName("Server URL")
        self.key_edit = QLineEdit(self)
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("optional; kept in the system keyring")
        self.key_edit.setAccessibleName("API key")
        self.model_combo = QComboBox(self)
        self.model_combo.setAccessibleName("Model on the server")
        self.model_combo.setEnabled(False)
        self.test_button = QPushButton("Test connection", self)
        self.test_button.clicked.connect(self.test_connection)
        icons.bind(self.test_button, "connection")
        self.result = QLabel("Enter the server's address (what SGLang, vLLM or expertdesk serve print), then "
                             "test the connection.", self)
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.result.setAccessibleName("Connection result")

        form = QFormLayout()
        form.addRow("Base URL", self.url_edit)
        form.addRow("API key", self.key_edit)
        form.addRow("", self.test_button)
        form.addRow("Model", self.model_combo)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel,
                                        self)
        self.add_button = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.add_button.setText("Add")
        icons.bind(self.add_button, "add")
        self.add_button.setEnabled(False)
        self.buttons.accepted.connect(self.add)
        self.buttons.rejected.connect(self.reject)
        self.url_edit.textChanged.connect(self._forget_report)
        self.key_edit.textChanged.connect(self._forget_report)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.result)
        layout.addWidget(self.buttons)

    def _forget_report(self) -> None:
        """A changed URL or key needs a new test before a model can be added."""
        self.report = None
        self.model_combo.clear()
        self.model_combo.setEnabled(False)
        self.add_button.setEnabled(False)

    def test_connection(self) -> None:
        """List the server's models on a worker thread; the result label says how it went."""
        if not self.test_button.isEnabled():  # a test is under way (its answer re-enables the button)
            return
        url, key = self.url_edit.text().strip(), self.key_edit.text().strip() or None
        try:
            url = normalize_base_url(url)
        except EndpointProblem as problem:
            self._show_problem(problem)
            return
        self._forget_report()
        self.test_button.setEnabled(False)
        self.result.setText(f"Connecting to {html.escape(url)}…")
        task = BackgroundTask(lambda report: check_connection(url, key), name="remote-connection-test")
        task.succeeded.connect(self._on_connected, QUEUED)
        task.failed.connect(self._on_failed, QUEUED)
        self.task = task.start()

    @Slot(object)
    def _on_connected(self, report: ConnectionReport) -> None:
        self.test_button.setEnabled(True)
        self.report = report
        self.model_combo.clear()
        for card in report.models:
            context = f" · context {card.context_length:,}" if card.context_length else ""
            self.model_combo.addItem(f"{card.id}{context}", card.id)
        self.model_combo.setEnabled(True)
        self.add_button.setEnabled(True)
        self.result.setText(f"✔ {html.escape(report.summary())}")

    @Slot(object)
    def _on_failed(self, exc: BaseException) -> None:
        self.test_button.setEnabled(True)
        self._show_problem(exc if isinstance(exc, EndpointProblem)
                           else EndpointProblem("unreachable", f"the test failed: {exc}"))

    def _show_problem(self, problem: EndpointProblem) -> None:
        titles = {"unreachable": "Server unreachable", "tls": "TLS error", "timeout": "No answer in time",
                  "unauthorized": "API key refused", "no_models": "No models", "bad_url": "Not a server URL",
                  "model_not_found": "No such model", "http": "Server error"}
        self.result.setText(f'<span style="color:{ERROR_COLOR[False]};"><b>✖ {titles[problem.reason]}:</b> '
                            f"{html.escape(problem.message)}</span>")

    def add(self) -> None:
        """Store the key (if any) in the keyring and accept with the picked model's ref."""
        from app.remote_keys import KeyStoreError, store_api_key

        if self.report is None or self.model_combo.currentData() is None:
            return
        key = self.key_edit.text().strip()
        if key:
            try:
                store_api_key(self.report.base_url, key)
            except KeyStoreError as exc:
                self.result.setText(f'<span style="color:{ERROR_COLOR[False]};"><b>✖ Not added:</b> '
                                    f"{html.escape(str(exc))}</span>")
                return
        self.model_name = str(self.model_combo.currentData())
        self.ref = endpoint_ref(self.report.base_url, self.model_name)
        self.accept()
