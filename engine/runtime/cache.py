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

`ExpertCache` composes three parts that share its one lock (`_cond`); each module's
docstring says what it owns:
- slots.py, the slot planner (`SlotPlanner`): the slot table, pins, the replacement
  policy; which experts stay, which are evicted, which load into which slot.
- load_pipeline.py, the load pipeline (`LoadPipeline`): every byte move (SSD ->
  staging -> host tier -> VRAM, and victims down into the host tier), the deep I/O
  queue (`max_inflight`, `pipeline_h2d`) and the drive's queue accounting.
- prefetch.py, the prefetch scheduler (`PrefetchScheduler`): `prefetch` intents
  started into spare queue depth (exact ones; guesses under `speculative`).
The batches it hands out (`CachedBatch`, `StreamingBatch`) are in batches.py.

Ordering on CUDA (see transfer.py): copies run on a dedicated stream; the compute
stream waits on a slot's copy event before the batch is returned; releasing a batch
records an event on the compute stream that the copy stream waits on before it
overwrites any of the batch's slots.

Speed levers, each lossless (benchmarks/RESULTS.md says what each bought): the
deep I/O queue and exclusive tiers (load_pipeline.py), prefetches (prefetch.py), and
`acquire_streaming`, which hands the experts out as each becomes usable so the caller
computes resident ones while misses still load; summed in a FIXED order (e.g.
ascending id), the result is bit-identical to a plain `acquire`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from engine import memory
from engine.service_events import ExpertMap
from expertpack import LayerEntry

from .batches import CachedBatch, StreamingBatch
from .errors import CacheCapacityError, ExpertReadError
from .expert_map import read_expert_map
from .host_tier import HostTier
from .load_pipeline import LoadPipeline
from .policy import DEFAULT_POLICY, whole_acquire_policy
from .prefetch import PrefetchScheduler
from .routed import PackRouting
from .slots import MIB, READY, Demotions, Key, Slot, SlotPlanner, size_device_tier
from .store import ExpertStore
from .telemetry import Telemetry
from .trace import AccessTrace
from .transfer import DeviceCopier

__all__ = ["MIB", "CachedBatch", "ExpertCache", "StreamingBatch"]


