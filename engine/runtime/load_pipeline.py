"""The load pipeline: SSD -> staging buffer -> host-RAM tier -> VRAM slot.

`LoadPipeline` moves every byte of the expert cache into and out of the device
buffer (which it holds) and fills the slots the slot planner (slots.py) reserved:

- `load_iter` / `load`: one acquire's loads. A deep I/O queue: all its SSD reads are
  submitted before its host-tier copies, up to `max_inflight` experts (each split
  into the store's `read_splits` sub-reads) in flight; with `pipeline_h2d` (the
  default) each expert's host-to-device copy is queued the moment its read lands,
  in completion order; `pipeline_h2d=False` reproduces the seed design: copy only
  after every read of the acquire has landed.
- One function per hop, for acquires and prefetches alike: `copy_up` (host-tier
  slot -> device slot: a RAM hit, no read) and `copy_staged` (a landed staging
  buffer -> device slot). Both publish the slot and give their source back.
- Exclusive tiers (host_tier.py): `take` takes the RAM copies of experts about to
  load, then `demote` copies the experts the device tier evicted down into the host
  tier, on the copy-down stream, before the loads that overwrite their slots (an
  acquire's once its reads are submitted: the drive starts first; in the order its
  loads fill the slots), so VRAM and RAM together cache `slot_count + host slots`
  distinct experts.

It also keeps the drive's queue accounting, which the prefetch scheduler reads (all
under the cache's lock, the slot planner's `cond`): `demand_pending` (planned
acquire loads not yet submitted or copied from RAM), `demand_reads` (acquire reads
in flight), `reads_inflight` (expert reads in flight, acquires and prefetches).
Whenever an acquire read lands (but the last: its batch's release wakes the pump, see
`guesses_after_compute`), and once its reads are all submitted, it calls `reads_freed`
(which wakes the prefetch pump): queue depth was freed, or guesses may now queue
behind the acquire's reads. Copy ordering on CUDA: transfer.py.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import Future, wait
from queue import SimpleQueue

import torch

from expertpack import LayerEntry

from .errors import ExpertReadError
from .host_tier import HostTier
from .slots import Demotions, Key, Slot, SlotPlanner
from .staging import StagingPool
from .store import ExpertStore, ReadHandle
from .telemetry import Telemetry
from .transfer import DeviceCopier


class LoadPipeline:
    """Fills reserved device slots from the host tier or the SSD (see module docstring).

    `max_inflight` defaults to the store's staging buffers; `reads_freed` is called
    (without the lock) whenever an acquire read landed."""

    def __init__(self, store: ExpertStore, planner: SlotPlanner, buffer: torch.Tensor, *, stride: int,
                 copier: DeviceCopier, host: HostTier, telemetry: Telemetry, max_inflight: int | None,
                 pipeline_h2d: bool, reads_freed: Callable[[], None]) -> None:
        self.store = store
        self.planner = planner
        self.cond = planner.cond
        self.buffer = buffer  # the device tier: slot i is bytes [i * stride, (i + 1) * stride)
        self.stride = stride
        self.copier = copier
        self.host = host
        self.telemetry = telemetry
        self.max_inflight = max(1, max_inflight if max_inflight is not None else store.staging.count)
        self.pipeline_h2d = pipeline_h2d
        self.reads_freed = reads_freed
        # On a GPU, an acquire's last read landing does not wake the prefetch pump: the
        # batch's release does, once the experts are queued (see `StreamingBatch.release`).
        # Woken at the last landing, the pump started the next layer's guess reads just as
        # the model's thread copied that expert up and launched the experts, and took the
        # GIL from it: the middle layers (with a guess) ran 0.75 ms slower there than the
        # last one (without). On a CPU the experts' compute is the long part, and the
        # guesses' reads should overlap it: the pump is woken at the last landing.
        self.guesses_after_compute = buffer.device.type == "cuda"
        self.demand_pending = 0  # planned acquire loads not yet submitted (or copied from RAM)
        self.demand_reads = 0  # acquire reads in flight
        self.reads_inflight = 0  # expert reads in flight (acquires + prefetches)

    @property
    def staging(self) -> StagingPool:
        return self.store.staging

    # One hop each ---------------------------------------------------------------
    def copy_into(self, slot: Slot, src: torch.Tensor, src_ready: torch.cuda.Event | None = None
                  ) -> torch.cuda.Event | None:
        """Queue the copy of `src` (host memory, written by the copy `src_ready` if any) into
        `slot`, after the compute that last read the slot and the copy down of the expert it
        held; returns the copy's event (None on CPU)."""
        base = slot.index * self.stride
        dst = self.buffer[base : base + src.numel()]
        with self.cond:
            after, slot.use_events = slot.use_events, []
        event = self.copier.copy(dst, src, [*after, src_ready])
        self.telemetry.add("h2d_bytes", src.numel())
        return event

    def copy_up(self, slot: Slot, host_index: int, nbytes: int) -> None:
        """RAM -> VRAM: copy the first `nbytes` of host-tier slot `host_index` (taken from
        the tier, pinned) into `slot` and publish it. The host slot is unpinned either way
        (once the copy ends, if it was queued)."""
        try:
            event = self.copy_into(slot, self.host.view(host_index)[:nbytes], self.host.filled_by(host_index))
        except BaseException:
            self.host.unpin(host_index, None)
            raise
        self.host.unpin(host_index, event)
        self.planner.publish(slot, event)

    def copy_staged(self, slot: Slot, src: torch.Tensor, buffer: int) -> None:
        """Staging -> VRAM: copy a landed read `src` (in staging buffer `buffer`) into `slot`
        and publish it. The buffer is given back either way (reused once the copy ends)."""
        try:
            event = self.copy_into(slot, src)
        except BaseException:
            self.staging.give(buffer)
            raise
        self.staging.give(buffer, after=event)
        self.planner.publish(slot, event)

    # Exclusive tiers ------------------------------------------------------------
    def take(self, keys: list[Key]) -> list[int | None]:
        """The RAM copies of the loads of `keys` (slots just reserved): host slot per key, or
        None. Taken before their victims are demoted, so that a demotion that needs a RAM
        slot cannot evict an expert about to move up."""
        return [self.host.take(key) if self.host.enabled else None for key in keys]

    def demote(self, demotions: Demotions) -> None:
        """Copy evicted experts down into the host tier (exclusive tiers, see host_tier.py).

        On the copy-down stream, after the copy that filled the device slot; the load that
        will overwrite that slot (queued later) waits for it (the slot's `use_events`), and
        so does any copy back up (the host slot's `filled_by`). Best effort: a tier with
        every slot pinned, or a failed copy (counted in `demotion_errors`), just drops the
        expert; never raises. No-op without a host tier."""
        if not self.host.enabled:
            return
        for key, index, filled in demotions:
            reserved = self.host.reserve(key)
            if reserved is None:
                continue
            host_index, copies_out = reserved
            base = index * self.stride
            try:
                event = self.copier.copy_down(self.host.view(host_index), self.buffer[base : base + self.stride],
                                              after=[*copies_out, filled])
            except Exception:  # never raised into an acquire: the expert is simply not kept in RAM
                self.host.abort(host_index)
                self.telemetry.add("demotion_errors")
                continue
            if event is not None:
                with self.cond:
                    slot = self.planner.slots[index]
                    slot.use_events = [*slot.use_events, event]
            self.host.publish(host_index, event)
            self.host.unpin(host_index, event)
            self.telemetry.add_many(host_demotions=1, d2h_bytes=self.stride)

    def cancel(self, loads: list[tuple[Key, Slot]], reason: str) -> None:
        """Planned loads that will never run: no longer pending, their host-tier slots given
        back, their slots failed with RuntimeError(reason) (the owner's release unpins them)."""
        with self.cond:
            self.demand_pending -= len(loads)
        for _key, slot in loads:
            host_index, slot.host_source = slot.host_source, None
            if host_index is not None:
                self.host.unpin(host_index, None)
            self.planner.fail(slot, RuntimeError(reason))

    # One acquire's loads --------------------------------------------------------
    def load(self, layer_index: int, layer: LayerEntry, loads: list[tuple[Key, Slot]],
             demotions: Demotions | None = None) -> ExpertReadError | None:
        """Fill the slots of `loads`; the first read error, if any (see `load_iter`)."""
        loader = self.load_iter(layer_index, layer, loads, demotions)
        while True:
            try:
                next(loader)
            except StopIteration as stop:
                return stop.value

    def load_iter(self, layer_index: int, layer: LayerEntry, loads: list[tuple[Key, Slot]],
                  demotions: Demotions | None = None) -> Generator[Slot | None, None, ExpertReadError | None]:
        """Fill the slots of `loads` from the host tier or the SSD, yielding each slot once
        its copy is queued (usable by compute queued after it); returns the first read
        error, if any. Its first yield is None, once: the drive has every read it can take
        now (all submitted, or the I/O queue or the staging buffers full), nothing else is
        done yet (`StreamingBatch.start` runs it to there).

        SSD reads (into staging buffers) are submitted first, so the drive starts at once;
        then the victims of these loads (`demotions`, their RAM copies already taken) are
        copied down, before any copy up can overwrite their slots (their copy calls cost
        the host about as much as the reads' submits: made first, they kept the drive
        waiting); then host-tier hits are copied up. Up to `max_inflight` reads are in
        flight; with `pipeline_h2d` each finished read is copied to its slot at once, in
        completion order, else only after every read of this call has landed (the seed).
        Closing the generator early waits for its reads in flight and fails the rest.
        """
        nbytes = layer.read_nbytes
        staging = self.staging
        inflight: dict[Future, tuple[Slot, ReadHandle, int]] = {}  # -> (slot, read, staging buffer)
        held: list[tuple[Slot, torch.Tensor, int]] = []  # landed, copy deferred (seed)
        done_slots: set[int] = set()
        first_error: ExpertReadError | None = None
        current: int | None = None  # a staging buffer taken but not yet in flight
        host_hits: list[tuple[Slot, int]] = []
        ssd: list[tuple[Key, Slot]] = []
        ready: list[Slot] = []  # published, not yet yielded

        # The victims go down in the order their slots fill up (RAM hits first, then the reads
        # in submit order): each slot's load waits for its own victim's copy down.
        order = {slot.index: (slot.host_source is None, i) for i, (_key, slot) in enumerate(loads)}
        pending_demotions = sorted(demotions or (), key=lambda d: order.get(d[1], (True, len(order))))

        def demote_once() -> None:
            """The victims down before the first copy up (any of which may overwrite one)."""
            if pending_demotions:
                self.demote(pending_demotions)
                pending_demotions.clear()

        def copy_landed(slot: Slot, src: torch.Tensor, buffer: int) -> None:
            demote_once()
            self.copy_staged(slot, src, buffer)
            done_slots.add(slot.index)
            ready.append(slot)

        def flush_held() -> None:
            while held:
                copy_landed(*held.pop(0))

        landed: SimpleQueue[Future] = SimpleQueue()  # our reads' futures as each completes

        def finish_some() -> None:
            nonlocal first_error
            finished = [landed.get()]  # wait for one, then take every other that landed meanwhile
            while not landed.empty():
                finished.append(landed.get_nowait())
            for future in finished:
                slot, handle, buffer = inflight.pop(future)
                with self.cond:
                    self.reads_inflight -= 1
                    self.demand_reads -= 1
                try:
                    src = handle.result()
                except ExpertReadError as exc:
                    staging.give(buffer)
                    self.planner.fail(slot, exc)
                    done_slots.add(slot.index)
                    first_error = first_error or exc
                    continue
                if self.pipeline_h2d:
                    copy_landed(slot, src, buffer)
                else:
                    held.append((slot, src, buffer))
            if not inflight and not self.pipeline_h2d:
                flush_held()
            if inflight or unsubmitted or not self.guesses_after_compute:
                self.reads_freed()  # read queue depth freed: prefetches may use it

        unsubmitted = len(loads)  # counted in self.demand_pending until issued
        marked = False  # the None after the submits was yielded

        def issued(n: int = 1) -> None:
            nonlocal unsubmitted
            with self.cond:
                unsubmitted -= n
                self.demand_pending -= n

        try:
            for key, slot in loads:
                host_index, slot.host_source = slot.host_source, None  # taken when it was planned
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
                if stage is None and not marked:
                    marked = True
                    yield None  # the queue is full: the caller may go on until it must wait
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
                with self.cond:
                    self.reads_inflight += 1
                    self.demand_reads += 1
                inflight[handle.future] = (slot, handle, current)
                handle.future.add_done_callback(landed.put)
                issued()
                current = None
                if len(inflight) >= self.max_inflight and not marked:
                    marked = True
                    yield None
                while len(inflight) >= self.max_inflight:
                    finish_some()
                while ready:
                    yield ready.pop(0)
            if not marked:
                marked = True
                yield None
            if ssd:
                self.reads_freed()  # every read submitted: guesses ("tail") may queue behind them
            demote_once()
            while host_hits:  # RAM -> VRAM while the drive works on the reads above
                slot, host_index = host_hits.pop(0)
                self.copy_up(slot, host_index, nbytes)
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
            with self.cond:
                self.reads_inflight -= len(inflight)
                self.demand_reads -= len(inflight)
            for _slot, _handle, buffer in inflight.values():
                staging.give(buffer)
            inflight.clear()
            for _slot, _src, buffer in held:
                staging.give(buffer)
            held.clear()
            for _slot, host_index in host_hits:
                self.host.unpin(host_index, None)
            if current is not None:
                staging.give(current)
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self.planner.fail(slot, exc)
            raise
        finally:
            if unsubmitted:
                issued(unsubmitted)
        if first_error is not None:
            for _key, slot in loads:
                if slot.index not in done_slots:
                    self.planner.fail(slot, ExpertReadError(
                        f"not loaded because an earlier read of this acquire failed: {first_error}",
                        layer_index=layer_index, cause=first_error))
        return first_error
