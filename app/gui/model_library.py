"""The model library: every model in the picker with its architecture, size, location and health.

Rename, remove (keeping or deleting the pack), re-verify (quick or full, on a worker
thread with progress; the result is saved as "last verified"), open the folder, and
add an existing pack. The built-in demo is listed but cannot be renamed or removed.

The dialog edits a copy of the app settings and the shared ``ModelRegistry``; after
each change it emits ``settingsChanged(AppSettings)`` and the main window saves the
settings and refreshes the picker.
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.gui import icons
from app.gui.qt_compat import protect_none_refcount
from app.gui.settings import AppSettings
from app.gui.wizard_logic import Progress
from app.gui.wizard_workers import BackgroundTask
from app.models_registry import (
    LibraryEntry,
    ModelRegistry,
    disk_bytes,
    is_pack_dir,
    library_entries,
    pack_record,
    remove_model,
    settings_renamed,
    settings_with_model,
)
from packer.diskio import format_bytes

COLUMNS = ("Name", "Architecture", "Size on disk", "Location", "Last verified")
QUEUED = Qt.ConnectionType.QueuedConnection


def verified_text(entry: LibraryEntry) -> str:
    """'✔ full · 2025-11-30 10:12', '✖ quick · …', or 'never'."""
    record = entry.record
    if record is None or record.last_verified_at is None:
        return "never"
    when = _dt.datetime.fromtimestamp(record.last_verified_at).strftime("%Y-%m-%d %H:%M")
    mark = "✔" if record.last_verified_ok else "✖ FAILED"
    return f"{mark} {record.last_verified_mode} · {when}"


class ModelLibraryDialog(QDialog):
    """Manage the registered models. ``release_model(ref)`` is called before a pack is deleted."""

    settingsChanged = Signal(object)  # AppSettings
    verifyFinished = Signal(str, object)  # ref, VerifyReport or the exception

    def __init__(self, settings: AppSettings, registry: ModelRegistry, parent: QWidget | None = None, *,
                 release_model: Callable[[str], None] | None = None) -> None:
        protect_none_refcount()
        super().__init__(parent)
        self.setWindowTitle("Model library")
        self.setObjectName("modelLibrary")
        self.resize(900, 420)
        self.settings = settings
        self.registry = registry
        self._release_model = release_model
        self.entries: list[LibraryEntry] = []
        self.task: BackgroundTask | None = None
        self._verifying: str | None = None

        self.table = QTableWidget(0, len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(False)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # long paths keep their start and end
        self.table.setAccessibleName("Registered models")
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self.rename_selected())

        self.rename_button = QPushButton("Rename…", self)
        self.rename_button.clicked.connect(self.rename_selected)
        self.remove_button = QPushButton("Remove…", self)
        self.remove_button.clicked.connect(self.remove_selected)
        self.quick_button = QPushButton("Verify (quick)", self)
        self.quick_button.setToolTip("Check the structure and a sample of experts (seconds)")
        self.quick_button.clicked.connect(lambda: self.verify_selected(quick=True))
        self.full_button = QPushButton("Verify (full)", self)
        self.full_button.setToolTip("Read every byte of the pack and check its SHA-256 (minutes for a big model)")
        self.full_button.clicked.connect(lambda: self.verify_selected(quick=False))
        self.open_button = QPushButton("Open folder", self)
        self.open_button.clicked.connect(self.open_selected_folder)
        self.add_button = QPushButton("Add existing pack…", self)
        self.add_button.clicked.connect(self.add_existing_pack)
        self.add_server_button = QPushButton("Add a server…", self)
        self.add_server_button.setToolTip("A model on an OpenAI-compatible server: SGLang, vLLM, llama-server or "
                                          "another ExpertDesk (expertdesk serve)")
        self.add_server_button.clicked.connect(self.add_server)
        self.server_dialog = None  # the open "Add a server" dialog (app.gui.remote_server_dialog)
        for button, icon_name in ((self.rename_button, "rename"), (self.remove_button, "delete"),
                                  (self.quick_button, "verify"), (self.full_button, "verify-full"),
                                  (self.open_button, "folder"), (self.add_button, "add-model"),
                                  (self.add_server_button, "server")):
            icons.bind(button, icon_name)
        row = QHBoxLayout()
        for button in (self.rename_button, self.remove_button, self.quick_button, self.full_button, self.open_button):
            row.addWidget(button)
        row.addStretch(1)
        row.addWidget(self.add_button)
        row.addWidget(self.add_server_button)

        self.progress = QProgressBar(self)
        self.progress.setRange(0, 1000)
        self.progress.setVisible(False)
        self.progress.setAccessibleName("Verification progress")
        self.status = QLabel(self)
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status.setAccessibleName("Library status")
        box = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, self)
        box.rejected.connect(self.reject)

        layout = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addLayout(row)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(box)
        self.refresh()

    # Table --------------------------------------------------------------------------------
    def refresh(self, select: str | None = None) -> None:
        """Rebuild the rows from the settings and the registry (keeps or sets the selection)."""
        current = select or self.selected_ref()
        self.entries = library_entries(self.settings, self.registry)
        self.table.setRowCount(len(self.entries))
        for row, entry in enumerate(self.entries):
            size = disk_bytes(entry.location) if entry.exists else 0
            where = str(entry.location) if entry.location is not None else "—"
            if entry.is_server:
                where = entry.ref.partition("#")[0]  # the server's base URL
            if not entry.exists:
                where += "  (not built yet)" if entry.is_demo else "  (missing!)"
            record = entry.record
            values = (entry.label, entry.architecture or "—", format_bytes(size) if size else "—", where,
                      verified_text(entry))
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setData(Qt.ItemDataRole.UserRole, entry.ref)
                if col == 3:
                    item.setToolTip(where)
                if col == 4 and record is not None and record.last_verified_summary:
                    item.setToolTip(record.last_verified_summary)
                self.table.setItem(row, col, item)
        refs = [e.ref for e in self.entries]
        self.table.selectRow(refs.index(current) if current in refs else 0)
        self._update_buttons()

    def selected_ref(self) -> str | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return None
        item = self.table.item(rows[0].row(), 0)
        return item.data(Qt.ItemDataRole.UserRole) if item is not None else None

    def entry(self, ref: str | None) -> LibraryEntry | None:
        return next((e for e in self.entries if e.ref == ref), None)

    def select(self, ref: str) -> None:
        refs = [e.ref for e in self.entries]
        if ref in refs:
            self.table.selectRow(refs.index(ref))

    def row_text(self, ref: str) -> list[str]:
        """The cells of a model's row (tests, accessibility)."""
        refs = [e.ref for e in self.entries]
        row = refs.index(ref)
        return [self.table.item(row, c).text() for c in range(len(COLUMNS))]

    def _update_buttons(self) -> None:
        entry = self.entry(self.selected_ref())
        busy = self.task is not None and self.task.running
        self.rename_button.setEnabled(entry is not None and not entry.is_demo and not busy)
        self.remove_button.setEnabled(entry is not None and entry.removable and not busy)
        self.remove_button.setToolTip("The built-in demo model cannot be removed" if entry is not None and
                                      entry.is_demo else "Remove this model from the list (optionally delete its pack)")
        can_verify = entry is not None and entry.is_pack and entry.exists and not busy
        self.quick_button.setEnabled(can_verify)
        self.full_button.setEnabled(can_verify)
        self.open_button.setEnabled(entry is not None and entry.location is not None and
                                    (entry.location.exists() or entry.location.parent.exists()))
        self.add_button.setEnabled(not busy)

    def _changed(self, select: str | None = None) -> None:
        self.refresh(select)
        self.settingsChanged.emit(self.settings)

    # Rename ------------------------------------------------------------------------------------
    def rename_selected(self) -> None:
        entry = self.entry(self.selected_ref())
        if entry is None or entry.is_demo:
            return
        name, ok = QInputDialog.getText(self, "Rename model", "Name in the model list:", text=entry.name)
        if ok and name.strip():
            self.rename_model(entry.ref, name)

    def rename_model(self, ref: str, name: str) -> None:
        if ref == "demo" or not name.strip():
            return
        self.registry.rename(ref, name.strip())
        self.settings = settings_renamed(self.settings, ref, name.strip())
        self.status.setText(f"Renamed to “{html.escape(name.strip())}”.")
        self._changed(ref)

    # Remove ------------------------------------------------------------------------------------
    def ask_remove(self, entry: LibraryEntry) -> str | None:
        """Ask how to remove: "keep" (list only), "delete" (and the pack's files) or None (cancel)."""
        box = QMessageBox(self)
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("Remove model")
        box.setText(f"Remove “{entry.name}” from the model list?")
        keep = box.addButton("Remove from list, keep files", QMessageBox.ButtonRole.AcceptRole)
        delete = None
        if entry.can_delete_files:
            size = format_bytes(disk_bytes(entry.location))
            box.setInformativeText(f"The pack is at {entry.location} ({size}). Deleting it cannot be undone; "
                                   "rebuilding it needs the source GGUF again.")
            delete = box.addButton(f"Remove and delete the pack ({size})", QMessageBox.ButtonRole.DestructiveRole)
            icons.bind(delete, "delete")
        else:
            box.setInformativeText(f"The files at {entry.location} are kept.")
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.exec()
        clicked = box.clickedButton()
        if clicked is keep:
            return "keep"
        if delete is not None and clicked is delete:
            return "delete"
        return None

    def remove_selected(self) -> None:
        entry = self.entry(self.selected_ref())
        if entry is None or not entry.removable:
            return
        choice = self.ask_remove(entry)
        if choice in ("keep", "delete"):
            self.remove(entry.ref, delete_files=choice == "delete")

    def remove(self, ref: str, *, delete_files: bool = False) -> int:
        """Remove a model (never the demo); with ``delete_files`` its pack too. Returns bytes freed."""
        entry = self.entry(ref)
        if entry is None or not entry.removable:
            return 0
        if self._release_model is not None:
            self._release_model(ref)
        try:
            self.settings, freed = remove_model(self.settings, self.registry, ref,
                                                delete_files=delete_files and entry.can_delete_files)
        except (OSError, ValueError) as exc:
            self.status.setText(f"Could not delete {html.escape(ref)}: {html.escape(str(exc))}")
            return 0
        if entry.is_server:  # its server's API key goes with the last of its models
            from app.remote_keys import KeyStoreError, forget_key_unless_used

            try:
                forget_key_unless_used(ref, (m.ref for m in self.settings.models))
            except KeyStoreError as exc:
                self.status.setText(f"Removed, but {html.escape(str(exc))}")
        self.status.setText(f"Removed “{html.escape(entry.name)}”" +
                            (f" and deleted its pack: {format_bytes(freed)} freed." if freed
                             else "; its files are kept."))
        self._changed()
        return freed

    # Verify ------------------------------------------------------------------------------------
    def verify_selected(self, quick: bool) -> None:
        entry = self.entry(self.selected_ref())
        if entry is not None:
            self.verify(entry.ref, quick=quick)

    def verify(self, ref: str, *, quick: bool) -> None:
        """Verify a pack on a worker thread; the result is saved in the registry as "last verified"."""
        from packer.verify import verify_pack

        entry = self.entry(ref)
        if entry is None or not entry.is_pack or not entry.exists or (self.task is not None and self.task.running):
            return
        location, registry, name, mode = entry.location, self.registry, entry.name, "quick" if quick else "full"

        def work(report):
            result = verify_pack(location, quick=quick,
                                 progress=lambda d, t, r, e, p: report(Progress("verify", d, t, r, e, p)))
            registry.mark_verified(ref, result.ok, mode, result.summary(), name=name)
            return result

        self._verifying = ref
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.status.setText(f"Verifying “{html.escape(name)}” ({mode})…")
        task = BackgroundTask(work, name="library-verify")
        task.progress.connect(self._on_verify_progress, QUEUED)
        task.succeeded.connect(self._on_verified, QUEUED)
        task.failed.connect(self._on_verify_failed, QUEUED)
        self.task = task.start()
        self._update_buttons()

    @Slot(object)
    def _on_verify_progress(self, p: Progress) -> None:
        self.progress.setValue(int(p.fraction * 1000))
        self.status.setText(f"Verifying… {p.text()}")

    @Slot(object)
    def _on_verified(self, result) -> None:
        ref, self._verifying = self._verifying, None
        self.progress.setValue(1000)
        self.progress.setVisible(False)
        mode = "Quick" if result.quick else "Full"
        self.status.setText(f"{mode} verification: OK — {result.slices_checked} of {result.slices_total} "
                            f"slices checked, {format_bytes(result.bytes_read)} read in {result.seconds:.1f} s."
                            if result.ok else
                            f"{mode} verification FAILED: {html.escape(result.summary())}. Rebuild the pack from its "
                            "GGUF; if it happens again, check the drive.")
        self.refresh(ref)
        self.verifyFinished.emit(ref or "", result)

    @Slot(object)
    def _on_verify_failed(self, exc: BaseException) -> None:
        ref, self._verifying = self._verifying, None
        self.progress.setVisible(False)
        self.status.setText(f"Verification could not run: {html.escape(str(exc))}")
        self.refresh(ref)
        self.verifyFinished.emit(ref or "", exc)

    # Folder, add -------------------------------------------------------------------------------
    def folder_of(self, entry: LibraryEntry) -> Path | None:
        """The folder to open: the one that contains the pack / GGUF."""
        if entry.location is None:
            return None
        return entry.location.parent if entry.location.parent.exists() else None

    def open_selected_folder(self) -> None:
        entry = self.entry(self.selected_ref())
        folder = self.folder_of(entry) if entry is not None else None
        if folder is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))

    def add_existing_pack(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose an Expert Pack folder (NAME.expertpack)")
        if folder:
            self.add_pack(folder)

    def add_server(self):
        """Open "Add a server…"; the model picked there is added when the dialog is accepted."""
        from app.gui.remote_server_dialog import AddServerDialog

        dialog = AddServerDialog(self)
        dialog.accepted.connect(lambda: self.add_remote_model(dialog.ref, dialog.model_name))
        self.server_dialog = dialog
        dialog.open()
        return dialog

    def add_remote_model(self, ref: str | None, model_name: str) -> None:
        """Register a server's model (ref ``URL#model``) and put it in the picker, not selected."""
        from urllib.parse import urlsplit

        from app.models_registry import ModelRecord

        if not ref:
            return
        host = urlsplit(ref.partition("#")[0]).netloc
        record = self.registry.upsert(ModelRecord(ref=ref, name=f"{model_name} @ {host}", architecture="remote server"))
        self.settings = replace(settings_with_model(self.settings, record.ref, record.name),
                                last_model=self.settings.last_model)
        self.status.setText(f"Added “{html.escape(record.name)}”: pick it in the model list to chat with it.")
        self._changed(record.ref)

    def add_pack(self, folder: str | Path) -> bool:
        """Register an existing pack folder (it must be a finished pack)."""
        from expertpack import PackError, load_manifest

        path = Path(folder)
        try:
            load_manifest(path)
        except PackError as exc:
            self.status.setText(f"Not added: {html.escape(str(exc))}")
            return False
        if not is_pack_dir(path):
            self.status.setText(f"Not added: {html.escape(str(path))} is not a NAME.expertpack folder.")
            return False
        record = self.registry.upsert(pack_record(path))
        # In the picker, but not selected: the model in use stays the last used one.
        self.settings = replace(settings_with_model(self.settings, record.ref, record.name),
                                last_model=self.settings.last_model)
        self.status.setText(f"Added “{html.escape(record.name)}”.")
        self._changed(record.ref)
        return True
