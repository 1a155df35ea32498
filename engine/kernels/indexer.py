"""DeepSeek-V4's lightning-indexer scores, in one launch on CUDA.

The indexer of a CSA layer scores every compressed entry s for each query t:
score(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s)) / sqrt(head_dim), with the head
weights w = proj(x) / sqrt(n_heads), all in float32; entries the query may not see yet
(s >= limit(t) = (t + 1) // ratio) score -inf. The model then keeps the top-k.

In torch that is about ten launches (casts, the matmul, the ReLU, two scalings, the
weighted sum over heads, the mask). On CUDA, for up to MAX_QUERIES queries (a decode
step; prefill blocks keep cuBLAS's matrix product), `index_scores` is one Triton launch: a
program per query and block of entries takes the dot products of all heads with
tensor cores (bf16 inputs are exact products in a float32 accumulator; float32 inputs
use IEEE float32 dots) and reduces over the heads in registers. It differs from the
reference in the order of float32 sums only (tests/test_indexer_kernel.py states the
bound). Set EXPERTDESK_INDEXER_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch

from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["index_scores", "index_scores_reference"]

SWITCH = TritonSwitch("EXPERTDESK_INDEXER_TRITON", "indexer")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_E = 32  # entries per program
# Query rows up to which the kernel runs. It is built for a decode step's few queries (one
# launch instead of ten); a prefill block of hundreds of queries is a real matrix product,
# which cuBLAS does better than programs that each hold one query's heads.
MAX_QUERIES = 16


def index_scores_reference(q: torch.Tensor, head_proj: torch.Tensor, keys: torch.Tensor,
                           limit: torch.Tensor) -> torch.Tensor:
    """Scores [T, E] (float32) of the queries q [T, heads, d] (rope applied) over the entries
    keys [E, d]; head_proj [T, heads] is proj(x) (scaled here); limit [T]: entry s is
    visible to query t iff s < limit[t] (-inf otherwise)."""
    heads, d = q.shape[1], q.shape[2]
    weights = head_proj.float() * heads ** -0.5
    scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * d ** -0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, E]
    future = torch.arange(keys.shape[0], device=keys.device)[None, :] >= limit[:, None]
    return scores.masked_fill(future, float("-inf"))


def index_scores(q: torch.Tensor, head_proj: torch.Tensor, keys: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """`index_scores_reference`, in one launch on CUDA."""
    def reference() -> torch.Tensor:
        return index_scores_reference(q, head_proj, keys, limit)

    if not _applies(q, keys):
        return reference()
    return SWITCH.run(q.device, lambda: _launch(q, head_proj, keys, limit), reference)


def _applies(q: torch.Tensor, keys: torch.Tensor) -> bool:
    return (SWITCH.applies(q) and q.dtype in _KERNEL_DTYPES and keys.dtype == q.dtype and q.dim() == 3
            and keys.dim() == 2 and keys.shape[1] == q.shape[2] and 0 < q.shape[0] <= MAX_QUERIES
            and keys.shape[0] > 0)


def _launch(q: torch.Tensor, head_proj: torch.Tensor, keys: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    n, heads, d = q.shape
    entries = keys.shape[0]
    qc, keys_c = q.contiguous(), keys.contiguous()
    proj = head_proj.contiguous()
    out = torch.empty((n, entries), dtype=torch.float32, device=q.device)
    _scores_kernel[(n, triton.cdiv(entries, _BLOCK_E))](
        qc, proj, keys_c, limit.contiguous(), out, heads, d, entries, heads ** -0.5, d ** -0.5,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_E=_BLOCK_E, IEEE=q.dtype == torch.float32, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _scores_kernel(q_ptr, proj_ptr, keys_ptr, limit_ptr, out_ptr, heads, d, entries, head_scale, dim_scale,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr):
        """Query t, entries [eb * BLOCK_E, +BLOCK_E): every head's dot product, ReLU, scaled,
        weighted by the head's weight and summed over the heads."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        live_e = e < entries
        h = tl.arange(0, BLOCK_H)
        live_h = h < heads
        dd = tl.arange(0, BLOCK_D)
        live_d = dd < d
        q = tl.load(q_ptr + t * heads * d + h[:, None] * d + dd[None, :], mask=live_h[:, None] & live_d[None, :],
                    other=0.0)
        k = tl.load(keys_ptr + e.to(tl.int64)[:, None] * d + dd[None, :], mask=live_e[:, None] & live_d[None, :],
                    other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.maximum(s, 0.0) * dim_scale  # [BLOCK_H, BLOCK_E]
        w = tl.load(proj_ptr + t * heads + h, mask=live_h, other=0.0).to(tl.float32) * head_scale
        score = tl.sum(s * w[:, None], axis=0)
        limit = tl.load(limit_ptr + t)
        score = tl.where(e < limit, score, float("-inf"))
        tl.store(out_ptr + t * entries + e, score, mask=live_e)
