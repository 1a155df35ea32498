"""A DeepSeek-V4 compressor's decode step, in one launch on CUDA.

A compressor turns every `ratio` tokens into one entry of the compressed KV cache:
the open window's rows (kv and gate projections of each token) are pooled feature by
feature, a softmax over the window's slots of gate + ape weighting the kv values, then
RMSNorm'd and rope'd at the window's first position. CSA (`overlap`) pools 2 * ratio
slots: the first half of the features of the previous window's rows and the second
half of the open window's; HCA pools the `ratio` rows of the open window.

In the fixed-shape decode state (`models.deepseek4_static.StaticCompressor`) a step
writes the token's rows into slot pos % ratio of the pending window; the step that
closes the window (slot ratio - 1) pools it into entry pos // ratio (masked from
attention and the indexer until then, so never read before) and keeps the window's
first-half features (gate with ape, float32) as the next window's overlap. In torch
that is about 25 launches of a few kilobytes, every step (the torch code pools every
step and keeps the result on the closing one: no host sync). `compress_step_reference`
is that torch code (and the CPU path); `compress_step` does all of it in one Triton
program on CUDA, pooling only on the closing step (an HCA window of 128 slots is read
once, not 128 times), rounding where the reference rounds (the
gate + ape sum in float32, the entry after the norm and after the rope), so the two
differ only in float32 roundings: the softmax's (online over blocks of slots, with the
GPU's approximate exponential), the order of its sums and of the norm's sum of squares,
and one fused multiply-add per rotated feature (tests/test_compressor_kernel.py derives
the bound). The buffers other than the entry are bitwise copies either way.

`pool_windows` is the pooling of closed windows that the eager (prefill) path shares.
Set EXPERTDESK_COMPRESSOR_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch

from .norm_rope import apply_rope, rms_norm, wide_dtype
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["compress_step", "compress_step_reference", "pool_windows"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of one [slots, features] tile of the kernel: a block of 16 slots of 512
# features for HCA (8 blocks for ratio 128), all 4 slots at once for CSA.
_TILE = 8192
SWITCH = TritonSwitch("EXPERTDESK_COMPRESSOR_TRITON", "compressor")


# ---------------------------------------------------------------------------------------
# References (and the CPU path)


def pool_windows(chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                 prev_gate: torch.Tensor | None, norm: torch.Tensor, ratio: int, head_dim: int, overlap: bool,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Entries of windows: chunk_kv / chunk_gate (gate + ape) [windows, ratio, width], CSA's
    first half of the window before the first one (prev_*, [ratio, head_dim]; None before
    the first window) and the rope angles of each window's first position (cos / sin
    [windows, rope_dim / 2]). Returns [windows, head_dim] in chunk_kv's dtype."""
    m, d = ratio, head_dim
    n_windows = chunk_kv.shape[0]
    if overlap:
        pooled_kv = chunk_kv.new_zeros((n_windows, 2 * m, d))
        pooled_gate = chunk_gate.new_full((n_windows, 2 * m, d), float("-inf"))
        pooled_kv[:, m:] = chunk_kv[..., d:]
        pooled_gate[:, m:] = chunk_gate[..., d:]
        pooled_kv[1:, :m] = chunk_kv[:-1, :, :d]
        pooled_gate[1:, :m] = chunk_gate[:-1, :, :d]
        if prev_kv is not None:
            assert prev_gate is not None  # set together with prev_kv
            pooled_kv[0, :m] = prev_kv
            pooled_gate[0, :m] = prev_gate
    else:
        pooled_kv, pooled_gate = chunk_kv, chunk_gate
    # Pooled in float32 (up to 2 x 128 terms a window); the entry is cast back once.
    # The softmax runs over the slots (dim 1), computed on the transposed view: torch's
    # softmax over a middle dim is a slow kernel on CUDA (0.23 ms a token at real size).
    weights = pooled_gate.transpose(1, 2).softmax(dim=-1, dtype=wide_dtype(pooled_kv.dtype)).transpose(1, 2)
    pooled = (pooled_kv.to(weights.dtype) * weights).sum(dim=1)
    compressed = rms_norm(pooled, norm, eps).to(pooled_kv.dtype)
    return apply_rope(compressed, cos, sin)


