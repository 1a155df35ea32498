"""Fused prefill MoE of routed experts stored as Q2_K / Q3_K (Kimi-K3's releases): tensor-core Triton kernels.

The K-quant counterpart of `engine.kernels.moe_mxfp4_prefill`, with its layout and its two
kernels: the T * k (token, expert) pairs of a chunk sorted by expert and padded to
M-blocks (`prefill_layout`, on the device, no host sync), then

1. per (M-block, N-block of BLOCK_N intermediate rows): the block's x rows gathered, the
   expert's gate and up tiles [BLOCK_N, 32] decoded from their GGUF bytes in
   registers to the dot dtype, both products accumulated with `tl.dot` in float32, the
   activation (swiglu or situ) in float32, stored as act [sorted slot, inter] in x's dtype;
2. per (M-block, N-block of d_out rows): the down projection of act the same way, times
   the pair's routing weight, stored to y [T * k, d_out] float32 at the pair's own row,
   then y.view(T, k, d_out).sum(1): a fixed order, no atomics.

Each used expert's bytes are read about once per chunk (the M-blocks of one expert run side
by side and share its tiles through L2), where `engine.kernels.moe_prefill`'s batches
dequantize every used expert to a bf16 copy first: Kimi-K3's Q2_K/Q3_K expert is about
11 MB in the file and 66 MB in bf16, and a 512-token chunk uses nearly all 896 experts
of a layer, so the copies were written and read back at six times the file's bytes.

Decoding, as `engine.kernels.dequant`'s K-quant kernel walks a super block: per row its d
(and dmin; Q3_K's hmask bytes) once, the packed bits once per 128 values (byte hl of chunk
c holds value 32 k + hl of the four steps k = 4c + j at bits 2j), each step's two sub-block
scales once; a step (32 values, natural order: value v = 32 k + 16 h + l, sub-block
s = 2 k + h) is one tile [BLOCK_N, 32] and one tl.dot with K = 32. A first version that
gathered every value's bytes and scale separately (64-value steps) decoded so slowly that
it took 2.9x the batched path's time (benchmarks/RESULTS.md).
- Q2_K (scales[16] | qs[64] | d | dmin): q = (qs[32 (k // 4) + 16 h + l] >> 2 (k % 4)) & 3,
  sc = scales[s]; w = (d * (sc & 15)) * q - dmin * (sc >> 4).
- Q3_K (hmask[32] | qs[64] | scales[12] | d): u = ((qs[...] >> 2 (k % 4)) & 3) | (bit k of
  hmask[16 h + l]) << 2, the 6-bit scale of sub-block s from its low nibble and high crumb;
  w = (d * (sc - 32)) * (u - 4).
These are `engine.kernels.dequant`'s formulas in its order of float32 operations (a value
may differ by one rounding where the compiler fuses a multiply-add), rounded to the dot
dtype as the reference's dequantization to x's dtype rounds them.

`prefill_applies` says when the fused path runs (CUDA or the interpreter,
EXPERTDESK_FUSED_MOE_QUANT != "0" as for the decode kernels of `engine.kernels.moe_quant`,
gate and up of one of these types, down of one of them, widths multiples of 256); a kernel
that cannot compile or launch warns once and `moe_prefill_reference` serves from then on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .moe_mxfp4 import activation_args, operands_fit, table_fits
from .moe_mxfp4_prefill import GROUP_M, PrefillBuffers, moe_prefill_reference
from .triton_switch import TritonSwitch

try:  # Triton ships with the CUDA builds of torch on Linux; absent on CPU installs.
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

if TYPE_CHECKING:
    from .moe import ExpertRows

__all__ = ["SWITCH", "fused_quant_moe_prefill", "prefill_applies"]

Q2_K = int(GGMLQuantizationType.Q2_K)
Q3_K = int(GGMLQuantizationType.Q3_K)
TYPES = (Q2_K, Q3_K)

# (BLOCK_N, num_warps, num_stages) of each kernel; the K step is one 32-value step of a super block.
GATE_UP_CONFIG: tuple[int, int, int] = (64, 4, 2)
DOWN_CONFIG: tuple[int, int, int] = (64, 4, 2)

# The decode kernels' switch variable: one lever for the fused K-quant experts.
SWITCH = TritonSwitch("EXPERTDESK_FUSED_MOE_QUANT", "fused K-quant prefill")


def _type_size(ggml_type: int) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]


def supported(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether the kernels handle these operands, on any device: an activation and x the
    expert kernels take (`operands_fit`), gate and up of one type, every role Q2_K or
    Q3_K with whole super blocks per row, one table length for the three roles."""
    if not operands_fit(x, gate, up, down, activation) or gate.ggml_type != up.ggml_type:
        return False
    for rows in (gate, up, down):
        if int(rows.ggml_type) not in TYPES or rows.shape[1] % 256 or not table_fits(rows, x):
            return False
    return gate.table.shape[0] == up.table.shape[0] == down.table.shape[0]


