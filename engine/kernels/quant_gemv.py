"""`x @ W.T` straight from a dense weight's GGUF bytes, for the few rows of a decode step.

A decode step multiplies one token (or a handful) by every dense matrix of the model:
it reads each weight once and does two FLOPs per weight, so its time is the bytes
read. Dequantized once to bf16 at load (`DenseWeights` with `materialize`), the dense
weights of a Q8_0 file take twice their GGUF bytes in VRAM and in every step, a
Q2_K/Q3_K file's about six times; and bf16 rounds the quantized weights (a Q8_0
value d * q needs up to 18 significant bits, bf16 keeps 8), which alone flips some of
DeepSeek-V4's expert choices (benchmarks/bench_precision.py).

`quant_gemv` reads the GGUF blocks in place and decodes them in registers: every
weight byte is read once, nothing the size of a weight is written, the products are
of the file's values (not of bf16 roundings of them), and the dot products are
accumulated in float32 (x is read in its own dtype, the result is rounded once to it).
Grid: (block of BLOCK_N output rows, token, group). A program walks its rows in units
of 256 values (one K-quant super block, or 8 Q8_0 blocks), SB units at a time. For
Q8_0, Q2_K, Q3_K and Q6_K a lane owns 4 consecutive packed bytes and every value they
hold (`_quad_dot`): its scales are decoded once per lane, not once per value, and each of
its 4 positions accumulates its products in its own register over the whole row, summed
once after the loop (a reduction across threads every step cost the loop 20-30% of its
instructions: benchmarks/kernel_sass.py, RESULTS.md); for Q4_K and Q5_K a lane
takes one value of each 32-value step (`_unit_values`).

`row_dots` is that walk as a device function over any rows (the expert kernels of
`engine.kernels.moe_quant` call it with rows picked by expert id).

Types: Q8_0 (widths a multiple of 32), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (widths a
multiple of 256), and the float types F32, F16, BF16 (widths a multiple of 256; 64 lanes of
one value each, read as they are and widened exactly to float32). `QuantTensor.linear`
multiplies a float weight in x's own dtype with torch's matmul; this kernel serves the
other dtype: a BF16 matrix in a float32 decode step (`RuntimeOptions.decode_dtype`) is read
in place instead of being converted to a float32 copy per use. The decoding follows
`engine.kernels.dequant` (itself `gguf.quants`' order of float32 operations), except where
a per-block scale is factored out of a sum (Q8_0, Q3_K, Q6_K) and where the compiler fuses
a multiply-add: each decoded value may differ from gguf's float32 one by a rounding, which
the float32 summation-order bound of the tests covers; the sums differ from a
dequantize-then-matmul in their order.

`gemv_applies` says when it runs: CUDA (or Triton's interpreter on CPU tensors under
TRITON_INTERPRET=1), EXPERTDESK_QUANT_GEMV != "0", at most `MAX_ROWS` rows of x, a
supported type and width. If a kernel fails to compile or launch, the family warns once
and `quant_matmul` (dequantize, then matmul) serves from then on. No host sync, no
value-dependent allocation: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .dequant import FLOAT_DTYPES, quant_matmul, row_nbytes
from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl

    from .dequant import _int_to_f32, _k4_scale_min, _ld_f16, _ld_u8
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

__all__ = ["FLOAT_GEMV_TYPES", "GEMV_TYPES", "MAX_ROWS", "SWITCH", "gemv_applies", "quant_gemv", "reads_in_place",
           "unit_bytes", "walks", "width_fits"]

_Q = GGMLQuantizationType
GEMV_TYPES: frozenset[int] = frozenset(int(t) for t in (_Q.Q8_0, _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K))
FLOAT_GEMV_TYPES: frozenset[int] = frozenset(FLOAT_DTYPES)  # F32, F16, BF16: rows of 256-value units
# More rows than this: dequantize once, then a matmul (prefill chunks, and the experts of
# a prefill chunk that few of its tokens chose). The GEMV's time grows with the rows (each
# row re-reads and re-decodes the weight; the K-quants are bound by that decoding), the
# dequantize-then-matmul's hardly. From the GEMV's measured speed per matrix
# (bench_quant_gemv.py) and the dequantization's rate (72-97% of the copy rate, see
# engine.kernels.dequant), they break even near 2 rows for Q2_K / Q3_K and 5 for Q8_0
# (an estimate; 8 rows here made a Kimi-K3 prefill chunk decode half its experts row by
# row). Decode is 1 row.
MAX_ROWS = 2
_X_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# (BLOCK_N rows, SB units of 256 values per step, num_warps) of each type; chosen on an H200
# with benchmarks/bench_quant_gemv.py --sweep over the real models' matrices.
# Small programs win (more of them in flight): summed over a type's matrices, these took 14%
# (Q8_0), 0.3% (Q2_K), 11% (Q3_K) and 27% (Q6_K) less time than (2, 2, 2) / (4, 2, 2)
# (benchmarks/results/quant-gemv-vm-20261202-144304.json).
# The float types' (4 rows, 1-2 units, 4 warps: 4 KB of a matrix per step) are not tuned yet.
CONFIGS: dict[int, tuple[int, int, int]] = {8: (1, 2, 1), 10: (2, 2, 1), 11: (2, 2, 1), 12: (4, 2, 2),
                                            13: (4, 2, 2), 14: (2, 2, 1), 0: (4, 1, 4), 1: (4, 2, 4), 30: (4, 2, 4)}

SWITCH = TritonSwitch("EXPERTDESK_QUANT_GEMV", "quantized GEMV")


def lanes(ggml_type: int) -> int:
    """Lanes of a 256-value unit in `row_dots`: one per 4 packed bytes (Q8_0: 64; Q2_K, Q3_K,
    Q6_K: 16), or one per value (Q4_K, Q5_K: 32; the float types: 64)."""
    return {8: 64, 12: 32, 13: 32, 0: 64, 1: 64, 30: 64}.get(int(ggml_type), 16)


def unit_bytes(ggml_type: int) -> int:
    """Bytes of 256 values: one K-quant super block, or 8 Q8_0 blocks."""
    block, size = GGML_QUANT_SIZES[_Q(ggml_type)]
    return size * (256 // block)


def width_fits(ggml_type: int, width: int) -> bool:
    """Whether rows `width` values wide of a quantized type can be walked (Q8_0: whole blocks;
    K-quants: whole super blocks)."""
    return int(ggml_type) in GEMV_TYPES and width % GGML_QUANT_SIZES[_Q(int(ggml_type))][0] == 0


def walks(ggml_type: int, width: int) -> bool:
    """Whether `quant_gemv` walks rows of this type `width` values wide (`width_fits`, or a
    float type in whole 256-value units)."""
    return width_fits(ggml_type, width) or (int(ggml_type) in FLOAT_GEMV_TYPES and width % 256 == 0)


def reads_in_place(device: torch.device, ggml_types: Iterable[int]) -> bool:
    """Whether a decode step on `device` can read weights of these GGUF types in place:
    this family is on there, each type is one it walks or a float type (read as is), and
    the kernel of each quantized type compiles and runs here (one row of 256 values: a
    GPU whose compiler cannot build it turns the family off now, before the loader
    decides to keep the weights quantized, not at the first decode step)."""
    types = {int(t) for t in ggml_types}
    probe = torch.zeros(1, 256, device=device)
    if not SWITCH.applies(probe) or not types <= GEMV_TYPES | FLOAT_GEMV_TYPES:
        return False
    for t in sorted(types):
        quant_gemv(probe, torch.zeros(unit_bytes(t), dtype=torch.uint8, device=device), t, (1, 256))
    return SWITCH.error is None


def gemv_applies(x: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether `quant_gemv` runs for x against a weight of this type and (out, in) shape."""
    return (len(shape) == 2 and x.shape[-1] == shape[1] and x.dtype in _X_DTYPES
            and walks(ggml_type, int(shape[1])) and x.numel() <= MAX_ROWS * shape[1]
            and SWITCH.applies(x))


