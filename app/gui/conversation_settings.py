"""Side panel with the current conversation's system prompt and sampling settings."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import QSignalBlocker, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.history import ChatSettings

MAX_SEED = 2**31 - 1  # QSpinBox holds a C int; any seed in this range is as good as another


class ConversationSettingsPanel(QWidget):
    """Edits a ``ChatSettings``; emits ``settingsChanged`` shortly after the user stops typing."""

    settingsChanged = Signal(object)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.system_prompt = QPlainTextEdit(self)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional instructions the model sees before every message")
        self.system_prompt.setMaximumHeight(140)
        self.temperature = QDoubleSpinBox(self)
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.temperature.setAccessibleName("Temperature")
        self.temperature.setToolTip("Randomness. 0 always picks the most likely token (greedy, reproducible).")
        self.top_p = QDoubleSpinBox(self)
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.01)
        self.top_p.setDecimals(2)
        self.top_p.setAccessibleName("Top-p")
        self.top_p.setToolTip("Keep the most likely tokens whose probabilities add up to this (1 = off).")
        self.top_k = QSpinBox(self)
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("0 (off)")
        self.top_k.setAccessibleName("Top-k")
        self.top_k.setToolTip("Keep only the k most likely tokens (0 = off).")
        self.max_tokens = QSpinBox(self)
        self.max_tokens.setRange(1, 262144)
        self.max_tokens.setSingleStep(256)
        self.max_tokens.setAccessibleName("Maximum reply tokens")
        self.max_tokens.setToolTip("The reply stops after this many tokens (stop reason: max_tokens).")
        self.seed = QSpinBox(self)
        self.seed.setRange(-1, MAX_SEED)
        self.seed.setSpecialValueText("random")
        self.seed.setAccessibleName("Seed")
        self.seed.setToolTip("A fixed seed repeats the same reply for the same prompt; 'random' varies it.")
        self.thinking = QCheckBox("Let the model think first (reasoning)", self)
        self.thinking.setAccessibleName("Reasoning")
        self.reset_button = QPushButton("Reset to defaults", self)
        self.reset_button.setAccessibleName("Reset sampling settings to defaults")
        self.reset_button.clicked.connect(lambda: self._reset())

        form = QFormLayout()
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>System prompt</b>", self))
        layout.addWidget(self.system_prompt)
        layout.addWidget(QLabel("<b>Sampling</b>", self))
        layout.addLayout(form)
        layout.addWidget(self.thinking)
        layout.addWidget(self.reset_button)
        layout.addStretch(1)

        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(400)
        self._debounce.timeout.connect(self._emit)
        for spin in (self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed):
            spin.valueChanged.connect(self._changed)
        self.system_prompt.textChanged.connect(self._changed)
        self.thinking.toggled.connect(self._changed)
        self.set_settings(ChatSettings())

    def settings(self) -> ChatSettings:
        """The settings as shown now."""
        return ChatSettings(
            system_prompt=self.system_prompt.toPlainText(),
            temperature=round(self.temperature.value(), 4),
            top_p=round(self.top_p.value(), 4),
            top_k=self.top_k.value(),
            max_tokens=self.max_tokens.value(),
            seed=None if self.seed.value() < 0 else self.seed.value(),
            thinking=self.thinking.isChecked(),
        )

    def set_settings(self, settings: ChatSettings) -> None:
        """Show a conversation's settings (does not emit settingsChanged)."""
        widgets = (self.system_prompt, self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed,
                   self.thinking)
        blockers = [QSignalBlocker(w) for w in widgets]
        try:
            if self.system_prompt.toPlainText() != settings.system_prompt:
                self.system_prompt.setPlainText(settings.system_prompt)
            self.temperature.setValue(settings.temperature)
            self.top_p.setValue(settings.top_p)
            self.top_k.setValue(settings.top_k)
            self.max_tokens.setValue(settings.max_tokens)
            self.seed.setValue(-1 if settings.seed is None else min(settings.seed, MAX_SEED))
            self.thinking.setChecked(settings.thinking)
        finally:
            del blockers
        self._debounce.stop()

    def flush(self) -> None:
        """Emit a pending change now (before sending, so the reply uses what is shown)."""
        if self._debounce.isActive():
            self._debounce.stop()
            self._emit()

    def _reset(self) -> None:
        self.set_settings(replace(ChatSettings(), system_prompt=self.system_prompt.toPlainText()))
        self._emit()

    def _changed(self, *_: object) -> None:
        self._debounce.start()

    def _emit(self) -> None:
        self.settingsChanged.emit(self.settings())
