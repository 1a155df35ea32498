"""Tests for engine.kernels.dequant against gguf.quants (the numpy reference).

Every dequantization comparison is bit-exact: the torch kernels (and the
optional Triton kernels on CUDA) evaluate the same float32 operations in the
same order as gguf.quants, so no tolerance is needed.  Outputs in
float16/bfloat16 must equal the float32 reference rounded once with torch's cast.

quant_matmul is the exception: its dequantized W is exact, but the matmul that
follows is a BLAS call whose summation order depends on the shapes (row chunks),
the CPU's kernels and the buffers' alignment.  It is checked against the
rounding-error bound of a float32 dot product (see ``assert_within_dot_bound``),
and in float64, where the same bound is ~1e-13 relative.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kernels import (
    SUPPORTED_TYPES,
    UnsupportedQuantType,
    dequantize,
    quant_matmul,
    row_nbytes,
    tensor_nbytes,
)
from engine.kernels import dequant as dequant_module
from quant_experts import F16_FIELDS

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

FLOAT_TYPES = (int(Q.F32), int(Q.F16), int(Q.BF16))
QUANT_TYPES = tuple(sorted(t for t in SUPPORTED_TYPES if t not in FLOAT_TYPES and t != Q.I32))
VALUE_TYPES = tuple(sorted(t for t in SUPPORTED_TYPES if t != Q.I32))

# Finite fp16 scales covering the extremes: zeros of both signs, the smallest
# subnormal, a mid subnormal, the smallest normal, the largest finite value,
# negatives, and ordinary magnitudes.
EXTREME_F16 = np.array(
    [0.0, -0.0, 2.0**-24, -(2.0**-24), 3 * 2.0**-20, 2.0**-14, 65504.0, -65504.0,
     1.0, -1.0, 0.5, 1e-3, -7.25, 1234.0, 3.0e4],
    dtype=np.float16,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TRITON_ON_CUDA = torch.cuda.is_available() and dequant_module.triton is not None


def name(ggml_type: int) -> str:
    return Q(ggml_type).name


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGML blocks [n_blocks, type_size] with finite, varied fp16 scale fields."""
    _, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(Q(ggml_type), ()):
        magnitudes = np.exp2(rng.uniform(-24, 15.9, n_blocks)) * rng.choice([-1.0, 1.0], n_blocks)
        scales = magnitudes.astype(np.float16)
        scales[: len(EXTREME_F16)] = EXTREME_F16[: n_blocks]
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == Q.MXFP4:
        blocks[:, 0] = np.arange(n_blocks) % 256  # every E8M0 exponent, 0 and 255 included
    return blocks


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 reference: numpy views for the float formats, gguf.quants for the rest."""
    if ggml_type == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if ggml_type == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    rows = raw.reshape(-1, row_nbytes(ggml_type, shape[-1]))
    with np.errstate(over="ignore"):  # MXFP4 with e = 255 overflows to inf, as in ggml
        return quants.dequantize(rows, Q(ggml_type)).reshape(shape)


def assert_matches(got: torch.Tensor, want_f32: np.ndarray, dtype: torch.dtype) -> None:
    """got (any device) equals the float32 reference rounded once to dtype; NaN == NaN."""
    assert got.dtype == dtype
    assert tuple(got.shape) == want_f32.shape
    want = torch.from_numpy(np.ascontiguousarray(want_f32)).to(dtype)
    # Upcasting to float32 is exact for float16/bfloat16, so this is a bitwise test
    # except for NaN payloads, which only the float formats' random bytes produce.
    got_np = got.cpu().to(torch.float32).numpy()
    want_np = want.to(torch.float32).numpy()
    if not np.array_equal(got_np, want_np, equal_nan=True):
        bad = np.flatnonzero(~((got_np == want_np) | (np.isnan(got_np) & np.isnan(want_np))))
        i = bad[0]
        raise AssertionError(
            f"{bad.size} of {got_np.size} values differ; first at flat index {i}: "
            f"got {got_np.flat[i]!r}, want {want_np.flat[i]!r}"
        )
    # Signed zeros must match too (array_equal treats -0.0 == 0.0); NaN signs may differ.
    numbers = ~np.isnan(want_np)
    assert np.array_equal(np.signbit(got_np[numbers]), np.signbit(want_np[numbers]))


@pytest.fixture(params=["torch", "triton"])
def cuda_backend(request, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if request.param == "triton" and not TRITON_ON_CUDA:
        pytest.skip("Triton not available")
    monkeypatch.setenv("EXPERTDESK_DEQUANT_TRITON", "1" if request.param == "triton" else "0")
    yield request.param
    # The Triton path falls back to torch on a compile error; that must not hide here.
    assert dequant_module._TRITON_ERROR is None


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("ggml_type", VALUE_TYPES, ids=name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference_cpu(ggml_type, dtype):
    rng = np.random.default_rng(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    if block_size == 1:  # plain floats: random bytes, NaNs and infs included
        raw = rng.integers(0, 256, 4 * 1024 * 3, dtype=np.uint8)
        shape = (3, raw.size // 3 // type_size)
    else:
        n_blocks = 512
        raw = random_blocks(ggml_type, n_blocks, rng).reshape(-1)
        shape = (8, n_blocks * block_size // 8)
    got = dequantize(torch.from_numpy(raw), ggml_type, shape, dtype)
    assert_matches(got, reference(raw, ggml_type, shape), dtype)


@pytest.mark.parametrize("ggml_type", VALUE_TYPES, ids=name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference_cuda(ggml_type, dtype, cuda_backend):
    rng = np.random.default_rng(1000 + ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    if block_size == 1:
        raw = rng.integers(0, 256, 4 * 4096, dtype=np.uint8)
        shape = (4, raw.size // 4 // type_size)
    else:
        n_blocks = 4096 + 3  # not a multiple of any Triton program size
        raw = random_blocks(ggml_type, n_blocks, rng).reshape(-1)
        shape = (n_blocks, block_size)
    got = dequantize(torch.from_numpy(raw).cuda(), ggml_type, shape, dtype)
    assert got.device.type == "cuda"
    assert_matches(got, reference(raw, ggml_type, shape), dtype)


@st.composite
def block_bytes(draw, ggml_type: int):
    """A few blocks of arbitrary bytes, with arbitrary finite fp16 scales."""
    _, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    n_blocks = draw(st.integers(1, 3))
    blocks = np.frombuffer(draw(st.binary(min_size=n_blocks * type_size,
                                          max_size=n_blocks * type_size)),
                           dtype=np.uint8).reshape(n_blocks, type_size).copy()
    # Finite fp16 bit patterns: any sign, magnitude bits up to 0x7BFF (65504), so
    # zeros, subnormals and the largest values all occur, with no filtering.
    finite_f16_bits = st.builds(lambda sign, magnitude: sign << 15 | magnitude,
                                st.integers(0, 1), st.integers(0, 0x7BFF))
    for offset in F16_FIELDS.get(Q(ggml_type), ()):
        bits = draw(st.lists(finite_f16_bits, min_size=n_blocks, max_size=n_blocks))
        blocks[:, offset:offset + 2] = np.array(bits, dtype="<u2").view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=name)
def test_matches_reference_hypothesis(ggml_type):
    block_size, _ = GGML_QUANT_SIZES[Q(ggml_type)]

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(block_bytes(ggml_type))
    def check(blocks):
        raw = blocks.reshape(-1)
        shape = (blocks.shape[0] * block_size,)
        got = dequantize(torch.from_numpy(raw), ggml_type, shape)
        assert_matches(got, reference(raw, ggml_type, shape), torch.float32)

    check()


def test_mxfp4_exponent_extremes():
    # One block per exponent with codes 0..15 (low nibbles) and 15..0 (high nibbles).
    codes = np.arange(16, dtype=np.uint8)
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = codes | (codes[::-1] << 4)
    raw = blocks.reshape(-1)
    got = dequantize(torch.from_numpy(raw), Q.MXFP4, (256, 32))
    want = reference(raw, Q.MXFP4, (256, 32))
    assert_matches(got, want, torch.float32)
    assert want[0, 1] == 2.0**-128  # e = 0: code 1 (= 0.5) * 2**-127, a float32 subnormal
    assert np.isinf(want[255, 7])  # e = 255: code 7 (= 6) * 2**128 overflows
    assert want[127, :16].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]


def test_dequantize_chunks_agree(monkeypatch):
    # The torch path splits big tensors into passes; make the passes tiny.
    rng = np.random.default_rng(7)
    raw = random_blocks(Q.Q4_K, 37, rng).reshape(-1)
    shape = (37, 256)
    monkeypatch.setattr(dequant_module, "_CHUNK_VALUES_CPU", 3 * 256)
    got = dequantize(torch.from_numpy(raw), Q.Q4_K, shape)
    assert_matches(got, reference(raw, Q.Q4_K, shape), torch.float32)


# ---------------------------------------------------------------- shapes and errors


@pytest.mark.parametrize("ggml_type,shape", [
    (Q.Q8_0, (3, 2, 64)),
    (Q.Q4_K, (2, 3, 512)),
    (Q.MXFP4, (2, 2, 2, 32)),
    (Q.F16, (5, 7)),
    (Q.Q6_K, (256,)),
], ids=lambda v: str(v) if isinstance(v, tuple) else name(v))
def test_multidim_shapes(ggml_type, shape):
    rng = np.random.default_rng(3)
    block_size, _ = GGML_QUANT_SIZES[Q(ggml_type)]
    n_blocks = int(np.prod(shape)) // block_size
    raw = (random_blocks(ggml_type, n_blocks, rng).reshape(-1) if block_size > 1
           else rng.integers(0, 256, tensor_nbytes(ggml_type, shape), dtype=np.uint8))
    got = dequantize(torch.from_numpy(raw), ggml_type, shape)
    assert got.shape == shape
    assert_matches(got, reference(raw, ggml_type, shape), torch.float32)


def test_sizes_follow_gguf_table():
    for ggml_type in SUPPORTED_TYPES:
        block_size, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
        assert row_nbytes(ggml_type, 4 * block_size) == 4 * type_size
        assert tensor_nbytes(ggml_type, (3, 2, 4 * block_size)) == 24 * type_size
    assert row_nbytes(Q.Q4_K, 0) == 0
    with pytest.raises(ValueError, match="block"):
        row_nbytes(Q.Q4_K, 100)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        tensor_nbytes(Q.Q4_K, (2, 100))


def test_non_divisible_last_dim_raises():
    raw = torch.zeros(144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        dequantize(raw, Q.Q4_K, (1, 128))


def test_wrong_byte_count_raises():
    with pytest.raises(ValueError, match="needs 288 bytes, raw has 287"):
        dequantize(torch.zeros(287, dtype=torch.uint8), Q.Q4_K, (1, 512))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(torch.zeros(68, dtype=torch.uint8), Q.Q8_0, (32,))


@pytest.mark.parametrize("bad_raw,match", [
    (torch.zeros(34, dtype=torch.int8), "uint8"),
    (torch.zeros(2, 17, dtype=torch.uint8), "1-D"),
    (torch.zeros(68, dtype=torch.uint8)[::2], "contiguous"),
])
def test_bad_raw_tensor_raises(bad_raw, match):
    with pytest.raises(ValueError, match=match):
        dequantize(bad_raw, Q.Q8_0, (32,))


def test_unsupported_type_raises():
    raw = torch.zeros(66, dtype=torch.uint8)  # one IQ2_XXS block
    with pytest.raises(UnsupportedQuantType) as info:
        dequantize(raw, Q.IQ2_XXS, (256,))
    message = str(info.value)
    assert "IQ2_XXS (16)" in message
    assert "Q4_K (12)" in message and "MXFP4 (39)" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedQuantType, match=r"unknown \(999\)"):
        dequantize(raw, 999, (256,))
    with pytest.raises(UnsupportedQuantType, match="IQ2_XXS"):
        quant_matmul(torch.zeros(1, 256), raw, Q.IQ2_XXS, (1, 256))


def test_i32_passthrough():
    values = np.array([[0, -1, 2**31 - 1], [-(2**31), 7, 123456]], dtype=np.int32)
    raw = torch.from_numpy(values.reshape(-1).view(np.uint8).copy())
    got = dequantize(raw, Q.I32, (2, 3), dtype=torch.bfloat16)  # dtype is ignored
    assert got.dtype == torch.int32
    assert np.array_equal(got.numpy(), values)
    got[0, 0] = 5  # a copy, never a view of the caller's buffer
    assert raw[:4].tolist() == [0, 0, 0, 0]


def test_float_formats_never_alias_raw():
    raw = torch.from_numpy(np.arange(4, dtype=np.float32).view(np.uint8).copy())
    got = dequantize(raw, Q.F32, (4,))
    got[0] = 9.0
    assert raw.view(torch.float32)[0] == 0.0


# ---------------------------------------------------------------- quant_matmul


def dot_bound(x: torch.Tensor, w: torch.Tensor, eps: float, c: float = 1.0) -> torch.Tensor:
    """Per-element bound on |fl(x @ w.T) - x @ w.T| for any summation order, in float64.

    For a length-K dot product evaluated in floating point with unit roundoff
    eps (2**-24 for float32, 2**-53 for float64) in *any* order, with or
    without fused multiply-add, |error| <= gamma_K * sum_k |x_k| |w_k| with
    gamma_K = K eps / (1 - K eps) (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 3.5).  ``c`` counts how many such rounded results
    the comparison involves: 1 for rounded vs exact, 2 for two roundings
    compared with each other.
    """
    k = x.shape[-1]
    assert k * eps < 0.5
    gamma = k * eps / (1.0 - k * eps)
    return c * gamma * (x.double().abs() @ w.double().abs().T)


def dot_bound_violation(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """max |got - exact| / bound (<= 1 means within the bound)."""
    err = (got.double() - exact).abs()
    return float((err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())


def assert_within_dot_bound(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor,
                            what: str) -> None:
    assert got.shape == exact.shape == bound.shape
    assert torch.isfinite(got).all(), what
    ratio = dot_bound_violation(got, exact, bound)
    assert ratio <= 1.0, (
        f"{what}: |error| reaches {ratio:.3g}x the float summation-order bound "
        f"(max |error| {float((got.double() - exact).abs().max()):.3g})")


EPS32, EPS64 = 2.0**-24, 2.0**-53


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q8_0, Q.MXFP4, Q.Q6_K], ids=name)
def test_quant_matmul_matches_dense(ggml_type):
    rng = np.random.default_rng(11)
    out_features, in_features = 24, 512
    block_size, _ = GGML_QUANT_SIZES[Q(ggml_type)]
    blocks = random_blocks(ggml_type, out_features * in_features // block_size, rng)
    if ggml_type != Q.MXFP4:  # keep magnitudes moderate so the sums are well conditioned
        for offset in F16_FIELDS[Q(ggml_type)]:
            blocks[:, offset:offset + 2] = (
                rng.uniform(0.01, 0.1, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2))
    else:
        blocks[:, 0] = rng.integers(120, 130, len(blocks))
    raw = torch.from_numpy(blocks.reshape(-1))
    shape = (out_features, in_features)
    w = dequantize(raw, ggml_type, shape)  # bit-exact (tested above)
    x = torch.from_numpy(rng.standard_normal((2, 5, in_features)).astype(np.float32))
    # The float32 products and sums differ from the exact ones only by rounding, in an
    # order BLAS chooses (it differs between chunked and unchunked calls and between
    # CPUs), so each float32 result must lie within gamma_K * (|x| @ |W|.T) of the
    # exact product.  The float64 reference adds its own (negligible) rounding.
    exact = x.double() @ w.double().T
    bound = dot_bound(x, w, EPS32) + dot_bound(x, w, EPS64)
    got = quant_matmul(x, raw, ggml_type, shape)
    assert got.shape == (2, 5, out_features) and got.dtype == torch.float32
    assert_within_dot_bound(got, exact, bound, "unchunked")
    # Chunked: 5 rows per chunk (budget of 5 float32 rows), a ragged last chunk.
    chunked = quant_matmul(x, raw, ggml_type, shape, chunk_bytes=5 * in_features * 4)
    assert chunked.shape == (2, 5, out_features) and chunked.dtype == torch.float32
    assert_within_dot_bound(chunked, exact, bound, "chunked")

    # float64: the same code path, where any summation order agrees to ~1e-13
    # relative, so a wrong row, block or scale cannot hide in the tolerance.
    x64 = x.double()
    bound64 = dot_bound(x64, w, EPS64, c=2)
    for chunk_bytes in (None, 5 * in_features * 8):
        got64 = quant_matmul(x64, raw, ggml_type, shape, chunk_bytes=chunk_bytes)
        assert got64.dtype == torch.float64
        assert_within_dot_bound(got64, exact, bound64, f"float64, chunk_bytes={chunk_bytes}")

    # The float32 bound is tight enough to catch real bugs: the rows of one chunk
    # shifted by one, or one block's scale doubled, both break it by far.
    shifted = chunked.clone()
    shifted[..., 5:10] = chunked[..., 6:11]
    assert dot_bound_violation(shifted, exact, bound) > 100
    bad = blocks.copy()
    victim = (7 * in_features) // block_size + 1  # second block of row 7
    if ggml_type == Q.MXFP4:
        bad[victim, 0] += 1  # E8M0 exponent + 1: scale x 2
    else:
        offset = F16_FIELDS[Q(ggml_type)][0]  # the block's (super-)scale d
        d = bad[victim, offset:offset + 2].copy().view(np.float16)
        bad[victim, offset:offset + 2] = (d * np.float16(2)).view(np.uint8)
    wrong = quant_matmul(x, torch.from_numpy(bad.reshape(-1)), ggml_type, shape,
                         chunk_bytes=5 * in_features * 4)
    assert dot_bound_violation(wrong[..., 7], exact[..., 7], bound[..., 7]) > 100
    others = [i for i in range(out_features) if i != 7]
    assert_within_dot_bound(wrong[..., others], exact[..., others], bound[..., others], "other rows")


def test_quant_matmul_chunks_by_default_budget(monkeypatch):
    rng = np.random.default_rng(12)
    shape = (10, 256)
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 80, rng).reshape(-1))
    calls = []
    real = dequant_module.dequantize
    monkeypatch.setattr(dequant_module, "dequantize",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(dequant_module, "_MATMUL_CHUNK_BYTES", 3 * 256 * 4)
    x = torch.randn(4, 256, dtype=torch.float64)
    got = quant_matmul(x, raw, Q.Q8_0, shape)
    assert len(calls) == 4 and all(dtype == torch.float64 for dtype in calls)
    want = x @ real(raw, Q.Q8_0, shape, torch.float64).T
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_quant_matmul_bfloat16_and_errors():
    rng = np.random.default_rng(13)
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 16, rng).reshape(-1))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = quant_matmul(x, raw, Q.Q4_0, (8, 64))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, x @ dequantize(raw, Q.Q4_0, (8, 64), torch.bfloat16).T)
    with pytest.raises(ValueError, match="features"):
        quant_matmul(torch.randn(3, 32), raw, Q.Q4_0, (8, 64))
    with pytest.raises(ValueError, match="2-D"):
        quant_matmul(x, raw, Q.Q4_0, (2, 4, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_quant_matmul_cuda(cuda_backend):
    rng = np.random.default_rng(14)
    shape = (40, 512)
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 80, rng).reshape(-1)).cuda()
    x = torch.randn(3, 512, device="cuda")
    want = x @ dequantize(raw, Q.Q4_K, shape).T
    torch.testing.assert_close(quant_matmul(x, raw, Q.Q4_K, shape), want)
    torch.testing.assert_close(quant_matmul(x, raw, Q.Q4_K, shape, chunk_bytes=7 * 512 * 4), want)


# ---------------------------------------------------------------- benchmark smoke test


def test_benchmark_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_dequant", REPO / "benchmarks" / "bench_dequant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--device", "cpu", "--mib", "0.02", "--iters", "1", "--warmup", "0",
                         "--types", "Q8_0,Q2_K,MXFP4", "--dtypes", "bfloat16", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert {"date", "command", "machine", "copy_bandwidth_gbps", "rows"} <= written.keys()
    assert {"hostname", "gpu_name", "torch_version", "cuda_version"} <= written["machine"].keys()
    assert "--device cpu" in written["command"]
    assert written["copy_bandwidth_gbps"] > 0
    assert [row["type"] for row in written["rows"]] == ["Q8_0", "Q2_K", "MXFP4"]
    for row in written["rows"]:
        assert {"in_mib", "out_mib", "ms", "gbps", "pct_of_copy", "backend", "out_dtype"} <= row.keys()
        assert row["ms"] > 0 and row["gbps"] > 0


# ---------------------------------------------------------------- rows of a table, read in place


def _expert_table(ggml_type: int, experts: int, shape: tuple[int, int], rng) -> tuple[torch.Tensor, np.ndarray]:
    """A strided table like one role of a model's stacked expert tensors: row i holds expert
    i's bytes, inside a buffer whose rows are wider (three roles side by side)."""
    nbytes = tensor_nbytes(ggml_type, shape)
    block_size, _ = GGML_QUANT_SIZES[Q(ggml_type)]
    raw = random_blocks(ggml_type, experts * nbytes // GGML_QUANT_SIZES[Q(ggml_type)][1], rng)
    raw = raw.reshape(experts, nbytes)
    buffer = rng.integers(0, 256, (experts, 3 * nbytes + 64), dtype=np.uint8)
    buffer[:, nbytes + 64: 2 * nbytes + 64] = raw  # the middle role, at an odd offset
    table = torch.from_numpy(buffer)[:, nbytes + 64: 2 * nbytes + 64]
    assert table.stride(0) != table.shape[1]
    return table, raw


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=name)
def test_rows_of_a_table_equal_each_row_dequantized(ggml_type):
    """`dequantize_rows` (out of order, repeated rows, a strided table) equals `dequantize`
    of each row; on the CPU it gathers, then dequantizes."""
    from engine.kernels.dequant import dequantize_rows

    rng = np.random.default_rng(7 + ggml_type)
    block_size = GGML_QUANT_SIZES[Q(ggml_type)][0]
    shape = (6, 2 * max(block_size, 32))
    table, raw = _expert_table(ggml_type, 9, shape, rng)
    rows = torch.tensor([5, 0, 8, 5, 3])
    got = dequantize_rows(table, rows, ggml_type, shape, torch.float32)
    assert got.shape == (5, *shape)
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(got[i], dequantize(torch.from_numpy(raw[r]), ggml_type, shape, torch.float32))


