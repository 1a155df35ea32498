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
Q8_0, Q2_K, Q3_K and Q6_K a lane owns QUADS words of 4 consecutive packed bytes and every
value they hold (`_quad_dot`, unrolled steps: no reduction across threads and no layout
change in the loop; with them it took 1.3-2.1x the instructions per value,
benchmarks/kernel_sass.py, RESULTS.md), its scales are decoded once per lane, not once per
value, and its bytes, scales and x values come in 16- and 32-bit words, not one byte or
value a load. The loop is bound by its integer ops, so a value's bits are masked where they
lie and made a float in one LOP3 and one FADD (`_field_f32`, with the exponent word in a
register), Q3_K's and Q6_K's split values are assembled for a word's 4 bytes at once, and
bytes 1 and 2 of such a word are read in place, 2**8 and 2**16 times their value, in sums
of their own scaled back once (`_word_values`). In a reduced-precision decode (x in bf16 or
f16) Q2_K and Q3_K take x as 16-bit integers (`engine.kernels.x16`, `integer_x`) and dot a
word's bytes with them by PTX dp2a into exact int32 sums per sub-block (`_quad_dot_x16`:
about half the instructions; 1.1-1.5x faster per matrix, the whole Kimi-K3 decode step
1.17x, benchmarks/RESULTS.md). For Q4_K and Q5_K a lane takes one value of
each 32-value step (`_unit_values`). The words need the
GGUF bytes 4-aligned and x's rows aligned to two values (`words_aligned`, `aligned_rows`:
always so for a GGUF's tensors, a pack's blocks and whole rows of x; otherwise a copy is
read). When the rows and steps are whole (EVEN_N, whole units), the loads carry no masks.

`row_dots` is that walk as a device function over any rows (the expert kernels of
`engine.kernels.moe_quant` call it with rows picked by expert id).

Types: Q8_0 (widths a multiple of 32), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (widths a
multiple of 256), and the float types F32, F16, BF16 (widths a multiple of 256; 64 lanes of
one value each, read as they are and widened exactly to float32). `QuantTensor.linear`
multiplies a float weight in x's own dtype with torch's matmul; this kernel serves the
other dtype: a BF16 matrix in a float32 decode step (`RuntimeOptions.decode_dtype`) is read
in place instead of being converted to a float32 copy per use. The decoding follows
`engine.kernels.dequant` (itself `gguf.quants`' order of float32 operations), except where
a per-block scale is factored out of a sum (Q8_0, Q3_K, Q6_K), where sums by byte place are
scaled by powers of two (exact: Q3_K, Q6_K) and where the compiler fuses
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

from .dequant import FLOAT_DTYPES, aligned_rows, quant_matmul, row_nbytes
from .triton_switch import TritonSwitch
from .x16 import quantize

try:
    import triton
    import triton.language as tl

    from .dequant import _int_to_f32, _k4_scale_min, _ld_f16, _ld_u8, _x_halves
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

__all__ = ["FLOAT_GEMV_TYPES", "GEMV_TYPES", "MAX_ROWS", "SWITCH", "X16_CONFIGS", "X16_SWITCH", "X16_TYPES",
           "gemv_applies", "integer_x", "quant_gemv", "reads_in_place", "unit_bytes", "walks",
           "width_fits", "word_alignment", "words_aligned"]

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

# (BLOCK_N rows, SB units of 256 values per step, num_warps, QUADS) of each type; chosen on an
# H200 with benchmarks/bench_quant_gemv.py --sweep over the real models' matrices. QUADS: the
# 4-byte words a lane of Q8_0, Q2_K, Q3_K and Q6_K takes (`_quad_dot`; 1 for the other types).
# Small programs win (more of them in flight): summed over a type's matrices, these took 14%
# (Q8_0), 0.3% (Q2_K), 11% (Q3_K) and 27% (Q6_K) less time than (2, 2, 2) / (4, 2, 2)
# (benchmarks/results/quant-gemv-vm-20261202-144304.json).
# The float types' (4 rows, 1-2 units, 4 warps: 4 KB of a matrix per step) are not tuned yet.
# The types whose GEMV takes a bf16 / f16 x as 16-bit integers (`integer_x`, `_quad_dot_x16`),
# and its (BLOCK_N, SB, num_warps, QUADS) for each, chosen on an H200 with
# benchmarks/bench_quant_gemv.py --sweep (quant-gemv-vm-20261206-234724.json): against the
# float32 math on x, Q2_K's matrices took 0.69-0.88x the time, Q3_K's 0.86-0.94x. Matrices of
# at least X16_MANY_ROWS rows (a group's) take X16_MANY_ROWS_CONFIGS: 4 rows a thread share
# their x loads. Q6_K (Kimi-K3's head) took 1.17x and Q8_0 (DeepSeek-V4's dense weights)
# 0.99-1.01x on its large matrices: they keep the float math.
X16_TYPES: frozenset[int] = frozenset(int(t) for t in (_Q.Q2_K, _Q.Q3_K))
X16_CONFIGS: dict[int, tuple[int, int, int, int]] = {10: (2, 2, 1, 2), 11: (2, 2, 1, 2)}
X16_MANY_ROWS = 12288
X16_MANY_ROWS_CONFIGS: dict[int, tuple[int, int, int, int]] = {10: (8, 4, 1, 4)}
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    8: (1, 2, 1, 1), 10: (2, 4, 1, 2), 11: (2, 4, 1, 2), 12: (4, 2, 2, 1), 13: (4, 2, 2, 1), 14: (2, 2, 1, 1),
    0: (4, 1, 4, 1), 1: (4, 2, 4, 1), 30: (4, 2, 4, 1)}