def compress_step_reference(kv_new: torch.Tensor, gate_new: torch.Tensor, pending_kv: torch.Tensor,
                            pending_gate: torch.Tensor, overlap_kv: torch.Tensor, overlap_gate: torch.Tensor,
                            entries: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, ratio: int, head_dim: int, overlap: bool,
                            eps: float) -> None:
    """One token's step of a compressor on its fixed-shape buffers, in place (module
    docstring): kv_new / gate_new [1, width] are the token's projections, pos its position
    (a device tensor [1], never read on the host), cos / sin [1, rope_dim / 2] the angles
    of the open window's first position. overlap_* are not touched without `overlap`."""
    m, d = ratio, head_dim
    slot, window = pos % m, pos // m
    pending_kv.index_copy_(0, slot, kv_new)
    pending_gate.index_copy_(0, slot, gate_new)
    chunk_kv = pending_kv.view(1, m, -1)
    chunk_gate = pending_gate.view(1, m, -1) + ape
    prev_kv = prev_gate = None
    if overlap:  # the previous window's first half exists once a window has closed
        seen = (window > 0).view(1, 1)
        prev_kv = torch.where(seen, overlap_kv, 0.0)
        prev_gate = torch.where(seen, overlap_gate, float("-inf"))
    pooled = pool_windows(chunk_kv, chunk_gate, prev_kv, prev_gate, norm, m, d, overlap, eps, cos, sin)
    closing = (slot == m - 1).view(1, 1)
    entries.index_copy_(0, window, torch.where(closing, pooled, entries.index_select(0, window)))
    if overlap:
        overlap_kv.copy_(torch.where(closing, chunk_kv[0, :, :d], overlap_kv))
        overlap_gate.copy_(torch.where(closing, chunk_gate[0, :, :d], overlap_gate))


# ---------------------------------------------------------------------------------------
# The dispatching function the model calls


def compress_step(kv_new: torch.Tensor, gate_new: torch.Tensor, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
                  overlap_kv: torch.Tensor, overlap_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
                  norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, ratio: int,
                  head_dim: int, overlap: bool, eps: float) -> None:
    """`compress_step_reference`, in one launch on CUDA (graph-capturable: pos stays on the
    device). One difference: an entry row past `entries`' capacity is not written by the
    kernel, where the reference's index_copy_ fails (the model grows the buffers first)."""
    args = (kv_new, gate_new, pending_kv, pending_gate, overlap_kv, overlap_gate, entries, ape, norm, cos, sin, pos,
            ratio, head_dim, overlap, eps)

    def reference() -> None:
        compress_step_reference(*args)

    if not _applies(*args):
        reference()
        return
    SWITCH.run(pending_kv.device, lambda: _launch(*args), reference)


def _applies(kv_new: torch.Tensor, gate_new: torch.Tensor, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
             overlap_kv: torch.Tensor, overlap_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
             norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, ratio: int, head_dim: int,
             overlap: bool, eps: float) -> bool:
    """Whether the kernel computes exactly what the reference does here: the buffers it
    writes in place contiguous and of the shapes the reference reads, the gate + ape sum
    and the overlap gate in float32 (the model's), the angles in float32."""
    if not SWITCH.applies(pending_kv):
        return False
    m, d = ratio, head_dim
    dtype, width = pending_kv.dtype, (2 if overlap else 1) * d
    if dtype not in _KERNEL_DTYPES or m < 1 or d < 2 or d % 2:
        return False
    same = [kv_new, gate_new, pending_kv, pending_gate, entries] + ([overlap_kv] if overlap else [])
    if any(t.dtype != dtype for t in same) or ape.dtype != torch.float32 or norm.dtype not in _KERNEL_DTYPES:
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or pos.dtype != torch.long or pos.numel() != 1:
        return False
    written = [pending_kv, pending_gate, entries] + ([overlap_kv, overlap_gate] if overlap else [])
    if any(not t.is_contiguous() for t in written) or (overlap and overlap_gate.dtype != torch.float32):
        return False
    shapes = [(pending_kv, (m, width)), (pending_gate, (m, width)), (ape, (m, width))]
    if overlap:
        shapes += [(overlap_kv, (m, d)), (overlap_gate, (m, d))]
    if any(tuple(t.shape) != shape for t, shape in shapes) or entries.dim() != 2 or entries.shape[1] != d:
        return False
    if kv_new.numel() != width or gate_new.numel() != width or norm.numel() != d:
        return False
    if cos.numel() != sin.numel() or 2 * cos.numel() > d:
        return False
    device = pending_kv.device
    return all(t.device == device for t in (kv_new, gate_new, pending_gate, overlap_kv, overlap_gate, entries, ape,
                                            norm, cos, sin, pos))


