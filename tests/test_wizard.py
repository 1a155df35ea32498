"""The setup wizard on tiny GGUFs: model check, preflight (simulated machines), build, cancel, resume,
verify, source deletion, and the new model answering in the main window.

Screenshots of each page go to the test's temporary directory and, when it can be written,
to /tmp/expertdesk-screens/wizard-*.png.
"""

from __future__ import annotations

import html
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtWidgets import QApplication, QMessageBox, QWizard

from app.gui.wizard import BAR_STEPS, PAGE_BUILD, PAGE_FINISH, PAGE_SOURCE, PAGE_TARGET, SetupWizard
from app.gui.wizard_logic import (
    Cancelled,
    build_and_verify,
    check_target,
    examine_target,
    format_count,
    inspect_gguf,
    journaled_layers,
)
from app.gui.wizard_workers import running_tasks
from gguf_factory import write_gguf
from gui_helpers import gui_env, open_window, send_and_wait, set_sampling  # noqa: F401 (fixtures)
from pack_fixtures import write_deepseek4, write_kimi_k3
from packer.diskio import GIB
from packer.preflight import GpuInfo, ODirectProbe, RamInfo
from packer.verify import verify_pack

SHARED_DIR = Path("/tmp/expertdesk-screens")
SMALL = dict(buffer_bytes=2 * 24576, threads=3)  # ds4: 2 experts per group, 2 groups per layer
RTX5090 = GpuInfo("NVIDIA GeForce RTX 5090", free_bytes=31 * GIB, total_bytes=32 * GIB)
DESKTOP_RAM = RamInfo(available_bytes=26 * GIB, total_bytes=32 * GIB)
GOOD_ODIRECT = ODirectProbe(True, True, "aligned O_DIRECT write and read work")
NO_ODIRECT = ODirectProbe(False, None, "the filesystem refused to open a file with O_DIRECT")


def probes(*, free: int = 1800 * 10**9, odirect: ODirectProbe = GOOD_ODIRECT, gpu: GpuInfo | None = RTX5090,
           ram: RamInfo = DESKTOP_RAM) -> dict:
    return dict(free_space_fn=lambda _p: (free, 2000 * 10**9), odirect_fn=lambda _p: odirect,
                gpu_fn=lambda: gpu, ram_fn=lambda: ram)


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    for task in running_tasks():
        assert task.wait(30), "a wizard worker thread did not stop"


def screenshot(widget, tmp_path: Path, name: str) -> None:
    QApplication.processEvents()  # widgets added to a shown layout appear on the next event loop pass
    widget.grab().save(str(tmp_path / f"{name}.png"))
    try:
        SHARED_DIR.mkdir(parents=True, exist_ok=True)
        widget.grab().save(str(SHARED_DIR / f"{name}.png"))
    except OSError:
        pass


def new_wizard(qtbot, **kw) -> SetupWizard:
    kw.setdefault("probes", probes())
    kw.setdefault("builder_options", dict(SMALL))
    wizard = SetupWizard(**kw)
    qtbot.addWidget(wizard)
    wizard.show()
    return wizard


def choose_model(qtbot, wizard: SetupWizard, path: Path):
    with qtbot.waitSignal(wizard.source_page.checked, timeout=10_000) as blocker:
        wizard.source_page.set_path(path)
    return blocker.args[0]


def to_target_page(qtbot, wizard: SetupWizard, folder: Path):
    wizard.target_page.folder_edit.setText(str(folder))
    with qtbot.waitSignal(wizard.target_page.checked, timeout=10_000) as blocker:
        wizard.next()
    assert wizard.currentId() == PAGE_TARGET
    return blocker.args[0]


def build(qtbot, wizard: SetupWizard, start=None):
    with qtbot.waitSignal(wizard.build_page.buildFinished, timeout=30_000) as blocker:
        (start or wizard.next)()
    return blocker.args[0]


def plain(label) -> str:
    """A label's text as the user reads it (rich text without tags and entities)."""
    return html.unescape(re.sub(r"<br\s*/?>", "\n", re.sub(r"<(?!br)[^>]+>", "", label.text())))


def commit_button(wizard: SetupWizard):
    return wizard.button(QWizard.WizardButton.CommitButton)


# --- Qt-free logic -------------------------------------------------------------------------------