# Rows of at most 1024 values (DeepSeek-V4's attn_q_b, Kimi-K3's ssm_f_b) walk few units each:
# there more rows and words a program pay (quant-gemv-vm-20261206-204026.json: attn_q_b 16.9 us
# against 22.2 at CONFIGS' (1, 2, 1, 1); ssm_f_b 5.1 against 8.8).
SHORT_ROWS = 1024
SHORT_ROW_CONFIGS: dict[int, tuple[int, int, int, int]] = {8: (2, 2, 1, 2)}
QUAD_TYPES: frozenset[int] = frozenset(int(t) for t in (_Q.Q8_0, _Q.Q2_K, _Q.Q3_K, _Q.Q6_K))
# The bits of float32 2**23, passed to the kernels at run time: in a register, one LOP3 both
# masks a packed field and ORs it in (`_field_f32`); as an immediate ptxas spends two.
F32_2P23_BITS = 0x4B000000

SWITCH = TritonSwitch("EXPERTDESK_QUANT_GEMV", "quantized GEMV")
# x as 16-bit integers (`integer_x`), in this GEMV and in moe_quant's expert kernels; if those
# cannot run, the float32 math on x serves.
X16_SWITCH = TritonSwitch("EXPERTDESK_X16", "integer-dot (x16)")


def lanes(ggml_type: int, quads: int = 1) -> int:
    """Lanes of a 256-value unit in `row_dots`: one per `quads` words of 4 packed bytes (Q8_0:
    64 / quads; Q2_K, Q3_K, Q6_K: 16 / quads), or one per value (Q4_K, Q5_K: 32; the float
    types: 64)."""
    t = int(ggml_type)
    if t in QUAD_TYPES:
        if quads not in (1, 2, 4):  # a lane's words stay in one 16-byte sub-block half
            raise ValueError(f"a lane takes 1, 2 or 4 words, not {quads}")
        return (64 if t == 8 else 16) // quads
    return {12: 32, 13: 32}.get(t, 64)


def config(ggml_type: int, width: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, SB, num_warps, QUADS) for rows of this type `width` values wide."""
    t = int(ggml_type)
    if width <= SHORT_ROWS and t in SHORT_ROW_CONFIGS:
        return SHORT_ROW_CONFIGS[t]
    return CONFIGS[t]


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


def word_alignment(ggml_type: int) -> int:
    """The alignment `row_dots` needs of a type's rows: 4 for Q2_K (32-bit words), 2 for
    Q8_0, Q3_K and Q6_K (16-bit words: their blocks are 34, 110 and 210 bytes), a float
    type's item size (whole values), 1 otherwise."""
    if int(ggml_type) in FLOAT_DTYPES:
        return FLOAT_DTYPES[int(ggml_type)].itemsize
    return {10: 4, 8: 2, 11: 2, 14: 2}.get(int(ggml_type), 1)


def words_aligned(raw: torch.Tensor, ggml_type: int) -> bool:
    """Whether GGUF bytes of this type start where `row_dots` may read them in words. A GGUF
    aligns its tensors to 32 bytes and an expert pack its roles to 4096; a copy on the device
    starts at an allocation (512-aligned) or at such an offset into one."""
    return raw.data_ptr() % word_alignment(ggml_type) == 0


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

    def launch() -> torch.Tensor:
        args = (x, raw, int(ggml_type), out_features, in_features, groups)
        if integer_x(x, ggml_type):  # its own switch: if it cannot run, the float32 math serves
            return X16_SWITCH.run(x.device, lambda: _launch(*args, True), lambda: _launch(*args, False))
        return _launch(*args, False)

    return SWITCH.run(x.device, launch, reference)


