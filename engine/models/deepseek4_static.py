"""DeepSeek-V4's attention state in fixed-shape buffers, for whole-step CUDA graphs.

A decode step's attention state grows: the sliding window fills up, compressor windows
open and close, compressed entries pile up. The eager state (`deepseek4.LayerState`)
holds exactly the rows that exist, so its tensors change shape every step and no CUDA
graph can hold the attention; launched op by op from Python, the step costs the host
~100 launches per layer while the GPU idles.

`StaticState` keeps the same information in buffers whose shapes do not change from
one step to the next, and the step reads its position from a device tensor:

- `window` [W, head_dim]: a ring of the keys of positions P - W + 1 .. P after the
  step at P, row p % W holding position p (one row written per step, nothing moved);
  rows no position has reached yet (r > P) are masked in the softmax.
- per compressor, `pending_kv` / `pending_gate` [ratio, width]: the open window, slot
  P % ratio written at P (slots not yet written this window hold the last window's
  rows, never pooled: see below);
  `overlap_kv` / `overlap_gate` [ratio, head_dim]: CSA's first half of the last closed
  window, as in the eager state; `entries` [capacity, head_dim]: every entry so far.
- The step that closes a window (P % ratio = ratio - 1) pools it into entry P // ratio,
  exactly what the eager code computes. Until then that row holds nothing of this
  window and is masked out of attention and the indexer (entry w is visible to the
  query at P iff w < (P + 1) // ratio, as in the eager code).

Attention and the indexer read the first `bucket` rows of `entries` (a power of two at
least P // ratio + 1), so a graph serves every step until the bucket grows: about log2
of the context captures per conversation. A state moves between the eager and the
static form with `load` / `store` (a prefill chunk after a reply runs eagerly); the
model keeps one `StaticState`, like llama.cpp keeps one KV cache, and hands it to the
conversation whose step runs (`static_state.StepBuffers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import GrowingRows
from .static_state import StepBuffers, bucket, grown

__all__ = ["StaticCompressor", "StaticLayer", "StaticState"]


@dataclass
class StaticCompressor:
    ratio: int
    overlap: bool
    pending_kv: torch.Tensor  # [ratio, width]
    pending_gate: torch.Tensor  # [ratio, width]
    overlap_kv: torch.Tensor  # [ratio, head_dim]
    overlap_gate: torch.Tensor  # [ratio, head_dim], float32 (the gate plus ape, as the eager state keeps it)
    entries: torch.Tensor  # [capacity, head_dim]

    @classmethod
    def empty(cls, ratio: int, width: int, head_dim: int, overlap: bool, capacity: int, dtype: torch.dtype,
              wide: torch.dtype, device: torch.device) -> StaticCompressor:
        def z(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(ratio, overlap, z(ratio, width), z(ratio, width), z(ratio, head_dim), z(ratio, head_dim, dt=wide),
                   z(capacity, head_dim))

    def tensors(self) -> list[torch.Tensor]:
        return [self.pending_kv, self.pending_gate, self.overlap_kv, self.overlap_gate, self.entries]

    def load(self, eager, position: int) -> None:
        """Copy an eager `CompressorState` (after `position` tokens) into the buffers."""
        open_rows = position % self.ratio
        for buffer in self.tensors():  # no row of another conversation stays (masked rows are read)
            buffer.zero_()
        self.pending_kv[:open_rows] = eager.pending_kv
        self.pending_gate[:open_rows] = eager.pending_gate
        if eager.overlap_kv is not None:
            self.overlap_kv.copy_(eager.overlap_kv)
            self.overlap_gate.copy_(eager.overlap_gate)
        self.entries[: eager.entries.n] = eager.entries.rows
        # The rows live here now: the eager copy is let go (store() rebuilds it), so a
        # conversation's entries are not held twice.
        eager.entries = GrowingRows(self.entries.shape[1], self.entries.dtype, self.entries.device)

    def store(self, eager, position: int) -> None:
        """Write the buffers back into an eager `CompressorState` (after `position` tokens)."""
        open_rows = position % self.ratio
        eager.pending_kv = self.pending_kv[:open_rows].clone()
        eager.pending_gate = self.pending_gate[:open_rows].clone()
        closed = position // self.ratio
        if self.overlap and closed > 0:
            eager.overlap_kv = self.overlap_kv.clone()
            eager.overlap_gate = self.overlap_gate.clone()
        rows = GrowingRows(self.entries.shape[1], self.entries.dtype, self.entries.device)
        rows.append(self.entries[:closed])
        eager.entries = rows


def _ring_rows(first: int, n: int, window: torch.Tensor) -> torch.Tensor:
    """The window rows of positions first .. first + n - 1, in order."""
    return torch.arange(first, first + n, device=window.device) % window.shape[0]


@dataclass
class StaticLayer:
    window: torch.Tensor  # [W, head_dim]
    compressor: StaticCompressor | None
    indexer: StaticCompressor | None

    def compressors(self) -> list[StaticCompressor]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer this layer's step writes."""
        return [self.window] + [t for c in self.compressors() for t in c.tensors()]


class StaticState(StepBuffers):
    """The attention state of one conversation in fixed-shape buffers (module docstring)."""

    def __init__(self, layers: list[StaticLayer]) -> None:
        self.layers = layers

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer a step writes (what a graph's warm-up run must leave untouched)."""
        return [t for layer in self.layers for t in layer.tensors()]

    def rows(self, position: int) -> dict[int, int]:
        """Entry rows the attention of each compress ratio reads in the step at `position`."""
        return {c.ratio: bucket(position // c.ratio + 1) for layer in self.layers for c in layer.compressors()}

    def ensure_capacity(self, position: int) -> bool:
        """Grow the entry buffers for the step at `position`; True if any was reallocated
        (graphs that captured the old buffers must then be dropped)."""
        rows = self.rows(position)
        reallocated = False
        for layer in self.layers:
            for c in layer.compressors():
                before = c.entries
                c.entries = grown(before, rows[c.ratio])
                reallocated |= c.entries is not before
        return reallocated

    def load(self, eager) -> None:
        """Take over an eager `DeepSeek4State`: its rows into the buffers (grown for them)."""
        position = eager.position
        for sl, el in zip(self.layers, eager.layers):
            sl.window.zero_()
            kept = el.window.shape[0]  # positions position - kept .. position - 1
            if kept:
                sl.window[_ring_rows(position - kept, kept, sl.window)] = el.window
            el.window = el.window[:0].clone()
            if sl.compressor is not None:
                sl.compressor.load(el.compressor, position)
            if sl.indexer is not None:
                sl.indexer.load(el.indexer, position)

    def store(self, eager) -> None:
        """Write the buffers back into `eager` (its eager fields were stale while it was loaded)."""
        position = eager.position
        for sl, el in zip(self.layers, eager.layers):
            kept = min(position, sl.window.shape[0] - 1)
            el.window = sl.window[_ring_rows(position - kept, kept, sl.window)] if kept else sl.window[:0].clone()
            if sl.compressor is not None:
                sl.compressor.store(el.compressor, position)
            if sl.indexer is not None:
                sl.indexer.store(el.indexer, position)
