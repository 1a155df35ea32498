"""engine.kernels.compressor: a compressor's decode step, the reference against the model's
code (bitwise) and the one-launch kernel against the reference.

The reference is the model's `_compress_static` + `_pool` moved into the kernel module;
`_old_compress_static` / `_old_pool` below are a literal copy of that model code as it
was before the move (the oracle that pins the semantics), but for one change that it
names: the entry is written on the window's closing step only.

Tolerances (kernel against reference). Everything but the step's entry (row pos // ratio)
is a copy: the token's rows, the float32 gate + ape sum kept as overlap, so those
buffers must be bitwise equal. The entry is y = sum_i p_i v_i / sum_i p_i per feature
over n slots (n = 2 * ratio for CSA, ratio for HCA), p_i = exp(g_i - max g), then
z = w * y * r with r = 1 / sqrt(mean(y^2) + eps), then the rope. Both sides compute in
float32 with u = 2**-24; the kernel folds the slots in B blocks (online softmax).
Against the exact values, with A = sum_i p_i |v_i| / sum_i p_i per feature and G the
largest spread max g - min g of a feature's gates:
- each p_i is within eta = (5B + 4G) u: a product of at most B exponentials (the
  term's own and the rescales of the later blocks), each within 4 u (ex2.approx's
  2**-22) and one multiply u; their arguments are rounded twice (the subtraction, the
  scaling by log2 e), an error relative to the argument that becomes relative in the
  result: 2 u per unit of argument, and the arguments add up to at most 2G (the term's
  own <= G, the rescales of a rising maximum telescope to <= G);
- y is within tau = 2 eta + (2n + 4) u of A: numerator and denominator are n-term sums
  ((n - 1) u of their terms' magnitudes whatever the order), the products one rounding,
  the division up to two (an approximate division on the GPU);
- r is within rho = tau S + (d/2 + 8) u relative, S = sum |y| A / sum y^2: half the
  relative change of the sum of squares (2 tau S from y's errors, d u from the sum's
  order) plus the mean, eps, square root and division, a few u each;
- z (two products) and the rotated features (two products and a sum, or one fused
  multiply-add) add 4 u of the pair's magnitude.
So with N = |w| r A (>= |z|) and P = N of both features of a rope pair, every entry
feature is within X = (tau + rho + 4u) P of the exact value on either side. In bfloat16
the entry is rounded after the norm (half an ulp: U_BF16 |z|, passed on by the rotation
to at most U_BF16 P) and after the rope (U_BF16 P): X + 2 U_BF16 P each, so the kernel
and the reference differ by at most twice that. The tests compute A, G, S and N in
float64 from the step's inputs and check both sides against the float64 entry.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import compressor as cm
from engine.kernels.norm_rope import apply_rope, apply_rope_reference, rms_norm, rms_norm_reference, wide_dtype
from kernel_device import EPS32, KERNEL_DEVICE, U_BF16, break_launches, needs_kernels, needs_rounding_bf16

EPS = 1e-6
# name: (ratio, head_dim, rope_dim, overlap)
SMALL = {
    "csa-4x32": (4, 32, 8, True),
    "hca-16x64": (16, 64, 16, False),
    "csa-3x24-ragged": (3, 24, 8, True),  # neither a power of two: padded tiles
}
# DeepSeek-V4-Flash: the attention compressors (CSA and HCA layers) and the indexer's.
REAL = {
    "attention-csa": (4, 512, 64, True),
    "attention-hca": (128, 512, 64, False),
    "indexer-csa": (4, 128, 64, True),
}


# ---------------------------------------------------------------------------------------
# The oracle: the model's code as it was (DeepSeek4Model._compress_static and _pool, the
# latter with the rope angles given), self / cw fields passed in.


def _old_pool(cw, chunk_kv, chunk_gate, prev_kv, prev_gate, rope, rms_eps):
    m, d = cw.ratio, cw.head_dim
    n_windows = chunk_kv.shape[0]
    if cw.overlap:
        pooled_kv = chunk_kv.new_zeros((n_windows, 2 * m, d))
        pooled_gate = chunk_gate.new_full((n_windows, 2 * m, d), float("-inf"))
        pooled_kv[:, m:] = chunk_kv[..., d:]
        pooled_gate[:, m:] = chunk_gate[..., d:]
        pooled_kv[1:, :m] = chunk_kv[:-1, :, :d]
        pooled_gate[1:, :m] = chunk_gate[:-1, :, :d]
        if prev_kv is not None:
            pooled_kv[0, :m] = prev_kv
            pooled_gate[0, :m] = prev_gate
    else:
        pooled_kv, pooled_gate = chunk_kv, chunk_gate
    weights = pooled_gate.transpose(1, 2).softmax(dim=-1, dtype=wide_dtype(pooled_kv.dtype)).transpose(1, 2)
    pooled = (pooled_kv.to(weights.dtype) * weights).sum(dim=1)
    compressed = rms_norm(pooled, cw.norm, rms_eps).to(pooled_kv.dtype)
    cos, sin = rope
    return apply_rope(compressed, cos, sin)


def _old_compress_static(cw, kv_new, gate_new, sc, pos, rope, rms_eps):
    m, d = cw.ratio, cw.head_dim
    slot, window = pos % m, pos // m
    sc.pending_kv.index_copy_(0, slot, kv_new)
    sc.pending_gate.index_copy_(0, slot, gate_new)
    chunk_kv = sc.pending_kv.view(1, m, -1)
    chunk_gate = sc.pending_gate.view(1, m, -1) + cw.ape
    prev_kv = prev_gate = None
    if cw.overlap:
        seen = (window > 0).view(1, 1)
        prev_kv = torch.where(seen, sc.overlap_kv, 0.0)
        prev_gate = torch.where(seen, sc.overlap_gate, float("-inf"))
    # The one change since: the entry is written on the closing step only (before, every
    # step rewrote it from a partly stale window; masked until it closes either way).
    closing = (slot == m - 1).view(1, 1)
    pooled = _old_pool(cw, chunk_kv, chunk_gate, prev_kv, prev_gate, rope, rms_eps)
    sc.entries.index_copy_(0, window, torch.where(closing, pooled, sc.entries.index_select(0, window)))
    if cw.overlap:
        sc.overlap_kv.copy_(torch.where(closing, chunk_kv[0, :, :d], sc.overlap_kv))
        sc.overlap_gate.copy_(torch.where(closing, chunk_gate[0, :, :d], sc.overlap_gate))


# ---------------------------------------------------------------------------------------
# Inputs


def _compressor(case, dtype, capacity: int, seed: int):
    """Weights (cw: ratio, head_dim, overlap, ape, norm) and buffers [pending_kv,
    pending_gate, overlap_kv, overlap_gate, entries] full of noise: stale slots, an overlap
    that the first window must ignore, entries that only their own step may change."""
    m, d, _, overlap = case
    width = (2 if overlap else 1) * d
    g = torch.Generator().manual_seed(seed)
    cw = SimpleNamespace(ratio=m, head_dim=d, overlap=overlap, ape=torch.randn(m, width, generator=g) * 0.5,
                         norm=torch.rand(d, generator=g) + 0.5)
    wide = wide_dtype(dtype)
    buffers = [(torch.randn(m, width, generator=g) * s).to(dtype) for s in (1.0, 2.0)]
    buffers += [torch.randn(m, d, generator=g).to(dtype), (torch.randn(m, d, generator=g) * 2).to(wide),
                torch.randn(capacity, d, generator=g).to(dtype)]
    return cw, buffers


def _token(case, dtype, pos: int, g: torch.Generator):
    """The token's kv / gate projections [1, width] and the angles [1, rope_dim / 2] of its
    window's first position (the model's rope_cos_sin with base 10000)."""
    m, d, rope_dim, overlap = case
    width = (2 if overlap else 1) * d
    kv = torch.randn(1, width, generator=g).to(dtype)
    gate = (torch.randn(1, width, generator=g) * 2).to(dtype)
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    angles = torch.tensor([[float(pos // m * m)]]) * inv_freq
    return kv, gate, angles.cos(), angles.sin()


def _static(cw, buffers):
    from engine.models.deepseek4_static import StaticCompressor

    return StaticCompressor(cw.ratio, cw.overlap, *buffers)


def _step(fn, cw, buffers, kv, gate, cos, sin, pos: int, device="cpu") -> None:
    on = [t.to(device) for t in (kv, gate)] + buffers
    fn(*on, cw.ape.to(device), cw.norm.to(device), cos.to(device), sin.to(device),
       torch.tensor([pos], device=device), cw.ratio, cw.head_dim, cw.overlap, EPS)


# ---------------------------------------------------------------------------------------
# (a) The reference is the model's code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("case", ["csa-4x32", "hca-16x64"])
def test_reference_is_the_models_step_bitwise(case, dtype):
    """2 * ratio + 3 steps from position 0: windows close, the overlap is carried."""
    cw, old = _compressor(SMALL[case], dtype, capacity=4, seed=1)
    new = [t.clone() for t in old]
    sc = _static(cw, old)
    g = torch.Generator().manual_seed(2)
    for pos in range(2 * cw.ratio + 3):
        kv, gate, cos, sin = _token(SMALL[case], dtype, pos, g)
        _old_compress_static(cw, kv, gate, sc, torch.tensor([pos]), (cos, sin), EPS)
        _step(cm.compress_step_reference, cw, new, kv, gate, cos, sin, pos)
        for want, got in zip(sc.tensors(), new):
            assert got.dtype == want.dtype and torch.equal(got, want), pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("first", [True, False], ids=["first-windows", "after-a-window"])
@pytest.mark.parametrize("case", ["csa-4x32", "hca-16x64"])
def test_pool_windows_is_the_models_pool_bitwise(case, first, dtype):
    """Several closed windows at once (the eager prefill), with and without a previous one."""
    m, d, rope_dim, overlap = SMALL[case]
    cw, _ = _compressor(SMALL[case], dtype, capacity=1, seed=3)
    g = torch.Generator().manual_seed(4)
    width = (2 if overlap else 1) * d
    chunk_kv = torch.randn(3, m, width, generator=g).to(dtype)
    chunk_gate = (torch.randn(3, m, width, generator=g) * 2).to(dtype) + cw.ape
    prev_kv = prev_gate = None
    if overlap and not first:
        prev_kv, prev_gate = torch.randn(m, d, generator=g).to(dtype), torch.randn(m, d, generator=g)
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    window_pos = (torch.arange(3) + (0 if first else 5)) * m
    angles = window_pos[:, None].float() * inv_freq
    rope = (angles.cos(), angles.sin())
    got = cm.pool_windows(chunk_kv, chunk_gate, prev_kv, prev_gate, cw.norm, m, d, overlap, EPS, *rope)
    assert torch.equal(got, _old_pool(cw, chunk_kv, chunk_gate, prev_kv, prev_gate, rope, EPS))


# ---------------------------------------------------------------------------------------
# (b) The kernel against the reference


def _exact_entry(case, before, kv, gate, cw, cos, sin, pos: int, dtype):
    """Float64: the step's entry and how far from it each side may be (module docstring)."""
    m, d, _, overlap = case
    slot, window = pos % m, pos // m
    rows_kv = before[0].double().clone()
    rows_kv[slot] = kv.double()
    rows_gate = before[1].clone()
    rows_gate[slot] = gate
    rows_gate = (rows_gate + cw.ape).double()  # the float32 sum both sides compute
    slots_kv, slots_gate = rows_kv[:, -d:], rows_gate[:, -d:]  # CSA's second half; HCA's width is d
    if overlap and window > 0:
        slots_kv = torch.cat([before[2].double(), slots_kv])
        slots_gate = torch.cat([before[3].double(), slots_gate])
    weights = slots_gate.softmax(dim=0)
    y = (weights * slots_kv).sum(0)
    a = (weights * slots_kv.abs()).sum(0)
    spread = (slots_gate.max(0).values - slots_gate.min(0).values).max().item()
    n = (2 if overlap else 1) * m
    blocks = (2 if overlap else 1) * math.ceil(m / cm._slot_block(m, d))
    u = EPS32
    eta = (5 * blocks + 4 * spread) * u
    tau = 2 * eta + (2 * n + 4) * u
    rho = tau * ((y.abs() * a).sum() / (y * y).sum()).item() + (d / 2 + 8) * u
    norm = cw.norm.double()
    entry = apply_rope_reference(rms_norm_reference(y[None], norm, EPS), cos.double(), sin.double())[0]
    r = 1 / torch.sqrt((y * y).mean() + EPS)
    magnitude = norm.abs() * r * a
    pairs = magnitude.view(-1, 2).sum(-1, keepdim=True).expand(-1, 2).flatten()
    bound = (tau + rho + 4 * u) * pairs
    if dtype == torch.bfloat16:
        bound = bound + 2 * U_BF16 * pairs
    return entry, bound + 1e-30


