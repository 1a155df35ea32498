"""The wizard's "download" start: a catalogue release from Hugging Face to a verified pack.

Why a separate page: a user who starts from nothing has no GGUF to inspect, and a
split set of ~50 GB shards should never sit on disk next to its pack. The page runs
`packer.shard_pack.ShardPacker` (pack each shard as soon as it is downloaded, then,
with the user's consent, default on, delete it) on a worker thread, shows bytes, speed,
ETA and the shard in progress, cancels cleanly (the partial download and the journaled
shards stay; starting again resumes) and then verifies the whole pack. Errors come with
their cause and the fix (the packer's messages say both).

`ReleaseChooser` sits on the model page: ticking it replaces the local GGUF by a
catalogue release and sends the wizard to `DownloadPage` instead of the folder checks.
On success the page hands a `GGUFInfo` (from the pack's manifest) and a `BuildOutcome`
to the wizard, so the finish page and the registry entry are the same as after a build.
"""

from __future__ import annotations

import html
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
    QWizardPage,
)

from app.gui.wizard_logic import BuildOutcome, Cancelled, GGUFInfo, Progress, full_verification
from app.gui.wizard_workers import BackgroundTask
from packer.diskio import format_bytes
from packer.fit import Release

if TYPE_CHECKING:
    from app.gui.wizard import SetupWizard

BAR_STEPS = 1000
QUEUED = Qt.ConnectionType.QueuedConnection
_COMMAND_WORDS = re.compile(r"run the same command again", re.IGNORECASE)


def for_the_wizard(message: str) -> str:
    """The packer's fixes speak of the CLI; in the wizard the same step is the Try again button."""
    return _COMMAND_WORDS.sub("press Try again", message)


def shard_of(phase: str, names: list[str]) -> str:
    """'Shard 2 of 3: NAME' for a download phase naming a shard ('' for other phases)."""
    for i, name in enumerate(names):
        if name in phase:
            return f"Shard {i + 1} of {len(names)}: {name}"
    return ""


def download_and_pack(release: Release, folder: Path, *, keep_shards: bool,
                      progress: Callable[[Progress], None], cancel: threading.Event,
                      on_shards: Callable[[list[str]], None] = lambda names: None,
                      **packer_options: Any) -> tuple[GGUFInfo, BuildOutcome]:
    """Resolve `release` on the hub (HF_ENDPOINT, HF_TOKEN), pack it into `folder` while it
    downloads, then verify the pack in full. Raises Cancelled (everything kept, a rerun
    resumes), DownloadError / PackBuildError (cause and fix) or OSError."""
    from expertpack import load_manifest
    from packer.builder import BuildCancelled
    from packer.diskio import allocated_bytes
    from packer.download import DownloadCancelled, resolve
    from packer.shard_pack import ShardPacker

    t0 = time.monotonic()
    plan = resolve(release.repo, [release.include])
    packer = ShardPacker(plan, Path(folder).expanduser(), keep_shards=keep_shards, cancel=cancel,
                         progress=lambda d, t, r, e, phase: progress(Progress("download", d, t, r, e, phase)),
                         **packer_options)
    on_shards(list(packer.names))
    outcome = BuildOutcome(pack_dir=packer.final, reused=packer.final.is_dir())
    if not outcome.reused:
        try:
            outcome.pack_dir = packer.run()
        except (DownloadCancelled, BuildCancelled):
            raise Cancelled("the download was cancelled; what was downloaded and packed is kept") from None
    full_verification(outcome, cancel, progress)
    outcome.seconds = time.monotonic() - t0
    outcome.pack_bytes = allocated_bytes(outcome.pack_dir)
    manifest = load_manifest(outcome.pack_dir)
    files = tuple(packer.job.destination(f) for f in packer.shards)
    info = GGUFInfo(path=files[0], files=files, file_sizes=tuple(f.size for f in packer.shards), name=release.name,
                    architecture=manifest.architecture, parameters=0, tensor_count=manifest.source_tensor_count,
                    quant_counts=tuple((q, 0) for q in release.quant_types.values()), quant_bytes=(),
                    supported=True, pack_bytes=outcome.pack_bytes, moe_layers=len(manifest.layers),
                    num_experts=manifest.num_experts, top_k=manifest.expert_used_count)
    return info, outcome


