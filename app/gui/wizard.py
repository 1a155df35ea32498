"""The setup wizard: GGUF -> checked folder -> built and verified Expert Pack -> a model in the picker.

Four pages, every slow step on a worker thread (``wizard_workers.BackgroundTask``):

1. **Model**: a GGUF file or the first shard of a split set. All shards are found and
   validated (``GGUFSource.open``); the page shows architecture, parameters, size,
   quant types, shards, and whether the packer supports it (and why not). Before any
   GGUF, a panel estimates which catalogue release fits this PC (``wizard_fit``).
2. **Pack folder**: the preflight checks for that folder (O_DIRECT with a real aligned
   read, free space, GPU and driver, VRAM, RAM), each pass / warning / problem with the
   reason and what to do. Only a problem blocks the next step. Proposes cache sizes
   (editable) and shows the memory plan (``memory_plan_view``: a stacked bar per
   memory, one segment per consumer; when nothing fits, a failed check with the numbers).
3. **Build**: progress with bytes, speed and ETA; Cancel at any moment keeps what was
   written (the packer journals finished layers) and Resume continues from there;
   then a full verification of the pack.
4. **Finish**: optionally delete the source GGUF files (only after the full
   verification passed), name the model. Finish emits ``modelReady(ModelRecord)``.

Or the "download" start (``wizard_download``): on page 1 a catalogue release instead of a
GGUF; the download page then packs it shard by shard while it downloads, verifies it in
full and goes on to page 4.

Closing the wizard during a build or download asks first, then cancels cleanly and closes once
the worker has stopped.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.gui.memory_plan_view import MemoryPlanView
from app.gui.qt_compat import protect_none_refcount
from app.gui.theme import ERROR_COLOR, MUTED_COLOR, OK_COLOR, SPACE, WARNING_COLOR
from app.gui.wizard_download import DownloadPage, ReleaseChooser
from app.gui.wizard_fit import FitPanel, ReadProbeFn
from app.gui.wizard_logic import (
    CHECK_TITLES,
    BuildOutcome,
    Cancelled,
    GGUFInfo,
    Progress,
    TargetReport,
    build_and_verify,
    check_target,
    delete_source_files,
    describe_phase,
    examine_target,
    format_count,
    inspect_gguf,
    source_disk_bytes,
)
from app.gui.wizard_workers import BackgroundTask
from app.models_registry import ModelRecord
from packer.diskio import format_bytes

if TYPE_CHECKING:
    from engine.options import RuntimeOptions

PAGE_SOURCE, PAGE_TARGET, PAGE_BUILD, PAGE_FINISH = range(4)
PAGE_DOWNLOAD = 4  # the "download a catalogue release" start (wizard_download), instead of TARGET and BUILD
BAR_STEPS = 1000
QUEUED = Qt.ConnectionType.QueuedConnection
STATUS_WORDS = {"pass": "✔ OK", "warn": "⚠ Warning", "fail": "✖ Problem"}


def _dark(widget: QWidget) -> bool:
    return widget.palette().color(QPalette.ColorRole.Window).lightness() < 128


def _status_color(widget: QWidget, status: str) -> str:
    dark = _dark(widget)
    return {"pass": OK_COLOR, "warn": WARNING_COLOR, "fail": ERROR_COLOR}.get(status, MUTED_COLOR)[dark]


def _colored(widget: QWidget, status: str, text: str) -> str:
    return f'<span style="color:{_status_color(widget, status)}"><b>{html.escape(text)}</b></span>'


def _sentence(text: str) -> str:
    """'free 1 GB on /' -> 'Free 1 GB on /.' (the packer writes clauses, the wizard shows sentences)."""
    text = text.strip()
    if not text:
        return text
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", "!", "?")) else ".")


def _wrap_label(parent: QWidget, text: str = "", *, selectable: bool = True) -> QLabel:
    label = QLabel(text, parent)
    label.setWordWrap(True)
    label.setTextFormat(Qt.TextFormat.RichText)
    if selectable:
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def _page_layout(page: QWizardPage) -> QVBoxLayout:
    """The layout for a page's content, inside a frameless vertical scroll area.

    Check results and build reports are several wrapped lines each: in a scroll area every
    label gets the height its text needs (nothing is squeezed and cut), and the page
    scrolls when the wizard is smaller than its content.
    """
    body = QWidget()
    layout = QVBoxLayout(body)
    layout.setContentsMargins(0, 0, SPACE["s"], 0)
    layout.setSpacing(SPACE["s"])
    scroll = QScrollArea(page)
    scroll.setObjectName("wizardPageScroll")
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QFrame.Shape.NoFrame)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    scroll.setWidget(body)
    scroll.viewport().setAutoFillBackground(False)
    body.setAutoFillBackground(False)
    outer = QVBoxLayout(page)
    outer.setContentsMargins(0, 0, 0, 0)
    outer.addWidget(scroll)
    return layout


class SourcePage(QWizardPage):
    """Page 1: which GGUF (or split set)."""

    checked = Signal(object)  # GGUFInfo or the exception, once a check finished (tests, screenshots)

    def __init__(self, wizard: SetupWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Choose the model")
        self.setSubTitle("A GGUF file, or the first shard of a split set (NAME-00001-of-0000N.gguf). "
                         "All shards must be in the same folder; they are all found and checked.")
        self.path_edit = QLineEdit(self)
        self.path_edit.setPlaceholderText("/path/to/DeepSeek-V4-Flash-MXFP4.gguf")
        self.path_edit.setAccessibleName("GGUF file")
        self.path_edit.setClearButtonEnabled(True)
        self.browse_button = QPushButton("Browse…", self)
        self.browse_button.clicked.connect(self.browse)
        row = QHBoxLayout()
        row.addWidget(self.path_edit, 1)
        row.addWidget(self.browse_button)
        self.status = _wrap_label(self)
        self.status.setAccessibleName("Model check")

        self.fields: dict[str, QLabel] = {}
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        for key, title in (("name", "Model"), ("architecture", "Architecture"), ("parameters", "Parameters"),
                           ("files", "Files"), ("quants", "Quant types"), ("pack", "Expert Pack"),
                           ("supported", "Supported")):
            label = _wrap_label(self)
            label.setAccessibleName(title)
            self.fields[key] = label
            form.addRow(f"{title}:", label)
        self.details = QFrame(self)
        self.details.setLayout(form)
        self.details.setVisible(False)

        # Before any GGUF: which catalogue release fits this PC (drive probe on a worker, on request).
        self.fit_panel = FitPanel(self, lambda: wizard.target_folder() or wizard.default_folder or Path.home(),
                                  read_probe_fn=wizard.fit_probe, probes=wizard.probes, colored=_colored)

        layout = _page_layout(self)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.details)
        layout.addWidget(self.fit_panel)
        # Or no GGUF at all: a catalogue release, downloaded and packed shard by shard (wizard_download).
        self.releases = ReleaseChooser(self)
        self.releases.changed.connect(self.completeChanged)
        layout.addWidget(self.releases)
        layout.addStretch(1)

        self.info: GGUFInfo | None = None
        self.task: BackgroundTask | None = None
        self._checking: str | None = None
        self.path_edit.editingFinished.connect(self.check_path)
        self.path_edit.textChanged.connect(self._on_text_changed)

    # Input -----------------------------------------------------------------------------
    def browse(self) -> None:
        start = self.path_edit.text().strip() or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model (or its first shard)", start,
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.set_path(path)

    def set_path(self, path: str | Path) -> None:
        """Put ``path`` in the field and check it (on a worker thread)."""
        self.path_edit.setText(str(path))
        self.check_path()

    def _current(self) -> str:
        return str(Path(self.path_edit.text().strip()).expanduser()) if self.path_edit.text().strip() else ""

    def _on_text_changed(self, _text: str) -> None:
        if self.info is not None and str(self.info.path) != self._current():
            self.info = None
            self._wizard.info = None
            self.details.setVisible(False)
            self.status.setText("")
            self.completeChanged.emit()

    def check_path(self) -> None:
        path = self._current()
        if not path or path == self._checking or (self.info is not None and str(self.info.path) == path):
            return
        self._checking = path
        self.info = None
        self._wizard.info = None
        self.details.setVisible(False)
        self.status.setText("Reading the model's header and checking every shard…")
        task = BackgroundTask(lambda _report: inspect_gguf(path), name="wizard-inspect")
        task.succeeded.connect(self._on_info, QUEUED)
        task.failed.connect(self._on_error, QUEUED)
        self.task = task.start()
        self.completeChanged.emit()

    # Results -----------------------------------------------------------------------------
    @Slot(object)
    def _on_info(self, info: GGUFInfo) -> None:
        if self.sender() is not self.task or str(info.path) != self._current():
            return  # an older check, or the user typed another path meanwhile
        self._checking = None
        self.info = info
        self._wizard.info = info
        f = self.fields
        f["name"].setText(html.escape(info.name))
        f["architecture"].setText(html.escape(info.architecture))
        f["parameters"].setText(f"{format_count(info.parameters)} "
                                f"({info.parameters:,} in {info.tensor_count:,} tensors)")
        shards = "1 file" if info.shards == 1 else f"{info.shards} shards, all present and consistent"
        names = "<br>".join(html.escape(p.name) for p in info.files[:8]) + ("<br>…" if info.shards > 8 else "")
        f["files"].setText(f"{format_bytes(info.total_bytes)} · {shards}<br><small>{names}</small>")
        f["quants"].setText(html.escape(", ".join(
            f"{name} ×{n} ({format_bytes(b)})" for (name, n), (_, b) in zip(info.quant_counts, info.quant_bytes))))
        if info.supported:
            f["pack"].setText(f"about {format_bytes(info.pack_bytes)} · {info.moe_layers} MoE layers × "
                              f"{info.num_experts} experts, top-{info.top_k}")
            f["supported"].setText(_colored(self, "pass", "Yes") + " — ExpertDesk can pack and run this model")
            self.status.setText(_colored(self, "pass", "✔ Model checked.") + " Next: choose where the pack goes.")
        else:
            f["pack"].setText("—")
            f["supported"].setText(_colored(self, "fail", "No") + f" — {html.escape(info.reason)}")
            self.status.setText(_colored(self, "fail", "✖ ExpertDesk cannot pack this model.") +
                                f" {html.escape(info.reason)}")
        self.details.setVisible(True)
        self.completeChanged.emit()
        self.checked.emit(info)

    @Slot(object)
    def _on_error(self, exc: BaseException) -> None:
        if self.sender() is not self.task:
            return
        self._checking = None
        message = str(exc) or type(exc).__name__
        if isinstance(exc, FileNotFoundError):
            message = f"{self._current()}: no such file. Choose the .gguf file (or the first shard of a split set)."
        elif isinstance(exc, IsADirectoryError):
            message = f"{self._current()} is a folder: choose the .gguf file inside it."
        self.status.setText(_colored(self, "fail", "✖ This file cannot be used.") + f" {html.escape(message)}")
        self.completeChanged.emit()
        self.checked.emit(exc)

    def isComplete(self) -> bool:  # noqa: N802 - Qt naming
        if self.releases.chosen():
            return True
        return self.info is not None and self.info.supported and str(self.info.path) == self._current()

    def nextId(self) -> int:  # noqa: N802 - Qt naming
        return PAGE_DOWNLOAD if self.releases.chosen() else PAGE_TARGET


class TargetPage(QWizardPage):
    """Page 2: where the pack goes, and can this machine build and run it there."""

    checked = Signal(object)  # TargetReport or the exception

    def __init__(self, wizard: SetupWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Choose where the pack goes")
        self.setSubTitle("Pick a folder on a fast local NVMe SSD. The experts are read from there for every "
                         "token, so the drive matters more than anything but the GPU.")
        self.setCommitPage(True)
        self.setButtonText(QWizard.WizardButton.CommitButton, "Build the pack")
        self.folder_edit = QLineEdit(self)
        self.folder_edit.setAccessibleName("Pack folder")
        self.browse_button = QPushButton("Browse…", self)
        self.browse_button.clicked.connect(self.browse)
        self.recheck_button = QPushButton("Check again", self)
        self.recheck_button.clicked.connect(self.run_checks)
        row = QHBoxLayout()
        row.addWidget(self.folder_edit, 1)
        row.addWidget(self.browse_button)
        row.addWidget(self.recheck_button)
        self.location = _wrap_label(self)
        self.summary = _wrap_label(self)
        self.summary.setAccessibleName("Checks summary")
        self.checks_frame = QFrame(self)
        self.checks_frame.setFrameShape(QFrame.Shape.StyledPanel)
        self.checks_layout = QVBoxLayout(self.checks_frame)
        self.check_rows: dict[str, QLabel] = {}
        self.memory_plan = MemoryPlanView(self)  # the plan's bars (engine.memory_plan), from the checks' worker

        self.cache_vram = QSpinBox(self)
        self.cache_vram.setRange(0, 1024 * 1024)
        self.cache_vram.setSingleStep(512)
        self.cache_vram.setSuffix(" MiB")
        self.cache_vram.setSpecialValueText("automatic")
        self.cache_vram.setAccessibleName("GPU expert cache size")
        self.cache_host = QSpinBox(self)
        self.cache_host.setRange(0, 4 * 1024 * 1024)
        self.cache_host.setSingleStep(1024)
        self.cache_host.setSuffix(" MiB")
        self.cache_host.setSpecialValueText("off")
        self.cache_host.setAccessibleName("Host RAM expert tier size")
        cache_form = QFormLayout()
        cache_form.addRow("GPU expert cache:", self.cache_vram)
        cache_form.addRow("Host RAM tier:", self.cache_host)
        self.cache_note = _wrap_label(self)

        layout = _page_layout(self)
        layout.addLayout(row)
        layout.addWidget(self.location)
        layout.addWidget(self.checks_frame)
        layout.addWidget(self.memory_plan)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel("<b>Cache sizes</b> (proposed from what was measured; you can change them)", self))
        layout.addLayout(cache_form)
        layout.addWidget(self.cache_note)
        layout.addStretch(1)

        self.report: TargetReport | None = None
        self.task: BackgroundTask | None = None
        self._report_info: GGUFInfo | None = None  # the model the report is about
        self._pending_info: GGUFInfo | None = None
        self.folder_edit.editingFinished.connect(self._on_folder_edited)
        self.folder_edit.textChanged.connect(lambda _t: self.completeChanged.emit())

    def initializePage(self) -> None:  # noqa: N802 - Qt naming
        info = self._wizard.info
        if info is None:
            return
        if not self.folder_edit.text().strip():
            self.folder_edit.setText(str(self._wizard.default_folder or info.files[0].parent))
        if not self._current_report():
            self.run_checks()

    def browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose the folder for the Expert Pack",
                                                  self.folder_edit.text().strip() or str(Path.home()))
        if folder:
            self.set_folder(folder)

    def set_folder(self, folder: str | Path) -> None:
        self.folder_edit.setText(str(folder))
        self.run_checks()

    def _folder(self) -> Path | None:
        text = self.folder_edit.text().strip()
        return Path(text).expanduser() if text else None

    def _current_report(self) -> bool:
        return (self.report is not None and self.report.folder == self._folder()
                and self._report_info is self._wizard.info)

    def _on_folder_edited(self) -> None:
        if not self._current_report():
            self.run_checks()

    def run_checks(self) -> None:
        """Run the preflight for the folder in the field (worker thread)."""
        info, folder = self._wizard.info, self._folder()
        if info is None or folder is None:
            return
        self.report = None
        self._pending_info = info
        self._clear_rows()
        self.memory_plan.set_plan(None)
        self.summary.setText("Checking the folder, the drive, the GPU and the memory…")
        self.location.setText("")
        probes = dict(self._wizard.probes)
        options = self._wizard.options
        task = BackgroundTask(lambda _report: check_target(info, folder, options, **probes), name="wizard-preflight")
        task.succeeded.connect(self._on_report, QUEUED)
        task.failed.connect(self._on_error, QUEUED)
        self.task = task.start()
        self.completeChanged.emit()

    def _clear_rows(self) -> None:
        for label in self.check_rows.values():
            self.checks_layout.removeWidget(label)
            label.deleteLater()
        self.check_rows = {}

    @Slot(object)
    def _on_report(self, report: TargetReport) -> None:
        if self.sender() is not self.task:
            return
        self.report = report
        self._report_info = self._pending_info
        self._clear_rows()
        for check in report.checks:
            title = CHECK_TITLES.get(check.name, check.name)
            text = f"{_colored(self, check.status, STATUS_WORDS[check.status])} &nbsp;<b>{html.escape(title)}</b><br>" \
                   f"{html.escape(_sentence(check.reason))}"
            if check.fix and check.status != "pass":
                text += f"<br><i>What to do:</i> {html.escape(_sentence(check.fix))}"
            label = _wrap_label(self.checks_frame, text)
            label.setAccessibleName(f"{title}: {check.status}")
            label.setProperty("status", check.status)
            self.checks_layout.addWidget(label)
            label.show()
            self.check_rows[check.name] = label
        self.memory_plan.set_plan(report.memory_plan)
        state = report.state
        info = self._wizard.info
        if state.existing == "same":
            self.location.setText("A finished pack of this model is already at "
                                  f"<b>{html.escape(str(state.final))}</b>: it will be verified and used.")
            self.setButtonText(QWizard.WizardButton.CommitButton, "Verify and use it")
        else:
            size = f" (about {format_bytes(info.pack_bytes)})" if info is not None else ""
            self.location.setText(f"The pack will be written to <b>{html.escape(str(state.final))}</b>{size}.")
            self.setButtonText(QWizard.WizardButton.CommitButton,
                               "Resume the build" if state.journaled_layers else "Build the pack")
        blockers = report.blockers
        warnings = [c for c in report.checks if c.status == "warn"]
        if blockers:
            names = ", ".join(CHECK_TITLES.get(c.name, c.name) for c in blockers)
            self.summary.setText(_colored(self, "fail", f"✖ {len(blockers)} problem(s) must be fixed first: {names}.") +
                                 " " + html.escape(_sentence(blockers[0].reason)) +
                                 (f" {html.escape(_sentence(blockers[0].fix))}" if blockers[0].fix else ""))
        elif warnings:
            self.summary.setText(_colored(self, "warn", f"⚠ Ready, with {len(warnings)} warning(s).") +
                                 " You can build now; the warnings affect speed, not correctness.")
        else:
            self.summary.setText(_colored(self, "pass", "✔ Everything checks out."))
        if info is not None:
            vram, host = report.recommended_cache(info)
            self.cache_vram.setValue(vram)
            self.cache_host.setValue(host)
            reserve = report.preflight.recommended.get("cache_vram_reserve_mib", 0)
            gpu = report.preflight.measurements.get("gpu")
            self.cache_note.setText(
                (f"GPU cache: what is left of the free VRAM after the dense weights and a {reserve:,} MiB reserve, "
                 "in whole experts. " if gpu else "No GPU: the expert cache lives in RAM (automatic size). ") +
                "Host RAM tier: hot experts kept in RAM without risking swap. They are saved with this model; "
                "sizes set in Preferences take precedence.")
        self.completeChanged.emit()
        self.checked.emit(report)

    @Slot(object)
    def _on_error(self, exc: BaseException) -> None:
        if self.sender() is not self.task:
            return
        self.summary.setText(_colored(self, "fail", "✖ The checks could not run:") + f" {html.escape(str(exc))}")
        self.completeChanged.emit()
        self.checked.emit(exc)

    def isComplete(self) -> bool:  # noqa: N802 - Qt naming
        return self._current_report() and self.report.ok and not (self.task is not None and self.task.running)


class BuildPage(QWizardPage):
    """Page 3: build (or resume) the pack, then verify it in full."""

    progressed = Signal(object)  # Progress, as shown
    buildFinished = Signal(object)  # BuildOutcome, Cancelled or the exception

    def __init__(self, wizard: SetupWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Build the Expert Pack")
        self.setSubTitle("The experts are copied into one aligned, hashed file. Cancel at any moment: "
                         "finished layers are kept and the next build resumes.")
        self.setCommitPage(True)
        self.setButtonText(QWizard.WizardButton.CommitButton, "Next")
        self.header = _wrap_label(self)
        self.resume_label = _wrap_label(self)
        self.resume_label.setAccessibleName("Resume")
        self.phase_label = _wrap_label(self)
        self.phase_label.setAccessibleName("Phase")
        self.bar = QProgressBar(self)
        self.bar.setRange(0, BAR_STEPS)
        self.bar.setFormat("%p%")
        self.bar.setAccessibleName("Build progress")
        self.detail_label = QLabel(self)
        self.detail_label.setAccessibleName("Bytes, speed and time left")
        self.cancel_button = QPushButton("Cancel build", self)
        self.cancel_button.clicked.connect(self.cancel_build)
        self.resume_button = QPushButton("Resume build", self)
        self.resume_button.clicked.connect(self.start_build)
        self.resume_button.setVisible(False)
        buttons = QHBoxLayout()
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.resume_button)
        buttons.addStretch(1)
        self.result_label = _wrap_label(self)
        self.result_label.setAccessibleName("Result")

        layout = _page_layout(self)
        layout.addWidget(self.header)
        layout.addWidget(self.resume_label)
        layout.addSpacing(8)
        layout.addWidget(self.phase_label)
        layout.addWidget(self.bar)
        layout.addWidget(self.detail_label)
        layout.addLayout(buttons)
        layout.addWidget(self.result_label)
        layout.addStretch(1)

        self.task: BackgroundTask | None = None
        self.outcome: BuildOutcome | None = None
        self.cancel_event = None
        self.progress_count = 0
        self._stage = ""

    @property
    def running(self) -> bool:
        return self.task is not None and self.task.running

    def initializePage(self) -> None:  # noqa: N802 - Qt naming
        if self.outcome is None and not self.running:
            self.start_build()

    def start_build(self) -> None:
        """Build (resuming what an earlier attempt wrote) and verify, on a worker thread."""
        import threading

        wizard = self._wizard
        info, folder = wizard.info, wizard.target_folder()
        if info is None or folder is None or self.running:
            return
        state = examine_target(info, folder)
        self.header.setText(f"<b>{html.escape(info.name)}</b> → {html.escape(str(state.final))}")
        if state.existing == "same":
            self.resume_label.setText("A finished pack of this model is already there: it is verified, not rebuilt.")
        elif state.journaled_layers:
            self.resume_label.setText(f"Resuming: {state.journaled_layers} of {info.moe_layers} layers already done "
                                      "(they are re-checked and kept; if the source changed, the build starts over).")
        else:
            self.resume_label.setText("")
        self.outcome = None
        self.progress_count = 0
        self._stage = ""
        self.bar.setValue(0)
        self.phase_label.setText("Starting…")
        self.detail_label.setText("")
        self.result_label.setText("")
        self.cancel_button.setVisible(True)
        self.cancel_button.setEnabled(True)
        self.resume_button.setVisible(False)
        self.cancel_event = event = threading.Event()
        options = dict(wizard.builder_options)
        task = BackgroundTask(
            lambda report: build_and_verify(info, folder, progress=report, cancel=event, builder_options=options),
            name="wizard-build")
        task.progress.connect(self._on_progress, QUEUED)
        task.succeeded.connect(self._on_done, QUEUED)
        task.failed.connect(self._on_failed, QUEUED)
        self.task = task.start()
        self.completeChanged.emit()

    def cancel_build(self) -> None:
        """Stop at the next safe point (the worker finishes the group it is on)."""
        if self.running and self.cancel_event is not None:
            self.cancel_event.set()
            self.cancel_button.setEnabled(False)
            self.phase_label.setText("Stopping… (finishing the piece in progress; everything written is kept)")

    @Slot(object)
    def _on_progress(self, p: Progress) -> None:
        if self.sender() is not self.task:
            return
        if self.cancel_event is not None and self.cancel_event.is_set():
            return
        self.progress_count += 1
        if p.stage != self._stage:
            self._stage = p.stage
            self.bar.setFormat("Verifying: %p%" if p.stage == "verify" else "%p%")
        self.bar.setValue(int(round(p.fraction * BAR_STEPS)))
        self.phase_label.setText(html.escape(describe_phase(p.stage, p.phase)))
        self.detail_label.setText(p.text())
        self.progressed.emit(p)

    @Slot(object)
    def _on_done(self, outcome: BuildOutcome) -> None:
        if self.sender() is not self.task:
            return
        self.outcome = outcome
        self.cancel_button.setVisible(False)
        self.bar.setValue(BAR_STEPS)
        notes = outcome.resume_text()
        if notes:
            self.resume_label.setText(html.escape(notes))
        if outcome.verify_ok:
            self.phase_label.setText(_colored(self, "pass", "✔ The pack is built and verified."))
            self.detail_label.setText(f"{format_bytes(outcome.pack_bytes)} on disk · {outcome.seconds:.1f} s")
            summary = outcome.verify_summary
            self.result_label.setText(html.escape(summary[:1].upper() + summary[1:]) + ".")
        else:
            self.phase_label.setText(_colored(self, "fail", "✖ The new pack failed verification."))
            self.result_label.setText(html.escape(outcome.verify_summary) +
                                      "<br><i>What to do:</i> check the drive (SMART, cables), then build again.")
            self.resume_button.setText("Build again")
            self.resume_button.setVisible(True)
        self.completeChanged.emit()
        self.buildFinished.emit(outcome)

    @Slot(object)
    def _on_failed(self, exc: BaseException) -> None:
        if self.sender() is not self.task:
            return
        self.cancel_button.setVisible(False)
        wizard = self._wizard
        if isinstance(exc, Cancelled):
            done = 0
            if wizard.info is not None and wizard.target_folder() is not None:
                done = examine_target(wizard.info, wizard.target_folder()).journaled_layers
            total = wizard.info.moe_layers if wizard.info else 0
            self.phase_label.setText(_colored(self, "warn", "Build cancelled."))
            self.detail_label.setText("")
            self.result_label.setText(
                f"{done} of {total} layers are written and kept. <b>Resume build</b> continues from there "
                "(now or later: running the wizard again with the same model and folder resumes too).")
            self.resume_button.setText("Resume build")
        else:
            self.phase_label.setText(_colored(self, "fail", "✖ The build failed."))
            self.result_label.setText(html.escape(_sentence(str(exc) or type(exc).__name__)) +
                                      "<br>Everything finished so far is kept. <b>Try again</b> resumes; "
                                      "to use another folder, close the wizard and start it again.")
            self.resume_button.setText("Try again")
        self.resume_button.setVisible(True)
        self.completeChanged.emit()
        self.buildFinished.emit(exc)

    def isComplete(self) -> bool:  # noqa: N802 - Qt naming
        return self.outcome is not None and self.outcome.verify_ok and not self.running


class FinishPage(QWizardPage):
    """Page 4: delete the source (optional), name the model, finish."""

    deleted = Signal(int)  # bytes freed

    def __init__(self, wizard: SetupWizard) -> None:
        super().__init__()
        self._wizard = wizard
        self.setTitle("Ready to chat")
        self.setSubTitle("The pack is self-contained: the app never needs the GGUF again.")
        self.summary = _wrap_label(self)
        self.name_edit = QLineEdit(self)
        self.name_edit.setAccessibleName("Model name")
        self.name_edit.textChanged.connect(lambda _t: self.completeChanged.emit())
        form = QFormLayout()
        form.addRow("Name in the model list:", self.name_edit)

        self.delete_box = QFrame(self)
        self.delete_box.setFrameShape(QFrame.Shape.StyledPanel)
        self.delete_check = QCheckBox(self.delete_box)
        self.delete_check.toggled.connect(self._update_delete_button)
        self.delete_button = QPushButton("Delete the source files", self.delete_box)
        self.delete_button.setEnabled(False)
        self.delete_button.clicked.connect(self.delete_source)
        self.files_label = _wrap_label(self.delete_box)
        self.delete_result = _wrap_label(self.delete_box)
        self.delete_result.setAccessibleName("Source deletion")
        box = QVBoxLayout(self.delete_box)
        box.addWidget(QLabel("<b>Free the space of the source GGUF</b>", self.delete_box))
        box.addWidget(self.files_label)
        box.addWidget(self.delete_check)
        row = QHBoxLayout()
        row.addWidget(self.delete_button)
        row.addStretch(1)
        box.addLayout(row)
        box.addWidget(self.delete_result)

        layout = _page_layout(self)
        layout.addWidget(self.summary)
        layout.addLayout(form)
        layout.addSpacing(8)
        layout.addWidget(self.delete_box)
        layout.addStretch(1)
        self.task: BackgroundTask | None = None
        self.freed_bytes = 0
        self.source_deleted = False

    def initializePage(self) -> None:  # noqa: N802 - Qt naming
        wizard = self._wizard
        info, outcome = wizard.info, wizard.build_page.outcome
        if info is None or outcome is None:
            return
        if not self.name_edit.text().strip():
            self.name_edit.setText(info.name)
        target = wizard.target_page
        vram, host = target.cache_vram.value(), target.cache_host.value()
        cache = (f"GPU cache {vram:,} MiB" if vram else "GPU cache automatic") + \
                (f", host RAM tier {host:,} MiB" if host else ", host RAM tier off")
        self.summary.setText(
            f"{_colored(self, 'pass', '✔ Verified')} ({html.escape(outcome.verify_mode)}): "
            f"<b>{html.escape(str(outcome.pack_dir))}</b><br>{format_bytes(outcome.pack_bytes)} on disk · "
            f"{html.escape(info.architecture)} · {cache}.<br>Finish adds it to the model list and loads it.")
        present = [f for f in info.files if f.exists()]
        self.source_bytes = source_disk_bytes(present)
        names = "<br>".join(html.escape(str(f)) for f in present[:6]) + ("<br>…" if len(present) > 6 else "")
        if not present:
            self.files_label.setText("The source files are no longer there.")
            self.delete_check.setVisible(False)
            self.delete_button.setVisible(False)
            return
        self.files_label.setText(names)
        count = "the source file" if len(present) == 1 else f"the {len(present)} source files"
        self.delete_check.setText(f"Delete {count}: frees {format_bytes(self.source_bytes)}")
        allowed = outcome.verify_ok and outcome.verify_mode == "full"
        self.delete_check.setEnabled(allowed and not self.source_deleted)
        if not allowed:
            self.delete_result.setText("The source can be deleted only after a full verification of the pack.")
        self._update_delete_button()

    def _update_delete_button(self) -> None:
        outcome = self._wizard.build_page.outcome
        ok = outcome is not None and outcome.verify_ok and outcome.verify_mode == "full"
        self.delete_button.setEnabled(ok and self.delete_check.isChecked() and not self.source_deleted and
                                      not (self.task is not None and self.task.running))

    def delete_source(self) -> None:
        """Delete the source GGUF files (worker thread); only after the pack passed a full verification."""
        wizard = self._wizard
        outcome, info = wizard.build_page.outcome, wizard.info
        if info is None or outcome is None or not outcome.verify_ok or not self.delete_check.isChecked():
            return
        files = [f for f in info.files if f.exists()]
        self.delete_result.setText("Deleting…")
        task = BackgroundTask(lambda _report: delete_source_files(files), name="wizard-delete")
        task.succeeded.connect(self._on_deleted, QUEUED)
        task.failed.connect(self._on_delete_failed, QUEUED)
        self.task = task.start()
        self._update_delete_button()
        self.completeChanged.emit()

    @Slot(object)
    def _on_deleted(self, freed: int) -> None:
        self.source_deleted = True
        self.freed_bytes = int(freed)
        self.delete_check.setEnabled(False)
        self.delete_result.setText(_colored(self, "pass", f"✔ Deleted: {format_bytes(freed)} freed."))
        self._update_delete_button()
        self.completeChanged.emit()
        self.deleted.emit(int(freed))

    @Slot(object)
    def _on_delete_failed(self, exc: BaseException) -> None:
        self.delete_result.setText(_colored(self, "fail", "✖ Could not delete:") + f" {html.escape(str(exc))}")
        self._update_delete_button()
        self.completeChanged.emit()

    def isComplete(self) -> bool:  # noqa: N802 - Qt naming
        return bool(self.name_edit.text().strip()) and not (self.task is not None and self.task.running)

    def nextId(self) -> int:  # noqa: N802 - Qt naming
        return -1  # the last page, although PAGE_DOWNLOAD has a higher id


class SetupWizard(QWizard):
    """GGUF -> Expert Pack -> registered model. ``modelReady(ModelRecord)`` on Finish.

    ``probes`` replace preflight's probes (free_space_fn, gpu_fn, ram_fn, odirect_fn),
    ``fit_probe`` the fit panel's drive read probe (folder -> packer.fit.ReadProbe), and
    ``builder_options`` are passed to PackBuilder (tests use small buffers and a
    ``progress_hook``); ``source`` / ``folder`` pre-fill the first two pages; ``options``
    (the app's settings) give the dtypes the memory plan counts the model's state in.
    """

    modelReady = Signal(object)

    def __init__(self, parent: QWidget | None = None, *, source: str | Path | None = None,
                 folder: str | Path | None = None, probes: dict[str, Any] | None = None,
                 builder_options: dict[str, Any] | None = None, fit_probe: ReadProbeFn | None = None,
                 options: RuntimeOptions | None = None) -> None:
        protect_none_refcount()
        super().__init__(parent)
        self.setWindowTitle("Set up a model")
        self.setObjectName("setupWizard")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.setOption(QWizard.WizardOption.NoBackButtonOnStartPage, True)
        self.setOption(QWizard.WizardOption.NoCancelButtonOnLastPage, True)
        self.setWindowModality(Qt.WindowModality.WindowModal)
        self.resize(780, 640)
        self.probes = dict(probes or {})
        self.fit_probe = fit_probe
        self.builder_options = dict(builder_options or {})
        self.options = options
        self.default_folder = Path(folder) if folder else None
        self.info: GGUFInfo | None = None
        self.record: ModelRecord | None = None
        self._stopping = False

        self.source_page = SourcePage(self)
        self.target_page = TargetPage(self)
        self.build_page = BuildPage(self)
        self.finish_page = FinishPage(self)
        self.setPage(PAGE_SOURCE, self.source_page)
        self.setPage(PAGE_TARGET, self.target_page)
        self.setPage(PAGE_BUILD, self.build_page)
        self.setPage(PAGE_FINISH, self.finish_page)
        self.download_page = DownloadPage(self, _page_layout, _colored, PAGE_FINISH)
        self.setPage(PAGE_DOWNLOAD, self.download_page)
        self.setStartId(PAGE_SOURCE)
        if folder:
            self.target_page.folder_edit.setText(str(folder))
        if source:
            self.source_page.set_path(source)

    def target_folder(self) -> Path | None:
        report = self.target_page.report
        return report.folder if report is not None else self.target_page._folder()

    @property
    def busy(self) -> bool:
        """A build or deletion is running."""
        return (self.build_page.running or self.download_page.running or
                (self.finish_page.task is not None and self.finish_page.task.running))

    def make_record(self) -> ModelRecord:
        """The registry entry for the finished pack (valid after the build page verified it)."""
        info, outcome = self.info, self.build_page.outcome
        if info is None or outcome is None or not outcome.verify_ok:
            raise RuntimeError("the pack is not built and verified yet")
        return ModelRecord(
            ref=str(outcome.pack_dir),
            name=self.finish_page.name_edit.text().strip() or info.name,
            architecture=info.architecture,
            size_bytes=outcome.pack_bytes,
            parameters=info.parameters,
            quant_types=info.quant_summary(),
            cache_vram_mib=self.target_page.cache_vram.value(),
            cache_host_mib=self.target_page.cache_host.value(),
            added_at=time.time(),
            source_files=tuple(str(f) for f in info.files),
            source_deleted=self.finish_page.source_deleted,
            last_verified_at=time.time(),
            last_verified_mode=outcome.verify_mode,
            last_verified_ok=True,
            last_verified_summary=outcome.verify_summary,
        )

    def accept(self) -> None:
        if self.busy:
            return
        self.record = self.make_record()
        super().accept()
        self.modelReady.emit(self.record)

    def reject(self) -> None:
        """Cancel/close/Esc: during a build, ask; then cancel cleanly and close once the worker stopped."""
        if self._stopping:
            return
        if self.build_page.running or self.download_page.running:
            answer = QMessageBox.question(
                self, "Stop building the pack?",
                "The pack is still being built. Stop now?\n\nEverything written so far is kept: setting up the "
                "same model into the same folder later resumes where it stopped.",
                QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No)
            if answer != QMessageBox.StandardButton.Yes:
                return
            self._stopping = True
            page = self.build_page if self.build_page.running else self.download_page
            page.task.finished.connect(self._close_after_stop, QUEUED)
            page.cancel_build()
            for button in (QWizard.WizardButton.BackButton, QWizard.WizardButton.NextButton,
                           QWizard.WizardButton.CommitButton, QWizard.WizardButton.CancelButton):
                if self.button(button) is not None:
                    self.button(button).setEnabled(False)
            return
        if self.finish_page.task is not None and self.finish_page.task.running:
            return  # deleting files: a moment; closing now would hide whether it finished
        super().reject()

    @Slot()
    def _close_after_stop(self) -> None:
        self._stopping = False
        super().reject()
