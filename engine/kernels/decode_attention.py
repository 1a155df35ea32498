"""DeepSeek-V4's attention for one decode query, in two launches on CUDA.

One query at position P attends with `heads` heads over one shared K = V head: the
sliding window's rows (a ring: row r of the [W, d] window buffer holds the latest
position p <= P with p % W = r, one of P - W + 1 .. P, and is visible iff r <= P) and,
on compressed layers, compressed entries: every entry of an HCA layer (entry w visible
iff w < (P + 1) // ratio) or the indexer's picks of a CSA layer (a pick p is visible
iff 0 <= p < (P + 1) // ratio). A learned per-head sink logit joins the softmax
denominator, and the output's rope slice is rotated back to the query position.

`attend` is transformers' order of operations (float32 logits and softmax, the
probabilities cast to the compute dtype before they weight the values) and serves the
eager path; `decode_attention_reference` builds the masks from P and calls it. In torch
that is some 25 launches per layer (masks, gathers, two matmuls per key set, the
concatenation, the softmax, the casts, the rope). On CUDA, `decode_attention` is one
split-key ("flash-decoding") Triton launch, each program taking a block of heads and a
slice of the keys with an online softmax, and one launch that merges the slices with
the sinks, rounds once and rotates the rope slice back. It reads the picked entries in
place (no gathered copy) and computes the masks from P, a device tensor (a CUDA graph
replays it for every position). It differs from the reference in the order of float32
sums and in rounding: the reference rounds the window's and the entries' partial
outputs to the compute dtype and adds them, the kernel accumulates both in float32 and
rounds once (tests/test_decode_attention.py states the bound).

Kimi-K3's MLA decode is the same computation: its cache rows (the normed latent, then the
shared rope-free key slice) are a window that has not wrapped (row r holds position r),
there is no sink, and the values are each row's first `value_dim` features (the latent);
the rest of a row joins the logits only. That replaces its ~12 torch launches (logits,
mask, softmax, casts, the weighted sum) with the same two.

Set EXPERTDESK_ATTENTION_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch

from .norm_rope import apply_rope, wide_dtype
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["additive_mask", "attend", "decode_attention", "decode_attention_reference"]

SWITCH = TritonSwitch("EXPERTDESK_ATTENTION_TRITON", "decode attention")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_H = 16  # heads per program (tl.dot needs 16 rows)
_BLOCK_N = 32  # keys per inner step


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask: 0 where `visible`, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, comp_keys: torch.Tensor | None,
           comp_mask: torch.Tensor | None, sinks: torch.Tensor | None, scale: float,
           value_dim: int | None = None) -> torch.Tensor:
    """Softmax attention of q [t, heads, d] over the `keys` [L, d] (+ compressed ones),
    with the per-head sink logit in the denominator (None: no sink).

    The values are the keys' first `value_dim` features (None: all of them; K = V).
    comp_keys is [E, d] (shared by all queries) or [t, k, d] (per-query picks).
    Returns [t, heads, value_dim].
    """
    qh = q.transpose(0, 1)  # [heads, t, d]
    # The logits in float32 (wide_dtype) whatever the compute dtype: rounded to bf16, a
    # logit of 30 is off by 0.125 and its softmax weight by 12%.
    wide = wide_dtype(q.dtype)
    logits = [_wide_logits(q, keys) * scale + mask]
    if comp_keys is not None:
        assert comp_mask is not None  # given together
        logits.append(_wide_logits(q, comp_keys) * scale + comp_mask)
    heads, t = qh.shape[0], qh.shape[1]
    if sinks is not None:
        logits.append(sinks.to(wide).view(heads, 1, 1).expand(heads, t, 1))
    combined = torch.cat([part.to(wide) for part in logits], dim=-1)  # the softmax runs in fp32 (fp64: fp64)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1).to(q.dtype)
    dv = keys.shape[-1] if value_dim is None else value_dim
    n_win = keys.shape[0]
    out = torch.matmul(probs[..., :n_win], keys[:, :dv])
    if comp_keys is not None:
        p_comp = probs[..., n_win:n_win + comp_keys.shape[-2]]
        if comp_keys.dim() == 2:
            out = out + torch.matmul(p_comp, comp_keys[:, :dv])
        else:
            out = out + torch.einsum("htk,tkd->htd", p_comp, comp_keys[..., :dv])
    return out.transpose(0, 1)


# mm / bmm with a float32 result from 16-bit operands (torch >= 2.8 on CUDA).
_MIXED_MATMUL = "dtype" in torch.ops.aten.mm.overloads() and "dtype" in torch.ops.aten.bmm.overloads()


def _wide_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [t, heads, d] against keys [L, d] (shared) or [t, k, d] (per query), unscaled:
    [heads, t, L | k] in wide_dtype.

    On CUDA with bf16 / fp16 operands this is one tensor-core matmul accumulating in
    float32: the product of two 16-bit values is exact in float32, so it gives the
    float32 matmul of the upcast operands up to the order of its sums (a DeepSeek-V4
    4,096-token chunk spent 28 ms of 585 in float32 matmuls without tensor cores).
    Elsewhere the operands are upcast first."""
    wide = wide_dtype(q.dtype)
    mixed = (_MIXED_MATMUL and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
             and keys.dtype == q.dtype and wide == torch.float32)
    if keys.dim() == 2:
        if mixed:
            flat = torch.mm(q.reshape(-1, q.shape[-1]), keys.t(), out_dtype=wide)  # [t * heads, L]
            return flat.view(q.shape[0], q.shape[1], -1).transpose(0, 1)
        return torch.matmul(q.transpose(0, 1).to(wide), keys.to(wide).t())
    if mixed:
        return torch.bmm(q, keys.transpose(1, 2), out_dtype=wide).transpose(0, 1)
    return torch.einsum("htd,tkd->htk", q.transpose(0, 1).to(wide), keys.to(wide))