@pytest.mark.skipif(dequant_module.triton is None, reason="needs Triton (CUDA, or its interpreter on the CPU)")
@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=name)
def test_triton_reads_picked_rows_in_place(ggml_type, monkeypatch):
    """The Triton kernels with a row table: the rows are read where they lie (no gathered
    copy: on CUDA `torch.index_select` must not run), every value as `dequantize` gives it.
    Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (float32 out: the interpreter
    truncates to bf16)."""
    import os

    from engine.kernels.dequant import _dequantize_blocks_triton, dequantize_rows

    on_cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1")
    device = "cuda" if on_cuda else "cpu"
    rng = np.random.default_rng(70 + ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    shape = (3, 4 * max(block_size, 64))  # per row more blocks than one program takes at 32 values
    table, raw = _expert_table(ggml_type, 11, shape, rng)
    table = table.to(device) if on_cuda else table
    rows = torch.tensor([10, 2, 2, 0, 7, 10, 4], device=device)
    want = torch.stack([dequantize(torch.from_numpy(raw[r]), ggml_type, shape, torch.float32)
                        for r in rows.tolist()])
    if on_cuda:
        monkeypatch.setattr(torch, "index_select", lambda *a, **k: pytest.fail("the rows were gathered"))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = dequantize_rows(table, rows, ggml_type, shape, dtype)
            assert torch.equal(got.cpu(), want.to(dtype)), dtype
        assert dequant_module._TRITON_ERROR is None
        return
    per_row = table.shape[1] // type_size
    out = torch.empty((rows.numel() * per_row, block_size), dtype=torch.float32)
    _dequantize_blocks_triton(ggml_type, table, out, (rows.to(torch.int64), per_row, table.stride(0)))
    assert torch.equal(out.view(rows.numel(), *shape), want)