def _run_steps(case, dtype, positions, seed: int):
    """The kernel (on the kernel device) and the reference (CPU) over consecutive steps,
    every buffer compared after each."""
    dev = torch.device(KERNEL_DEVICE)
    m = case[0]
    cw, ref = _compressor(case, dtype, capacity=positions[-1] // m + 2, seed=seed)
    got = [t.to(dev, copy=True) for t in ref]
    g = torch.Generator().manual_seed(seed + 1)
    for pos in positions:
        before = [t.clone() for t in ref]
        got_before = [t.cpu() for t in got]
        kv, gate, cos, sin = _token(case, dtype, pos, g)
        _step(cm.compress_step, cw, got, kv, gate, cos, sin, pos, dev)
        assert cm.SWITCH.error is None, f"the kernel fell back: {cm.SWITCH.error!r}"
        _step(cm.compress_step_reference, cw, ref, kv, gate, cos, sin, pos)
        now = [t.cpu() for t in got]
        for name, want, have in zip(("pending_kv", "pending_gate", "overlap_kv", "overlap_gate"), ref, now):
            assert have.dtype == want.dtype and torch.equal(have, want), (pos, name)
        window = pos // m
        closing = pos % m == m - 1
        # Only the closing step writes an entry, its window's; every other row stays as it was.
        kept = (torch.arange(now[4].shape[0]) != window) | (not closing)
        assert torch.equal(now[4][kept], got_before[4][kept]), pos
        assert torch.equal(ref[4][kept], before[4][kept]), pos
        if closing:
            exact, bound = _exact_entry(case, before, kv, gate, cw, cos, sin, pos, dtype)
            for side in (now[4][window], ref[4][window]):
                assert ((side.double() - exact).abs() <= bound).all(), pos


DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_rounding_bf16)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", SMALL, ids=list(SMALL))
def test_kernel_matches_reference_over_consecutive_steps(case, dtype):
    """From position 0 over 2 * ratio + 3 steps: the first window (no overlap yet), two
    closing slots, the overlap carried into the next windows."""
    _run_steps(SMALL[case], dtype, list(range(2 * SMALL[case][0] + 3)), seed=len(case))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", REAL, ids=list(REAL))
