"""Block attention residuals (Kimi-K3's AttnRes mix), in one launch per mix on CUDA.

The input of each of Kimi-K3's mixers, FFNs and of its head is, per token, a softmax mix
of the banked residual snapshots and the current partial sum v = [bank..., prefix]:
  out = sum_i softmax_i(<RMSNorm(v_i), score>) v_i,
scored on the normalised snapshots, summed over the raw ones, in float32. In torch that
is seven launches (stack, norm, product, sum, softmax, product, sum), two mixes a layer;
`attn_res_mix` stacks the snapshots and does the rest in one Triton program per token.
The score of a snapshot is its dot product with `score` times its norm's reciprocal
(the reference scales each value first): the two differ only in float32 roundings, the
order of the sums and the GPU's exponential (tests/test_attn_res_kernel.py derives the
bound).

Set EXPERTDESK_ATTN_RES_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .norm_rope import rms_norm_unweighted, wide_dtype
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["attn_res_mix", "attn_res_mix_reference"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 1024  # features a program reads at a time, per snapshot
SWITCH = TritonSwitch("EXPERTDESK_ATTN_RES_TRITON", "AttnRes mix")


def attn_res_mix_reference(prefix: torch.Tensor, bank: Sequence[torch.Tensor], score: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """sum_i softmax_i(<RMSNorm(v_i), score>) v_i over v = [bank..., prefix], per token, in fp32.

    The scores use the normalised snapshots, the sum the raw ones.
    """
    values = torch.stack([*bank, prefix], dim=1).to(wide_dtype(prefix.dtype))  # [T, n, hidden]
    logits = (rms_norm_unweighted(values, eps) * score).sum(-1)  # [T, n]
    probs = torch.softmax(logits, dim=-1)
    return (probs.unsqueeze(-1) * values).sum(dim=1).to(prefix.dtype)


def attn_res_mix(prefix: torch.Tensor, bank: Sequence[torch.Tensor], score: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`attn_res_mix_reference`: one stack and one launch on CUDA (no host sync)."""
    def reference() -> torch.Tensor:
        return attn_res_mix_reference(prefix, bank, score, eps)

    if not _applies(prefix, bank, score):
        return reference()
    return SWITCH.run(prefix.device, lambda: _launch(prefix, bank, score, eps), reference)


def _applies(prefix: torch.Tensor, bank: Sequence[torch.Tensor], score: torch.Tensor) -> bool:
    """Rows [T, hidden] in float32 (the reference's float32 sums: float64 runs stay in torch),
    a contiguous prefix, every snapshot like it, a score per feature, one device."""
    if not SWITCH.applies(prefix) or prefix.dtype != torch.float32 or prefix.dim() != 2:
        return False
    if not prefix.is_contiguous():  # the output takes its layout; the kernel writes rows
        return False
    if any(t.shape != prefix.shape or t.dtype != prefix.dtype or t.device != prefix.device for t in bank):
        return False
    return score.numel() == prefix.shape[1] and score.dtype in _KERNEL_DTYPES and score.device == prefix.device


def _launch(prefix: torch.Tensor, bank: Sequence[torch.Tensor], score: torch.Tensor, eps: float) -> torch.Tensor:
    values = torch.stack([*bank, prefix])  # [n, T, hidden], contiguous
    n, rows, hidden = values.shape
    out = torch.empty_like(prefix)
    snapshots = max(2, triton.next_power_of_2(n))
    block = min(_BLOCK, triton.next_power_of_2(hidden))
    _attn_res_kernel[(rows,)](values, score.contiguous(), out, n, rows, hidden, eps, SNAPSHOTS=snapshots,
                              BLOCK=block, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _attn_res_kernel(values_ptr, score_ptr, out_ptr, n, rows, hidden, eps, SNAPSHOTS: tl.constexpr,
                         BLOCK: tl.constexpr):
        """One token (program): each snapshot's sum of squares and dot product with the score in
        one pass, the softmax over snapshots, then the weighted sum in a second pass."""
        row = tl.program_id(0)
        which = tl.arange(0, SNAPSHOTS)
        live = which < n
        base = values_ptr + which[:, None].to(tl.int64) * rows * hidden + row * hidden
        squares = tl.zeros((SNAPSHOTS,), dtype=tl.float32)
        dots = tl.zeros((SNAPSHOTS,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            feature = start + tl.arange(0, BLOCK)
            there = feature < hidden
            v = tl.load(base + feature[None, :], mask=live[:, None] & there[None, :], other=0.0)
            s = tl.load(score_ptr + feature, mask=there, other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=1)
            dots += tl.sum(v * s[None, :], axis=1)
        logits = dots * (1.0 / tl.sqrt(squares / hidden + eps))
        logits = tl.where(live, logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        for start in range(0, hidden, BLOCK):
            feature = start + tl.arange(0, BLOCK)
            there = feature < hidden
            v = tl.load(base + feature[None, :], mask=live[:, None] & there[None, :], other=0.0)
            tl.store(out_ptr + row * hidden + feature, tl.sum(v * p[:, None], axis=0), mask=there)
