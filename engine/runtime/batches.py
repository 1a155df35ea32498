"""The batches an `ExpertCache` hands out: `CachedBatch` (acquire) and `StreamingBatch`.

A batch holds the device slots of one acquire, protected (pinned) from eviction until
it is released (the end of its `with` block); `batch[e]` maps role -> `QuantTensor`
views into expert `e`'s slot (`slot_views`), valid only until then. A streaming batch
also owns the loop that hands its experts out as each becomes usable; the loads
themselves are the cache's load pipeline's, and releasing goes through the cache.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import torch

from expertpack import LayerEntry

from .errors import ExpertReadError
from .slots import READY, Demotions, Key, Slot

if TYPE_CHECKING:
    from engine.experts import QuantTensor

    from .cache import ExpertCache


def slot_views(buffer: torch.Tensor, stride: int, slot: Slot, layer: LayerEntry) -> dict[str, QuantTensor]:
    """Role -> `QuantTensor` view of the expert in `slot` of the device buffer."""
    # Imported here: engine.experts loads the quant kernels, which the store, the
    # policy tools and the benchmark's I/O part do not need.
    from engine.experts import QuantTensor

    base = slot.index * stride
    return {
        role.name: QuantTensor(buffer[base + role.offset : base + role.end], role.ggml_type, role.shape)
        for role in layer.roles
    }


class CachedBatch:
    """The experts of one acquire. Use inside `with`; views are invalid after it exits."""

    def __init__(self, cache: ExpertCache, block: int, layer: LayerEntry, slots: dict[int, Slot]) -> None:
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

    def slot_indices(self, experts: list[int]) -> list[int]:
        """The device slot of each of `experts` (all of this batch), in that order."""
        if self._released:
            raise RuntimeError(f"batch of blk.{self.block} used after it was released (outside its `with` block)")
        return [self._slots[e].index for e in experts]

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
            views = self._views[expert] = slot_views(self._cache.buffer, self._cache.stride, slot, self._layer)
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

    def __init__(self, cache: ExpertCache, block: int, layer: LayerEntry, slots: dict[int, Slot],
                 layer_index: int, loads: list[tuple[Key, Slot]], demotions: Demotions | None = None) -> None:
        super().__init__(cache, block, layer, slots)
        self._layer_index = layer_index
        self._loads = loads
        self._demotions = demotions
        self._delivered: set[int] = set()
        self._iterator: Generator | None = None
        self._loader: Generator[Slot | None, None, ExpertReadError | None] | None = None
        self._loads_started = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, QuantTensor]]]:
        return self._start(views=True)

    def start(self) -> None:
        """Submit this batch's SSD reads now (idempotent; iterating starts them too): the
        drive starts on the misses before the caller does anything else (queue the next
        layer's guess, compute resident experts). Returns once the drive has every read
        it can take now: all submitted, or the I/O queue or the staging buffers full.
        The reads in flight hold staging buffers that only this batch's iteration (or its
        release) gives back: iterate or release it before acquiring more on this thread."""
        if self._loads_started or not self._loads:
            return
        if self._released:
            raise RuntimeError(f"batch of blk.{self.block} used after it was released (outside its `with` block)")
        self._loads_started = True
        self._loader = self._cache._pipeline.load_iter(self._layer_index, self._layer, self._loads,
                                                       self._demotions)
        mark = next(self._loader)
        assert mark is None  # load_iter's first yield is its mark, before any slot

    def settle(self) -> None:
        """Run the whole streaming loop without looking at the experts: on return every
        expert is usable by compute queued after it (the compute stream waits for each
        copy). For callers that read the slots themselves (`slot_indices`): no per-expert
        views are made."""
        for _ in self._start(views=False):
            pass

    def _start(self, views: bool) -> Generator:
        if self._iterator is not None:
            raise RuntimeError(f"a streaming batch of blk.{self.block} can be iterated only once")
        if self._released:
            raise RuntimeError(f"batch of blk.{self.block} used after it was released (outside its `with` block)")
        self._iterator = self._stream(views)
        return self._iterator

    def _stream(self, views: bool) -> Generator[tuple[int, dict[str, QuantTensor] | None], None, None]:
        """The generator behind iteration (see `ExpertCache.acquire_streaming`): resident
        experts first, then each of this batch's loads as its copy is queued, and those
        loaded meanwhile by a prefetch or another acquire; a read error is raised after
        the other experts were delivered or settled."""
        cache, ordered, loads = self._cache, self._slots, self._loads
        own = {slot.index for _key, slot in loads}
        expert_of = {slot.index: e for e, slot in ordered.items()}
        delivered = self._delivered

        def deliver(slot: Slot) -> tuple[int, dict[str, QuantTensor] | None]:
            cache._copier.compute_waits_for([slot.ready_event])
            e = expert_of[slot.index]
            delivered.add(e)
            return e, self[e] if views else None

        def ready_others() -> list[Slot]:
            with cache._planner.cond:
                return [s for e, s in ordered.items()
                        if e not in delivered and s.index not in own and s.state == READY]

        error: ExpertReadError | None = None
        try:
            self.start()  # the reads first: the drive works while the resident experts compute
            loader = self._loader
            for slot in ready_others():  # resident: computable right away
                yield deliver(slot)
            while loader is not None:
                try:
                    loaded = next(loader)
                except StopIteration as stop:
                    error = stop.value
                    break
                assert loaded is not None  # its one mark was taken by `start`
                yield deliver(loaded)
                for other in ready_others():  # loaded meanwhile by a prefetch or another acquire
                    yield deliver(other)
            error = cache._settle(self.block, self._layer_index, ordered.values(), error)
            for slot in ready_others():
                yield deliver(slot)
            if error is not None:
                raise error
        finally:
            self._close_loader()
            if not cache._pipeline.guesses_after_compute:
                cache._pump()

    def _close_loader(self) -> None:
        """Closed early: the loader waits for its reads in flight and fails the rest."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()

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
        self._close_loader()  # started but never iterated
        if not self._loads_started:  # its loads never started: give their slots back unfilled
            self._cache._pipeline.cancel(self._loads, "released before its streaming loop started")
        super().release()
        # On a GPU the experts are queued now: the next layer's guesses may read. (On a CPU
        # the loop's end woke it; a batch released without being iterated wakes it here.)
        self._cache._pump()