def test_inspect_single_split_and_unsupported(tmp_path):
    ds4 = inspect_gguf(write_deepseek4(tmp_path / "a"))
    assert (ds4.architecture, ds4.shards, ds4.supported, ds4.name) == ("deepseek4", 1, True, "tiny deepseek4")
    assert ds4.parameters > 0 and ds4.total_bytes == ds4.files[0].stat().st_size
    assert dict(ds4.quant_counts)["MXFP4"] == 12 and ds4.quant_summary().startswith("MXFP4 ×12")
    assert (ds4.moe_layers, ds4.num_experts, ds4.top_k) == (4, 4, 2) and ds4.pack_bytes > 0
    kimi = inspect_gguf(write_kimi_k3(tmp_path / "b", split=3))
    assert (kimi.architecture, kimi.shards, kimi.supported, kimi.stem) == ("kimi-k3", 3, True, "tiny-kimi")
    assert {"Q2_K", "Q3_K"} <= dict(kimi.quant_counts).keys()
    dense = write_gguf(tmp_path / "dense.gguf", {"token_embd.weight": np.ones((8, 32), np.float32)}, {},
                       arch="testarch")
    info = inspect_gguf(dense)
    assert not info.supported and info.reason and info.sizes is None
    assert format_count(284_300_000_000) == "284.3 B" and format_count(1_030_000_000_000) == "1.03 T"


def test_build_cancel_resume_and_reuse_without_qt(tmp_path):
    info = inspect_gguf(write_deepseek4(tmp_path / "src"))
    cancel = threading.Event()

    def hook(done, total, rate, eta, phase):
        if phase.startswith("copying experts: layer 2"):
            cancel.set()

    with pytest.raises(Cancelled):
        build_and_verify(info, tmp_path / "packs", cancel=cancel, builder_options=dict(SMALL, progress_hook=hook))
    state = examine_target(info, tmp_path / "packs")
    assert state.existing == "none" and state.journaled_layers == journaled_layers(state.partial) >= 1
    seen = []
    outcome = build_and_verify(info, tmp_path / "packs", progress=seen.append, builder_options=SMALL)
    assert outcome.verify_ok and outcome.layers_resumed == state.journaled_layers and "Resumed" in outcome.resume_text()
    assert {p.stage for p in seen} == {"build", "verify"}
    again = build_and_verify(info, tmp_path / "packs")  # a finished pack of the same model: verified, reused
    assert again.reused and again.verify_ok and examine_target(info, tmp_path / "packs").existing == "same"
    report = check_target(info, tmp_path / "packs", **probes())
    assert report.ok and report.checks[0].name == "target" and "already" in report.checks[0].reason


# --- page 1 -------------------------------------------------------------------------------------


def test_page1_shows_the_model_and_refuses_what_it_cannot_use(qtbot, tmp_path):
    wizard = new_wizard(qtbot)
    page = wizard.source_page
    info = choose_model(qtbot, wizard, write_kimi_k3(tmp_path / "kimi", split=3))
    assert info.shards == 3 and page.isComplete()
    assert plain(page.fields["architecture"]) == "kimi-k3"
    assert "3 shards" in plain(page.fields["files"]) and "tiny-kimi-00003-of-00003.gguf" in plain(page.fields["files"])
    assert "Q2_K ×6" in plain(page.fields["quants"]) and "M (" in plain(page.fields["parameters"])
    assert "Yes" in plain(page.fields["supported"])
    assert wizard.button(QWizard.WizardButton.NextButton).isEnabled()

    # A missing shard: named, with what to do; Next stays off.
    broken = write_kimi_k3(tmp_path / "broken", split=3)
    (broken.parent / "tiny-kimi-00002-of-00003.gguf").unlink()
    exc = choose_model(qtbot, wizard, broken)
    assert "shard 2 of 3 is missing" in str(exc) and "shard 2 of 3 is missing" in plain(page.status)
    assert not page.isComplete() and not wizard.button(QWizard.WizardButton.NextButton).isEnabled()

    # A GGUF the packer does not support: the reason is shown, Next stays off.
    dense = write_gguf(tmp_path / "dense.gguf", {"token_embd.weight": np.ones((8, 32), np.float32)}, {},
                       arch="testarch")
    info = choose_model(qtbot, wizard, dense)
    assert not info.supported and "cannot pack" in plain(page.status) and info.reason[:30] in plain(page.status)
    assert not page.isComplete()

    exc = choose_model(qtbot, wizard, tmp_path / "nope.gguf")
    assert isinstance(exc, FileNotFoundError) and "no such file" in plain(page.status)