def _slot_block(ratio: int, head_dim: int) -> int:
    """Slots per tile of the kernel (a power of two): the whole window where it fits."""
    return max(1, min(triton.next_power_of_2(ratio), _TILE // triton.next_power_of_2(head_dim)))


def _launch(kv_new: torch.Tensor, gate_new: torch.Tensor, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
            overlap_kv: torch.Tensor, overlap_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
            norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, ratio: int, head_dim: int,
            overlap: bool, eps: float) -> None:
    features = triton.next_power_of_2(head_dim)
    block = _slot_block(ratio, head_dim)
    if not overlap:  # never read nor written: any pointer of the right type will do
        overlap_kv, overlap_gate = pending_kv, ape
    _compress_kernel[(1,)](kv_new.contiguous(), gate_new.contiguous(), pending_kv, pending_gate, overlap_kv,
                           overlap_gate, entries, ape.contiguous(), norm.contiguous(), cos.contiguous(),
                           sin.contiguous(), pos, entries.shape[0], eps, RATIO=ratio, D=head_dim,
                           WIDTH=pending_kv.shape[1], ROPE=2 * cos.numel(), OVERLAP=overlap, FEATURES=features,
                           BLOCK_S=block, num_warps=8 if block * features >= 4096 else 4)


if triton is not None:

    @triton.jit
    def _absorb(mx, total, acc, gate, kv):
        """Online softmax over slots, per feature: fold a [slots, features] block of gates
        (-inf for slots that are not there) and kv values into the running maximum, the
        denominator and the weighted sum."""
        new_mx = tl.maximum(mx, tl.max(gate, axis=0))
        ref = tl.where(new_mx == float("-inf"), 0.0, new_mx)  # no slot yet: exp(-inf) = 0, not nan
        scale = tl.exp(mx - ref)
        p = tl.exp(gate - ref[None, :])
        return new_mx, total * scale + tl.sum(p, axis=0), acc * scale + tl.sum(p * kv, axis=0)

    @triton.jit
    def _window_rows(pending_kv, pending_gate, ape, kv_new, gate_new, rows, f, live, slot, col,
                     WIDTH: tl.constexpr, RATIO: tl.constexpr):
        """Features col + f of the open window's `rows` [slots]: kv as stored and gate + ape
        in float32 (as the reference's chunk_gate). The token's own slot comes from kv_new /
        gate_new, not from the buffer this launch writes it to (no read after write)."""
        there = rows < RATIO
        fresh = (rows == slot)[:, None]
        offs = rows[:, None] * WIDTH + col + f[None, :]
        both = there[:, None] & live[None, :]
        old = both & (rows != slot)[:, None]
        kv = tl.load(pending_kv + offs, mask=old, other=0.0)
        kv = tl.where(fresh, tl.load(kv_new + col + f, mask=live, other=0.0)[None, :], kv)
        gate = tl.load(pending_gate + offs, mask=old, other=0.0)
        gate = tl.where(fresh, tl.load(gate_new + col + f, mask=live, other=0.0)[None, :], gate)
        gate = gate.to(tl.float32) + tl.load(ape + offs, mask=both, other=0.0)
        return kv, gate, there

    @triton.jit
    def _compress_kernel(kv_new, gate_new, pending_kv, pending_gate, overlap_kv, overlap_gate, entries, ape, norm,
                         cos_ptr, sin_ptr, pos_ptr, capacity, eps, RATIO: tl.constexpr, D: tl.constexpr,
                         WIDTH: tl.constexpr, ROPE: tl.constexpr, OVERLAP: tl.constexpr, FEATURES: tl.constexpr,
                         BLOCK_S: tl.constexpr):
        """The whole step in one program: the slot write and, on the closing slot only, the
        pooling (blocks of BLOCK_S slots, online softmax per feature), RMSNorm, rope, entry
        write and overlap (`_close_window`). A row
        of the window is WIDTH = 2 * D features for CSA (the pooled ones are the second
        half), D for HCA."""
        pos = tl.load(pos_ptr)
        slot = pos % RATIO
        window = pos // RATIO
        f = tl.arange(0, FEATURES)
        live = f < D

        # The token's rows into its slot (nothing below reads them back from memory).
        for half in tl.static_range(WIDTH // D):
            cols = half * D + f
            tl.store(pending_kv + slot * WIDTH + cols, tl.load(kv_new + cols, mask=live), mask=live)
            tl.store(pending_gate + slot * WIDTH + cols, tl.load(gate_new + cols, mask=live), mask=live)

        if slot == RATIO - 1:  # the window closes: its entry, and (CSA) the next overlap
            _close_window(kv_new, gate_new, pending_kv, pending_gate, overlap_kv, overlap_gate, entries, ape, norm,
                          cos_ptr, sin_ptr, slot, window, capacity, eps, RATIO, D, WIDTH, ROPE, OVERLAP, FEATURES,
                          BLOCK_S)

    @triton.jit
    def _close_window(kv_new, gate_new, pending_kv, pending_gate, overlap_kv, overlap_gate, entries, ape, norm,
                      cos_ptr, sin_ptr, slot, window, capacity, eps, RATIO: tl.constexpr, D: tl.constexpr,
                      WIDTH: tl.constexpr, ROPE: tl.constexpr, OVERLAP: tl.constexpr, FEATURES: tl.constexpr,
                      BLOCK_S: tl.constexpr):
        """The closing step: the window pooled into its entry, and (CSA) its first half kept
        as the next window's overlap."""
        f = tl.arange(0, FEATURES)
        live = f < D
        slots = tl.arange(0, BLOCK_S)
        # Pooling: the window's slots, then (CSA) the last closed window's first half,
        # which is no slot at all (gate -inf) while the first window is open.
        mx = tl.full((FEATURES,), float("-inf"), tl.float32)
        total = tl.zeros((FEATURES,), tl.float32)
        acc = tl.zeros((FEATURES,), tl.float32)
        for start in range(0, RATIO, BLOCK_S):
            rows = start + slots
            kv, gate, there = _window_rows(pending_kv, pending_gate, ape, kv_new, gate_new, rows, f, live, slot,
                                           WIDTH - D, WIDTH, RATIO)
            gate = tl.where(there[:, None], gate, float("-inf"))
            mx, total, acc = _absorb(mx, total, acc, gate, kv.to(tl.float32))
        if OVERLAP:
            closed = tl.where(window > 0, RATIO, 0)  # rows of the last closed window there are
            for start in range(0, RATIO, BLOCK_S):
                rows = start + slots
                offs = rows[:, None] * D + f[None, :]
                seen = (rows < closed)[:, None] & live[None, :]
                kv = tl.load(overlap_kv + offs, mask=seen, other=0.0).to(tl.float32)
                gate = tl.load(overlap_gate + offs, mask=seen, other=float("-inf"))
                mx, total, acc = _absorb(mx, total, acc, gate, kv)
        pooled = tl.where(live, acc / total, 0.0)

        # RMSNorm (float32, the entry's dtype once), rope on the trailing ROPE features.
        out_ty = entries.dtype.element_ty
        r = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
        gains = tl.load(norm + f, mask=live, other=0.0).to(tl.float32)
        normed = (gains * (pooled * r)).to(out_ty).to(tl.float32)
        even, odd = tl.split(tl.reshape(normed, (FEATURES // 2, 2)))
        p = tl.arange(0, FEATURES // 2)
        k = p - (D - ROPE) // 2
        turn = (p < D // 2) & (k >= 0)
        c = tl.load(cos_ptr + k, mask=turn, other=1.0)
        s = tl.load(sin_ptr + k, mask=turn, other=0.0)
        even, odd = tl.where(turn, even * c + (-odd) * s, even), tl.where(turn, odd * c + even * s, odd)
        entry = tl.reshape(tl.join(even, odd), (FEATURES,)).to(out_ty)
        tl.store(entries + window * D + f, entry, mask=f < tl.where(window < capacity, D, 0))

        # CSA: the window's first half (gate with ape) is the next overlap. Every thread has
        # read the old overlap above before any overwrites it.
        if OVERLAP:
            tl.debug_barrier()
            for start in range(0, RATIO, BLOCK_S):
                rows = start + slots
                kv, gate, there = _window_rows(pending_kv, pending_gate, ape, kv_new, gate_new, rows, f, live,
                                               slot, 0, WIDTH, RATIO)
                offs = rows[:, None] * D + f[None, :]
                keep = there[:, None] & live[None, :]
                tl.store(overlap_kv + offs, kv, mask=keep)
                tl.store(overlap_gate + offs, gate, mask=keep)
