"""GGML quant dequantization for torch tensors (CPU and CUDA, same code).

Two implementations, with identical results:

* The torch path (CPU, and CUDA without Triton).  Each kernel views the raw
  bytes as ``[n_blocks, type_size]``, slices the fields of a block, unpacks
  the small integers with vectorized uint8/int8 bit operations and ends in one
  float multiply (plus one add/subtract for the "affine" types) that writes
  straight into the output dtype: ``torch.mul(int8, float32, out=bf16)``
  computes in float32 and rounds once on store.

* The Triton path (CUDA, when Triton is importable; it ships with torch's
  Linux CUDA wheels).  One launch per tensor, reading the packed bytes once
  and writing the output once: 72-97% of the device-to-device copy
  bandwidth on an H200 for bfloat16 output, against 5-25% for the torch
  path, which is bound by its many full-size intermediate passes.  Set
  ``EXPERTDESK_DEQUANT_TRITON=0`` to force the torch path.

Bit-exactness: the float math mirrors ``gguf.quants`` (the numpy reference)
operation by operation in float32, e.g. for Q2_K ``(d * sc) * q - (dmin * m)``
with each product rounded to float32 before the next step (never a fused
multiply-add).  Lower-precision outputs (float16/bfloat16) are that float32
result rounded once to nearest even, i.e. ``torch.from_numpy(reference).to(dtype)``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

try:  # Triton ships with the CUDA builds of torch on Linux; absent on CPU installs.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - not installed, or a broken install
    triton = None
    tl = None

__all__ = [
    "SUPPORTED_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "dequantize_gathered",
    "dequantize_rows",
    "quant_matmul",
    "aligned_rows",
    "row_nbytes",
    "tensor_nbytes",
]

_Q = GGMLQuantizationType

SUPPORTED_TYPES: frozenset[int] = frozenset(
    int(t)
    for t in (
        _Q.F32, _Q.F16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
        _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.I32, _Q.BF16, _Q.MXFP4,
    )
)

# The torch path dequantizes at most this many values per pass, so its
# uint8/float32 temporaries stay bounded whatever the tensor size.  On CPU
# small passes keep the temporaries in cache and off fresh (page-faulting)
# allocations; on CUDA large passes keep launch overhead negligible.
_CHUNK_VALUES_CPU = 1 << 18
_CHUNK_VALUES_CUDA = 1 << 26

# quant_matmul dequantizes W in row chunks whose float32 size stays below this.
_MATMUL_CHUNK_BYTES = 256 << 20


def _type_name(ggml_type: int) -> str:
    try:
        return f"{_Q(ggml_type).name} ({int(ggml_type)})"
    except ValueError:
        return f"unknown ({int(ggml_type)})"


class UnsupportedQuantType(ValueError):
    """Raised for a GGML type id that this module cannot dequantize."""

    def __init__(self, ggml_type: int, what: str = "dequantize"):
        supported = ", ".join(_type_name(t) for t in sorted(SUPPORTED_TYPES))
        super().__init__(
            f"cannot {what} GGML type {_type_name(ggml_type)}; supported types: {supported}"
        )
        self.ggml_type = int(ggml_type)


def _sizes(ggml_type: int) -> tuple[int, int]:
    """(block size in values, bytes per block) from gguf's table."""
    try:
        return GGML_QUANT_SIZES[_Q(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedQuantType(ggml_type, "compute the size of") from None


def aligned_rows(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """x [rows, width] (unit stride along the width), or a copy of it, whose every row starts
    at a multiple of `nbytes`: the decode kernels read x in words of two or four values, which
    must be aligned (a misaligned load faults on a GPU). Whole rows of an allocation already are."""
    if x.data_ptr() % nbytes or (x.shape[0] > 1 and x.stride(0) * x.element_size() % nbytes):
        return x.clone()
    return x


def row_nbytes(ggml_type: int, n: int) -> int:
    """Bytes that ``n`` consecutive values of ``ggml_type`` occupy.

    Works for every type in gguf's size table (not only SUPPORTED_TYPES).
    Raises ValueError when ``n`` is not a whole number of blocks.
    """
    block_size, type_size = _sizes(ggml_type)
    n = int(n)
    if n < 0 or n % block_size:
        raise ValueError(
            f"{_type_name(ggml_type)}: {n} values is not a whole number of "
            f"{block_size}-value blocks"
        )
    return n // block_size * type_size


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes of a GGML tensor of numpy-order ``shape`` (last dim = GGUF ne[0])."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    block_size, _ = _sizes(ggml_type)
    if shape[-1] % block_size:
        raise ValueError(
            f"{_type_name(ggml_type)}: last dimension {shape[-1]} of shape {shape} "
            f"is not a multiple of the block size {block_size}"
        )
    return math.prod(shape[:-1]) * row_nbytes(ggml_type, shape[-1])


def _check_raw(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> tuple[int, ...]:
    if int(ggml_type) not in SUPPORTED_TYPES:
        raise UnsupportedQuantType(ggml_type)
    if not isinstance(raw, torch.Tensor):
        raise ValueError(f"raw must be a torch.Tensor, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw must be a uint8 tensor, got {raw.dtype}")
    if raw.dim() != 1 or not raw.is_contiguous():
        raise ValueError(
            f"raw must be 1-D and contiguous, got shape {tuple(raw.shape)} "
            f"(contiguous={raw.is_contiguous()})"
        )
    shape = tuple(int(s) for s in shape)
    expected = tensor_nbytes(ggml_type, shape)  # also validates the last dim
    if raw.numel() != expected:
        raise ValueError(
            f"{_type_name(ggml_type)} tensor of shape {shape} needs {expected} bytes, "
            f"raw has {raw.numel()}"
        )
    return shape


# --------------------------------------------------------------------------
# Small constant tensors (shift amounts, lookup tables), cached per device.


@functools.cache
def _const(values: tuple, dtype: torch.dtype, device: torch.device, shape: tuple) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).reshape(shape)


def _u8(values: Iterable[int], device: torch.device, shape: tuple) -> torch.Tensor:
    return _const(tuple(values), torch.uint8, device, shape)


# MXFP4 (E2M1) code -> value * 2, as gguf.quants.MXFP4.kvalues / ggml's kvalues_mxfp4.
_MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.cache
def _mxfp4_pair_lut(device: torch.device) -> torch.Tensor:
    """int8 [256, 2]: byte b -> (kvalue of low nibble, kvalue of high nibble)."""
    values = tuple(v for b in range(256) for v in (_MXFP4_KVALUES[b & 15], _MXFP4_KVALUES[b >> 4]))
    return _const(values, torch.int8, device, (256, 2))


# --------------------------------------------------------------------------
# Shared pieces of the torch kernels.


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block, as float32 [n, 1] (exact)."""
    # A fresh copy is contiguous and 2-byte aligned whatever raw's offset was.
    field = blocks[:, offset:offset + 2].clone(memory_format=torch.contiguous_format)
    return field.view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, ..., k] -> [n, ..., 2, k]: low nibbles, then high nibbles."""
    shifts = _u8((0, 4), qs.device, (2, 1))
    return (qs.unsqueeze(-2) >> shifts) & 0x0F


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> [n, 8, k]: bit i of every byte in row i (0 or 1)."""
    shifts = _u8(range(8), packed.device, (8, 1))
    return (packed.unsqueeze(-2) >> shifts) & 1


def _bits_lsb_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> [n, k * 8]: bit j of byte i at position 8 * i + j (a little-endian bitfield)."""
    shifts = _u8(range(8), packed.device, (8,))
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, ..., k] -> [n, ..., 4, k]: 2-bit fields at shifts 0, 2, 4, 6."""
    shifts = _u8((0, 2, 4, 6), qs.device, (4, 1))
    return (qs.unsqueeze(-2) >> shifts) & 3


def _scale_mul(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out = float32(q) * scale, rounded once to out.dtype (one kernel on CUDA)."""
    torch.mul(q, scale, out=out)


def _scale_mul_offset(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                      out: torch.Tensor, subtract: bool) -> None:
    """out = fl32(fl32(scale * q) -/+ offset), as numpy evaluates ``d * q - m``.

    Two separate kernels on purpose: a fused multiply-add would skip the
    float32 rounding of the product and break bit-exactness.
    """
    combine = torch.sub if subtract else torch.add
    if out.dtype == torch.float32:
        torch.mul(q, scale, out=out)
        combine(out, offset, out=out)
    else:
        combine(torch.mul(q, scale), offset, out=out)


# --------------------------------------------------------------------------
# Per-type torch kernels: (blocks uint8 [n, type_size], out [n, block_size]) -> None.
# Field layouts follow ggml's block_* structs (ggml-common.h).


def _deq_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_0: d f16 | qs[16]; value j = lo nibble of qs[j], j + 16 = hi nibble; q - 8.
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)
    # XOR 8 into each nibble makes it the 4-bit two's complement of (nibble - 8);
    # moving it to the top of an int8 and shifting back arithmetically sign-extends it.
    flipped = blocks[:, 2:] ^ 0x88
    q = (flipped.unsqueeze(1) << _u8((4, 0), blocks.device, (2, 1))).view(torch.int8) >> 4
    _scale_mul(q.view(n, 32), d, out)


def _deq_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_1: d f16 | m f16 | qs[16]; value = d * q + m.
    n = blocks.shape[0]
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _nibbles(blocks[:, 4:]).view(n, 32)
    _scale_mul_offset(q, d, m, out, subtract=False)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values 0..31 from qh (32-bit LE bitfield, bit v = value v) and qs nibbles."""
    n = qs.shape[0]
    return _nibbles(qs).view(n, 32) | (_bits_lsb_first(qh) << 4)


def _deq_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_0: d f16 | qh u32 | qs[16]; value = d * (q - 16).
    d = _f16_field(blocks, 0)
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8) - 16
    _scale_mul(q, d, out)


def _deq_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_1: d f16 | m f16 | qh u32 | qs[16]; value = d * q + m.
    d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:])
    _scale_mul_offset(q, d, m, out, subtract=False)


def _deq_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q8_0: d f16 | qs int8[32]; value = qs * d (the strided int8 view is read in place).
    d = _f16_field(blocks, 0)
    _scale_mul(blocks[:, 2:].view(torch.int8), d, out)


def _deq_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q2_K: scales[16] (lo nibble scale, hi nibble min) | qs[64] | d f16 | dmin f16.
    # Value v: sub-block v // 16; qs byte 32 * (v // 128) + v % 32 at shift 2 * (v // 32 % 4).
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16_field(blocks, 80), _f16_field(blocks, 82)
    dl = (d * (scales & 0x0F)).view(n, 16, 1)
    ml = (dmin * (scales >> 4)).view(n, 16, 1)
    q = _crumbs(blocks[:, 16:80].reshape(n, 2, 32)).view(n, 16, 16)
    _scale_mul_offset(q, dl, ml, out.view(n, 16, 16), subtract=True)


def _deq_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q3_K: hmask[32] | qs[64] | scales[12] (16 x 6-bit, signed by -32) | d f16.
    # Value v: low 2 bits as in Q2_K, high bit = bit v // 32 of hmask[v % 32];
    # q = low - 4 when that bit is 0 (ggml stores the inverted bit).
    n = blocks.shape[0]
    d = _f16_field(blocks, 108)
    packed = blocks[:, 96:108]
    low4 = _nibbles(packed[:, :8]).view(n, 16)   # scale i: byte i % 8, nibble i // 8
    high2 = _crumbs(packed[:, 8:]).view(n, 16)   # scale i: byte 8 + i % 4, crumb i // 4
    sc = (low4 | (high2 << 4)).view(torch.int8) - 32
    dl = (d * sc).view(n, 16, 1)
    low = _crumbs(blocks[:, 32:96].reshape(n, 2, 32)).view(n, 8, 32)
    high = _bits(blocks[:, :32])                 # [n, 8, 32]: row = v // 32
    q = (low | (high << 2)).view(torch.int8) - 4
    _scale_mul(q.view(n, 16, 16), dl, out.view(n, 16, 16))


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte field -> (scales, mins), each uint8 [n, 8] of 6-bit values."""
    lo_sc, lo_min, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)), dim=1)
    mn = torch.cat((lo_min & 0x3F, (hi >> 4) | ((lo_min >> 2) & 0x30)), dim=1)
    return sc, mn


