"""How model code gets routed-expert weights, whatever tier they come from.

A model's MoE layer calls `provider.acquire(block, expert_ids)` and uses the returned
batch inside a `with` block: every requested expert is delivered (nothing skipped or
substituted), each as its roles' quantized bytes. The expert runtime (`ExpertCache`)
and the all-resident `ResidentExperts` below implement the same protocol, so the model
never knows whether a weight came from VRAM, RAM or SSD.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kernels import dequantize, quant_matmul


@dataclass(frozen=True)
class QuantTensor:
    """A tensor kept in its GGML type: raw bytes (1-D uint8) plus type and numpy-order shape."""

    raw: torch.Tensor
    ggml_type: int
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values in `dtype`, on the bytes' device."""
        return dequantize(self.raw, self.ggml_type, self.shape, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for this 2-D weight W of shape (out_features, in_features)."""
        return quant_matmul(x, self.raw, self.ggml_type, self.shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device


ExpertWeights = Mapping[str, QuantTensor]
"""One expert's weights: role name (`gate`, `up`, `down`, ...) -> tensor."""


class ExpertBatch(Protocol):
    """The experts of one acquire; valid (and protected from eviction) inside `with`."""

    def __getitem__(self, expert: int) -> ExpertWeights: ...

    def __enter__(self) -> ExpertBatch: ...

    def __exit__(self, *exc: object) -> None: ...


class ExpertProvider(Protocol):
    """Source of routed-expert weights for model code."""

    def acquire(self, block: int, expert_ids: Sequence[int]) -> ExpertBatch:
        """Deliver every expert in `expert_ids` of model block `block` (blk.N)."""
        ...


class _ResidentBatch:
    def __init__(self, experts: dict[int, ExpertWeights]) -> None:
        self._experts = experts

    def __getitem__(self, expert: int) -> ExpertWeights:
        return self._experts[expert]

    def __enter__(self) -> _ResidentBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class ResidentExperts:
    """All routed experts held in memory: the reference the expert runtime must equal.

    `stacked[block][role]` is the whole stacked tensor of that role (experts outermost),
    as GGML bytes; one expert's slice is a zero-copy view of it.
    """

    def __init__(self, stacked: Mapping[int, Mapping[str, QuantTensor]]) -> None:
        self._stacked = {block: dict(roles) for block, roles in stacked.items()}

    def acquire(self, block: int, expert_ids: Sequence[int]) -> _ResidentBatch:
        roles = self._stacked[block]
        experts: dict[int, ExpertWeights] = {}
        for expert in dict.fromkeys(int(e) for e in expert_ids):
            experts[expert] = {name: _expert_slice(t, expert) for name, t in roles.items()}
        return _ResidentBatch(experts)


def _expert_slice(stacked: QuantTensor, expert: int) -> QuantTensor:
    n_experts = stacked.shape[0]
    if not 0 <= expert < n_experts:
        raise IndexError(f"expert {expert} out of range 0..{n_experts - 1}")
    per_expert = stacked.raw.numel() // n_experts
    raw = stacked.raw[expert * per_expert : (expert + 1) * per_expert]
    return QuantTensor(raw, stacked.ggml_type, tuple(stacked.shape[1:]))
