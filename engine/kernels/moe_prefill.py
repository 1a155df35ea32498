"""The routed experts of a prefill chunk, for experts of any GGUF type, in batches of experts.

A chunk of T tokens with top-k routing has T * k (token, expert) pairs spread over nearly
every expert of the layer (Kimi-K3: 512 tokens pick ~all 896 experts, ~9 tokens each).
Expert by expert (`engine.experts.accumulate_routed`) that is about ten launches and a
Python round per used expert, and per-use dequantization of each of its matrices.

`batched_prefill_mlp` takes the used experts in batches instead: per batch, one gather
and one dequantization per role into x's dtype, so each used expert is dequantized once
per chunk (`ExpertRows.gather`: on a GPU the experts' bytes are read in place, no gathered
copy), each expert's tokens gathered into a padded [E, m, d_in] block, and three
batched matmuls. Experts are taken by descending token count, and a batch only takes
experts with at least half its largest count, so at most half of a batch is padding;
`batch_bytes` bounds both its dequantized weights and its activations: by default a quarter of
the GPU memory free now, between 256 MiB and 4 GiB (`batch_budget`; Kimi-K3's expert is 66 MB
in bf16, so 15 to 62 experts a batch). Each batch costs about fifteen launches and a Python
round, so the bigger the batch the fewer of them (a 512-token Kimi-K3 chunk: 56 batches
a layer at 1 GiB, 15 at 4 GiB, with uniformly random routing).
Each pair's output lands in its own row of a [T * k, d_out] buffer (x's dtype), so no two
writes meet; the sum over k, times the routing weights, is taken at the end in float32.
The host waits for the experts used and their token counts (their number, then one copy
back), nothing else.

The math per pair is that of the reference (dequantize to x's dtype, then matmul); in
float32 only the order of the final sum differs. (In bf16 the reference also rounds each
weighted output and its running sum to bf16, and on a GPU it runs an expert with one or
two tokens through the quantized GEMV: the results agree within bf16 roundings.)
DeepSeek-V4's MXFP4 experts have fused kernels (`engine.kernels.moe_mxfp4_prefill`); this
serves the other types (Q8_0, and the K-quants of Kimi-K3's releases).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from engine import memory

from .moe import ExpertRows

# What one batch may hold: the dequantized weights of its experts (all three roles), and apart
# from them its padded activations. On a GPU a quarter of the free memory within these bounds;
# EXPERTDESK_PREFILL_BATCH_MIB sets it (benchmarks compare budgets with it).
MIN_BATCH_BYTES = 256 << 20
MAX_BATCH_BYTES = 4 << 30
CPU_BATCH_BYTES = 1 << 30


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batched_prefill_mlp(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate: ExpertRows,
                        up: ExpertRows, down: ExpertRows, activation: Activation,
                        batch_bytes: int | None = None) -> torch.Tensor:
    """sum over j of weights[t, j] * down_r(act(gate_r x[t], up_r x[t])), r = chosen[t, j].

    x [T, d_in]; chosen (integer) and weights [T, k] on x's device. Returns [T, d_out] in
    x's dtype. Every pair is computed (top-k unchanged); see the module docstring.
    """
    if batch_bytes is None:
        batch_bytes = batch_budget(x.device)
    t, k = chosen.shape
    inter, d_in = gate.shape
    d_out = down.shape[0]
    flat = chosen.reshape(-1).long()
    if flat.numel() == 0:
        return x.new_zeros((t, d_out))
    order = torch.argsort(flat, stable=True)  # the pairs, grouped by expert
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)  # waits for the GPU (its size)
    starts = torch.cumsum(counts, 0) - counts
    by_count = torch.argsort(counts, descending=True, stable=True)  # similar counts share a batch
    ids_h, counts_h = torch.stack([ids[by_count], counts[by_count]]).tolist()  # one copy back
    n_experts = min(r.table.shape[0] for r in (gate, up, down))
    bad = [e for e in (min(ids_h), max(ids_h)) if not 0 <= e < n_experts]
    if bad:
        raise IndexError(f"expert id {bad[0]} out of range 0..{n_experts - 1}")

    weight_bytes = (2 * inter * d_in + d_out * inter) * x.element_size()  # one expert, dequantized
    row_bytes = (d_in + 3 * inter + d_out) * x.element_size()  # one padded row's activations
    spare = t * k  # padded positions write to this extra row, which is dropped
    pair_out = x.new_empty((spare + 1, d_out))
    b = 0
    while b < len(ids_h):
        m = counts_h[b]  # the batch's largest token count (counts descend)
        e = b + 1  # a batch grows while its weights and padded activations fit batch_bytes and
        # its experts have at least half its largest count (at most half of it is padding)
        while (e < len(ids_h) and 2 * counts_h[e] >= m
               and (e + 1 - b) * weight_bytes <= batch_bytes and (e + 1 - b) * m * row_bytes <= batch_bytes):
            e += 1
        members = by_count[b:e]
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
        b = e
    # The sum over k in float32, one slot at a time: no float32 copy of all T * k outputs
    # (at 4,096 Kimi-K3 tokens that copy alone would be 1.9 GB).
    per_pair = pair_out[:spare].view(t, k, d_out)
    w = weights.reshape(t, k).float()
    out = per_pair[:, 0].float() * w[:, :1]
    for slot in range(1, k):
        out += per_pair[:, slot].float() * w[:, slot:slot + 1]
    return out.to(x.dtype)


def batch_budget(device: torch.device) -> int:
    """The bytes a batch may hold on `device` (module docstring): EXPERTDESK_PREFILL_BATCH_MIB
    if set, else on a GPU a quarter of what could be allocated now (`memory.free_device_memory`,
    the rule the expert cache sizes itself by) within [MIN_BATCH_BYTES, MAX_BATCH_BYTES],
    else CPU_BATCH_BYTES."""
    fixed = os.environ.get("EXPERTDESK_PREFILL_BATCH_MIB")
    if fixed:
        return max(1, int(fixed)) << 20
    if device.type != "cuda":
        return CPU_BATCH_BYTES
    return max(MIN_BATCH_BYTES, min(MAX_BATCH_BYTES, memory.free_device_memory(device) // 4))