def decode_attention_reference(q: torch.Tensor, window: torch.Tensor, pos: torch.Tensor, window_on: bool,
                               entries: torch.Tensor | None, picks: torch.Tensor | None, ratio: int,
                               sinks: torch.Tensor | None, scale: float,
                               unrope: tuple[torch.Tensor, torch.Tensor] | None,
                               value_dim: int | None = None) -> torch.Tensor:
    """The attention of the query q [1, heads, d] at position `pos` (a device tensor [1]).

    window [W, d]: the sliding window's ring of rows (`window_on` False: none is visible);
    entries [R, d]: the compressed entries (None on a sliding-only layer), all of them
    candidates (HCA) or only the indexer's `picks` [1, k] (CSA, -1: no pick); `ratio`
    the layer's compress ratio; `sinks` [heads] the sink logits (None: no sink); `unrope`
    the query position's (cos, sin): the output's rope slice is rotated back by it.
    `value_dim`: the values are the keys' first value_dim features (None: all, K = V), as
    in an MLA cache row (the latent, then the key-only rope slice). A cache of rows 0 ..
    W - 1 holding positions 0 .. W - 1 is a window that has not wrapped: row r is
    visible iff r <= pos. Returns [1, heads, value_dim] in q's dtype.
    """
    visible = torch.arange(window.shape[0], device=q.device)[None, :] <= pos[:, None]
    if not window_on:
        visible = torch.zeros_like(visible)
    comp_keys = comp_mask = None
    if entries is not None:
        limit = (pos + 1) // ratio  # entry w is visible iff w < limit
        if picks is None:
            comp_keys = entries
            ok = torch.arange(entries.shape[0], device=q.device)[None, :] < limit[:, None]
        else:
            comp_keys = entries[picks.clamp(min=0)]
            ok = (picks >= 0) & (picks < limit[:, None])
        comp_mask = additive_mask(ok, q.dtype)
    out = attend(q, window, additive_mask(visible, q.dtype), comp_keys, comp_mask, sinks, scale, value_dim)
    if unrope is not None:
        out = apply_rope(out, unrope[0], -unrope[1])
    return out


def decode_attention(q: torch.Tensor, window: torch.Tensor, pos: torch.Tensor, window_on: bool,
                     entries: torch.Tensor | None, picks: torch.Tensor | None, ratio: int,
                     sinks: torch.Tensor | None, scale: float,
                     unrope: tuple[torch.Tensor, torch.Tensor] | None,
                     value_dim: int | None = None) -> torch.Tensor:
    """`decode_attention_reference`, in two launches on CUDA."""
    def reference() -> torch.Tensor:
        return decode_attention_reference(q, window, pos, window_on, entries, picks, ratio, sinks, scale, unrope,
                                          value_dim)

    dv = q.shape[-1] if value_dim is None else value_dim
    if not _applies(q, window, entries, unrope, dv):
        return reference()
    return SWITCH.run(q.device, lambda: _launch(q, window, pos, window_on, entries, picks, ratio, sinks, scale,
                                                unrope, dv), reference)


def _applies(q: torch.Tensor, window: torch.Tensor, entries: torch.Tensor | None,
             unrope: tuple[torch.Tensor, torch.Tensor] | None, dv: int) -> bool:
    if not SWITCH.applies(q) or q.dtype not in _KERNEL_DTYPES or q.dim() != 3 or q.shape[0] != 1:
        return False
    d = q.shape[-1]
    if dv % 2 or not 0 < dv <= d or window.dtype != q.dtype or window.shape[-1] != d or (
            entries is not None and entries.dtype != q.dtype):
        return False
    return unrope is None or 2 * unrope[0].shape[-1] <= dv


