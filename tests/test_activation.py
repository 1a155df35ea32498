"""engine.kernels.activation: Kimi-K3's SiTU, the one-launch kernel and the torch reference,
each against SiTU in float64.

The bound: SiTU is a product of factors (tanh(g / beta) beta, sigmoid(g), tanh(u / lb) lb),
so relative errors add. Each of the nine operations rounds to the dtype (unit uh: 2**-8
bfloat16, 2**-11 float16, u = 2**-24 float32) and tanh passes its argument's relative error
on at most once (|y tanh'(y) / tanh(y)| <= 1); the function evaluations in float32 add
16 u per tanh (the kernel's (1 - e) / (1 + e) at |y| = 1/16: e = exp(-1/8) has a few units
of error and 1 - e keeps an eighth of it) and 4 u per sigmoid. So both sides are within
(9 uh + 40 u) |SiTU| of the float64 value, elementwise.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import activation
from kernel_device import (
    EPS32,
    KERNEL_DEVICE,
    U_BF16,
    U_F16,
    count_launches,
    falls_back_once,
    needs_kernels,
    needs_rounding_bf16,
)

BETA, LINEAR_BETA = 4.0, 8.0  # within the published configs' range
UNIT = {torch.float32: EPS32, torch.float16: U_F16, torch.bfloat16: U_BF16}


def _inputs(n: int, dtype: torch.dtype, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up values of both signs, log-uniform over the scales an FFN produces: from the
    tanh series (|g / beta| < 1/16) to saturated tanh and sigmoid. The bound is relative, so
    every intermediate stays a normal number in float16 too (underflow's error is absolute):
    gate in [-7, 30] (sigmoid(-7) ~ 1e-3), |gate| >= 1e-2, |up| >= 0.05."""
    g = torch.Generator().manual_seed(seed)

    def log_uniform(lo: float, hi: float) -> torch.Tensor:
        size = torch.exp(torch.empty(n).uniform_(torch.tensor(lo).log().item(), torch.tensor(hi).log().item(),
                                                 generator=g))
        return size * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)

    gate = log_uniform(1e-2, 30.0).clamp(min=-7.0)
    up = log_uniform(0.05, 40.0)
    return gate.view(1, n).to(dtype).to(device), up.view(1, n).to(dtype).to(device)


def _check(ours: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, linear_beta: float) -> None:
    exact = activation.situ_reference(gate.double().cpu(), up.double().cpu(), BETA, linear_beta)
    tolerance = (9 * UNIT[gate.dtype] + 40 * EPS32) * exact.abs()
    err = (ours.double().cpu() - exact).abs()
    worst = int((err - tolerance).argmax())
    assert (err <= tolerance).all(), (f"element {worst} off by {err.view(-1)[worst]:.3e}, "
                                      f"bound {tolerance.view(-1)[worst]:.3e}")


@needs_kernels
@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, 0.0], ids=["tanh-up", "plain-up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16,
                                                                                 marks=needs_rounding_bf16)])
def test_kernel_and_reference_within_the_bound(dtype, linear_beta, monkeypatch):
    gate, up = _inputs(6144 + 17, dtype, KERNEL_DEVICE)  # Kimi-K3's shared FFN width, and a ragged block
    _check(activation.situ_reference(gate, up, BETA, linear_beta), gate, up, linear_beta)
    launches = count_launches(monkeypatch, activation)
    _check(activation.situ(gate, up, BETA, linear_beta), gate, up, linear_beta)
    assert launches and activation.SWITCH.error is None  # the kernel ran


@needs_kernels
def test_the_bound_catches_a_wrong_activation(monkeypatch):
    """A kernel that forgot one rounding's worth of beta (beta off by 2**-10) falls outside it."""
    gate, up = _inputs(4096, torch.float32, KERNEL_DEVICE, seed=1)
    launches = count_launches(monkeypatch, activation)
    wrong = activation.situ(gate, up, BETA * (1 + 2 ** -10), LINEAR_BETA)
    assert launches
    with pytest.raises(AssertionError, match="off by"):
        _check(wrong, gate, up, LINEAR_BETA)


@needs_kernels
def test_failed_launch_falls_back_to_the_reference(monkeypatch):
    gate, up = _inputs(100, torch.float32, KERNEL_DEVICE, seed=2)
    got = falls_back_once(monkeypatch, activation, lambda: activation.situ(gate, up, BETA, LINEAR_BETA),
                          "SiTU kernels unavailable")
    assert torch.equal(got, activation.situ_reference(gate, up, BETA, LINEAR_BETA))


def test_on_cpu_without_the_interpreter_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate, up = _inputs(50, torch.float32, "cpu", seed=3)
    assert torch.equal(activation.situ(gate, up, BETA, LINEAR_BETA),
                       activation.situ_reference(gate, up, BETA, LINEAR_BETA))
