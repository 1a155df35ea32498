"""Routed-expert math: the activations, and the grouped decode path over many experts.

`grouped_expert_mlp` runs every (token, expert) pair of a small batch in a fixed
number of launches, whatever k is: the pairs' weights are gathered from a table of
expert rows by an index tensor that stays on the device (no host sync), dequantized
once into one batch, and multiplied with batched matmuls; the routing weights and
the sum over k are applied at the end. It is the decode path of the resident
provider (and of a fully cached layer); the reference it is tested against is the
expert-by-expert loop of `engine.experts.accumulate_routed`.

On CUDA, when all three roles are MXFP4 and Triton is there, it runs the fused
kernels of `engine.kernels.moe_mxfp4` instead (each expert byte read once, decoded
in registers, no dequantized copy; see `fused_applies`); for Q8_0 and K-quant experts
(Kimi-K3's Q2_K / Q3_K) those of `engine.kernels.moe_quant`. The torch path,
`grouped_expert_mlp_reference`, is their reference and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import moe_quant
from .dequant import dequantize_rows
from .moe_mxfp4 import fused_applies, fused_expert_mlp


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); no clamp when limit is 0."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertRows:
    """One role (gate, up or down) of many experts: row i of `table` holds expert i's
    GGML bytes of numpy shape `shape` (a strided uint8 [N, nbytes] view is fine)."""

    table: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weights of `rows` (device int64 [n]) as [n, *shape] in `dtype`
        (`dequantize_rows`: on a GPU one launch that reads the rows in place)."""
        return dequantize_rows(self.table, rows, self.ggml_type, self.shape, dtype)


def grouped_expert_mlp(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                       gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation) -> torch.Tensor:
    """sum over k of weights[t, k] * down_r(act(gate_r x[t], up_r x[t])), r = rows[t, k].

    x [T, d_in]; rows, weights [T, k] (rows on x's device). Returns [T, d_out] in x's
    dtype. Fixed launch count, no host sync: for small T * k (decode).
    """
    if fused_applies(x, gate, up, down, activation):
        return fused_expert_mlp(x, rows, weights, gate, up, down, activation)
    if moe_quant.fused_applies(x, gate, up, down, activation):
        return moe_quant.fused_quant_expert_mlp(x, rows, weights, gate, up, down, activation)
    return grouped_expert_mlp_reference(x, rows, weights, gate, up, down, activation)


def grouped_expert_mlp_reference(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                                 gate: ExpertRows, up: ExpertRows, down: ExpertRows,
                                 activation) -> torch.Tensor:
    """`grouped_expert_mlp` in torch: gather, dequantize to x's dtype, batched matmuls."""
    t, k = rows.shape
    flat = rows.reshape(-1)
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, d_in, 1]
    g = torch.bmm(gate.gather(flat, x.dtype), xs).squeeze(-1)
    u = torch.bmm(up.gather(flat, x.dtype), xs).squeeze(-1)
    a = activation(g, u).unsqueeze(-1)  # [T*k, inter, 1]
    y = torch.bmm(down.gather(flat, x.dtype), a).view(t, k, -1)
    return (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
