"""The expert runtime's side of the expert-provider contract (`engine.experts`).

`PackRouting` is the half of `ExpertCache` that model code sees: `routed` (through
`engine.experts.AcquiringProvider`), with the cache's own way of delivering experts
(streaming: resident experts compute while the misses are still being read; a chunk
with more distinct experts than free slots in batches that fit), `hint` (exact
prefetches) and the next-layer guess (speculative prefetches). The sum is added in
ascending expert order whatever the delivery order, so every path gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.experts import AcquiringProvider, ExpertWeights, NextLayer

from .errors import CacheCapacityError

if TYPE_CHECKING:
    from .cache import ExpertCache


class PackRouting(AcquiringProvider):
    """Mixed into ExpertCache: routed experts from the pack's tiers.

    `streaming` and `prefetching` (both on) are the levers the seed design lacked; the
    benchmarks and the parity check turn them off to run the seed's profile: plain
    acquires (every expert of a layer resident before any computes), no prefetch.
    """

    streaming = True
    prefetching = True

    def deliveries(self: ExpertCache, block: int, expert_ids: list[int],  # type: ignore[misc]
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
                yield from batch
            else:
                for expert in expert_ids:
                    yield expert, batch[expert]

    def hint(self: ExpertCache, block: int, expert_ids: torch.Tensor) -> None:  # type: ignore[misc]
        if self.prefetching:
            self.prefetch(block, expert_ids, exact=True)

    def plan_guess(self: ExpertCache, next_layer: NextLayer) -> Callable[[], None] | None:  # type: ignore[misc]
        if not self.prefetching:
            return None
        guess = torch.topk(next_layer.scores(), next_layer.k, dim=-1, sorted=True).indices
        return lambda: self.prefetch(next_layer.block, guess, exact=False)
