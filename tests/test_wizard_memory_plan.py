"""The setup wizard's checks page shows the memory plan (engine.memory_plan) as stacked bars.

A fake machine (fixed free VRAM and RAM) makes the bars deterministic; the expected
numbers come from the GGUF read with the `gguf` library and from the plan's documented
rules (CUDA margin: 6% of the card, at least 1 GiB; the expert cache: every expert when
they fit), not from the plan code. The bars are grabbed as pixels to check that each
segment is painted in its consumer's colour and in proportion to its bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader
from PySide6.QtWidgets import QApplication

from app.gui.memory_plan_view import FREE, SEGMENT_COLORS
from packer.diskio import GIB, format_bytes
from packer.preflight import GpuInfo, RamInfo
from test_screenshots import clipped_texts
from test_wizard import (  # noqa: F401 (_no_leftover_tasks: the autouse fixture that waits for the workers)
    _no_leftover_tasks,
    choose_model,
    commit_button,
    new_wizard,
    plain,
    probes,
    to_target_page,
)

KIMI = Path(__file__).parent / "fixtures" / "kimi_k3" / "tiny-f32.gguf"
RAM = RamInfo(available_bytes=26 * GIB, total_bytes=32 * GIB)
CARD = GpuInfo("NVIDIA GeForce RTX 5090", free_bytes=31 * GIB, total_bytes=32 * GIB)
TINY_CARD = GpuInfo("Tiny GPU", free_bytes=GIB + 10 * 2**20, total_bytes=2 * GIB)  # less than the 1 GiB margin + KV


def context_tokens() -> int:
    """What the plan assumes: the model's context length, at most 8192 tokens."""
    field = GGUFReader(KIMI).fields["kimi-k3.context_length"]
    return min(8192, int(field.parts[field.data[0]][0]))


def checked(qtbot, tmp_path, gpu, ram=RAM, **kw):
    wizard = new_wizard(qtbot, probes=probes(gpu=gpu, ram=ram), **kw)
    info = choose_model(qtbot, wizard, KIMI)
    assert info.supported, info.reason
    report = to_target_page(qtbot, wizard, tmp_path / "packs")
    return wizard, info, report


def clipped(wizard) -> list[str]:
    """The screenshot test's clipped-text check, once the layout has settled (as it takes its shots)."""
    for _ in range(3):
        QApplication.processEvents()
    return clipped_texts(wizard)


def pixel(bar, rect):
    image = bar.grab().toImage()
    ratio = image.devicePixelRatio()
    return image.pixelColor(int(rect.center().x() * ratio), int(rect.center().y() * ratio)).name()


def test_gpu_machine_shows_a_bar_per_memory_with_a_segment_per_consumer(qtbot, tmp_path):
    wizard, info, report = checked(qtbot, tmp_path, CARD)
    page, view = wizard.target_page, wizard.target_page.memory_plan
    assert report.ok and page.isComplete() and commit_button(wizard).isEnabled()
    assert "memory_plan" not in page.check_rows and view.isVisible()
    tokens = context_tokens()
    assert report.memory_plan.context_tokens == tokens == 4096
    assert f"context of {tokens:,} tokens" in plain(view.heading)

    bar = view.bars["device"]
    seg = dict(bar.segments)
    assert [n for n, _ in bar.segments] == ["dense weights", "kv state", "activations", "margin", "expert cache", FREE]
    assert bar.total == sum(seg.values()) == CARD.free_bytes  # the card's free memory, shared out
    assert seg["dense weights"] == info.sizes.dense_bytes
    assert seg["margin"] == max(GIB, int(CARD.total_bytes * 0.06))
    every_expert = info.sizes.moe_layers * info.sizes.num_experts * info.sizes.expert_block_bytes
    assert seg["expert cache"] == every_expert  # they all fit: the rest stays free
    assert 0 < seg["kv state"] < GIB and 0 < seg["activations"] < GIB
    title = plain(view.titles["device"])
    assert "GPU memory" in title and format_bytes(CARD.free_bytes) in title
    legend = plain(view.legends["device"])
    assert f"KV state at {tokens:,} tokens\xa0{format_bytes(seg['kv state'])}" in legend
    chunk = report.memory_plan.prompt_chunk
    assert chunk == 2048  # every expert fits the card: long prompts take the largest chunks
    assert f"activations (prompt chunks of {chunk:,} tokens)\xa0{format_bytes(seg['activations'])}" in legend
    for name in ("dense weights", "margin", "expert cache", FREE):
        assert f"{name}\xa0{format_bytes(seg[name])}" in legend, name

    # The pixels: the margin's segment in its colour, as wide as its share of the bar.
    qtbot.waitUntil(lambda: bar.width() > 100)
    rects = dict(bar.segment_rects())
    assert rects["margin"].width() == pytest.approx(bar.width() * seg["margin"] / bar.total, abs=3 * 3)
    assert pixel(bar, rects["margin"]) == SEGMENT_COLORS["margin"][0]
    assert pixel(bar, rects[FREE]) == SEGMENT_COLORS[FREE][0]
    assert rects["expert cache"].width() >= 3  # a few MiB of 31 GB still shows

    ram = dict(view.bars["ram"].segments)  # every expert is in VRAM: the host tier holds none
    assert view.bars["ram"].isVisible() and view.bars["ram"].total == RAM.available_bytes
    assert ram == {"host expert tier": 0, "OS + app margin": RAM.available_bytes}
    assert not clipped(wizard)