# --- page 2 -------------------------------------------------------------------------------------


def test_page2_checks_with_reasons_full_disk_and_no_odirect_block(qtbot, tmp_path):
    src = write_deepseek4(tmp_path / "src")
    wizard = new_wizard(qtbot, probes=probes(free=10 * 10**6))
    choose_model(qtbot, wizard, src)
    report = to_target_page(qtbot, wizard, tmp_path / "packs")
    page = wizard.target_page
    assert not report.ok and [c.name for c in report.blockers] == ["free_space"]
    row = page.check_rows["free_space"]
    assert row.property("status") == "fail" and "only 10.0 MB free" in plain(row) and "What to do" in plain(row)
    assert "problem" in plain(page.summary) and "only 10.0 MB free" in plain(page.summary)
    assert not page.isComplete() and not commit_button(wizard).isEnabled()
    for name in ("target", "direct_io", "gpu", "vram", "ram"):
        assert page.check_rows[name].property("status") == "pass", plain(page.check_rows[name])
    assert "RTX 5090" in plain(page.check_rows["gpu"]) and "dense weights" in plain(page.check_rows["vram"])
    screenshot(wizard, tmp_path, "wizard-2-full-disk")

    # The filesystem cannot do O_DIRECT: a blocker too, with the reason and the fix.
    wizard.probes.update(probes(odirect=NO_ODIRECT))
    with qtbot.waitSignal(page.checked, timeout=10_000):
        page.recheck_button.click()
    row = page.check_rows["direct_io"]
    assert row.property("status") == "fail" and "refused to open a file with O_DIRECT" in plain(row)
    assert "local NVMe" in plain(row) and not commit_button(wizard).isEnabled()

    # Buffered "direct" I/O and no GPU are warnings: Next is allowed.
    wizard.probes.update(probes(odirect=ODirectProbe(True, False, "ok"), gpu=None))
    with qtbot.waitSignal(page.checked, timeout=10_000):
        page.recheck_button.click()
    assert page.check_rows["direct_io"].property("status") == "warn"
    assert page.check_rows["gpu"].property("status") == "warn" and "no CUDA GPU" in plain(page.check_rows["gpu"])
    assert page.isComplete() and commit_button(wizard).isEnabled() and "warning" in plain(page.summary)
    assert page.cache_vram.value() == 0 and page.cache_vram.text() == "automatic"

    # All good on a 5090 desktop: cache sizes proposed (never more than every expert of the model).
    wizard.probes.update(probes())
    with qtbot.waitSignal(page.checked, timeout=10_000):
        page.recheck_button.click()
    assert all(label.property("status") == "pass" for label in page.check_rows.values())
    assert 0 < page.cache_vram.value() <= 2 and "Everything checks out" in plain(page.summary)
    assert commit_button(wizard).text() == "Build the pack"


def test_real_probes_in_the_test_folder(qtbot, tmp_path):
    wizard = new_wizard(qtbot, probes={"gpu_fn": lambda: None})
    choose_model(qtbot, wizard, write_deepseek4(tmp_path / "src"))
    report = to_target_page(qtbot, wizard, tmp_path / "packs")
    assert {c.name for c in report.checks} == {"target", "direct_io", "free_space", "gpu", "vram", "ram"}
    assert report.preflight.measurements["odirect"]["works"] in (True, False)
    assert wizard.target_page.check_rows["free_space"].property("status") == "pass"


# --- pages 3 and 4, single file --------------------------------------------------------------------


