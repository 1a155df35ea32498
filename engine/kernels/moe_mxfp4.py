"""Fused decode MLP of routed experts stored as MXFP4 (GGML type 39), in two Triton launches.

`grouped_expert_mlp` (engine.kernels.moe) gathers the k experts of every token and
dequantizes them to a full bf16/fp32 copy before its batched matmuls; on a GPU that
copy (index_select + dequantization) is most of a decode step's expert time. Here
each program reads its expert's packed bytes straight from the table of expert rows
(base + r * row stride, so strided slot-pool views and storage offsets work as they
are), decodes MXFP4 in registers and multiplies as it goes: every expert byte is
read once from memory, and nothing the size of a weight is written.

Kernel A, grid (pair p = t * k + j, block of BLOCK_N intermediate rows):
    act[p, n] = act(gate_r[n] . x[t], up_r[n] . x[t]),  r = rows[t, j]
with both dot products in one pass over x (float32 accumulation) and the activation
(swiglu, with or without the clamp, or situ) in float32.
Kernel B, grid (pair p, block of BLOCK_N output rows):
    y[p, n] = weights[p] * (down_r[n] . act[p])
and then y.view(T, k, d_out).sum(1) in torch: a fixed summation order, no atomics.

Decoding. block_mxfp4 is 17 bytes for 32 values: e (E8M0) then qs[16]; value i < 16
is the low nibble of qs[i], value i + 16 its high nibble, an E2M1 code (sign, 2-bit
exponent, 1-bit mantissa) scaled by 2**(e - 127). Placing a code's bits at an fp16's
sign, low exponent and top mantissa bits gives value * 2**-14 exactly (e = 0 lands
on the fp16 subnormals, which the fp16 -> fp32 conversion keeps); both nibbles of a
byte are placed at once as the two halves of one int32, so a byte costs one load,
four integer ops and two conversions, with no table.

Layout (as quant_gemv's `_quad_dot`). A lane is (row, block, quad q = 0..3): it owns the
bytes qs[4q .. 4q + 3] and their 8 values 4q + i (low nibbles) and 16 + 4q + i (high),
taken as 4 unrolled steps of lane-shaped tensors [4 quads, blocks, rows] (quads fastest
across a warp's threads, then blocks: a warp's byte load reads 4 quads of 4-8 consecutive
blocks of a row).
The lane sums its 8 products of value * 2**-14 with x, then multiplies that sum once by
its block's scale 2**(e - 113) = ggml_e8m0_to_fp32_half(e) * 2**15 (the 2**15 restores the
2**-14 and ggml's doubled kvalues; x itself is not scaled). That scale is past float32's
range for e > 240, so it is applied as two normal powers of two, 2**(max(e, 240) - 240)
(1 below) and 2**(min(e, 240) - 113) (2**-113 at e = 0: no subnormal scale either). x is
read 8 bytes at a time (4 values of a lane: bf16/fp16 split in registers, float32 as two
words) in the lanes' layout, broadcast over the rows: nothing moves between threads in
the loop (no shared memory, no barrier). Each step walks SUB = 4 sub-steps of BLOCK_K / 128
blocks, so that at BLOCK_N * BLOCK_K = 1024 * num_warps (for the gate_up kernel, which
walks 2 BLOCK_N rows, its gate and up rows interleaved, 512 * num_warps) a thread holds
2 lanes: 2 rows that share its x values. All scalings are by powers of two: every product is
of the exact dequantized weight (as value * 2**-14 * x, rounded like weight * x), summed
in float32 in an order of its own, unless |x| < 2**-112 (the products then fall below
float32's normal range; the earlier x * 2**15 had its limit at |x| > 2**112 instead).

Cost (SASS of the main loop, sm_90, Triton 3.6, benchmarks/kernel_sass.py): 6.55
instructions per weight value for gate_up (8, 512, 4) and 6.06 for down (8, 512, 2),
against 10.77 and 10.38 with the earlier [BLOCK_N, NB, 16] layout (which recomputed
the block scale for nearly every byte and moved x through shared memory). Per byte the
floor is about 9 (load, 2 IMAD + 2 LOP3 to place the nibbles, 2 fp16 -> fp32 conversions,
2 FFMA); the rest is x (bf16 splits), the lane's scale (e load, 2 min/max, 2 shifts,
FMUL) and some PRMT that ptxas adds around the conversions. More lanes per thread would
share x more, but LLVM's SLP vectorizer then packs the fp16 halves of different lanes
(one PRMT per byte: 6.26 at gate_up (16, 512, 4)); one lane per thread reads every x
value once per row and pays the loop's pointer steps over fewer values (7.41 at
(4, 512, 4)).

The kernels are compiled for each model geometry (d_in and the intermediate width
are compile-time constants): a thread's byte addresses then differ by constants,
and when the widths are multiples of the blocks no load is masked.

No host sync and no value-dependent allocation: the launches can be captured in a
CUDA graph. Rows are not range-checked (that would need a sync); a row outside the
table reads outside it, where the torch path would raise.

`fused_applies` says when the fused path runs (CUDA, Triton importable,
EXPERTDESK_FUSED_MOE != "0", all three roles MXFP4, swiglu or situ, float32 /
bfloat16 / float16 x). If a kernel fails to compile or launch, a warning is issued
once, the module remembers the error and the torch path runs from then on.
Under TRITON_INTERPRET=1 `fused_expert_mlp` also runs on CPU tensors (Triton's
interpreter), which is how the tests check the kernels' arithmetic without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from gguf.constants import GGMLQuantizationType

try:  # Triton ships with the CUDA builds of torch on Linux; absent on CPU installs.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - not installed, or a broken install
    triton = None
    tl = None

from .dequant import aligned_rows, row_nbytes
from .triton_switch import TritonSwitch

if TYPE_CHECKING:
    from .moe import ExpertRows

__all__ = ["fused_applies", "fused_error", "fused_expert_mlp"]

MXFP4 = int(GGMLQuantizationType.MXFP4)
_X_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_KINDS = ("swiglu", "situ")

# (BLOCK_N rows, BLOCK_K values per step, num_warps) of each kernel. BLOCK_K is a
# power of two >= 32; d_in and the intermediate width need only be multiples of 32
# (a partial last step or row block is masked). With the earlier layout, an H200 sweep
# (benchmarks/bench_moe_mxfp4.py --sweep, d_in 4096, inter 2048, k 6, T 1, bf16) found
# the configurations within 15% of each other (93.5 us a call at (8, 512, 4) / (8, 256, 2)).
# Untuned for the quad layout: gate_up keeps (8, 512, 4), down keeps 8 rows and 2 warps
# with twice the values a step (8, 512, 2), so that a thread holds 2 lanes (see Layout).
GATE_UP_CONFIG: tuple[int, int, int] = (8, 512, 4)
DOWN_CONFIG: tuple[int, int, int] = (8, 512, 2)

# Off when EXPERTDESK_FUSED_MOE is 0, and from the first kernel that fails to compile or
# launch on (the torch path is used from then on).
SWITCH = TritonSwitch("EXPERTDESK_FUSED_MOE", "fused MXFP4 expert")


def fused_error() -> Exception | None:
    """The compile/launch error that turned the fused path off, or None."""
    return SWITCH.error


def table_fits(rows: ExpertRows, x: torch.Tensor) -> bool:
    """What every decode expert kernel needs of a role's table: byte rows on x's device,
    each holding a whole expert of the role's type and shape (a width its type divides)."""
    table = rows.table
    out_features, in_features = rows.shape
    return (table.dtype == torch.uint8 and table.dim() == 2 and table.device == x.device
            and (table.stride(1) == 1 or table.shape[1] <= 1)
            and table.shape[1] >= out_features * row_nbytes(rows.ggml_type, in_features))


