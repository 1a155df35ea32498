"""Telemetry: consistent snapshots, atomic stats JSON, the periodic writer."""

from __future__ import annotations

import json
import threading
import time

from engine.runtime import Telemetry
from engine.runtime.telemetry import COUNTERS


def test_snapshot_is_a_plain_json_dict_with_every_counter():
    telemetry = Telemetry()
    telemetry.record_acquire(5, hits=3, misses=1)
    telemetry.add_many(pack_read_bytes=4096, read_seconds=0.5)
    telemetry.set(slot_count=10, direct_io=True)
    snap = telemetry.snapshot()
    assert set(COUNTERS) <= set(snap)
    assert snap["cache_hits"] == 3 and snap["cache_misses"] == 1 and snap["hit_rate"] == 0.75
    assert snap["layers"] == {"5": {"hits": 3, "misses": 1}}
    assert snap["slot_count"] == 10 and snap["direct_io"] is True
    assert json.loads(json.dumps(snap)) == snap


def test_counters_are_thread_safe():
    telemetry = Telemetry()

    def work():
        for _ in range(2000):
            telemetry.add("h2d_bytes", 2)
            telemetry.record_acquire(1, 1, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = telemetry.snapshot()
    assert snap["h2d_bytes"] == 16000 and snap["acquires"] == 8000 and snap["layers"]["1"]["hits"] == 8000


def test_write_stats_json_is_atomic(tmp_path):
    telemetry = Telemetry()
    telemetry.add("io_errors")
    path = tmp_path / "stats.json"
    telemetry.write_stats_json(path)
    telemetry.write_stats_json(path)
    assert json.loads(path.read_text())["io_errors"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temp file left behind


def test_periodic_writer_writes_and_stops(tmp_path):
    telemetry = Telemetry()
    path = tmp_path / "stats.json"
    writer = telemetry.start_writer(path, interval=0.02)
    deadline = time.time() + 5
    while writer.writes < 2 and time.time() < deadline:
        time.sleep(0.01)
    telemetry.add("cache_misses", 7)
    writer.stop()
    assert not writer.is_alive() and writer.writes >= 3
    assert json.loads(path.read_text())["cache_misses"] == 7  # stop() writes the final numbers
