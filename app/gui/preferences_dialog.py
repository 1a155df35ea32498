"""App preferences: known models, cache sizes, device, reply precision, theme and font size."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.gui import icons
from app.gui.settings import DEVICES, MAX_FONT_POINTS, MIN_FONT_POINTS, THEMES, AppSettings, KnownModel


class PreferencesDialog(QDialog):
    """Edits an ``AppSettings``; ``result_settings()`` gives the edited copy after ``exec()``."""

    def __init__(self, settings: AppSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Preferences")
        self._settings = settings
        self.models = QListWidget(self)
        self.models.setAccessibleName("Known models")
        for model in settings.models:
            self._add_item(model)
        add_pack = QPushButton("Add pack folder…", self)
        add_pack.clicked.connect(self._add_pack)
        add_gguf = QPushButton("Add GGUF file…", self)
        add_gguf.clicked.connect(self._add_gguf)
        self.remove = QPushButton("Remove", self)
        self.remove.setAccessibleName("Remove the selected model from the list")
        self.remove.clicked.connect(self._remove)
        buttons_row = QHBoxLayout()
        for button, icon_name in ((add_pack, "folder"), (add_gguf, "open-file"), (self.remove, "delete")):
            icons.bind(button, icon_name)
            buttons_row.addWidget(button)
        buttons_row.addStretch(1)

        self.device = QComboBox(self)
        self.device.addItems(DEVICES)
        self.device.setCurrentText(settings.device)
        self.device.setAccessibleName("Device")
        self.cache_vram = QSpinBox(self)
        self.cache_vram.setRange(0, 1024 * 1024)
        self.cache_vram.setSingleStep(512)
        self.cache_vram.setSuffix(" MiB")
        self.cache_vram.setSpecialValueText("automatic")
        self.cache_vram.setValue(settings.cache_vram_mib)
        self.cache_vram.setAccessibleName("GPU expert cache size")
        self.cache_host = QSpinBox(self)
        self.cache_host.setRange(0, 4 * 1024 * 1024)
        self.cache_host.setSingleStep(1024)
        self.cache_host.setSuffix(" MiB")
        self.cache_host.setSpecialValueText("off")
        self.cache_host.setValue(settings.cache_host_mib)
        self.cache_host.setAccessibleName("Host RAM expert tier size")
        self.verify_reads = QCheckBox("Check every expert read against the pack's hashes", self)
        self.verify_reads.setToolTip("Detects a drive that returns wrong bytes; costs CPU time on every read")
        self.verify_reads.setChecked(settings.verify_reads)
        self.verify_reads.setAccessibleName("Verify expert reads")
        self.float32_replies = QCheckBox("Compute replies in float32", self)
        self.float32_replies.setToolTip(
            "On a GPU, prompts run in bfloat16 and replies in float32: the reply's tokens come closer to a "
            "full-precision run, each reply token costs a little more time, and the conversation's memory "
            "(KV state) takes twice the bytes. On a CPU everything runs in float32 already.")
        self.float32_replies.setChecked(settings.float32_replies)
        self.float32_replies.setAccessibleName("Compute replies in float32")
        self.theme = QComboBox(self)
        self.theme.addItems(THEMES)
        self.theme.setCurrentText(settings.theme)
        self.theme.setAccessibleName("Theme")
        self.font_points = QSpinBox(self)
        self.font_points.setRange(MIN_FONT_POINTS, MAX_FONT_POINTS)
        self.font_points.setSuffix(" pt")
        self.font_points.setValue(settings.font_points)
        self.font_points.setAccessibleName("Font size")

        form = QFormLayout()
        form.addRow("Device", self.device)
        form.addRow("GPU expert cache", self.cache_vram)
        form.addRow("Host RAM tier", self.cache_host)
        form.addRow("Drive reads", self.verify_reads)
        form.addRow("Precision", self.float32_replies)
        form.addRow("Theme", self.theme)
        form.addRow("Font size", self.font_points)
        note = QLabel("A new device, cache size, precision or read check reloads the loaded model with it.",
                      self)
        note.setWordWrap(True)
        box = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel, self)
        box.accepted.connect(self.accept)
        box.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>Models in the picker</b>", self))
        layout.addWidget(self.models)
        layout.addLayout(buttons_row)
        layout.addLayout(form)
        layout.addWidget(note)
        layout.addWidget(box)

    def _add_item(self, model: KnownModel) -> None:
        item = QListWidgetItem(f"{model.label}\n{model.ref}" if not model.is_demo else model.label)
        item.setData(Qt.ItemDataRole.UserRole, (model.ref, model.name))
        self.models.addItem(item)

    def _add_pack(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose an Expert Pack folder")
        if folder:
            self._add_item(KnownModel(folder, Path(folder).name))

    def _add_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self._add_item(KnownModel(path, Path(path).name))

    def _remove(self) -> None:
        item = self.models.currentItem()
        if item is not None and item.data(Qt.ItemDataRole.UserRole)[0] != "demo":
            self.models.takeItem(self.models.row(item))

    def result_settings(self) -> AppSettings:
        """The settings as edited in the dialog."""
        models = tuple(KnownModel(*self.models.item(i).data(Qt.ItemDataRole.UserRole))
                       for i in range(self.models.count()))
        return replace(
            self._settings,
            models=models,
            device=self.device.currentText(),
            cache_vram_mib=self.cache_vram.value(),
            cache_host_mib=self.cache_host.value(),
            verify_reads=self.verify_reads.isChecked(),
            float32_replies=self.float32_replies.isChecked(),
            theme=self.theme.currentText(),
            font_points=self.font_points.value(),
        ).clamped()
