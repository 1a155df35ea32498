"""The wizard's model-choice page shows, before anything is downloaded, which catalogue
release fits this PC: disk needed vs free, the expected tokens/s range, fits or not.
The drive probe is a fake (fast, and blocking on demand to show it runs off the GUI
thread); the expected values are worked out here from the raw resources/catalog.json."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")

from app.gui.wizard import SetupWizard  # noqa: E402
from app.gui.wizard_workers import running_tasks  # noqa: E402
from packer.diskio import GIB, MIB  # noqa: E402
from packer.fit import ReadProbe  # noqa: E402
from packer.preflight import GpuInfo, ODirectProbe, RamInfo  # noqa: E402

CATALOG = json.loads((Path(__file__).resolve().parents[1] / "resources" / "catalog.json").read_text())["releases"]
RATE = 3000 * MIB
FREE = 400 * 10**9  # room for DeepSeek-V4-Flash (~156 GB pack), not for Kimi-K3 (~1 TB)


class FakeProbe:
    """A read probe that records where and on which thread it ran; `gate` holds it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, threading.Thread]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, folder: Path) -> ReadProbe:
        self.calls.append((folder, threading.current_thread()))
        assert self.gate.wait(20)
        return ReadProbe(RATE, True, RATE, 1.0, "O_DIRECT reads (fake)")


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    for task in running_tasks():
        assert task.wait(30), "a wizard worker thread did not stop"


def new_wizard(qtbot, tmp_path, probe) -> SetupWizard:
    probes = dict(free_space_fn=lambda _p: (FREE, 2000 * 10**9),
                  odirect_fn=lambda _p: ODirectProbe(True, True, "works"),
                  gpu_fn=lambda: GpuInfo("NVIDIA GeForce RTX 5090", 31 * GIB, 32 * GIB),
                  ram_fn=lambda: RamInfo(26 * GIB, 32 * GIB))
    wizard = SetupWizard(folder=tmp_path, probes=probes, fit_probe=probe)
    qtbot.addWidget(wizard)
    wizard.show()
    return wizard


def test_panel_shows_each_release_fit_and_speed(qtbot, tmp_path):
    probe = FakeProbe()
    wizard = new_wizard(qtbot, tmp_path, probe)
    panel = wizard.source_page.fit_panel
    assert probe.calls == [] and panel.rows == []  # opening the wizard measures nothing
    probe.gate.clear()
    panel.button.click()
    qtbot.waitUntil(lambda: len(probe.calls) == 1, timeout=10_000)
    assert not panel.button.isEnabled()
    qtbot.wait(50)  # the GUI thread keeps running while the probe is held
    assert probe.calls[0][1] is not threading.main_thread()
    assert probe.calls[0][0] == tmp_path
    with qtbot.waitSignal(panel.estimated, timeout=20_000) as blocker:
        probe.gate.set()
    reports = blocker.args[0]
    assert panel.button.isEnabled()
    assert [label.accessibleName() for label in panel.rows] == [f"Fit of {r['name']}" for r in CATALOG]
    verdicts = {}
    for raw, report, label in zip(CATALOG, reports, panel.rows):
        text = label.text()
        verdicts[raw["id"]] = "does not fit" not in text
        experts = raw["moe_layers"] * raw["num_experts"] * raw["expert_block_bytes"]
        f = min(1.0, (report.cache_vram_bytes + report.host_cache_bytes) / experts)
        low = RATE / ((1 - f) * raw["per_token_expert_bytes"])
        high = RATE / ((1 - f ** (1 / 3)) * raw["per_token_expert_bytes"])
        assert f"{low:.1f}–{high:.1f} tokens/s" in text
        assert "GB free" in text and "needs" in text
        assert report.disk_needed_streaming > experts + raw["dense_bytes"]  # the pack plus a shard
    assert verdicts == {"deepseek-v4-flash-mxfp4": True, "kimi-k3-q2_k": False}
    assert "Drive:" in panel.status.text()


def test_probe_failure_is_shown(qtbot, tmp_path):
    def broken(_folder: Path) -> ReadProbe:
        raise OSError(28, "No space left on device")

    wizard = new_wizard(qtbot, tmp_path, broken)
    panel = wizard.source_page.fit_panel
    with qtbot.waitSignal(panel.estimated, timeout=20_000) as blocker:
        panel.button.click()
    assert isinstance(blocker.args[0], OSError)
    assert "No space left on device" in panel.status.text()
    assert panel.rows == [] and panel.button.isEnabled()