def test_the_plan_counts_the_state_in_the_dtype_the_settings_reply_in(qtbot, tmp_path):
    """With "Compute replies in float32" (the app's settings, handed to the wizard) the KV
    state is planned in float32: Kimi-K3's MLA rows take twice their bf16 bytes."""
    from app.gui.settings import AppSettings

    _, _, default = checked(qtbot, tmp_path / "a", CARD)
    options = AppSettings(float32_replies=True).runtime_options()
    wizard, _, mixed = checked(qtbot, tmp_path / "b", CARD, options=options)
    assert wizard.options is options
    wide, narrow = mixed.memory_plan.kv.per_token, default.memory_plan.kv.per_token
    assert wide == 2 * narrow > 0
    seg = dict(wizard.target_page.memory_plan.bars["device"].segments)
    assert seg["kv state"] == mixed.memory_plan.device_parts["kv state"] > default.memory_plan.device_parts["kv state"]


def test_cpu_machine_plans_ram_only(qtbot, tmp_path):
    wizard, info, report = checked(qtbot, tmp_path, None)
    view = wizard.target_page.memory_plan
    assert report.ok and view.isVisible() and not view.bars["ram"].isVisible()
    assert "no GPU" in plain(view.titles["device"])
    seg = dict(view.bars["device"].segments)
    assert sum(seg.values()) == RAM.available_bytes and seg["margin"] == max(2 * GIB, RAM.total_bytes // 10)


def test_nothing_fits_is_a_failed_check_with_the_numbers_then_a_bigger_card_fits(qtbot, tmp_path):
    wizard, info, report = checked(qtbot, tmp_path, TINY_CARD)
    page = wizard.target_page
    assert report.memory_plan is None and not page.memory_plan.isVisible()
    assert [c.name for c in report.blockers] == ["memory_plan"]
    row = page.check_rows["memory_plan"]
    text = plain(row)
    assert row.property("status") == "fail" and "Memory plan" in text and "does not fit cuda" in text
    assert f"{context_tokens()} tokens" in text and "1.01 GiB" in text and "margin 1.00 GiB" in text
    assert "What to do" in text and "Memory plan" in plain(page.summary)
    assert not page.isComplete() and not commit_button(wizard).isEnabled()
    assert not clipped(wizard)

    wizard.probes.update(probes(gpu=CARD, ram=RAM))
    with qtbot.waitSignal(page.checked, timeout=10_000):
        page.recheck_button.click()
    assert "memory_plan" not in page.check_rows and page.memory_plan.isVisible() and page.isComplete()


def test_a_model_without_a_runnable_config_shows_no_plan(qtbot, tmp_path):
    from pack_fixtures import write_deepseek4  # packable, but its metadata lacks what the engine needs

    wizard = new_wizard(qtbot)
    choose_model(qtbot, wizard, write_deepseek4(tmp_path / "src"))
    report = to_target_page(qtbot, wizard, tmp_path / "packs")
    assert report.ok and report.memory_plan is None and not wizard.target_page.memory_plan.isVisible()