def _rows_fit(rows: ExpertRows, x: torch.Tensor) -> bool:
    """An MXFP4 role whose table `table_fits`."""
    return int(rows.ggml_type) == MXFP4 and rows.shape[1] % 32 == 0 and table_fits(rows, x)


def operands_fit(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """What every decode expert kernel needs, whatever the weights' type: an activation it
    computes (swiglu, or situ with beta > 0), a 2-D float32/bf16/fp16 x, consistent shapes."""
    kind = getattr(activation, "kind", None)
    if kind not in _KINDS or (kind == "situ" and not float(getattr(activation, "beta", 0.0)) > 0):
        return False
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        return False
    inter, d_in = gate.shape
    return tuple(up.shape) == (inter, d_in) and down.shape[1] == inter and x.shape[1] == d_in


def supported(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether the kernels handle these operands, on any device (fused_applies adds CUDA and the switches)."""
    return operands_fit(x, gate, up, down, activation) and all(_rows_fit(r, x) for r in (gate, up, down))


def fused_applies(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether `grouped_expert_mlp` runs the fused kernels (see the module docstring)."""
    return x.is_cuda and SWITCH.applies(x) and supported(x, gate, up, down, activation)


def fused_expert_mlp(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                     gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    """sum over k of weights[t, k] * down_r(act(gate_r x[t], up_r x[t])), r = rows[t, k].

    x [T, d_in]; rows (int64 or int32) and weights [T, k] on x's device. Returns
    [T, d_out] in x's dtype. The operands must be `supported`; if a kernel cannot
    compile or launch, warns once and returns the torch path's result.
    """
    from .moe import grouped_expert_mlp_reference

    return SWITCH.run(x.device, lambda: _launch(x, rows, weights, gate, up, down, activation),
                      lambda: grouped_expert_mlp_reference(x, rows, weights, gate, up, down, activation))


def activation_args(activation: Any) -> tuple[int, bool, float, float]:
    """The kernels' (ACT, CLAMP, p1, p2) for an ExpertActivation (see `_activation`)."""
    if activation.kind == "swiglu":
        return 0, float(activation.limit) > 0, float(activation.limit), 0.0
    return 1, float(activation.linear_beta) > 0, float(activation.beta), float(activation.linear_beta)


@dataclass(frozen=True)
class DecodePairs:
    """What the decode expert kernels (MXFP4 here, Q8_0 / K-quant in moe_quant) share: the
    (token, expert) pairs p = t * k + j as flat rows and weights, x with unit stride, the
    float32 buffers act [pairs, inter] and y [pairs, d_out], the widths and the activation's
    kernel arguments (`activation_args`)."""

    x: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor
    k: int
    d_in: int
    activation: tuple[int, bool, float, float]

    @property
    def count(self) -> int:
        return self.y.shape[0]

    @property
    def inter(self) -> int:
        return self.act.shape[1]

    @property
    def d_out(self) -> int:
        return self.y.shape[1]


def run_pairs(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate: ExpertRows, down: ExpertRows,
              activation: Any, kernels: Callable[[DecodePairs], None]) -> torch.Tensor:
    """The routed sum [T, d_out] in x's dtype: `kernels` fills the pairs' y (gate/up into
    act, then down times the routing weight), then y is summed over k in a fixed order (no
    atomics)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    t, k = rows.shape
    inter, d_in = gate.shape
    d_out = down.shape[0]
    if t * k == 0:
        return x.new_zeros((t, d_out))
    # The kernels read x in 8-byte words (`_x_quad`; moe_quant's `_x_pair`: 4 or 8 bytes): its
    # rows start 8-byte aligned (act's rows, allocated here, do).
    pairs = DecodePairs(aligned_rows(x if x.stride(1) == 1 else x.contiguous(), 8), rows.reshape(-1).contiguous(),
                        weights.reshape(-1).to(torch.float32).contiguous(),
                        torch.empty((t * k, inter), dtype=torch.float32, device=x.device),
                        torch.empty((t * k, d_out), dtype=torch.float32, device=x.device), k, d_in,
                        activation_args(activation))
    kernels(pairs)
    return pairs.y.view(t, k, d_out).sum(dim=1).to(x.dtype)


def _launch(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
            gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    return run_pairs(x, rows, weights, gate, down, activation, lambda pairs: _kernels(pairs, gate, up, down))


def _kernels(p: DecodePairs, gate: ExpertRows, up: ExpertRows, down: ExpertRows) -> None:
    kind, clamp, p1, p2 = p.activation
    # The widths are compile-time constants (one compilation per model geometry): the
    # offsets of a thread's bytes then differ by constants, and full blocks need no masks.
    block_n, block_k, warps = GATE_UP_CONFIG
    _gate_up_kernel[(p.count, triton.cdiv(p.inter, block_n))](
        p.x, p.x.stride(0), p.rows, gate.table, gate.table.stride(0), up.table, up.table.stride(0), p.act,
        p.k, p.inter, p1, p2, D_IN=p.d_in, ACT=kind, CLAMP=clamp, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=p.inter % block_n == 0, num_warps=warps, enable_fp_fusion=True)
    block_n, block_k, warps = DOWN_CONFIG
    _down_kernel[(p.count, triton.cdiv(p.d_out, block_n))](
        p.act, p.rows, down.table, down.table.stride(0), p.weights, p.y, p.d_out, INTER=p.inter,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=p.d_out % block_n == 0, num_warps=warps, enable_fp_fusion=True)


if triton is not None:
    from .dequant import _x_halves

    @triton.jit
    def _e2m1_pair(q):
        """The two E2M1 nibbles of the bytes q (int32 0..255) as float32 values * 2**-14: (low, high).

        A code's sign, exponent e and mantissa m go to fp16 bits 15, 10-11 and 9, which reads
        2**(e - 15) * (1 + m/2) for e > 0 and the subnormal m * 2**-15 for e = 0: both the E2M1
        value times 2**-14. Both nibbles are placed at once, as the two fp16 halves of one
        int32 (q * 0x1001 puts the high nibble at bits 16-19), and each half converts exactly.
        """
        w = q * 0x1001
        bits = ((w << 9) & 0x0E000E00) | ((w << 12) & -2147450880)  # 0x80008000: the two sign bits
        lo = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _x_quad(ptr, mask, X_MASKED: tl.constexpr):
        """The 4 x values at ptr (8-byte aligned: float32, bfloat16 or float16), as float32 (0
        where masked), read as 64-bit words and split in registers."""
        words = ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        if ptr.dtype.element_ty == tl.float32:
            if X_MASKED:
                w0 = tl.load(words, mask=mask, other=0)
                w1 = tl.load(words + 1, mask=mask, other=0)
            else:
                w0 = tl.load(words)
                w1 = tl.load(words + 1)
            x0, x1 = _x_halves(w0, ptr)
            x2, x3 = _x_halves(w1, ptr)
        else:
            if X_MASKED:
                w = tl.load(words, mask=mask, other=0)
            else:
                w = tl.load(words)
            x0, x1 = _x_halves(w.to(tl.int32), ptr)
            x2, x3 = _x_halves((w >> 32).to(tl.int32), ptr)
        return x0, x1, x2, x3

    @triton.jit
    def _quad_dot(blocks, mask, l0, l1, l2, l3, h0, h1, h2, h3, quad, MASKED: tl.constexpr):
        """The lanes' partial dot products, scaled: lane = (quad, block, row), `blocks` pointing
        to each lane's block (its e byte), `quad` its quad q; its bytes qs[4q + i] hold values
        4q + i (low nibble, x = l_i) and 16 + 4q + i (high nibble, x = h_i), i = 0..3.

        The 8 products are summed in the thread (as value * 2**-14 * x), and the block scale
        multiplies that sum once: 2**(e - 113) = ggml_e8m0_to_fp32_half(e) * 2**15.
        """
        qs = blocks + 1 + 4 * quad
        if MASKED:
            e = tl.load(blocks, mask=mask, other=0).to(tl.int32)
            q0 = tl.load(qs, mask=mask, other=0).to(tl.int32)
            q1 = tl.load(qs + 1, mask=mask, other=0).to(tl.int32)
            q2 = tl.load(qs + 2, mask=mask, other=0).to(tl.int32)
            q3 = tl.load(qs + 3, mask=mask, other=0).to(tl.int32)
        else:
            e = tl.load(blocks).to(tl.int32)
            q0 = tl.load(qs).to(tl.int32)
            q1 = tl.load(qs + 1).to(tl.int32)
            q2 = tl.load(qs + 2).to(tl.int32)
            q3 = tl.load(qs + 3).to(tl.int32)
        lo, hi = _e2m1_pair(q0)
        s = lo * l0
        s += hi * h0
        lo, hi = _e2m1_pair(q1)
        s += lo * l1
        s += hi * h1
        lo, hi = _e2m1_pair(q2)
        s += lo * l2
        s += hi * h2
        lo, hi = _e2m1_pair(q3)
        s += lo * l3
        s += hi * h3
        # 2**(e - 113) as two float32 powers of two, both normal for every e (one alone is
        # past float32's range for e > 240): 2**(max(e, 240) - 240), 1 up to e = 240, then
        # 2**(min(e, 240) - 113), from 2**-113 at e = 0.
        d_hi = ((tl.maximum(e, 240) - 113) << 23).to(tl.float32, bitcast=True)
        d_lo = ((tl.minimum(e, 240) + 14) << 23).to(tl.float32, bitcast=True)
        return (s * d_hi) * d_lo

    @triton.jit
    def _walk(blocks, xp, n_ok, b, quad, ROWS: tl.constexpr, N_BLOCKS: tl.constexpr, NB: tl.constexpr,
              SUB: tl.constexpr, EVEN_K: tl.constexpr, MASKED: tl.constexpr):
        """Both kernels' main loop: the [ROWS] dot products of the rows whose lanes' blocks
        start at `blocks` ([4, NB, ROWS], `n_ok` the rows' mask) with x at `xp` ([4, NB, 1], each
        lane's first value), N_BLOCKS blocks a row, NB * SUB blocks a step."""
        acc = tl.zeros((4, NB, ROWS), dtype=tl.float32)
        for start in range(0, N_BLOCKS, NB * SUB):
            for s in tl.static_range(SUB):
                b_ok = start + s * NB + b < N_BLOCKS
                l0, l1, l2, l3 = _x_quad(xp + s * NB * 32, b_ok, not EVEN_K)
                h0, h1, h2, h3 = _x_quad(xp + s * NB * 32 + 16, b_ok, not EVEN_K)
                acc += _quad_dot(blocks + s * NB * 17, n_ok & b_ok, l0, l1, l2, l3, h0, h1, h2, h3, quad, MASKED)
            blocks += NB * SUB * 17
            xp += NB * SUB * 32
        return tl.sum(tl.sum(acc, axis=0), axis=0)

    @triton.jit
    def _sigmoid(z):
        return 1.0 / (1.0 + tl.exp(-z))

    @triton.jit
    def _tanh(z):
        """tanh in float32 to a few ulp: the odd Taylor series below |z| = 0.3 (truncated past
        z**15, a relative 1e-10 there), 1 - 2 / (exp(2|z|) + 1) above (1.0 from |z| = 9 on)."""
        a = tl.minimum(tl.abs(z), 20.0)
        s = a * a
        poly = -929569.0 / 638512875.0
        poly = poly * s + 21844.0 / 6081075.0
        poly = poly * s - 1382.0 / 155925.0
        poly = poly * s + 62.0 / 2835.0
        poly = poly * s - 17.0 / 315.0
        poly = poly * s + 2.0 / 15.0
        poly = poly * s - 1.0 / 3.0
        small = a + a * (s * poly)
        big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
        t = tl.where(a < 0.3, small, big)
        return tl.where(z < 0, -t, t)

    @triton.jit
    def _activation(g, u, p1, p2, ACT: tl.constexpr, CLAMP: tl.constexpr):
        """The experts' activation in float32 (also the prefill kernels'). ACT 0: swiglu,
        silu(min(g, p1)) * clamp(u, -p1, p1) (CLAMP: limit p1 > 0); ACT 1: situ,
        p1 tanh(g / p1) sigmoid(g) * p2 tanh(u / p2) (CLAMP: linear_beta p2 > 0)."""
        if ACT == 0:
            if CLAMP:
                g = tl.minimum(g, p1)
                u = tl.minimum(tl.maximum(u, -p1), p1)
            a = g * _sigmoid(g) * u
        else:
            a = _tanh(g * (1.0 / p1)) * p1 * _sigmoid(g)
            if CLAMP:
                u = _tanh(u * (1.0 / p2)) * p2
            a = a * u
        return a

    @triton.jit
    def _gate_up_kernel(x, x_stride, rows, gate, gate_stride, up, up_stride, act, k_top, inter, p1, p2,
                        D_IN: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):
        """act[p, n] = activation(gate_r[n] . x[t], up_r[n] . x[t]) for this program's n.

        ACT 0: swiglu (CLAMP: limit p1 > 0); ACT 1: situ, beta p1 (CLAMP: linear_beta p2 > 0).
        EVEN_N: inter is a multiple of BLOCK_N (no row mask). x rows 8-byte aligned.
        """
        SUB: tl.constexpr = min(4, BLOCK_K // 32)  # sub-steps of NB blocks
        NB: tl.constexpr = BLOCK_K // (32 * SUB)
        N_BLOCKS: tl.constexpr = D_IN // 32
        EVEN_K: tl.constexpr = N_BLOCKS % (NB * SUB) == 0
        MASKED: tl.constexpr = not (EVEN_N and EVEN_K)
        p = tl.program_id(0)
        # 2 BLOCK_N rows: gate row n = r // 2 for even r, up row n for odd r.
        r = tl.arange(0, 2 * BLOCK_N)[None, None, :]
        n = tl.program_id(1) * BLOCK_N + r // 2
        quad = tl.arange(0, 4)[:, None, None]  # lanes [4, NB, 2 BLOCK_N]: quad fastest across threads
        b = tl.arange(0, NB)[None, :, None]
        n_ok = n < inter
        expert = tl.load(rows + p).to(tl.int64)
        table = tl.where(r % 2 == 0, gate + expert * gate_stride, up + expert * up_stride)
        # Byte offsets of each lane's block. In int64: a thread's offsets then differ by
        # constants that the loads take as immediates (an int32 offset's sign extension would
        # hide them: one address add per byte).
        blocks = table + n.to(tl.int64) * (N_BLOCKS * 17) + b * 17 + 0 * quad
        # x of each lane's first value: [4, NB, 1], broadcast over the rows.
        xp = x + (p // k_top).to(tl.int64) * x_stride + b * 32 + 4 * quad
        dots = _walk(blocks, xp, n_ok, b, quad, 2 * BLOCK_N, N_BLOCKS, NB, SUB, EVEN_K, MASKED)
        g, u = tl.split(tl.reshape(dots, (BLOCK_N, 2)))
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        a = _activation(g, u, p1, p2, ACT, CLAMP)
        tl.store(act + p.to(tl.int64) * inter + n, a, mask=n < inter)

    @triton.jit
    def _down_kernel(act, rows, down, down_stride, weights, y, d_out,
                     INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):
        """y[p, n] = weights[p] * (down_r[n] . act[p]) for this program's n."""
        SUB: tl.constexpr = min(4, BLOCK_K // 32)
        NB: tl.constexpr = BLOCK_K // (32 * SUB)
        N_BLOCKS: tl.constexpr = INTER // 32
        EVEN_K: tl.constexpr = N_BLOCKS % (NB * SUB) == 0
        MASKED: tl.constexpr = not (EVEN_N and EVEN_K)
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        quad = tl.arange(0, 4)[:, None, None]
        b = tl.arange(0, NB)[None, :, None]
        n_ok = (n < d_out)[None, None, :]
        expert = tl.load(rows + p).to(tl.int64)
        down_b = down + expert * down_stride + n[None, None, :].to(tl.int64) * (N_BLOCKS * 17) + b * 17 + 0 * quad
        ap = act + p.to(tl.int64) * INTER + b * 32 + 4 * quad
        out = _walk(down_b, ap, n_ok, b, quad, BLOCK_N, N_BLOCKS, NB, SUB, EVEN_K, MASKED) * tl.load(weights + p)
        tl.store(y + p.to(tl.int64) * d_out + n, out, mask=n < d_out)
