"""The wizard's "which model fits this PC?" panel: the fit estimate before anything is downloaded.

Why here and not on a later page: users ask this first, before they have a GGUF.
For every release of the catalogue (`resources/catalog.json`) the panel shows the
disk space needed (packing while downloading) against what is free, the expected
decode tokens/s range and a fits / does not fit verdict, from `packer.fit.estimate_fit`
(the same estimate as `expertdesk fit`). The drive probe (a 2-second O_DIRECT read of a
scratch file) runs on a worker thread when the user asks for it, never on the GUI
thread and never just because the wizard opened.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.gui.wizard_workers import BackgroundTask
from packer.diskio import existing_ancestor, format_bytes
from packer.fit import FitReport, ReadProbe, estimate_fit, load_catalog, probe_read_speed

ReadProbeFn = Callable[[Path], ReadProbe]


def catalog_path() -> Path:
    """The bundled catalogue of downloadable releases."""
    from engine.resources import resource_path

    return resource_path("catalog.json")


def estimate_catalog(folder: str | os.PathLike, *, catalog: str | os.PathLike | None = None,
                     read_probe_fn: ReadProbeFn = probe_read_speed, **probes: Callable[..., Any]) -> list[FitReport]:
    """`estimate_fit` for every catalogue release in `folder`, with ONE drive probe for all
    (the drive does not change between releases). `probes`: estimate_fit's *_fn arguments."""
    releases = load_catalog(catalog if catalog is not None else catalog_path())
    probe = read_probe_fn(existing_ancestor(Path(folder).expanduser()))
    return [estimate_fit(r, folder, read_probe=probe, **probes) for r in releases]


def fit_summary(report: FitReport) -> tuple[str, str]:
    """(status, plain text) of one release for the panel: status is "pass" (fits),
    "warn" (fits the disk, a preflight check warns) or "fail" (does not fit)."""
    low, high = report.tokens_per_s
    if high is None:
        speed = "not limited by the drive (the whole model fits in the caches)"
    else:
        speed = f"{low or 0:.1f}–{high:.1f} tokens/s expected (drive bound)"
    disk = (f"disk: needs {format_bytes(report.disk_needed_streaming)}, "
            f"{format_bytes(report.disk_free)} free")
    problems = [c.reason for c in report.preflight.checks if c.status == "fail"]
    if not report.fits_disk:
        return "fail", f"does not fit · {disk} · {speed}"
    if problems:
        return "fail", f"does not fit: {problems[0]} · {disk} · {speed}"
    status = "warn" if any(c.status == "warn" for c in report.preflight.checks) else "pass"
    return status, f"fits · {disk} · {speed}"


class FitPanel(QFrame):
    """One line per catalogue release, filled by a worker thread on "Estimate".

    `folder_fn` gives the folder to measure (the pack folder if known, else home);
    `read_probe_fn` and `probes` replace the real probes (tests). `estimated` carries the
    list of FitReports, or the exception, once an estimate finished."""

    estimated = Signal(object)

    def __init__(self, parent: QWidget, folder_fn: Callable[[], Path], *, read_probe_fn: ReadProbeFn | None = None,
                 probes: dict[str, Any] | None = None,
                 colored: Callable[[QWidget, str, str], str] = lambda _w, _s, text: text) -> None:
        super().__init__(parent)
        self.setObjectName("fitPanel")
        self._folder_fn = folder_fn
        self._read_probe_fn = read_probe_fn or probe_read_speed
        self._probes = dict(probes or {})
        self._colored = colored
        self.title = QLabel("<b>Which model fits this PC?</b> Before downloading anything: disk space and "
                            "the decode speed to expect, from a 2-second read test of your drive.", self)
        self.title.setWordWrap(True)
        self.button = QPushButton("Estimate", self)
        self.button.setAccessibleName("Estimate which models fit")
        self.button.clicked.connect(self.start)
        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(self.button, 0, Qt.AlignmentFlag.AlignTop)
        self.status = QLabel("", self)
        self.status.setWordWrap(True)
        self.rows: list[QLabel] = []
        self._rows_layout = QVBoxLayout()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        layout.addWidget(self.status)
        layout.addLayout(self._rows_layout)
        self.reports: list[FitReport] = []
        self.task: BackgroundTask | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and self.task.running

    def start(self) -> None:
        """Run the estimate on a worker thread (one at a time)."""
        if self.running:
            return
        folder = self._folder_fn()
        probe, probes = self._read_probe_fn, dict(self._probes)
        self.button.setEnabled(False)
        self.status.setText(f"Measuring the drive of {html.escape(str(folder))}…")
        task = BackgroundTask(lambda _report: estimate_catalog(folder, read_probe_fn=probe, **probes),
                              name="wizard-fit")
        task.succeeded.connect(self._on_reports, Qt.ConnectionType.QueuedConnection)
        task.failed.connect(self._on_error, Qt.ConnectionType.QueuedConnection)
        self.task = task.start()

    def _clear(self) -> None:
        for label in self.rows:
            self._rows_layout.removeWidget(label)
            label.deleteLater()
        self.rows = []

    @Slot(object)
    def _on_reports(self, reports: list[FitReport]) -> None:
        if self.sender() is not self.task:
            return
        self._clear()
        self.reports = reports
        for report in reports:
            status, text = fit_summary(report)
            label = QLabel(f"<b>{html.escape(report.release.name)}</b><br>"
                           f"{self._colored(self, status, html.escape(text))}", self)
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            label.setAccessibleName(f"Fit of {report.release.name}")
            label.setToolTip("\n".join(report.lines()))
            self._rows_layout.addWidget(label)
            self.rows.append(label)
        if reports:
            r = reports[0].read
            self.status.setText(f"Drive: {format_bytes(r.bytes_per_s)}/s ({html.escape(r.detail)}). "
                                "Compute and PCIe copies only slow decoding further; hover a model for details.")
        self.button.setEnabled(True)
        self.estimated.emit(reports)

    @Slot(object)
    def _on_error(self, exc: BaseException) -> None:
        if self.sender() is not self.task:
            return
        self._clear()
        self.status.setText(self._colored(self, "fail", "✖ The estimate failed: ") + html.escape(str(exc) or
                                                                                                 type(exc).__name__))
        self.button.setEnabled(True)
        self.estimated.emit(exc)