def _part(part: str, name: str) -> property:
    """An attribute of the cache kept by one of its parts (read and set through)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class ExpertCache(PackRouting):
    """Tiered expert cache over an `ExpertStore` (see module docstring).

    `device`: where the slots live ("cuda", "cuda:1", "cpu"). `cache_bytes`: the
    device-tier budget; `reserve_bytes`: device memory always left free. `host_cache_bytes`:
    the host-RAM tier (0 = off), clamped to available RAM minus a safety margin.
    `policy`: the device tier's replacement policy, "forecast" (default), "router", "hybrid",
    "lfru", "lfu" or "lru" (policy.make_policy; docs/cache.md compares them); `halflife`
    overrides its decay. The host-RAM tier runs "hybrid" under the forecast policies
    (it never sees whole acquires).
    `trace`: an AccessTrace to record every acquire into. `max_inflight`: expert reads in
    flight per acquire (default: the store's staging buffers). `pipeline_h2d`: copy each
    expert to the device as soon as its read lands (default) or, False, only after all
    reads of the acquire landed (the seed design, kept as a baseline). `prefetch_depth`:
    prefetch reads start only while fewer expert reads than this are in flight (default
    `max_inflight`); `prefetch_limit`: at most this many prefetched experts may wait
    unused in the device tier (default a quarter of the slots, at least top-k).
    `speculative`: when guesses (`prefetch(..., exact=False)`) may read the SSD: "tail"
    (default: submitted once every acquire read has been, into the queue depth the
    acquires leave free; the store starts them as the last of those reads ends, see
    `ExpertStore.later_after_urgent`), "idle" (submitted only while no acquire read is
    pending or in flight) or "ram" (never). `speculative_reads`: only the first this
    many experts of each guess (callers list the likeliest first) may read the SSD
    (default 2; None: all). Guesses the host tier holds are copied up at once, in every
    mode: they cost no drive time and no queue depth. Why 2: prefetch.py.
    """

    buffer = _part("_pipeline", "buffer")  # the device tier: slot i is bytes [i * stride, (i + 1) * stride)
    max_inflight = _part("_pipeline", "max_inflight")
    pipeline_h2d = _part("_pipeline", "pipeline_h2d")
    guesses_after_compute = _part("_pipeline", "guesses_after_compute")  # see load_pipeline.py
    prefetch_depth = _part("_prefetch", "depth")
    prefetch_limit = _part("_prefetch", "limit")
    speculative = _part("_prefetch", "speculative")
    speculative_reads = _part("_prefetch", "speculative_reads")
    last_prefetch_error = _part("_prefetch", "last_error")
    # The parts' shared state (guarded by `_cond`), as tests and benchmarks inspect it.
    _cond = _part("_planner", "cond")
    _slots = _part("_planner", "slots")
    _where = _part("_planner", "where")
    _pinned = _part("_planner", "pinned")
    _demand_pending = _part("_pipeline", "demand_pending")
    _demand_reads = _part("_pipeline", "demand_reads")
    _reads_inflight = _part("_pipeline", "reads_inflight")

    def __init__(
        self,
        store: ExpertStore,
        *,
        device: str | torch.device = "cpu",
        cache_bytes: int,
        reserve_bytes: int = 2 * memory.GIB,
        host_cache_bytes: int = 0,
        policy: str = DEFAULT_POLICY,
        halflife: float | None = None,
        trace: AccessTrace | None = None,
        telemetry: Telemetry | None = None,
        max_inflight: int | None = None,
        pipeline_h2d: bool = True,
        prefetch_depth: int | None = None,
        prefetch_limit: int | None = None,
        speculative: str = "tail",
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
        self.slot_count = size_device_tier(self.device, self.stride, self.manifest.expert_used_count,
                                           int(cache_bytes), int(reserve_bytes))
        buffer = torch.empty(self.slot_count * self.stride, dtype=torch.uint8, device=self.device)
        self._planner = SlotPlanner(self.slot_count, policy, halflife, telemetry=self.telemetry)
        self._copier = DeviceCopier(self.device)
        self.host = HostTier(self.stride, int(host_cache_bytes), pinned=store.staging.slab.pinned,
                             telemetry=self.telemetry, policy="hybrid" if whole_acquire_policy(policy) else policy)
        self._pipeline = LoadPipeline(store, self._planner, buffer, stride=self.stride, copier=self._copier,
                                      host=self.host, telemetry=self.telemetry, max_inflight=max_inflight,
                                      pipeline_h2d=bool(pipeline_h2d), reads_freed=self._pump)
        self._prefetch = PrefetchScheduler(self.manifest, self._planner, self._pipeline, self.host, self.telemetry,
                                           speculative=speculative, speculative_reads=speculative_reads,
                                           depth=prefetch_depth, limit=prefetch_limit)
        self.telemetry.set(slot_count=self.slot_count, slots_used=0, device=str(self.device),
                           cache_bytes=self.slot_count * self.stride)
        for name in ("prefetch_issued", "prefetch_hits", "prefetch_wasted", "prefetch_dropped", "prefetch_errors"):
            self.telemetry.add(name, 0)

    # Public API -----------------------------------------------------------------
    @property
    def max_experts_per_acquire(self) -> int:
        """Distinct experts one acquire can take right now: slots not protected by live batches."""
        with self._planner.cond:
            return self.slot_count - self._planner.pinned

    def acquire(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> CachedBatch:
        """Deliver experts `expert_ids` of model block `block` (blk.N); use the batch in `with`.

        Duplicates are fine. Raises CacheCapacityError (nothing changed) if the distinct
        experts that are not resident exceed the unprotected slots; use `acquire_chunks`
        for such requests. Raises ExpertReadError if a read failed; experts loaded before
        the failure stay cached and the cache stays usable.
        """
        layer_index, layer, ordered, loads, demotions = self._plan(block, expert_ids)
        try:
            error = self._pipeline.load(layer_index, layer, loads, demotions) if loads else None
            error = self._settle(block, layer_index, ordered.values(), error)
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
        the call); the reads start with `batch.start()` or when iteration starts.
        `batch[e]` is valid for experts already yielded. A read error is raised from the
        loop after the other experts were delivered or settled.
        """
        layer_index, layer, ordered, loads, demotions = self._plan(block, expert_ids)
        return StreamingBatch(self, block, layer, ordered, layer_index, loads, demotions)

    def prefetch(self, block: int, expert_ids: Sequence[int] | torch.Tensor, *, exact: bool = True) -> int:
        """Start loading experts of the next acquire of `block` that are not in the device
        tier; returns at once with how many were queued (0 if all are resident or loading).

        Nothing is protected: a prefetched expert is an ordinary cached one once loaded.
        `exact=True` is for experts known to be needed (DeepSeek-V4's hash layers, whose
        experts follow from the sampled token); `exact=False` for guesses (the next
        layer's router on the current hidden state), which read only into idle
        bandwidth; list them likeliest first (only the first `speculative_reads` may read
        the SSD). A prefetch never evicts a protected expert; one not started by the time
        `block` is acquired is dropped. Lossless by construction: it only changes when
        bytes arrive, never which bytes an acquire delivers. An acquire that finds a
        prefetched expert counts it as a hit; one still loading is waited for. The rules
        and counters: prefetch.py.

        Where to call it: exact ones as soon as the ids are known (hash layers: right
        after the token is sampled). Guesses for layer l+1 right AFTER the acquire of
        layer l returned (`acquire_streaming`: after its `start()`, which submits its
        reads, before iterating it): guesses wait only for reads already planned, so one
        queued before that acquire would start at once and compete with its reads. An
        acquire that finds an expert a prefetch is still reading makes that read urgent
        (`ExpertStore.promote`).
        """
        layer_index, _layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        if not exact:
            self._planner.note_guess(layer_index, experts)
        return self._prefetch.enqueue(layer_index, experts, exact)

    def drain_prefetches(self, timeout: float | None = None) -> bool:
        """Drop prefetches not started and wait for those in flight (tests, shutdown)."""
        return self._prefetch.drain(timeout)

    def acquire_chunks(
        self, block: int, expert_ids: Sequence[int] | torch.Tensor, max_per_chunk: int | None = None,
        *, streaming: bool = False,
    ) -> Iterator[CachedBatch]:
        """Deliver any number of experts as consecutive batches that each fit the cache.

        Each batch is released when the next one is requested (or the loop ends), so use
        it inside the loop body: `for batch in cache.acquire_chunks(b, ids): with batch: ...`.
        Experts already resident come first (they cost no read and a later chunk must
        not evict them before use). Every distinct expert is delivered exactly once (a
        streaming batch: if it is iterated to its end).
        `streaming`: each batch is an `acquire_streaming` one, to be iterated: its experts
        compute as their reads land instead of after all of the batch's reads (a prompt
        through a cache smaller than a layer's experts); the next batch's reads start when
        this one is released.
        (Prefetching the next batch's first experts while one computes was measured
        slower: benchmarks/RESULTS.md.)
        """
        if max_per_chunk is not None and max_per_chunk < 1:
            raise ValueError(f"max_per_chunk must be at least 1, got {max_per_chunk}")
        layer_index, _layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        with self._planner.cond:
            experts.sort(key=lambda e: (layer_index, e) not in self._planner.where)  # stable: resident first
        acquire = self.acquire_streaming if streaming else self.acquire
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
                    batch = acquire(block, experts[start : start + room])
                    break
                except CacheCapacityError as exc:  # another thread took slots meanwhile
                    room = min(room - 1, exc.max_experts)
            try:
                yield batch
            finally:
                batch.release()
            start += len(batch)

    def shrink(self, cache_bytes: int) -> int:
        """Shrink the device tier in place to at most `cache_bytes` (whole slots) and give
        the memory back; returns the new slot count (unchanged if already that small).

        Why: the memory plan (engine/memory_plan.py) calls it when a conversation's KV
        state outgrows its budget, so the cache yields instead of the model running out
        of memory. The replacement policy picks what leaves; the experts that stay keep
        their bytes (moved down into the remaining slots). Call it between replies:
        pending prefetches are drained first, and it refuses (RuntimeError, nothing
        changed) while batches are alive. ValueError, with the numbers, below one MoE
        layer's top-k experts.
        """
        count = int(cache_bytes) // self.stride
        topk = self.manifest.expert_used_count
        if count < topk:
            raise ValueError(f"the expert cache cannot shrink to {int(cache_bytes) / MIB:.0f} MiB: one MoE layer "
                             f"uses {topk} experts of {self.stride / MIB:.1f} MiB at once "
                             f"({topk * self.stride / MIB:.0f} MiB)")
        if count >= self.slot_count:
            return self.slot_count
        self.drain_prefetches()
        with self._planner.cond:
            evicted, moves = self._planner.shrink(count)
            if self._copier.is_cuda:
                torch.cuda.synchronize(self.device)  # copies into moved slots have landed
            old = self.buffer
            for src, dst in moves:
                old[dst * self.stride : (dst + 1) * self.stride].copy_(old[src * self.stride : (src + 1) * self.stride])
            kept = old[: count * self.stride]
            if self._copier.is_cuda and memory.free_device_memory(self.device) < kept.numel():
                # Through host memory (one pass of the kept bytes): the device never holds both.
                host = kept.cpu()
                self._replace_pool(torch.empty(0, dtype=torch.uint8, device=self.device))
                del old, kept
                torch.cuda.empty_cache()
                self._replace_pool(host.to(self.device))
            else:
                self._replace_pool(kept.clone())
                del old, kept
                if self._copier.is_cuda:
                    torch.cuda.empty_cache()
            if self._copier.is_cuda:
                # The new pool was written on this (compute) stream: copies into it and out of it
                # (a demotion reads a slot) wait for that.
                for stream in (self._copier.stream, self._copier.down_stream):
                    if stream is not None:
                        stream.wait_stream(torch.cuda.current_stream(self.device))
            self.slot_count = count
            self.prefetch_limit = min(self.prefetch_limit, max(topk, count // 4))
            used = len(self._planner.where)
        self.telemetry.add_many(cache_evictions=len(evicted))
        self.telemetry.set(slot_count=count, slots_used=used, cache_bytes=count * self.stride)
        return count

    def _replace_pool(self, buffer: torch.Tensor) -> None:
        """The device tier's memory changes (shrink, close): views of the old pool go with it."""
        self._forget_slot_rows()
        self.buffer = buffer

    def slot_of(self, block: int, expert: int) -> int | None:
        """Device slot holding (block, expert) if it is loaded, else None (tests, diagnostics)."""
        key = (self.manifest.layer_index(block), int(expert))
        with self._planner.cond:
            slot = self._planner.where.get(key)
            return slot.index if slot is not None and slot.state == READY else None

    def resident_count(self) -> int:
        return self._planner.resident_count()

    def expert_map(self) -> ExpertMap | None:
        """Where each expert sits and its recent use (the GUI's heat map); read-only, and None
        rather than a wait when the engine holds the lock (expert_map.py)."""
        return read_expert_map(self.manifest, self._planner, self.host, str(self.device))

    def close(self) -> None:
        """Stop prefetching, wait for prefetch reads in flight, drop the device buffer (the
        store is closed by its owner)."""
        self.drain_prefetches()
        self._prefetch.close()
        if self._copier.is_cuda:
            torch.cuda.synchronize(self.device)
        self._replace_pool(torch.empty(0, dtype=torch.uint8, device=self.device))

    # Internals --------------------------------------------------------------
    def _plan(self, block: int, expert_ids: Sequence[int] | torch.Tensor
              ) -> tuple[int, LayerEntry, dict[int, Slot], list[tuple[Key, Slot]], Demotions]:
        """Decide and reserve one acquire (the slot planner), take its RAM copies, count it.
        Returns (layer index, layer, expert -> slot in request order, the loads to do, the
        victims to copy down: the load pipeline does, once the loads' reads are submitted)."""
        layer_index, layer = self._layer(block)
        experts = self._unique_ids(expert_ids)
        keys = [(layer_index, e) for e in experts]
        with self._planner.cond:
            plan = self._planner.plan(block, keys, lambda: self._prefetch.loading)
            self._prefetch.invalidate(layer_index)  # prefetches for this block not started are now stale
            self._pipeline.demand_pending += len(plan.loads)  # speculative prefetches hold back until issued
            used = len(self._planner.where)
            awaited = [slot.read for slot in plan.slots.values() if slot.read is not None]
        for read in awaited:  # prefetch reads this acquire now waits for: no longer held back
            self.store.promote(read)
        taken = self._pipeline.take([key for key, _slot in plan.loads])
        for (_key, slot), host_index in zip(plan.loads, taken):
            slot.host_source = host_index
        self.telemetry.add_many(cache_evictions=plan.evictions, prefetch_hits=plan.prefetch_hits,
                                prefetch_wasted=plan.wasted)
        self.telemetry.record_acquire(block, plan.hits, len(plan.loads))
        self.telemetry.set(slots_used=used)
        if self.trace is not None:
            self.trace.record(block, experts)
        # Keep request order for the batch.
        return layer_index, layer, {e: plan.slots[e] for e in experts}, plan.loads, plan.demotions

    def _settle(self, block: int, layer_index: int, slots: Iterable[Slot], error: ExpertReadError | None
                ) -> ExpertReadError | None:
        """Wait for the `slots` that other acquires or prefetches are loading; the error to
        raise: `error` (this call's own first read error), else that of one that failed."""
        failed = self._planner.wait_settled(slots)
        if error is None and failed is not None:
            error = ExpertReadError(
                f"expert of blk.{block} could not be loaded by a concurrent acquire or prefetch: {failed.error}",
                block=block, layer_index=layer_index, cause=failed.error,
            )
        return error

    def _pump(self) -> None:
        """Let the prefetch scheduler start what the rules allow now (never blocks)."""
        self._prefetch.pump()

    def _release(self, slots: list[Slot], record: bool = True) -> None:
        self._planner.release(slots, self._copier.record_use() if record else None)

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