def prefill_applies(x: torch.Tensor, k: int, gate: ExpertRows, up: ExpertRows, down: ExpertRows,
                    activation: Any) -> bool:
    """Whether `fused_quant_moe_prefill` runs the kernels on x [T, d_in] with top-k routing
    (on a GPU; see the module docstring)."""
    return x.is_cuda and int(k) >= 1 and SWITCH.applies(x) and supported(x, gate, up, down, activation)


def fused_quant_moe_prefill(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                            gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    """sum over j of weights[t, j] * down_r(act(gate_r x[t], up_r x[t])), r = chosen[t, j].

    x [T, d_in]; chosen and weights [T, k] on x's device; [T, d_out] in x's dtype. Every
    pair is computed (top-k unchanged). Operands the kernels do not take (or no Triton, or
    CPU tensors outside TRITON_INTERPRET=1) go to `moe_prefill_reference`, as does every
    call after a kernel failed to compile or launch (warned once).
    """
    def reference() -> torch.Tensor:
        return moe_prefill_reference(x, chosen, weights, gate, up, down, activation)

    if not (SWITCH.available(x) and supported(x, gate, up, down, activation)):
        return reference()
    return SWITCH.run(x.device, lambda: _launch(x, chosen, weights, gate, up, down, activation), reference)


def _launch(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
            gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    t, k = chosen.shape
    inter, d_in = gate.shape
    d_out = down.shape[0]
    if t * k == 0:
        return x.new_zeros((t, d_out))
    b = PrefillBuffers.make(x, chosen, weights, gate.table.shape[0], inter, d_out)
    kind, clamp, p1, p2 = activation_args(activation)
    ieee = x.dtype == torch.float32

    block_n, warps, stages = GATE_UP_CONFIG
    _gate_up_kernel[(b.n_blocks * triton.cdiv(inter, block_n),)](
        b.x, b.x.stride(0), b.sorted_ids, b.block_expert, gate.table, gate.table.stride(0),
        up.table, up.table.stride(0), b.act, k, d_in, inter, b.n_blocks, p1, p2,
        QTYPE=int(gate.ggml_type), TYPE_SIZE=_type_size(gate.ggml_type), ACT=kind, CLAMP=clamp, IEEE=ieee,
        BLOCK_M=b.block_m, BLOCK_N=block_n, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    block_n, warps, stages = DOWN_CONFIG
    _down_kernel[(b.n_blocks * triton.cdiv(d_out, block_n),)](
        b.act, b.sorted_ids, b.block_expert, down.table, down.table.stride(0), b.weights, b.y, inter, d_out,
        b.n_blocks, QTYPE=int(down.ggml_type), TYPE_SIZE=_type_size(down.ggml_type), IEEE=ieee,
        BLOCK_M=b.block_m, BLOCK_N=block_n, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return b.summed(chosen)


if triton is not None:
    from .dequant import _ld_f16, _ld_u8
    from .moe_mxfp4 import _activation
    from .moe_mxfp4_prefill import _dot, _tile

    @triton.jit
    def _block_fields(blk, n_ok, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Per row, the super block's d, dmin (Q2_K; Q3_K: d again, unused) and hmask bytes
        [BN, 32] (Q3_K; Q2_K: zeros, unused)."""
        hl = tl.arange(0, 32)[None, :]
        if QTYPE == 10:
            d = _ld_f16(blk + 80, n_ok)[:, None]
            dmin = _ld_f16(blk + 82, n_ok)[:, None]
            hm = tl.zeros((BLOCK_N, 32), dtype=tl.int32)
        else:
            d = _ld_f16(blk + 108, n_ok)[:, None]
            dmin = d
            hm = _ld_u8(blk[:, None] + hl, n_ok[:, None])
        return d, dmin, hm

    @triton.jit
    def _chunk_bits(blk, n_ok, c: tl.constexpr, QTYPE: tl.constexpr):
        """The packed 2-bit quants [BN, 32] of steps 4c .. 4c + 3 (byte hl holds value
        32 k + hl of step k = 4c + j at bits 2j)."""
        hl = tl.arange(0, 32)[None, :]
        if QTYPE == 10:  # Q2_K: qs at byte 16
            return _ld_u8(blk[:, None] + 16 + 32 * c + hl, n_ok[:, None])
        return _ld_u8(blk[:, None] + 32 + 32 * c + hl, n_ok[:, None])  # Q3_K: qs after hmask

    @triton.jit
    def _per_value(pair, BLOCK_N: tl.constexpr):
        """[BN, 2] (one number per 16-value sub-block of a step) as [BN, 32]."""
        return tl.reshape(tl.broadcast_to(pair[:, :, None], (BLOCK_N, 2, 16)), (BLOCK_N, 32))

    @triton.jit
    def _step_weights(blk, n_ok, qs, hm, d, dmin, k: tl.constexpr, DTYPE: tl.constexpr, QTYPE: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """The weights [BN, 32] of step k (values 32 k ... 32 k + 31 of the super block), in
        natural order, decoded to DTYPE from the chunk's bits `qs` and the block's fields."""
        h = tl.arange(0, 2)[None, :]
        m = n_ok[:, None]
        q = (qs >> (2 * (k % 4))) & 3
        if QTYPE == 10:  # Q2_K: (d * (sc & 15)) * q - dmin * (sc >> 4), sc = scales[2k + h]
            sc = _ld_u8(blk[:, None] + 2 * k + h, m)
            dl = _per_value(d * (sc & 15).to(tl.float32), BLOCK_N)
            ml = _per_value(dmin * (sc >> 4).to(tl.float32), BLOCK_N)
            w = dl * q.to(tl.float32) - ml
        else:  # Q3_K: (d * (sc - 32)) * (u - 4), the 6-bit scale of sub-block 2k + h
            low4 = (_ld_u8(blk[:, None] + 96 + (2 * k) % 8 + h, m) >> (k // 4 * 4)) & 15
            high2 = (_ld_u8(blk[:, None] + 104 + (2 * k) % 4 + h, m) >> (k // 2 * 2)) & 3
            dl = _per_value(d * ((low4 | (high2 << 4)) - 32).to(tl.float32), BLOCK_N)
            u = q | (((hm >> k) & 1) << 2)
            w = dl * (u - 4).to(tl.float32)
        if DTYPE != tl.float32:
            w = w.to(DTYPE, fp_downcast_rounding="rtne")
        return w

    @triton.jit
    def _gate_up_kernel(x, x_stride, sorted_ids, block_expert, gate, gate_stride, up, up_stride, act,
                        k_top, d_in, inter, n_blocks, p1, p2,
                        QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """act[slot, n] = activation(gate_r[n] . x[t], up_r[n] . x[t]) for this program's slots and n."""
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, inter, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        if expert < 0:
            return
        DTYPE = x.dtype.element_ty
        token = tl.where(m_ok, pair // k_top, 0).to(tl.int64)
        row_start = n.to(tl.int64) * ((d_in // 256) * TYPE_SIZE)
        gate_rows = gate + expert * gate_stride + row_start
        up_rows = up + expert * up_stride + row_start
        x_rows = x + token[:, None] * x_stride + tl.arange(0, 32)[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sb in range(0, d_in // 256):
            bg = gate_rows + sb * TYPE_SIZE
            bu = up_rows + sb * TYPE_SIZE
            dg, mg, hg = _block_fields(bg, n_ok, QTYPE, BLOCK_N)
            du, mu, hu = _block_fields(bu, n_ok, QTYPE, BLOCK_N)
            for c in tl.static_range(2):
                qg = _chunk_bits(bg, n_ok, c, QTYPE)
                qu = _chunk_bits(bu, n_ok, c, QTYPE)
                for j in tl.static_range(4):
                    xs = tl.load(x_rows + sb * 256 + 32 * (4 * c + j), mask=m_ok[:, None], other=0.0)
                    wg = _step_weights(bg, n_ok, qg, hg, dg, mg, 4 * c + j, DTYPE, QTYPE, BLOCK_N)
                    wu = _step_weights(bu, n_ok, qu, hu, du, mu, 4 * c + j, DTYPE, QTYPE, BLOCK_N)
                    acc_g = _dot(xs, wg, acc_g, IEEE)
                    acc_u = _dot(xs, wu, acc_u, IEEE)
        a = _activation(acc_g, acc_u, p1, p2, ACT, CLAMP)
        out = act + slots.to(tl.int64)[:, None] * inter + n[None, :]
        tl.store(out, a.to(act.dtype.element_ty), mask=n_ok[None, :])

    @triton.jit
    def _down_kernel(act, sorted_ids, block_expert, down, down_stride, weights, y, inter, d_out, n_blocks,
                     QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """y[p, n] = weights[p] * (down_r[n] . act[slot of p]) for this program's slots and n."""
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, d_out, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        out = y + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * d_out + n[None, :]
        if expert < 0:  # past the last used block, or the bucket of invalid ids: zero
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=m_ok[:, None] & n_ok[None, :])
            return
        DTYPE = act.dtype.element_ty
        down_rows = down + expert * down_stride + n.to(tl.int64) * ((inter // 256) * TYPE_SIZE)
        a_rows = act + slots.to(tl.int64)[:, None] * inter + tl.arange(0, 32)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sb in range(0, inter // 256):
            bd = down_rows + sb * TYPE_SIZE
            dd, md, hd = _block_fields(bd, n_ok, QTYPE, BLOCK_N)
            for c in tl.static_range(2):
                qd = _chunk_bits(bd, n_ok, c, QTYPE)
                for j in tl.static_range(4):
                    a = tl.load(a_rows + sb * 256 + 32 * (4 * c + j))
                    wd = _step_weights(bd, n_ok, qd, hd, dd, md, 4 * c + j, DTYPE, QTYPE, BLOCK_N)
                    acc = _dot(a, wd, acc, IEEE)
        route = tl.load(weights + tl.where(m_ok, pair, 0), mask=m_ok, other=0.0)
        tl.store(out, acc * route[:, None], mask=m_ok[:, None] & n_ok[None, :])
