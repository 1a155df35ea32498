"""The slot planner: the device tier's slot table, and which experts stay and which load.

The device tier is one buffer of `slot_count` whole-expert slots. `SlotPlanner` owns
its bookkeeping, never its bytes: which expert each slot holds and in what state
(EMPTY, LOADING, READY), the pins that protect a slot (a live batch, or a load in
progress), the free list, the replacement policy (policy.py), and the marks on
experts prefetched but not yet acquired (`prefetched`). It decides:

- for an acquire (`plan`): which requested experts are hits (pinned as they are),
  which unprotected experts are evicted to make room, and which misses load into
  which slot (reserved: pinned, LOADING), or that the request does not fit
  (CacheCapacityError);
- for a prefetch (`reserve_prefetch`): a slot, evicting only an expert that is
  neither protected nor an exact prefetch not yet used.

An evicted expert comes back as a "demotion" (key, slot index) for the load
pipeline to copy down into the host tier, unless it was a prefetch never used
(not worth RAM either). The
load pipeline fills reserved slots and reports through `publish` and `fail`.

All state is guarded by `cond`, the cache's one lock. Methods marked "under lock"
expect the caller to hold it; the others take it themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine import memory

from .errors import CacheCapacityError, RuntimeStartError
from .policy import ReplacementPolicy, make_policy, plan_acquire
from .telemetry import Telemetry
from .transfer import prune_done

if TYPE_CHECKING:
    from .store import ReadHandle

EMPTY, LOADING, READY = "empty", "loading", "ready"
MIB = 1 << 20
Key = tuple[int, int]  # (pack layer index, expert id)
# Evicted experts to copy down: (key, device slot index, the copy that filled the slot:
# the copy down waits for it; None on CPU).
Demotions = list[tuple[Key, int, "torch.cuda.Event | None"]]


class Slot:
    """One whole-expert slot of the device buffer and its state."""

    __slots__ = ("index", "key", "state", "pins", "ready_event", "use_events", "error", "host_source", "read")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: Key | None = None
        self.state = EMPTY
        self.pins = 0
        self.ready_event: torch.cuda.Event | None = None  # copy that filled it (CUDA)
        self.use_events: list = []  # compute that read it, queued when batches were released (CUDA)
        self.error: BaseException | None = None
        self.host_source: int | None = None  # host-tier slot taken for its planned load
        self.read: ReadHandle | None = None  # a prefetch's SSD read filling it: an acquire may hurry it


@dataclass
class AcquirePlan:
    """One acquire as `SlotPlanner.plan` reserved it."""

    slots: dict[int, Slot]  # expert -> slot, every requested expert (pinned)
    loads: list[tuple[Key, Slot]]  # the misses, each with its reserved (LOADING) slot
    hits: int
    evictions: int
    prefetch_hits: int  # hits on prefetched experts not acquired before
    wasted: int  # evicted prefetches never used
    demotions: Demotions


def size_device_tier(device: torch.device, stride: int, topk: int, cache_bytes: int, reserve_bytes: int) -> int:
    """`floor(min(cache_bytes, free device memory - reserve_bytes) / stride)` slots; raises
    RuntimeStartError, with the numbers and the fix, if that cannot hold `topk` experts."""
    free = memory.free_device_memory(device)
    usable = min(cache_bytes, free - reserve_bytes)
    slot_count = max(0, usable) // stride
    if slot_count >= topk:
        return slot_count
    need = topk * stride
    where = "VRAM" if device.type == "cuda" else "RAM"
    numbers = (
        f"usable = min(cache {cache_bytes / MIB:.0f} MiB, free {where} {free / MIB:.0f} MiB - reserve "
        f"{reserve_bytes / MIB:.0f} MiB) = {max(0, usable) / MIB:.0f} MiB, one expert is "
        f"{stride / MIB:.1f} MiB, so the cache holds {slot_count} experts but one MoE layer "
        f"uses {topk} at once ({need / MIB:.0f} MiB)"
    )
    if cache_bytes < need:
        fix = f"raise cache_vram_mib to at least {-(-need // MIB)}"
    else:
        fix = (f"free {-(-(need + reserve_bytes - free) // MIB)} MiB more {where} (close other programs "
               "using the GPU) or lower cache_vram_reserve_mib")
    raise RuntimeStartError(f"the expert cache on {device} is too small: {numbers}; {fix}")


class SlotPlanner:
    """The slot table of one device tier (see module docstring)."""

    def __init__(self, slot_count: int, policy: str, halflife: float | None, *, telemetry: Telemetry) -> None:
        self.slot_count = slot_count
        self.slots = [Slot(i) for i in range(slot_count)]
        self.free = list(range(slot_count - 1, -1, -1))
        self.where: dict[Key, Slot] = {}
        self.unpinned_resident = 0  # slots holding a key with no pins: the evictable ones
        self.pinned = 0  # slots with pins (protected, or loading)
        self.cond = threading.Condition(threading.Lock())
        self.policy: ReplacementPolicy = make_policy(policy, slot_count, halflife)
        self.prefetched: dict[Key, bool] = {}  # prefetched, not yet acquired -> exact?
        self.telemetry = telemetry

    # Planning (under lock) ---------------------------------------------------
    def plan(self, block: int, keys: Sequence[Key], prefetches_loading: Callable[[], int]) -> AcquirePlan:  # under lock
        """Reserve one acquire of the distinct `keys` of `block`: every one pinned, misses in
        reserved slots. Waits (releasing the lock) while it does not fit but prefetch loads
        hold slots; raises CacheCapacityError, nothing changed, if it does not fit."""
        while True:
            resident = [self.where.get(k) for k in keys]
            unpinned_hits = sum(1 for s in resident if s is not None and s.pins == 0)
            misses = sum(1 for s in resident if s is None)
            available = len(self.free) + self.unpinned_resident - unpinned_hits
            if misses <= available:
                break
            if prefetches_loading():  # prefetch loads hold slots only until their copy is queued
                self.cond.wait()
                continue
            most = self.slot_count - self.pinned
            raise CacheCapacityError(
                f"blk.{block}: {len(keys)} distinct experts requested ({misses} not cached) but only "
                f"{available} of {self.slot_count} cache slots can take a new expert now "
                f"({self.pinned} are protected by batches still in use); at most {most} per acquire. "
                "Use acquire_chunks() for prefill chunks, release other batches first, or raise cache_vram_mib",
                requested=len(keys), max_experts=most,
            )
        slots: dict[int, Slot] = {}
        for key, slot in zip(keys, resident):
            if slot is not None:
                self.pin(slot)
                slots[key[1]] = slot
        # The policy is generic over hashable keys; the ones it hands back (and to `protected`)
        # are the ones it was given: Keys.
        plan = plan_acquire(self.policy, keys, self.where.__contains__, len(self.free),
                            lambda k: self.where[k].pins > 0)  # type: ignore[index]
        hit_keys, miss_keys = cast("list[Key]", plan.hits), cast("list[Key]", plan.misses)
        prefetch_hits = sum(1 for k in hit_keys if self.prefetched.pop(k, None) is not None)
        wasted, demotions = self._evict(plan.victims)
        loads: list[tuple[Key, Slot]] = []
        for key in miss_keys:
            slot = slots[key[1]] = self._reserve(key)
            loads.append((key, slot))
        return AcquirePlan(slots, loads, len(plan.hits), len(plan.victims), prefetch_hits, wasted, demotions)

    def shrink(self, slot_count: int) -> tuple[list[Key], list[tuple[int, int]]]:  # under lock
        """Keep `slot_count` slots (at most the current count): evict the policy's victims
        until the residents fit, then move every resident above the new end into a free
        slot below it. Returns (evicted keys, moves (from slot, to slot)) for the caller
        to copy the bytes of the moves before it drops the slots above. Refuses (nothing
        changed) while any slot is pinned: shrink between replies, not during one."""
        if not 0 < slot_count <= self.slot_count:
            raise ValueError(f"shrink to {slot_count} slots: give 1 to {self.slot_count}")
        if self.pinned:
            raise RuntimeError(f"cannot shrink the expert cache while {self.pinned} slots are in use "
                               "(batches alive or loads in flight); release them first")
        evicted: list[Key] = []
        while len(self.where) - len(evicted) > slot_count:
            victim = self.policy.pop_victim(lambda k: False)
            if victim is None:
                break
            evicted.append(cast("Key", victim))  # its keys are Keys (see plan)
        self._evict(evicted)
        for key in evicted:
            self.prefetched.pop(key, None)
        low_free = sorted(i for i in self.free if i < slot_count)
        moves: list[tuple[int, int]] = []
        for slot in self.slots[slot_count:]:
            if slot.key is None:
                continue
            target = self.slots[low_free.pop(0)]
            target.key, target.state, target.error = slot.key, slot.state, None
            target.ready_event, target.use_events = slot.ready_event, slot.use_events
            self.where[slot.key] = target
            moves.append((slot.index, target.index))
            slot.key, slot.state = None, EMPTY
        self.slots = self.slots[:slot_count]
        self.free = low_free[::-1]
        self.slot_count = slot_count
        return evicted, moves

    def note_guess(self, layer_index: int, experts: Sequence[int]) -> None:
        """Hand a next-layer guess (likeliest first) to a policy that learns from guesses
        (`observe_guess`, the `router` policy); the others ignore it."""
        observe = getattr(self.policy, "observe_guess", None)
        if observe is not None:
            with self.cond:
                observe([(layer_index, e) for e in experts])

    def reserve_prefetch(self, key: Key, exact: bool) -> tuple[Slot, Demotions] | None:  # under lock
        """A reserved slot for a prefetch of `key` and the demotions its eviction needs, or
        None when every slot holds a protected expert or an exact prefetch not yet used."""
        demotions: Demotions = []
        if not self.free:
            # Evict only an unprotected expert, and never an exact prefetch not yet used.
            victim = self.policy.pop_victim(  # its keys are Keys (see acquire)
                lambda k: self.where[k].pins > 0 or self.prefetched.get(k, False))  # type: ignore[index, call-overload]
            if victim is None:
                return None
            wasted, demotions = self._evict([victim])
            self.telemetry.add_many(cache_evictions=1, prefetch_wasted=wasted)
        slot = self._reserve(key)
        self.policy.admit(key)  # ranked as used once, now; an acquire's access counts later
        self.prefetched[key] = exact
        return slot, demotions

    def _reserve(self, key: Key) -> Slot:  # under lock, with a free slot
        slot = self.slots[self.free.pop()]
        self.pin(slot)  # before it gets a key: a free slot was never counted as evictable
        slot.key, slot.state, slot.error, slot.ready_event = key, LOADING, None, None
        self.where[key] = slot
        return slot

    def _evict(self, victims: list) -> tuple[int, Demotions]:  # under lock
        """Free the victims' slots. Returns (how many were unused prefetches, the demotions).
        The demotions must be queued before any copy into those slots."""
        wasted = 0
        demotions: Demotions = []
        for victim in victims:
            slot = self.where.pop(victim)
            slot.key, slot.state = None, EMPTY
            self.unpinned_resident -= 1
            self.free.append(slot.index)
            if self.prefetched.pop(victim, None) is not None:
                wasted += 1  # a guess never used: not worth RAM either
            else:
                demotions.append((victim, slot.index, slot.ready_event))
        return wasted, demotions

    # Protection (under lock) -------------------------------------------------
    def pin(self, slot: Slot) -> None:  # under lock
        if slot.pins == 0:
            self.pinned += 1
            if slot.key is not None:
                self.unpinned_resident -= 1
        slot.pins += 1

    def unpin(self, slot: Slot) -> None:  # under lock
        slot.pins -= 1
        if slot.pins == 0:
            self.pinned -= 1
            if slot.key is not None:
                self.unpinned_resident += 1
            else:  # its load failed: the slot is free again
                slot.state = EMPTY
                self.free.append(slot.index)

    # Load outcomes and releases (take the lock) ------------------------------
    def release(self, slots: Iterable[Slot], use_event: torch.cuda.Event | None) -> None:
        """Unpin `slots` (a batch ends); `use_event`: the compute that read them, which a
        later copy into them must wait for (CUDA), or None."""
        with self.cond:
            for slot in slots:
                if use_event is not None:
                    slot.use_events = prune_done(slot.use_events) + [use_event]
                self.unpin(slot)
            self.cond.notify_all()

    def publish(self, slot: Slot, event: torch.cuda.Event | None) -> None:
        """The copy filling `slot` is queued (`event`: its completion, CUDA): it is READY."""
        with self.cond:
            slot.state, slot.ready_event = READY, event
            self.cond.notify_all()

    def fail(self, slot: Slot, error: BaseException) -> None:
        """The load of `slot` failed: forget its key (whoever pinned it unpins it)."""
        with self.cond:
            if slot.key is not None and self.where.get(slot.key) is slot:
                del self.where[slot.key]
                self.policy.remove(slot.key)
            slot.key, slot.state, slot.error = None, EMPTY, error
            self.cond.notify_all()
        self.telemetry.set(slots_used=self.resident_count())

    def wait_settled(self, slots: Iterable[Slot]) -> Slot | None:
        """Wait until none of `slots` (re-iterable) is LOADING, e.g. loaded by another
        acquire or a prefetch; the first that did not end READY, or None."""
        with self.cond:
            self.cond.wait_for(lambda: all(s.state != LOADING for s in slots))
            return next((s for s in slots if s.state != READY), None)

    def resident_count(self) -> int:
        with self.cond:
            return len(self.where)
