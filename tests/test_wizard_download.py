"""The wizard's download start (app/gui/wizard_download.py) against the mock hub (tests/hub_mock.py).

Driven like a user: tick "download from Hugging Face", pick the release, Next, Download
and pack; Cancel after the first shard (the worker is held at that moment, so the cancel
lands mid-way), Resume, Finish. The references: `expertdesk verify` and a byte comparison
with `build_pack` of the complete split set (test_shard_pack's fixtures), the files left
in the Hugging Face cache, and the hub's request log (the packed shard is not fetched again).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QWizard

from app.gui.wizard import PAGE_DOWNLOAD, PAGE_FINISH, SetupWizard
from app.gui.wizard_workers import running_tasks
from packer.fit import Release
from packer.gguf_source import split_set_paths
from test_screenshots import clipped_texts
from test_shard_pack import PATTERN, REPO, disk_bytes, hub, reference, same_files, source  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    for task in running_tasks():
        task.wait(10)


def tiny_release(source) -> Release:
    files = split_set_paths(source)
    return Release(id="tiny", name="Tiny DS4", architecture="deepseek4", repo=REPO, include=PATTERN,
                   shards=len(files), source_bytes=sum(p.stat().st_size for p in files), dense_bytes=0,
                   moe_layers=2, num_experts=8, top_k=2, expert_block_bytes=0, per_token_expert_bytes=0,
                   quant_types={"routed_experts": "MXFP4"})


def open_download_page(qtbot, source, folder, *, keep_shards: bool = False) -> SetupWizard:
    wizard = SetupWizard(folder=folder)
    qtbot.addWidget(wizard)
    wizard.show()
    chooser = wizard.source_page.releases
    chooser.set_releases([tiny_release(source)])
    assert not wizard.source_page.isComplete()  # neither a GGUF nor a release yet
    chooser.use_check.setChecked(True)
    assert wizard.source_page.isComplete()
    qtbot.waitExposed(wizard)
    assert clipped_texts(wizard) == []
    wizard.next()
    assert wizard.currentId() == PAGE_DOWNLOAD
    page = wizard.download_page
    assert page.delete_check.isChecked()  # consent to delete shards: default on
    assert page.folder_edit.text() == str(folder)
    page.delete_check.setChecked(not keep_shards)
    return wizard


def cached_shards(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "hf-cache").rglob("*.gguf"))


class Ticks:
    """Gaps between 10 ms timer ticks on the GUI thread: a blocked GUI thread shows as a long gap."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.last = time.perf_counter()
        self.timer = QTimer()
        self.timer.setInterval(10)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now