def quant_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               groups: int = 1) -> torch.Tensor:
    """`x @ W.T` for W (out, in) as GGUF bytes `raw` (1-D uint8 on x's device); x [..., in]
    with at most MAX_ROWS rows. The result is in x's dtype; see the module docstring.

    groups G > 1: a grouped projection, x [..., G, in / G]: group g's input times row
    block g of W (out / G rows of in / G values), the G outputs side by side [..., out]."""
    out_features, in_features = (int(s) for s in shape)

    def reference() -> torch.Tensor:
        if groups == 1:
            return quant_matmul(x, raw, ggml_type, (out_features, in_features))
        rows, block = out_features // groups, raw.numel() // groups
        return torch.cat([quant_matmul(x[..., g, :], raw[g * block:(g + 1) * block], ggml_type,
                                       (rows, in_features)) for g in range(groups)], dim=-1)

    return SWITCH.run(x.device, lambda: _launch(x, raw, int(ggml_type), out_features, in_features, groups),
                      reference)


def _launch(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, out_features: int, in_features: int,
            groups: int) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    x2 = x.reshape(-1, groups * in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if ggml_type in FLOAT_GEMV_TYPES and raw.storage_offset() % FLOAT_DTYPES[ggml_type].itemsize:
        raw = raw.clone()  # the kernel reads whole values: an aligned start
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows:
        block_n, sb, warps = CONFIGS[ggml_type]
        per_group = out_features // groups
        _gemv_kernel[(triton.cdiv(per_group, block_n), rows, groups)](
            x2, x2.stride(0), raw, y, per_group, QTYPE=ggml_type, UNIT_BYTES=unit_bytes(ggml_type),
            ROW_BYTES=row_nbytes(ggml_type, in_features), K=in_features, BLOCK_N=block_n, SB=sb,
            LANES=lanes(ggml_type), num_warps=warps)
    return y.view(*lead, out_features)


if triton is not None:

    @triton.jit
    def _unit_values(blk, k: tl.constexpr, hl, ok, QTYPE: tl.constexpr):
        """Q4_K / Q5_K: values 32k + hl (hl = 0..31) of the 256-value units at `blk` (byte
        pointers [.., 1]), as float32; `ok` masks whole units. The expressions are
        engine.kernels.dequant's (gguf.quants' order of float32 operations)."""
        d = _ld_f16(blk, ok)
        dmin = _ld_f16(blk + 2, ok)
        sc, mn = _k4_scale_min(blk, k, ok)
        if QTYPE == 12:  # Q4_K: d | dmin | scales[12] | qs[128]
            q = (_ld_u8(blk + 16 + 32 * (k // 2) + hl, ok) >> (4 * (k % 2))) & 15
        else:  # Q5_K: qh[32] before qs
            q = (_ld_u8(blk + 48 + 32 * (k // 2) + hl, ok) >> (4 * (k % 2))) & 15
            q = q | (((_ld_u8(blk + 16 + hl, ok) >> k) & 1) << 4)
        return (d * _int_to_f32(sc, 0)) * _int_to_f32(q, 0) - dmin * _int_to_f32(mn, 0)

    @triton.jit
    def _quad_dot(blk, ok, xu, x_ok, first_block, QTYPE: tl.constexpr, LANES: tl.constexpr,
                  N_BLOCKS32: tl.constexpr):
        """Q8_0, Q2_K, Q3_K, Q6_K: [BLOCK_N, SB, LANES, 4] partial dot products of the
        256-value units at `blk` (byte pointers [BLOCK_N, SB, 1], `ok` their mask) with their
        x values (xu: pointers [1, SB, 1] to each unit's first x, x_ok their mask); the caller
        accumulates them and sums the last axis after its loop.

        A lane owns 4 consecutive packed bytes (i = 0..3; one 4-byte load where the
        alignment allows it) and every value they hold: its scales are decoded once per
        lane, not once per value. K-quants: lane = (run c of 32 bytes, quad) with 16 lanes
        a unit, the 4 crumbs / nibble pairs j of a byte being values 32j apart; Q8_0:
        lane = (block b, quad), 64 lanes a unit; first_block: the unit's first block index
        (the last unit of a Q8_0 row may hold fewer than 8 blocks).
        """
        lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, LANES]
        i = tl.arange(0, 4)[None, None, None, :]
        blk4 = blk[:, :, :, None]
        ok4 = ok[:, :, :, None]
        xu4 = xu[:, :, :, None]
        x_ok4 = x_ok[:, :, :, None]
        if QTYPE == 8:  # Q8_0: 8 blocks of d | int8[32]; w = d * q exactly, d factored out
            b = lane // 8
            b_ok = first_block + b < N_BLOCKS32
            pos = 4 * (lane % 8)[:, :, :, None] + i
            q = _ld_u8(blk4 + 34 * b[:, :, :, None] + 2 + pos, ok4 & b_ok[:, :, :, None]) ^ 0x80
            xv = tl.load(xu4 + 32 * b[:, :, :, None] + pos, mask=x_ok4 & b_ok[:, :, :, None],
                         other=0.0).to(tl.float32)
            out = _ld_f16(blk + 34 * b, ok & b_ok)[:, :, :, None] * (_int_to_f32(q, 128) * xv)
        else:
            c = lane // 8
            h = (lane % 8) // 4  # the 16-value sub-block half of the 32-byte run
            pos = 4 * (lane % 8)[:, :, :, None] + i  # byte position in the run
            c4 = c[:, :, :, None]
            out = tl.zeros((blk4 + lane[:, :, :, None] + i).shape, dtype=tl.float32)  # [BLOCK_N, SB, LANES, 4]
            if QTYPE == 10:  # Q2_K: scales[16] | qs[64] | d | dmin; w = (d * sc) * q - dmin * m
                d = _ld_f16(blk + 80, ok)
                dmin = _ld_f16(blk + 82, ok)
                qs = _ld_u8(blk4 + 16 + 32 * c4 + pos, ok4)
                for j in tl.static_range(4):
                    sc = _ld_u8(blk + 2 * (4 * c + j) + h, ok)
                    dl = (d * _int_to_f32(sc & 15, 0))[:, :, :, None]
                    ml = (dmin * _int_to_f32(sc >> 4, 0))[:, :, :, None]
                    xv = tl.load(xu4 + 128 * c4 + 32 * j + pos, mask=x_ok4, other=0.0).to(tl.float32)
                    w = dl * _int_to_f32((qs >> (2 * j)) & 3, 0) - ml
                    out += w * xv
            elif QTYPE == 11:  # Q3_K: hmask[32] | qs[64] | scales[12] | d; w = (d * (sc - 32)) * (u - 4)
                d = _ld_f16(blk + 108, ok)
                hmask = _ld_u8(blk4 + pos, ok4)
                qs = _ld_u8(blk4 + 32 + 32 * c4 + pos, ok4)
                for j in tl.static_range(4):
                    # sub-block 2k + h, k = 4c + j: low nibble of byte 96 + 2j + h (shift 4c),
                    # high 2 bits of byte 104 + 2 (j % 2) + h (shift 4c + 2 (j // 2)).
                    low4 = (_ld_u8(blk + 96 + 2 * j + h, ok) >> (4 * c)) & 15
                    high2 = (_ld_u8(blk + 104 + 2 * (j % 2) + h, ok) >> (4 * c + 2 * (j // 2))) & 3
                    dl = d * _int_to_f32(low4 | (high2 << 4), 32)
                    u = ((qs >> (2 * j)) & 3) | (((hmask >> (4 * c4 + j)) & 1) << 2)
                    xv = tl.load(xu4 + 128 * c4 + 32 * j + pos, mask=x_ok4, other=0.0).to(tl.float32)
                    out += dl[:, :, :, None] * (_int_to_f32(u, 4) * xv)
            else:  # Q6_K (14): ql[128] | qh[64] | scales int8[16] | d; w = (d * sc) * (q - 32)
                d = _ld_f16(blk + 208, ok)
                ql_even = _ld_u8(blk4 + 64 * c4 + pos, ok4)  # j = 0, 2: low, high nibble
                ql_odd = _ld_u8(blk4 + 64 * c4 + 32 + pos, ok4)  # j = 1, 3
                qh = _ld_u8(blk4 + 128 + 32 * c4 + pos, ok4)
                for j in tl.static_range(4):
                    sc = tl.load(blk + 192 + 2 * (4 * c + j) + h, mask=ok, other=0).to(tl.int8, bitcast=True)
                    dl = d * _int_to_f32(sc.to(tl.int32) + 128, 128)
                    if j % 2 == 0:
                        low = (ql_even >> (4 * (j // 2))) & 15
                    else:
                        low = (ql_odd >> (4 * (j // 2))) & 15
                    q = low | (((qh >> (2 * j)) & 3) << 4)
                    xv = tl.load(xu4 + 128 * c4 + 32 * j + pos, mask=x_ok4, other=0.0).to(tl.float32)
                    out += dl[:, :, :, None] * (_int_to_f32(q, 32) * xv)
        return out

    @triton.jit
    def _float_values(blk, v, ok, QTYPE: tl.constexpr):
        """Values v of the float-type units at the byte pointers blk, as float32 (exact)."""
        if QTYPE == 0:
            return tl.load(blk.to(tl.pointer_type(tl.float32)) + v, mask=ok, other=0.0)
        if QTYPE == 1:
            return tl.load(blk.to(tl.pointer_type(tl.float16)) + v, mask=ok, other=0.0).to(tl.float32)
        return tl.load(blk.to(tl.pointer_type(tl.bfloat16)) + v, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def row_dots(rows, row_ok, x, QTYPE: tl.constexpr, UNIT_BYTES: tl.constexpr, K: tl.constexpr,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, LANES: tl.constexpr):
        """[BLOCK_N] float32: row i (GGUF bytes at rows[i], K values wide; row_ok[i] False: 0)
        dotted with x[0:K] (any float dtype). LANES: `lanes(QTYPE)`."""
        N_UNITS: tl.constexpr = (K + 255) // 256
        N_BLOCKS32: tl.constexpr = K // 32
        s = tl.arange(0, SB)[None, :, None]
        units = rows[:, None, None] + s.to(tl.int64) * UNIT_BYTES
        acc = tl.zeros((BLOCK_N, SB, LANES), dtype=tl.float32)
        acc4 = tl.zeros((BLOCK_N, SB, LANES, 4), dtype=tl.float32)  # the 4-value quads' products, summed after
        for start in range(0, N_UNITS, SB):
            u_ok = start + s < N_UNITS
            ok = row_ok[:, None, None] & u_ok
            blk = units + start * UNIT_BYTES
            xu = x + (start + s) * 256
            if QTYPE == 12 or QTYPE == 13:
                hl = tl.arange(0, 32)[None, None, :]
                for k in tl.static_range(8):
                    xv = tl.load(xu + 32 * k + hl, mask=u_ok, other=0.0).to(tl.float32)
                    acc += _unit_values(blk, k, hl, ok, QTYPE) * xv
            elif QTYPE == 0 or QTYPE == 1 or QTYPE == 30:
                v = tl.arange(0, LANES)[None, None, :]
                for k in tl.static_range(256 // LANES):
                    xv = tl.load(xu + LANES * k + v, mask=u_ok, other=0.0).to(tl.float32)
                    acc += _float_values(blk, LANES * k + v, ok, QTYPE) * xv
            else:
                acc4 += _quad_dot(blk, ok, xu, u_ok, (start + s) * 8, QTYPE, LANES, N_BLOCKS32)
        if QTYPE == 8 or QTYPE == 10 or QTYPE == 11 or QTYPE == 14:
            acc += tl.sum(acc4, axis=3)
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _gemv_kernel(x, x_stride, w, y, n_rows, QTYPE: tl.constexpr, UNIT_BYTES: tl.constexpr,
                     ROW_BYTES: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                     LANES: tl.constexpr):
        """y[t, g * n_rows + n] = W[g * n_rows + n] . x[t, g * K:(g + 1) * K] (one group: g = 0)."""
        t = tl.program_id(1).to(tl.int64)
        g = tl.program_id(2).to(tl.int64)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_rows
        row = g * n_rows + n
        dots = row_dots(w + row * ROW_BYTES, n_ok, x + t * x_stride + g * K, QTYPE, UNIT_BYTES, K, BLOCK_N, SB,
                        LANES)
        tl.store(y + t * (tl.num_programs(2) * n_rows) + row, dots.to(y.dtype.element_ty), mask=n_ok)
