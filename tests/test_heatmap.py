"""The expert heat map: the cache's read-only map against the cache's own answers, and the widget's
colours and hover read-out."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QPointF
from PySide6.QtGui import QColor, QPixmap
from PySide6.QtTest import QTest

from app.gui.heatmap import PLACE_COLORS, ExpertHeatMap
from app.gui.theme import apply_theme
from engine.runtime import ExpertCache, ExpertStore
from engine.service_events import PLACE_DEVICE, PLACE_RAM, PLACE_SSD, ExpertMap
from pack_factory import make_pack

BLOCKS = (1, 3)


@pytest.fixture
def cache(tmp_path):
    pack = make_pack(tmp_path / "tiny.expertpack", blocks=BLOCKS, num_experts=8, top_k=2)
    store = ExpertStore(pack.path, direct_io=False, io_threads=2, stage_slots=3)
    stride = pack.manifest.expert_stride
    cache = ExpertCache(store, device="cpu", cache_bytes=3 * stride, reserve_bytes=0, host_cache_bytes=4 * stride,
                        policy="lfu")
    yield cache
    cache.close()
    store.close()


def test_the_map_says_where_each_expert_is_and_how_often_it_was_used(cache):
    uses = {(1, 0): 6, (1, 1): 3, (3, 2): 1, (3, 4): 1, (3, 5): 2}
    for (block, expert), n in uses.items():
        for _ in range(n):
            with cache.acquire(block, [expert]):
                pass
    expert_map = cache.expert_map()
    assert expert_map.blocks == BLOCKS and expert_map.num_experts == 8 and expert_map.device == "cpu"
    for row, block in enumerate(BLOCKS):
        for expert in range(8):
            place = expert_map.places[row * 8 + expert]
            key = (cache.manifest.layer_index(block), expert)
            if cache.slot_of(block, expert) is not None:  # the cache's own answers are the reference
                assert place == PLACE_DEVICE, (block, expert)
            elif key in cache.host:
                assert place == PLACE_RAM, (block, expert)
            else:
                assert place == PLACE_SSD, (block, expert)
            # "lfu": the count is the number of uses, exactly.
            assert expert_map.uses[row * 8 + expert] == pytest.approx(uses.get((block, expert), 0)), (block, expert)
    counts = [expert_map.places.count(p) for p in (PLACE_DEVICE, PLACE_RAM, PLACE_SSD)]
    assert counts[0] == 3 and counts[1] == 2 and sum(counts) == 16  # 3 slots full, 2 evicted into RAM


def test_the_map_is_none_rather_than_a_wait_while_the_engine_holds_the_lock(cache):
    with cache._cond:
        assert cache.expert_map() is None
    assert cache.expert_map() is not None


def _map() -> ExpertMap:
    places = bytes([PLACE_DEVICE, PLACE_RAM, PLACE_SSD, PLACE_SSD, PLACE_DEVICE, PLACE_SSD, PLACE_SSD, PLACE_SSD])
    return ExpertMap(blocks=(1, 3), num_experts=4, places=places, uses=(9, 2, 0, 0, 1, 0, 0, 4), device="cuda:0")


@pytest.mark.parametrize("dark", [False, True])
def test_colours_and_hover_read_out(qtbot, dark):
    apply_theme("dark" if dark else "light")
    widget = ExpertHeatMap()
    qtbot.addWidget(widget)
    background = "#0d1117" if dark else "#ffffff"
    widget.set_colors(dark, background, "#888888")
    widget.resize(320, 190)
    widget.set_map(_map())
    widget.show()
    qtbot.waitExposed(widget)
    image = widget.grab().toImage()
    grid = widget.grid_rect()
    w, h = grid.width() / 4, grid.height() / 2

    def color(row: int, col: int) -> QColor:
        return image.pixelColor(int(grid.left() + (col + 0.5) * w), int(grid.top() + (row + 0.5) * h))

    # The busiest expert has its tier's full colour; an unused one is mostly background.
    assert color(0, 0) == QColor(PLACE_COLORS[dark][PLACE_DEVICE])
    unused = color(0, 2)
    assert abs(unused.lightness() - QColor(background).lightness()) < 60
    ssd = color(1, 3)  # used, but only on the SSD: grey, not the device tier's green
    assert max(ssd.red(), ssd.green(), ssd.blue()) - min(ssd.red(), ssd.green(), ssd.blue()) < 40
    assert color(0, 1).red() > color(0, 1).blue() + 40  # in the RAM tier: amber
    # Hover: the read-out names the cell under the mouse.
    QTest.mouseMove(widget, QPoint(1, 1))  # from outside the cells (the cursor may already be on the target)
    QTest.mouseMove(widget, QPoint(int(grid.left() + 3.5 * w), int(grid.top() + 1.5 * h)))
    qtbot.waitUntil(lambda: widget.hover == (1, 3))
    assert widget.describe(1, 3) == "Layer blk.3 · expert 3\nSSD only · recent uses 4.0"
    assert widget.cell_at(QPointF(grid.left() + 1, grid.top() + 1)) == (0, 0)
    assert widget.describe(0, 0).startswith("Layer blk.1 · expert 0\nVRAM")
    assert widget.legend_width <= widget.width()  # the legend's text is not cut off
    assert widget.counts() == {PLACE_DEVICE: 2, PLACE_RAM: 1, PLACE_SSD: 5}
    # No map (experts held in memory): a sentence instead of cells.
    widget.set_map(None)
    assert isinstance(widget.grab(), QPixmap) and widget.grid_rect().isEmpty()
