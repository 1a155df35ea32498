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
   there is no host sync at all. (The passes of step 2 and their buffers' sizes follow
   the GPU memory free at the call, so a CUDA graph would fix them at capture.)
   Expert ids outside [0, E) are put in a bucket of their own, after the last expert,
   whose pairs contribute zero (the torch reference raises IndexError there; checking
   on the host would cost a sync).
2. Split copies (`split_experts`, one launch per role and pass): the used experts' MXFP4 bytes are
   copied into the split layout (`SplitExperts`: the 4-bit codes of a row in column order,
   two to a byte, and the block scales apart, transposed). GGUF's 17-byte blocks allow
   only byte loads, which Triton's pipeliner cannot copy ahead; the split layout's aligned
   runs of bytes it copies to shared memory asynchronously, num_stages K steps ahead of
   the tensor cores. As many experts' copies as `group_size` allows are made at a time
   (a quarter of the free GPU memory, at most 4 GiB: all 256 of DeepSeek-V4-Flash's on a
   large GPU; halved while allocating them runs out of memory), and steps 2-4 run once
   per such group (a pass), the kernels' programs of other experts returning at once.
3. Kernel 1, one program per (M-block, N-block of BLOCK_N intermediate rows): gathers the
   block's x rows (token = pair // k), loops over d_in in steps of BLOCK_K, decodes the
   expert's gate and up tiles [BLOCK_N, BLOCK_K] in registers to the dot dtype (bf16 /
   fp16 for such x, fp32 for fp32 x with input_precision "ieee": no tf32) and
   accumulates both products with `tl.dot` in fp32; applies the activation (swiglu with
   or without its clamp, or situ) in fp32 and stores act [sorted slot, inter] in x's
   dtype (padding slots hold act(0, 0) = 0 and are never read into an output).
4. Kernel 2, one program per (M-block, N-block of d_out rows): the down projection the
   same way over act, times the pair's routing weight (fp32), stored to y [T * k, d_out]
   fp32 at the pair's own index p. Then y.view(T, k, d_out).sum(1).to(x.dtype): a fixed
   summation order, no atomics, deterministic.

Programs are ordered GROUP_M M-blocks at a time for each N-block (the usual grouped
ordering), so the M-blocks of one expert run side by side and its weight tile comes
from L2 the second time: each needed expert byte is read from memory about once.

Decoding. An E2M1 code's bits placed at an fp16's sign, low exponent and top mantissa
bits are its value times 2**-14 exactly (code 1 lands on the fp16 subnormals, which the
conversion to fp32 keeps). The fp32 value is multiplied by the block scale and rounded
to the dot dtype:
- bf16 and fp32: by ggml_e8m0_to_fp32_half(e) = 2**(e - 128) (float32 subnormals below
  e = 2), giving the weight times 2**-15, defined for every e; the accumulator is
  multiplied by 2**15 after the loop. Exact (powers of two), except weights below
  2**-111, which land on the dot dtype's subnormals (rounded; zero below about 2**-119 in
  bf16). Real MXFP4 weights are nowhere near that.
- fp16: by 2**(min(e, 240) - 113), giving the weight itself, rounded to fp16 as the
  torch path's dequantization to fp16 rounds it (weights past fp16's range are inf
  there and here alike).
bf16 x on sm_90 (`packed_decode_applies`) takes the same values by a shorter road, four
codes per 32-bit register in packed bf16 math (`_E2M1_BF16_ASM`): about 6 instructions per
weight value in the kernels' loops against about 10 (benchmarks/kernel_sass.py), with the
same correctly rounded bf16 weights, so the same outputs bit for bit. If it cannot compile
or launch, it is turned off (a warning, once) and the float32 decode runs.