def test_kernel_matches_reference_at_deepseek_v4_sizes(case, dtype):
    """Five steps around the second window's close (HCA: 128 slots in blocks)."""
    m = REAL[case][0]
    _run_steps(REAL[case], dtype, list(range(2 * m - 3, 2 * m + 2)), seed=len(case))


# ---------------------------------------------------------------------------------------
# (c), (d) Fallback and dispatch


@needs_kernels
def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    dev = torch.device(KERNEL_DEVICE)

    break_launches(monkeypatch, cm)
    case = SMALL["csa-4x32"]
    cw, buffers = _compressor(case, torch.float32, capacity=4, seed=7)
    got = [t.to(dev, copy=True) for t in buffers]
    want = [t.to(dev, copy=True) for t in buffers]  # the same device's torch
    g = torch.Generator().manual_seed(8)
    for pos in (3, 4):  # a closing slot, then the next window's first
        kv, gate, cos, sin = _token(case, torch.float32, pos, g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(cm.compress_step, cw, got, kv, gate, cos, sin, pos, dev)
        _step(cm.compress_step_reference, cw, want, kv, gate, cos, sin, pos, dev)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == (1 if pos == 3 else 0) and all("EXPERTDESK_COMPRESSOR_TRITON" in m for m in messages)
        assert isinstance(cm.SWITCH.error, RuntimeError)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b.cpu()), pos


