"""Kimi-K3's decode state in fixed-shape buffers, for whole-step CUDA graphs.

The KDA layers' state is fixed-shape already (the conv tails and the recurrent state
S); the eager code replaces those tensors every step, so here they are buffers the step
writes in place. The MLA layers' cache grows by one row a step: here it is a buffer of
`capacity` rows, the step writes row P and attends to the first `bucket` rows (a power
of two above P, at least MIN_BUCKET), masking the rows after P. A graph serves every
step until the bucket grows. `bank` holds a step's AttnRes snapshots when the step
runs as several graphs (a pack's experts between them): no state, rows each step
writes before it reads them. As for DeepSeek-V4 (`deepseek4_static`), the model keeps
one such state and moves a conversation's rows in (`load`) and out (`store`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import GrowingRows
from .static_state import MIN_BUCKET, StepBuffers, bucket, grown


@dataclass
class StaticKDA:
    conv: list[torch.Tensor]  # q, k, v conv tails [conv_kernel - 1, channels]
    recurrent: torch.Tensor  # [heads, key, value], float32


@dataclass
class StaticMLA:
    cache: torch.Tensor  # [capacity, kv_lora_rank + rope]


class KimiStaticState(StepBuffers):
    """One conversation's Kimi-K3 state in fixed-shape buffers (module docstring)."""

    def __init__(self, layers: list[StaticKDA | StaticMLA], bank: torch.Tensor) -> None:
        self.layers = layers
        self.bank = bank  # [banked layers, hidden], the stream's dtype

    @classmethod
    def like(cls, eager, bank: torch.Tensor) -> KimiStaticState:
        """Buffers shaped like an empty eager `KimiK3State`, and the bank rows `bank`."""
        layers: list[StaticKDA | StaticMLA] = []
        for st in eager.layers:
            if hasattr(st, "recurrent"):
                layers.append(StaticKDA([torch.zeros_like(t) for t in st.conv], torch.zeros_like(st.recurrent)))
            else:
                rows = st.cache.capacity
                layers.append(StaticMLA(rows.new_zeros((MIN_BUCKET, rows.shape[1]))))
        return cls(layers, bank)

    def tensors(self, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """The buffers layers first .. last (default: all) write in a step, and the bank."""
        out: list[torch.Tensor] = []
        for layer in self.layers[first : None if last is None else last + 1]:
            out += [*layer.conv, layer.recurrent] if isinstance(layer, StaticKDA) else [layer.cache]
        return out + [self.bank]

    @staticmethod
    def rows(position: int) -> int:
        """Cache rows an MLA layer reads in the step at `position`."""
        return bucket(position + 1)

    def ensure_capacity(self, position: int) -> bool:
        """Grow the MLA caches for the step at `position`; True if one was reallocated."""
        need = self.rows(position)
        reallocated = False
        for layer in self.layers:
            if isinstance(layer, StaticMLA):
                before = layer.cache
                layer.cache = grown(before, need)
                reallocated |= layer.cache is not before
        return reallocated

    def load(self, eager) -> None:
        """Take over an eager `KimiK3State` (the buffers grown for it: `prepare`)."""
        for sl, el in zip(self.layers, eager.layers):
            if isinstance(sl, StaticKDA):
                for buffer, tail in zip(sl.conv, el.conv):
                    buffer.copy_(tail)
                sl.recurrent.copy_(el.recurrent)
            else:  # the rows live here now: the eager cache is let go (store() rebuilds it)
                sl.cache[el.cache.n:].zero_()  # no row of another conversation stays (masked rows are read)
                sl.cache[: el.cache.n] = el.cache.rows
                el.cache = GrowingRows(sl.cache.shape[1], sl.cache.dtype, sl.cache.device)

    def store(self, eager) -> None:
        for sl, el in zip(self.layers, eager.layers):
            if isinstance(sl, StaticKDA):
                el.conv = [t.clone() for t in sl.conv]
                el.recurrent = sl.recurrent.clone()
            else:
                rows = GrowingRows(sl.cache.shape[1], sl.cache.dtype, sl.cache.device)
                rows.append(sl.cache[: eager.position])
                el.cache = rows