Speed: see benchmarks/RESULTS.md (bench_moe_prefill.py, DeepSeek-V4-Flash's routed experts).

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
from .moe_prefill import batch_budget
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
GATE_UP_CONFIG: tuple[int, int, int, int] = (128, 64, 4, 3)
DOWN_CONFIG: tuple[int, int, int, int] = (128, 64, 4, 3)
BLOCK_M_STEPS: tuple[tuple[float, int], ...] = ((20.0, 16), (48.0, 32), (float("inf"), 64))
GROUP_M = 8
# The split copy (`split_experts`): programs of SPLIT_WARPS warps, SPLIT_ROWS rows, SPLIT_BLOCKS
# MXFP4 blocks a step.
SPLIT_ROWS = 8  # 4.6 ms a DeepSeek-V4 layer on an H100 against 7.9 at 16 rows (moe-prefill-vm-20261208-004100.json)
SPLIT_BLOCKS = 16
SPLIT_WARPS = 4
# bf16 x on sm_90 and later: the weights decoded by `_E2M1_BF16_ASM` (packed bf16 math) instead
# of per-value float32 math (what the interpreter and the other dtypes use); off when
# EXPERTDESK_MXFP4_ASM is 0, and from its first failure to compile or launch (`packed_decode_applies`).
ASM_SWITCH = TritonSwitch("EXPERTDESK_MXFP4_ASM", "packed bf16 MXFP4 decode", "the float32 decode")

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
    """The kernels; bf16 x on sm_90 with the packed decode, which, if it cannot compile or launch,
    is turned off (warning once) for the float32 decode."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    args = (x, chosen, weights, gate, up, down, activation)
    if packed_decode_applies(x):
        return ASM_SWITCH.run(x.device, lambda: _routed_sum(*args, asm=True), lambda: _routed_sum(*args, asm=False))
    return _routed_sum(*args, asm=False)


def packed_decode_applies(x: torch.Tensor) -> bool:
    """Whether the weights are decoded by `_E2M1_BF16_ASM`: bf16 x on an NVIDIA GPU of sm_90 or
    later (PTX bf16x2 multiplies), EXPERTDESK_MXFP4_ASM != "0", and no earlier failure of it."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and torch.version.hip is None and ASM_SWITCH.applies(x)
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _routed_sum(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate: ExpertRows, up: ExpertRows,
                down: ExpertRows, activation: Any, *, asm: bool) -> torch.Tensor:
    """Steps 1-4 of the module docstring, the weights decoded by `_E2M1_BF16_ASM` if `asm`."""
    t, k = chosen.shape
    inter, d_in = gate.shape
    d_out = down.shape[0]
    if t * k == 0:
        return x.new_zeros((t, d_out))
    n_experts = gate.table.shape[0]
    b = PrefillBuffers.make(x, chosen, weights, n_experts, inter, d_out)
    used = experts_used(b.block_expert, n_experts)
    kind, clamp, p1, p2 = activation_args(activation)
    # Dot dtype = x's dtype; SCALE_MODE 0: weights times 2**-15 (bf16, fp32), 1: as they are (fp16).
    scale_mode = 1 if x.dtype == torch.float16 else 0
    ieee = x.dtype == torch.float32
    roles = {"gate": gate, "up": up, "down": down}
    group, split = _split_buffers(roles, group_size(gate.shape, down.shape, n_experts, x.device), x.device)
    # At least one pass, whose down kernel also writes the zeros of pairs of no expert (ids out of range).
    for first in range(0, max(1, n_experts), group):
        for role, rows in roles.items():
            split_experts(rows, used, first, split[role])
        g, u, dn = split["gate"], split["up"], split["down"]
        block_n, bk, warps, stages = GATE_UP_CONFIG
        _gate_up_kernel[(b.n_blocks * triton.cdiv(inter, block_n),)](
            b.x, b.x.stride(0), b.sorted_ids, b.block_expert, g.values, g.scales, u.values, u.scales,
            g.values.stride(0), g.scales.stride(0), b.act, k, d_in, inter, b.n_blocks, first, group, p1, p2,
            ACT=kind, CLAMP=clamp, SCALE_MODE=scale_mode, IEEE=ieee, ASM=asm,
            BLOCK_M=b.block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=GROUP_M,
            num_warps=warps, num_stages=stages)
        block_n, bk, warps, stages = DOWN_CONFIG
        _down_kernel[(b.n_blocks * triton.cdiv(d_out, block_n),)](
            b.act, b.sorted_ids, b.block_expert, dn.values, dn.scales, dn.values.stride(0), dn.scales.stride(0),
            b.weights, b.y, inter, d_out, b.n_blocks, first, group,
            SCALE_MODE=scale_mode, IEEE=ieee, ASM=asm, BLOCK_M=b.block_m, BLOCK_N=block_n, BLOCK_K=bk,
            GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return b.summed(chosen)


def _split_buffers(roles: dict[str, ExpertRows], group: int,
                   device: torch.device) -> tuple[int, dict[str, SplitExperts]]:
    """(group, the split copies' buffers of each role for `group` experts): halved while the
    allocation runs out of memory (other work took what `group_size` saw free), down to one."""
    while True:
        try:
            return group, {role: SplitExperts.empty(rows.shape, group, device) for role, rows in roles.items()}
        except torch.OutOfMemoryError:
            if group == 1:
                raise
            group = max(1, group // 2)


@dataclass
class SplitExperts:
    """Experts of one role in the split MXFP4 layout the kernels read: `values` uint8
    [G, N, K / 2], byte j of a row holding the E2M1 codes of columns 2 j (low nibble) and
    2 j + 1 (high nibble), and `scales` uint8 [G, K / 32, N], the E8M0 byte of columns
    32 b ... 32 b + 31 of row n at [b, n]. Each K step of a kernel then reads whole aligned
    runs of bytes, which Triton copies to shared memory ahead of their use (asynchronously,
    num_stages deep); GGUF's 17-byte blocks (a scale byte, then the 16 bytes of codes, value
    i < 16 the low nibble of byte i, value 16 + i its high nibble) allow only byte loads,
    which it cannot."""

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def empty(cls, shape: tuple[int, int], group: int, device: torch.device) -> SplitExperts:
        n, width = shape
        return cls(torch.empty((group, n, width // 2), dtype=torch.uint8, device=device),
                   torch.empty((group, width // 32, n), dtype=torch.uint8, device=device))


def experts_used(block_expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int32 [n_experts]: 1 for each expert that some pair chose, else 0, read off the layout's
    `block_expert` (`prefill_layout`: an expert has M-blocks iff it was chosen; -1 for the
    blocks of ids out of range and past the last used one)."""
    used = torch.zeros(n_experts + 1, dtype=torch.int32, device=block_expert.device)
    used.scatter_(0, torch.where(block_expert >= 0, block_expert, n_experts).long(), 1)
    return used[:n_experts]


def group_size(gate_shape: tuple[int, int], down_shape: tuple[int, int], n_experts: int,
               device: torch.device) -> int:
    """How many experts' split copies (three roles) a pass holds: as many as
    `moe_prefill.batch_budget` allows (a quarter of the free GPU memory, 256 MiB to 4 GiB),
    at least one, at most all."""
    per_expert = (2 * gate_shape[0] * gate_shape[1] + down_shape[0] * down_shape[1]) * 17 // 32
    return max(1, min(n_experts, batch_budget(device) // per_expert))


def split_experts(rows: ExpertRows, used: torch.Tensor, first: int, out: SplitExperts) -> None:
    """Experts first ... first + G - 1 of `rows` (G = out's length), those marked in `used`,
    copied into out in the split layout (`SplitExperts`); the others' entries are left as
    they are. One launch."""
    n, width = rows.shape
    group = out.values.shape[0]
    grid = (group, triton.cdiv(n, SPLIT_ROWS))
    _split_kernel[grid](rows.table, rows.table.stride(0), used, used.shape[0], first, out.values, out.scales,
                        out.values.stride(0), out.scales.stride(0), n, width,
                        BLOCK_R=SPLIT_ROWS, BLOCK_B=SPLIT_BLOCKS, num_warps=SPLIT_WARPS)


if triton is not None:
    from .moe_mxfp4 import _activation  # the same activation as the decode kernels

    @triton.jit(do_not_specialize=["first"])
    def _split_kernel(table, table_stride, used, n_experts, first, values, scales, values_stride, scales_stride,
                      n_rows, width, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
        """Rows BLOCK_R * p1 ... of expert first + p0 (if used) into the split layout.

        Byte m < 8 of a split block holds columns 2 m, 2 m + 1: the low nibbles of GGUF code
        bytes a = 2 m and c = 2 m + 1; byte 8 + m columns 16 + 2 m, 17 + 2 m: their high
        nibbles. So each K step loads the [R, B, 8] bytes a and c (a warp's lanes over a
        row's neighbouring blocks: its loads and stores stay within a few sectors) and stores
        the [R, B, 8] low and high halves; offsets within an expert are 32-bit."""
        e = first + tl.program_id(0)
        if e >= n_experts:
            return
        if tl.load(used + e) == 0:
            return
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < n_rows
        n_mx = width // 32
        src = table + e.to(tl.int64) * table_stride  # the expert's first byte
        dst_v = values + tl.program_id(0).to(tl.int64) * values_stride
        dst_s = scales + tl.program_id(0).to(tl.int64) * scales_stride
        m = tl.arange(0, 8)
        for b0 in range(0, n_mx, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ok = r_ok[:, None] & (b < n_mx)[None, :]  # [R, B]
            block = r[:, None] * (n_mx * 17) + b[None, :] * 17  # [R, B]: each block's scale byte
            code = block[:, :, None] + 1 + 2 * m[None, None, :]  # [R, B, 8]: its code bytes 2 m
            a = tl.load(src + code, mask=ok[:, :, None], other=0)
            c = tl.load(src + code + 1, mask=ok[:, :, None], other=0)
            out = (r[:, None] * (width // 2) + b[None, :] * 16)[:, :, None] + m[None, None, :]
            tl.store(dst_v + out, (a & 15) | ((c & 15) << 4), mask=ok[:, :, None])
            tl.store(dst_v + out + 8, (a >> 4) | (c & 240), mask=ok[:, :, None])
            tl.store(dst_s + b[None, :] * n_rows + r[:, None], tl.load(src + block, mask=ok, other=0), mask=ok)

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
    def _e2m1(q, SHIFT: tl.constexpr):
        """The E2M1 nibble at bit SHIFT (0 or 4) of the bytes q (int32), as float32 value * 2**-14."""
        if SHIFT == 0:
            bits = ((q << 9) & 0x0E00) | ((q << 12) & 0x8000)
        else:
            bits = ((q << 5) & 0x0E00) | ((q << 8) & 0x8000)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    # E2M1 codes to bf16 on sm_90, 4 bytes (8 codes) of q and their 4 scales (bf16 pairs) per
    # asm instance. For each pair of bytes: u = byte a | byte b << 16 (prmt), the low nibbles at bits
    # 0-3 and 16-19 of u (the high ones of u >> 4). A code's magnitude bits placed at a bf16's
    # bits 6-8 (its low exponent bits and top mantissa bit) and its sign at bit 15 make the bf16
    # of its value times 2**-126 exactly (code 1 on the bf16 subnormals, which half-precision
    # multiplies keep); times 2**112 (0x7780) that is the value times 2**-14, then times the
    # block's 2**(e - 128): two exact bf16x2 multiplies per pair of values.
    def _e2m1_bf16_asm() -> str:
        """The PTX: bytes 0, 1 of $4 (scales $5) give lo $0 and hi $2, bytes 2, 3 (scales $6) $1 and $3."""
        lines = ["{", ".reg .b32 z, k, u, t, v;", "mov.b32 z, 0;", "mov.b32 k, 0x77807780;"]
        for pair, (select, scale) in enumerate((("0x4140", "$5"), ("0x4342", "$6"))):
            lines.append(f"prmt.b32 u, $4, z, {select};")
            for half, out in ((0, pair), (1, 2 + pair)):
                if half:
                    lines.append("shr.b32 u, u, 4;")
                lines += ["shl.b32 t, u, 6;", "and.b32 t, t, 0x01C001C0;", "shl.b32 v, u, 12;",
                          "and.b32 v, v, 0x80008000;", "or.b32 t, t, v;", "mul.rn.bf16x2 t, t, k;",
                          f"mul.rn.bf16x2 ${out}, t, {scale};"]
        return "\n".join(lines + ["}"])

    _E2M1_BF16_ASM = tl.constexpr(_e2m1_bf16_asm())

    @triton.jit
    def _split_rows(values, scales, entry, v_stride, s_stride, n, width, n_rows, BLOCK_K: tl.constexpr):
        """Pointers to the first K step of rows n of split entry `entry` (`SplitExperts` of
        [n_rows, width] weights): its values [BLOCK_N, BLOCK_K / 2] and scales [BLOCK_N, BLOCK_K / 32]."""
        v = values + entry * v_stride + n.to(tl.int64)[:, None] * (width // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
        s = scales + entry * s_stride + n[:, None] + tl.arange(0, BLOCK_K // 32)[None, :] * n_rows
        return v, s

    @triton.jit
    def _split_tile(values, scales, k0, n_rows, n_ok, DTYPE: tl.constexpr, SCALE_MODE: tl.constexpr,
                    ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The weights [BLOCK_N, BLOCK_K] of columns k0 ... of the rows whose first K step's
        split-layout bytes are at `values` and `scales` (`_split_rows`), decoded to DTYPE in
        column order; times 2**-15 for SCALE_MODE 0. ASM (bf16 on sm_90): by `_E2M1_BF16_ASM`."""
        q = tl.load(values + k0 // 2, mask=n_ok[:, None], other=0)
        e = tl.load(scales + (k0 // 32) * n_rows, mask=n_ok[:, None], other=0).to(tl.int32)
        if ASM:
            # 2**(e - 128) in bf16: subnormal for e < 2
            d = tl.where(e < 2, 0x20 << tl.minimum(e, 1), (e - 1) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            shape: tl.constexpr = (BLOCK_N, BLOCK_K // 32, 16)
            lo, hi = tl.inline_asm_elementwise(
                _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [tl.reshape(q, shape), tl.broadcast_to(d[:, :, None], shape)],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        q = q.to(tl.int32)
        if SCALE_MODE == 0:
            # ggml_e8m0_to_fp32_half: 2**(e - 128); e < 2 are float32 subnormals (the shift is
            # clamped so that the unused branch stays defined).
            d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        else:
            d = ((tl.minimum(e, 240) + 14) << 23).to(tl.float32, bitcast=True)  # 2**(e - 113)
        lo = tl.reshape(_e2m1(q, 0), (BLOCK_N, BLOCK_K // 32, 16)) * d[:, :, None]
        hi = tl.reshape(_e2m1(q, 4), (BLOCK_N, BLOCK_K // 32, 16)) * d[:, :, None]
        return tl.reshape(tl.join(lo.to(DTYPE), hi.to(DTYPE)), (BLOCK_N, BLOCK_K))

    @triton.jit(do_not_specialize=["first", "group"])
    def _gate_up_kernel(x, x_stride, sorted_ids, block_expert, gate_v, gate_s, up_v, up_s, v_stride, s_stride, act,
                        k_top, d_in, inter, n_blocks, first, group, p1, p2,
                        ACT: tl.constexpr, CLAMP: tl.constexpr, SCALE_MODE: tl.constexpr, IEEE: tl.constexpr,
                        ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        """act[slot, n] = activation(gate_r[n] . x[t], up_r[n] . x[t]) for this program's slots and n,
        if its expert r is one of first ... first + group - 1 (split copies, index r - first).

        ACT 0: swiglu (CLAMP: limit p1 > 0); ACT 1: situ, beta p1 (CLAMP: linear_beta p2 > 0).
        """
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, inter, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        if expert < first or expert >= first + group:
            return
        DTYPE = x.dtype.element_ty
        token = tl.where(m_ok, pair // k_top, 0).to(tl.int64)
        gv, gs = _split_rows(gate_v, gate_s, expert - first, v_stride, s_stride, n, d_in, inter, BLOCK_K)
        uv, us = _split_rows(up_v, up_s, expert - first, v_stride, s_stride, n, d_in, inter, BLOCK_K)
        x_rows = x + token[:, None] * x_stride + tl.arange(0, BLOCK_K)[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            xs = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
            wg = _split_tile(gv, gs, k0, inter, n_ok, DTYPE, SCALE_MODE, ASM, BLOCK_N, BLOCK_K)
            wu = _split_tile(uv, us, k0, inter, n_ok, DTYPE, SCALE_MODE, ASM, BLOCK_N, BLOCK_K)
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

    @triton.jit(do_not_specialize=["first", "group"])
    def _down_kernel(act, sorted_ids, block_expert, down_v, down_s, v_stride, s_stride, weights, y, inter, d_out,
                     n_blocks, first, group, SCALE_MODE: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """y[p, n] = weights[p] * (down_r[n] . act[slot of p]) for this program's slots and n, if its
        expert r is one of first ... first + group - 1; zero for pairs of no expert (first pass)."""
        expert, slots, pair, m_ok, n, n_ok = _tile(sorted_ids, block_expert, n_blocks, d_out, BLOCK_M, BLOCK_N,
                                                   GROUP_M)
        out = y + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * d_out + n[None, :]
        if expert < 0:  # past the last used block (no valid slot), or the bucket of invalid ids: zero
            if first == 0:
                tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=m_ok[:, None] & n_ok[None, :])
            return
        if expert < first or expert >= first + group:
            return
        DTYPE = act.dtype.element_ty
        dv, ds = _split_rows(down_v, down_s, expert - first, v_stride, s_stride, n, inter, d_out, BLOCK_K)
        a_rows = act + slots.to(tl.int64)[:, None] * inter + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            a = tl.load(a_rows + k0)
            wd = _split_tile(dv, ds, k0, d_out, n_ok, DTYPE, SCALE_MODE, ASM, BLOCK_N, BLOCK_K)
            acc = _dot(a, wd, acc, IEEE)
        if SCALE_MODE == 0:
            acc = acc * 32768.0
        route = tl.load(weights + tl.where(m_ok, pair, 0), mask=m_ok, other=0.0)
        tl.store(out, acc * route[:, None], mask=m_ok[:, None] & n_ok[None, :])
