"""DeepSeek-V4's hyper-connections around a block, in two launches each way on CUDA.

The residual is `n` parallel streams x [T, n, hidden] (float32). Before a block,
`hc_pre` derives the mixing weights from the streams (an unweighted RMSNorm of all n *
hidden values, one small projection, sigmoids, and a Sinkhorn projection of an n x n
matrix) and collapses the streams into the block's input, RMSNorm'd with the block's
gains. After the block, `hc_post` writes the new streams: x'_k = post_k * out +
sum_j comb[j, k] * x_j.

In torch that is about 30 launches per block on a few kilobytes each. On CUDA,
`hc_pre` is one matrix-vector product (cuBLAS, on the raw streams: the norm's factor is
a scalar per token, applied to the n * (2 + n) mixes afterwards) and one Triton program
per token for everything else; `hc_post` is one Triton launch. The references below are
transformers' order of operations; the kernels round where they round (the collapsed
input is cast to the compute dtype before its norm) and differ in the order of float32
sums only (tests/test_hyper_connection.py). Set EXPERTDESK_HC_TRITON=0 to use torch on
CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm_rope import rms_norm, rms_norm_unweighted
from .sinkhorn import sinkhorn
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl

    from .sinkhorn import sinkhorn_tile
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["hc_post", "hc_post_reference", "hc_pre", "hc_pre_reference"]

SWITCH = TritonSwitch("EXPERTDESK_HC_TRITON", "hyper-connection")


def hc_pre_reference(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                     hc_eps: float, rms_eps: float, dtype: torch.dtype, norm: torch.Tensor):
    """Mixing weights from the streams x [T, n, hidden], and the block input.

    Returns post [T, n], comb [T, n, n] (comb[j, k]: stream j into output stream k) and
    the collapsed streams cast to `dtype` and RMSNorm'd with the gains `norm` [T, hidden].
    """
    n = x.shape[1]
    flat = rms_norm_unweighted(x.reshape(x.shape[0], -1).float(), rms_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = sinkhorn(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(dtype)
    return post, comb, rms_norm(collapsed, norm, rms_eps)


def hc_post_reference(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: x'_k = post_k * out + sum_j comb[j, k] * x_j."""
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


def _applies(x: torch.Tensor) -> bool:
    n = x.shape[1] if x.dim() == 3 else 0
    return SWITCH.applies(x) and x.dtype == torch.float32 and n > 0 and not n & (n - 1)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           rms_eps: float, dtype: torch.dtype, norm: torch.Tensor):
    """`hc_pre_reference`, as one matrix-vector product and one launch on CUDA."""
    def reference():
        return hc_pre_reference(x, fn, base, scale, iters, hc_eps, rms_eps, dtype, norm)

    if not _applies(x) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return reference()

    def launch():
        t, n, hidden = x.shape
        src = x.contiguous()
        raw = F.linear(src.view(t, n * hidden), fn.float())  # [T, (2 + n) * n], before the norm's factor
        post = torch.empty((t, n), dtype=torch.float32, device=x.device)
        comb = torch.empty((t, n, n), dtype=torch.float32, device=x.device)
        h = torch.empty((t, hidden), dtype=dtype, device=x.device)
        if t:
            _hc_pre_kernel[(t,)](src, raw, base.float().contiguous(), scale.float().contiguous(),
                                 norm.float().contiguous(), post, comb, h, hidden, iters, hc_eps, rms_eps,
                                 N=n, BLOCK=2048, num_warps=16)
        return post, comb, h

    return SWITCH.run(x.device, launch, reference)


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`hc_post_reference`, in one launch on CUDA."""
    def reference() -> torch.Tensor:
        return hc_post_reference(x, out, post, comb)

    if not _applies(x) or out.dim() != 2:
        return reference()

    def launch() -> torch.Tensor:
        t, n, hidden = x.shape
        src, block_out = x.contiguous(), out.contiguous()
        new = torch.empty_like(src)
        block = 512
        if t:
            _hc_post_kernel[(t, triton.cdiv(hidden, block))](src, block_out, post.float().contiguous(),
                                                             comb.float().contiguous(), new, hidden, N=n,
                                                             BLOCK=block, num_warps=4)
        return new

    return SWITCH.run(x.device, launch, reference)


if triton is not None:

    @triton.jit
    def _hc_collapse(x_ptr, pre, start, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
        """sum_j pre_j * x[j, start:start + BLOCK] (float32) and the mask of live columns."""
        cols = start + tl.arange(0, BLOCK)
        live = cols < hidden
        j = tl.arange(0, N)
        tile = tl.load(x_ptr + j[:, None] * hidden + cols[None, :], mask=live[None, :], other=0.0)
        return tl.sum(pre[:, None] * tile, axis=0), cols, live

    @triton.jit
    def _hc_pre_kernel(x, raw, base, scale, norm, post_out, comb_out, h_out, hidden, iters, hc_eps, rms_eps,
                       N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        width = N * hidden
        x_row = x + t * width
        # The unweighted RMSNorm's factor over all n * hidden stream values.
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < width, other=0.0)
            acc += v * v
        r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / width + rms_eps)
        # The mixes (raw @ fn scaled by r), sigmoids and the Sinkhorn projection.
        m = (2 + N) * N
        i = tl.arange(0, N)
        pre_w = tl.load(raw + t * m + i) * r
        post_w = tl.load(raw + t * m + N + i) * r
        square = i[:, None] * N + i[None, :]
        comb_w = tl.load(raw + t * m + 2 * N + square) * r
        pre = tl.sigmoid(pre_w * tl.load(scale) + tl.load(base + i)) + hc_eps
        post = 2 * tl.sigmoid(post_w * tl.load(scale + 1) + tl.load(base + N + i))
        p = sinkhorn_tile(comb_w * tl.load(scale + 2) + tl.load(base + 2 * N + square), iters, hc_eps)
        tl.store(post_out + t * N + i, post)
        tl.store(comb_out + t * N * N + square, p)
        # Collapse, cast to the compute dtype, RMSNorm with the block's gains: the sum of
        # squares in a first pass, the output in a second (the collapse computed again).
        out_ty = h_out.dtype.element_ty
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            c, cols, live = _hc_collapse(x_row, pre, start, hidden, N, BLOCK)
            c = c.to(out_ty).to(tl.float32)
            sq += tl.where(live, c * c, 0.0)
        rn = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / hidden + rms_eps)
        for start in range(0, hidden, BLOCK):
            c, cols, live = _hc_collapse(x_row, pre, start, hidden, N, BLOCK)
            c = c.to(out_ty).to(tl.float32)
            g = tl.load(norm + cols, mask=live, other=0.0)
            tl.store(h_out + t * hidden + cols, (g * (c * rn)).to(out_ty), mask=live)

    @triton.jit
    def _hc_post_kernel(x, out, post, comb, new, hidden, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < hidden
        j = tl.arange(0, N)
        tile = tl.load(x + t * N * hidden + j[:, None] * hidden + cols[None, :], mask=live[None, :], other=0.0)
        o = tl.load(out + t * hidden + cols, mask=live, other=0.0).to(tl.float32)
        w = tl.load(comb + t * N * N + j[:, None] * N + j[None, :])  # w[j, k]
        p = tl.load(post + t * N + j)
        mixed = tl.sum(w[:, :, None] * tile[:, None, :], axis=0)  # [k, BLOCK]
        res = p[:, None] * o[None, :] + mixed
        tl.store(new + t * N * hidden + j[:, None] * hidden + cols[None, :], res, mask=live[None, :])
