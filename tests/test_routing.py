"""engine.kernels.routing: DeepSeek-V4's router (sqrt-softplus scores, biased top-k) and Kimi-K3's
(sigmoid scores, the normalisation's sum clamped) in one launch.

The logits are built with clear margins: the biased scores of any two experts differ by
more than 1e-3, far above the float32 rounding of softplus and sqrt (a few ulp of values
below 10: under 1e-5), so the kernel and torch pick the same set; ties never decide a
test. The weights are sqrt(softplus(z)) at the picked experts, normalised: the kernel
computes softplus as log(1 + e^z) (or its series for tiny e^z) where torch uses log1p,
a few ulp apart, and the normalisation's k-term sum in another order: within
(k + 8) * 2**-24 of each weight, relative. Kimi-K3's sigmoid (an exponential, a sum and a
division on either side) keeps that bound.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import routing
from kernel_device import EPS32, KERNEL_DEVICE, needs_kernels

N_EXPERTS, K = 256, 6


def _logits(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose biased scores are a shuffled ladder with steps of at least 2e-3."""
    g = torch.Generator().manual_seed(seed)
    bias = (torch.rand(N_EXPERTS, generator=g) - 0.5) * 0.02
    bias[:4] = 0  # the test below puts its own logits there
    rows = []
    for _ in range(tokens):
        target = torch.randperm(N_EXPERTS, generator=g).float() * 2e-2 + 0.05  # biased score, distinct
        score = (target - bias).clamp(min=1e-3)
        rows.append(torch.log(torch.expm1(score.double() ** 2)).float())  # sqrt(softplus(z)) = score
    return torch.stack(rows), bias


@needs_kernels
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 7])
def test_kernel_picks_the_same_experts_with_the_same_weights(tokens, normalize):
    logits, bias = _logits(tokens, tokens)
    # The series, plain softplus, the threshold: scores 5.5e-7, 2.5e-3, 0.83 and 5.0 (bias 0),
    # each at least 2.6e-3 from the ladder's rungs 0.05 + 0.02 j.
    logits[0, :4] = torch.tensor([-30.0, -12.0, 0.0, 25.0])
    dev = torch.device(KERNEL_DEVICE)
    chosen, weights = (t.cpu() for t in routing.route(logits.to(dev), bias.to(dev), K, normalize, 1.5))
    assert routing.SWITCH.error is None, f"the kernel fell back: {routing.SWITCH.error!r}"
    want_chosen, want_weights = routing.route_reference(logits.double(), bias.double(), K, normalize, 1.5)
    order, want_order = chosen.argsort(dim=1), want_chosen.argsort(dim=1)
    assert torch.equal(chosen.gather(1, order), want_chosen.gather(1, want_order))
    got, want = weights.gather(1, order).double(), want_weights.gather(1, want_order)
    assert ((got - want).abs() <= (K + 8) * EPS32 * want.abs()).all()
    biased = routing.sqrt_softplus(logits.double()) + bias.double()
    assert (biased.gather(1, chosen).diff(dim=1) < 0).all()  # descending order of the biased score


def test_a_hash_layer_gets_the_weights_of_its_given_experts():
    logits, _ = _logits(3, 9)
    given = torch.tensor([[5, 1, 9, 2, 7, 3]] * 3)
    chosen, weights = routing.route(logits, None, K, True, 2.0, given)
    assert torch.equal(chosen, given)
    scores = routing.sqrt_softplus(logits).gather(1, given)
    assert torch.allclose(weights, 2.0 * scores / scores.sum(1, keepdim=True), rtol=1e-6)


def test_on_cpu_without_the_interpreter_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, bias = _logits(2, 3)
    got = routing.route(logits, bias, K, True, 1.0)
    want = routing.route_reference(logits, bias, K, True, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


KIMI_EXPERTS, KIMI_K, KIMI_SUM_MIN = 896, 16, 6.103515625e-5


def _kimi_logits(tokens: int, seed: int, tiny: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi-K3's router: logits whose sigmoid + bias is a shuffled ladder with steps of 1e-3
    (`tiny`: the top-k scores so small that their sum is under the clamp, the bias ranking them)."""
    g = torch.Generator().manual_seed(seed)
    bias = (torch.rand(KIMI_EXPERTS, generator=g) - 0.5) * 1e-4
    rows = []
    for _ in range(tokens):
        target = torch.randperm(KIMI_EXPERTS, generator=g).double() * 1e-3 + 0.02  # biased score, distinct
        score = (1e-7 * target if tiny else target - bias.double()).clamp(min=1e-9, max=1 - 1e-6)
        rows.append(torch.logit(score).float())
    return torch.stack(rows), (torch.zeros(KIMI_EXPERTS) if tiny else bias)


@needs_kernels
@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "clamped-sum"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_kimi_router_picks_the_same_experts_with_the_same_weights(tokens, tiny):
    logits, bias = _kimi_logits(tokens, tokens, tiny)
    dev = torch.device(KERNEL_DEVICE)
    kwargs = {"sigmoid": True, "sum_min": KIMI_SUM_MIN}
    chosen, weights = (t.cpu() for t in routing.route(logits.to(dev), bias.to(dev), KIMI_K, True, 2.5, **kwargs))
    assert routing.SWITCH.error is None, f"the kernel fell back: {routing.SWITCH.error!r}"
    want_chosen, want_weights = routing.route_reference(logits.double(), bias.double(), KIMI_K, True, 2.5,
                                                        **kwargs)
    order, want_order = chosen.argsort(dim=1), want_chosen.argsort(dim=1)
    assert torch.equal(chosen.gather(1, order), want_chosen.gather(1, want_order))
    got, want = weights.gather(1, order).double(), want_weights.gather(1, want_order)
    assert ((got - want).abs() <= (KIMI_K + 8) * EPS32 * want.abs()).all()
    scores = torch.sigmoid(logits.double()).gather(1, want_chosen)
    if tiny:  # the clamp decides: the weights are the scores over 2**-14, far from summing to 1
        assert (scores.sum(1) < KIMI_SUM_MIN).all()
        assert torch.allclose(want_weights, 2.5 * scores / KIMI_SUM_MIN)
    else:
        assert torch.allclose(want_weights.sum(1), torch.full((tokens,), 2.5, dtype=torch.float64))
    biased = torch.sigmoid(logits.double()) + bias.double()
    assert (biased.gather(1, chosen).diff(dim=1) < 0).all()  # descending order of the biased score