def _stages(dtype: torch.dtype, block_d: int) -> int:
    """Software-pipelining stages of the split kernel: Triton's default 3, but 1 for float32
    tiles of 512 features. There each stage buffers a [BLOCK_N, 512] key tile of 64 KiB; with
    3 the kernel asked for 360,448 bytes of shared memory where an H200 has 232,448, and
    DeepSeek-V4's float32 decode fell back to torch (benchmarks/results/
    real-deepseek-v4-flash-vm-20261202-165403.json)."""
    return 1 if dtype == torch.float32 and block_d >= 512 else 3


def _launch(q: torch.Tensor, window: torch.Tensor, pos: torch.Tensor, window_on: bool,
            entries: torch.Tensor | None, picks: torch.Tensor | None, ratio: int, sinks: torch.Tensor | None,
            scale: float, unrope: tuple[torch.Tensor, torch.Tensor] | None, dv: int) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]
    qc, window = q.contiguous(), window.contiguous()
    n_window = window.shape[0] if window_on else 0
    if entries is None:
        entries_c, n_comp, index = window, 0, pos  # unused
    else:
        entries_c = entries.contiguous()
        index = pos if picks is None else picks.reshape(-1).contiguous()
        n_comp = entries_c.shape[0] if picks is None else index.numel()
    n_keys = n_window + n_comp
    blocks = triton.cdiv(max(1, n_keys), _BLOCK_N)
    head_blocks = triton.cdiv(heads, _BLOCK_H)
    # Enough programs to fill the GPU, each at least one block of keys.
    per_split = max(1, triton.cdiv(blocks * head_blocks, 128))
    splits = triton.cdiv(blocks, per_split)
    block_d = max(16, triton.next_power_of_2(dv))  # tl.dot needs 16
    block_t = max(16, triton.next_power_of_2(d - dv))  # the key-only tail (none when d == dv)
    wide = torch.float32
    acc = torch.empty((splits, heads, dv), dtype=wide, device=q.device)
    stats = torch.empty((2, splits, heads), dtype=wide, device=q.device)  # running max, sum
    _split_kernel[(head_blocks, splits)](
        qc, window, entries_c, index, pos, acc, stats, heads, d, dv, n_window, n_comp,
        max(1, ratio), per_split * _BLOCK_N, splits, scale,
        PICKS=picks is not None, TAIL=d > dv, BLOCK_H=_BLOCK_H, BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        BLOCK_T=block_t, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=_stages(q.dtype, block_d))
    out = torch.empty((1, heads, dv), dtype=q.dtype, device=q.device)
    if unrope is not None:
        cos, sin = unrope[0].to(wide).contiguous(), unrope[1].to(wide).contiguous()
        rope_dim = 2 * cos.shape[-1]
    else:
        cos = sin = stats  # unused
        rope_dim = 0
    sinks_c = stats if sinks is None else sinks.to(wide).contiguous()
    _merge_kernel[(heads,)](acc, stats, sinks_c, out, cos, sin, heads, dv, splits, rope_dim,
                            HALF=triton.next_power_of_2(dv // 2),
                            SPLITS=triton.next_power_of_2(splits), SINK=sinks is not None, ROPE=rope_dim > 0,
                            num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, window_ptr, entries_ptr, index_ptr, pos_ptr, acc_ptr, stats_ptr, heads, d, dv,
                      n_window, n_comp, ratio, keys_per_split, splits, scale,
                      PICKS: tl.constexpr, TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr):
        """Heads [hb * BLOCK_H, +BLOCK_H) over keys [split * keys_per_split, +keys_per_split) of
        the window rows followed by the compressed keys: the split's running max, its sum of
        exp(logit - max) and its unnormalised output (the keys' first dv features), in
        float32. TAIL: the features dv .. d - 1 are key-only (they join the logits alone)."""
        hb = tl.program_id(0)
        split = tl.program_id(1)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        live_h = h < heads
        dd = tl.arange(0, BLOCK_D)
        live_d = dd < dv
        q = tl.load(q_ptr + h[:, None] * d + dd[None, :], mask=live_h[:, None] & live_d[None, :], other=0.0)
        tt = dv + tl.arange(0, BLOCK_T)
        live_t = tt < d
        if TAIL:
            q_tail = tl.load(q_ptr + h[:, None] * d + tt[None, :], mask=live_h[:, None] & live_t[None, :], other=0.0)
        pos = tl.load(pos_ptr)
        limit = (pos + 1) // ratio  # compressed entry w is visible iff w < limit
        m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)  # finite: an all-masked block gives p = 0, not NaN
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        n_keys = n_window + n_comp
        start = split * keys_per_split
        for k0 in range(start, start + keys_per_split, BLOCK_N):
            j = k0 + tl.arange(0, BLOCK_N)
            in_window = j < n_window
            c = j - n_window
            in_comp = (j >= n_window) & (j < n_keys)
            if PICKS:
                row = tl.load(index_ptr + c, mask=in_comp, other=-1).to(tl.int32)
            else:
                row = c
            comp_ok = in_comp & (row >= 0) & (row < limit)
            ok = (in_window & (j <= pos)) | comp_ok
            w_rows = window_ptr + j.to(tl.int64)[:, None] * d  # each key's row, in one of the two tables
            e_rows = entries_ptr + tl.where(comp_ok, row, 0).to(tl.int64)[:, None] * d
            w_ok = (in_window & ok)[:, None]
            kw = tl.load(w_rows + dd[None, :], mask=w_ok & live_d[None, :], other=0.0)
            kc = tl.load(e_rows + dd[None, :], mask=comp_ok[:, None] & live_d[None, :], other=0.0)
            k = kw + kc  # each key is one of the two (the other loaded as 0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if TAIL:
                k_tail = (tl.load(w_rows + tt[None, :], mask=w_ok & live_t[None, :], other=0.0)
                          + tl.load(e_rows + tt[None, :], mask=comp_ok[:, None] & live_t[None, :], other=0.0))
                if IEEE:
                    s += tl.dot(q_tail, tl.trans(k_tail), input_precision="ieee")
                else:
                    s += tl.dot(q_tail, tl.trans(k_tail))
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, k, input_precision="ieee")
            else:
                pv = tl.dot(p.to(k.dtype), k)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        base = split * heads + h
        tl.store(acc_ptr + base.to(tl.int64)[:, None] * dv + dd[None, :], acc,
                 mask=live_h[:, None] & live_d[None, :])
        tl.store(stats_ptr + base, m_i, mask=live_h)
        tl.store(stats_ptr + splits * heads + base, l_i, mask=live_h)

    @triton.jit
    def _merge_kernel(acc_ptr, stats_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, heads, d, splits, rope_dim,
                      HALF: tl.constexpr, SPLITS: tl.constexpr, SINK: tl.constexpr, ROPE: tl.constexpr):
        """One head: the splits merged with the sink (SINK) in the denominator, rounded once to the
        output dtype, then (ROPE) the trailing rope_dim features rotated back by the query's
        angles (pairs (2p, 2p + 1), loaded as two halves, as norm_rope's kernel does)."""
        h = tl.program_id(0)
        s = tl.arange(0, SPLITS)
        live_s = s < splits
        m = tl.load(stats_ptr + s * heads + h, mask=live_s, other=-1.0e30)
        l_s = tl.load(stats_ptr + splits * heads + s * heads + h, mask=live_s, other=0.0)
        top = tl.max(m, axis=0)
        if SINK:
            sink = tl.load(sinks_ptr + h)
            top = tl.maximum(top, sink)
        w = tl.exp(m - top)
        denominator = tl.sum(l_s * w, axis=0)
        if SINK:
            denominator += tl.exp(sink - top)
        p = tl.arange(0, HALF)
        live = p < d // 2
        rows = (s * heads + h).to(tl.int64)[:, None] * d
        both = live_s[:, None] & live[None, :]
        even = tl.sum(tl.load(acc_ptr + rows + 2 * p[None, :], mask=both, other=0.0) * w[:, None], axis=0)
        odd = tl.sum(tl.load(acc_ptr + rows + 2 * p[None, :] + 1, mask=both, other=0.0) * w[:, None], axis=0)
        out_ty = out_ptr.dtype.element_ty
        even = (even / denominator).to(out_ty).to(tl.float32)
        odd = (odd / denominator).to(out_ty).to(tl.float32)
        if ROPE:  # apply_rope(out, cos, -sin)
            k = p - (d - rope_dim) // 2
            turn = live & (k >= 0)
            c = tl.load(cos_ptr + k, mask=turn, other=1.0)
            sn = -tl.load(sin_ptr + k, mask=turn, other=0.0)
            rot_even = even * c + (-odd) * sn
            rot_odd = odd * c + even * sn
            even = tl.where(turn, rot_even, even)
            odd = tl.where(turn, rot_odd, odd)
        base = h.to(tl.int64) * d
        tl.store(out_ptr + base + 2 * p, even.to(out_ty), mask=live)
        tl.store(out_ptr + base + 2 * p + 1, odd.to(out_ty), mask=live)
