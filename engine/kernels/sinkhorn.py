"""Sinkhorn projection of the hyper-connections' small mixing matrices.

DeepSeek-V4 mixes its residual streams through an n x n matrix per token (n = 4),
made doubly stochastic by a row softmax and `iters` rounds of row/column
normalisation. In torch that is about 6 kernels a round (120 for 20 rounds) on 16
numbers; on CUDA one Triton program per token does the whole projection in
registers. The torch function is the reference and the CPU path; the two differ only
in the rounding of exp and of 4-term sums (float32), see tests/test_moe_kernels.py.
Set EXPERTDESK_SINKHORN_TRITON=0 to use torch on CUDA too.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None


def sinkhorn_reference(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then project towards doubly stochastic: columns once, then rows/columns."""
    comb = torch.softmax(comb_logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_reference` of comb_logits [..., n, n] (float32), in one launch on CUDA."""
    n = comb_logits.shape[-1]
    if (triton is None or not comb_logits.is_cuda or comb_logits.dtype != torch.float32
            or n & (n - 1) or os.environ.get("EXPERTDESK_SINKHORN_TRITON", "1") == "0"):
        return sinkhorn_reference(comb_logits, iters, eps)
    src = comb_logits.contiguous()
    out = torch.empty_like(src)
    count = src.numel() // (n * n)
    if count:
        with torch.cuda.device(src.device):
            _sinkhorn_kernel[(count,)](src, out, iters, eps, N=n, num_warps=1)
    return out


if triton is not None:

    @triton.jit
    def sinkhorn_tile(x, iters, eps):
        """`sinkhorn_reference` of one [n, n] tile in registers (also used by
        `hyper_connection`'s fused kernel)."""
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = e / tl.sum(e, axis=1)[:, None] + eps
        p = p / (tl.sum(p, axis=0)[None, :] + eps)
        for _ in range(iters - 1):
            p = p / (tl.sum(p, axis=1)[:, None] + eps)
            p = p / (tl.sum(p, axis=0)[None, :] + eps)
        return p

    @triton.jit
    def _sinkhorn_kernel(src, dst, iters, eps, N: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * N * N
        offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(dst + base + offs, sinkhorn_tile(tl.load(src + base + offs), iters, eps))
