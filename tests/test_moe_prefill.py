"""A prefill chunk's experts in batches of experts (engine.kernels.moe_prefill) against
float64 and against the expert-by-expert reference (engine.experts.accumulate_routed).

It is torch code, so it runs here on the CPU exactly as on a GPU. Tolerance (float32 x):
every pair's output is the reference's math (the weights dequantized to float32, exact for
these types up to one rounding per value, then matmuls), and the sum over k is taken in
float32 in another order. Per output, n = d_in + inter + k rounded terms along the way (the
dot products over d_in, the activation's inputs feeding the dot product over inter, the sum
over k); any order keeps the result within n * 2**-24 of the exact value relative to the
sum of the terms' magnitudes, and a decoded value's own rounding adds at most one more
2**-24 relative to its term. Allowed: 2 * n * 2**-24 times that magnitude, computed in
float64 with |W|, |x| and the activation of the absolute sums.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine import experts as experts_module
from engine.experts import ExpertActivation, QuantTensor, ResidentExperts
from engine.kernels import moe_prefill
from engine.kernels.moe_prefill import batched_prefill_mlp
from quant_experts import expert_roles, float64_reference

D_IN, INTER, N_EXPERTS, K = 256, 512, 16, 4  # d_in != inter: a swapped dimension shows
USED = 13  # experts 13, 14, 15 are never chosen; expert 0 is chosen by every token
EPS32 = 2.0 ** -24
N_TERMS = D_IN + INTER + K
KIMI = "kimi-k3 (Q2_K gate/up, Q3_K down)"
TYPES = {
    KIMI: {"gate": Q.Q2_K, "up": Q.Q2_K, "down": Q.Q3_K},
    "Q8_0": {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0},
    "Q4_K / Q6_K": {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K},
}
ACTIVATIONS = {
    "swiglu-limit7": ExpertActivation("swiglu", limit=7.0),
    "situ": ExpertActivation("situ", beta=3.0, linear_beta=5.0),
}


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D_IN], chosen [T, K] (expert 0 in every row, so its token count is the largest and
    its batch pads the others; experts >= USED never; token 1 lists one expert twice), weights."""
    return quant_experts.routing_with_a_hot_expert(tokens, seed, D_IN, K, USED)


def check(got: torch.Tensor, roles, x, chosen, weights, activation) -> None:
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    exact = float64_reference(roles, x, chosen, weights, activation)
    assert got.dtype == x.dtype and got.shape == exact.shape
    err = (got.double() - exact).abs()
    assert (err <= 2 * N_TERMS * EPS32 * magnitude).all(), float((err / magnitude).max())


@pytest.mark.parametrize("types", list(TYPES))
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("batch", ["one expert a batch", "five experts a batch", "default"])
def test_float32_equals_float64_within_summation_order(types, tokens, batch):
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=tokens % 2 == 0, seed=tokens, types=TYPES[types])
    per_expert = 3 * D_IN * INTER * 4
    batch_bytes = {"one expert a batch": per_expert, "five experts a batch": 5 * per_expert + 1,
                   "default": None}[batch]
    x, chosen, weights = routing(tokens, seed=tokens + 7)
    for activation in ACTIVATIONS.values():
        got = batched_prefill_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation,
                                  batch_bytes=batch_bytes)
        check(got, roles, x, chosen, weights, activation)


def test_a_wrong_scale_breaks_the_bound():
    """The check can fail: one expert's Q2_K super-block scale doubled moves the result out."""
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, seed=3, types=TYPES[KIMI])
    x, chosen, weights = routing(16, seed=5)
    activation = ACTIVATIONS["situ"]
    tampered = roles["gate"].table.clone()
    d = tampered[0, 80:82].view(torch.float16)
    tampered[0, 80:82] = (d * 2).view(torch.uint8)
    bad = moe_prefill.ExpertRows(tampered, roles["gate"].ggml_type, roles["gate"].shape)
    got = batched_prefill_mlp(x, chosen, weights, bad, roles["up"], roles["down"], activation)
    with pytest.raises(AssertionError):
        check(got, roles, x, chosen, weights, activation)


@pytest.mark.parametrize("types", list(TYPES))
def test_resident_prefill_runs_batched_and_equals_expert_by_expert(types, monkeypatch):
    """ResidentExperts.routed on a prefill chunk: expert by expert on a CPU
    (accumulate_routed), in batches where BATCHED_PREFILL_DEVICES lists the device (a GPU);
    both within the summation-order bound of each other."""
    kinds = TYPES[types]
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, seed=11, types=kinds)
    shapes = {"gate": (INTER, D_IN), "up": (INTER, D_IN), "down": (D_IN, INTER)}
    stacked = {name: QuantTensor(r.table.reshape(-1), int(kinds[name]), (N_EXPERTS, *shapes[name]))
               for name, r in roles.items()}
    provider = ResidentExperts({0: stacked})
    x, chosen, weights = routing(40, seed=12)
    activation = ACTIVATIONS["swiglu-limit7"]
    expected = provider.routed(0, x, chosen, weights, activation)

    calls = []
    monkeypatch.setattr(experts_module, "BATCHED_PREFILL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(experts_module, "batched_prefill_mlp",
                        lambda *a, **kw: calls.append(1) or batched_prefill_mlp(*a, **kw))
    got = provider.routed(0, x, chosen, weights, activation)
    assert calls == [1]
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    assert ((got.double() - expected.double()).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()
    check(got, roles, x, chosen, weights, activation)


@pytest.mark.parametrize("bad", [N_EXPERTS, -1])
def test_out_of_range_experts_are_refused(bad):
    """Refused before any gather (on a GPU an out-of-range gather is a device-side assert)."""
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, types=TYPES["Q8_0"])
    x, chosen, weights = routing(3, seed=3)
    chosen[1, 2] = bad
    with pytest.raises(IndexError, match=rf"expert id {bad} out of range 0\.\.{N_EXPERTS - 1}"):
        batched_prefill_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"], ACTIVATIONS["situ"])