def test_build_cancel_resume_verify_delete_finish(qtbot, tmp_path):
    src = write_deepseek4(tmp_path / "models")
    reached, gate = threading.Event(), threading.Event()

    def hook(done, total, rate, eta, phase):  # on the build thread: hold it mid-build until the GUI cancels
        if phase.startswith("copying experts: layer 2") and not gate.is_set():
            reached.set()
            gate.wait(10)

    wizard = new_wizard(qtbot, builder_options=dict(SMALL, progress_hook=hook))
    choose_model(qtbot, wizard, src)
    screenshot(wizard, tmp_path, "wizard-1-model")
    to_target_page(qtbot, wizard, tmp_path / "packs")
    screenshot(wizard, tmp_path, "wizard-2-checks")
    page = wizard.build_page

    # Build, cancel mid-way.
    wizard.next()
    assert wizard.currentId() == PAGE_BUILD and page.running
    qtbot.waitUntil(reached.is_set, timeout=10_000)
    qtbot.waitUntil(lambda: page.progress_count > 0, timeout=5_000)
    assert 0 < page.bar.value() < BAR_STEPS and " of " in page.detail_label.text()
    screenshot(wizard, tmp_path, "wizard-3-building")
    with qtbot.waitSignal(page.buildFinished, timeout=30_000) as blocker:
        page.cancel_button.click()
        gate.set()
    assert isinstance(blocker.args[0], Cancelled)
    assert "cancelled" in plain(page.phase_label) and page.resume_button.isVisible() and not page.isComplete()
    done = examine_target(wizard.info, tmp_path / "packs").journaled_layers
    assert done >= 1 and f"{done} of 4 layers" in plain(page.result_label)
    assert not (tmp_path / "packs" / "tiny-ds4.expertpack").exists(), "no half pack under the final name"
    assert not wizard.button(QWizard.WizardButton.NextButton).isEnabled()
    screenshot(wizard, tmp_path, "wizard-3-cancelled")

    # Resume: the builder reports the layers it kept; the bar reaches 100%; then a full verify.
    stages = []
    page.progressed.connect(lambda p: stages.append(p.stage))
    outcome = build(qtbot, wizard, page.resume_button.click)
    assert outcome.verify_ok and outcome.layers_resumed == done and not outcome.restarted
    assert f"{done} layers were already done" in plain(page.resume_label)
    assert page.bar.value() == BAR_STEPS and "verified" in plain(page.phase_label)
    assert "build" in stages and "verify" in stages and "full verification" in plain(page.result_label).lower()
    assert verify_pack(outcome.pack_dir).ok
    screenshot(wizard, tmp_path, "wizard-3-built")

    # Page 4: delete the source (after the full verify), see the space freed.
    wizard.next()
    assert wizard.currentId() == PAGE_FINISH
    finish = wizard.finish_page
    assert not wizard.button(QWizard.WizardButton.BackButton).isEnabled()
    assert "frees" in finish.delete_check.text() and not finish.delete_button.isEnabled()
    size = src.stat().st_blocks * 512
    finish.delete_check.setChecked(True)
    assert finish.delete_button.isEnabled()
    screenshot(wizard, tmp_path, "wizard-4-finish")
    with qtbot.waitSignal(finish.deleted, timeout=10_000) as blocker:
        finish.delete_button.click()
    assert blocker.args[0] == size and not src.exists()
    assert "freed" in plain(finish.delete_result) and not finish.delete_button.isEnabled()
    screenshot(wizard, tmp_path, "wizard-4-deleted")

    finish.name_edit.setText("My DS4")
    with qtbot.waitSignal(wizard.modelReady, timeout=5_000) as blocker:
        wizard.button(QWizard.WizardButton.FinishButton).click()
    record = blocker.args[0]
    assert record.ref == str(tmp_path / "packs" / "tiny-ds4.expertpack") and record.name == "My DS4"
    assert record.architecture == "deepseek4" and record.source_deleted and record.last_verified_ok
    assert record.last_verified_mode == "full" and record.size_bytes > 0 and record.cache_vram_mib > 0


