"""The one door between model code and routed experts: the expert-provider contract.

A model's MoE layer hands its provider the layer's hidden states and routing and gets
the layer's routed output back:

    out = provider.routed(block, x, chosen, weights, activation, next_layer=...)

Every selected expert runs (top-k unchanged, nothing skipped or substituted). Where
the experts come from (VRAM, RAM, SSD), whether they stream, how a large prefill chunk
is split, which kernel runs them, and what is prefetched (`hint` for experts known in
advance, `next_layer` for a guess at the next layer's) are the provider's business.
Two providers implement it: `ResidentExperts` below (every expert in memory; the
reference) and the expert runtime's `engine.runtime.ExpertCache` (an Expert Pack on
the SSD behind a VRAM/RAM cache). Models never import the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kernels import dequantize, quant_matmul
from engine.kernels.activation import situ
from engine.kernels.dequant import FLOAT_DTYPES, row_nbytes
from engine.kernels.moe import ExpertRows, grouped_expert_mlp, swiglu
from engine.kernels.moe_mxfp4_prefill import fused_moe_prefill, prefill_applies
from engine.kernels.moe_prefill import batched_prefill_mlp
from engine.kernels.moe_quant_prefill import fused_quant_moe_prefill
from engine.kernels.moe_quant_prefill import prefill_applies as quant_prefill_applies
from engine.kernels.quant_gemv import gemv_applies, quant_gemv


@dataclass(frozen=True)
class QuantTensor:
    """A tensor kept in its GGML type: raw bytes (1-D uint8) plus type and numpy-order shape.

    `values`, when set, is the tensor already dequantized once (a dense weight kept in
    the compute dtype): `linear` then multiplies with it directly instead of
    dequantizing per use, and `raw` may be empty.
    """

    raw: torch.Tensor
    ggml_type: int
    shape: tuple[int, ...]
    values: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values in `dtype`, on the bytes' device."""
        if self.values is not None:
            return self.values.to(dtype, copy=True)
        return dequantize(self.raw, self.ggml_type, self.shape, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for this 2-D weight W of shape (out_features, in_features): with the
        materialized `values`; a float GGUF type in x's dtype read in place; a decode step's
        few rows straight from the quantized bytes (`quant_gemv`); else dequantize, then matmul."""
        if self.values is not None:
            w = self.values if self.values.dtype == x.dtype else self.values.to(x.dtype)
            return F.linear(x, w)
        plain = FLOAT_DTYPES.get(self.ggml_type)
        if plain == x.dtype and self.raw.storage_offset() % x.element_size() == 0:
            return F.linear(x, self.raw.view(plain).view(self.shape))
        if gemv_applies(x, self.ggml_type, self.shape):
            return quant_gemv(x, self.raw, self.ggml_type, self.shape)
        return quant_matmul(x, self.raw, self.ggml_type, self.shape)

    def grouped_linear(self, x: torch.Tensor) -> torch.Tensor:
        """A grouped projection: x [n, G, in / ...] times this (G * rows, in) weight's row
        block g for group g, the G outputs side by side: [n, G * rows]."""
        n, groups, width = x.shape
        rows = self.shape[0] // groups
        if self.values is not None:  # [G, n, in] @ [G, in, rows] in one launch
            w = self.values.view(groups, rows, width)
            w = w if w.dtype == x.dtype else w.to(x.dtype)
            return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(n, -1)
        if gemv_applies(x[:, 0], self.ggml_type, (rows, width)):
            return quant_gemv(x, self.raw, self.ggml_type, self.shape, groups=groups)
        return torch.cat([self.rows(g * rows, (g + 1) * rows).linear(x[:, g]) for g in range(groups)], dim=-1)

    def rows(self, start: int, stop: int) -> QuantTensor:
        """Rows [start, stop) of this 2-D weight: a zero-copy byte slice (rows are contiguous)."""
        cols = self.shape[1]
        if self.values is not None:
            return QuantTensor(self.raw, self.ggml_type, (stop - start, cols), self.values[start:stop])
        per_row = row_nbytes(self.ggml_type, cols)
        return QuantTensor(self.raw[start * per_row : stop * per_row], self.ggml_type, (stop - start, cols))

    def materialized(self, dtype: torch.dtype) -> QuantTensor:
        """This weight dequantized once into `dtype` (the raw bytes are let go)."""
        values = self.dequantize(dtype)
        # new_empty, not raw[:0]: a view, even an empty one, would keep the bytes alive.
        return QuantTensor(self.raw.new_empty(0), self.ggml_type, self.shape, values)

    @property
    def device(self) -> torch.device:
        return self.raw.device


ExpertWeights = Mapping[str, QuantTensor]
"""One expert's weights: role name (`gate`, `up`, `down`, ...) -> tensor."""


@dataclass(frozen=True)
class ExpertActivation:
    """What a layer's routed experts compute between their matmuls: down(act(gate x, up x)).

    kind "swiglu": silu(min(gate, limit)) * clamp(up, +-limit) (no clamp for limit 0;
    DeepSeek-V4); "situ": Kimi-K3's SiTU with `beta` and `linear_beta`.
    """

    kind: str = "swiglu"
    limit: float = 0.0
    beta: float = 0.0
    linear_beta: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return swiglu(gate, up, self.limit)
        if self.kind == "situ":
            return situ(gate, up, self.beta, self.linear_beta)
        raise ValueError(f"unknown expert activation {self.kind!r}")

    def mlp(self, expert: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens x [n, d_in], dequantize-then-matmul (the reference)."""
        return expert["down"].linear(self(expert["gate"].linear(x), expert["up"].linear(x)))


@dataclass(frozen=True)
class NextLayer:
    """A hint at the next MoE layer: its block and top-k, and `scores()`, its router's
    selection scores on THIS layer's input (computed only if the provider wants a guess;
    a GPU decode step of a pack computes them in its graph anyway: one small GEMV a layer,
    cheaper there than a few eager launches between graphs)."""

    block: int
    k: int
    scores: Callable[[], torch.Tensor]


class ExpertProvider(Protocol):
    """Source of a layer's routed-expert output for model code (see the module docstring)."""

    def routed(self, block: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               activation: ExpertActivation, next_layer: NextLayer | None = None) -> torch.Tensor:
        """sum over k of weights[t, k] * expert chosen[t, k] of block `block` applied to x[t].

        x [T, d_in]; chosen (int64), weights [T, k]. Returns [T, d_out] in x's dtype.
        """
        ...

    def hint(self, block: int, expert_ids: torch.Tensor) -> None:
        """These experts of `block` will be asked for in this very step (exact, not a guess)."""
        ...

    def graph_safe(self, x: torch.Tensor, k: int) -> bool:
        """Whether `routed` on x [T, d] with top-k routing makes no host sync and keeps no
        host state, so a model may capture it in a CUDA graph and replay it."""
        ...

    def close(self) -> None:
        """Release memory and files (the provider is not used afterwards)."""
        ...


class ExpertBatch(Protocol):
    """The experts of one acquire; valid (and protected from eviction) inside `with`."""

    def __getitem__(self, expert: int) -> ExpertWeights: ...

    def __enter__(self) -> ExpertBatch: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class TokensByExpert:
    """A chunk's routing grouped by expert, with one host transfer: `ids` ascending, and
    for each its (token, weight) pairs in ascending token order (as torch.where gives)."""

    ids: list[int]
    segments: dict[int, tuple[int, int]]  # expert -> (start, count) in token_of / weight_of
    token_of: torch.Tensor
    weight_of: torch.Tensor

    @classmethod
    def of(cls, chosen: torch.Tensor, weights: torch.Tensor) -> TokensByExpert:
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        segments, start = {}, 0
        for expert, count in zip(ids.tolist(), counts.tolist()):
            segments[expert] = (start, count)
            start += count
        return cls(list(segments), segments, order // chosen.shape[-1], weights.reshape(-1)[order])


def accumulate_routed(deliveries: Iterable[tuple[int, ExpertWeights]], x: torch.Tensor, groups: TokensByExpert,
                      activation: ExpertActivation) -> torch.Tensor:
    """The reference routed sum: each delivered expert runs once on the tokens that chose
    it; the contributions are added in ascending expert order, so the result does not
    depend on delivery order or on how the experts were split into batches.

    `deliveries` yields (expert, weights) for every id of `groups`, in any order; each
    expert's weights need only stay valid until the next item is taken. A generator is
    closed on the way out, also when an expert's compute raises: its batches are
    released and its reads in flight end then, not whenever the traceback is freed.
    """
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    d_out = None
    close = getattr(deliveries, "close", None)
    try:
        for expert, expert_weights in deliveries:
            start, count = groups.segments[expert]
            token_idx = groups.token_of[start:start + count]
            y = activation.mlp(expert_weights, x[token_idx])
            outputs[expert] = (token_idx, y * groups.weight_of[start:start + count, None].to(y.dtype))
            d_out = y.shape[-1]
    finally:
        if close is not None:
            close()
    routed = x.new_zeros((x.shape[0], x.shape[-1] if d_out is None else d_out))
    for expert in sorted(outputs):
        routed.index_add_(0, *outputs[expert])
    return routed


class AcquiringProvider:
    """`routed` over `acquire`: the shared half of every provider that hands out experts
    in batches (the expert runtime, test doubles). Subclasses implement `acquire`, and
    may override `deliveries` (streaming, splitting), `plan_guess` (speculative loads) and
    `hint` (exact prefetches)."""

    def acquire(self, block: int, expert_ids: Sequence[int]) -> ExpertBatch:
        raise NotImplementedError

    def deliveries(self, block: int, expert_ids: list[int],
                   requested: Callable[[], None]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) for every id, valid until the next is taken; `requested()`
        runs once all of them are asked for and before any is computed."""
        with self.acquire(block, expert_ids) as batch:
            requested()
            for expert in expert_ids:
                yield expert, batch[expert]

    def plan_guess(self, next_layer: NextLayer) -> Callable[[], object] | None:
        """A speculative prefetch of the next layer's likeliest experts, to run once this
        layer's experts are requested; None (no guess) here."""
        return None

    def routed(self, block: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               activation: ExpertActivation, next_layer: NextLayer | None = None) -> torch.Tensor:
        # Decode only: a chunk of several tokens needs most experts anyway. The guess's
        # scores are queued on the device before the expert ids are read back (no extra
        # wait); its prefetch waits behind this layer's reads instead of competing.
        guess = self.plan_guess(next_layer) if next_layer is not None and x.shape[0] == 1 else None
        groups = TokensByExpert.of(chosen, weights)

        def requested() -> None:
            if guess is not None:
                guess()

        return accumulate_routed(self.deliveries(block, groups.ids, requested), x, groups, activation)

    def hint(self, block: int, expert_ids: torch.Tensor) -> None:
        return None

    def graph_safe(self, x: torch.Tensor, k: int) -> bool:
        return False  # routed() reads the expert ids back to the host

    def close(self) -> None:
        return None


class _ResidentBatch:
    def __init__(self, experts: dict[int, ExpertWeights]) -> None:
        self._experts = experts

    def __getitem__(self, expert: int) -> ExpertWeights:
        return self._experts[expert]

    def __enter__(self) -> _ResidentBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# Decode batches up to this many (token, expert) pairs run grouped on the GPU (one
# gather + dequantization per role, batched matmuls, no host sync); larger ones expert
# by expert, each expert dequantized once for all its tokens.
GROUPED_MAX_PAIRS = 16
# Where the grouped path runs: on a GPU it saves launches and host syncs; on a CPU the
# expert-by-expert reference is as fast. Tests add "cpu" to check the grouped math there.
GROUPED_DEVICES: tuple[str, ...] = ("cuda",)


# Where a prefill chunk's experts run in batches of experts (`engine.kernels.moe_prefill`)
# or, for MXFP4, in the fused prefill kernels: on a GPU the expert-by-expert loop costs
# ~10 launches per used expert; on a CPU it is as fast. Tests add "cpu".
BATCHED_PREFILL_DEVICES: tuple[str, ...] = ("cuda",)


def grouped_applies(x: torch.Tensor, k: int) -> bool:
    """Whether a batch of x's rows with k experts each runs grouped (see GROUPED_MAX_PAIRS)."""
    return x.device.type in GROUPED_DEVICES and x.shape[0] * k <= GROUPED_MAX_PAIRS


class ResidentExperts(AcquiringProvider):
    """All routed experts held in memory: the reference the expert runtime must equal.

    `stacked[block][role]` is the whole stacked tensor of that role (experts outermost),
    as GGML bytes; one expert's slice is a zero-copy view of it. On CUDA a decode step
    runs grouped (`engine.kernels.moe.grouped_expert_mlp`) straight from these tensors,
    and a prefill chunk runs grouped by expert: MXFP4 experts in fused kernels
    (`engine.kernels.moe_mxfp4_prefill`), Q2_K / Q3_K experts likewise
    (`engine.kernels.moe_quant_prefill`), other types in batches of experts, each
    dequantized once per chunk (`engine.kernels.moe_prefill`).
    """

    def __init__(self, stacked: Mapping[int, Mapping[str, QuantTensor]]) -> None:
        self._stacked = {block: dict(roles) for block, roles in stacked.items()}
        self._rows: dict[int, dict[str, ExpertRows]] = {}

    def acquire(self, block: int, expert_ids: Sequence[int]) -> _ResidentBatch:
        roles = self._stacked[block]
        experts: dict[int, ExpertWeights] = {}
        for expert in dict.fromkeys(int(e) for e in expert_ids):
            experts[expert] = {name: _expert_slice(t, expert) for name, t in roles.items()}
        return _ResidentBatch(experts)

    def graph_safe(self, x: torch.Tensor, k: int) -> bool:
        return grouped_applies(x, k)

    def routed(self, block: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               activation: ExpertActivation, next_layer: NextLayer | None = None) -> torch.Tensor:
        if self.graph_safe(x, chosen.shape[-1]):
            rows = self._expert_rows(block)
            return grouped_expert_mlp(x, chosen, weights, rows["gate"], rows["up"], rows["down"], activation)
        if x.device.type in BATCHED_PREFILL_DEVICES:  # a prefill chunk: each used expert read once
            rows = self._expert_rows(block)
            if prefill_applies(x, chosen.shape[-1], rows["gate"], rows["up"], rows["down"], activation):
                return fused_moe_prefill(x, chosen, weights, rows["gate"], rows["up"], rows["down"], activation)
            if quant_prefill_applies(x, chosen.shape[-1], rows["gate"], rows["up"], rows["down"], activation):
                return fused_quant_moe_prefill(x, chosen, weights, rows["gate"], rows["up"], rows["down"],
                                               activation)
            return batched_prefill_mlp(x, chosen, weights, rows["gate"], rows["up"], rows["down"], activation)
        return super().routed(block, x, chosen, weights, activation, next_layer)

    def _expert_rows(self, block: int) -> dict[str, ExpertRows]:
        if block not in self._rows:
            self._rows[block] = {
                name: ExpertRows(t.raw.view(t.shape[0], -1), t.ggml_type, (t.shape[1], t.shape[2]))
                for name, t in self._stacked[block].items()
            }
        return self._rows[block]


def _expert_slice(stacked: QuantTensor, expert: int) -> QuantTensor:
    n_experts = stacked.shape[0]
    if not 0 <= expert < n_experts:
        raise IndexError(f"expert {expert} out of range 0..{n_experts - 1}")
    per_expert = stacked.raw.numel() // n_experts
    raw = stacked.raw[expert * per_expert : (expert + 1) * per_expert]
    return QuantTensor(raw, stacked.ggml_type, tuple(stacked.shape[1:]))