class ReleaseChooser(QFrame):
    """On the model page: "download a release instead" and which one (the catalogue's)."""

    changed = Signal()

    def __init__(self, parent: QWidget, releases: list[Release] | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("releaseChooser")
        self.use_check = QCheckBox("Or download a model from Hugging Face (no GGUF needed):", self)
        self.use_check.setAccessibleName("Download a release")
        self.combo = QComboBox(self)
        self.combo.setAccessibleName("Release to download")
        self.combo.setEnabled(False)
        self.note = QLabel(self)
        self.note.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.use_check)
        layout.addWidget(self.combo)
        layout.addWidget(self.note)
        self.releases: list[Release] = []
        self.set_releases(releases if releases is not None else _bundled_releases())
        self.use_check.toggled.connect(self._on_toggled)
        self.combo.currentIndexChanged.connect(lambda _i: self._describe())

    def set_releases(self, releases: list[Release]) -> None:
        self.releases = list(releases)
        self.combo.clear()
        for r in self.releases:
            self.combo.addItem(f"{r.name} — {r.repo}, {r.shards} shards, {format_bytes(r.source_bytes)}")
        self.use_check.setEnabled(bool(self.releases))
        self._describe()

    def _on_toggled(self, on: bool) -> None:
        self.combo.setEnabled(on)
        self._describe()
        self.changed.emit()

    def _describe(self) -> None:
        r = self.release()
        self.note.setText(f"Files {r.include} of {r.repo}; each shard is packed as soon as it is downloaded."
                          if r is not None else "")
        self.note.setVisible(r is not None)

    def chosen(self) -> bool:
        return self.use_check.isChecked() and self.release() is not None

    def release(self) -> Release | None:
        i = self.combo.currentIndex()
        return self.releases[i] if 0 <= i < len(self.releases) and self.use_check.isChecked() else None


def _bundled_releases() -> list[Release]:
    from app.gui.wizard_fit import catalog_path
    from packer.fit import load_catalog

    try:
        return load_catalog(catalog_path())
    except (OSError, ValueError):
        return []


