"""The prefetch scheduler: loads of coming acquires, started into spare queue depth.

`ExpertCache.prefetch(block, ids, exact=...)` queues intents here; the scheduler's
own thread (the pump) starts them while the rules allow. `pump()` only wakes it:
from the model's thread (a hint, an acquire's landed read) it costs no more than
that. Why a thread: starting a load (reserve a slot, copy its victim down, submit
the read) costs the host ~0.1-0.5 ms; DeepSeek-V4's three hash layers' hints at a
step's start made the decode thread start up to 18 of them, and keep starting more
as reads landed, before it could launch the step's first layer (14 ms a step at an
emulated 12.5 GB/s, benchmarks/RESULTS.md). The rules:

- Reads go only into spare queue depth: a prefetch starts only while fewer than
  `depth` expert reads are in flight (acquires and prefetches, the load pipeline's
  `reads_inflight`). Exact intents (experts known to be needed) go first.
- Guesses (`exact=False`) may read the SSD only for their likeliest
  `speculative_reads` experts (default 2), and only once every read of the acquires
  planned so far has been issued: with `speculative="tail"` (default) at once, into
  the queue depth the acquires leave free, with "idle" only while no acquire read is
  in flight, with "ram" never. A guess read (like every prefetch read) is non-urgent:
  the store holds it back while an acquire's read is in flight and starts it the
  moment the last one ends (`ExpertStore.later_after_urgent`), so it fills the
  drive's idle time between two layers from its first moment, never slows a layer's
  misses, and its start (slot, victim, submit) ran on the pump while the model's
  thread waited for those misses. "idle" started it only at the batch's release,
  after the layer's copies and launches: 7-8% slower on DeepSeek-V4 at an emulated
  12.5 GB/s drive, whether the drive serves its reads in order or shares its rate;
  the same on Kimi-K3 (benchmarks/RESULTS.md). Why 2 (benchmarks/RESULTS.md): decode is
  drive-bound and a wrong guess read from the SSD costs a whole expert of drive time;
  the next layer's router on the current hidden state ranks its top pick right 97% of
  the time and its second 89%, its sixth only 49%. Reading all six made decode slower
  than reading none; reading the best two filled the drive's idle time between
  layers (busy 80% -> 91%) for 14% more tokens/s than the seed design.
- Intents the host tier holds (guesses or exact) need no drive time, no staging
  buffer and no queue depth: they are copied up at once, in every mode, ahead of the
  acquire's own copies, which come only as its reads land (held back behind the
  queue depth, they used to go out just as the acquire's last read landed, and
  delayed its copy). A guess that may not read and that the host tier does not hold
  is dropped.
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

import threading
import time
import weakref
from collections import deque

from expertpack import PackManifest

from .host_tier import HostTier
from .load_pipeline import LoadPipeline
from .slots import Demotions, Key, Slot, SlotPlanner
from .store import ReadHandle
from .telemetry import Telemetry


def _pump_thread(kick: threading.Event, scheduler_ref: weakref.ref) -> None:
    """The pump: a pass each time it is woken, until its scheduler closes or is collected."""
    while True:
        kick.wait()
        kick.clear()  # a wake after this line runs another pass: nothing is missed
        scheduler = scheduler_ref()
        if scheduler is None or scheduler.stopping:
            return
        scheduler._pass()
        del scheduler  # not held while asleep: a dropped cache is collected


def _wake(kick: threading.Event) -> None:
    kick.set()


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
        self.intents: deque = deque()  # (key, may read the SSD, generation of its layer, exact) not started yet
        self.exact_intents: deque = deque()
        self.generation = [0] * manifest.num_layers  # acquires of each pack layer so far
        self.loading = 0  # prefetch loads in progress (each pins its slot)
        self.closed = False  # no prefetch starts any more
        self.stopping = False  # the pump thread ends
        self.last_error: BaseException | None = None
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first pump()
        self._passes = threading.Condition(threading.Lock())  # guards the two counts below
        self._passes_started = 0
        self._passes_done = 0
        # The pump thread ends at close(), or when the scheduler is collected without it.
        self._stopper = weakref.finalize(self, _wake, self._kick)

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
                queue.append((key, rank < reads, generation, exact))
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
        """Let the pump make one pass over the intents queued so far, drop those it could
        not start, and wait for the loads in flight; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._passes:
            wanted = self._passes_started + 1  # a pass that starts after this call
        thread = self._thread
        if thread is not None and self.pump():  # no thread yet: nothing was ever queued
            with self._passes:
                if not self._passes.wait_for(
                        lambda: self._passes_done >= wanted or self.stopping or not thread.is_alive(), left()):
                    return False
        with self.cond:
            dropped = len(self.intents) + len(self.exact_intents)
            self.intents.clear()
            self.exact_intents.clear()
            done = self.cond.wait_for(lambda: self.loading == 0, left())
        self.telemetry.add("prefetch_dropped", dropped)
        return done

    def close(self) -> None:
        """No prefetch starts from now on; the pump thread ends (after its pass in progress)."""
        with self.cond:
            self.closed = True
            self.stopping = True
            thread = self._thread
        self._kick.set()
        with self._passes:
            self._passes.notify_all()  # a drain waiting for a pass that will not come
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def pump(self) -> bool:
        """Wake the pump thread to start what the rules allow now (started with the first
        call). Never blocks nor raises; safe from any thread. False once closed, or if the
        thread could not start (`last_error`; the intents wait, acquires read their own)."""
        with self.cond:
            if self.stopping:
                return False
            if self._thread is None:
                thread = threading.Thread(target=_pump_thread, args=(self._kick, weakref.ref(self)),
                                          name="expert-prefetch", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # e.g. the process is out of threads: tried again next time
                    self.last_error = exc
                    return False
                self._thread = thread
        self._kick.set()
        return True

    # The pump thread --------------------------------------------------------------
    def _pass(self) -> None:
        """Start loads while the rules allow (on the pump thread)."""
        with self._passes:
            self._passes_started += 1
        try:
            while self._start_one():
                pass
        except BaseException as exc:  # never kills the pump: counted, the intents an acquire reads itself
            self.last_error = exc
            self.telemetry.add("prefetch_errors")
        finally:
            with self._passes:
                self._passes_done += 1
                self._passes.notify_all()

    def _start_one(self) -> bool:
        """Start the next load the rules allow; False when there is none."""
        staging = self.pipeline.staging
        with self.cond:
            if self.closed or not (self.intents or self.exact_intents):
                return False
            # Reads need a staging buffer and queue depth; loads from the host tier neither.
            picked = self._pick(may_read=staging.free_count > 0 and self.pipeline.reads_inflight < self.depth)
            if picked is None:
                return False
            self.loading += 1
        key, slot, demotions, host_index = picked
        buffer = None
        try:
            self.pipeline.demote(demotions)  # the victim down before the load into its slot
            if host_index is None:
                # Free a moment ago; if an acquire took the last one since, wait for one (this
                # thread only: the slot is reserved, an acquire may be waiting for it).
                buffer = staging.try_take()
                if buffer is None:
                    buffer = staging.take()
        except BaseException as exc:
            if host_index is not None:
                self.host.unpin(host_index, None)
            self.planner.fail(slot, exc)
            self._settled(slot, key, failed=True)
            raise
        unused = self._start(key, slot, buffer, host_index)
        if unused is not None:
            staging.give(unused)
        return True

    # Choosing the next intent ---------------------------------------------------
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
            key, _may_read, generation, _exact = item
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

    def _pick(self, may_read: bool) -> tuple[Key, Slot, Demotions, int | None] | None:  # under lock
        """The next valid intent with a slot reserved for it (pinned, LOADING), the
        demotions its eviction needs and its host-tier slot (taken from the tier here, so
        it cannot leave it before its copy up; None: it is read from the SSD), or None.
        `may_read`: a staging buffer is free and the queue depth allows a read; without it
        only intents the host tier holds start."""
        if self.closed:
            return None
        while self.exact_intents or self.intents:
            item = self._take_exact(may_read)
            reads = may_read  # whether this intent may read the SSD if RAM has not got it
            if item is None:
                if self.intents and may_read and self._guesses_may_read():
                    item = self.intents.popleft()
                else:  # reads wait for depth (guesses: for idle bandwidth); RAM copies need neither
                    item = self._take_ram_guess() if self.host.enabled else None
                    reads = False
                    if item is None:
                        return None
            key, may_read_ssd, generation, exact = item
            if key in self.planner.where:
                continue  # resident or loading already
            if generation != self.generation[key[0]] or len(self.planner.prefetched) >= self.limit:
                self.telemetry.add("prefetch_dropped")
                continue
            host_index = self.host.take(key) if self.host.enabled and key in self.host else None
            if host_index is None and not (reads and may_read_ssd):
                self.telemetry.add("prefetch_dropped")  # not in RAM (any more), and it may not read now
                continue
            reserved = self.planner.reserve_prefetch(key, exact)
            if reserved is None:
                if host_index is not None:
                    self.host.put_back(key, host_index)
                self.telemetry.add("prefetch_dropped")
                continue
            slot, demotions = reserved
            return key, slot, demotions, host_index
        return None

    def _take_exact(self, may_read: bool) -> tuple | None:  # under lock
        """The oldest exact intent that may start now: any, when a read may; else the oldest
        the host tier holds."""
        if not self.exact_intents:
            return None
        if may_read:
            return self.exact_intents.popleft()
        for i, item in enumerate(self.exact_intents):
            if item[0] in self.host:
                del self.exact_intents[i]
                return item
        return None

    # One prefetch load ------------------------------------------------------------
    def _start(self, key: Key, slot: Slot, buffer: int | None, host_index: int | None) -> int | None:
        """Load `key` into `slot` (reserved by `_pick`) from host-tier slot `host_index`
        (taken by the caller), or from the SSD through staging buffer `buffer` (not None
        then); returns `buffer` if it was not used."""
        self.telemetry.add("prefetch_issued")
        layer = self.manifest.layers[key[0]]
        try:
            if host_index is not None:  # RAM -> VRAM, no read
                self.pipeline.copy_up(slot, host_index, layer.read_nbytes)
                self._settled(slot, key)
                return buffer
            assert buffer is not None  # _start_one checked: a read has a staging buffer
            handle = self.pipeline.store.submit(key[0], key[1], self.pipeline.staging.view(buffer), urgent=False)
        except BaseException as exc:  # e.g. the store was closed: counted, never raised into the model
            self.last_error = exc
            self.planner.fail(slot, exc)
            self._settled(slot, key, failed=True)
            return buffer
        with self.cond:
            self.pipeline.reads_inflight += 1
            slot.read = handle
            wanted = slot.pins > 1  # an acquire planned it while it was being submitted: it waits for it
        if wanted:
            self.pipeline.store.promote(handle)
        staged = buffer
        handle.future.add_done_callback(lambda _f: self._landed(key, slot, handle, staged))
        return None

    def _landed(self, key: Key, slot: Slot, handle: ReadHandle, buffer: int) -> None:
        """An I/O thread finished a prefetch read: copy it to its slot and unpin the slot."""
        with self.cond:
            self.pipeline.reads_inflight -= 1
            slot.read = None
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