def _deq_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_K: d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32:
    # value v at qs byte 32 * (v // 64) + v % 32, nibble (v // 32) % 2; d*sc*q - dmin*m.
    n = blocks.shape[0]
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).view(n, 8, 32)
    _scale_mul_offset(q, (d * sc).view(n, 8, 1), (dmin * mn).view(n, 8, 1),
                      out.view(n, 8, 32), subtract=True)


def _deq_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_K: as Q4_K plus qh[32] before qs; 5th bit of value v = bit v // 32 of qh[v % 32].
    n = blocks.shape[0]
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    q = low | (_bits(blocks[:, 16:48]) << 4)
    _scale_mul_offset(q, (d * sc).view(n, 8, 1), (dmin * mn).view(n, 8, 1),
                      out.view(n, 8, 32), subtract=True)


def _deq_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q6_K: ql[128] | qh[64] | scales int8[16] | d f16; q = (ql nibble | qh crumb << 4) - 32.
    # Value v: ql byte 64 * (v // 128) + v % 64, nibble (v // 64) % 2;
    #          qh byte 32 * (v // 128) + v % 32, crumb (v // 32) % 4; scale v // 16.
    n = blocks.shape[0]
    d = _f16_field(blocks, 208)
    scale = (d * blocks[:, 192:208].view(torch.int8)).view(n, 16, 1)
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).view(n, 8, 32)
    high = _crumbs(blocks[:, 128:192].reshape(n, 2, 32)).view(n, 8, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    _scale_mul(q.view(n, 16, 16), scale, out.view(n, 16, 16))


def _e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> 2**(e - 127) / 2 as float32 bits, like ggml_e8m0_to_fp32_half.

    e < 2 gives the float32 subnormals 2**-128 and 2**-127; e = 255 gives 2**127.
    """
    e = e.to(torch.int32)
    subnormal = torch.full_like(e, 0x00200000) << e  # only used where e < 2
    bits = torch.where(e < 2, subnormal, (e - 1) << 23)
    return bits.view(torch.float32)


def _deq_mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_mxfp4: e (E8M0) | qs[16]; value j = kvalue[lo nibble of qs[j]], j + 16 = hi nibble;
    # times 2**(e-127) / 2 (kvalues are doubled).  Products are exact (powers of two),
    # except where e = 255 overflows to inf, as in the reference.
    n = blocks.shape[0]
    d = _e8m0_to_fp32_half(blocks[:, :1]).view(n, 1, 1)
    # One table lookup per byte yields both of its values; the transpose puts the
    # low nibbles first, and the final multiply reads it strided.
    pairs = torch.index_select(_mxfp4_pair_lut(blocks.device), 0,
                               blocks[:, 1:].reshape(-1).to(torch.int32))
    _scale_mul(pairs.view(n, 16, 2).transpose(1, 2), d, out.view(n, 2, 16))


_TORCH_KERNELS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    int(_Q.Q4_0): _deq_q4_0,
    int(_Q.Q4_1): _deq_q4_1,
    int(_Q.Q5_0): _deq_q5_0,
    int(_Q.Q5_1): _deq_q5_1,
    int(_Q.Q8_0): _deq_q8_0,
    int(_Q.Q2_K): _deq_q2_k,
    int(_Q.Q3_K): _deq_q3_k,
    int(_Q.Q4_K): _deq_q4_k,
    int(_Q.Q5_K): _deq_q5_k,
    int(_Q.Q6_K): _deq_q6_k,
    int(_Q.MXFP4): _deq_mxfp4,
}


def _dequantize_blocks_torch(ggml_type: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Run the torch kernel over ``blocks`` in bounded chunks, writing ``out`` [n, block_size]."""
    kernel = _TORCH_KERNELS[ggml_type]
    n_blocks, block_size = out.shape
    chunk_values = _CHUNK_VALUES_CUDA if out.device.type == "cuda" else _CHUNK_VALUES_CPU
    step = max(1, chunk_values // block_size)
    for start in range(0, n_blocks, step):
        stop = min(n_blocks, start + step)
        kernel(blocks[start:stop], out[start:stop])


# --------------------------------------------------------------------------
# Public API.


# The float GGML types and the torch dtype their bytes are (read in place where x has it).
FLOAT_DTYPES: dict[int, torch.dtype] = {int(_Q.F32): torch.float32, int(_Q.F16): torch.float16,
                                        int(_Q.BF16): torch.bfloat16}
_PLAIN_TYPES = frozenset([*FLOAT_DTYPES, int(_Q.I32)])


# Set when a Triton kernel failed to compile or launch; the torch path is used from then on.
_TRITON_ERROR: Exception | None = None


def _triton_enabled(device: torch.device) -> bool:
    return (
        triton is not None
        and _TRITON_ERROR is None
        and device.type == "cuda"
        and os.environ.get("EXPERTDESK_DEQUANT_TRITON", "1") != "0"
    )


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize GGML bytes into a tensor.

    raw: 1-D contiguous uint8 tensor (CPU or CUDA) holding the GGML bytes of a
    tensor whose numpy-order shape is ``shape`` (last dim = fastest = GGUF ne[0]).
    Returns a new tensor of ``shape`` in ``dtype`` on raw's device, equal to
    ``gguf.quants.dequantize`` (float32) rounded once to ``dtype``.  I32 is a
    passthrough that returns int32 values and ignores ``dtype``.

    Raises UnsupportedQuantType for types outside SUPPORTED_TYPES and
    ValueError for a bad ``raw`` (dtype, layout, byte count) or ``shape``.
    """
    ggml_type = int(ggml_type)
    shape = _check_raw(raw, ggml_type, shape)
    if ggml_type in _PLAIN_TYPES and raw.storage_offset() % _sizes(ggml_type)[1]:
        raw = raw.clone()  # a wider dtype view needs an aligned start
    if ggml_type == _Q.I32:
        return raw.view(torch.int32).reshape(shape).clone()
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    if ggml_type in FLOAT_DTYPES:
        source = raw.view(FLOAT_DTYPES[ggml_type])
    else:
        block_size, type_size = _sizes(ggml_type)
        blocks = raw.view(-1, type_size)
        out = torch.empty((blocks.shape[0], block_size), dtype=dtype, device=raw.device)
        if out.numel():
            if _triton_enabled(raw.device) and dtype in _TRITON_OUT_DTYPES:
                _dequantize_blocks_triton_or_torch(ggml_type, blocks, out)
            else:
                _dequantize_blocks_torch(ggml_type, blocks, out)
        return out.view(shape)
    # Plain float formats: a widening/narrowing cast; never alias the caller's buffer.
    return source.to(dtype, copy=True).view(shape)


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
                 *, chunk_bytes: int | None = None) -> torch.Tensor:
    """Return ``x @ W.T`` for W of numpy shape (out_features, in_features) stored as GGML bytes.

    Computes in ``x.dtype``; the dequantized W exists only during the call.
    When W would exceed ``chunk_bytes`` (default 256 MiB) as float32, it is
    dequantized and multiplied in row chunks, so extra memory stays bounded.
    """
    if len(shape) != 2:
        raise ValueError(f"quant_matmul needs a 2-D weight shape, got {tuple(shape)}")
    out_features, in_features = (int(s) for s in shape)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, W has {in_features} input features")
    if x.device != raw.device:
        raise ValueError(f"x is on {x.device} but raw is on {raw.device}")
    _check_raw(raw, ggml_type, (out_features, in_features))
    budget = _MATMUL_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    rows_per_chunk = max(1, budget // max(1, in_features * 4))
    if rows_per_chunk >= out_features:
        return x @ dequantize(raw, ggml_type, (out_features, in_features), x.dtype).T
    bytes_per_row = row_nbytes(ggml_type, in_features)
    result = x.new_empty((*x.shape[:-1], out_features))
    for start in range(0, out_features, rows_per_chunk):
        stop = min(out_features, start + rows_per_chunk)
        w = dequantize(raw[start * bytes_per_row:stop * bytes_per_row], ggml_type,
                       (stop - start, in_features), x.dtype)
        result[..., start:stop] = x @ w.T
        del w  # free before the next chunk is dequantized
    return result


# --------------------------------------------------------------------------
# Optional Triton path (CUDA only).  One launch per tensor reads the packed
# bytes once and writes the output once.  The float math is the same sequence
# of float32 roundings as the torch path; fused multiply-add is turned off at
# launch (enable_fp_fusion=False) so ``d * q - m`` rounds the product first.
#
# The kernels are limited by instruction throughput, not memory, unless the
# per-value work is a handful of integer ops, so:
# - small ints become floats through the 2**23 mantissa trick (_int_to_f32),
#   not the quarter-rate int-to-float instruction;
# - the 256-value K-quant blocks are expanded in 32-value steps of a static
#   loop: each packed byte is loaded once and reused for every value it holds,
#   shift amounts are compile-time constants, and scales are computed once
#   per sub-block and broadcast.

_TRITON_OUT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_TRITON_VALUES_PER_PROGRAM = 4096
_TRITON_NUM_WARPS = 4

if triton is not None:

    @triton.jit
    def _x_halves(word, ptr):
        """The two x values packed in `word`, as float32, low half first (little-endian): a
        64-bit word of two float32, or a 32-bit word of two bfloat16 / float16 values (`ptr`:
        a pointer into x, which gives its element type). Exact: a widening or a bitcast."""
        if ptr.dtype.element_ty == tl.float32:
            return (word.to(tl.int32).to(tl.float32, bitcast=True),
                    (word >> 32).to(tl.int32).to(tl.float32, bitcast=True))
        if ptr.dtype.element_ty == tl.bfloat16:  # a bfloat16 is the top half of its float32
            return (word << 16).to(tl.float32, bitcast=True), (word & -65536).to(tl.float32, bitcast=True)
        return (word.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
                (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))

    @triton.jit
    def _ld_u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _ld_f16(ptr, mask):
        """Little-endian fp16 at ptr, as float32 (exact)."""
        bits = _ld_u8(ptr, mask) | (_ld_u8(ptr + 1, mask) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _int_to_f32(u, bias: tl.constexpr):
        """float32(u - bias) for 0 <= u < 2**23, exactly.

        2**23 + u is the float32 whose mantissa holds u, and subtracting
        2**23 + bias from it is exact (it even gives +0.0 for u == bias, as a
        conversion would).
        """
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _cast_out(y, dst):
        """y in dst's element type, rounded to nearest even like torch's casts."""
        if dst.dtype.element_ty != tl.float32:
            y = y.to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
        return y

    @triton.jit
    def _block_rows(src, first, b, n_blocks, TYPE_SIZE: tl.constexpr, rows, blocks_per_row, row_stride,
                    GATHER: tl.constexpr):
        """(pointers to the source blocks first + b, the mask of those that exist). GATHER:
        output block g is block g % blocks_per_row of table row rows[g // blocks_per_row]
        (row_stride bytes apart); else block g of src itself."""
        g = first + b
        ok = g < n_blocks
        if GATHER:
            r = g // blocks_per_row
            picked = tl.load(rows + r, mask=ok, other=0).to(tl.int64)
            return src + picked * row_stride + (g - r * blocks_per_row) * TYPE_SIZE, ok
        return src + g * TYPE_SIZE, ok

    @triton.jit
    def _dequant_32_kernel(src, dst, n_blocks, rows, blocks_per_row, row_stride, QTYPE: tl.constexpr,
                           TYPE_SIZE: tl.constexpr, N_SUB: tl.constexpr, BLOCKS: tl.constexpr,
                           GATHER: tl.constexpr):
        """32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), laid out [block b, half s, byte l].

        Value v = s * SUB_LEN + l: for the 4-bit types s picks the nibble of byte l.
        """
        SUB_LEN: tl.constexpr = 32 // N_SUB
        first = tl.program_id(0).to(tl.int64) * BLOCKS
        dst = dst + first * 32
        b = tl.arange(0, BLOCKS)[:, None, None]
        s = tl.arange(0, N_SUB)[None, :, None]
        l = tl.arange(0, SUB_LEN)[None, None, :]
        row, row_mask = _block_rows(src, first, b, n_blocks, TYPE_SIZE, rows, blocks_per_row, row_stride, GATHER)
        mask = row_mask & (s < N_SUB) & (l < SUB_LEN)
        if QTYPE == 2:  # Q4_0: d * (q - 8)
            d = _ld_f16(row, row_mask)
            q = (_ld_u8(row + 2 + l, mask) >> (s * 4)) & 15
            y = d * _int_to_f32(q, 8)
        elif QTYPE == 3:  # Q4_1: d * q + m
            d = _ld_f16(row, row_mask)
            m = _ld_f16(row + 2, row_mask)
            q = (_ld_u8(row + 4 + l, mask) >> (s * 4)) & 15
            y = d * _int_to_f32(q, 0) + m
        elif QTYPE == 6:  # Q5_0: d * (q - 16); 5th bit of value v is bit v of the u32 qh
            d = _ld_f16(row, row_mask)
            h = (_ld_u8(row + 2 + s * 2 + l // 8, mask) >> (l % 8)) & 1
            q = ((_ld_u8(row + 6 + l, mask) >> (s * 4)) & 15) | (h << 4)
            y = d * _int_to_f32(q, 16)
        elif QTYPE == 7:  # Q5_1: d * q + m
            d = _ld_f16(row, row_mask)
            m = _ld_f16(row + 2, row_mask)
            h = (_ld_u8(row + 4 + s * 2 + l // 8, mask) >> (l % 8)) & 1
            q = ((_ld_u8(row + 8 + l, mask) >> (s * 4)) & 15) | (h << 4)
            y = d * _int_to_f32(q, 0) + m
        else:  # Q8_0 (8): int8 * d
            d = _ld_f16(row, row_mask)
            q = _ld_u8(row + 2 + l, mask) ^ 0x80  # the int8 plus 128
            y = _int_to_f32(q, 128) * d
        tl.store(dst + b * 32 + s * SUB_LEN + l, _cast_out(y, dst), mask=mask)

    @triton.jit
    def _k4_scale_min(row, k: tl.constexpr, mask):
        """The 6-bit scale and min of sub-block k of the Q4_K / Q5_K blocks at `row`
        (Q4_K.get_scale_min): (sc, mn) as int32."""
        if k < 4:
            sc = _ld_u8(row + 4 + k, mask) & 63
            mn = _ld_u8(row + 8 + k, mask) & 63
        else:
            packed = _ld_u8(row + 12 + (k - 4), mask)
            sc = (packed & 15) | ((_ld_u8(row + 4 + (k - 4), mask) >> 2) & 48)
            mn = (packed >> 4) | ((_ld_u8(row + 8 + (k - 4), mask) >> 2) & 48)
        return sc, mn

    @triton.jit
    def _dequant_k_kernel(src, dst, n_blocks, rows, blocks_per_row, row_stride, QTYPE: tl.constexpr,
                          TYPE_SIZE: tl.constexpr, BLOCKS: tl.constexpr, GATHER: tl.constexpr):
        """256-value K-quant blocks, expanded in 8 steps of 32 values.

        Step k writes values v = 32 * k + 16 * h + l, h in {0, 1}, l in 0..15;
        the 16-value halves h are the Q2_K/Q3_K/Q6_K sub-blocks 2k + h.
        """
        first = tl.program_id(0).to(tl.int64) * BLOCKS
        dst = dst + first * 256
        b = tl.arange(0, BLOCKS)[:, None, None]
        h = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 16)[None, None, :]
        hl = h * 16 + l  # position within a 32-byte run of packed bits
        row, row_mask = _block_rows(src, first, b, n_blocks, TYPE_SIZE, rows, blocks_per_row, row_stride, GATHER)
        mask = row_mask & (hl < 32)
        out = dst + b * 256 + hl
        if QTYPE == 10:  # Q2_K: scales[16] | qs[64] | d | dmin; (d * sc) * q - dmin * m
            d = _ld_f16(row + 80, row_mask)
            dmin = _ld_f16(row + 82, row_mask)
            for c in tl.static_range(2):
                qs = _ld_u8(row + 16 + 32 * c + hl, mask)  # 2 bits of values 128c + 32j + hl
                for j in tl.static_range(4):
                    k = 4 * c + j
                    sc = _ld_u8(row + 2 * k + h, row_mask)
                    dl = d * _int_to_f32(sc & 15, 0)
                    ml = dmin * _int_to_f32(sc >> 4, 0)
                    y = dl * _int_to_f32((qs >> (2 * j)) & 3, 0) - ml
                    tl.store(out + 32 * k, _cast_out(y, dst), mask=mask)
        elif QTYPE == 11:  # Q3_K: hmask[32] | qs[64] | scales[12] | d; (d * (sc - 32)) * q
            d = _ld_f16(row + 108, row_mask)
            hmask = _ld_u8(row + hl, mask)  # bit k: 3rd bit of value 32k + hl
            for c in tl.static_range(2):
                qs = _ld_u8(row + 32 + 32 * c + hl, mask)
                for j in tl.static_range(4):
                    k = 4 * c + j
                    # 6-bit scale of sub-block 2k + h: low nibble from byte
                    # 96 + (2k + h) % 8, high 2 bits from byte 104 + (2k + h) % 4.
                    low4 = (_ld_u8(row + 96 + (2 * k) % 8 + h, row_mask) >> (k // 4 * 4)) & 15
                    high2 = (_ld_u8(row + 104 + (2 * k) % 4 + h, row_mask) >> (k // 2 * 2)) & 3
                    dl = d * _int_to_f32(low4 | (high2 << 4), 32)
                    # q = low 2 bits - 4 where the hmask bit is 0, i.e. (low | bit << 2) - 4.
                    u = ((qs >> (2 * j)) & 3) | (((hmask >> k) & 1) << 2)
                    y = dl * _int_to_f32(u, 4)
                    tl.store(out + 32 * k, _cast_out(y, dst), mask=mask)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: (d * sc) * q - dmin * m, sub-block k
            d = _ld_f16(row, row_mask)
            dmin = _ld_f16(row + 2, row_mask)
            if QTYPE == 13:
                qh = _ld_u8(row + 16 + hl, mask)  # bit k: 5th bit of value 32k + hl
            for p in tl.static_range(4):
                if QTYPE == 12:
                    qs = _ld_u8(row + 16 + 32 * p + hl, mask)  # nibbles of sub-blocks 2p, 2p + 1
                else:
                    qs = _ld_u8(row + 48 + 32 * p + hl, mask)
                for n in tl.static_range(2):
                    k = 2 * p + n
                    sc, mn = _k4_scale_min(row, k, row_mask)
                    q = (qs >> (4 * n)) & 15
                    if QTYPE == 13:
                        q = q | (((qh >> k) & 1) << 4)
                    y = (d * _int_to_f32(sc, 0)) * _int_to_f32(q, 0) - dmin * _int_to_f32(mn, 0)
                    tl.store(out + 32 * k, _cast_out(y, dst), mask=mask)
        else:  # Q6_K (14): ql[128] | qh[64] | scales int8[16] | d; (d * sc) * (q - 32)
            d = _ld_f16(row + 208, row_mask)
            for c in tl.static_range(2):
                ql_even = _ld_u8(row + 64 * c + hl, mask)       # values 128c + 32j + hl, j = 0, 2
                ql_odd = _ld_u8(row + 64 * c + 32 + hl, mask)   # j = 1, 3
                qh = _ld_u8(row + 128 + 32 * c + hl, mask)      # crumb j
                for j in tl.static_range(4):
                    k = 4 * c + j
                    sc = tl.load(row + 192 + 2 * k + h, mask=row_mask, other=0).to(tl.int8, bitcast=True)
                    dl = d * _int_to_f32(sc.to(tl.int32) + 128, 128)
                    if j % 2 == 0:
                        low = (ql_even >> (4 * (j // 2))) & 15
                    else:
                        low = (ql_odd >> (4 * (j // 2))) & 15
                    y = dl * _int_to_f32(low | (((qh >> (2 * j)) & 3) << 4), 32)
                    tl.store(out + 32 * k, _cast_out(y, dst), mask=mask)

    @triton.jit
    def _dequant_mxfp4_kernel(src, dst, n_blocks, rows, blocks_per_row, row_stride, BLOCKS: tl.constexpr,
                              GATHER: tl.constexpr):
        """MXFP4: e | qs[16]; value j = kvalue[lo nibble of qs[j]] * d, j + 16 the hi nibble."""
        first = tl.program_id(0).to(tl.int64) * BLOCKS
        dst = dst + first * 32
        b = tl.arange(0, BLOCKS)[:, None]
        l = tl.arange(0, 16)[None, :]
        row, row_mask = _block_rows(src, first, b, n_blocks, 17, rows, blocks_per_row, row_stride, GATHER)
        mask = row_mask & (l < 16)
        e = _ld_u8(row, row_mask)
        # ggml_e8m0_to_fp32_half; the shift is clamped so the unused branch stays defined.
        d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        qs = _ld_u8(row + 1 + l, mask)
        for n in tl.static_range(2):
            code = (qs >> (4 * n)) & 15
            # Doubled E2M1 magnitudes 0,1,2,3,4,6,8,12 as the nibbles of 0xC8643210
            # (written as a negative int32 literal; the & 15 drops the sign fill).
            mag = (-932957680 >> ((code & 7) * 4)) & 15
            y = d * _int_to_f32(tl.where(code >= 8, 12 - mag, 12 + mag), 12)
            tl.store(dst + b * 32 + 16 * n + l, _cast_out(y, dst), mask=mask)


def _dequantize_blocks_triton_or_torch(ggml_type: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """The Triton kernel; if it cannot compile or launch here, warn once and use torch."""
    if not _triton_launched(blocks.device, lambda: _dequantize_blocks_triton(ggml_type, blocks, out)):
        _dequantize_blocks_torch(ggml_type, blocks, out)


def _triton_launched(device: torch.device, launch: Callable[[], None]) -> bool:
    """Run a Triton launch on `device`; False, after warning once and turning the Triton
    path off for good, if it cannot compile or launch (e.g. no usable compiler for this GPU)."""
    global _TRITON_ERROR
    try:
        with torch.cuda.device(device):  # Triton launches on the current device
            launch()
    except Exception as exc:
        _TRITON_ERROR = exc
        warnings.warn(f"Triton dequantization unavailable ({exc!r}); using the slower torch path",
                      RuntimeWarning, stacklevel=4)
        return False
    return True


def _dequantize_blocks_triton(ggml_type: int, blocks: torch.Tensor, out: torch.Tensor,
                              picked: tuple[torch.Tensor, int, int] | None = None) -> None:
    """Triton kernel over all ``blocks`` into ``out`` [n, block_size] (float32/16, bfloat16).

    ``picked`` = (rows, blocks_per_row, row_stride): ``blocks`` is then a table whose row i
    starts row_stride bytes after row i - 1, and output block g is block
    g % blocks_per_row of row rows[g // blocks_per_row] (read in place, no gathered copy)."""
    n_blocks, block_size = out.shape
    blocks_per_program = max(1, _TRITON_VALUES_PER_PROGRAM // block_size)
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    options = dict(num_warps=_TRITON_NUM_WARPS, enable_fp_fusion=False)
    rows, blocks_per_row, row_stride = picked if picked is not None else (blocks, 1, 0)
    where = dict(rows=rows, blocks_per_row=blocks_per_row, row_stride=row_stride, GATHER=picked is not None)
    type_size = _sizes(ggml_type)[1]
    if ggml_type == _Q.MXFP4:
        _dequant_mxfp4_kernel[grid](blocks, out, n_blocks, BLOCKS=blocks_per_program, **where, **options)
    elif block_size == 256:
        _dequant_k_kernel[grid](blocks, out, n_blocks, QTYPE=ggml_type, TYPE_SIZE=type_size,
                                BLOCKS=blocks_per_program, **where, **options)
    else:
        _dequant_32_kernel[grid](blocks, out, n_blocks, QTYPE=ggml_type, TYPE_SIZE=type_size,
                                 N_SUB=1 if ggml_type == _Q.Q8_0 else 2,
                                 BLOCKS=blocks_per_program, **where, **options)


def dequantize_rows(table: torch.Tensor, rows: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` (device integers [n]) of `table` dequantized: [n, *shape] in `dtype`.

    Row i of `table` (uint8 [N, bytes of `shape`]; a strided view is fine, e.g. one role
    of a model's stacked expert tensors) holds one tensor of numpy shape `shape` in GGML
    type `ggml_type`. With the Triton kernels (CUDA) one launch reads the picked rows
    where they are; elsewhere (and for the plain float types) the rows are gathered (one
    copy), then dequantized. Both give `dequantize`'s values. The ids are not
    range-checked here (the callers check them)."""
    ggml_type = int(ggml_type)
    n = rows.numel()
    if (ggml_type not in _PLAIN_TYPES and n and table.dim() == 2 and table.dtype == torch.uint8
            and table.stride(1) == 1 and table.shape[1] == tensor_nbytes(ggml_type, shape)
            and _triton_enabled(table.device) and dtype in _TRITON_OUT_DTYPES):
        block_size, type_size = _sizes(ggml_type)
        out = torch.empty((n * (table.shape[1] // type_size), block_size), dtype=dtype, device=table.device)
        picked = (rows.to(torch.int64).contiguous(), table.shape[1] // type_size, table.stride(0))
        if _triton_launched(table.device, lambda: _dequantize_blocks_triton(ggml_type, table, out, picked)):
            return out.view(n, *shape)
    return dequantize_gathered(table, rows, ggml_type, shape, dtype)


def dequantize_gathered(table: torch.Tensor, rows: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
                        dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_rows` by copying the rows out first (one gather), then `dequantize`: its
    path where the rows cannot be read in place."""
    n = rows.numel()
    if table.shape[1] % 8 == 0 and table.stride(1) == 1 and table.stride(0) % 8 == 0 \
            and table.storage_offset() % 8 == 0:
        table = table.view(torch.int64)  # 8 bytes per element: a far faster gather than uint8
    gathered = torch.index_select(table, 0, rows).view(torch.uint8)
    return dequantize(gathered.reshape(-1), ggml_type, (n, *shape), dtype)
