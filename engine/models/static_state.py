"""What the models' fixed-shape decode states share (`deepseek4_static`, `kimi_k3_static`).

A model keeps ONE set of fixed-shape buffers (like llama.cpp keeps one KV cache): a
CUDA graph captured on them replays for every step of every conversation. A
conversation's eager state (`DeepSeek4State`, `KimiK3State`) moves in with `take` at
its first decode step (its `in_static` flag then says its own tensors are stale) and
out with `give_back` before a prefill chunk runs on it or when another conversation
takes the buffers.

Buffers that grow with the context are read up to a `bucket` of rows, a power of two:
a graph serves every step until the bucket doubles.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_BUCKET = 64  # rows a step reads at least (cheap: 64 rows)


def bucket(rows: int) -> int:
    """The rows a step reads when `rows` exist: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, rows - 1).bit_length())


def grown(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """`buffer` [n, width] itself when it has `rows` rows, else a zeroed copy with room for
    max(rows, 2 n) (doubling: few reallocations, each of which drops the graphs)."""
    if rows <= buffer.shape[0]:
        return buffer
    bigger = buffer.new_zeros((max(rows, 2 * buffer.shape[0]), buffer.shape[1]))
    bigger[: buffer.shape[0]] = buffer
    return bigger


class StepBuffers:
    """One model's fixed-shape decode buffers and the eager state they hold (`owner`)."""

    owner: Any = None

    def ensure_capacity(self, position: int) -> bool:
        """Grow the buffers for the step at `position`; True if any was reallocated."""
        raise NotImplementedError

    def load(self, eager: Any) -> None:
        """Copy an eager state's rows into the buffers."""
        raise NotImplementedError

    def store(self, eager: Any) -> None:
        """Write the buffers back into the eager state."""
        raise NotImplementedError

    def prepare(self, eager: Any, graphs: Any) -> None:
        """Ready the buffers for `eager`'s next step: grown first (dropping every graph of
        `graphs`, a StepGraphs, that holds the old ones), then taken over, so that no
        graph is ever replayed on a buffer that was reallocated."""
        if self.ensure_capacity(eager.position):
            graphs.reset()
        self.take(eager)

    def take(self, eager: Any) -> None:
        """Make the buffers hold `eager`: the conversation holding them gets its rows back first."""
        if self.owner is eager:
            return
        if self.owner is not None:
            self.give_back(self.owner)
        self.load(eager)
        eager.in_static = True
        self.owner = eager

    def give_back(self, eager: Any) -> None:
        """Store the buffers into `eager` (before an eager chunk runs on it)."""
        if self.owner is not eager:
            if eager.in_static:  # its rows were in buffers that are gone: nothing can bring them back
                raise RuntimeError("this conversation's state was held by another model's decode buffers")
            return
        if eager.in_static:
            self.store(eager)
        eager.in_static = False
        self.owner = None
