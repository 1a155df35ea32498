"""The expert runtime's side of the expert-provider contract (`engine.experts`).

`PackRouting` is the half of `ExpertCache` that model code sees: `routed` (through
`engine.experts.AcquiringProvider`), with the cache's own way of delivering experts
(streaming: resident experts compute while the misses are still being read; a chunk
with more distinct experts than free slots in batches that fit), `hint` (exact
prefetches) and the next-layer guess (speculative prefetches). The sum is added in
ascending expert order whatever the delivery order, so every path gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch

from engine.experts import AcquiringProvider, ExpertWeights, NextLayer

from .errors import CacheCapacityError

if TYPE_CHECKING:
    from .batches import CachedBatch, StreamingBatch


class PackRouting(AcquiringProvider):
    """Mixed into ExpertCache: routed experts from the pack's tiers.

    `streaming` and `prefetching` (both on) are the levers the seed design lacked; the
    benchmarks and the parity check turn them off to run the seed's profile: plain
    acquires (every expert of a layer resident before any computes), no prefetch.
    """

    streaming = True
    prefetching = True

    if TYPE_CHECKING:  # what this half uses of the other: ExpertCache (cache.py) defines them
        def acquire(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> CachedBatch: ...

        def acquire_streaming(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> StreamingBatch: ...

        def acquire_chunks(self, block: int, expert_ids: Sequence[int] | torch.Tensor,
                           max_per_chunk: int | None = None) -> Iterator[CachedBatch]: ...

        def prefetch(self, block: int, expert_ids: Sequence[int] | torch.Tensor, *, exact: bool = True) -> int: ...

    def deliveries(self, block: int, expert_ids: list[int],
                   requested: Callable[[], None]) -> Iterator[tuple[int, ExpertWeights]]:
        try:
            batch = (self.acquire_streaming if self.streaming else self.acquire)(block, expert_ids)
        except CacheCapacityError:
            # More distinct experts than the cache can hold at once (a long prefill chunk
            # with a small cache): take them in batches that fit.
            requested()
            for part in self.acquire_chunks(block, expert_ids):
                with part:
                    for expert in part.expert_ids:
                        yield expert, part[expert]
            return
        with batch:
            requested()
            if self.streaming:
                # Each expert as it becomes resident: resident ones first, misses as their copies land.
                yield from cast("StreamingBatch", batch)  # acquire_streaming made it
            else:
                for expert in expert_ids:
                    yield expert, batch[expert]

    def hint(self, block: int, expert_ids: torch.Tensor) -> None:
        if self.prefetching:
            self.prefetch(block, expert_ids, exact=True)

    def plan_guess(self, next_layer: NextLayer) -> Callable[[], object] | None:
        if not self.prefetching:
            return None
        guess = torch.topk(next_layer.scores(), next_layer.k, dim=-1, sorted=True).indices
        return lambda: self.prefetch(next_layer.block, guess, exact=False)
