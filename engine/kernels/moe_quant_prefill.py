"""Fused prefill MoE of routed experts stored as Q2_K / Q3_K (Kimi-K3's releases): tensor-core Triton kernels.

The K-quant counterpart of `engine.kernels.moe_mxfp4_prefill`, with its layout and its two
kernels: the T * k (token, expert) pairs of a chunk sorted by expert and padded to
M-blocks (`prefill_layout`, on the device, no host sync), then

1. per (M-block, N-block of BLOCK_N intermediate rows): the block's x rows gathered, the
   expert's gate and up tiles [BLOCK_N, BLOCK_K] decoded from their GGUF bytes in
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

Decoding. A K step of BLOCK_K values (a divisor of 256) lies in one super block; the tile's
columns are in natural order: value v = 32 k + 16 h + l of the super block (step k of 8,
sub-block s = 2 k + h) is column v - v0. Per row the block's d (and dmin) are loaded once a
step, the scale bytes and packed bits once per value (they come from L1):
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
from .moe_mxfp4_prefill import GROUP_M, block_m_for, moe_prefill_reference, prefill_layout
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

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel; BLOCK_K divides 256.
GATE_UP_CONFIG: tuple[int, int, int, int] = (64, 64, 4, 2)
DOWN_CONFIG: tuple[int, int, int, int] = (64, 64, 4, 2)

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
    pairs = t * k
    if pairs == 0:
        return x.new_zeros((t, d_out))
    if x.stride(1) != 1:
        x = x.contiguous()
    n_experts = gate.table.shape[0]
    block_m = block_m_for(pairs, n_experts)
    sorted_ids, block_expert = prefill_layout(chosen, n_experts, block_m)
    n_blocks = block_expert.numel()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty((n_blocks * block_m, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, d_out), dtype=torch.float32, device=x.device)
    kind, clamp, p1, p2 = activation_args(activation)
    ieee = x.dtype == torch.float32

    block_n, bk, warps, stages = GATE_UP_CONFIG
    _gate_up_kernel[(n_blocks * triton.cdiv(inter, block_n),)](
        x, x.stride(0), sorted_ids, block_expert, gate.table, gate.table.stride(0),
        up.table, up.table.stride(0), act, k, d_in, inter, n_blocks, p1, p2,
        QTYPE=int(gate.ggml_type), TYPE_SIZE=_type_size(gate.ggml_type), ACT=kind, CLAMP=clamp, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    block_n, bk, warps, stages = DOWN_CONFIG
    _down_kernel[(n_blocks * triton.cdiv(d_out, block_n),)](
        act, sorted_ids, block_expert, down.table, down.table.stride(0), w, y, inter, d_out, n_blocks,
        QTYPE=int(down.ggml_type), TYPE_SIZE=_type_size(down.ggml_type), IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return y.view(t, k, d_out).sum(dim=1).to(x.dtype)


if triton is not None:
    from .dequant import _ld_f16, _ld_u8
    from .moe_mxfp4 import _activation
    from .moe_mxfp4_prefill import _tile_ids

    @triton.jit
    def _weight_tile(rows, n_ok, v0, DTYPE: tl.constexpr, QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """The weights [BLOCK_N, BLOCK_K] of values v0 ... v0 + BLOCK_K - 1 of the rows `rows`
        (pointers to each row's first byte), decoded to DTYPE, in natural column order."""
        blk = rows + (v0 // 256) * TYPE_SIZE  # [BN]: each row's super block of this step
        v = v0 % 256 + tl.arange(0, BLOCK_K)  # [BK]: the values' places in it
        k = v // 32
        hl = v % 32
        s = v // 16  # sub-block
        shift = (2 * (k % 4))[None, :]
        m = n_ok[:, None]
        base = blk[:, None]
        if QTYPE == 10:  # Q2_K
            d = _ld_f16(blk + 80, n_ok)[:, None]
            dmin = _ld_f16(blk + 82, n_ok)[:, None]
            sc = _ld_u8(base + s[None, :], m)
            q = (_ld_u8(base + (16 + 32 * (k // 4) + hl)[None, :], m) >> shift) & 3
            w = (d * (sc & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
        else:  # Q3_K (11)
            d = _ld_f16(blk + 108, n_ok)[:, None]
            low4 = (_ld_u8(base + (96 + s % 8)[None, :], m) >> ((s // 8) * 4)[None, :]) & 15
            high2 = (_ld_u8(base + (104 + s % 4)[None, :], m) >> ((s // 4) * 2)[None, :]) & 3
            dl = d * ((low4 | (high2 << 4)) - 32).to(tl.float32)
            u = (_ld_u8(base + (32 + 32 * (k // 4) + hl)[None, :], m) >> shift) & 3
            u = u | (((_ld_u8(base + hl[None, :], m) >> k[None, :]) & 1) << 2)
            w = dl * (u - 4).to(tl.float32)
        if DTYPE != tl.float32:
            w = w.to(DTYPE, fp_downcast_rounding="rtne")
        return w

    @triton.jit
    def _gate_up_kernel(x, x_stride, sorted_ids, block_expert, gate, gate_stride, up, up_stride, act,
                        k_top, d_in, inter, n_blocks, p1, p2,
                        QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        """act[slot, n] = activation(gate_r[n] . x[t], up_r[n] . x[t]) for this program's slots and n."""
        pid_m, pid_n = _tile_ids(n_blocks, inter, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        if expert < 0:
            return
        DTYPE = x.dtype.element_ty
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids + slots)
        m_ok = pair >= 0
        token = tl.where(m_ok, pair // k_top, 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        row_start = n.to(tl.int64) * ((d_in // 256) * TYPE_SIZE)
        gate_rows = gate + expert * gate_stride + row_start
        up_rows = up + expert * up_stride + row_start
        x_rows = x + token[:, None] * x_stride + tl.arange(0, BLOCK_K)[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for v0 in range(0, d_in, BLOCK_K):
            xs = tl.load(x_rows + v0, mask=m_ok[:, None], other=0.0)
            wg = _weight_tile(gate_rows, n_ok, v0, DTYPE, QTYPE, TYPE_SIZE, BLOCK_K)
            wu = _weight_tile(up_rows, n_ok, v0, DTYPE, QTYPE, TYPE_SIZE, BLOCK_K)
            if IEEE:
                acc_g = tl.dot(xs, tl.trans(wg), acc_g, input_precision="ieee")
                acc_u = tl.dot(xs, tl.trans(wu), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xs, tl.trans(wg), acc_g)
                acc_u = tl.dot(xs, tl.trans(wu), acc_u)
        a = _activation(acc_g, acc_u, p1, p2, ACT, CLAMP)
        out = act + slots.to(tl.int64)[:, None] * inter + n[None, :]
        tl.store(out, a.to(act.dtype.element_ty), mask=n_ok[None, :])

    @triton.jit
    def _down_kernel(act, sorted_ids, block_expert, down, down_stride, weights, y, inter, d_out, n_blocks,
                     QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """y[p, n] = weights[p] * (down_r[n] . act[slot of p]) for this program's slots and n."""
        pid_m, pid_n = _tile_ids(n_blocks, d_out, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids + slots)
        m_ok = pair >= 0
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < d_out
        out = y + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * d_out + n[None, :]
        if expert < 0:  # past the last used block, or the bucket of invalid ids: zero
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=m_ok[:, None] & n_ok[None, :])
            return
        DTYPE = act.dtype.element_ty
        down_rows = down + expert * down_stride + n.to(tl.int64) * ((inter // 256) * TYPE_SIZE)
        a_rows = act + slots.to(tl.int64)[:, None] * inter + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for v0 in range(0, inter, BLOCK_K):
            a = tl.load(a_rows + v0)
            wd = _weight_tile(down_rows, n_ok, v0, DTYPE, QTYPE, TYPE_SIZE, BLOCK_K)
            if IEEE:
                acc = tl.dot(a, tl.trans(wd), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(wd), acc)
        route = tl.load(weights + tl.where(m_ok, pair, 0), mask=m_ok, other=0.0)
        tl.store(out, acc * route[:, None], mask=m_ok[:, None] & n_ok[None, :])
