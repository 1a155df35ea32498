"""The prefetch scheduler: loads of coming acquires, started into spare queue depth.

`ExpertCache.prefetch(block, ids, exact=...)` queues intents here; `pump` starts them
while the rules allow, from any thread, and never blocks:

- Reads go only into spare queue depth: a prefetch starts only while fewer than
  `depth` expert reads are in flight (acquires and prefetches, the load pipeline's
  `reads_inflight`). Exact intents (experts known to be needed) go first.
- Guesses (`exact=False`) may read the SSD only for their likeliest
  `speculative_reads` experts (default 2), and only once every read of the acquires
  planned so far has been issued: with `speculative="idle"` (default) only while no
  acquire read is in flight (idle bandwidth), with "tail" into the queue depth the
  acquires leave free, with "ram" never. Guesses the host tier holds need no drive
  time and are copied up whenever a prefetch may start, in every mode; a guess that
  may not read and that the host tier does not hold is dropped. Why 2
  (benchmarks/RESULTS.md): decode is drive-bound and a wrong guess read from the SSD
  costs a whole expert of drive time; the next layer's router on the current hidden
  state ranks its top pick right 97% of the time and its second 89%, its sixth only
  49%. Reading all six made decode slower than reading none; reading the best two
  filled the drive's idle time between layers (busy 80% -> 91%) for 14% more
  tokens/s than the seed design.
- A prefetch never evicts a protected expert, nor an exact prefetch not yet used
  (the slot planner's `reserve_prefetch`); at most `limit` prefetched experts wait
  unused in the device tier; an intent not started by the time its block is
  acquired is dropped (`invalidate`: it was for that acquire).
- Each load pins its slot only until its copy is queued (`loading` counts them);
  a failed one is counted, never raised into the model (an acquire re-reads it).

Counters: prefetch_issued, prefetch_hits (used; counted by the acquire that finds
one), prefetch_wasted (evicted unused), prefetch_dropped (never started),
prefetch_errors. State is guarded by the cache's lock (the slot planner's `cond`).
"""

from __future__ import annotations

from collections import deque

from expertpack import PackManifest

from .host_tier import HostTier
from .load_pipeline import LoadPipeline
from .slots import Demotions, Key, Slot, SlotPlanner
from .store import ReadHandle
from .telemetry import Telemetry


