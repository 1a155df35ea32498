"""RMSNorm and interleaved rope, each row in one launch on CUDA.

The reference functions below are the models' numerics (transformers' order of
operations): the norm in float32 with the result cast back once, and DeepSeek-V4's rope
on the trailing `rope_dim` features, pair (2i, 2i + 1) rotated by angle i. In torch, a
norm is 5 kernels and a rope about 10; a decode step of DeepSeek-V4 runs some 30 of them
per layer, each a launch of a few hundred bytes. On CUDA, `norm_rope` does a norm, a
rope or both for every row in one Triton launch (one program per row), rounding where
the reference rounds (after the norm, after the rope), so the two differ only in the
order of the float32 sum of squares and in one fused multiply-add per rotated feature
(tests/test_norm_rope.py derives the bound).

Set EXPERTDESK_NORM_ROPE_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch

from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["apply_rope", "norm_rope", "rms_norm", "rms_norm_unweighted", "wide_dtype"]

_NONE, _UNWEIGHTED, _WEIGHTED = 0, 1, 2
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SWITCH = TritonSwitch("EXPERTDESK_NORM_ROPE_TRITON", "RMSNorm/rope")


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the numerically sensitive parts (norms, softmaxes, recurrent states):
    float32, or float64 when the model itself runs in float64 (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------
# References (and the CPU path)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm in float32 (gains are fp32), cast back to x's dtype once."""
    h = x.to(wide_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def rms_norm_unweighted_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.to(wide_dtype(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rope on the trailing dims of x [n, ..., d]; cos/sin [n, rope_dim / 2]."""
    extra = x.dim() - 2
    cos = cos.repeat_interleave(2, dim=-1).view(cos.shape[0], *([1] * extra), -1)
    sin = sin.repeat_interleave(2, dim=-1).view(sin.shape[0], *([1] * extra), -1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (rotated_half.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


# ---------------------------------------------------------------------------------------
# The dispatching functions the models call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference`, in one launch on CUDA."""
    return _run(x, weight, _WEIGHTED, eps, None, None, lambda: rms_norm_reference(x, weight, eps))


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_unweighted_reference`, in one launch on CUDA."""
    return _run(x, None, _UNWEIGHTED, eps, None, None, lambda: rms_norm_unweighted_reference(x, eps))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope_reference`, in one launch on CUDA."""
    return _run(x, None, _NONE, 0.0, cos, sin, lambda: apply_rope_reference(x, cos, sin))


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight)) (or of rms_norm_unweighted(x) when weight is None),
    in one launch on CUDA."""

    def reference() -> torch.Tensor:
        normed = rms_norm_unweighted_reference(x, eps) if weight is None else rms_norm_reference(x, weight, eps)
        return apply_rope_reference(normed, cos, sin)

    return _run(x, weight, _UNWEIGHTED if weight is None else _WEIGHTED, eps, cos, sin, reference)


def _run(x: torch.Tensor, weight: torch.Tensor | None, norm: int, eps: float, cos: torch.Tensor | None,
         sin: torch.Tensor | None, reference) -> torch.Tensor:
    """The kernel's output where it applies, else (or if it fails) reference()."""
    if not _applies(x, weight, cos):
        return reference()
    return SWITCH.run(x.device, lambda: _launch(x, weight, norm, eps, cos, sin), reference)


def _applies(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor | None) -> bool:
    if not SWITCH.applies(x) or x.dtype not in _KERNEL_DTYPES or x.dim() < 1 or x.shape[-1] % 2:
        return False
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    if weight is not None and weight.numel() != d:
        return False
    if cos is None:
        return True
    return 2 * cos.shape[-1] <= d and cos.shape[0] > 0 and rows % cos.shape[0] == 0


def _launch(x: torch.Tensor, weight: torch.Tensor | None, norm: int, eps: float, cos: torch.Tensor | None,
            sin: torch.Tensor | None) -> torch.Tensor:
    d = x.shape[-1]
    rope_dim = 0 if cos is None else 2 * cos.shape[-1]
    src = x.contiguous()
    out = torch.empty_like(src)
    rows = src.numel() // d if d else 0
    if rows == 0:
        return out
    if cos is not None:
        assert sin is not None  # given together
        cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
        per_angle = rows // cos.shape[0]  # rows sharing one position's angles (the heads)
    else:
        cos = sin = src  # unused (ROPE is off)
        per_angle = 1
    gains = src if weight is None else weight.to(torch.float32).contiguous()
    _norm_rope_kernel[(rows,)](src, out, gains, cos, sin, d, rope_dim, per_angle, eps, NORM=norm,
                               ROPE=rope_dim > 0, HALF=triton.next_power_of_2(d // 2),
                               num_warps=4 if d >= 2048 else 1)
    return out


if triton is not None:

    @triton.jit
    def _norm_rope_kernel(src, dst, gains, cos_ptr, sin_ptr, d, rope_dim, per_angle, eps,
                          NORM: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
        """One row: optional RMSNorm (unweighted or weighted), optional interleaved rope on the
        trailing rope_dim features. Pairs (2p, 2p + 1) are loaded as two halves."""
        row = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, HALF)
        live = p < d // 2
        base = row * d
        even_raw = tl.load(src + base + 2 * p, mask=live, other=0.0)
        odd_raw = tl.load(src + base + 2 * p + 1, mask=live, other=0.0)
        even = even_raw.to(tl.float32)
        odd = odd_raw.to(tl.float32)
        out_ty = dst.dtype.element_ty
        if NORM != 0:
            mean_sq = (tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / d
            r = 1.0 / tl.sqrt(mean_sq + eps)
            if NORM == 1:  # x * rsqrt(...).to(x.dtype), the product in x's dtype
                r = r.to(out_ty).to(tl.float32)
                even = (even * r).to(out_ty).to(tl.float32)
                odd = (odd * r).to(out_ty).to(tl.float32)
            else:  # (weight * (x * rsqrt(...))).to(x.dtype)
                w_even = tl.load(gains + 2 * p, mask=live, other=0.0)
                w_odd = tl.load(gains + 2 * p + 1, mask=live, other=0.0)
                even = (w_even * (even * r)).to(out_ty).to(tl.float32)
                odd = (w_odd * (odd * r)).to(out_ty).to(tl.float32)
        if ROPE:
            first = (d - rope_dim) // 2  # the first rotated pair
            k = p - first
            turn = live & (k >= 0)
            angle = (row // per_angle) * (rope_dim // 2) + k
            c = tl.load(cos_ptr + angle, mask=turn, other=1.0)
            s = tl.load(sin_ptr + angle, mask=turn, other=0.0)
            rot_even = even * c + (-odd) * s
            rot_odd = odd * c + even * s
            even = tl.where(turn, rot_even, even)
            odd = tl.where(turn, rot_odd, odd)
        tl.store(dst + base + 2 * p, even.to(out_ty), mask=live)
        tl.store(dst + base + 2 * p + 1, odd.to(out_ty), mask=live)
