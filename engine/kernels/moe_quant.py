"""Fused decode MLP of routed experts stored as Q8_0 or K-quants (Kimi-K3's Q2_K / Q3_K), in two launches.

The K-quant counterpart of `engine.kernels.moe_mxfp4`: where the torch path gathers
the k chosen experts of every token (index_select of whole experts) and dequantizes
them to a bf16 copy before batched matmuls, these kernels read each chosen expert's
GGUF rows in place through `engine.kernels.quant_gemv.row_dots` (decoded in
registers, float32 sums): every expert byte read once, nothing the size of a weight
written. In a bf16 / f16 decode, Q2_K and Q3_K rows take x (and kernel B the activations)
as 16-bit integers (`engine.kernels.x16`, quantized by one launch each) and integer dot
products (`quant_gemv.integer_x`).

Kernel A, grid (pair p = t * k + j, block of BLOCK_N intermediate rows):
    act[p, n] = act(gate_r[n] . x[t], up_r[n] . x[t]),  r = rows[t, j]
Kernel B, grid (pair p, block of BLOCK_N output rows):
    y[p, n] = weights[p] * (down_r[n] . act[p])
then y.view(T, k, d_out).sum(1) in torch: a fixed order, no atomics. The activation
(swiglu with or without its clamp, or situ) is moe_mxfp4's, in float32.

Gate and up share a type; down may differ (Kimi-K3: Q2_K gate/up, Q3_K down). Rows are
not range-checked (that would need a host sync). `fused_applies` says when this path
runs (CUDA or the interpreter, EXPERTDESK_FUSED_MOE_QUANT != "0", types and widths
`quant_gemv` walks); a kernel that cannot compile or launch warns once and the torch
path (`grouped_expert_mlp_reference`) serves from then on. No host sync: capturable in
a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .dequant import row_nbytes
from .moe_mxfp4 import DecodePairs, operands_fit, run_pairs, table_fits
from .quant_gemv import (
    F32_2P23_BITS,
    X16_CONFIGS,
    X16_SWITCH,
    config,
    integer_x,
    lanes,
    unit_bytes,
    width_fits,
    word_alignment,
    words_aligned,
)
from .triton_switch import TritonSwitch
from .x16 import quantize

try:
    import triton
    import triton.language as tl

    from .moe_mxfp4 import _activation
    from .quant_gemv import _rows_ok, row_dots
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

if TYPE_CHECKING:
    from .moe import ExpertRows

__all__ = ["SWITCH", "fused_applies", "fused_quant_expert_mlp"]

# (BLOCK_N rows, SB units of 256 values per step, num_warps, QUADS) of each kernel: those of
# the dense GEMV for rows of the type and width (engine.kernels.quant_gemv.config), unless
# KERNEL_CONFIGS names one for the kernel and type (benchmarks/bench_moe_quant.py --sweep
# times the choices: a decode step's experts are many short programs, unlike a dense matrix).
KERNEL_CONFIGS: dict[str, dict[int, tuple[int, int, int, int]]] = {"gate_up": {}, "down": {}}

SWITCH = TritonSwitch("EXPERTDESK_FUSED_MOE_QUANT", "fused quantized expert")


def _rows_fit(rows: ExpertRows, x: torch.Tensor) -> bool:
    """A role of a type and width `row_dots` walks, whose table `table_fits` and whose rows
    start where `row_dots` reads words (an aligned table and row stride)."""
    align = word_alignment(rows.ggml_type)
    return (width_fits(rows.ggml_type, rows.shape[1]) and table_fits(rows, x)
            and words_aligned(rows.table, rows.ggml_type) and rows.table.stride(0) % align == 0)


def supported(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether the kernels handle these operands, on any device."""
    return (operands_fit(x, gate, up, down, activation) and gate.ggml_type == up.ggml_type
            and all(_rows_fit(r, x) for r in (gate, up, down)))


