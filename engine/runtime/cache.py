"""The tiered expert cache: VRAM slots <- host-RAM tier <- SSD (`ExpertStore`).

`ExpertCache.acquire(block, expert_ids)` implements `engine.experts.ExpertProvider`:
it returns a batch whose `batch[e]` maps role -> `QuantTensor` views into device
slots. Every requested expert is delivered, byte for byte what the pack holds;
nothing is skipped or substituted. Experts of a batch are protected from eviction
from the acquire until the batch is released (end of its `with` block), so several
batches (layers, threads) may be alive at once as long as their experts fit.

Device tier: one device buffer of `slot_count` whole-expert slots of `expert_stride`
bytes, `slot_count = floor(min(cache_bytes, free_device_memory - reserve_bytes) /
expert_stride)`. Start-up fails (RuntimeStartError) if that cannot hold one MoE
layer's top-k experts.

Requests larger than the free slots (prefill chunks): `acquire` refuses them with a
`CacheCapacityError` that names the maximum (`max_experts_per_acquire`), and
`acquire_chunks` delivers such a request as a sequence of batches that each fit,
experts already resident first. Per-expert outputs do not depend on each other, so
the caller computes each chunk's experts and sums the outputs in a fixed order
(expert id), which keeps the result independent of the chunking.

Ordering on CUDA (see transfer.py): copies run on a dedicated stream; the compute
stream waits on a slot's copy event before the batch is returned; releasing a batch
records an event on the compute stream that the copy stream waits on before it
overwrites any of the batch's slots.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

import torch

from packer.manifest import LayerEntry

from . import memory
from .errors import CacheCapacityError, ExpertReadError, RuntimeStartError
from .host_tier import HostTier
from .policy import ReplacementPolicy, make_policy, plan_acquire
from .store import ExpertStore, ReadHandle
from .telemetry import Telemetry
from .trace import AccessTrace
from .transfer import DeviceCopier, prune_done

if TYPE_CHECKING:
    from engine.experts import QuantTensor

EMPTY, LOADING, READY = "empty", "loading", "ready"
MIB = 1 << 20


class _Slot:
    """One whole-expert slot of the device buffer and its state."""

    __slots__ = ("index", "key", "state", "pins", "ready_event", "use_events", "error")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: tuple[int, int] | None = None
        self.state = EMPTY
        self.pins = 0
        self.ready_event: object | None = None  # copy that filled it (CUDA)
        self.use_events: list = []  # compute that read it, queued when batches were released (CUDA)
        self.error: BaseException | None = None


class CachedBatch:
    """The experts of one acquire. Use inside `with`; views are invalid after it exits."""

    def __init__(self, cache: ExpertCache, block: int, layer: LayerEntry, slots: dict[int, _Slot]) -> None:
        self._cache = cache
        self.block = block
        self._layer = layer
        self._slots = slots
        self._views: dict[int, dict[str, QuantTensor]] = {}
        self._released = False

    @property
    def expert_ids(self) -> tuple[int, ...]:
        """The distinct experts of this batch, in request order."""
        return tuple(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, expert: object) -> bool:
        return expert in self._slots

    def __getitem__(self, expert: int) -> dict[str, QuantTensor]:
        if self._released:
            raise RuntimeError(f"batch of blk.{self.block} used after it was released (outside its `with` block)")
        expert = int(expert)
        views = self._views.get(expert)
        if views is None:
            slot = self._slots.get(expert)
            if slot is None:
                raise KeyError(f"expert {expert} was not acquired in this batch of blk.{self.block} "
                               f"(it holds {list(self._slots)})")
            views = self._views[expert] = self._cache._views(slot, self._layer)
        return views

    def release(self) -> None:
        """Unprotect this batch's experts (idempotent). `with` calls it on exit."""
        if not self._released:
            self._released = True
            self._views.clear()
            self._cache._release(list(self._slots.values()))

    def __enter__(self) -> CachedBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ExpertCache:
    """Tiered expert cache over an `ExpertStore` (see module docstring).

    `device`: where the slots live ("cuda", "cuda:1", "cpu"). `cache_bytes`: the
    device-tier budget; `reserve_bytes`: device memory always left free. `host_cache_bytes`:
    the host-RAM tier (0 = off), clamped to available RAM minus a safety margin.
    `policy`: "hybrid" (default), "lfu" or "lru"; `halflife` overrides the hybrid's decay.
    `trace`: an AccessTrace to record every acquire into. `max_inflight`: expert reads in
    flight per acquire (default: the store's staging buffers).
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        device: str | torch.device = "cpu",
        cache_bytes: int,
        reserve_bytes: int = 2 * memory.GIB,
        host_cache_bytes: int = 0,
        policy: str = "hybrid",
        halflife: float | None = None,
        trace: AccessTrace | None = None,
        telemetry: Telemetry | None = None,
        max_inflight: int | None = None,
    ) -> None:
        self.store = store
        self.manifest = store.manifest
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.telemetry = telemetry if telemetry is not None else store.telemetry
        self.trace = trace
        self.stride = self.manifest.expert_stride
        self.slot_count = self._size_device_tier(int(cache_bytes), int(reserve_bytes))
        self.buffer = torch.empty(self.slot_count * self.stride, dtype=torch.uint8, device=self.device)
        self._slots = [_Slot(i) for i in range(self.slot_count)]
        self._free = list(range(self.slot_count - 1, -1, -1))
        self._where: dict[tuple[int, int], _Slot] = {}
        self._unpinned_resident = 0  # slots holding a key with no pins: the evictable ones
        self._pinned = 0  # slots with pins (protected, or loading)
        self._cond = threading.Condition(threading.Lock())
        self._policy: ReplacementPolicy = make_policy(policy, self.slot_count, halflife)
        self._copier = DeviceCopier(self.device)
        self.max_inflight = max(1, max_inflight if max_inflight is not None else store.staging.count)
        self.host = HostTier(self.stride, int(host_cache_bytes), pinned=store.staging.slab.pinned,
                             telemetry=self.telemetry, policy=policy)
        self.telemetry.set(slot_count=self.slot_count, slots_used=0, device=str(self.device),
                           cache_bytes=self.slot_count * self.stride)

    # Sizing -----------------------------------------------------------------
    def _size_device_tier(self, cache_bytes: int, reserve_bytes: int) -> int:
        free = memory.free_device_memory(self.device)
        usable = min(cache_bytes, free - reserve_bytes)
        slot_count = max(0, usable) // self.stride
        topk = self.manifest.expert_used_count
        if slot_count >= topk:
            return slot_count
        need = topk * self.stride
        where = "VRAM" if self.device.type == "cuda" else "RAM"
        numbers = (
            f"usable = min(cache {cache_bytes / MIB:.0f} MiB, free {where} {free / MIB:.0f} MiB - reserve "
            f"{reserve_bytes / MIB:.0f} MiB) = {max(0, usable) / MIB:.0f} MiB, one expert is "
            f"{self.stride / MIB:.1f} MiB, so the cache holds {slot_count} experts but one MoE layer "
            f"uses {topk} at once ({need / MIB:.0f} MiB)"
        )
        if cache_bytes < need:
            fix = f"raise cache_vram_mib to at least {-(-need // MIB)}"
        else:
            fix = (f"free {-(-(need + reserve_bytes - free) // MIB)} MiB more {where} (close other programs "
                   "using the GPU) or lower cache_vram_reserve_mib")
        raise RuntimeStartError(f"the expert cache on {self.device} is too small: {numbers}; {fix}")

    # Public API -----------------------------------------------------------------
    @property
    def max_experts_per_acquire(self) -> int:
        """Distinct experts one acquire can take right now: slots not protected by live batches."""
        with self._cond:
            return self.slot_count - self._pinned

    def acquire(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> CachedBatch:
        """Deliver experts `expert_ids` of model block `block` (blk.N); use the batch in `with`.

        Duplicates are fine. Raises CacheCapacityError (nothing changed) if the distinct
        experts that are not resident exceed the unprotected slots; use `acquire_chunks`
        for such requests. Raises ExpertReadError if a read failed; experts loaded before
        the failure stay cached and the cache stays usable.
        """
        layer_index, layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        keys = [(layer_index, e) for e in experts]
        slots: dict[int, _Slot] = {}
        loads: list[tuple[tuple[int, int], _Slot]] = []
        with self._cond:
            resident = [self._where.get(k) for k in keys]
            unpinned_hits = sum(1 for s in resident if s is not None and s.pins == 0)
            misses = sum(1 for s in resident if s is None)
            available = len(self._free) + self._unpinned_resident - unpinned_hits
            if misses > available:
                most = self.slot_count - self._pinned
                raise CacheCapacityError(
                    f"blk.{block}: {len(keys)} distinct experts requested ({misses} not cached) but only "
                    f"{available} of {self.slot_count} cache slots can take a new expert now "
                    f"({self._pinned} are protected by batches still in use); at most {most} per acquire. "
                    "Use acquire_chunks() for prefill chunks, release other batches first, or raise cache_vram_mib",
                    requested=len(keys), max_experts=most,
                )
            for key, slot in zip(keys, resident):
                if slot is not None:
                    self._pin(slot)
                    slots[key[1]] = slot
            plan = plan_acquire(self._policy, keys, self._where.__contains__, len(self._free),
                                lambda k: self._where[k].pins > 0)
            for victim in plan.victims:
                slot = self._where.pop(victim)
                slot.key, slot.state = None, EMPTY
                self._unpinned_resident -= 1
                self._free.append(slot.index)
            for key in plan.misses:
                slot = self._slots[self._free.pop()]
                self._pin(slot)  # before it gets a key: a free slot was never counted as evictable
                slot.key, slot.state, slot.error, slot.ready_event = key, LOADING, None, None
                self._where[key] = slot
                slots[key[1]] = slot
                loads.append((key, slot))
            used = len(self._where)
        self.telemetry.add("cache_evictions", len(plan.victims))
        self.telemetry.record_acquire(block, len(plan.hits), len(plan.misses))
        self.telemetry.set(slots_used=used)
        if self.trace is not None:
            self.trace.record(block, experts)
        # Keep request order for the batch.
        ordered = {e: slots[e] for e in experts}
        try:
            error = self._load(layer_index, layer, loads) if loads else None
            with self._cond:  # experts another acquire is loading right now
                self._cond.wait_for(lambda: all(s.state != LOADING for s in ordered.values()))
                failed = next((s for s in ordered.values() if s.state != READY), None)
            if error is None and failed is not None:
                error = ExpertReadError(
                    f"expert of blk.{block} could not be loaded by a concurrent acquire: {failed.error}",
                    block=block, layer_index=layer_index, cause=failed.error,
                )
            if error is not None:
                raise error
        except BaseException:
            self._release(list(ordered.values()), record=False)
            raise
        self._copier.compute_waits_for(s.ready_event for s in ordered.values())
        return CachedBatch(self, block, layer, ordered)

    def acquire_chunks(
        self, block: int, expert_ids: Sequence[int] | torch.Tensor, max_per_chunk: int | None = None
    ) -> Iterator[CachedBatch]:
        """Deliver any number of experts as consecutive batches that each fit the cache.

        Each batch is released when the next one is requested (or the loop ends), so use
        it inside the loop body: `for batch in cache.acquire_chunks(b, ids): with batch: ...`.
        Experts already resident come first (they cost no read and a later chunk must
        not evict them before use). Every distinct expert is delivered exactly once.
        """
        if max_per_chunk is not None and max_per_chunk < 1:
            raise ValueError(f"max_per_chunk must be at least 1, got {max_per_chunk}")
        layer_index, _layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        with self._cond:
            experts.sort(key=lambda e: (layer_index, e) not in self._where)  # stable: resident first
        start = 0
        while start < len(experts):
            room = self.max_experts_per_acquire
            if max_per_chunk is not None:
                room = min(room, max_per_chunk)
            while True:
                if room < 1:
                    raise CacheCapacityError(
                        f"blk.{block}: no cache slot is free of protected experts; release other batches "
                        "before acquiring more, or raise cache_vram_mib",
                        requested=len(experts) - start, max_experts=0,
                    )
                try:
                    batch = self.acquire(block, experts[start : start + room])
                    break
                except CacheCapacityError as exc:  # another thread took slots meanwhile
                    room = min(room - 1, exc.max_experts)
            try:
                yield batch
            finally:
                batch.release()
            start += len(batch)

    def slot_of(self, block: int, expert: int) -> int | None:
        """Device slot holding (block, expert) if it is loaded, else None (tests, diagnostics)."""
        key = (self.manifest.layer_index(block), int(expert))
        with self._cond:
            slot = self._where.get(key)
            return slot.index if slot is not None and slot.state == READY else None

    def resident_count(self) -> int:
        with self._cond:
            return len(self._where)

    def close(self) -> None:
        """Drop the device buffer (the store is closed by its owner)."""
        if self._copier.is_cuda:
            torch.cuda.synchronize(self.device)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    # Internals --------------------------------------------------------------
    def _layer(self, block: int) -> tuple[int, LayerEntry]:
        index = self.manifest.layer_index(int(block))
        return index, self.manifest.layers[index]

    def _unique_ids(self, expert_ids: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(expert_ids, torch.Tensor):
            expert_ids = expert_ids.flatten().tolist()  # one device sync, not one per id
        experts = list(dict.fromkeys(int(e) for e in expert_ids))
        n = self.manifest.num_experts
        bad = [e for e in experts if not 0 <= e < n]
        if bad:
            raise IndexError(f"expert ids {bad} out of range 0..{n - 1}")
        return experts

    def _pin(self, slot: _Slot) -> None:  # under lock
        if slot.pins == 0:
            self._pinned += 1
            if slot.key is not None:
                self._unpinned_resident -= 1
        slot.pins += 1

    def _unpin(self, slot: _Slot) -> None:  # under lock
        slot.pins -= 1
        if slot.pins == 0:
            self._pinned -= 1
            if slot.key is not None:
                self._unpinned_resident += 1
            else:  # its load failed: the slot is free again
                slot.state = EMPTY
                self._free.append(slot.index)

    def _release(self, slots: list[_Slot], record: bool = True) -> None:
        event = self._copier.record_use() if record else None
        with self._cond:
            for slot in slots:
                if event is not None:
                    slot.use_events = prune_done(slot.use_events) + [event]
                self._unpin(slot)
            self._cond.notify_all()

    def _views(self, slot: _Slot, layer: LayerEntry) -> dict[str, QuantTensor]:
        # Imported here: engine.experts loads the quant kernels, which the store, the
        # policy tools and the benchmark's I/O part do not need.
        from engine.experts import QuantTensor

        base = slot.index * self.stride
        return {
            role.name: QuantTensor(self.buffer[base + role.offset : base + role.end], role.ggml_type, role.shape)
            for role in layer.roles
        }

    def _copy_into(self, slot: _Slot, src: torch.Tensor) -> object | None:
        base = slot.index * self.stride
        dst = self.buffer[base : base + src.numel()]
        with self._cond:
            after, slot.use_events = slot.use_events, []
        event = self._copier.copy(dst, src, after)
        self.telemetry.add("h2d_bytes", src.numel())
        return event

    def _publish(self, slot: _Slot, event: object | None) -> None:
        with self._cond:
            slot.state, slot.ready_event = READY, event
            self._cond.notify_all()

    def _fail(self, slot: _Slot, error: BaseException) -> None:
        """The load of `slot` failed: forget its key (the acquire's cleanup unpins it)."""
        with self._cond:
            if slot.key is not None and self._where.get(slot.key) is slot:
                del self._where[slot.key]
                self._policy.remove(slot.key)
            slot.key, slot.state, slot.error = None, EMPTY, error
            self._cond.notify_all()
        self.telemetry.set(slots_used=self.resident_count())

    def _load(self, layer_index: int, layer: LayerEntry, loads: list[tuple[tuple[int, int], _Slot]]) -> ExpertReadError | None:
        """Fill the slots of `loads` from the host tier or the SSD; the first read error, if any.

        Reads go straight into a host-tier slot when the tier has room (admission
        without a copy), else into a staging buffer. Up to `max_inflight` reads are in
        flight; each finished read is copied to its slot at once, in completion order.
        """
        nbytes = layer.read_nbytes
        staging = self.store.staging
        inflight: dict[Future, tuple[_Slot, ReadHandle, tuple[str, int]]] = {}
        done_slots: set[int] = set()
        first_error: ExpertReadError | None = None
        current: tuple[str, int] | None = None  # a buffer taken but not yet in flight

        def finish_some() -> None:
            nonlocal first_error
            finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for future in finished:
                slot, handle, buffer = inflight.pop(future)
                try:
                    src = handle.result()
                except ExpertReadError as exc:
                    self._give_back(buffer, None, ok=False)
                    self._fail(slot, exc)
                    done_slots.add(slot.index)
                    first_error = first_error or exc
                    continue
                try:
                    event = self._copy_into(slot, src)
                except BaseException:
                    self._give_back(buffer, None, ok=False)
                    raise
                self._give_back(buffer, event, ok=True)
                self._publish(slot, event)
                done_slots.add(slot.index)

        try:
            for key, slot in loads:
                if first_error is not None:
                    break
                host_index = self.host.lookup(key) if self.host.enabled else None
                if host_index is not None:
                    try:
                        event = self._copy_into(slot, self.host.view(host_index)[:nbytes])
                    except BaseException:
                        self.host.unpin(host_index, None)
                        raise
                    self.host.unpin(host_index, event)
                    self._publish(slot, event)
                    done_slots.add(slot.index)
                    continue
                host_index = self.host.reserve(key) if self.host.enabled else None
                if host_index is not None:
                    current = ("host", host_index)
                    target = self.host.view(host_index)
                else:
                    stage = staging.try_take()
                    while stage is None:  # finish our own reads first: they free buffers without help
                        if inflight:
                            finish_some()
                            stage = staging.try_take()
                        else:
                            stage = staging.take()
                    current = ("stage", stage)
                    target = staging.view(stage)
                handle = self.store.submit(layer_index, key[1], target)
                inflight[handle.future] = (slot, handle, current)
                current = None
                while len(inflight) >= self.max_inflight:
                    finish_some()
            while inflight:
                finish_some()
        except BaseException as exc:
            # Reads still in flight write into their buffers: wait before giving any back.
            wait(list(inflight))
            for slot, _handle, buffer in inflight.values():
                self._give_back(buffer, None, ok=False)
            inflight.clear()
            if current is not None:
                self._give_back(current, None, ok=False)
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self._fail(slot, exc)
            raise
        if first_error is not None:
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self._fail(slot, ExpertReadError(
                        f"not loaded because an earlier read of this acquire failed: {first_error}",
                        layer_index=layer_index, cause=first_error))
        return first_error

    def _give_back(self, buffer: tuple[str, int], event: object | None, *, ok: bool) -> None:
        kind, index = buffer
        if kind == "stage":
            self.store.staging.give(index, after=event)
        elif ok:
            self.host.publish(index)
            self.host.unpin(index, event)
        else:
            self.host.abort(index)