@pytest.mark.parametrize("why", ["cpu-without-interpreter", "switched-off", "ape-not-float32"])
def test_where_the_kernel_does_not_apply_the_reference_runs(monkeypatch, why):
    """No Triton on CPU without the interpreter, none when switched off, none where it
    would round differently (a bfloat16 ape makes the gate + ape sum bfloat16)."""

    def launched(*args, **kwargs):
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(cm, "_launch", launched)
    device = "cpu"
    if why == "cpu-without-interpreter":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    elif why == "switched-off":
        monkeypatch.setenv("EXPERTDESK_COMPRESSOR_TRITON", "0")
        device = KERNEL_DEVICE or "cpu"
    else:
        device = KERNEL_DEVICE or "cpu"
    case = SMALL["csa-4x32"]
    cw, buffers = _compressor(case, torch.bfloat16, capacity=4, seed=9)
    if why == "ape-not-float32":
        cw.ape = cw.ape.to(torch.bfloat16)
    got = [t.to(device, copy=True) for t in buffers]
    want = [t.to(device, copy=True) for t in buffers]
    g = torch.Generator().manual_seed(10)
    for pos in range(5):
        kv, gate, cos, sin = _token(case, torch.bfloat16, pos, g)
        _step(cm.compress_step, cw, got, kv, gate, cos, sin, pos, device)
        _step(cm.compress_step_reference, cw, want, kv, gate, cos, sin, pos, device)
        for a, b in zip(got, want):
            assert torch.equal(a, b), pos