class DownloadPage(QWizardPage):
    """Download the chosen release and pack it shard by shard, then verify; see the module doc."""

    progressed = Signal(object)  # Progress, as shown
    downloadFinished = Signal(object)  # (GGUFInfo, BuildOutcome), Cancelled or the exception

    def __init__(self, wizard: SetupWizard, layout_fn: Callable[[QWizardPage], QVBoxLayout],
                 colored: Callable[[QWidget, str, str], str], finish_id: int) -> None:
        super().__init__()
        self._wizard = wizard
        self._colored = colored
        self._finish_id = finish_id
        self.setTitle("Download and pack")
        self.setSubTitle("Each shard is packed as soon as it is downloaded. Cancel at any moment: what is "
                         "downloaded and packed is kept, and starting again resumes.")
        self.header = QLabel(self)
        self.header.setWordWrap(True)
        self.folder_edit = QLineEdit(self)
        self.folder_edit.setAccessibleName("Pack folder")
        self.browse_button = QPushButton("Browse…", self)
        self.browse_button.clicked.connect(self.browse)
        row = QHBoxLayout()
        row.addWidget(QLabel("Pack folder:", self))
        row.addWidget(self.folder_edit, 1)
        row.addWidget(self.browse_button)
        self.delete_check = QCheckBox("Delete each shard once it is packed (the disk then holds the pack "
                                      "plus about one shard)", self)
        self.delete_check.setChecked(True)
        self.delete_check.setAccessibleName("Delete each shard once packed")
        self.start_button = QPushButton("Download and pack", self)
        self.start_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel download", self)
        self.cancel_button.clicked.connect(self.cancel_build)
        self.cancel_button.setVisible(False)
        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.cancel_button)
        buttons.addStretch(1)
        self.phase_label = QLabel(self)
        self.phase_label.setWordWrap(True)
        self.phase_label.setAccessibleName("Phase")
        self.bar = QProgressBar(self)
        self.bar.setRange(0, BAR_STEPS)
        self.bar.setAccessibleName("Download progress")
        self.detail_label = QLabel(self)
        self.detail_label.setWordWrap(True)
        self.detail_label.setAccessibleName("Bytes, speed and time left")
        self.result_label = QLabel(self)
        self.result_label.setWordWrap(True)
        self.result_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.result_label.setAccessibleName("Result")

        layout = layout_fn(self)
        layout.addWidget(self.header)
        layout.addLayout(row)
        layout.addWidget(self.delete_check)
        layout.addLayout(buttons)
        layout.addWidget(self.phase_label)
        layout.addWidget(self.bar)
        layout.addWidget(self.detail_label)
        layout.addWidget(self.result_label)
        layout.addStretch(1)

        self.task: BackgroundTask | None = None
        self.cancel_event: threading.Event | None = None
        self.release: Release | None = None
        self.result: tuple[GGUFInfo, BuildOutcome] | None = None
        self.shard_names: list[str] = []
        self.packer_options: dict[str, Any] = {}
        self.progress_count = 0

    @property
    def running(self) -> bool:
        return self.task is not None and self.task.running

    def initializePage(self) -> None:  # noqa: N802 - Qt naming
        release = self._wizard.source_page.releases.release()
        if release is not self.release:
            self.release, self.result = release, None
            self.result_label.setText("")
        if release is not None:
            self.header.setText(f"<b>{html.escape(release.name)}</b> from {html.escape(release.repo)} "
                                f"({html.escape(release.include)}, about {format_bytes(release.source_bytes)})")
        if not self.folder_edit.text().strip():
            self.folder_edit.setText(str(self._wizard.default_folder or Path.home() / "ExpertDesk packs"))

    def browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose the folder for the Expert Pack",
                                                  self.folder_edit.text().strip() or str(Path.home()))
        if folder:
            self.folder_edit.setText(folder)

    def start(self) -> None:
        """Download, pack and verify on a worker thread (resuming whatever an earlier attempt kept)."""
        release, text = self.release, self.folder_edit.text().strip()
        if release is None or not text or self.running:
            return
        folder = Path(text).expanduser()
        keep = not self.delete_check.isChecked()
        self.result = None
        self.progress_count = 0
        self.cancel_event = event = threading.Event()
        for w in (self.start_button, self.folder_edit, self.browse_button, self.delete_check):
            w.setEnabled(False)
        self.cancel_button.setVisible(True)
        self.cancel_button.setEnabled(True)
        self.phase_label.setText("Asking the hub for the file list…")
        self.detail_label.setText("")
        self.result_label.setText("")
        self.bar.setValue(0)
        options = dict(self.packer_options)
        task = BackgroundTask(lambda report: download_and_pack(
            release, folder, keep_shards=keep, progress=report, cancel=event, on_shards=self._set_names, **options),
            name="wizard-download")
        task.progress.connect(self._on_progress, QUEUED)
        task.succeeded.connect(self._on_done, QUEUED)
        task.failed.connect(self._on_failed, QUEUED)
        self.task = task.start()
        self.completeChanged.emit()

    def _set_names(self, names: list[str]) -> None:
        self.shard_names = names  # worker thread: a plain attribute, read by the GUI thread's progress slot

    def cancel_build(self) -> None:
        """Stop at the next chunk or packing step (the same name as the build page's: the wizard closes either)."""
        if self.running and self.cancel_event is not None:
            self.cancel_event.set()
            self.cancel_button.setEnabled(False)
            self.phase_label.setText("Stopping… (what is downloaded and packed is kept)")

    def _reset_buttons(self, start_text: str) -> None:
        self.cancel_button.setVisible(False)
        self.start_button.setText(start_text)
        for w in (self.start_button, self.folder_edit, self.browse_button, self.delete_check):
            w.setEnabled(True)

    @Slot(object)
    def _on_progress(self, p: Progress) -> None:
        if self.sender() is not self.task or (self.cancel_event is not None and self.cancel_event.is_set()):
            return
        self.progress_count += 1
        self.bar.setValue(int(round(p.fraction * BAR_STEPS)))
        if p.stage == "verify":
            self.phase_label.setText("Verifying the whole pack: reading every byte back and checking its SHA-256")
        else:
            self.phase_label.setText(html.escape(shard_of(p.phase, self.shard_names) or p.phase))
        self.detail_label.setText(p.text())
        self.progressed.emit(p)

    @Slot(object)
    def _on_done(self, result: tuple[GGUFInfo, BuildOutcome]) -> None:
        if self.sender() is not self.task:
            return
        info, outcome = result
        self._reset_buttons("Download and pack again")
        self.bar.setValue(BAR_STEPS)
        if outcome.verify_ok:
            self.result = result
            self._wizard.info = info  # the finish page and the registry entry read these two
            self._wizard.build_page.outcome = outcome
            self.start_button.setVisible(False)
            self.phase_label.setText(self._colored(self, "pass", "✔ Downloaded, packed and verified."))
            self.detail_label.setText(f"{format_bytes(outcome.pack_bytes)} on disk · {outcome.seconds:.1f} s")
            self.result_label.setText(html.escape(outcome.verify_summary[:1].upper() + outcome.verify_summary[1:]))
        else:
            self.phase_label.setText(self._colored(self, "fail", "✖ The new pack failed verification."))
            self.result_label.setText(html.escape(outcome.verify_summary) +
                                      "<br><i>What to do:</i> check the drive, delete the pack and start again.")
        self.completeChanged.emit()
        self.downloadFinished.emit(result)

    @Slot(object)
    def _on_failed(self, exc: BaseException) -> None:
        if self.sender() is not self.task:
            return
        if isinstance(exc, Cancelled):
            self._reset_buttons("Resume download")
            self.phase_label.setText(self._colored(self, "warn", "Download cancelled."))
            self.result_label.setText("What is downloaded and packed is kept. <b>Resume download</b> continues "
                                      "from there (now or later, with the same release and folder).")
        else:
            self._reset_buttons("Try again")
            message = for_the_wizard(str(exc) or type(exc).__name__).rstrip(".") + "."
            self.phase_label.setText(self._colored(self, "fail", "✖ The download stopped."))
            self.result_label.setText(html.escape(message[:1].upper() + message[1:]) +
                                      "<br>What is downloaded and packed so far is kept; <b>Try again</b> resumes.")
        self.completeChanged.emit()
        self.downloadFinished.emit(exc)

    def isComplete(self) -> bool:  # noqa: N802 - Qt naming
        return self.result is not None and not self.running

    def nextId(self) -> int:  # noqa: N802 - Qt naming
        return self._finish_id
