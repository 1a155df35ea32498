"""A decode step's activations as 16-bit integers in groups of 16, for integer dot products.

The Q2_K / Q3_K GEMVs with float32 math spend 7.7-7.8 instructions per weight value
(benchmarks/kernel_sass.py) and run near 1 TB/s of an H200's 4.8. Integer dot products take
a weight's packed bytes as they lie: PTX `dp2a` multiplies two 16-bit integers by two bytes
and adds them to a 32-bit sum in one instruction, so a word of 4 Q2_K values costs a mask
and two dp2a (3.9-4.5 instructions per value in all; the loop is then bound by its loads,
benchmarks/RESULTS.md). That needs x as integers: `quantize` writes, for each row of x and
each group of 16 consecutive values,

    q[i] = round(x[i] / s)  (int16, half to even),   s = 2**(e - 14),

where 2**e <= max |x| over the group < 2**(e + 1), so |q| < 2**15 (a float32 largest |x|
that would round to 2**15 takes s = 2**(e - 13) instead), and beside it the group's
(s, s * sum q) as two float32 (the K-quants' offsets and minimums multiply sums of x). A
value within 2**7 of its group's largest is exact for bfloat16 x (8 significant bits:
x / s is an integer), any other is off by at most s / 2 = 2**-15 * 2**e (float32 or float16
x likewise at most s / 2). The dot products then differ from float32 math on x by at most
sum |w_i| * s_i / 2 (the tests' bound), against bf16's own rounding of the result
(2**-9 of it). The int32 sums are exact (a sub-block's 16 products of |q| <= 2**15 and
bytes under 2**8 stay under 2**31); each is made a float32 once (a rounding of 2**-24 of
it, inside float32 summation's bound) and scaled in float32. Only the reduced-precision
decode (x in bfloat16 or float16) takes this path; a float32 decode keeps `quant_gemv`'s
float32 math.

A group holding inf or NaN gets s = NaN, so the products that read it are NaN (the float
path gives inf or NaN); |x| must stay under 2**120 (s * sum q overflows beyond).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None
    tl = None

__all__ = ["GROUP", "X16", "quantize"]

GROUP = 16
_BLOCK_GROUPS = 64  # groups of a program: 1,024 values


@dataclass(frozen=True)
class X16:
    """x [rows, width] as `quantize` writes it: q int16 [rows, width] and groups float32
    [rows, width / 16, 2] holding each group's (s, s * sum q)."""

    q: torch.Tensor
    groups: torch.Tensor


def quantize(x: torch.Tensor) -> X16:
    """x [rows, width] (width a multiple of 16, unit stride) as 16-bit integers per group
    (module docstring); one launch, no host sync. CUDA, or Triton's interpreter on CPU."""
    rows, width = x.shape
    if width % GROUP or x.stride(1) != 1:
        raise ValueError(f"quantize takes rows of a multiple of {GROUP} values with unit stride")
    if triton is None:
        raise RuntimeError("triton is not installed")
    q = torch.empty((rows, width), dtype=torch.int16, device=x.device)
    groups = torch.empty((rows, width // GROUP, 2), dtype=torch.float32, device=x.device)
    if rows:
        n_groups = width // GROUP
        _quantize_kernel[(rows, triton.cdiv(n_groups, _BLOCK_GROUPS))](
            x, x.stride(0), q, groups, n_groups, BLOCK_GROUPS=_BLOCK_GROUPS, num_warps=4)
    return X16(q, groups)


if triton is not None:

    @triton.jit
    def _rounded(y):
        """y rounded to an integer, half to even, for |y| < 2**22 (adding and taking away
        1.5 * 2**23 leaves no fraction bits)."""
        return (y + 12582912.0) - 12582912.0

    @triton.jit
    def _quantize_kernel(x, x_stride, q, groups, n_groups, BLOCK_GROUPS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        gs = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
        g = gs[:, None]
        i = tl.arange(0, 16)[None, :]
        ok = g < n_groups
        offs = g * 16 + i
        v = tl.load(x + r * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        # b: the biased exponent of the largest |x| (2**(b - 127) <= it); 1 / s = 2**(141 - b)
        # (biased exponent e_inv = 268 - b), clamped so that s and 1 / s are normal float32 (a
        # group whose largest |x| is under 2**-112 gets s = 2**-126: q at most 2**14, its
        # error under 2**-127)
        b = (amax.to(tl.int32, bitcast=True) >> 23) & 255
        e_inv = tl.minimum(tl.maximum(268 - b, 1), 253)
        # a float32 largest |x| within half a step of 2**(b - 126) would round to 2**15, out
        # of int16: that group takes the next coarser s (a bf16 or f16 one never does: 8 or
        # 11 significant bits put it at most 2**15 - 2**7 or 2**15 - 2**4 steps from 0)
        e_inv -= (_rounded(amax * (e_inv << 23).to(tl.float32, bitcast=True)) >= 32768.0).to(tl.int32)
        inv = (e_inv << 23).to(tl.float32, bitcast=True)
        y = v * inv[:, None]  # exact (a power of two, no underflow: |y| >= 2**-126 or 0)
        iy = _rounded(y).to(tl.int32)
        tl.store(q + r * (n_groups * 16) + offs, iy.to(tl.int16), mask=ok)
        # s = 1 / (1 / s), exactly (both powers of two); NaN for a group holding inf or NaN
        # (0 * x is NaN there, 0 elsewhere), so that its products come out NaN, not finite
        s = ((254 - e_inv) << 23).to(tl.float32, bitcast=True) + tl.sum(v * 0.0, axis=1)
        total = tl.sum(iy, axis=1).to(tl.float32)  # |sum| <= 16 * 32767 < 2**19: exact, and s * it
        gp = groups + r * (n_groups * 2) + gs * 2
        tl.store(gp, s, mask=gs < n_groups)
        tl.store(gp + 1, s * total, mask=gs < n_groups)
