"""engine.kernels.hyper_connection: DeepSeek-V4's hyper-connections, kernels against torch.

Tolerances. hc_pre: the kernel and the torch reference compute the same float32 values
in different orders, and both are compared with a float64 run of the reference.
- The mixes are n * hidden-term dot products. The reference normalises the streams
  first and sums the products in cuBLAS's order; the kernel sums the raw products and
  scales the n * (2 + n) results by the norm's factor. Either order is within
  n * hidden * 2**-24 of the exact sum relative to the sum of the terms' magnitudes:
  for unit-variance streams and weights of std 1 / sqrt(n * hidden) that sum is about
  0.8 * sqrt(n * hidden), so the mixes are within 0.8 * (n * hidden)**1.5 * 2**-24 in
  the worst case (0.4 for n * hidden = 4 * 512, far above what random signs give).
  Every output is a smooth function of the mixes (sigmoids of slope <= 1/4 times the
  scale, Sinkhorn rounds that divide by sums near 1), so a test with tight bounds needs
  mixes that are not in the worst case: it bounds the error by the float64 reference's
  sensitivity instead, measured by perturbing the mixes by the worst case of a random-
  sign sum, 4 * sqrt(n * hidden) * 2**-24 times that magnitude, and checks that both
  float32 paths stay within 4 times that change.
- The block input h is the collapsed streams cast to the compute dtype and RMSNorm'd:
  in float32 within (hidden + n + 8) * 2**-24 of its value's magnitude plus what the
  mixes' error moves it; in bfloat16 up to two bf16 roundings may flip, 3 * 2**-8.
hc_post: x'_k = post_k * out + sum_j comb[j, k] x_j is n + 1 products and n additions
per value: within (2n + 2) * 2**-24 of the sum of the terms' magnitudes.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import hyper_connection as hc
from kernel_device import EPS32, KERNEL_DEVICE, U_BF16, needs_kernels, needs_rounding_bf16

N, HIDDEN, ITERS, HC_EPS, RMS_EPS = 4, 512, 20, 1e-6, 1e-6


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    m = (2 + N) * N
    fn = torch.randn(m, N * HIDDEN, generator=g) / (N * HIDDEN) ** 0.5
    base = torch.randn(m, generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    norm = torch.rand(HIDDEN, generator=g) + 0.5
    return fn, base, scale, norm


def _streams(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, N, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _pre(x, weights, dtype, device):
    args = [t.to(device) for t in (x, *weights[:3])]
    return hc.hc_pre(args[0], args[1], args[2], args[3], ITERS, HC_EPS, RMS_EPS, dtype, weights[3].to(device))


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_rounding_bf16)],
                         ids=["f32", "bf16"])
def test_hc_pre_kernel_matches_float64_within_summation_order(tokens, dtype):
    x, weights = _streams(tokens, 1), _weights(2)
    fn, base, scale, norm = weights
    post, comb, h = (t.cpu() for t in _pre(x, weights, dtype, torch.device(KERNEL_DEVICE)))
    assert hc.SWITCH.error is None, f"the kernel fell back: {hc.SWITCH.error!r}"
    ref_post, ref_comb, ref_h = hc.hc_pre_reference(x, fn, base, scale, ITERS, HC_EPS, RMS_EPS, dtype, norm)
    exact = hc.hc_pre_reference(x.double(), fn.double(), base.double(), scale.double(), ITERS, HC_EPS, RMS_EPS,
                                torch.float64, norm.double())

    # The float64 reference's change when its mixes move by the random-sign sum bound.
    delta = 4 * (N * HIDDEN) ** 0.5 * EPS32 * 0.8 * (N * HIDDEN) ** 0.5
    moved_base = base.double() + delta
    moved = hc.hc_pre_reference(x.double(), fn.double(), moved_base, scale.double(), ITERS, HC_EPS, RMS_EPS,
                                torch.float64, norm.double())
    for got, ref, want, shifted in zip((post, comb), (ref_post, ref_comb), exact[:2], moved[:2]):
        bound = 4 * (shifted - want).abs().max() + 64 * EPS32 * want.abs().max()
        assert (got.double() - want).abs().max() <= bound
        assert (ref.double() - want).abs().max() <= bound  # the bound holds the reference too
    h_unit = 3 * U_BF16 if dtype == torch.bfloat16 else (HIDDEN + N + 8) * EPS32
    h_bound = h_unit * exact[2].abs() + 4 * (moved[2] - exact[2]).abs().max()
    assert h.dtype == dtype == ref_h.dtype
    assert ((h.double() - exact[2]).abs() <= h_bound).all()
    assert ((ref_h.double() - exact[2]).abs() <= h_bound).all()


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32-out", "bf16-out"])
def test_hc_post_kernel_matches_float64_within_summation_order(out_dtype):
    tokens = 3
    g = torch.Generator().manual_seed(7)
    x = _streams(tokens, 3)
    out = torch.randn(tokens, HIDDEN, generator=g).to(out_dtype)
    post = torch.rand(tokens, N, generator=g) * 2
    comb = torch.rand(tokens, N, N, generator=g)
    dev = torch.device(KERNEL_DEVICE)
    got = hc.hc_post(x.to(dev), out.to(dev), post.to(dev), comb.to(dev)).cpu()
    assert hc.SWITCH.error is None
    want = hc.hc_post_reference(x.double(), out.double(), post.double(), comb.double())
    magnitude = hc.hc_post_reference(x.double().abs(), out.double().abs(), post.double(), comb.double())
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got.double() - want).abs() <= (2 * N + 2) * EPS32 * magnitude + 1e-30).all()


def test_on_cpu_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weights = _streams(2, 4), _weights(5)
    got = _pre(x, weights, torch.float32, torch.device("cpu"))
    want = hc.hc_pre_reference(x, *weights[:3], ITERS, HC_EPS, RMS_EPS, torch.float32, weights[3])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = torch.randn(2, HIDDEN)
    assert torch.equal(hc.hc_post(x, out, got[0], got[1]), hc.hc_post_reference(x, out, got[0], got[1]))


@needs_kernels
def test_a_failing_kernel_warns_and_falls_back(monkeypatch):
    monkeypatch.setattr(hc.SWITCH, "error", None)
    monkeypatch.setattr(hc, "_hc_post_kernel", None)  # subscripting None fails like a missing compiler
    dev = torch.device(KERNEL_DEVICE)
    x, out = _streams(2, 6), torch.randn(2, HIDDEN)
    post, comb = torch.rand(2, N), torch.rand(2, N, N)
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_HC_TRITON"):
        got = hc.hc_post(x.to(dev), out.to(dev), post.to(dev), comb.to(dev))
    assert hc.SWITCH.error is not None
    assert torch.allclose(got.cpu(), hc.hc_post_reference(x, out, post, comb), atol=1e-6)
