"""Kimi Delta Attention's math, and one token's step of it in one launch on CUDA.

A KDA layer (Kimi-K3, kimi-linear) keeps per head a float32 state S [key, value] and
the last `taps - 1` projected q / k / v rows (the short convolutions' tails). One
token's step, from its projections:
  q, k, v = SiLU(causal depthwise conv of [tail; row]) for each of q, k, v;
  q, k = q / |q|, k / |k| (per head, float32);
  g = the per-channel log decay of (f_b(f_a) + dt_bias); beta = sigmoid(beta);
  S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(d);
  out = RMSNorm(o, o_norm) * sigmoid(gate), per head.
The functions below are that math in torch (the models' code for any number of
tokens, and the CPU path). In torch one step is some 60 launches of a few kilobytes
each (the three convolutions alone are 24); `kda_step` does all of it in one Triton
launch on CUDA, one program per head, reading each head's S once and writing it once.
It rounds where the torch code rounds (the convolution's products and sums, the SiLU,
the decay's input, the norm's output and the gate in the model's dtype), so the two
differ only in float32 roundings: the order of the sums over a head (|q|, |k|, S^T k,
S^T q, the norm's) and the GPU's exponential (tests/test_kda_kernel.py derives the
bound).

Set EXPERTDESK_KDA_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm_rope import rms_norm, wide_dtype
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["delta_rule", "gated_output", "kda_decay", "kda_step", "kda_step_reference", "l2_normalize",
           "short_conv"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The largest head the kernel holds in registers: a [128, 128] float32 S over 8 warps.
_MAX_HEAD_DIM = 128
SWITCH = TritonSwitch("EXPERTDESK_KDA_TRITON", "KDA step")


# ---------------------------------------------------------------------------------------
# The math (the models' code, and the CPU path)


def short_conv(window: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution of `window` [taps - 1 + n, channels] (the tail, then n
    new rows) with `kernel` [channels, taps] (oldest tap first, like ggml_ssm_conv), then
    SiLU: [n, channels], in the window's dtype (the kernel rounded to it)."""
    taps = kernel.shape[1]
    n = window.shape[0] - (taps - 1)
    kernel = kernel.to(window.dtype)
    out = window[0:n] * kernel[:, 0]
    for j in range(1, taps):
        out = out + window[j:j + n] * kernel[:, j]
    return F.silu(out)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp's build_gdn_l2_norm), in fp32."""
    x = x.to(wide_dtype(x.dtype))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def kda_decay(f: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """The per-channel log decay (<= 0) [n, heads, d] in the wide dtype, from f = f_b(f_a)
    [n, heads * d] (the model's dtype, where dt_bias is added) and a = -exp(A_log) [heads]:
    K3's lower_bound * sigmoid(exp(A_log) g), or kimi-linear's -exp(A_log) softplus(g)."""
    heads = a.numel()
    g = (f + dt_bias.to(f.dtype)).to(wide_dtype(f.dtype)).view(f.shape[0], heads, -1)
    a = a.view(1, heads, 1)
    if lower_bound is not None:
        return torch.sigmoid(-(g * a)) * lower_bound
    return F.softplus(g) * a


def gated_output(o: torch.Tensor, o_norm: torch.Tensor, gate: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """The heads' outputs o [n, heads, d] (wide) RMS-normed per head, in `dtype`, times
    sigmoid(gate) [n, heads * d]: [n, heads * d], the input of the output projection."""
    o = rms_norm(o, o_norm, eps).to(dtype)
    return (o * torch.sigmoid(gate).view(o.shape)).reshape(o.shape[0], -1)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (llama.cpp's recurrent form) from state s [heads, key,
    value]: q, k, v, g [n, heads, d], beta [n, heads]; returns (o [n, heads, d], the new s)."""
    n, heads, d = q.shape
    scale = d ** -0.5
    decay = g.exp()
    out = torch.empty((n, heads, d), dtype=s.dtype, device=q.device)
    for t in range(n):
        s = s * decay[t].unsqueeze(-1)  # scale each key row of S
        predicted = torch.bmm(k[t].unsqueeze(1), s).squeeze(1)  # S^T k: [heads, value]
        delta = (v[t] - predicted) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * delta.unsqueeze(1)
        out[t] = torch.bmm(q[t].unsqueeze(1), s).squeeze(1) * scale
    return out, s


def kda_step_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
                       gate: torch.Tensor, conv: list[torch.Tensor], tails: list[torch.Tensor], s: torch.Tensor,
                       dt_bias: torch.Tensor, a: torch.Tensor, o_norm: torch.Tensor, eps: float,
                       lower_bound: float | None, tails_out: list[torch.Tensor], s_out: torch.Tensor) -> torch.Tensor:
    """One token's KDA step (module docstring). q, k, v, f (f_b(f_a)), gate [1, heads * d] and
    beta [1, heads] are the token's projections (the model's dtype); conv the q / k / v kernels
    [heads * d, taps]; tails the q / k / v tails [taps - 1, heads * d] (the state's dtype); s
    [heads, d, d]; dt_bias [heads * d]; a [heads]; o_norm [d]. Writes the new tails into
    `tails_out` and the new S into `s_out` (either may be the input itself); returns the gated
    output [1, heads * d] in the model's dtype, the input of the layer's output projection."""
    heads, d = s.shape[0], s.shape[1]
    wide = wide_dtype(q.dtype)
    rows = []
    for row, kernel, tail, out in zip((q, k, v), conv, tails, tails_out):
        kept = torch.cat([tail, row.to(tail.dtype)], dim=0)  # as the state keeps it, then as computed
        rows.append(short_conv(kept.to(row.dtype), kernel).view(1, heads, d))
        out.copy_(kept[1:])
    qn = l2_normalize(rows[0], eps)
    kn = l2_normalize(rows[1], eps)
    g = kda_decay(f, dt_bias, a, lower_bound)
    o, new_s = delta_rule(qn, kn, rows[2].to(wide), g, torch.sigmoid(beta.to(wide)), s)
    s_out.copy_(new_s)
    return gated_output(o, o_norm, gate, eps, q.dtype)


# ---------------------------------------------------------------------------------------
# The dispatching function the model calls


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
             gate: torch.Tensor, conv: list[torch.Tensor], tails: list[torch.Tensor], s: torch.Tensor,
             dt_bias: torch.Tensor, a: torch.Tensor, o_norm: torch.Tensor, eps: float, lower_bound: float | None,
             tails_out: list[torch.Tensor], s_out: torch.Tensor) -> torch.Tensor:
    """`kda_step_reference`, in one launch on CUDA (graph-capturable: no host sync)."""
    args = (q, k, v, f, beta, gate, conv, tails, s, dt_bias, a, o_norm, eps, lower_bound, tails_out, s_out)

    def reference() -> torch.Tensor:
        return kda_step_reference(*args)

    if not _applies(*args):
        return reference()
    return SWITCH.run(s.device, lambda: _launch(*args), reference)


def _applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
             gate: torch.Tensor, conv: list[torch.Tensor], tails: list[torch.Tensor], s: torch.Tensor,
             dt_bias: torch.Tensor, a: torch.Tensor, o_norm: torch.Tensor, eps: float, lower_bound: float | None,
             tails_out: list[torch.Tensor], s_out: torch.Tensor) -> bool:
    """Whether the kernel computes what the reference does here: one token in a kernel dtype,
    the tails in that dtype (so keeping them rounds nothing), S float32, rows of the shapes
    the reference reads, the buffers written contiguous, a head of at most 128 and a
    convolution of 2 to 4 taps, everything on one device."""
    if not SWITCH.applies(s):
        return False
    if s.dim() != 3:
        return False
    dtype = q.dtype
    heads, d = s.shape[0], s.shape[1]
    if dtype not in _KERNEL_DTYPES or s.shape[2] != d or not 0 < d <= _MAX_HEAD_DIM:
        return False
    if s.dtype != torch.float32 or s_out.dtype != torch.float32 or s_out.shape != s.shape:
        return False
    width = heads * d
    rows = (q, k, v, f, gate)
    if any(t.dtype != dtype or t.numel() != width or t.stride(-1) != 1 for t in rows):
        return False
    if beta.numel() != heads or a.numel() != heads or o_norm.numel() != d or dt_bias.numel() != width:
        return False
    if len(conv) != 3 or len(tails) != 3 or len(tails_out) != 3:
        return False
    taps = conv[0].shape[1] if conv[0].dim() == 2 else 0
    if not 2 <= taps <= 4 or any(tuple(c.shape) != (width, taps) for c in conv):
        return False
    buffers = [*tails, *tails_out]
    if any(t.dtype != dtype or tuple(t.shape) != (taps - 1, width) for t in buffers):
        return False
    if any(not t.is_contiguous() for t in (*buffers, *conv, s, s_out, dt_bias, a, o_norm)):
        return False
    device = s.device
    return all(t.device == device for t in (*rows, beta, *conv, *buffers, s_out, dt_bias, a, o_norm))


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
            gate: torch.Tensor, conv: list[torch.Tensor], tails: list[torch.Tensor], s: torch.Tensor,
            dt_bias: torch.Tensor, a: torch.Tensor, o_norm: torch.Tensor, eps: float, lower_bound: float | None,
            tails_out: list[torch.Tensor], s_out: torch.Tensor) -> torch.Tensor:
    heads, d = s.shape[0], s.shape[1]
    out = torch.empty((1, heads * d), dtype=q.dtype, device=q.device)
    block = triton.next_power_of_2(d)
    _kda_step_kernel[(heads,)](
        q, k, v, f, beta.reshape(-1), gate, conv[0], conv[1], conv[2], tails[0], tails[1], tails[2],
        tails_out[0], tails_out[1], tails_out[2], s, s_out, dt_bias, a, o_norm, out, heads * d, eps,
        d ** -0.5, 0.0 if lower_bound is None else lower_bound, D=d, BLOCK=block, TAPS=conv[0].shape[1],
        LOWER_BOUND=lower_bound is not None, num_warps=8 if block >= 128 else 4)
    return out


if triton is not None:

    @triton.jit
    def _conv_silu(newest, kernel_ptr, tail_ptr, ch, live, width, TAPS: tl.constexpr):
        """One head's channels of a short convolution over [tail; newest] and SiLU, rounding as
        torch does in the row's dtype (each product, each sum, the SiLU). Returns float32 values."""
        dtype = newest.dtype
        acc = tl.zeros_like(ch.to(tl.float32))
        for j in tl.static_range(TAPS):
            if j < TAPS - 1:
                x = tl.load(tail_ptr + j * width + ch, mask=live, other=0.0)
            else:
                x = newest
            w = tl.load(kernel_ptr + ch * TAPS + j, mask=live, other=0.0).to(dtype).to(tl.float32)
            product = (x.to(tl.float32) * w).to(dtype).to(tl.float32)
            if j == 0:
                acc = product
            else:
                acc = (acc + product).to(dtype).to(tl.float32)
        return (acc / (1.0 + tl.exp(-acc))).to(dtype).to(tl.float32)

    @triton.jit
    def _kept(newest, tail_ptr, ch, live, width, J: tl.constexpr, TAPS: tl.constexpr):
        """Row J of the new tail: row J + 1 of the old one, or the newest row."""
        if J + 1 < TAPS - 1:
            kept = tl.load(tail_ptr + (J + 1) * width + ch, mask=live, other=0.0)
        else:
            kept = newest
        return kept

    @triton.jit
    def _store_tail(tail_out_ptr, row0, row1, row2, ch, live, width, TAPS: tl.constexpr):
        """The new tail's TAPS - 1 rows (at most 3: TAPS <= 4)."""
        tl.store(tail_out_ptr + ch, row0, mask=live)
        if TAPS > 2:
            tl.store(tail_out_ptr + width + ch, row1, mask=live)
        if TAPS > 3:
            tl.store(tail_out_ptr + 2 * width + ch, row2, mask=live)

    @triton.jit
    def _kda_step_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, gate_ptr, conv_q, conv_k, conv_v, tail_q, tail_k,
                         tail_v, out_q, out_k, out_v, s_ptr, s_out_ptr, dt_bias_ptr, a_ptr, norm_ptr, out_ptr,
                         width, eps, scale, lower_bound, D: tl.constexpr, BLOCK: tl.constexpr,
                         TAPS: tl.constexpr, LOWER_BOUND: tl.constexpr):
        """One head (program) of a token's KDA step: its q / k / v convolutions and tails, its
        S read once and written once, its normed and gated output."""
        head = tl.program_id(0)
        dtype = q_ptr.dtype.element_ty
        idx = tl.arange(0, BLOCK)
        live = idx < D
        ch = head * D + idx
        # The outputs may alias the inputs: every tail row is read before a barrier and written
        # after it (a head's vectors are held by several warps, so program order is not enough).
        q_row = tl.load(q_ptr + ch, mask=live, other=0.0)
        k_row = tl.load(k_ptr + ch, mask=live, other=0.0)
        v_row = tl.load(v_ptr + ch, mask=live, other=0.0)
        q = _conv_silu(q_row, conv_q, tail_q, ch, live, width, TAPS)
        k = _conv_silu(k_row, conv_k, tail_k, ch, live, width, TAPS)
        v = _conv_silu(v_row, conv_v, tail_v, ch, live, width, TAPS)
        q0 = _kept(q_row, tail_q, ch, live, width, 0, TAPS)
        q1 = _kept(q_row, tail_q, ch, live, width, 1, TAPS)
        q2 = _kept(q_row, tail_q, ch, live, width, 2, TAPS)
        k0 = _kept(k_row, tail_k, ch, live, width, 0, TAPS)
        k1 = _kept(k_row, tail_k, ch, live, width, 1, TAPS)
        k2 = _kept(k_row, tail_k, ch, live, width, 2, TAPS)
        v0 = _kept(v_row, tail_v, ch, live, width, 0, TAPS)
        v1 = _kept(v_row, tail_v, ch, live, width, 1, TAPS)
        v2 = _kept(v_row, tail_v, ch, live, width, 2, TAPS)
        tl.debug_barrier()
        _store_tail(out_q, q0, q1, q2, ch, live, width, TAPS)
        _store_tail(out_k, k0, k1, k2, ch, live, width, TAPS)
        _store_tail(out_v, v0, v1, v2, ch, live, width, TAPS)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps))
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))

        f = tl.load(f_ptr + ch, mask=live, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias_ptr + ch, mask=live, other=0.0).to(dtype).to(tl.float32)
        g = (f + bias).to(dtype).to(tl.float32)
        a = tl.load(a_ptr + head).to(tl.float32)
        if LOWER_BOUND:
            g = tl.sigmoid(-(g * a)) * lower_bound
        else:  # softplus as torch computes it (threshold 20); log(1 + y)'s series for tiny y
            y = tl.exp(tl.minimum(g, 20.0))
            g = tl.where(g > 20.0, g, tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))) * a
        beta = tl.sigmoid(tl.load(beta_ptr + head).to(tl.float32))

        tile = head * D * D + idx[:, None] * D + idx[None, :]  # [key, value]
        both = live[:, None] & live[None, :]
        s = tl.load(s_ptr + tile, mask=both, other=0.0) * tl.exp(g)[:, None]
        predicted = tl.sum(s * k[:, None], axis=0)
        s = s + k[:, None] * ((v - predicted) * beta)[None, :]
        tl.store(s_out_ptr + tile, s, mask=both)
        o = tl.sum(s * q[:, None], axis=0) * scale

        o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps))
        o = (tl.load(norm_ptr + idx, mask=live, other=0.0).to(tl.float32) * o).to(dtype).to(tl.float32)
        gate = tl.sigmoid(tl.load(gate_ptr + ch, mask=live, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + ch, (o * gate).to(dtype), mask=live)
