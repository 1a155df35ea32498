"""engine.kernels.attn_res: Kimi-K3's AttnRes mix, the one-launch kernel and the torch
reference, each against the float64 mix.

The error bound (float32, u = 2**-24; `bound` computes it in float64). Per token, over
the n snapshots v_i of H features, with r_i = 1 / sqrt(mean(v_i^2) + eps) and
L_i = r_i sum_h |v_ih score_h|:
- the logit l_i = r_i sum_h v_ih score_h: the dot product within (H + 2) u of
  sum |v score| (any order of the sum, the products), r_i within (H / 2 + 4) u relative
  (the sum of squares, the mean, eps, the square root, the division), one more product
  (the reference scales each value first: the same terms in another order):
  |dl_i| <= (1.5 H + 7) u L_i =: Lambda_i;
- the softmax p_i within p_i (2 max Lambda + (n + 8) u) (the maximum's shift cancels; the
  exponentials within 4 u, GPU ex2.approx 2**-22; the sum of n; the division);
- out_h = sum_i p_i v_ih within (2 max Lambda + (2 n + 8) u) sum_i p_i |v_ih|.
Kernel and reference each stay within it of the float64 mix.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import attn_res
from kernel_device import EPS32, KERNEL_DEVICE, count_launches, falls_back_once, needs_kernels

EPS = 1e-6
# name: (snapshots with the prefix, tokens, features)
SHAPES = {"one": (1, 1, 64), "ragged": (3, 2, 100), "kimi-k3": (9, 1, 7168), "prefill": (4, 5, 7168)}


def _mix(n: int, rows: int, hidden: int, device, seed: int = 0):
    """A bank of n - 1 snapshots growing in scale (as a residual stream does), the prefix and a
    score that spreads the softmax over them."""
    g = torch.Generator().manual_seed(seed)
    bank = [(torch.randn(rows, hidden, generator=g) * (1 + i)).to(device) for i in range(n - 1)]
    prefix = torch.randn(rows, hidden, generator=g).to(device)
    score = (torch.randn(hidden, generator=g) * 0.005).to(device)  # logits of about 0.4: no one-hot softmax
    return prefix, bank, score


def bound(prefix: torch.Tensor, bank: list[torch.Tensor], score: torch.Tensor) -> torch.Tensor:
    u = EPS32
    values = torch.stack([*bank, prefix], dim=1).double().cpu()  # [T, n, H]
    n, hidden = values.shape[1], values.shape[2]
    r = torch.rsqrt(values.square().mean(-1) + EPS)
    spread = (1.5 * hidden + 7) * u * r * (values * score.double().cpu()).abs().sum(-1)  # [T, n]
    logits = r * (values * score.double().cpu()).sum(-1)
    p = torch.softmax(logits, dim=-1)
    worst = spread.max(dim=-1, keepdim=True).values
    return (2 * worst + (2 * n + 8) * u) * (p.unsqueeze(-1) * values.abs()).sum(1)


def _exact(prefix, bank, score):
    return attn_res.attn_res_mix_reference(prefix.double(), [t.double() for t in bank], score.double(), EPS)


def _check(ours: torch.Tensor, exact: torch.Tensor, tolerance: torch.Tensor) -> None:
    err = (ours.double().cpu() - exact.cpu()).abs()
    worst = int((err - tolerance).argmax())
    assert (err <= tolerance).all(), (f"feature {worst} off by {err.view(-1)[worst]:.3e}, "
                                      f"bound {tolerance.view(-1)[worst]:.3e}")


@needs_kernels
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_and_reference_within_the_float32_bound(shape, monkeypatch):
    prefix, bank, score = _mix(*SHAPES[shape], KERNEL_DEVICE)
    exact = _exact(prefix, bank, score)
    tolerance = bound(prefix, bank, score)
    _check(attn_res.attn_res_mix_reference(prefix, bank, score, EPS), exact, tolerance)
    launches = count_launches(monkeypatch, attn_res)
    _check(attn_res.attn_res_mix(prefix, bank, score, EPS), exact, tolerance)
    assert launches and attn_res.SWITCH.error is None  # the kernel ran


@needs_kernels
def test_the_bound_catches_a_wrong_mix():
    """A mix that drops the oldest snapshot's share falls outside the bound at Kimi-K3's width;
    at a narrow one, where the worst case of a sum is closer to its typical error, so do a
    score off by 1% and an eps of 1e-2. (At 7168 features the logits' bound, 1.5 H u of their
    terms' magnitudes, lets a score off by a few percent pass: it is a worst case.)"""
    prefix, bank, score = _mix(*SHAPES["kimi-k3"], KERNEL_DEVICE, seed=1)
    exact = _exact(prefix, bank, score)
    with pytest.raises(AssertionError, match="off by"):
        _check(attn_res.attn_res_mix(prefix, bank[1:], score, EPS), exact, bound(prefix, bank, score))
    prefix, bank, score = _mix(*SHAPES["ragged"], KERNEL_DEVICE, seed=1)
    exact = _exact(prefix, bank, score)
    tolerance = bound(prefix, bank, score)
    for wrong in (attn_res.attn_res_mix(prefix, bank, score * 1.01, EPS),
                  attn_res.attn_res_mix(prefix, bank, score, 1e-2)):
        with pytest.raises(AssertionError, match="off by"):
            _check(wrong, exact, tolerance)


def test_the_kernel_refuses_what_it_does_not_compute(monkeypatch):
    """float64 runs, a bfloat16 stream (the reference's sums would round), snapshots of another
    shape, a score of another width and a strided prefix run the reference (with the family on,
    as on a GPU)."""
    monkeypatch.setattr(attn_res.SWITCH, "applies", lambda x: True)
    prefix, bank, score = _mix(3, 2, 64, "cpu")
    assert attn_res._applies(prefix, bank, score)
    cases = {
        "float64": (prefix.double(), [t.double() for t in bank], score),
        "bfloat16": (prefix.bfloat16(), [t.bfloat16() for t in bank], score),
        "another shape": (prefix, [bank[0][:1]], score),
        "score width": (prefix, bank, score[:32]),
        "strided prefix": (prefix.t().contiguous().t(), bank, score),
    }
    for name, args in cases.items():
        assert not attn_res._applies(*args), name


@needs_kernels
def test_failed_launch_falls_back_to_the_reference(monkeypatch):
    prefix, bank, score = _mix(*SHAPES["ragged"], KERNEL_DEVICE)
    expected = attn_res.attn_res_mix_reference(prefix, bank, score, EPS)
    got = falls_back_once(monkeypatch, attn_res, lambda: attn_res.attn_res_mix(prefix, bank, score, EPS),
                          "AttnRes mix kernels unavailable")
    assert torch.equal(got, expected)
