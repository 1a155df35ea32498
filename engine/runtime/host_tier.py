"""The host-RAM expert tier: a bounded set of whole experts between the SSD and VRAM.

Sized from a byte budget and clamped so it never pushes the machine into swap
(available RAM minus a safety margin; the clamp is logged and shown in telemetry).

The tier is EXCLUSIVE of the device tier (a victim cache): an expert the device tier
evicts is copied down into it (`reserve` + a device-to-host copy + `publish`, on the
copy-down stream), and an
expert the device tier takes back from it leaves it (`take`). So VRAM and RAM never
hold the same expert twice and the two tiers together cache `device + host` bytes of
distinct experts; SSD reads go to staging buffers, never into this tier. Entries
being filled or copied from are pinned (never evicted); a copy into a slot whose last
copy out is still running waits for it, and a copy out waits for the copy in, on
the GPU (the host never waits for either: a host wait there cost a sync per
demotion).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

import torch

from engine import memory

from .policy import ReplacementPolicy, make_policy
from .staging import HostSlab
from .telemetry import Telemetry
from .transfer import prune_done

log = logging.getLogger(__name__)

Key = Hashable
LOADING, READY = "loading", "ready"


class _Entry:
    __slots__ = ("key", "state", "pins", "copy_events", "filled")

    def __init__(self) -> None:
        self.key: Key | None = None
        self.state = READY
        self.pins = 0
        self.copy_events: list = []  # copies out of the slot still running (CUDA)
        self.filled: torch.cuda.Event | None = None  # the copy down that filled it (CUDA)


def plan_host_budget(requested: int, slot_bytes: int) -> tuple[int, str | None]:
    """(budget actually used, message if it was clamped) for a requested host-tier size."""
    if requested <= 0:
        return 0, None
    limit = memory.available_ram() - memory.host_safety_margin()
    if requested <= limit:
        return requested, None
    granted = max(0, limit) // slot_bytes * slot_bytes
    mib = 1 << 20
    return granted, (
        f"host expert cache clamped from {requested / mib:.0f} MiB to {granted / mib:.0f} MiB: "
        f"only {memory.available_ram() / mib:.0f} MiB of RAM is available and "
        f"{memory.host_safety_margin() / mib:.0f} MiB is kept free so the system never swaps; "
        "close other programs or lower host_cache_mib to silence this"
    )


class HostTier:
    """Whole experts in (pinned, on CUDA) host memory; see module docstring."""

    def __init__(self, slot_bytes: int, budget_bytes: int, *, pinned: bool, telemetry: Telemetry,
                 policy: str = "hybrid", halflife: float | None = None) -> None:
        self.requested_bytes = int(budget_bytes)
        budget, self.clamp_message = plan_host_budget(int(budget_bytes), slot_bytes)
        if self.clamp_message:
            log.warning(self.clamp_message)
        self.slot_bytes = slot_bytes
        count = budget // slot_bytes
        self.budget_bytes = count * slot_bytes
        self.slab = HostSlab(count, slot_bytes, pinned=pinned, what="host-tier slot")
        self._entries = [_Entry() for _ in range(count)]
        self._where: dict[Key, int] = {}
        self._free = list(range(count - 1, -1, -1))
        self._policy: ReplacementPolicy = make_policy(policy, max(1, count), halflife)
        self._lock = threading.Lock()
        self.telemetry = telemetry
        telemetry.set(host_bytes_budget=self.budget_bytes, host_bytes_used=0,
                      host_bytes_requested=self.requested_bytes)

    @property
    def enabled(self) -> bool:
        return self.slab.count > 0

    @property
    def count(self) -> int:
        return self.slab.count

    def view(self, index: int) -> torch.Tensor:
        return self.slab.view(index)

    def used_bytes(self) -> int:
        with self._lock:
            return len(self._where) * self.slot_bytes

    def take(self, key: Key) -> int | None:
        """Slot of `key` if it is resident and filled, else None. The key leaves the tier
        (the device tier now holds it); the slot stays pinned until `unpin(index, event)`
        of the copy out of it, then it is free."""
        with self._lock:
            index = self._where.get(key)
            hit = index is not None and self._entries[index].state == READY
            if hit:
                assert index is not None  # hit implies it
                del self._where[key]
                self._policy.remove(key)
                entry = self._entries[index]
                entry.key, entry.pins = None, entry.pins + 1
            used = len(self._where) * self.slot_bytes
        self.telemetry.add("host_hits" if hit else "host_misses")
        if hit:
            self.telemetry.set(host_bytes_used=used)
        return index if hit else None

    def put_back(self, key: Key, index: int) -> None:
        """Undo `take(key)` (it returned `index`) before any copy out of the slot: the tier
        holds `key` again, as it did."""
        with self._lock:
            entry = self._entries[index]
            entry.key, entry.pins = key, entry.pins - 1
            self._where[key] = index
            self._policy.admit(key)
            used = len(self._where) * self.slot_bytes
        self.telemetry.set(host_bytes_used=used)

    def __contains__(self, key: Key) -> bool:
        """Whether `key` is resident and filled (a peek: no pin, no count)."""
        with self._lock:
            index = self._where.get(key)
            return index is not None and self._entries[index].state == READY

    def reserve(self, key: Key) -> tuple[int, list] | None:
        """A slot for `key`, to be filled by a copy down from the device tier (pinned,
        LOADING), and the copies out of that slot still running, which the copy down must
        queue behind (`DeviceCopier.copy(after=...)`: GPU-side, the host never waits);
        None if the tier is off, already holds `key`, or every slot is pinned."""
        if not self.enabled:
            return None
        with self._lock:
            if key in self._where:
                return None
            if self._free:
                index = self._free.pop()
            else:
                victim = self._policy.pop_victim(lambda k: self._entries[self._where[k]].pins > 0)
                if victim is None:
                    return None
                index = self._where.pop(victim)
                self.telemetry.add("host_evictions")
            entry = self._entries[index]
            entry.key, entry.state, entry.pins = key, LOADING, 1
            pending, entry.copy_events = entry.copy_events, []
            self._where[key] = index
            self._policy.access(key)
            self._policy.admit(key)
            used = len(self._where) * self.slot_bytes
        self.telemetry.set(host_bytes_used=used)
        return index, pending

    def publish(self, index: int, filled: torch.cuda.Event | None = None) -> None:
        """The copy into slot `index` is queued (`filled`: its completion, CUDA): later
        `take`s may copy out of it, once that event (`filled_by`)."""
        with self._lock:
            entry = self._entries[index]
            entry.state, entry.filled = READY, filled

    def filled_by(self, index: int) -> torch.cuda.Event | None:
        """The copy down that filled slot `index` (a copy out of it waits for it), or None."""
        with self._lock:
            return self._entries[index].filled

    def abort(self, index: int) -> None:
        """The copy into slot `index` failed: forget the key and free the slot."""
        with self._lock:
            entry = self._entries[index]
            if entry.key is not None and self._where.get(entry.key) == index:
                del self._where[entry.key]
                self._policy.remove(entry.key)
            entry.key, entry.state, entry.pins = None, READY, 0
            self._free.append(index)
            used = len(self._where) * self.slot_bytes
        self.telemetry.set(host_bytes_used=used)

    def unpin(self, index: int, copy_event: torch.cuda.Event | None = None) -> None:
        """The caller is done with slot `index`; `copy_event` = its copy, if still running.
        A slot whose key was taken is free once its last pin is gone."""
        with self._lock:
            entry = self._entries[index]
            entry.pins -= 1
            if copy_event is not None:
                entry.copy_events = prune_done(entry.copy_events) + [copy_event]
            if entry.pins == 0 and entry.key is None:
                self._free.append(index)

    def resident_keys(self) -> set[Key]:
        with self._lock:
            return {k for k, i in self._where.items() if self._entries[i].state == READY}
