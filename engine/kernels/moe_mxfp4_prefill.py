"""Fused prefill MoE of routed experts stored as MXFP4 (GGML type 39): tensor-core Triton kernels.

The decode kernels (engine.kernels.moe_mxfp4) give every (token, expert) pair its own
programs, so each pair re-reads its expert's bytes: right for a handful of tokens, but a
prefill chunk of T tokens with top-k routing has T * k pairs spread over all experts
(T = 512, k = 6, 256 experts: about 12 pairs per expert), and there the work must be
grouped by expert so that each expert's bytes are read once for all of its tokens and
multiplied on the tensor cores. This is the design of vLLM's `fused_moe` (our own code):

1. Layout, on the device (torch, no host sync). The T * k pairs (pair p = t * k + j) are
   sorted by expert (stable argsort); each expert's run of pairs is padded to a multiple
   of BLOCK_M, giving `sorted_ids` (pair ids by expert, padding -1) and `block_expert`
   (the expert of each M-block of BLOCK_M sorted slots). The number of M-blocks is not
   read back: the grid is sized by the bound cdiv(T * k, BLOCK_M) + min(E + 1, T * k)
   and the programs of unused trailing M-blocks (block_expert -1) return at once. So
   there is no host sync at all, and the launches could be captured in a CUDA graph.
   Expert ids outside [0, E) are put in a bucket of their own, after the last expert,
   whose pairs contribute zero (the torch reference raises IndexError there; checking
   on the host would cost a sync).
2. Kernel 1, one program per (M-block, N-block of BLOCK_N intermediate rows): gathers the
   block's x rows (token = pair // k), loops over d_in in steps of BLOCK_K, decodes the
   expert's MXFP4 gate and up tiles [BLOCK_N, BLOCK_K] in registers to the dot dtype
   (bf16 / fp16 for such x, fp32 for fp32 x with input_precision "ieee": no tf32) and
   accumulates both products with `tl.dot` in fp32; applies the activation (swiglu with
   or without its clamp, or situ) in fp32 and stores act [sorted slot, inter] in x's
   dtype (padding slots hold act(0, 0) = 0 and are never read into an output).
3. Kernel 2, one program per (M-block, N-block of d_out rows): the down projection the
   same way over act, times the pair's routing weight (fp32), stored to y [T * k, d_out]
   fp32 at the pair's own index p. Then y.view(T, k, d_out).sum(1).to(x.dtype): a fixed
   summation order, no atomics, deterministic.

Programs are ordered GROUP_M M-blocks at a time for each N-block (the usual grouped
ordering), so the M-blocks of one expert run side by side and its weight tile comes
from L2 the second time: each needed expert byte is read from memory about once.

Decoding. block_mxfp4 is 17 bytes for 32 values: e (E8M0) then qs[16]; value i < 16 is
the low nibble of qs[i], value i + 16 its high nibble, an E2M1 code. A code's bits
placed at an fp16's sign, low exponent and top mantissa bits are its value times 2**-14
exactly (code 1 lands on the fp16 subnormals, which the conversion to fp32 keeps). Each
qs byte is loaded once and gives two values; instead of interleaving them back into
order, the x (or act) tile is loaded with its columns in the same order (value 32 b +
16 h + i at tile column 32 b + 2 i + h): a dot product does not care about the order of
its terms. The fp32 value is multiplied by the block scale and rounded to the dot dtype:
- bf16 and fp32: by ggml_e8m0_to_fp32_half(e) = 2**(e - 128) (float32 subnormals below
  e = 2), giving the weight times 2**-15, defined for every e; the accumulator is
  multiplied by 2**15 after the loop. Exact (powers of two), except weights below
  2**-111, which flush in the dot dtype (real MXFP4 weights are nowhere near that).
- fp16: by 2**(min(e, 240) - 113), giving the weight itself, rounded to fp16 as the
  torch path's dequantization to fp16 rounds it (weights past fp16's range are inf
  there and here alike).

Speed (H200, benchmarks/bench_moe_prefill.py, d_in 4096, inter 2048, 256 experts, k 6,
bf16): 7.0 ms at T = 512 and 29 ms at T = 4096, against 122 and 119 ms for the torch
reference: far from the ~1 ms (expert bytes at HBM speed) and ~2 ms (bf16 tensor-core
rate) they could reach. The compiled loop (sm_90 TTGIR) is serial: the weight bytes
are loaded into registers (not pipelined: num_stages changes nothing), decoded, written
to shared memory, then `warp_group_dot` and a wait with nothing in flight, so each K
step pays the global-load latency. Loading the next step's bytes into registers before
decoding the current one (software pipelining by hand) was tried and was slower: more
registers, more spills (benchmarks/RESULTS.md, 2026-12-07). The next step is a weight
layout that allows aligned 16-byte loads, which Triton's pipeliner can copy ahead
asynchronously.

`prefill_applies` says when the fused path runs; if a kernel fails to compile or launch,
a warning is issued once, the module remembers the error, `prefill_applies` is False
from then on, and `fused_moe_prefill` returns `moe_prefill_reference`'s result. Under
TRITON_INTERPRET=1 `fused_moe_prefill` also runs on CPU tensors (Triton's interpreter),
for float32 and float16 x (the interpreter's bf16 `tl.dot` is wrong in Triton 3.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .dequant import dequantize, row_nbytes
from .moe_mxfp4 import activation_args
from .moe_mxfp4 import supported as decode_supported
from .triton_switch import TritonSwitch

try:  # Triton ships with the CUDA builds of torch on Linux; absent on CPU installs.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - not installed, or a broken install
    triton = None
    tl = None

if TYPE_CHECKING:
    from .moe import ExpertRows

__all__ = ["fused_moe_prefill", "moe_prefill_reference", "prefill_applies", "prefill_error", "prefill_layout"]


# Kernel tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel, and BLOCK_M by
# the mean number of pairs per expert (T * k / E): the smallest of BLOCK_M_STEPS whose
# threshold the mean does not exceed, else the last. BLOCK_K is a multiple of 32 (whole
# MXFP4 blocks) and every reduced dimension (d_in, inter) must be a multiple of it.
# bf16 tl.dot on Hopper wants every block >= 16.
GATE_UP_CONFIG: tuple[int, int, int, int] = (128, 64, 4, 2)
DOWN_CONFIG: tuple[int, int, int, int] = (128, 64, 4, 2)
BLOCK_M_STEPS: tuple[tuple[float, int], ...] = ((20.0, 16), (48.0, 32), (float("inf"), 64))
GROUP_M = 8
# How a weight tile is decoded: 0 loads each qs byte once and joins its two values (x's
# columns permuted to match), 1 loads each byte once per value, in natural column order.
DECODE = 0

# Off when EXPERTDESK_FUSED_MOE is 0 (`prefill_applies`), and from the first kernel that
# fails to compile or launch on (the reference is used from then on).
SWITCH = TritonSwitch("EXPERTDESK_FUSED_MOE", "fused MXFP4 prefill")


def prefill_error() -> Exception | None:
    """The compile/launch error that turned the fused prefill path off, or None."""
    return SWITCH.error


def block_k() -> int:
    """The K step both kernels use: d_in and inter must be multiples of it."""
    return max(GATE_UP_CONFIG[1], DOWN_CONFIG[1])


def supported(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether the kernels handle these operands, on any device (prefill_applies adds CUDA and the switches):
    the decode kernels' operands (`moe_mxfp4.supported`), reduced widths that are
    multiples of `block_k()`, and one table length for the three roles."""
    if not decode_supported(x, gate, up, down, activation):
        return False
    inter, d_in = gate.shape
    if d_in % block_k() or inter % block_k():
        return False
    return gate.table.shape[0] == up.table.shape[0] == down.table.shape[0]


