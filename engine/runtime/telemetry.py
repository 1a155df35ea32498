"""Expert-runtime counters: what the UI polls and what the stats JSON holds.

Reading the numbers (see docs/expert-pack-format.md and the runtime spec): a low hit
rate means the cache budget or the routing locality is too small; a high hit rate
with large `pack_read_bytes` means bursts beyond capacity; `fallback_count` and
`io_errors` are never swallowed, so a non-zero value always means something to act on.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

COUNTERS = (
    "acquires",          # acquire() calls that delivered a batch
    "cache_hits",        # unique (layer, expert) keys per acquire found in the device tier
    "cache_misses",      # ... not found there (loaded from the host tier or the SSD)
    "cache_evictions",   # device-tier slots given to another expert
    "host_hits",         # device misses served from the host-RAM tier
    "host_misses",       # device misses that went to the SSD (host tier on)
    "host_evictions",    # host-tier entries given to another expert
    "pack_read_bytes",   # bytes read from experts.bin
    "reads",             # expert blocks read from experts.bin
    "buffered_reads",    # ... of them through the page cache (direct_io=False, chosen explicitly)
    "read_seconds",      # summed time of the read system calls (all I/O threads)
    "drive_busy_seconds",  # time with at least one read in flight (busy / elapsed = drive utilisation)
    "h2d_bytes",         # bytes copied into the device tier
    "d2h_bytes",         # bytes copied down from the device tier to the host tier (evictions kept in RAM)
    "host_demotions",    # device-tier evictions copied down to the host tier
    "fallback_count",    # requested path not usable and another used instead (never silent; 0 by design)
    "io_errors",         # failed expert reads (EIO, short read, vanished drive); each raised to the caller
    "hash_mismatches",   # verify-on-read found bytes that differ from expert_hashes.bin
)


class Telemetry:
    """Thread-safe counters and gauges of one expert runtime."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._counters["read_seconds"] = 0.0
        self._counters["drive_busy_seconds"] = 0.0
        self._gauges: dict[str, Any] = {
            "direct_io": None,
            "read_splits": None,
            "slot_count": 0,
            "slots_used": 0,
            "host_bytes_used": 0,
            "host_bytes_budget": 0,
            "device": None,
        }
        self._layers: dict[int, list[int]] = {}
        self._started = time.time()

    def add(self, name: str, amount: float = 1) -> None:
        """Add `amount` to counter `name`."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + amount

    def add_many(self, **amounts: float) -> None:
        """Add several counters under one lock (a consistent snapshot never sees half of them)."""
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] = self._counters.get(name, 0) + amount

    def set(self, **gauges: Any) -> None:
        """Set gauges (current values, not sums): slot_count, slots_used, host_bytes_used, ..."""
        with self._lock:
            self._gauges.update(gauges)

    def record_acquire(self, block: int, hits: int, misses: int) -> None:
        """Count one acquire's unique-key hits and misses, in total and for its layer."""
        with self._lock:
            self._counters["acquires"] += 1
            self._counters["cache_hits"] += hits
            self._counters["cache_misses"] += misses
            per_layer = self._layers.setdefault(int(block), [0, 0])
            per_layer[0] += hits
            per_layer[1] += misses

    def get(self, name: str) -> Any:
        """Current value of one counter or gauge."""
        with self._lock:
            return self._counters[name] if name in self._counters else self._gauges[name]

    def snapshot(self) -> dict[str, Any]:
        """All numbers as a plain, JSON-serialisable dict (safe to call from any thread)."""
        with self._lock:
            data: dict[str, Any] = dict(self._counters)
            data.update(self._gauges)
            layers = {str(b): {"hits": h, "misses": m} for b, (h, m) in sorted(self._layers.items())}
        looked_up = data["cache_hits"] + data["cache_misses"]
        data["hit_rate"] = data["cache_hits"] / looked_up if looked_up else None
        data["read_gbps"] = data["pack_read_bytes"] / data["read_seconds"] / 1e9 if data["read_seconds"] else None
        data["layers"] = layers
        data["time"] = time.time()
        data["uptime_s"] = data["time"] - self._started
        return data

    def write_stats_json(self, path: str | os.PathLike) -> None:
        """Write `snapshot()` to `path` atomically (temp file + rename): a reader never sees half a file."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def start_writer(self, path: str | os.PathLike, interval: float = 2.0) -> StatsWriter:
        """Start a background thread writing the stats JSON every `interval` seconds."""
        writer = StatsWriter(self, path, interval)
        writer.start()
        return writer


class StatsWriter(threading.Thread):
    """Writes a Telemetry's stats JSON periodically until `stop()` (which writes once more)."""

    def __init__(self, telemetry: Telemetry, path: str | os.PathLike, interval: float) -> None:
        super().__init__(name="expert-stats-writer", daemon=True)
        if interval <= 0:
            raise ValueError(f"stats interval must be positive, got {interval}")
        self.telemetry = telemetry
        self.path = Path(path)
        self.interval = interval
        self.writes = 0
        self.last_error: OSError | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self._write()

    def _write(self) -> None:
        try:
            self.telemetry.write_stats_json(self.path)
            self.writes += 1
        except OSError as exc:  # a full disk must not kill generation; the error stays visible here
            self.last_error = exc

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and write the final numbers."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)
        self._write()