def test_split_set_builds_and_all_shards_are_deleted(qtbot, tmp_path):
    src = write_kimi_k3(tmp_path / "models", split=3)
    shards = sorted((tmp_path / "models").glob("tiny-kimi-*.gguf"))
    wizard = new_wizard(qtbot)
    choose_model(qtbot, wizard, src)
    to_target_page(qtbot, wizard, tmp_path / "packs")
    outcome = build(qtbot, wizard)
    assert outcome.verify_ok and not outcome.layers_resumed and outcome.pack_dir.name == "tiny-kimi.expertpack"
    wizard.next()
    finish = wizard.finish_page
    assert "the 3 source files" in finish.delete_check.text()
    size = sum(p.stat().st_blocks * 512 for p in shards)
    finish.delete_check.setChecked(True)
    with qtbot.waitSignal(finish.deleted, timeout=10_000) as blocker:
        finish.delete_button.click()
    assert blocker.args[0] == size > 0
    assert not any(p.exists() for p in shards)
    with qtbot.waitSignal(wizard.modelReady, timeout=5_000) as blocker:
        wizard.button(QWizard.WizardButton.FinishButton).click()
    assert blocker.args[0].architecture == "kimi-k3" and blocker.args[0].name == "tiny kimi-k3"


def test_closing_mid_build_asks_then_cancels_cleanly(qtbot, tmp_path, monkeypatch):
    src = write_deepseek4(tmp_path / "models")
    reached, gate = threading.Event(), threading.Event()

    def hook(done, total, rate, eta, phase):
        if phase.startswith("copying experts: layer 2") and not gate.is_set():
            reached.set()
            gate.wait(10)

    wizard = new_wizard(qtbot, builder_options=dict(SMALL, progress_hook=hook))
    choose_model(qtbot, wizard, src)
    to_target_page(qtbot, wizard, tmp_path / "packs")
    wizard.next()
    qtbot.waitUntil(reached.is_set, timeout=10_000)
    answers = [QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes]
    asked = []
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: (asked.append(a[1]), answers.pop(0))[1])
    wizard.reject()  # "No": keeps building
    assert wizard.isVisible() and wizard.build_page.running and len(asked) == 1
    wizard.reject()  # "Yes": cancel, close once the worker has stopped
    assert "Stop building" in asked[1] and wizard.isVisible()
    gate.set()
    qtbot.waitUntil(lambda: not wizard.isVisible(), timeout=30_000)
    assert not wizard.build_page.running and wizard.result() == 0
    partial = tmp_path / "packs" / "tiny-ds4.expertpack.partial"
    assert partial.is_dir() and journaled_layers(partial) >= 1
    assert not (tmp_path / "packs" / "tiny-ds4.expertpack").exists()

    # A later attempt into the same folder says it resumes, and does.
    again = new_wizard(qtbot)
    choose_model(qtbot, again, src)
    report = to_target_page(qtbot, again, tmp_path / "packs")
    assert report.state.journaled_layers >= 1 and "interrupted build" in plain(again.target_page.check_rows["target"])
    assert commit_button(again).text() == "Resume the build"
    again.next()
    assert "Resuming:" in plain(again.build_page.resume_label)
    qtbot.waitUntil(lambda: again.build_page.outcome is not None, timeout=30_000)
    outcome = again.build_page.outcome
    assert outcome.verify_ok and outcome.layers_resumed == report.state.journaled_layers


# --- the whole path in the main window ------------------------------------------------------------


def test_first_run_wizard_adds_a_model_that_answers(qtbot, open_window, tmp_path):
    from app.gui.main_window import ADD_MODEL, SETUP_LINK
    from app.gui.settings import load_settings
    from app.models_registry import ModelRegistry
    from engine.demo import write_demo_gguf

    models = tmp_path / "downloads"
    models.mkdir()
    gguf = write_demo_gguf(models / "tiny-ds4-chat.gguf")  # a real (tiny) deepseek4 model with a tokenizer
    window = open_window()
    # First run: only the demo is known, so the chat area offers the wizard.
    assert SETUP_LINK in window.chat_view.placeholder.text() and "Set up DeepSeek-V4-Flash" in \
        window.chat_view.placeholder.text()
    screenshot(window, tmp_path, "wizard-0-first-run")
    window.wizard_probes.update(probes(gpu=None))
    window.chat_view.placeholder.linkActivated.emit(SETUP_LINK)
    wizard = window.setup_wizard
    assert wizard is not None and wizard.isVisible() and wizard.currentId() == PAGE_SOURCE
    wizard.close()
    qtbot.waitUntil(lambda: not wizard.isVisible())

    # The picker's "Add a model…" opens it too.
    window._on_model_picked(window.model_picker.findData(ADD_MODEL))
    wizard = window.setup_wizard
    assert wizard.isVisible() and window.model_picker.currentData() == "demo"
    choose_model(qtbot, wizard, gguf)
    to_target_page(qtbot, wizard, tmp_path / "packs")
    assert build(qtbot, wizard).verify_ok
    wizard.next()
    wizard.finish_page.name_edit.setText("Tiny chat model")
    pack = str(tmp_path / "packs" / "tiny-ds4-chat.expertpack")
    wizard.button(QWizard.WizardButton.FinishButton).click()

    # Registered, in the picker, selected and loading at once.
    assert window.model_picker.currentData() == pack and window.model_picker.currentText() == "Tiny chat model"
    assert ModelRegistry().get(pack).name == "Tiny chat model"
    assert load_settings().last_model == pack
    qtbot.waitUntil(lambda: window.bridge.loaded is not None and window.bridge.model_ref == pack, timeout=60_000)
    assert not window.bridge.loaded.is_demo and window.bridge.loaded.architecture == "deepseek4"
    assert SETUP_LINK not in window.chat_view.placeholder.text()

    set_sampling(window, max_tokens=6)
    message_id = send_and_wait(qtbot, window, "What does json.dumps do?")
    reply = window.history.messages(window.controller.current_id)[-1]
    assert reply.id == message_id and reply.status == "finished" and reply.model_ref == pack
    assert reply.stats["completion_tokens"] >= 1


