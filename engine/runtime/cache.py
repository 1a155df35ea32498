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

Speed levers (each lossless; see benchmarks/bench_decode.py for what each buys):
- Deep I/O queue: an acquire's SSD reads are all submitted before its host-tier copies,
  up to `max_inflight` experts x `read_splits` sub-reads in flight, and each expert's
  H2D copy is queued the moment its read lands (`pipeline_h2d=True`, the default;
  `pipeline_h2d=False` reproduces the seed design: copy only after every read of the
  acquire has landed).
- `acquire_streaming(block, ids)`: the same experts as `acquire`, handed out one by one
  as each becomes usable (resident ones first, then each miss as its copy is queued),
  so the caller computes resident experts while misses are still loading. The caller
  keeps each expert's output and sums them in a FIXED order (e.g. ascending id) after
  the loop: per-expert outputs do not depend on arrival order, so the sum is
  bit-identical to the one after a plain `acquire`.
- Exclusive tiers: an expert the device tier evicts is copied down into the host-RAM
  tier (when it has one) and one found there moves back up, so VRAM and RAM together
  cache `slot_count + host slots` distinct experts (host_tier.py). The copy down is
  queued on the copy stream before the load that overwrites its slot.
- `prefetch(block, ids, exact=...)`: start loading experts of a coming acquire of
  `block` without protecting them. Reads go only into spare queue depth (exact
  prefetches: while fewer than `prefetch_depth` expert reads are in flight;
  speculative ones, `exact=False`: only the likeliest `speculative_reads` of each guess,
  only once every read of the acquires planned so far has been issued, and with
  `speculative="idle"` (default) only while none is in flight, i.e. idle bandwidth;
  the rest only from the host tier), never evict a protected expert (nor an exact
  prefetch not yet used), and a prefetch not yet started is dropped once `block` is
  acquired (it was for that acquire). An acquire that finds a prefetched expert counts it as a hit; one
  still loading is waited for. Counters: prefetch_issued, prefetch_hits (used),
  prefetch_wasted (evicted unused), prefetch_dropped (never started).
