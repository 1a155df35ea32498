"""The expert runtime's side of the expert-provider contract (`engine.experts`).

`PackRouting` is the half of `ExpertCache` that model code sees: `routed` (through
`engine.experts.AcquiringProvider`), with the cache's own way of delivering experts
(streaming: resident experts compute while the misses are still being read; a chunk
with more distinct experts than free slots in batches that fit), `hint` (exact
prefetches) and the next-layer guess (speculative prefetches). The sum is added in
ascending expert order whatever the delivery order, so every path gives the same bits.

Decode on a GPU (`grouped`): one token's k experts are made resident (streamed in as
above, the guess for the next layer queued behind them), then run as ONE grouped
kernel sequence straight from their device slots (`engine.kernels.moe`): the slot pool
is one tensor, so each role of every slot is a row of a strided table. That is the
kernel `ResidentExperts` runs on the GPU, on the same bytes in the same (token, k)
order, so a pack decodes bit for bit as the resident model does, in ~10 launches a
layer instead of ~15 per expert. On a GPU (`graphed`) that sequence is a CUDA graph
per layer (`engine.graphs.StepGraphs`, keyed by the slot pool): one launch after the
experts' slot numbers are copied up. It reads the router's output in place (a graph's
output buffer) and its own output is read in place by the model's next graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch

from engine.experts import AcquiringProvider, ExpertActivation, ExpertWeights, NextLayer, grouped_applies
from engine.graphs import StepGraphs
from engine.kernels.moe import ExpertRows, grouped_expert_mlp
from expertpack import LayerEntry

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
    grouped = True
    graphed = True  # a grouped decode step's expert kernels replay as one CUDA graph per layer

    if TYPE_CHECKING:  # what this half uses of the other: ExpertCache (cache.py) defines them
        buffer: torch.Tensor
        stride: int

        def _layer(self, block: int) -> tuple[int, LayerEntry]: ...

        def acquire(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> CachedBatch: ...

        def acquire_streaming(self, block: int, expert_ids: Sequence[int] | torch.Tensor) -> StreamingBatch: ...

        def acquire_chunks(self, block: int, expert_ids: Sequence[int] | torch.Tensor,
                           max_per_chunk: int | None = None, *, streaming: bool = False
                           ) -> Iterator[CachedBatch]: ...

        def prefetch(self, block: int, expert_ids: Sequence[int] | torch.Tensor, *, exact: bool = True) -> int: ...

    def deliveries(self, block: int, expert_ids: list[int],
                   requested: Callable[[], None]) -> Iterator[tuple[int, ExpertWeights]]:
        try:
            batch = (self.acquire_streaming if self.streaming else self.acquire)(block, expert_ids)
        except CacheCapacityError:
            # More distinct experts than the cache can hold at once (a long prefill chunk
            # with a small cache): take them in batches that fit, each streamed as below
            # when `streaming`.
            requested()
            for part in self.acquire_chunks(block, expert_ids, streaming=self.streaming):
                with part:
                    yield from self._handed_out(part, part.expert_ids)
            return
        with batch:
            if self.streaming:
                cast("StreamingBatch", batch).start()  # the drive first, then the guess (`requested`)
            requested()
            yield from self._handed_out(batch, expert_ids)

    def _handed_out(self, batch: CachedBatch, expert_ids: Sequence[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) for each expert of `batch`: with `streaming` (acquire_streaming
        made it) as each becomes resident, resident ones first, misses as their copies
        land; else in the order of `expert_ids`."""
        if self.streaming:
            yield from cast("StreamingBatch", batch)
        else:
            for expert in expert_ids:
                yield expert, batch[expert]

    def routed(self, block: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               activation: ExpertActivation, next_layer: NextLayer | None = None) -> torch.Tensor:
        rows = self._slot_rows(block) if self._grouped_for(x, chosen) else None
        if rows is None:
            return super().routed(block, x, chosen, weights, activation, next_layer)
        guess = self._guess_ids(next_layer)
        flat = chosen.reshape(-1)
        # The layer's one host sync: its experts and the next layer's guess together.
        ids = (flat if guess is None else torch.cat([flat, guess.reshape(-1).to(flat.dtype)])).tolist()
        picks, guessed = [int(e) for e in ids[: flat.numel()]], ids[flat.numel():]
        try:
            batch = (self.acquire_streaming if self.streaming else self.acquire)(block, picks)
        except CacheCapacityError:  # a cache smaller than one token's experts: batches that fit
            return super().routed(block, x, chosen, weights, activation, next_layer)
        with batch:
            if self.streaming:
                # This layer's reads are submitted before the guess is queued (whose pump
                # would take the GIL from these submits) and before the resident experts'
                # waits are queued: the drive starts ~0.1 ms sooner.
                cast("StreamingBatch", batch).start()
            if guess is not None and next_layer is not None:
                self.prefetch(next_layer.block, guessed, exact=False)
            if self.streaming:
                cast("StreamingBatch", batch).settle()  # the compute stream waits for every expert's copy
            slots = torch.tensor(batch.slot_indices(picks), dtype=torch.int64).view(chosen.shape)
            gate, up, down = rows["gate"], rows["up"], rows["down"]

            def experts(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                # In a graph `slots` is already its device copy (copied up before each replay).
                return grouped_expert_mlp(x, slots.to(x.device, non_blocking=True), weights, gate, up, down,
                                          activation)

            if not self.graphed:
                return experts(x, slots, weights)
            # The graph reads the slot pool by address: keyed by it (a new pool, new graphs).
            key = ("experts", block, self.buffer.data_ptr(), self.buffer.numel())
            return self._expert_graphs().run(key, experts, x, slots, weights)

    def _grouped_for(self, x: torch.Tensor, chosen: torch.Tensor) -> bool:
        return self.grouped and grouped_applies(x, chosen.shape[-1])

    def _slot_rows(self, block: int) -> dict[str, ExpertRows] | None:
        """Each role of the layer of `block` as a table whose row i is slot i's bytes of
        that role (None when its experts are not gate/up/down: the reference path). Views
        of the slot pool, kept until the pool is replaced (`_forget_slot_rows`)."""
        tables = self.__dict__.setdefault("_slot_tables", {})
        if block not in tables:
            _index, layer = self._layer(block)
            roles = {role.name: role for role in layer.roles}
            rows = None
            if set(roles) == {"gate", "up", "down"}:
                n_slots = self.buffer.numel() // self.stride
                pool = self.buffer[: n_slots * self.stride].view(n_slots, self.stride)
                rows = {name: ExpertRows(pool[:, r.offset : r.end], r.ggml_type, (r.shape[0], r.shape[1]))
                        for name, r in roles.items()}
            tables[block] = rows
        return tables[block]

    def _expert_graphs(self) -> StepGraphs:
        """The graphs of the grouped expert kernels (`graphed`), made at the first decode step."""
        graphs = self.__dict__.get("_graphs")
        if graphs is None:
            graphs = self.__dict__["_graphs"] = StepGraphs()
        return graphs

    def _forget_slot_rows(self) -> None:
        """Drop the views of the slot pool: it is being replaced, and a view would keep it
        alive; and the graphs that read the old one."""
        self.__dict__.pop("_slot_tables", None)
        graphs = self.__dict__.get("_graphs")
        if graphs is not None:
            graphs.reset()

    def hint(self, block: int, expert_ids: torch.Tensor) -> None:
        if self.prefetching:
            self.prefetch(block, expert_ids, exact=True)

    def plan_guess(self, next_layer: NextLayer) -> Callable[[], object] | None:
        guess = self._guess_ids(next_layer)
        if guess is None:
            return None
        return lambda: self.prefetch(next_layer.block, guess, exact=False)

    def _guess_ids(self, next_layer: NextLayer | None) -> torch.Tensor | None:
        """The next layer's likeliest experts on this layer's input, likeliest first
        (queued on the device; None without prefetching or a next layer)."""
        if not self.prefetching or next_layer is None:
            return None
        return torch.topk(next_layer.scores(), next_layer.k, dim=-1, sorted=True).indices