def _launch(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, out_features: int, in_features: int,
            groups: int, x16: bool) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    x2 = x.reshape(-1, groups * in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if not words_aligned(raw, ggml_type):
        raw = raw.clone()  # the kernel reads whole values, or 16- and 32-bit words
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows:
        per_group = out_features // groups
        if x16:
            q = quantize(x2)  # per call: no state a CUDA graph could replay stale
            xq, xg = q.q, q.groups
            block_n, sb, warps, quads = x16_config(ggml_type, per_group)
        else:
            xq = xg = aligned_rows(x2, 2 * x2.element_size())  # two values a load (`_x_pair`)
            block_n, sb, warps, quads = config(ggml_type, in_features)
        _gemv_kernel[(triton.cdiv(per_group, block_n), rows, groups)](
            xq, xq.stride(0), xg, raw, y, per_group, F32_2P23_BITS, QTYPE=ggml_type,
            UNIT_BYTES=unit_bytes(ggml_type), ROW_BYTES=row_nbytes(ggml_type, in_features), K=in_features,
            BLOCK_N=block_n, SB=sb, LANES=lanes(ggml_type, quads), QUADS=quads, EVEN_N=per_group % block_n == 0,
            X16=x16, ASM=x.is_cuda, num_warps=warps)
    return y.view(*lead, out_features)


def x16_config(ggml_type: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, SB, num_warps, QUADS) of the integer-dot GEMV over `rows` rows of a type."""
    if rows >= X16_MANY_ROWS and ggml_type in X16_MANY_ROWS_CONFIGS:
        return X16_MANY_ROWS_CONFIGS[ggml_type]
    return X16_CONFIGS[ggml_type]


def integer_x(x: torch.Tensor, ggml_type: int) -> bool:
    """Whether the kernels take x as 16-bit integers (`engine.kernels.x16`) against weights of
    this type: a reduced-precision decode (x in bfloat16 or float16), a type `_quad_dot_x16`
    walks, and `X16_SWITCH` on (EXPERTDESK_X16 not "0", and no failure to compile or launch
    them). A float32 decode keeps the float32 math."""
    return x.dtype in (torch.bfloat16, torch.float16) and int(ggml_type) in X16_TYPES and X16_SWITCH.applies(x)


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
    def _x_pair(ptr, mask):
        """x at ptr and ptr + 1, as float32 (0 where masked), from one load of both: ptr is an
        even element of an x whose rows `aligned_rows` aligned to two values."""
        if ptr.dtype.element_ty == tl.float32:
            word = tl.load(ptr.to(tl.pointer_type(tl.int64)), mask=mask, other=0)
        else:
            word = tl.load(ptr.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
        return _x_halves(word, ptr)

    @triton.jit
    def _x_crumbs(ptr, mask):
        """The K-quant lanes' x pairs of one step: x at ptr + 32 j and ptr + 32 j + 1, j = 0..3
        (values i, i + 1 of the 4 sub-blocks a byte's crumbs or nibbles serve)."""
        x00, x01 = _x_pair(ptr, mask)
        x10, x11 = _x_pair(ptr + 32, mask)
        x20, x21 = _x_pair(ptr + 64, mask)
        x30, x31 = _x_pair(ptr + 96, mask)
        return x00, x01, x10, x11, x20, x21, x30, x31

    @triton.jit
    def _ld_u16(ptr, mask):
        """The little-endian 16-bit word at the byte pointer ptr (2-aligned), as int32 0..65535."""
        return tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _ld_u32(ptr, mask):
        """The little-endian 32-bit word at the byte pointer ptr (4-aligned), as int32 bits."""
        return tl.load(ptr.to(tl.pointer_type(tl.int32)), mask=mask, other=0)

    @triton.jit
    def _ld_quad(ptr, mask, ALIGN4: tl.constexpr):
        """The 4 bytes at ptr as one int32 (byte i at bits 8i): one load where ptr is 4-aligned,
        else two 16-bit loads (2-aligned)."""
        if ALIGN4:
            return _ld_u32(ptr, mask)
        return _ld_u16(ptr, mask) | (_ld_u16(ptr + 2, mask) << 16)

    @triton.jit
    def _byte(word, i: tl.constexpr):
        """Byte i of a word of 4 bytes, as int32 0..255."""
        return (word >> (8 * i)) & 255

    @triton.jit
    def _f16_at(word, i: tl.constexpr):
        """The fp16 in half i of a 32-bit word, as float32 (exact)."""
        return (word >> (16 * i)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _field_f32(bits, magic, bias: tl.constexpr):
        """float32(bits - bias) for 0 <= bits < 2**23, exactly (`_int_to_f32`), with the bits of
        2**23 in a register (magic: F32_2P23_BITS, a kernel argument), so that a packed field
        masked in place and its exponent take one LOP3."""
        return (bits | magic).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _word_values(v, x0, x1, x2, x3, s0, s1, s2, magic, BIAS: tl.constexpr):
        """Add (byte i of v - BIAS) * x_i, i = 0..3, to the sums by place: bytes 0 and 3 to s0,
        byte 1 to s1 and byte 2 to s2, as 2**8 and 2**16 times their values (read where they
        lie, one LOP3 and one FADD each; `_by_place` scales them back). Every byte of v < 2**7,
        so a value in place stays under 2**23 (`_field_f32`); scaling by a power of two is exact
        (for |x| < 2**100: beyond, 2**16 times a product may overflow where it would not)."""
        s0 += _field_f32(v & 255, magic, BIAS) * x0
        s1 += _field_f32(v & 65280, magic, BIAS * 256) * x1
        s2 += _field_f32(v & 16711680, magic, BIAS * 65536) * x2
        s0 += _field_f32((v >> 24) & 255, magic, BIAS) * x3
        return s0, s1, s2

    @triton.jit
    def _word_steps(v0, v1, v2, v3, xw, x_ok, a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3, magic,
                    BIAS: tl.constexpr):
        """`_word_values` for a lane's word of each of the 4 sub-steps j (v_j: sub-step j's
        values, byte i for the word's byte i; xw: x of byte 0 of sub-step 0, sub-step j's 32 j
        further on): the 12 sums by sub-step and place."""
        x00, x01, x10, x11, x20, x21, x30, x31 = _x_crumbs(xw, x_ok)  # bytes 0, 1
        y00, y01, y10, y11, y20, y21, y30, y31 = _x_crumbs(xw + 2, x_ok)  # bytes 2, 3
        a0, b0, c0 = _word_values(v0, x00, x01, y00, y01, a0, b0, c0, magic, BIAS)
        a1, b1, c1 = _word_values(v1, x10, x11, y10, y11, a1, b1, c1, magic, BIAS)
        a2, b2, c2 = _word_values(v2, x20, x21, y20, y21, a2, b2, c2, magic, BIAS)
        a3, b3, c3 = _word_values(v3, x30, x31, y30, y31, a3, b3, c3, magic, BIAS)
        return a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3

    @triton.jit
    def _q2k_scales(blk, ok, h, c):
        """Q2_K (scales[16] | qs[64] | d | dmin): d, dmin and the 4-bit scale and min fields s_j
        of the lane's sub-blocks 2 (4 c + j) + h (byte 8 c + 2 j + h: scale | min << 4)."""
        dd = _ld_u32(blk + 80, ok)
        sc01 = _ld_u32(blk + 8 * c, ok) >> (8 * h)
        sc23 = _ld_u32(blk + 8 * c + 4, ok) >> (8 * h)
        return _f16_at(dd, 0), _f16_at(dd, 1), sc01 & 255, (sc01 >> 16) & 255, sc23 & 255, (sc23 >> 16) & 255

    @triton.jit
    def _q3k_values(qs, hm):
        """Q3_K: sub-step j's 3-bit values u of a word's 4 bytes at once (byte i of u_j), from
        its low bits qs and its high bits hm (bit j of byte i, the rest masked off here)."""
        return ((qs & 0x03030303) | ((hm << 2) & 0x04040404), ((qs >> 2) & 0x03030303) | ((hm << 1) & 0x04040404),
                ((qs >> 4) & 0x03030303) | (hm & 0x04040404), ((qs >> 6) & 0x03030303) | ((hm >> 1) & 0x04040404))

    @triton.jit
    def _q3k_scales(blk, ok, h, c):
        """Q3_K (hmask[32] | qs[64] | scales[12] | d): d and the 6-bit scale fields s_j of the
        lane's sub-blocks 2 k + h, k = 4 c + j: the low nibble of byte 96 + 2 j + h (shift 4 c),
        the high 2 bits of byte 104 + 2 (j % 2) + h (shift 4 c + 2 (j // 2)); the masks keep
        only those bits of the words."""
        low01 = _ld_quad(blk + 96, ok, False) >> (8 * h + 4 * c)
        low23 = _ld_quad(blk + 100, ok, False) >> (8 * h + 4 * c)
        high = _ld_quad(blk + 104, ok, False) >> (8 * h + 4 * c)
        high02, high13 = high, high >> 16
        return (_f16_at(_ld_u16(blk + 108, ok), 0), (low01 & 15) | ((high02 & 3) << 4),
                ((low01 >> 16) & 15) | ((high13 & 3) << 4), (low23 & 15) | (high02 & 12) << 2,
                ((low23 >> 16) & 15) | (high13 & 12) << 2)

    @triton.jit
    def _by_place(s0, s1, s2):
        """One sum of `_word_values`' three sums by place (exact scalings by 2**-8, 2**-16)."""
        return s0 + s1 * 0.00390625 + s2 * 0.0000152587890625

    @triton.jit
    def _quad_dot(blk, ok, xu, x_ok, first_block, magic, QTYPE: tl.constexpr, LANES: tl.constexpr,
                  QUADS: tl.constexpr, N_BLOCKS32: tl.constexpr):
        """Q8_0, Q2_K, Q3_K, Q6_K: [BLOCK_N, SB, LANES] partial dot products of the 256-value
        units at `blk` (byte pointers [BLOCK_N, SB, 1], `ok` their mask) with their x values
        (xu: pointers [1, SB, 1] to each unit's first x, x_ok their mask).

        A lane owns QUADS consecutive words of 4 packed bytes and every value they hold, taken
        as unrolled steps of lane-shaped tensors (no tensor axis for the steps: their products
        are summed in the thread, and every tensor of the loop shares one layout, so nothing
        moves between threads; with an axis the loop took 1.3-2.1x the instructions per value
        under Triton 3.6, benchmarks/kernel_sass.py). Its scales are decoded once per lane, not
        once per value, so more words a lane spread that cost over more values; where a scale
        multiplies a whole sub-block (Q8_0, Q3_K, Q6_K) it multiplies the lane's sum of its
        products. Loads are words, not bytes: 4 bytes in one 32-bit load where the format keeps
        them 4-aligned (Q2_K's 84-byte units), else two 16-bit loads (Q8_0's 34-byte blocks,
        Q3_K's 110 and Q6_K's 210-byte units are 2-aligned); the scales likewise; x two values
        a load (`_x_pair`). A Hopper SM serves 32 lanes of loads a clock against 64 of integer
        and 128 of float32 ops: the loop is bound by its integer ops (field masks, x widening),
        so each field is masked where it lies and made a float by one LOP3 and one FADD
        (`_field_f32`). K-quants: lane = (run c of 32 bytes, 4 * QUADS bytes of it) with
        16 / QUADS lanes a unit, the 4 crumbs / nibble pairs j of a byte being values 32j
        apart; Q8_0: lane = (block b, 4 * QUADS bytes of it), 64 / QUADS lanes a unit;
        first_block: the unit's first block index (the last unit of a Q8_0 row may hold fewer
        than 8 blocks).
        """
        RUN_LANES: tl.constexpr = 8 // QUADS  # lanes of a 32-byte run (or block)
        lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, LANES]
        base = 4 * QUADS * (lane % RUN_LANES)  # the lane's first byte in its run (or block)
        if QTYPE == 8:  # Q8_0: 8 blocks of d | int8[32]; w = d * q exactly, d factored out
            b = lane // RUN_LANES
            if N_BLOCKS32 % 8 == 0:  # whole units: every block is there
                m = ok
                xm = x_ok
            else:
                b_ok = first_block + b < N_BLOCKS32
                m = ok & b_ok
                xm = x_ok & b_ok
            row = blk + 34 * b
            xb = xu + 32 * b + base + 0 * m.to(tl.int32)
            dot = tl.zeros((blk + lane).shape, dtype=tl.float32)
            for k in tl.static_range(QUADS):
                q = _ld_quad(row + 2 + base + 4 * k, m, False) ^ -2139062144  # 0x80808080: each int8 plus 128
                x0, x1 = _x_pair(xb + 4 * k, xm)
                x2, x3 = _x_pair(xb + 4 * k + 2, xm)
                dot += _field_f32(q & 255, magic, 128) * x0
                dot += _field_f32((q >> 8) & 255, magic, 128) * x1
                dot += _field_f32((q >> 16) & 255, magic, 128) * x2
                dot += _field_f32((q >> 24) & 255, magic, 128) * x3
            return _f16_at(_ld_u16(row, m), 0) * dot
        c = lane // RUN_LANES
        h = base // 16  # the 16-value sub-block half of the 32-byte run
        # x of value 128 c + 32 j + base + i at xb + 32 j + i, one pointer per row too (a load
        # of the weights' shape: it shares their layout, and nothing is converted in the loop)
        xb = xu + 128 * c + base + 0 * ok.to(tl.int32)
        out = tl.zeros((blk + lane).shape, dtype=tl.float32)
        if QTYPE == 10:  # Q2_K: scales[16] | qs[64] | d | dmin; w = (d * sc) * q - dmin * m
            d, dmin, s0, s1, s2, s3 = _q2k_scales(blk, ok, h, c)
            # crumb j is read where it lies, 4**j times its value, and its scale carries 4**-j:
            # powers of two, so each product d * sc * q (and w) rounds as before, one op saved
            dl0, ml0 = d * _field_f32(s0 & 15, magic, 0), dmin * _field_f32(s0 >> 4, magic, 0)
            dl1, ml1 = d * _field_f32(s1 & 15, magic, 0) * 0.25, dmin * _field_f32(s1 >> 4, magic, 0)
            dl2, ml2 = d * _field_f32(s2 & 15, magic, 0) * 0.0625, dmin * _field_f32(s2 >> 4, magic, 0)
            dl3, ml3 = d * _field_f32(s3 & 15, magic, 0) * 0.015625, dmin * _field_f32(s3 >> 4, magic, 0)
            for k in tl.static_range(QUADS):
                quad = _ld_quad(blk + 16 + 32 * c + base + 4 * k, ok, True)
                for i in tl.static_range(0, 4, 2):
                    x00, x01, x10, x11, x20, x21, x30, x31 = _x_crumbs(xb + 4 * k + i, x_ok)
                    qs = quad >> (8 * i)  # byte i in bits 0-7 (the masks below drop the rest)
                    out += (dl0 * _field_f32(qs & 3, magic, 0) - ml0) * x00
                    out += (dl1 * _field_f32(qs & 12, magic, 0) - ml1) * x10
                    out += (dl2 * _field_f32(qs & 48, magic, 0) - ml2) * x20
                    out += (dl3 * _field_f32(qs & 192, magic, 0) - ml3) * x30
                    qs = quad >> (8 * i + 8)
                    out += (dl0 * _field_f32(qs & 3, magic, 0) - ml0) * x01
                    out += (dl1 * _field_f32(qs & 12, magic, 0) - ml1) * x11
                    out += (dl2 * _field_f32(qs & 48, magic, 0) - ml2) * x21
                    out += (dl3 * _field_f32(qs & 192, magic, 0) - ml3) * x31
            return out
        # Q3_K / Q6_K: sub-step j's sums of q * x, scaled after, kept by the byte's place: the
        # values of bytes 1 and 2 of a word are read where they lie, 2**8 and 2**16 times
        # themselves (`_word_values`), and their sums are scaled back once at the end
        zero = tl.zeros((blk + lane).shape, dtype=tl.float32)
        a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, \
            zero, zero
        # the sub-block scale fields s_j: Q3_K's 6 bits less 32, Q6_K's int8 stored plus 128 below
        SC_BIAS: tl.constexpr = 32 if QTYPE == 11 else 128
        if QTYPE == 11:  # Q3_K: hmask[32] | qs[64] | scales[12] | d; w = (d * (sc - 32)) * (u - 4)
            for k in tl.static_range(QUADS):
                # byte i, bit 4 c + j: the 3rd bit of value 128 c + 32 j + base + 4 k + i; shifted
                # by 4 c, bit j of byte i (the masks below drop what came from byte i + 1)
                hm = _ld_quad(blk + base + 4 * k, ok, False) >> (4 * c)
                u0, u1, u2, u3 = _q3k_values(_ld_quad(blk + 32 + 32 * c + base + 4 * k, ok, False), hm)
                a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3 = _word_steps(
                    u0, u1, u2, u3, xb + 4 * k, x_ok, a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3, magic, 4)
            d, s0, s1, s2, s3 = _q3k_scales(blk, ok, h, c)
        else:  # Q6_K (14): ql[128] | qh[64] | scales int8[16] | d; w = (d * sc) * (q - 32)
            for k in tl.static_range(QUADS):
                ql_evens = _ld_quad(blk + 64 * c + base + 4 * k, ok, False)  # j = 0, 2: low, high nibble
                ql_odds = _ld_quad(blk + 64 * c + 32 + base + 4 * k, ok, False)  # j = 1, 3
                qhs = _ld_quad(blk + 128 + 32 * c + base + 4 * k, ok, False)  # crumb j: bits 4-5 of value j
                # sub-step j's 6-bit values of the 4 bytes at once: byte i of v_j
                v0 = (ql_evens & 0x0F0F0F0F) | ((qhs << 4) & 0x30303030)
                v1 = (ql_odds & 0x0F0F0F0F) | ((qhs << 2) & 0x30303030)
                v2 = ((ql_evens >> 4) & 0x0F0F0F0F) | (qhs & 0x30303030)
                v3 = ((ql_odds >> 4) & 0x0F0F0F0F) | ((qhs >> 2) & 0x30303030)
                a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3 = _word_steps(
                    v0, v1, v2, v3, xb + 4 * k, x_ok, a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3, magic, 32)
            d = _f16_at(_ld_u16(blk + 208, ok), 0)
            sc01 = (_ld_quad(blk + 192 + 8 * c, ok, False) >> (8 * h)) ^ 0x800080  # int8 scales + 128
            sc23 = (_ld_quad(blk + 196 + 8 * c, ok, False) >> (8 * h)) ^ 0x800080
            s0, s1, s2, s3 = sc01 & 255, (sc01 >> 16) & 255, sc23 & 255, (sc23 >> 16) & 255
        # sub-step j's sum of q * x (`_by_place`) times its sub-block's scale d * (s_j - SC_BIAS)
        out += (d * _field_f32(s0, magic, SC_BIAS)) * _by_place(a0, b0, c0)
        out += (d * _field_f32(s1, magic, SC_BIAS)) * _by_place(a1, b1, c1)
        out += (d * _field_f32(s2, magic, SC_BIAS)) * _by_place(a2, b2, c2)
        out += (d * _field_f32(s3, magic, SC_BIAS)) * _by_place(a3, b3, c3)
        return out

    @triton.jit
    def _dp2a(a, b, c, HI: tl.constexpr, ASM: tl.constexpr):
        """c + a.h0 * b.b0 + a.h1 * b.b1 (HI: bytes b2, b3), a's halves signed 16-bit, b's bytes
        unsigned: PTX dp2a, one instruction (ASM), or the same in integer ops (Triton's
        interpreter runs no PTX)."""
        if ASM:
            if HI:
                return tl.inline_asm_elementwise("dp2a.hi.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise("dp2a.lo.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        SHIFT: tl.constexpr = 16 if HI else 0
        return c + ((a << 16) >> 16) * ((b >> SHIFT) & 255) + (a >> 16) * ((b >> (SHIFT + 8)) & 255)

    @triton.jit
    def _x16_word_dot(xq, x_ok, v, d, ASM: tl.constexpr):
        """d plus the dot product of the 4 bytes of v (unsigned) with the 4 int16 x at xq
        (8-aligned)."""
        xw = tl.load(xq.to(tl.pointer_type(tl.int64)), mask=x_ok, other=0)
        d = _dp2a(xw.to(tl.int32), v, d, False, ASM)
        return _dp2a((xw >> 32).to(tl.int32), v, d, True, ASM)

    @triton.jit
    def _x16_group(xg, x_ok):
        """A group's (s, s * sum q) of `engine.kernels.x16`, from one 64-bit load."""
        w = tl.load(xg.to(tl.pointer_type(tl.int64)), mask=x_ok, other=0)
        return w.to(tl.int32).to(tl.float32, bitcast=True), (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _quad_dot_x16(blk, ok, xq, xg, x_ok, magic, QTYPE: tl.constexpr, LANES: tl.constexpr,
                      QUADS: tl.constexpr, ASM: tl.constexpr):
        """Q2_K, Q3_K: `_quad_dot` with x as 16-bit integers in groups of 16 (`engine.kernels.x16`:
        xq, int16 pointers [1, SB, 1] to each unit's first value, xg float32 pointers to its
        first group's (s, s * sum q)): a lane's words are masked in place and dotted with x by
        `_dp2a`, two values an instruction, into exact int32 sums, one per sub-block; each is
        scaled by its x group's s and the weights' scale in float32, and a sub-block's offset
        or minimum multiplies its group's s * sum q (added once, by the sub-block's first
        lane). Lanes as in `_quad_dot`."""
        tl.static_assert(QTYPE == 10 or QTYPE == 11)  # `X16_TYPES`
        RUN_LANES: tl.constexpr = 8 // QUADS
        lane = tl.arange(0, LANES)[None, None, :]
        base = 4 * QUADS * (lane % RUN_LANES)
        zero_i = tl.zeros((blk + lane).shape, dtype=tl.int32)
        c = lane // RUN_LANES
        h = base // 16
        first = (base % 16 == 0).to(tl.float32)  # the lane that adds its sub-block's offset term
        xb = xq + 128 * c + base + 0 * ok.to(tl.int32)
        gb = xg + 2 * (8 * c + h) + 0 * ok.to(tl.int32)  # group 8 c + 2 j + h: sub-block (c, j, h)
        g0, t0 = _x16_group(gb, x_ok)
        g1, t1 = _x16_group(gb + 4, x_ok)
        g2, t2 = _x16_group(gb + 8, x_ok)
        g3, t3 = _x16_group(gb + 12, x_ok)
        d0, d1, d2, d3 = zero_i, zero_i, zero_i, zero_i
        if QTYPE == 10:  # Q2_K: crumb j masked in place, 4**j times its value (under 2**8)
            for k in tl.static_range(QUADS):
                quad = _ld_quad(blk + 16 + 32 * c + base + 4 * k, ok, True)
                d0 = _x16_word_dot(xb + 4 * k, x_ok, quad & 0x03030303, d0, ASM)
                d1 = _x16_word_dot(xb + 32 + 4 * k, x_ok, quad & 0x0C0C0C0C, d1, ASM)
                d2 = _x16_word_dot(xb + 64 + 4 * k, x_ok, quad & 0x30303030, d2, ASM)
                d3 = _x16_word_dot(xb + 96 + 4 * k, x_ok, quad & -1061109568, d3, ASM)  # 0xC0C0C0C0
            d, dmin, s0, s1, s2, s3 = _q2k_scales(blk, ok, h, c)
            out = (d * _field_f32(s0 & 15, magic, 0)) * (g0 * d0.to(tl.float32)) \
                - (dmin * _field_f32(s0 >> 4, magic, 0)) * (first * t0)
            out += (d * _field_f32(s1 & 15, magic, 0) * 0.25) * (g1 * d1.to(tl.float32)) \
                - (dmin * _field_f32(s1 >> 4, magic, 0)) * (first * t1)
            out += (d * _field_f32(s2 & 15, magic, 0) * 0.0625) * (g2 * d2.to(tl.float32)) \
                - (dmin * _field_f32(s2 >> 4, magic, 0)) * (first * t2)
            out += (d * _field_f32(s3 & 15, magic, 0) * 0.015625) * (g3 * d3.to(tl.float32)) \
                - (dmin * _field_f32(s3 >> 4, magic, 0)) * (first * t3)
        else:  # Q3_K: w = d * (sc - 32) * (u - 4), values and scales assembled as in `_quad_dot`
            for k in tl.static_range(QUADS):
                hm = _ld_quad(blk + base + 4 * k, ok, False) >> (4 * c)
                u0, u1, u2, u3 = _q3k_values(_ld_quad(blk + 32 + 32 * c + base + 4 * k, ok, False), hm)
                d0 = _x16_word_dot(xb + 4 * k, x_ok, u0, d0, ASM)
                d1 = _x16_word_dot(xb + 32 + 4 * k, x_ok, u1, d1, ASM)
                d2 = _x16_word_dot(xb + 64 + 4 * k, x_ok, u2, d2, ASM)
                d3 = _x16_word_dot(xb + 96 + 4 * k, x_ok, u3, d3, ASM)
            d, s0, s1, s2, s3 = _q3k_scales(blk, ok, h, c)
            out = (d * _field_f32(s0, magic, 32)) * (g0 * d0.to(tl.float32) - 4 * (first * t0))
            out += (d * _field_f32(s1, magic, 32)) * (g1 * d1.to(tl.float32) - 4 * (first * t1))
            out += (d * _field_f32(s2, magic, 32)) * (g2 * d2.to(tl.float32) - 4 * (first * t2))
            out += (d * _field_f32(s3, magic, 32)) * (g3 * d3.to(tl.float32) - 4 * (first * t3))
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
    def row_dots(rows, row_ok, x, xg, magic, QTYPE: tl.constexpr, UNIT_BYTES: tl.constexpr, K: tl.constexpr,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, LANES: tl.constexpr, QUADS: tl.constexpr,
                 X16: tl.constexpr, ASM: tl.constexpr):
        """[BLOCK_N] float32: row i (GGUF bytes at rows[i], K values wide; row_ok[i] False: 0)
        dotted with x[0:K] (any float dtype). magic: F32_2P23_BITS; QUADS: words a lane takes
        (1 but for `QUAD_TYPES`), LANES: `lanes(QTYPE, QUADS)`. X16 (`X16_TYPES`): x is the
        row's int16 values of `engine.kernels.x16` and xg its groups (else xg is unused); ASM:
        `_dp2a` in PTX (False under Triton's interpreter)."""
        N_UNITS: tl.constexpr = (K + 255) // 256
        N_BLOCKS32: tl.constexpr = K // 32
        s = tl.arange(0, SB)[None, :, None]
        units = rows[:, None, None] + s.to(tl.int64) * UNIT_BYTES
        acc = tl.zeros((BLOCK_N, SB, LANES), dtype=tl.float32)
        for start in range(0, N_UNITS, SB):
            if N_UNITS % SB == 0:  # every step is whole: a constant mask, which the compiler drops
                u_ok = tl.full((1, SB, 1), 1, tl.int1)
            else:
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
            elif X16:
                acc += _quad_dot_x16(blk, ok, xu, xg + (start + s) * 32, u_ok, magic, QTYPE, LANES, QUADS, ASM)
            else:
                acc += _quad_dot(blk, ok, xu, u_ok, (start + s) * 8, magic, QTYPE, LANES, QUADS, N_BLOCKS32)
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _rows_ok(n, n_rows, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
        """n < n_rows; EVEN_N (n_rows a multiple of BLOCK_N): a constant mask, which the
        compiler drops from the loads."""
        if EVEN_N:
            return tl.full((BLOCK_N,), 1, tl.int1)
        return n < n_rows

    @triton.jit
    def _gemv_kernel(x, x_stride, xg, w, y, n_rows, magic, QTYPE: tl.constexpr, UNIT_BYTES: tl.constexpr,
                     ROW_BYTES: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                     LANES: tl.constexpr, QUADS: tl.constexpr, EVEN_N: tl.constexpr, X16: tl.constexpr,
                     ASM: tl.constexpr):
        """y[t, g * n_rows + n] = W[g * n_rows + n] . x[t, g * K:(g + 1) * K] (one group: g = 0).
        X16: x is `engine.kernels.x16`'s q (x_stride its row length) and xg its groups."""
        t = tl.program_id(1).to(tl.int64)
        g = tl.program_id(2).to(tl.int64)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = _rows_ok(n, n_rows, BLOCK_N, EVEN_N)
        row = g * n_rows + n
        dots = row_dots(w + row * ROW_BYTES, n_ok, x + t * x_stride + g * K, xg + (t * x_stride + g * K) // 8,
                        magic, QTYPE, UNIT_BYTES, K, BLOCK_N, SB, LANES, QUADS, X16, ASM)
        tl.store(y + t * (tl.num_programs(2) * n_rows) + row, dots.to(y.dtype.element_ty), mask=n_ok)
