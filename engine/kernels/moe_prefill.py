"""The routed experts of a prefill chunk, for experts of any GGUF type, in batches of experts.

A chunk of T tokens with top-k routing has T * k (token, expert) pairs spread over nearly
every expert of the layer (Kimi-K3: 512 tokens pick ~all 896 experts, ~9 tokens each).
Expert by expert (`engine.experts.accumulate_routed`) that is about ten launches and a
Python round per used expert, and per-use dequantization of each of its matrices.

`batched_prefill_mlp` takes the used experts in batches instead: per batch, one gather
and one dequantization per role into x's dtype (so each used expert is dequantized once
per chunk), each expert's tokens gathered into a padded [E, m, d_in] block (experts with
similar token counts share a batch, so little is padded), and three batched matmuls.
Each pair's output lands in its own row of a [T * k, d_out] buffer, so no two writes meet;
the sum over k, times the routing weights, is taken at the end in float32. One host sync
(the experts used and their token counts), then no value-dependent shapes.

The math per pair is that of the reference (dequantize to x's dtype, then matmul); only
the order of the final sum differs. DeepSeek-V4's MXFP4 experts have fused kernels
(`engine.kernels.moe_mxfp4_prefill`); this serves the other types (Q8_0, and the K-quants
of Kimi-K3's releases).
"""

from __future__ import annotations

from typing import Any

import torch

from .moe import ExpertRows

# Dequantized expert weights held at once (all three roles of a batch's experts). Kimi-K3's
# expert is 132 MB in bf16, so 8 experts a batch; DeepSeek-V4's 50 MB, so 21.
BATCH_BYTES = 1 << 30


def batched_prefill_mlp(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate: ExpertRows,
                        up: ExpertRows, down: ExpertRows, activation: Any,
                        batch_bytes: int = BATCH_BYTES) -> torch.Tensor:
    """sum over j of weights[t, j] * down_r(act(gate_r x[t], up_r x[t])), r = chosen[t, j].

    x [T, d_in]; chosen (integer) and weights [T, k] on x's device. Returns [T, d_out] in
    x's dtype. Every pair is computed (top-k unchanged); see the module docstring.
    """
    t, k = chosen.shape
    d_out = down.shape[0]
    flat = chosen.reshape(-1).long()
    if flat.numel() == 0:
        return x.new_zeros((t, d_out))
    order = torch.argsort(flat, stable=True)  # the pairs, grouped by expert
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    ids_h, counts_h = ids.tolist(), counts.tolist()  # the one host sync
    n_experts = gate.table.shape[0]
    if ids_h[0] < 0 or ids_h[-1] >= n_experts:
        raise IndexError(f"expert id out of range 0..{n_experts - 1}: {ids_h[0] if ids_h[0] < 0 else ids_h[-1]}")

    per_expert = sum(r.shape[0] * r.shape[1] for r in (gate, up, down)) * x.element_size()
    per_batch = max(1, batch_bytes // per_expert)
    by_count = sorted(range(len(ids_h)), key=lambda i: (-counts_h[i], i))  # similar counts share a batch
    by_count_dev = torch.tensor(by_count, device=x.device)
    spare = t * k  # padded positions write to this extra row, which is dropped
    pair_out = x.new_empty((spare + 1, d_out))
    for b in range(0, len(by_count), per_batch):
        members = by_count_dev[b:b + per_batch]
        m = counts_h[by_count[b]]  # the batch's largest token count
        cnt, first = counts[members], starts[members]
        j = torch.arange(m, device=x.device)
        valid = j[None, :] < cnt[:, None]  # [E, m]
        pairs = order[torch.where(valid, first[:, None] + j[None, :], first[:, None])]  # [E, m]
        xs = x[pairs // k]  # [E, m, d_in]; padded rows repeat the expert's first token
        e_ids = ids[members]
        g = torch.bmm(xs, gate.gather(e_ids, x.dtype).transpose(1, 2))
        u = torch.bmm(xs, up.gather(e_ids, x.dtype).transpose(1, 2))
        y = torch.bmm(activation(g, u), down.gather(e_ids, x.dtype).transpose(1, 2))  # [E, m, d_out]
        target = torch.where(valid, pairs, spare).reshape(-1)
        pair_out.index_copy_(0, target, y.reshape(-1, d_out))
    per_pair = pair_out[:spare].view(t, k, d_out).float()
    return (per_pair * weights.reshape(t, k, 1).float()).sum(dim=1).to(x.dtype)