class PrefetchScheduler:
    """Prefetch intents and the loads started from them (see module docstring).

    `depth` defaults to the pipeline's `max_inflight`; `limit` to a quarter of the slots,
    at least top-k. The other settings are `ExpertCache`'s of the same names."""

    def __init__(self, manifest: PackManifest, planner: SlotPlanner, pipeline: LoadPipeline, host: HostTier,
                 telemetry: Telemetry, *, speculative: str, speculative_reads: int | None,
                 depth: int | None, limit: int | None) -> None:
        if speculative not in ("idle", "tail", "ram"):
            raise ValueError(f"speculative must be 'idle', 'tail' or 'ram', got {speculative!r}")
        self.manifest = manifest
        self.planner = planner
        self.pipeline = pipeline
        self.cond = planner.cond
        self.host = host
        self.telemetry = telemetry
        self.speculative = speculative
        self.speculative_reads = None if speculative_reads is None else max(0, int(speculative_reads))
        topk = manifest.expert_used_count
        self.depth = max(1, int(depth) if depth is not None else pipeline.max_inflight)
        self.limit = max(1, int(limit) if limit is not None else max(topk, planner.slot_count // 4))
        self.intents: deque = deque()  # (key, may read the SSD, generation of its layer) not started yet
        self.exact_intents: deque = deque()
        self.generation = [0] * manifest.num_layers  # acquires of each pack layer so far
        self.loading = 0  # prefetch loads in progress (each pins its slot)
        self._pumping = False
        self._pump_again = False
        self.closed = False
        self.last_error: BaseException | None = None

    # Called by the cache ----------------------------------------------------------
    def enqueue(self, layer_index: int, experts: list[int], exact: bool) -> int:
        """Queue intents for the experts of pack layer `layer_index` that are not in the
        device tier (see `ExpertCache.prefetch`) and pump; how many were queued."""
        queued = 0
        with self.cond:
            if self.closed:
                return 0
            generation = self.generation[layer_index]
            queue = self.exact_intents if exact else self.intents
            reads = len(experts) if exact or self.speculative_reads is None else self.speculative_reads
            for rank, e in enumerate(experts):
                key = (layer_index, e)
                if key in self.planner.where:
                    continue
                queue.append((key, rank < reads, generation))
                queued += 1
            while len(queue) > 4 * self.planner.slot_count:  # bounded: the oldest intents are stalest
                queue.popleft()
                self.telemetry.add("prefetch_dropped")
        if queued:
            self.pump()
        return queued

    def invalidate(self, layer_index: int) -> None:  # under lock
        """An acquire of pack layer `layer_index` was planned: intents for it not started are stale."""
        self.generation[layer_index] += 1

    def drain(self, timeout: float | None = None) -> bool:
        """Drop intents not started and wait for loads in flight; False on timeout."""
        with self.cond:
            dropped = len(self.intents) + len(self.exact_intents)
            self.intents.clear()
            self.exact_intents.clear()
            done = self.cond.wait_for(lambda: self.loading == 0, timeout)
        self.telemetry.add("prefetch_dropped", dropped)
        return done

    def close(self) -> None:
        """No prefetch starts from now on."""
        with self.cond:
            self.closed = True

    def pump(self) -> None:
        """Start prefetch loads while the rules allow. Never blocks: with no staging buffer
        free it stops, and the completion that frees one pumps again. Safe from any
        thread; a call while another thread pumps asks that one to look again."""
        with self.cond:
            if self._pumping:
                self._pump_again = True
                return
            self._pumping = True
        try:
            while True:
                started = False
                buffer = self._buffer_or_none()
                if buffer is not None:
                    try:
                        with self.cond:
                            picked = self._pick()
                            if picked is not None:
                                self.loading += 1
                        if picked is not None:
                            key, slot, demotions = picked
                            (host_index,) = self.pipeline.take_then_demote([key], demotions)
                            buffer = self._start(key, slot, buffer, host_index)
                            started = True
                    finally:
                        if buffer is not None:  # not used by a read
                            self.pipeline.staging.give(buffer)
                if started:
                    continue
                with self.cond:
                    if not self._pump_again:
                        self._pumping = False
                        return
                    self._pump_again = False
        except BaseException:
            with self.cond:
                self._pumping = False
            raise

    # Choosing the next intent ---------------------------------------------------
    def _buffer_or_none(self) -> int | None:
        """A staging buffer for a prefetch read, or None (no intent waiting, or none free)."""
        with self.cond:
            if self.closed or not (self.intents or self.exact_intents):
                return None
        return self.pipeline.staging.try_take()

    def _guesses_may_read(self) -> bool:  # under lock
        """Whether a guess may read the SSD now (see `speculative`); guesses the host tier
        holds need no drive time and may always be copied up."""
        if self.speculative == "ram" or self.pipeline.demand_pending:
            return False
        return self.speculative == "tail" or not self.pipeline.demand_reads

    def _take_ram_guess(self) -> tuple | None:  # under lock
        """Remove and return the oldest live guess the host tier holds; stale guesses (their
        block was acquired since) are dropped on the way."""
        keep: deque = deque()
        found = None
        dropped = 0
        while self.intents:
            item = self.intents.popleft()
            key, _may_read, generation = item
            if generation != self.generation[key[0]]:
                dropped += 1
            elif key in self.planner.where:
                pass
            elif found is None and key in self.host:
                found = item
            else:
                keep.append(item)
        self.intents = keep
        if dropped:
            self.telemetry.add("prefetch_dropped", dropped)
        return found

    def _pick(self) -> tuple[Key, Slot, Demotions] | None:  # under lock
        """The next valid intent with a slot reserved for it (pinned, LOADING) and the
        demotions its eviction needs, or None."""
        if self.closed or self.pipeline.reads_inflight >= self.depth:
            return None
        while self.exact_intents or self.intents:
            exact = bool(self.exact_intents)
            if exact:
                item = self.exact_intents.popleft()
            elif self._guesses_may_read():
                item = self.intents.popleft()
            else:  # guesses read only into bandwidth the acquires leave idle; RAM ones need none
                item = self._take_ram_guess() if self.host.enabled else None
                if item is None:
                    return None
            key, may_read, generation = item
            if key in self.planner.where:
                continue  # resident or loading already
            if not may_read and key not in self.host:
                self.telemetry.add("prefetch_dropped")  # a guess only RAM may serve, and RAM has not got it
                continue
            if generation != self.generation[key[0]] or len(self.planner.prefetched) >= self.limit:
                self.telemetry.add("prefetch_dropped")
                continue
            reserved = self.planner.reserve_prefetch(key, exact)
            if reserved is None:
                self.telemetry.add("prefetch_dropped")
                continue
            slot, demotions = reserved
            return key, slot, demotions
        return None

    # One prefetch load ------------------------------------------------------------
    def _start(self, key: Key, slot: Slot, buffer: int, host_index: int | None) -> int | None:
        """Load `key` into `slot` (reserved by `_pick`) from host-tier slot `host_index`
        (taken by the caller), or from the SSD through staging buffer `buffer`; returns
        `buffer` if it was not used."""
        self.telemetry.add("prefetch_issued")
        layer = self.manifest.layers[key[0]]
        try:
            if host_index is not None:  # RAM -> VRAM, no read
                self.pipeline.copy_up(slot, host_index, layer.read_nbytes)
                self._settled(slot, key)
                return buffer
            handle = self.pipeline.store.submit(key[0], key[1], self.pipeline.staging.view(buffer))
        except BaseException as exc:  # e.g. the store was closed: counted, never raised into the model
            self.last_error = exc
            self.planner.fail(slot, exc)
            self._settled(slot, key, failed=True)
            return buffer
        with self.cond:
            self.pipeline.reads_inflight += 1
        handle.future.add_done_callback(lambda _f: self._landed(key, slot, handle, buffer))
        return None

    def _landed(self, key: Key, slot: Slot, handle: ReadHandle, buffer: int) -> None:
        """An I/O thread finished a prefetch read: copy it to its slot and unpin the slot."""
        with self.cond:
            self.pipeline.reads_inflight -= 1
        failed = False
        try:
            try:
                src = handle.result()
            except BaseException:
                self.pipeline.staging.give(buffer)
                raise
            self.pipeline.copy_staged(slot, src, buffer)  # gives the buffer back either way
        except BaseException as exc:  # counted (io_errors, prefetch_errors); an acquire re-reads it
            self.last_error = exc
            self.planner.fail(slot, exc)
            failed = True
        self._settled(slot, key, failed=failed)
        self.pump()

    def _settled(self, slot: Slot, key: Key, failed: bool = False) -> None:
        with self.cond:
            if failed:
                self.planner.prefetched.pop(key, None)
            self.loading -= 1
            self.planner.unpin(slot)
            self.cond.notify_all()
        if failed:
            self.telemetry.add("prefetch_errors")