def test_a_failed_build_says_why_and_try_again_resumes(qtbot, tmp_path):
    failures = []

    def hook(done, total, rate, eta, phase):  # the drive hiccups once, in the middle of layer 2
        if phase.startswith("copying experts: layer 2") and not failures:
            failures.append(phase)
            raise OSError(5, "Input/output error")

    wizard = new_wizard(qtbot, builder_options=dict(SMALL, progress_hook=hook))
    choose_model(qtbot, wizard, write_deepseek4(tmp_path / "models"))
    to_target_page(qtbot, wizard, tmp_path / "packs")
    page = wizard.build_page
    exc = build(qtbot, wizard)
    assert not isinstance(exc, Cancelled) and "Input/output error" in str(exc)
    assert "build failed" in plain(page.phase_label) and "Input/output error" in plain(page.result_label)
    assert page.resume_button.isVisible() and page.resume_button.text() == "Try again" and not page.isComplete()
    outcome = build(qtbot, wizard, page.resume_button.click)
    assert outcome.verify_ok and outcome.layers_resumed >= 1 and page.isComplete()


def test_a_task_that_handed_over_its_error_no_longer_runs_while_its_thread_ends(qtbot):
    """The receiver of `failed` (on the GUI thread) sees the task stopped even while the
    worker thread is still alive (held here in `finished`): the build page's "Try again",
    clicked at once, used to be ignored because the thread had not ended yet."""
    from PySide6.QtCore import Qt

    from app.gui.wizard_workers import BackgroundTask

    def fail(report):
        raise OSError(5, "Input/output error")

    seen, release = [], threading.Event()
    task = BackgroundTask(fail, name="test-task")
    task.finished.connect(lambda: release.wait(10), Qt.ConnectionType.DirectConnection)  # the worker lingers
    with qtbot.waitSignal(task.failed, timeout=10_000):
        task.failed.connect(lambda exc: seen.append((task.running, task._thread.is_alive())),
                            Qt.ConnectionType.QueuedConnection)
        task.start()
    qtbot.waitUntil(lambda: bool(seen), timeout=10_000)
    release.set()
    assert task.wait(10)
    assert seen == [(False, True)]


def test_a_changed_source_restarts_the_interrupted_build(tmp_path):
    src = write_deepseek4(tmp_path / "src")
    cancel = threading.Event()

    def hook(done, total, rate, eta, phase):
        if phase.startswith("copying experts: layer 2"):
            cancel.set()

    with pytest.raises(Cancelled):
        build_and_verify(inspect_gguf(src), tmp_path / "packs", cancel=cancel,
                         builder_options=dict(SMALL, progress_hook=hook))
    write_deepseek4(tmp_path / "src", salt=7)  # same name, other bytes (another download)
    outcome = build_and_verify(inspect_gguf(src), tmp_path / "packs", builder_options=SMALL)
    assert outcome.verify_ok and outcome.restarted and not outcome.layers_resumed
    assert "started over" in outcome.resume_text()