def fused_applies(x: torch.Tensor, gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> bool:
    """Whether `grouped_expert_mlp` runs these kernels (module docstring)."""
    return SWITCH.applies(x) and supported(x, gate, up, down, activation)


def fused_quant_expert_mlp(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                           gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    """sum over k of weights[t, k] * down_r(act(gate_r x[t], up_r x[t])), r = rows[t, k];
    x [T, d_in], rows and weights [T, k] on x's device; [T, d_out] in x's dtype."""
    from .moe import grouped_expert_mlp_reference

    return SWITCH.run(x.device, lambda: _launch(x, rows, weights, gate, up, down, activation),
                      lambda: grouped_expert_mlp_reference(x, rows, weights, gate, up, down, activation))


def _launch(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
            gate: ExpertRows, up: ExpertRows, down: ExpertRows, activation: Any) -> torch.Tensor:
    def launch(x16: bool) -> torch.Tensor:
        return run_pairs(x, rows, weights, gate, down, activation,
                         lambda pairs: _kernels(pairs, gate, up, down, x if x16 else None))

    if any(integer_x(x, r.ggml_type) for r in (gate, down)):  # if they cannot run, float32 math on x
        return X16_SWITCH.run(x.device, lambda: launch(True), lambda: launch(False))
    return launch(False)


def _config(kernel: str, qtype: int, width: int) -> tuple[int, int, int, int]:
    return KERNEL_CONFIGS[kernel].get(qtype) or config(qtype, width)


def _x_operand(kernel: str, x: torch.Tensor, reduced: torch.Tensor | None, qtype: int,
               width: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], bool]:
    """(x or its int16 values, its x16 groups (or x again, unused), config, X16) of one
    kernel: a reduced-precision decode (`reduced`, the step's x, in bfloat16 or float16; None:
    float32 math) takes x as 16-bit integers (`engine.kernels.x16`) where
    `quant_gemv.integer_x` says so."""
    if reduced is not None and integer_x(reduced, qtype):
        q = quantize(x)
        return q.q, q.groups, KERNEL_CONFIGS[kernel].get(qtype) or X16_CONFIGS[qtype], True
    return x, x, _config(kernel, qtype, width), False


def _kernels(p: DecodePairs, gate: ExpertRows, up: ExpertRows, down: ExpertRows, x: torch.Tensor | None) -> None:
    kind, clamp, p1, p2 = p.activation
    qtype = int(gate.ggml_type)
    xq, xg, (block_n, sb, warps, quads), x16 = _x_operand("gate_up", p.x, x, qtype, p.d_in)
    _gate_up_kernel[(p.count, triton.cdiv(p.inter, block_n))](
        xq, xq.stride(0), xg, p.rows, gate.table, gate.table.stride(0), up.table, up.table.stride(0), p.act, p.k,
        p.inter, p1, p2, F32_2P23_BITS, QTYPE=qtype, UNIT_BYTES=unit_bytes(qtype), ROW_BYTES=row_nbytes(qtype, p.d_in),
        D_IN=p.d_in, ACT=kind, CLAMP=clamp, BLOCK_N=block_n, SB=sb, LANES=lanes(qtype, quads),
        QUADS=quads, EVEN_N=p.inter % block_n == 0, X16=x16, ASM=p.x.is_cuda, num_warps=warps)
    qtype = int(down.ggml_type)
    aq, ag, (block_n, sb, warps, quads), x16 = _x_operand("down", p.act, x, qtype, p.inter)
    _down_kernel[(p.count, triton.cdiv(p.d_out, block_n))](
        aq, aq.stride(0), ag, p.rows, down.table, down.table.stride(0), p.weights, p.y, p.d_out, F32_2P23_BITS,
        QTYPE=qtype, UNIT_BYTES=unit_bytes(qtype), ROW_BYTES=row_nbytes(qtype, p.inter), INTER=p.inter,
        BLOCK_N=block_n, SB=sb, LANES=lanes(qtype, quads), QUADS=quads, EVEN_N=p.d_out % block_n == 0, X16=x16,
        ASM=p.x.is_cuda, num_warps=warps)


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x, x_stride, xg, rows, gate, gate_stride, up, up_stride, act, k_top, inter, p1, p2,
                        magic, QTYPE: tl.constexpr, UNIT_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr,
                        D_IN: tl.constexpr, ACT: tl.constexpr,
                        CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, LANES: tl.constexpr,
                        QUADS: tl.constexpr, EVEN_N: tl.constexpr, X16: tl.constexpr, ASM: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = _rows_ok(n, inter, BLOCK_N, EVEN_N)
        expert = tl.load(rows + p).to(tl.int64)
        offsets = n.to(tl.int64) * ROW_BYTES
        at = (p // k_top).to(tl.int64) * x_stride
        x_row = x + at
        g = row_dots(gate + expert * gate_stride + offsets, n_ok, x_row, xg + at // 8, magic, QTYPE, UNIT_BYTES,
                     D_IN, BLOCK_N, SB, LANES, QUADS, X16, ASM)
        u = row_dots(up + expert * up_stride + offsets, n_ok, x_row, xg + at // 8, magic, QTYPE, UNIT_BYTES, D_IN,
                     BLOCK_N, SB, LANES, QUADS, X16, ASM)
        a = _activation(g, u, p1, p2, ACT, CLAMP)
        tl.store(act + p.to(tl.int64) * inter + n, a, mask=n_ok)

    @triton.jit
    def _down_kernel(act, act_stride, ag, rows, down, down_stride, weights, y, d_out, magic, QTYPE: tl.constexpr,
                     UNIT_BYTES: tl.constexpr, ROW_BYTES: tl.constexpr, INTER: tl.constexpr,
                     BLOCK_N: tl.constexpr, SB: tl.constexpr, LANES: tl.constexpr, QUADS: tl.constexpr,
                     EVEN_N: tl.constexpr, X16: tl.constexpr, ASM: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = _rows_ok(n, d_out, BLOCK_N, EVEN_N)
        expert = tl.load(rows + p).to(tl.int64)
        offsets = n.to(tl.int64) * ROW_BYTES
        at = p.to(tl.int64) * act_stride
        dots = row_dots(down + expert * down_stride + offsets, n_ok, act + at, ag + at // 8, magic, QTYPE,
                        UNIT_BYTES, INTER, BLOCK_N, SB, LANES, QUADS, X16, ASM)
        tl.store(y + p.to(tl.int64) * d_out + n, dots * tl.load(weights + p), mask=n_ok)