def test_download_cancel_resume_finish_deletes_the_shards(qtbot, hub, source, reference, tmp_path):
    from app.cli import main

    out = tmp_path / "packs"
    wizard = open_download_page(qtbot, source, out)
    page = wizard.download_page
    names = [p.name for p in split_set_paths(source)]
    held, go_on, steps = threading.Event(), threading.Event(), []

    def on_step(what: str, name: str) -> None:  # worker thread
        steps.append((what, name))
        if (what, name) == ("deleted", names[0]) and not go_on.is_set():
            held.set()
            go_on.wait(10)  # the user presses Cancel while shard 1 is done and shard 2 is next

    page.packer_options = {"on_step": on_step}
    ticks = Ticks()
    qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    assert page.running and not page.start_button.isEnabled() and page.cancel_button.isVisible()
    qtbot.waitUntil(held.is_set, timeout=10_000)
    qtbot.mouseClick(page.cancel_button, Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(page.downloadFinished, timeout=10_000) as cancelled:
        go_on.set()
    assert type(cancelled.args[0]).__name__ == "Cancelled"
    assert "cancelled" in page.phase_label.text() and page.start_button.text() == "Resume download"
    assert not page.isComplete() and clipped_texts(wizard) == []
    assert cached_shards(tmp_path) == []  # shard 1 packed and deleted; shard 2 not complete
    assert list(out.iterdir()) and not (out / reference.name).exists()  # the partial pack stays

    before = len(hub.requests)
    with qtbot.waitSignal(page.downloadFinished, timeout=15_000) as done:
        qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    ticks.timer.stop()
    stopped = time.perf_counter()
    info, outcome = done.args[0]
    assert outcome.verify_ok and outcome.verify_mode == "full", outcome.verify_summary
    assert page.progress_count > 0 and "verified" in page.phase_label.text()
    assert clipped_texts(wizard) == []
    fetched = [p for m, p, r in hub.requests[before:] if m == "GET" and p.endswith(".gguf") and r is None]
    assert sorted(fetched) == [f"MXFP4_MOE/{n}" for n in names[1:]]  # shard 1 was not fetched again
    assert [s for s in steps if s[0] == "deleted"] == [("deleted", n) for n in names]
    assert cached_shards(tmp_path) == []  # every shard deleted once packed
    assert disk_bytes(tmp_path / "hf-cache") < min(p.stat().st_size for p in split_set_paths(source))
    same_files(outcome.pack_dir, reference)
    assert main(["verify", str(outcome.pack_dir)]) == 0

    # The GUI thread kept ticking while the worker downloaded, packed and verified: no gap
    # of 0.5 s from the first click to the end, the last one (up to the stop) included. How
    # many ticks that is depends on how fast this machine does the work (an idle one: ~20).
    assert ticks.gaps and stopped - ticks.last < 0.5
    assert max(ticks.gaps) < 0.5, f"GUI thread blocked for {max(ticks.gaps) * 1000:.0f} ms"

    assert page.isComplete()
    wizard.next()
    assert wizard.currentId() == PAGE_FINISH
    assert "no longer there" in wizard.finish_page.files_label.text()
    with qtbot.waitSignal(wizard.modelReady, timeout=5_000) as ready:
        wizard.button(QWizard.WizardButton.FinishButton).click()
    record = ready.args[0]
    assert record.ref == str(outcome.pack_dir) and record.name == "Tiny DS4"
    assert record.architecture == info.architecture == "deepseek4" and record.last_verified_mode == "full"


def test_unticked_box_keeps_the_shards(qtbot, hub, source, tmp_path):
    wizard = open_download_page(qtbot, source, tmp_path / "packs", keep_shards=True)
    page = wizard.download_page
    with qtbot.waitSignal(page.downloadFinished, timeout=15_000) as done:
        qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    _info, outcome = done.args[0]
    assert outcome.verify_ok
    assert cached_shards(tmp_path) == [p.name for p in split_set_paths(source)]
    wizard.next()
    finish = wizard.finish_page
    assert finish.delete_check.isEnabled() and "3 source files" in finish.delete_check.text()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fault", ["401", "network", "disk"])
def test_errors_show_the_cause_and_the_fix(qtbot, hub, source, tmp_path, monkeypatch, fault):
    if fault == "401":
        hub.token = "hf_right"
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    elif fault == "network":
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    else:
        import packer.shard_pack

        monkeypatch.setattr(packer.shard_pack, "free_space", lambda _path: (10_000, 10**12))
    wizard = open_download_page(qtbot, source, tmp_path / "packs")
    page = wizard.download_page
    with qtbot.waitSignal(page.downloadFinished, timeout=15_000) as failed:
        qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    assert type(failed.args[0]).__name__ == ("PackBuildError" if fault == "disk" else "DownloadError")
    text = page.result_label.text()
    if fault == "401":
        assert "401" in text and "HF_TOKEN" in text
    elif fault == "disk":
        assert "Not enough free space" in text and "free space or choose another folder" in text
    else:
        assert "check the network connection" in text and "press Try again" in text
    assert "same command" not in text
    assert page.start_button.text() == "Try again" and page.start_button.isEnabled() and not page.isComplete()
    assert clipped_texts(wizard) == []
    if fault == "401":  # the fix works: the right token, Try again
        monkeypatch.setenv("HF_TOKEN", "hf_right")
        with qtbot.waitSignal(page.downloadFinished, timeout=15_000) as done:
            qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
        assert done.args[0][1].verify_ok
