"""The fused K-quant prefill MoE kernels (engine.kernels.moe_quant_prefill) against float64.

Where they run: on CUDA with Triton, or under Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1 pytest tests/test_moe_quant_prefill.py`), float32 and float16 x there
(the interpreter's bf16 `tl.dot` is wrong); otherwise the kernel tests skip and what runs
everywhere is the dispatch and the refusals.

Tolerances (float32 x). Each weight is decoded in float32 in `dequant`'s order of operations
(a value may differ by one rounding where the compiler fuses a multiply-add: 2**-24 of its
term), multiplied on tl.dot with input_precision "ieee" (no tf32) and summed in float32 in an
order of its own. Per output, n = d_in + inter + k rounded terms (the dot products over d_in,
the activation's inputs feeding the dot product over inter, the sum over k): any order stays
within n * 2**-24 of the exact value relative to the sum of the terms' magnitudes, and the
decoded values' own rounding adds one more 2**-24 of each term. Allowed: 2 * n * 2**-24 times
that magnitude (|W|, |x| and the activation of the absolute sums, in float64).

Tolerances (bfloat16 x, CUDA). Against float64 of the same bf16 x and the exact weights: the
weights rounded to bf16 (the torch path's dequantization to x's dtype rounds them the same
way; u = 2**-8 of each term), the activation stored in bf16 for the down projection (u of
each act term) and the output rounded once (u of its value): 3 u + 2 n 2**-24 times the
magnitude.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine.experts import ExpertActivation, QuantTensor, ResidentExperts
from engine.kernels import moe_quant_prefill
from engine.kernels.moe import ExpertRows
from engine.kernels.moe_quant_prefill import fused_quant_moe_prefill, prefill_applies, supported
from kernel_device import KERNEL_DEVICE, count_launches, falls_back_once, needs_kernels
from quant_experts import float64_reference, moved_to

D_IN, INTER, N_EXPERTS, K = 512, 256, 16, 4  # d_in != inter: a swapped dimension shows
USED = 13  # experts 13, 14, 15 are never chosen; expert 0 by every token
EPS32 = 2.0 ** -24
U_BF16 = 2.0 ** -8
N_TERMS = D_IN + INTER + K
TYPES = {
    "kimi-k3 (Q2_K gate/up, Q3_K down)": {"gate": Q.Q2_K, "up": Q.Q2_K, "down": Q.Q3_K},
    "Q3_K gate/up, Q2_K down": {"gate": Q.Q3_K, "up": Q.Q3_K, "down": Q.Q2_K},
}
ACTIVATIONS = {
    "swiglu-limit7": ExpertActivation("swiglu", limit=7.0),
    "situ": ExpertActivation("situ", beta=3.0, linear_beta=5.0),
}
SHAPES = {"gate": (INTER, D_IN), "up": (INTER, D_IN), "down": (D_IN, INTER)}


def roles_of(types: str, strided: bool, seed: int):
    return quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, strided=strided, seed=seed, types=TYPES[types])


def routing(tokens: int, seed: int, scale: float = 4.0):
    return quant_experts.routing_with_a_hot_expert(tokens, seed, D_IN, K, USED, scale)


def run_fused(monkeypatch, roles, x, chosen, weights, activation) -> torch.Tensor:
    """The kernels on the kernel device (CUDA or the interpreter's CPU); checks they ran."""
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    xd = x.to(dev)
    assert supported(xd, moved["gate"], moved["up"], moved["down"], activation)
    launches = count_launches(monkeypatch, moe_quant_prefill)
    out = fused_quant_moe_prefill(xd, chosen.to(dev), weights.to(dev), moved["gate"], moved["up"], moved["down"],
                                  activation)
    assert launches and moe_quant_prefill.SWITCH.error is None, f"fell back: {moe_quant_prefill.SWITCH.error!r}"
    monkeypatch.undo()
    assert out.dtype == x.dtype and out.shape == (x.shape[0], D_IN)
    return out.cpu()


def bound(roles, x, chosen, weights, activation, units: float) -> torch.Tensor:
    return units * float64_reference(roles, x, chosen, weights, activation, absolute=True)


@needs_kernels
@pytest.mark.parametrize("types", list(TYPES))
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_float32_equals_float64_within_summation_order(tokens, act_name, types, monkeypatch):
    if KERNEL_DEVICE == "cpu" and tokens == 300 and act_name != "situ":
        pytest.skip("interpreter: the largest chunk once per type")
    activation = ACTIVATIONS[act_name]
    roles = roles_of(types, strided=tokens % 2 == 0, seed=tokens)
    x, chosen, weights = routing(tokens, seed=tokens + 10)
    got = run_fused(monkeypatch, roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    tol = bound(roles, x, chosen, weights, activation, 2 * N_TERMS * EPS32)
    err = (got.double() - exact).abs()
    assert (err <= tol).all(), f"worst {(err / tol).max():.2f}x the bound"
    # A real bug (one pair's expert swapped for an unused one) is far outside the bound.
    wrong = chosen.clone()
    wrong[0, 0] = N_EXPERTS - 1
    bad = run_fused(monkeypatch, roles, x, wrong, weights, activation)
    assert not ((bad.double() - exact).abs() <= tol).all()


@needs_kernels
@pytest.mark.parametrize("role", ["gate", "down"])
def test_a_wrong_scale_breaks_the_bound(role, monkeypatch):
    """One super block's d doubled (the kernel would decode it so if it read the wrong
    field) moves the result out of the bound: the decoding is what the test checks."""
    types = "kimi-k3 (Q2_K gate/up, Q3_K down)"
    roles = roles_of(types, strided=False, seed=3)
    x, chosen, weights = routing(16, seed=5)
    activation = ACTIVATIONS["situ"]
    exact = float64_reference(roles, x, chosen, weights, activation)
    tol = bound(roles, x, chosen, weights, activation, 2 * N_TERMS * EPS32)
    rows = roles[role]
    tampered = rows.table.clone()
    at = quant_experts.F16_FIELDS[Q(rows.ggml_type)][0]
    d = tampered[0, at:at + 2].view(torch.float16)
    tampered[0, at:at + 2] = (d * 2).view(torch.uint8)
    bad_roles = dict(roles, **{role: ExpertRows(tampered, rows.ggml_type, rows.shape)})
    got = run_fused(monkeypatch, bad_roles, x, chosen, weights, activation)
    assert not ((got.double() - exact).abs() <= tol).all()


@needs_kernels
@pytest.mark.parametrize("tokens", [7, 64])
def test_float16_against_float64(tokens, monkeypatch):
    """fp16 x: the weights rounded to fp16 as the torch path's dequantization rounds them:
    the bf16 reasoning with u = 2**-11."""
    activation = ACTIVATIONS["swiglu-limit7"]
    roles = roles_of("kimi-k3 (Q2_K gate/up, Q3_K down)", strided=False, seed=tokens + 2)
    x, chosen, weights = routing(tokens, seed=tokens + 30, scale=1.0)
    x = x.to(torch.float16)
    got = run_fused(monkeypatch, roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    tol = bound(roles, x, chosen, weights, activation, 3 * 2.0 ** -11 + 2 * N_TERMS * EPS32)
    assert ((got.double() - exact).abs() <= tol).all()


@pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 tl.dot is wrong)")
@pytest.mark.parametrize("types", list(TYPES))
@pytest.mark.parametrize("tokens", [7, 300])
def test_bfloat16_against_float64(tokens, types, monkeypatch):
    activation = ACTIVATIONS["situ"]
    roles = roles_of(types, strided=True, seed=tokens + 1)
    x, chosen, weights = routing(tokens, seed=tokens + 20)
    x = x.to(torch.bfloat16)
    got = run_fused(monkeypatch, roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    tol = bound(roles, x, chosen, weights, activation, 3 * U_BF16 + 2 * N_TERMS * EPS32)
    assert ((got.double() - exact).abs() <= tol).all()


@needs_kernels
def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    dev = torch.device(KERNEL_DEVICE)
    roles = moved_to(dev, roles_of("kimi-k3 (Q2_K gate/up, Q3_K down)", strided=False, seed=9))
    x, chosen, weights = routing(7, seed=9)
    args = (x.to(dev), chosen.to(dev), weights.to(dev), roles["gate"], roles["up"], roles["down"],
            ACTIVATIONS["situ"])
    got = falls_back_once(monkeypatch, moe_quant_prefill, lambda: fused_quant_moe_prefill(*args),
                          "fused K-quant prefill")
    expected = moe_quant_prefill.moe_prefill_reference(*args)
    assert torch.equal(got, expected)


def test_what_the_kernels_do_not_take_is_refused():
    """Another type (Q8_0), gate and up of two types, and (here) a CPU tensor."""
    roles = roles_of("kimi-k3 (Q2_K gate/up, Q3_K down)", strided=False, seed=1)
    x = torch.zeros(4, D_IN)
    act = ACTIVATIONS["situ"]
    assert supported(x, roles["gate"], roles["up"], roles["down"], act)
    q8 = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, strided=False, seed=1,
                                    types={"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0})
    assert not supported(x, q8["gate"], q8["up"], q8["down"], act)
    mixed = roles_of("Q3_K gate/up, Q2_K down", strided=False, seed=1)
    assert not supported(x, roles["gate"], mixed["up"], roles["down"], act)
    assert not prefill_applies(x, K, roles["gate"], roles["up"], roles["down"], act)  # a CPU tensor


@pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="needs CUDA: the dispatch is the GPU's")
def test_resident_prefill_runs_the_fused_kernels(monkeypatch):
    """ResidentExperts.routed on a Kimi-K3 prefill chunk on a GPU runs these kernels."""
    kinds = TYPES["kimi-k3 (Q2_K gate/up, Q3_K down)"]
    roles = roles_of("kimi-k3 (Q2_K gate/up, Q3_K down)", strided=False, seed=11)
    stacked = {name: QuantTensor(r.table.reshape(-1).cuda(), int(kinds[name]), (N_EXPERTS, *SHAPES[name]))
               for name, r in roles.items()}
    provider = ResidentExperts({0: stacked})
    x, chosen, weights = routing(40, seed=12)
    activation = ACTIVATIONS["situ"]
    launches = count_launches(monkeypatch, moe_quant_prefill)
    got = provider.routed(0, x.cuda(), chosen.cuda(), weights.cuda(), activation).cpu()
    assert len(launches) == 1
    exact = float64_reference(roles, x, chosen, weights, activation)
    assert ((got.double() - exact).abs() <= bound(roles, x, chosen, weights, activation,
                                                   2 * N_TERMS * EPS32)).all()