def prefill_applies(x: torch.Tensor, k: int, gate: ExpertRows, up: ExpertRows, down: ExpertRows,
                    activation: Any) -> bool:
    """Whether `fused_moe_prefill` runs the fused kernels on x [T, d_in] with top-k routing:
    CUDA, Triton importable, EXPERTDESK_FUSED_MOE != "0", no earlier kernel failure, all
    three roles MXFP4, d_in and inter multiples of `block_k()`, swiglu or situ, x in
    float32 / bfloat16 / float16."""
    return x.is_cuda and int(k) >= 1 and SWITCH.applies(x) and supported(x, gate, up, down, activation)


def fused_moe_prefill(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                      gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    """sum over j of weights[t, j] * down_r(act(gate_r x[t], up_r x[t])), r = chosen[t, j].

    x [T, d_in]; chosen (int64 or int32) and weights [T, k] on x's device. Returns
    [T, d_out] in x's dtype. Every pair is computed (top-k unchanged). Operands the
    kernels do not handle (or no Triton; or CPU tensors outside TRITON_INTERPRET=1) go
    to `moe_prefill_reference`; if a kernel cannot compile or launch, warns once,
    remembers it (`prefill_applies` is False from then on) and returns the reference's
    result.
    """
    def reference() -> torch.Tensor:
        return moe_prefill_reference(x, chosen, weights, gate, up, down, activation)

    if not (SWITCH.available(x) and supported(x, gate, up, down, activation)):
        return reference()
    return SWITCH.run(x.device, lambda: _launch(x, chosen, weights, gate, up, down, activation), reference)


def moe_prefill_reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                          gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    """The routed sum in torch, expert by expert (the fused kernels' reference and fallback).

    Each used expert's rows of the three tables are dequantized once to x's dtype
    (`engine.kernels.dequantize`) and multiplied with the rows of x that chose it; the
    contributions, times their routing weights, are added in ascending expert order
    (as `engine.experts.accumulate_routed` does). One host sync (the experts used).
    """
    t, k = chosen.shape
    d_out = down.shape[0]
    out = x.new_zeros((t, d_out))
    flat = chosen.reshape(-1)
    if flat.numel() == 0:
        return out
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tokens = order // k
    pair_weights = weights.reshape(-1)[order]
    n_experts = gate.table.shape[0]
    start = 0
    for expert, count in zip(ids.tolist(), counts.tolist()):
        if not 0 <= expert < n_experts:
            raise IndexError(f"expert {expert} out of range 0..{n_experts - 1}")
        idx = tokens[start:start + count]
        xs = x[idx]
        g = xs @ _dequantized(gate, expert, x.dtype).T
        u = xs @ _dequantized(up, expert, x.dtype).T
        y = activation(g, u) @ _dequantized(down, expert, x.dtype).T
        out.index_add_(0, idx, y * pair_weights[start:start + count, None].to(y.dtype))
        start += count
    return out


def _dequantized(rows: ExpertRows, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s weight of role `rows`, [out, in] in dtype."""
    out_features, in_features = rows.shape
    nbytes = out_features * row_nbytes(rows.ggml_type, in_features)
    raw = rows.table[expert, :nbytes].contiguous()
    return dequantize(raw, rows.ggml_type, (out_features, in_features), dtype)


def block_m_for(pairs: int, n_experts: int) -> int:
    """BLOCK_M for a mean of pairs / n_experts pairs per expert (see BLOCK_M_STEPS)."""
    mean = pairs / max(1, n_experts)
    for threshold, block_m in BLOCK_M_STEPS:
        if mean <= threshold:
            return block_m
    return BLOCK_M_STEPS[-1][1]


def prefill_layout(chosen: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [n_blocks * block_m], block_expert int32 [n_blocks]), on chosen's device.

    The pairs p = t * k + j sorted by expert (stable), each expert's run padded with -1
    to a multiple of block_m; block_expert[b] is the expert of slots b * block_m ... and
    -1 for M-blocks past the last used one and for the bucket of out-of-range ids. The
    length n_blocks = cdiv(P, block_m) + min(E + 1, P) bounds the blocks used, so that
    nothing is read back to the host.
    """
    device = chosen.device
    flat = chosen.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    valid = (flat >= 0) & (flat < n_experts)
    key = torch.where(valid, flat, torch.full_like(flat, n_experts))  # bucket n_experts: invalid ids
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    blocks = (counts + (block_m - 1)) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    count_start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    dest = block_start[sorted_key] * block_m + (torch.arange(pairs, device=device) - count_start[sorted_key])
    n_blocks = -(-pairs // block_m) + min(n_experts + 1, pairs)
    sorted_ids = torch.full((n_blocks * block_m,), -1, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(n_blocks, device=device), right=True)
    block_expert = torch.where(block_expert >= n_experts, -1, block_expert).to(torch.int32)
    return sorted_ids, block_expert


@dataclass
class PrefillBuffers:
    """What both kernels of a fused prefill share: x (rows contiguous), the pairs' layout
    (`prefill_layout`), the routing weights flat in float32, the activations act
    [sorted slot, inter] and the per-pair outputs y [T * k, d_out] float32."""

    x: torch.Tensor
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    n_blocks: int
    weights: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor

    @classmethod
    def make(cls, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, n_experts: int, inter: int,
             d_out: int) -> PrefillBuffers:
        pairs = chosen.numel()
        block_m = block_m_for(pairs, n_experts)
        sorted_ids, block_expert = prefill_layout(chosen, n_experts, block_m)
        n_blocks = block_expert.numel()
        return cls(x if x.stride(1) == 1 else x.contiguous(), sorted_ids, block_expert, block_m, n_blocks,
                   weights.reshape(-1).to(torch.float32).contiguous(),
                   torch.empty((n_blocks * block_m, inter), dtype=x.dtype, device=x.device),
                   torch.empty((pairs, d_out), dtype=torch.float32, device=x.device))

    def summed(self, chosen: torch.Tensor) -> torch.Tensor:
        """The pairs' outputs summed per token in a fixed order (no atomics), in x's dtype."""
        t, k = chosen.shape
        return self.y.view(t, k, -1).sum(dim=1).to(self.x.dtype)


def _launch(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
            gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, k = chosen.shape
    inter, d_in = gate.shape
    d_out = down.shape[0]
    if t * k == 0:
        return x.new_zeros((t, d_out))
    b = PrefillBuffers.make(x, chosen, weights, gate.table.shape[0], inter, d_out)
    kind, clamp, p1, p2 = activation_args(activation)
    # Dot dtype = x's dtype; SCALE_MODE 0: weights times 2**-15 (bf16, fp32), 1: as they are (fp16).
    scale_mode = 1 if x.dtype == torch.float16 else 0
    ieee = x.dtype == torch.float32

    block_n, bk, warps, stages = GATE_UP_CONFIG
    _gate_up_kernel[(b.n_blocks * triton.cdiv(inter, block_n),)](
        b.x, b.x.stride(0), b.sorted_ids, b.block_expert, gate.table, gate.table.stride(0),
        up.table, up.table.stride(0), b.act, k, d_in, inter, b.n_blocks, p1, p2,
        ACT=kind, CLAMP=clamp, SCALE_MODE=scale_mode, IEEE=ieee, DECODE=DECODE,
        BLOCK_M=b.block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=GROUP_M,
        num_warps=warps, num_stages=stages)
    block_n, bk, warps, stages = DOWN_CONFIG
    _down_kernel[(b.n_blocks * triton.cdiv(d_out, block_n),)](
        b.act, b.sorted_ids, b.block_expert, down.table, down.table.stride(0), b.weights, b.y, inter, d_out,
        b.n_blocks, SCALE_MODE=scale_mode, IEEE=ieee, DECODE=DECODE,
        BLOCK_M=b.block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=GROUP_M,
        num_warps=warps, num_stages=stages)
    return b.summed(chosen)


if triton is not None:
    from .moe_mxfp4 import _activation  # the same activation as the decode kernels

    @triton.jit
    def _tile_ids(n_blocks, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(M-block, N-block) of this program: GROUP_M M-blocks side by side for each N-block."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(n_size, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(n_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def _tile(sorted_ids, block_expert, n_blocks, n_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_M: tl.constexpr):
        """This program's tile of a grouped prefill kernel (both kernels of both fused prefill
        modules): its expert (< 0: no valid slot), slots, their (token, k) pairs (< 0:
        padding) and that mask, and its output columns n and their mask."""
        pid_m, pid_n = _tile_ids(n_blocks, n_size, BLOCK_N, GROUP_M)
        expert = tl.load(block_expert + pid_m).to(tl.int64)
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids + slots)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, slots, pair, pair >= 0, n, n < n_size

    @triton.jit
    def _dot(a, w, acc, IEEE: tl.constexpr):
        """acc + a @ w^T, in IEEE float32 when IEEE (the tests' float32 runs)."""
        if IEEE:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(w), acc)

    @triton.jit
    def _permuted_columns(BLOCK_K: tl.constexpr, DECODE: tl.constexpr):
        """DECODE 0: column of value (block b, byte i, nibble h) at tile position 32 b + 2 i + h:
        32 b + 16 h + i. DECODE 1: the natural order."""
        c = tl.arange(0, BLOCK_K)
        if DECODE == 0:
            c = (c // 32) * 32 + (c % 2) * 16 + (c % 32) // 2
        return c

    @triton.jit
    def _e2m1(q, SHIFT: tl.constexpr):
        """The E2M1 nibble at bit SHIFT (0 or 4) of the bytes q (int32), as float32 value * 2**-14."""
        if SHIFT == 0:
            bits = ((q << 9) & 0x0E00) | ((q << 12) & 0x8000)
        else:
            bits = ((q << 5) & 0x0E00) | ((q << 8) & 0x8000)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _weight_tile(rows, n_ok, blk0, DTYPE: tl.constexpr, SCALE_MODE: tl.constexpr, DECODE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The weights [BLOCK_N, BLOCK_K] of MXFP4 blocks blk0 ... of the rows `rows` (pointers to
        each row's first byte), decoded to DTYPE, columns in `_permuted_columns` order;
        times 2**-15 for SCALE_MODE 0."""
        NB: tl.constexpr = BLOCK_K // 32
        if DECODE == 0:
            b = blk0 + tl.arange(0, NB)
            blocks = rows[:, None] + b[None, :] * 17  # [BN, NB]
        else:
            c = tl.arange(0, BLOCK_K)
            blocks = rows[:, None] + (blk0 + c // 32)[None, :] * 17  # [BN, BK]: each value's block
        e = tl.load(blocks, mask=n_ok[:, None], other=0).to(tl.int32)
        if SCALE_MODE == 0:
            # ggml_e8m0_to_fp32_half: 2**(e - 128); e < 2 are float32 subnormals (the shift is
            # clamped so that the unused branch stays defined).
            d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        else:
            d = ((tl.minimum(e, 240) + 14) << 23).to(tl.float32, bitcast=True)  # 2**(e - 113)
        if DECODE == 0:
            i = tl.arange(0, 16)
            q = tl.load(blocks[:, :, None] + 1 + i[None, None, :], mask=n_ok[:, None, None], other=0).to(tl.int32)
            lo = (_e2m1(q, 0) * d[:, :, None]).to(DTYPE)
            hi = (_e2m1(q, 4) * d[:, :, None]).to(DTYPE)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        else:
            c = tl.arange(0, BLOCK_K)
            q = tl.load(blocks + 1 + (c % 16)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            w = (_e2m1(q >> ((c % 32) // 16 * 4)[None, :], 0) * d).to(DTYPE)
        return w

    @triton.jit
    def _gate_up_kernel(x, x_stride, sorted_ids, block_expert, gate, gate_stride, up, up_stride, act,
                        k_top, d_in, inter, n_blocks, p1, p2,
                        ACT: tl.constexpr, CLAMP: tl.constexpr, SCALE_MODE: tl.constexpr, IEEE: tl.constexpr,
                        DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        """act[slot, n] = activation(gate_r[n] . x[t], up_r[n] . x[t]) for this program's slots and n.

        ACT 0: swiglu (CLAMP: limit p1 > 0); ACT 1: situ, beta p1 (CLAMP: linear_beta p2 > 0).
        """
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, inter, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        if expert < 0:
            return
        DTYPE = x.dtype.element_ty
        token = tl.where(m_ok, pair // k_top, 0).to(tl.int64)
        n_mx = d_in // 32
        row_start = n.to(tl.int64) * (n_mx * 17)
        gate_rows = gate + expert * gate_stride + row_start
        up_rows = up + expert * up_stride + row_start
        x_rows = x + token[:, None] * x_stride + _permuted_columns(BLOCK_K, DECODE)[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for blk0 in range(0, n_mx, BLOCK_K // 32):
            xs = tl.load(x_rows + blk0 * 32, mask=m_ok[:, None], other=0.0)
            wg = _weight_tile(gate_rows, n_ok, blk0, DTYPE, SCALE_MODE, DECODE, BLOCK_N, BLOCK_K)
            wu = _weight_tile(up_rows, n_ok, blk0, DTYPE, SCALE_MODE, DECODE, BLOCK_N, BLOCK_K)
            acc_g = _dot(xs, wg, acc_g, IEEE)
            acc_u = _dot(xs, wu, acc_u, IEEE)
        if SCALE_MODE == 0:
            g = acc_g * 32768.0
            u = acc_u * 32768.0
        else:
            g = acc_g
            u = acc_u
        a = _activation(g, u, p1, p2, ACT, CLAMP)
        out = act + slots.to(tl.int64)[:, None] * inter + n[None, :]
        tl.store(out, a.to(act.dtype.element_ty), mask=n_ok[None, :])

    @triton.jit
    def _down_kernel(act, sorted_ids, block_expert, down, down_stride, weights, y, inter, d_out, n_blocks,
                     SCALE_MODE: tl.constexpr, IEEE: tl.constexpr, DECODE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
        """y[p, n] = weights[p] * (down_r[n] . act[slot of p]) for this program's slots and n."""
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, d_out, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        out = y + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * d_out + n[None, :]
        if expert < 0:  # past the last used block (no valid slot), or the bucket of invalid ids: zero
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=m_ok[:, None] & n_ok[None, :])
            return
        DTYPE = act.dtype.element_ty
        n_mx = inter // 32
        down_rows = down + expert * down_stride + n.to(tl.int64) * (n_mx * 17)
        a_rows = act + slots.to(tl.int64)[:, None] * inter + _permuted_columns(BLOCK_K, DECODE)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for blk0 in range(0, n_mx, BLOCK_K // 32):
            a = tl.load(a_rows + blk0 * 32)
            wd = _weight_tile(down_rows, n_ok, blk0, DTYPE, SCALE_MODE, DECODE, BLOCK_N, BLOCK_K)
            acc = _dot(a, wd, acc, IEEE)
        if SCALE_MODE == 0:
            acc = acc * 32768.0
        route = tl.load(weights + tl.where(m_ok, pair, 0), mask=m_ok, other=0.0)
        tl.store(out, acc * route[:, None], mask=m_ok[:, None] & n_ok[None, :])