def test_no_tokens_give_an_empty_sum():
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, types=TYPES["Q8_0"])
    out = batched_prefill_mlp(torch.zeros(0, D_IN), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K),
                              roles["gate"], roles["up"], roles["down"], ACTIVATIONS["situ"])
    assert out.shape == (0, D_IN) and out.dtype == torch.float32


def test_int32_ids_one_expert_a_token_and_a_repeated_expert():
    """chosen as int32 (the routing kernels' output), top-1 routing, and a token that lists
    the same expert twice (each listing is its own pair, as in accumulate_routed)."""
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, seed=8, types=TYPES[KIMI])
    activation = ACTIVATIONS["situ"]
    x, chosen, weights = routing(20, seed=9)
    chosen[3, 1] = chosen[3, 2]
    for ids, w in ((chosen.int(), weights), (chosen[:, 1:2], weights[:, 1:2])):
        got = batched_prefill_mlp(x, ids, w, roles["gate"], roles["up"], roles["down"], activation)
        check(got, roles, x, ids.long(), w, activation)


def test_padding_is_at_most_half_of_a_batch_and_within_its_bytes():
    """Expert 0 is chosen by all 300 tokens, the others by ~70 each: the hot expert runs in a
    batch of its own instead of padding a dozen others to 300 rows; a batch's activations stay
    within batch_bytes."""
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=False, seed=6, types=TYPES["Q8_0"])
    x, chosen, weights = routing(300, seed=7)
    shapes = []

    def recording(gate, up):
        shapes.append(tuple(gate.shape[:2]))  # (experts E, padded rows m) of one batch
        return ACTIVATIONS["situ"](gate, up)

    batch_bytes = 3 * D_IN * INTER * 4 * 6
    got = batched_prefill_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"], recording,
                              batch_bytes=batch_bytes)
    check(got, roles, x, chosen, weights, ACTIVATIONS["situ"])
    assert shapes[0] == (1, int((chosen == 0).sum()))  # the hot expert alone, with all its pairs
    assert sum(e * m for e, m in shapes) <= 2 * chosen.numel()
    row_bytes = (D_IN + 3 * INTER + D_IN) * 4
    assert all(e == 1 or e * m * row_bytes <= batch_bytes for e, m in shapes)
    assert sum(e for e, _ in shapes) == USED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_float32_equals_float64_and_bfloat16_stays_near():
    """The same on a GPU (cuBLAS in IEEE float32: TF32 off by default), and bf16 x within
    the roundings of bf16 (the reference in bf16 on the CPU is not the same order)."""
    roles = expert_roles(N_EXPERTS, D_IN, INTER, strided=True, seed=21, types=TYPES[KIMI])
    moved = quant_experts.moved_to("cuda", roles)
    x, chosen, weights = routing(300, seed=22)
    activation = ACTIVATIONS["situ"]
    got = batched_prefill_mlp(x.cuda(), chosen.cuda(), weights.cuda(), moved["gate"], moved["up"], moved["down"],
                              activation, batch_bytes=3 * D_IN * INTER * 4 * 4)
    check(got.cpu(), roles, x, chosen, weights, activation)
    low = batched_prefill_mlp(x.cuda().bfloat16(), chosen.cuda(), weights.cuda(), moved["gate"], moved["up"],
                              moved["down"], activation).float().cpu()
    exact = float64_reference(roles, x, chosen, weights, activation)
    assert ((low.double() - exact).norm() / exact.norm()) < 2e-2



def test_the_batch_budget(monkeypatch):
    """A fixed budget from EXPERTDESK_PREFILL_BATCH_MIB; else on a CPU a fixed GiB, on a GPU a
    quarter of what could be allocated now, within [256 MiB, 4 GiB]."""
    monkeypatch.delenv("EXPERTDESK_PREFILL_BATCH_MIB", raising=False)
    assert moe_prefill.batch_budget(torch.device("cpu")) == moe_prefill.CPU_BATCH_BYTES == 1 << 30
    monkeypatch.setenv("EXPERTDESK_PREFILL_BATCH_MIB", "300")
    assert moe_prefill.batch_budget(torch.device("cpu")) == 300 << 20
    monkeypatch.delenv("EXPERTDESK_PREFILL_BATCH_MIB")
    gib = 1 << 30
    for free, reserved, allocated, budget in ((80 * gib, 0, 0, 4 * gib), (8 * gib, 2 * gib, gib, 9 * gib // 4),
                                              (gib // 2, 0, 0, 256 << 20)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 141 * gib))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device, r=reserved: r)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device, a=allocated: a)
        assert moe_prefill.batch_budget(torch.device("cuda", 0)) == budget