"""

from __future__ import annotations

import threading
from collections import deque
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

    __slots__ = ("index", "key", "state", "pins", "ready_event", "use_events", "error", "host_source")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: tuple[int, int] | None = None
        self.state = EMPTY
        self.pins = 0
        self.ready_event: object | None = None  # copy that filled it (CUDA)
        self.use_events: list = []  # compute that read it, queued when batches were released (CUDA)
        self.error: BaseException | None = None
        self.host_source: int | None = None  # host-tier slot taken for its planned load


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


class StreamingBatch(CachedBatch):
    """The experts of one `acquire_streaming`: iterate (once) to get `(expert, weights)`
    pairs as each becomes usable; `batch[e]` works for experts already yielded. Use in
    `with`; releasing it before the iteration ended stops the loads cleanly."""

    def __init__(self, cache: ExpertCache, block: int, layer: LayerEntry, slots: dict[int, _Slot],
                 layer_index: int, loads: list) -> None:
        super().__init__(cache, block, layer, slots)
        self._layer_index = layer_index
        self._loads = loads
        self._delivered: set[int] = set()
        self._iterator: Iterator | None = None
        self._loads_started = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, QuantTensor]]]:
        if self._iterator is not None:
            raise RuntimeError(f"a streaming batch of blk.{self.block} can be iterated only once")
        if self._released:
            raise RuntimeError(f"batch of blk.{self.block} used after it was released (outside its `with` block)")
        self._iterator = self._cache._stream(self)
        return self._iterator

    def __getitem__(self, expert: int) -> dict[str, QuantTensor]:
        expert = int(expert)
        if expert in self._slots and expert not in self._delivered:
            raise KeyError(f"expert {expert} of blk.{self.block} has not been delivered yet: "
                           "use it when the streaming loop yields it")
        return super().__getitem__(expert)

    def release(self) -> None:
        if self._released:
            return
        if self._iterator is not None:
            self._iterator.close()  # stops our loads cleanly: reads in flight end first
        if not self._loads_started:  # its loads never started: give their slots back unfilled
            with self._cache._cond:
                self._cache._demand_pending -= len(self._loads)
            for _key, slot in self._loads:
                self._cache._drop_host_source(slot)
                self._cache._fail(slot, RuntimeError("released before its streaming loop started"))
        super().release()


class ExpertCache:
    """Tiered expert cache over an `ExpertStore` (see module docstring).

    `device`: where the slots live ("cuda", "cuda:1", "cpu"). `cache_bytes`: the
    device-tier budget; `reserve_bytes`: device memory always left free. `host_cache_bytes`:
    the host-RAM tier (0 = off), clamped to available RAM minus a safety margin.
    `policy`: "hybrid" (default), "lfu" or "lru"; `halflife` overrides the hybrid's decay.
    `trace`: an AccessTrace to record every acquire into. `max_inflight`: expert reads in
    flight per acquire (default: the store's staging buffers). `pipeline_h2d`: copy each
    expert to the device as soon as its read lands (default) or, False, only after all
    reads of the acquire landed (the seed design, kept as a baseline). `prefetch_depth`:
    prefetch reads start only while fewer expert reads than this are in flight (default
    `max_inflight`); `prefetch_limit`: at most this many prefetched experts may wait
    unused in the device tier (default a quarter of the slots, at least top-k).
    `speculative`: when guesses (`prefetch(..., exact=False)`) may read the SSD: "idle"
    (default: while no acquire read is pending or in flight), "tail" (once every acquire
    read has been submitted, into the queue depth the acquires leave free) or "ram"
    (never). `speculative_reads`: only the first this many experts of each guess
    (callers list the likeliest first) may read the SSD (default 2; None: all). Guesses
    the host tier holds are copied up whenever a prefetch may start, in every mode:
    they cost no drive time. Why 2 (benchmarks/RESULTS.md): decode is drive-bound and a
    wrong guess read from the SSD costs a whole expert of drive time; the next layer's
    router on the current hidden state ranks its top pick right 97% of the time and its
    second 89%, its sixth only 49%. Reading all six made decode slower than reading
    none; reading the best two filled the drive's idle time between layers (busy 80% ->
    91%) for 14% more tokens/s than the seed design.
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
        pipeline_h2d: bool = True,
        prefetch_depth: int | None = None,
        prefetch_limit: int | None = None,
        speculative: str = "idle",
        speculative_reads: int | None = 2,
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
        self.pipeline_h2d = bool(pipeline_h2d)
        if speculative not in ("idle", "tail", "ram"):
            raise ValueError(f"speculative must be 'idle', 'tail' or 'ram', got {speculative!r}")
        self.speculative = speculative
        self.speculative_reads = None if speculative_reads is None else max(0, int(speculative_reads))
        # Prefetch state (all under self._cond).
        topk = self.manifest.expert_used_count
        self.prefetch_depth = max(1, int(prefetch_depth) if prefetch_depth is not None else self.max_inflight)
        self.prefetch_limit = max(1, int(prefetch_limit) if prefetch_limit is not None
                                  else max(topk, self.slot_count // 4))
        self._intents: deque = deque()  # (key, may read the SSD, generation of its layer) not started yet
        self._exact_intents: deque = deque()
        self._generation = [0] * self.manifest.num_layers  # acquires of each pack layer so far
        self._pf_unused: dict[tuple[int, int], bool] = {}  # prefetched, not yet acquired -> exact?
        self._pf_loading = 0  # prefetch loads in progress (each pins its slot)
        self._demand_pending = 0  # planned acquire loads not yet submitted (or copied from RAM)
        self._demand_reads = 0  # acquire reads in flight
        self._reads_inflight = 0  # expert reads in flight (acquires + prefetches)
        self._pumping = False
        self._pump_again = False
        self._closed = False
        self.last_prefetch_error: BaseException | None = None
        self.telemetry.set(slot_count=self.slot_count, slots_used=0, device=str(self.device),
                           cache_bytes=self.slot_count * self.stride)
        for name in ("prefetch_issued", "prefetch_hits", "prefetch_wasted", "prefetch_dropped", "prefetch_errors"):
            self.telemetry.add(name, 0)

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
        layer_index, layer, ordered, loads = self._plan(block, expert_ids)
        try:
            error = self._load(layer_index, layer, loads) if loads else None
            with self._cond:  # experts another acquire (or a prefetch) is loading right now
                self._cond.wait_for(lambda: all(s.state != LOADING for s in ordered.values()))
                failed = next((s for s in ordered.values() if s.state != READY), None)
            if error is None and failed is not None:
                error = self._concurrent_error(block, layer_index, failed)
            if error is not None:
                raise error
        except BaseException:
            self._release(list(ordered.values()), record=False)
            raise
        finally:
            self._pump()
        self._copier.compute_waits_for(s.ready_event for s in ordered.values())
        return CachedBatch(self, block, layer, ordered)

    def acquire_streaming(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> StreamingBatch:
        """Like `acquire`, but hands the experts out as each becomes usable.

            outputs = {}
            with cache.acquire_streaming(block, ids) as batch:
                for expert, weights in batch:          # resident ones first, then each miss
                    outputs[expert] = mlp(weights, x)  # as soon as its copy is queued
            y = sum of outputs in ascending expert order  # FIXED order: bit-identical to acquire

        Planning, protection and hit/miss counting are those of `acquire` (done here, at
        the call); the reads start when iteration starts. `batch[e]` is valid for experts
        already yielded. A read error is raised from the loop after the other experts
        were delivered or settled.
        """
        layer_index, layer, ordered, loads = self._plan(block, expert_ids)
        return StreamingBatch(self, block, layer, ordered, layer_index, loads)

    def prefetch(self, block: int, expert_ids: Sequence[int] | torch.Tensor, *, exact: bool = True) -> int:
        """Start loading experts of the next acquire of `block` that are not in the device
        tier; returns at once with how many were queued (0 if all are resident or loading).

        Nothing is protected: a prefetched expert is an ordinary cached one once loaded.
        `exact=True` is for experts known to be needed (DeepSeek-V4's hash layers, whose
        experts follow from the sampled token); `exact=False` for guesses (the next
        layer's router on the current hidden state), which read only into idle
        bandwidth. A prefetch never evicts a protected expert; one not started by the
        time `block` is acquired is dropped. Lossless by construction: it only changes
        when bytes arrive, never which bytes an acquire delivers.

        Guesses are listed likeliest first: with `speculative_reads` only the first ones
        may read the SSD.

        Where to call it: exact ones as soon as the ids are known (hash layers: right
        after the token is sampled). Guesses for layer l+1 right AFTER the acquire of
        layer l returned (`acquire_streaming`: before iterating it): guesses wait only
        for reads already planned, so one queued before that acquire would start at
        once and compete with its reads.
        """
        layer_index, _layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        queued = 0
        with self._cond:
            if self._closed:
                return 0
            generation = self._generation[layer_index]
            queue = self._exact_intents if exact else self._intents
            reads = len(experts) if exact or self.speculative_reads is None else self.speculative_reads
            for rank, e in enumerate(experts):
                key = (layer_index, e)
                if key in self._where:
                    continue
                queue.append((key, rank < reads, generation))
                queued += 1
            while len(queue) > 4 * self.slot_count:  # bounded: the oldest intents are stalest
                queue.popleft()
                self.telemetry.add("prefetch_dropped")
        if queued:
            self._pump()
        return queued

    def drain_prefetches(self, timeout: float | None = None) -> bool:
        """Drop prefetches not started and wait for those in flight (tests, shutdown)."""
        with self._cond:
            dropped = len(self._intents) + len(self._exact_intents)
            self._intents.clear()
            self._exact_intents.clear()
            done = self._cond.wait_for(lambda: self._pf_loading == 0, timeout)
        self.telemetry.add("prefetch_dropped", dropped)
        return done

    def _plan(self, block: int, expert_ids: Sequence[int] | torch.Tensor
              ) -> tuple[int, LayerEntry, dict[int, _Slot], list[tuple[tuple[int, int], _Slot]]]:
        """Decide and reserve one acquire: every requested slot pinned, misses marked LOADING.

        Returns (layer index, layer, expert -> slot in request order, the loads to do).
        """
        layer_index, layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        keys = [(layer_index, e) for e in experts]
        slots: dict[int, _Slot] = {}
        with self._cond:
            while True:
                resident = [self._where.get(k) for k in keys]
                unpinned_hits = sum(1 for s in resident if s is not None and s.pins == 0)
                misses = sum(1 for s in resident if s is None)
                available = len(self._free) + self._unpinned_resident - unpinned_hits
                if misses <= available:
                    break
                if self._pf_loading:  # prefetch loads hold slots only until their copy is queued
                    self._cond.wait()
                    continue
                most = self.slot_count - self._pinned
                raise CacheCapacityError(
                    f"blk.{block}: {len(keys)} distinct experts requested ({misses} not cached) but only "
                    f"{available} of {self.slot_count} cache slots can take a new expert now "
                    f"({self._pinned} are protected by batches still in use); at most {most} per acquire. "
                    "Use acquire_chunks() for prefill chunks, release other batches first, or raise cache_vram_mib",
                    requested=len(keys), max_experts=most,
                )
            self._generation[layer_index] += 1  # prefetches for this block not started are now stale
            for key, slot in zip(keys, resident):
                if slot is not None:
                    self._pin(slot)
                    slots[key[1]] = slot
            plan = plan_acquire(self._policy, keys, self._where.__contains__, len(self._free),
                                lambda k: self._where[k].pins > 0)
            prefetch_hits = sum(1 for k in plan.hits if self._pf_unused.pop(k, None) is not None)
            wasted, demotions = self._evict(plan.victims)
            loads: list[tuple[tuple[int, int], _Slot]] = []
            for key in plan.misses:
                slot = self._slots[self._free.pop()]
                self._pin(slot)  # before it gets a key: a free slot was never counted as evictable
                slot.key, slot.state, slot.error, slot.ready_event = key, LOADING, None, None
                self._where[key] = slot
                slots[key[1]] = slot
                loads.append((key, slot))
            self._demand_pending += len(loads)  # speculative prefetches hold back until these are issued
            used = len(self._where)
        taken = self._take_then_demote([key for key, _slot in loads], demotions)
        for (_key, slot), host_index in zip(loads, taken):
            slot.host_source = host_index
        self.telemetry.add_many(cache_evictions=len(plan.victims), prefetch_hits=prefetch_hits,
                                prefetch_wasted=wasted)
        self.telemetry.record_acquire(block, len(plan.hits), len(plan.misses))
        self.telemetry.set(slots_used=used)
        if self.trace is not None:
            self.trace.record(block, experts)
        # Keep request order for the batch.
        return layer_index, layer, {e: slots[e] for e in experts}, loads

    def _evict(self, victims: list) -> tuple[int, list[tuple[tuple[int, int], int]]]:  # under lock
        """Free the victims' slots. Returns (how many were unused prefetches, the (key, slot
        index) pairs to copy down to the host tier). The caller must pass the latter to
        `_demote` before it queues any copy into those slots."""
        wasted = 0
        demotions = []
        for victim in victims:
            slot = self._where.pop(victim)
            slot.key, slot.state = None, EMPTY
            self._unpinned_resident -= 1
            self._free.append(slot.index)
            if self._pf_unused.pop(victim, None) is not None:
                wasted += 1  # a guess never used: not worth RAM either
            elif self.host.enabled:
                demotions.append((victim, slot.index))
        return wasted, demotions

    def _drop_host_source(self, slot: _Slot) -> None:
        """A planned load that will not run gives back the host-tier slot it took."""
        host_index, slot.host_source = slot.host_source, None
        if host_index is not None:
            self.host.unpin(host_index, None)

    def _take_then_demote(self, keys: list[tuple[int, int]], demotions: list[tuple[tuple[int, int], int]]
                          ) -> list[int | None]:
        """For the loads of `keys` (slots just reserved, their victims in `demotions`): take
        their RAM copies (host slot per key, or None), THEN copy the victims down. In that
        order, a demotion that needs a RAM slot cannot evict an expert about to move up;
        and both happen before any load is queued into the victims' slots."""
        taken = [self.host.take(key) if self.host.enabled else None for key in keys]
        self._demote(demotions)
        return taken

    def _demote(self, demotions: list[tuple[tuple[int, int], int]]) -> None:
        """Copy evicted experts down into the host tier (exclusive tiers, see host_tier.py).

        Queued on the copy stream, so each runs before the load that will overwrite its
        device slot (queued later by the same thread) and before any copy back up. Best
        effort: a tier with every slot pinned, or a failed copy (counted in
        `demotion_errors`), just drops the expert; never raises."""
        for key, index in demotions:
            host_index = self.host.reserve(key)
            if host_index is None:
                continue
            base = index * self.stride
            try:
                event = self._copier.copy(self.host.view(host_index), self.buffer[base : base + self.stride])
            except Exception:  # never raised into an acquire: the expert is simply not kept in RAM
                self.host.abort(host_index)
                self.telemetry.add("demotion_errors")
                continue
            self.host.publish(host_index)
            self.host.unpin(host_index, event)
            self.telemetry.add_many(host_demotions=1, d2h_bytes=self.stride)

    def _concurrent_error(self, block: int, layer_index: int, failed: _Slot) -> ExpertReadError:
        return ExpertReadError(
            f"expert of blk.{block} could not be loaded by a concurrent acquire or prefetch: {failed.error}",
            block=block, layer_index=layer_index, cause=failed.error,
        )

    def _stream(self, batch: StreamingBatch) -> Iterator[tuple[int, dict[str, QuantTensor]]]:
        """The generator behind `StreamingBatch.__iter__` (see `acquire_streaming`)."""
        ordered, loads, layer_index = batch._slots, batch._loads, batch._layer_index
        own = {slot.index for _key, slot in loads}
        expert_of = {slot.index: e for e, slot in ordered.items()}
        delivered = batch._delivered

        def deliver(slot: _Slot) -> tuple[int, dict[str, QuantTensor]]:
            self._copier.compute_waits_for([slot.ready_event])
            e = expert_of[slot.index]
            delivered.add(e)
            return e, batch[e]

        def ready_others() -> list[_Slot]:
            with self._cond:
                return [s for e, s in ordered.items()
                        if e not in delivered and s.index not in own and s.state == READY]

        error: ExpertReadError | None = None
        loader = None
        try:
            for slot in ready_others():  # resident: computable right away
                yield deliver(slot)
            if loads:
                loader = self._load_iter(layer_index, batch._layer, loads)
                batch._loads_started = True
                while True:
                    try:
                        slot = next(loader)
                    except StopIteration as stop:
                        error = stop.value
                        break
                    yield deliver(slot)
                    for other in ready_others():  # loaded meanwhile by a prefetch or another acquire
                        yield deliver(other)
            with self._cond:
                self._cond.wait_for(lambda: all(s.state != LOADING for s in ordered.values()))
                failed = next((s for s in ordered.values() if s.state != READY), None)
            for slot in ready_others():
                yield deliver(slot)
            if error is None and failed is not None:
                error = self._concurrent_error(batch.block, layer_index, failed)
            if error is not None:
                raise error
        finally:
            if loader is not None:
                loader.close()  # closed early: waits for its reads in flight, fails the rest
            self._pump()

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
        """Stop prefetching, wait for prefetch reads in flight, drop the device buffer (the
        store is closed by its owner)."""
        self.drain_prefetches()
        with self._cond:
            self._closed = True
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
        """Fill the slots of `loads`; the first read error, if any (see `_load_iter`)."""
        loader = self._load_iter(layer_index, layer, loads)
        while True:
            try:
                next(loader)
            except StopIteration as stop:
                return stop.value

    def _load_iter(self, layer_index: int, layer: LayerEntry, loads: list[tuple[tuple[int, int], _Slot]]
                   ) -> Iterator[_Slot]:
        """Fill the slots of `loads` from the host tier or the SSD, yielding each slot once
        its copy is queued (usable by compute queued after it); returns the first read
        error, if any.

        SSD reads (into staging buffers) are submitted first, so the drive starts at once,
        then host-tier hits are copied up. Up to `max_inflight` reads are in
        flight; with `pipeline_h2d` each finished read is copied to its slot at once, in
        completion order, else only after every read of this call has landed (the seed).
        """
        nbytes = layer.read_nbytes
        staging = self.store.staging
        inflight: dict[Future, tuple[_Slot, ReadHandle, int]] = {}  # -> (slot, read, staging buffer)
        held: list[tuple[_Slot, torch.Tensor, int]] = []  # landed, copy deferred (seed)
        done_slots: set[int] = set()
        first_error: ExpertReadError | None = None
        current: int | None = None  # a staging buffer taken but not yet in flight
        host_hits: list[tuple[_Slot, int]] = []
        ssd: list[tuple[tuple[int, int], _Slot]] = []
        ready: list[_Slot] = []  # published, not yet yielded

        def copy_landed(slot: _Slot, src: torch.Tensor, buffer: int) -> None:
            try:
                event = self._copy_into(slot, src)
            except BaseException:
                staging.give(buffer)
                raise
            staging.give(buffer, after=event)
            self._publish(slot, event)
            done_slots.add(slot.index)
            ready.append(slot)

        def flush_held() -> None:
            while held:
                copy_landed(*held.pop(0))

        def finish_some() -> None:
            nonlocal first_error
            finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for future in finished:
                slot, handle, buffer = inflight.pop(future)
                with self._cond:
                    self._reads_inflight -= 1
                    self._demand_reads -= 1
                try:
                    src = handle.result()
                except ExpertReadError as exc:
                    staging.give(buffer)
                    self._fail(slot, exc)
                    done_slots.add(slot.index)
                    first_error = first_error or exc
                    continue
                if self.pipeline_h2d:
                    copy_landed(slot, src, buffer)
                else:
                    held.append((slot, src, buffer))
            if not inflight and not self.pipeline_h2d:
                flush_held()
            self._pump()  # read queue depth freed: prefetches may use it

        unsubmitted = len(loads)  # counted in self._demand_pending until issued

        def issued(n: int = 1) -> None:
            nonlocal unsubmitted
            with self._cond:
                unsubmitted -= n
                self._demand_pending -= n

        try:
            for key, slot in loads:
                host_index, slot.host_source = slot.host_source, None  # taken by `_plan`
                if host_index is None:
                    ssd.append((key, slot))
                else:
                    host_hits.append((slot, host_index))
            if host_hits:
                issued(len(host_hits))  # RAM hits need no drive time
            for key, slot in ssd:
                if first_error is not None:
                    break
                stage = staging.try_take()
                while stage is None:  # finish our own reads first: they free buffers without help
                    if held:
                        flush_held()
                    elif inflight:
                        finish_some()
                    else:
                        stage = staging.take()
                        break
                    stage = staging.try_take()
                current = stage
                handle = self.store.submit(layer_index, key[1], staging.view(stage))
                with self._cond:
                    self._reads_inflight += 1
                    self._demand_reads += 1
                inflight[handle.future] = (slot, handle, current)
                issued()
                current = None
                while len(inflight) >= self.max_inflight:
                    finish_some()
                while ready:
                    yield ready.pop(0)
            while host_hits:  # RAM -> VRAM while the drive works on the reads above
                slot, host_index = host_hits.pop(0)
                try:
                    event = self._copy_into(slot, self.host.view(host_index)[:nbytes])
                except BaseException:
                    self.host.unpin(host_index, None)
                    raise
                self.host.unpin(host_index, event)
                self._publish(slot, event)
                done_slots.add(slot.index)
                yield slot
            while inflight or held or ready:
                if ready:
                    yield ready.pop(0)
                elif held and not inflight:
                    flush_held()
                else:
                    finish_some()
        except BaseException as exc:
            # Reads still in flight write into their buffers: wait before giving any back.
            wait(list(inflight))
            with self._cond:
                self._reads_inflight -= len(inflight)
                self._demand_reads -= len(inflight)
            for slot, _handle, buffer in inflight.values():
                staging.give(buffer)
            inflight.clear()
            for slot, _src, buffer in held:
                staging.give(buffer)
            held.clear()
            for _slot, host_index in host_hits:
                self.host.unpin(host_index, None)
            if current is not None:
                staging.give(current)
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self._fail(slot, exc)
            raise
        finally:
            if unsubmitted:
                issued(unsubmitted)
        if first_error is not None:
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self._fail(slot, ExpertReadError(
                        f"not loaded because an earlier read of this acquire failed: {first_error}",
                        layer_index=layer_index, cause=first_error))
        return first_error

    # Prefetch -----------------------------------------------------------------
    def _pump(self) -> None:
        """Start prefetch loads while the rules allow (see `prefetch`). Never blocks: with
        no staging buffer free it stops, and the completion that frees one pumps again.
        Safe from any thread; a call while another thread pumps asks that one to look again."""
        with self._cond:
            if self._pumping:
                self._pump_again = True
                return
            self._pumping = True
        try:
            while True:
                started = False
                buffer = self._prefetch_buffer_or_none()
                if buffer is not None:
                    try:
                        with self._cond:
                            picked = self._pick_intent()
                            if picked is not None:
                                self._pf_loading += 1
                        if picked is not None:
                            key, slot, demotions = picked
                            (host_index,) = self._take_then_demote([key], demotions)
                            buffer = self._start_prefetch(key, slot, buffer, host_index)
                            started = True
                    finally:
                        if buffer is not None:  # not used by a read
                            self.store.staging.give(buffer)
                if started:
                    continue
                with self._cond:
                    if not self._pump_again:
                        self._pumping = False
                        return
                    self._pump_again = False
        except BaseException:
            with self._cond:
                self._pumping = False
            raise

    def _prefetch_buffer_or_none(self) -> int | None:
        """A staging buffer for a prefetch read, or None (no intent waiting, or none free)."""
        with self._cond:
            if self._closed or not (self._intents or self._exact_intents):
                return None
        return self.store.staging.try_take()

    def _guesses_may_read(self) -> bool:  # under lock
        """Whether a guess may read the SSD now (see `speculative`); guesses the host tier
        holds need no drive time and may always be copied up."""
        if self.speculative == "ram" or self._demand_pending:
            return False
        return self.speculative == "tail" or not self._demand_reads

    def _take_ram_guess(self) -> tuple | None:  # under lock
        """Remove and return the oldest live guess the host tier holds; stale guesses (their
        block was acquired since) are dropped on the way."""
        keep: deque = deque()
        found = None
        dropped = 0
        while self._intents:
            item = self._intents.popleft()
            key, _may_read, generation = item
            if generation != self._generation[key[0]]:
                dropped += 1
            elif key in self._where:
                pass
            elif found is None and key in self.host:
                found = item
            else:
                keep.append(item)
        self._intents = keep
        if dropped:
            self.telemetry.add("prefetch_dropped", dropped)
        return found

    def _pick_intent(self) -> tuple[tuple[int, int], _Slot, list] | None:  # under lock
        """The next valid intent with a slot reserved for it (pinned, LOADING) and the
        demotions its eviction needs (for `_demote`), or None."""
        if self._closed or self._reads_inflight >= self.prefetch_depth:
            return None
        while self._exact_intents or self._intents:
            exact = bool(self._exact_intents)
            if exact:
                item = self._exact_intents.popleft()
            elif self._guesses_may_read():
                item = self._intents.popleft()
            else:  # guesses read only into bandwidth the acquires leave idle; RAM ones need none
                item = self._take_ram_guess() if self.host.enabled else None
                if item is None:
                    return None
            key, may_read, generation = item
            if key in self._where:
                continue  # resident or loading already
            if not may_read and key not in self.host:
                self.telemetry.add("prefetch_dropped")  # a guess only RAM may serve, and RAM has not got it
                continue
            if generation != self._generation[key[0]] or len(self._pf_unused) >= self.prefetch_limit:
                self.telemetry.add("prefetch_dropped")
                continue
            demotions: list = []
            if not self._free:
                # Evict only an unprotected expert, and never an exact prefetch not yet used.
                victim = self._policy.pop_victim(
                    lambda k: self._where[k].pins > 0 or self._pf_unused.get(k, False))
                if victim is None:
                    self.telemetry.add("prefetch_dropped")
                    continue
                wasted, demotions = self._evict([victim])
                self.telemetry.add_many(cache_evictions=1, prefetch_wasted=wasted)
            slot = self._slots[self._free.pop()]
            self._pin(slot)
            slot.key, slot.state, slot.error, slot.ready_event = key, LOADING, None, None
            self._where[key] = slot
            self._policy.admit(key)  # ranked as used once, now; an acquire's access counts later
            self._pf_unused[key] = exact
            return key, slot, demotions
        return None

    def _start_prefetch(self, key: tuple[int, int], slot: _Slot, buffer: int, host_index: int | None
                        ) -> int | None:
        """Load `key` into `slot` (reserved by `_pick_intent`) from host-tier slot
        `host_index` (taken by the caller), or from the SSD through staging buffer
        `buffer`; returns `buffer` if it was not used."""
        self.telemetry.add("prefetch_issued")
        layer = self.manifest.layers[key[0]]
        try:
            if host_index is not None:  # RAM -> VRAM, no read
                try:
                    event = self._copy_into(slot, self.host.view(host_index)[: layer.read_nbytes])
                except BaseException:
                    self.host.unpin(host_index, None)
                    raise
                self.host.unpin(host_index, event)
                self._publish(slot, event)
                self._prefetch_settled(slot, key)
                return buffer
            handle = self.store.submit(key[0], key[1], self.store.staging.view(buffer))
        except BaseException as exc:  # e.g. the store was closed: counted, never raised into the model
            self.last_prefetch_error = exc
            self._fail(slot, exc)
            self._prefetch_settled(slot, key, failed=True)
            return buffer
        with self._cond:
            self._reads_inflight += 1
        handle.future.add_done_callback(lambda _f: self._prefetch_landed(key, slot, handle, buffer))
        return None

    def _prefetch_landed(self, key: tuple[int, int], slot: _Slot, handle: ReadHandle, buffer: int) -> None:
        """An I/O thread finished a prefetch read: copy it to its slot and unpin the slot."""
        with self._cond:
            self._reads_inflight -= 1
        failed = False
        try:
            src = handle.result()
            event = self._copy_into(slot, src)
            self.store.staging.give(buffer, after=event)
            self._publish(slot, event)
        except BaseException as exc:  # counted (io_errors, prefetch_errors); an acquire re-reads it
            self.last_prefetch_error = exc
            self.store.staging.give(buffer)
            self._fail(slot, exc)
            failed = True
        self._prefetch_settled(slot, key, failed=failed)
        self._pump()

    def _prefetch_settled(self, slot: _Slot, key: tuple[int, int], failed: bool = False) -> None:
        with self._cond:
            if failed:
                self._pf_unused.pop(key, None)
            self._pf_loading -= 1
            self._unpin(slot)
            self._cond.notify_all()
        if failed:
            self.telemetry.add("prefetch_errors")
