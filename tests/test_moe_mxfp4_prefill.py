"""The fused prefill MoE kernels (engine.kernels.moe_mxfp4_prefill) against float64 and the torch path.

Where they run. On CUDA with Triton; or, with no GPU, under Triton's interpreter
(`TRITON_INTERPRET=1 pytest tests/test_moe_mxfp4_prefill.py` with triton installed), which
runs the same kernels on CPU tensors for float32 and float16 x (its bf16 `tl.dot` is wrong
in Triton 3.9, so the bf16 cases need CUDA). Otherwise the kernel tests are skipped; what
runs everywhere (CI) is the device-side layout, the dispatch (`prefill_applies` is False on
CPU), the fallback on a kernel error, and the torch reference against
`engine.experts.accumulate_routed`.

Tolerances (float32 x). The kernels multiply the dequantized weights exactly (the MXFP4
decoding and its scalings are powers of two; float32 x goes through tl.dot with
input_precision "ieee", no tf32) and sum in float32 in an order of their own: per output,
n = d_in + inter + k rounded terms along the way (the dot products over d_in, the
activation's inputs feeding the dot product over inter, the sum over k). Any order keeps
the result within n * 2**-24 of the exact value relative to the sum of the terms'
magnitudes; the activation adds a few ulp of its own value, which that magnitude covers
many times over. The tests compare with a float64 evaluation of the same dequantized
weights and allow 2 * n * 2**-24 times that magnitude, computed with |W|, |x| and the
activation of the absolute sums (an upper bound of |act| for swiglu and situ).

Tolerances (bfloat16 x). x is bf16, and the weights are exact in bf16 (2-bit significands
times powers of two), so against float64 of the same bf16 x the kernels add to the float32
bound above two roundings to bf16 (unit roundoff u = 2**-8): the activation, stored in bf16
for the down projection (a relative u on each act term: at most u times the magnitude), and
the output (u of its value, below the magnitude). Allowed: (2 u + 2 n 2**-24) * magnitude.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine.experts import ExpertActivation, QuantTensor, ResidentExperts
from engine.kernels import moe_mxfp4_prefill, triton_switch
from engine.kernels.moe import ExpertRows
from engine.kernels.moe_mxfp4_prefill import (
    SplitExperts,
    experts_used,
    fused_moe_prefill,
    moe_prefill_reference,
    prefill_applies,
    prefill_error,
    prefill_layout,
    split_experts,
    supported,
)
from quant_experts import dense, float64_reference, moved_to

D_IN, INTER, N_EXPERTS, K = 256, 128, 16, 6
USED = 13  # experts 13, 14, 15 are never chosen; expert 0 is chosen by every token
EPS32 = 2.0 ** -24
U_BF16 = 2.0 ** -8
N_TERMS = D_IN + INTER + K

HAS_TRITON = moe_mxfp4_prefill.triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if HAS_TRITON and torch.cuda.is_available() and not INTERPRET:
    KERNEL_DEVICE: str | None = "cuda"
elif HAS_TRITON and INTERPRET:
    KERNEL_DEVICE = "cpu"  # Triton's interpreter runs the kernels on CPU tensors
else:
    KERNEL_DEVICE = None

needs_kernels = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="needs CUDA and Triton, or Triton with TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="needs CUDA and Triton (not interpreted)")

ACTIVATIONS = {
    "swiglu": ExpertActivation("swiglu", limit=0.0),
    "swiglu-limit7": ExpertActivation("swiglu", limit=7.0),
    "situ": ExpertActivation("situ", beta=3.0, linear_beta=5.0),
}
TOKENS = [1, 7, 64, 300]  # BLOCK_M 16, 16, 32, 64; at 300 expert 0 spans five M-blocks
# The default tiles; small ones (several K steps over both reduced dims, BLOCK_N 32); and
# BLOCK_M 128 whatever T (8 warps), the largest M-block the benchmark tries.
CONFIGS = {
    "default": None,
    "small-tiles": ((32, 64, 4, 2), (32, 64, 4, 2), None),
    "block-m-128": ((128, 64, 8, 2), (128, 64, 8, 2), ((float("inf"), 128),)),
}


SHAPES = {"gate": (INTER, D_IN), "up": (INTER, D_IN), "down": (D_IN, INTER)}


def expert_roles(strided: bool, seed: int = 0) -> dict[str, ExpertRows]:
    """This module's experts (N_EXPERTS, D_IN, INTER): see quant_experts.expert_roles."""
    return quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, strided, seed)


def routing(tokens: int, seed: int, scale: float = 4.0):
    """`quant_experts.routing_with_a_hot_expert` at this file's widths."""
    return quant_experts.routing_with_a_hot_expert(tokens, seed, D_IN, K, USED, scale)


def run_fused(roles, x, chosen, weights, activation) -> torch.Tensor:
    """fused_moe_prefill on the kernel device (the interpreter's CPU or CUDA), result on the CPU."""
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    xd = x.to(dev)
    assert supported(xd, moved["gate"], moved["up"], moved["down"], activation)
    if dev.type == "cuda":
        assert prefill_applies(xd, chosen.shape[1], moved["gate"], moved["up"], moved["down"], activation)
    out = fused_moe_prefill(xd, chosen.to(dev), weights.to(dev), moved["gate"], moved["up"], moved["down"],
                            activation)
    assert prefill_error() is None, f"the kernels fell back: {prefill_error()!r}"
    assert out.dtype == x.dtype and out.shape == (x.shape[0], D_IN)
    return out.cpu()


@pytest.fixture
def config(request, monkeypatch):
    tiles = CONFIGS[request.param]
    if tiles is not None:
        monkeypatch.setattr(moe_mxfp4_prefill, "GATE_UP_CONFIG", tiles[0])
        monkeypatch.setattr(moe_mxfp4_prefill, "DOWN_CONFIG", tiles[1])
        if tiles[2] is not None:
            monkeypatch.setattr(moe_mxfp4_prefill, "BLOCK_M_STEPS", tiles[2])
    return request.param


# ---------------------------------------------------------------------------------------
# The kernels (CUDA, or the interpreter).


@needs_kernels
@pytest.mark.parametrize("config", list(CONFIGS), indirect=True)
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_float32_equals_float64_within_summation_order(tokens, act_name, strided, config):
    if INTERPRET and config != "default" and tokens > 7:
        pytest.skip("interpreter: small tiles only at small T (slow)")
    activation = ACTIVATIONS[act_name]
    roles = expert_roles(strided, seed=tokens)
    x, chosen, weights = routing(tokens, seed=tokens + 10)
    got = run_fused(roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    bound = 2 * N_TERMS * EPS32 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    if act_name == "swiglu-limit7":  # the clamp was exercised
        gate = x.double() @ dense(roles["gate"])[0].T
        assert (gate > 7).any()
    # A real bug (one pair's expert swapped for an unused one) is far outside that bound.
    wrong = chosen.clone()
    wrong[0, 0] = N_EXPERTS - 1
    bad = run_fused(roles, x, wrong, weights, activation)
    assert not ((bad.double() - exact).abs() <= bound).all()


@needs_cuda
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_bfloat16_against_float64(tokens, act_name, strided):
    activation = ACTIVATIONS[act_name]
    roles = expert_roles(strided, seed=tokens + 1)
    x, chosen, weights = routing(tokens, seed=tokens + 20)
    x = x.to(torch.bfloat16)
    got = run_fused(roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    bound = (2 * U_BF16 + 2 * N_TERMS * EPS32) * magnitude
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("tokens", [7, 64])
def test_fused_float16_against_float64(tokens):
    """fp16 x: the weights are rounded to fp16 as the torch path's dequantization rounds them
    (exact for these: no weight below fp16's normal range here), so the bf16 reasoning
    holds with u = 2**-11."""
    activation = ACTIVATIONS["swiglu-limit7"]
    roles = expert_roles(False, seed=tokens + 2)
    x, chosen, weights = routing(tokens, seed=tokens + 30, scale=1.0)
    x = x.to(torch.float16)
    got = run_fused(roles, x, chosen, weights, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    w16 = {name: dense(r) for name, r in roles.items()}
    assert all(bool((v.to(torch.float16).double() == v).all()) for v in w16.values())
    bound = (2 * 2.0 ** -11 + 2 * N_TERMS * EPS32) * magnitude
    assert ((got.double() - exact).abs() <= bound).all()


@needs_cuda
def test_fused_is_deterministic_and_matches_the_torch_path():
    activation = ACTIVATIONS["situ"]
    roles = moved_to("cuda", expert_roles(True, seed=5))
    x, chosen, weights = routing(300, seed=6)
    x, chosen, weights = x.cuda().to(torch.bfloat16), chosen.cuda(), weights.cuda()
    args = (x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    first, second = fused_moe_prefill(*args), fused_moe_prefill(*args)
    assert torch.equal(first, second)
    # The torch path in bf16 rounds the gate/up outputs, the activation, the down output and
    # the weighted terms to bf16 along the way: a loose, order-of-magnitude comparison.
    ref = moe_prefill_reference(*args).float()
    assert (first.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def _decode_all_codes_and_scales(asm: bool, device: torch.device) -> torch.Tensor:
    """`_split_tile` (bf16, SCALE_MODE 0) over 256 rows of one MXFP4 block each: row n has the
    E8M0 scale n and the 32 codes 0..15, 0..15 (byte j holds codes 2 j mod 16 and 2 j + 1
    mod 16). Returns the decoded bf16 [256, 32] (weights times 2**-15), on the CPU."""
    codes = torch.arange(32) % 16
    row = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
    values = row.repeat(256, 1).to(device)  # [N, K / 2]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None, :].to(device)  # [K / 32, N]
    out = torch.empty((256, 32), dtype=torch.bfloat16, device=device)
    _decode_kernel[(1,)](values, scales, out, ASM=asm)
    return out.cpu()


if HAS_TRITON:
    import triton
    import triton.language as tl

    from engine.kernels.moe_mxfp4_prefill import _split_rows, _split_tile

    @triton.jit
    def _decode_kernel(values, scales, out, ASM: tl.constexpr):
        n = tl.arange(0, 256)
        v, e = _split_rows(values, scales, 0, 0, 0, n, 32, 256, 32)
        w = _split_tile(v, e, 0, 256, n < 256, tl.bfloat16, 0, ASM, 256, 32)
        tl.store(out + n[:, None] * 32 + tl.arange(0, 32)[None, :], w)


@needs_cuda
@pytest.mark.parametrize("asm", [True, False], ids=["packed-bf16", "float32"])
def test_each_code_at_each_scale_decodes_to_the_weight_correctly_rounded(asm):
    """Both decodes of the split layout, all 16 codes at all 256 E8M0 scales, against the weight
    times 2**-15 (E2M1 value * 2**(e - 127) * 2**-15, exact in float64) rounded to bf16 by torch:
    bit for bit, the subnormal scales (e < 2), the weights rounded onto bf16's subnormals and
    those flushed to zero included."""
    if asm and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the packed decode needs sm_90")
    got = _decode_all_codes_and_scales(asm, torch.device("cuda"))
    e = torch.arange(256, dtype=torch.float64)[:, None]
    exact = E2M1[torch.arange(32) % 16][None, :] * torch.pow(2.0, e - 127 - 15)
    expected = exact.to(torch.float32).to(torch.bfloat16)  # exact in float32: one rounding, to bf16
    assert torch.equal(exact.to(torch.float32).double(), exact)
    assert (expected == 0).any() and ((expected != 0) & (expected.abs() < 2.0 ** -126)).any()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_cuda
def test_bf16_decode_in_packed_asm_equals_the_float32_decode_bit_for_bit(monkeypatch):
    """bf16 x on sm_90, the whole prefill: the weights decoded by `_E2M1_BF16_ASM` (bf16x2
    multiplies) and by the float32 decode (EXPERTDESK_MXFP4_ASM=0) give the same outputs bit for
    bit, with block scales random over E8M0 100..134 (weights up to 6 * 2**7) and every code."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the packed decode needs sm_90")
    activation = ACTIVATIONS["swiglu"]
    roles = expert_roles(False, seed=15)
    g = torch.Generator().manual_seed(16)
    for rows in roles.values():
        blocks = rows.table.view(N_EXPERTS, -1, 17)
        blocks[:, :, 0] = torch.randint(100, 135, blocks[:, :, 0].shape, dtype=torch.uint8, generator=g)
        assert len(torch.unique(torch.cat([blocks[:, :, 1:] & 15, blocks[:, :, 1:] >> 4]))) == 16
    x, chosen, weights = routing(64, seed=17)
    x = x.to(torch.bfloat16)
    assert moe_mxfp4_prefill.packed_decode_applies(x.cuda())
    packed = run_fused(roles, x, chosen, weights, activation)
    monkeypatch.setenv("EXPERTDESK_MXFP4_ASM", "0")
    assert not moe_mxfp4_prefill.packed_decode_applies(x.cuda())
    plain = run_fused(roles, x, chosen, weights, activation)
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(packed, plain)


@needs_cuda
def test_out_of_range_expert_ids_contribute_zero():
    """Ids outside [0, E) are not checked on the host (a sync); their pairs add nothing."""
    activation = ACTIVATIONS["swiglu"]
    roles = expert_roles(False, seed=7)
    x, chosen, weights = routing(7, seed=8)
    bad = chosen.clone()
    bad[2, 1] = N_EXPERTS + 3
    bad[4, 0] = -1
    got = run_fused(roles, x, bad, weights, activation)
    keep = torch.ones_like(weights)
    keep[2, 1] = keep[4, 0] = 0
    exact = float64_reference(roles, x, chosen, weights * keep, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    assert ((got.double() - exact).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()


# OCP MX E2M1 values of the 16 codes (sign bit 3): the split layout's codes, decoded by the test.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)
SENTINEL = 0xA5


def decoded_split(split: SplitExperts, entry: int) -> torch.Tensor:
    """float64 [N, K] of the split copy's entry: code 2 j in byte j's low nibble, 2 j + 1 in its
    high one, times 2**(e - 127) for the E8M0 byte e of its 32 columns (scales [K / 32, N])."""
    v = split.values[entry].cpu().long()
    codes = torch.stack([v & 15, v >> 4], dim=-1).reshape(v.shape[0], -1)
    scale = torch.pow(2.0, split.scales[entry].cpu().double().T - 127).repeat_interleave(32, dim=1)
    return E2M1[codes] * scale


@needs_kernels
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
def test_split_copies_hold_the_used_experts_exactly_and_leave_the_rest(strided):
    """`split_experts` against gguf's own MXFP4 dequantization (gguf.quants), for a pass that
    starts at expert 10 and holds 5 entries: used experts 10..12 land in entries 0..2 exactly,
    the entries of 13 and 14 (never chosen) keep what was there."""
    dev = torch.device(KERNEL_DEVICE)
    roles = moved_to(dev, expert_roles(strided, seed=11))
    _, chosen, _ = routing(7, seed=12)
    used = experts_used(prefill_layout(chosen.to(dev), N_EXPERTS, 16)[1], N_EXPERTS)
    assert used.tolist() == [int((chosen == e).any()) for e in range(N_EXPERTS)]
    first, group = 10, 5
    marked = [e for e in range(first, first + group) if used[e]]
    assert marked and len(marked) < group  # both kinds of entry are checked
    for name, rows in roles.items():
        split = SplitExperts.empty(rows.shape, group, dev)
        split.values.fill_(SENTINEL)
        split.scales.fill_(SENTINEL)
        split_experts(rows, used, first, split)
        table = rows.table.cpu().numpy()
        nbytes = rows.shape[0] * rows.shape[1] // 32 * 17
        for e in range(first, first + group):
            if e in marked:
                expected = quants.dequantize(np.ascontiguousarray(table[e, :nbytes]), Q.MXFP4).reshape(rows.shape)
                assert torch.equal(decoded_split(split, e - first), torch.from_numpy(expected).double()), (name, e)
            else:
                assert bool((split.values[e - first] == SENTINEL).all() and (split.scales[e - first] == SENTINEL).all())


@needs_kernels
def test_several_passes_give_the_one_pass_result_bit_for_bit(monkeypatch):
    """With room for 3 experts' split copies (`group_size`), 16 experts take 6 passes; every
    pair is computed once, by the same programs, so the result is the one-pass result exactly,
    out-of-range ids (zeroed in the first pass only) included."""
    dev = torch.device(KERNEL_DEVICE)
    activation = ACTIVATIONS["swiglu-limit7"]
    roles = moved_to(dev, expert_roles(True, seed=13))
    x, chosen, weights = routing(64, seed=14)
    chosen[3, 1] = N_EXPERTS + 2
    args = (x.to(dev), chosen.to(dev), weights.to(dev), roles["gate"], roles["up"], roles["down"], activation)
    one = fused_moe_prefill(*args)
    assert moe_mxfp4_prefill.group_size(roles["gate"].shape, roles["down"].shape, N_EXPERTS, dev) == N_EXPERTS
    per_expert = (2 * INTER * D_IN + D_IN * INTER) * 17 // 32
    monkeypatch.setattr(moe_mxfp4_prefill, "batch_budget", lambda device: 3 * per_expert + 1)
    assert moe_mxfp4_prefill.group_size(roles["gate"].shape, roles["down"].shape, N_EXPERTS, dev) == 3
    nan_filled(monkeypatch)  # a pass left out would leave NaN, not the one-pass call's values
    several = fused_moe_prefill(*args)
    assert prefill_error() is None
    assert torch.equal(one, several)
    keep = torch.ones_like(weights)
    keep[3, 1] = 0
    exact = float64_reference(roles, x, torch.where(keep > 0, chosen, 0), weights * keep, activation)
    magnitude = float64_reference(roles, x, torch.where(keep > 0, chosen, 0), weights, activation, absolute=True)
    assert ((several.cpu().double() - exact).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()


def nan_filled(monkeypatch) -> None:
    """From now on the kernels' act and y buffers start as NaN (not as whatever memory the
    allocator hands back, which may hold an earlier call's results)."""
    make = moe_mxfp4_prefill.PrefillBuffers.make

    def filled(*args, **kwargs):
        b = make(*args, **kwargs)
        b.act.fill_(float("nan"))
        b.y.fill_(float("nan"))
        return b

    monkeypatch.setattr(moe_mxfp4_prefill.PrefillBuffers, "make", filled)


@needs_kernels
def test_split_buffers_that_do_not_fit_are_halved_and_give_the_same_result(monkeypatch):
    """Allocating the split copies for more than 4 experts runs out of memory here (other work
    took what `group_size` saw free): the passes hold 4 experts instead, and the result is the
    one-pass result bit for bit, with the fused path still on."""
    dev = torch.device(KERNEL_DEVICE)
    activation = ACTIVATIONS["situ"]
    roles = moved_to(dev, expert_roles(False, seed=18))
    x, chosen, weights = routing(64, seed=19)
    args = (x.to(dev), chosen.to(dev), weights.to(dev), roles["gate"], roles["up"], roles["down"], activation)
    one = fused_moe_prefill(*args)
    empty = SplitExperts.empty.__func__
    sizes = []

    def tight(cls, shape, group, device):
        sizes.append(group)
        if group > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return empty(cls, shape, group, device)

    monkeypatch.setattr(SplitExperts, "empty", classmethod(tight))
    nan_filled(monkeypatch)
    halved = fused_moe_prefill(*args)
    assert prefill_error() is None
    assert sizes[0] == N_EXPERTS and sizes[-1] == 4 and set(sizes) == {16, 8, 4}
    assert torch.equal(one, halved)


@needs_kernels
def test_a_layer_of_no_experts_gives_zeros():
    """A table of zero experts: every pair's id is out of range, so every output is zero (one pass
    runs, whose down kernel writes them), not the memory the buffers started with."""
    dev = torch.device(KERNEL_DEVICE)
    roles = {name: ExpertRows(r.table[:0], r.ggml_type, r.shape) for name, r in expert_roles(False).items()}
    x, chosen, weights = routing(7, seed=20)
    out = moe_mxfp4_prefill._launch(x.to(dev), chosen.to(dev), weights.to(dev), roles["gate"], roles["up"],
                                    roles["down"], ACTIVATIONS["swiglu"])
    assert torch.equal(out.cpu(), torch.zeros_like(x))


# ---------------------------------------------------------------------------------------
# Everywhere (CI): layout, dispatch, fallback, the reference.


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (7, 16), (64, 32), (300, 64)])
def test_layout_groups_every_pair_by_expert_in_padded_blocks(tokens, block_m):
    _, chosen, _ = routing(tokens, seed=tokens)
    if tokens > 2:
        chosen[2, 2] = N_EXPERTS + 1  # out of range: a bucket of its own, block_expert -1
    sorted_ids, block_expert = prefill_layout(chosen, N_EXPERTS, block_m)
    pairs = chosen.numel()
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids.numel() == block_expert.numel() * block_m
    valid = sorted_ids[sorted_ids >= 0].long()
    assert sorted(valid.tolist()) == list(range(pairs))  # every pair exactly once
    flat = chosen.reshape(-1)
    slot_expert = block_expert.long().repeat_interleave(block_m)
    for slot in torch.nonzero(sorted_ids >= 0).reshape(-1).tolist():
        e = int(flat[int(sorted_ids[slot])])
        assert int(slot_expert[slot]) == (e if 0 <= e < N_EXPERTS else -1)
    # Within an expert, pairs keep their order (stable), and blocks of one expert are contiguous.
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used)
    for e in set(used):
        ids = sorted_ids[slot_expert == e]
        ids = ids[ids >= 0].tolist()
        assert ids == sorted(ids) and len(ids) == int((flat == e).sum())
        assert used.count(e) == -(-len(ids) // block_m)  # padded to whole blocks, no empty block


def test_prefill_applies_is_false_on_cpu():
    roles = expert_roles(False)
    x, _, _ = routing(7, seed=1)
    for activation in ACTIVATIONS.values():
        assert not prefill_applies(x, K, roles["gate"], roles["up"], roles["down"], activation)
    # And the operand checks reject what the kernels cannot take, wherever they run.
    assert supported(x, roles["gate"], roles["up"], roles["down"], ACTIVATIONS["situ"])
    assert not supported(x.double(), roles["gate"], roles["up"], roles["down"], ACTIVATIONS["situ"])
    assert not supported(x, roles["gate"], roles["up"], roles["down"], ExpertActivation("situ", beta=0.0))
    q8 = ExpertRows(roles["down"].table, int(Q.Q8_0), roles["down"].shape)
    assert not supported(x, roles["gate"], roles["up"], q8, ACTIVATIONS["swiglu"])


def test_kernel_error_warns_once_falls_back_and_turns_the_path_off(monkeypatch):
    roles = expert_roles(False)
    x, chosen, weights = routing(7, seed=2)
    activation = ACTIVATIONS["swiglu-limit7"]

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(triton_switch, "triton", triton_switch.triton or object())
    monkeypatch.setattr(moe_mxfp4_prefill, "_launch", broken)
    monkeypatch.setattr(moe_mxfp4_prefill.SWITCH, "error", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that the CPU tensors reach the launch
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        got = fused_moe_prefill(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    assert isinstance(prefill_error(), RuntimeError)
    ref = moe_prefill_reference(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    assert torch.equal(got, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: the path is off
        again = fused_moe_prefill(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    assert torch.equal(again, ref)
    if torch.cuda.is_available():
        moved = moved_to("cuda", roles)
        assert not prefill_applies(x.cuda(), K, moved["gate"], moved["up"], moved["down"], activation)


def test_a_packed_decode_that_fails_warns_once_and_the_float32_decode_runs(monkeypatch):
    """If the packed bf16 decode cannot compile or launch (say, an assembler that rejects its
    PTX), the kernels run with the float32 decode instead, a warning says so once, and only the
    packed decode is turned off (the fused path stays on)."""
    calls = []

    def routed_sum(*args, asm):
        calls.append(asm)
        if asm:
            raise RuntimeError("ptxas rejected the asm")
        return torch.ones(3)

    monkeypatch.setattr(moe_mxfp4_prefill, "triton", moe_mxfp4_prefill.triton or object())
    monkeypatch.setattr(moe_mxfp4_prefill, "_routed_sum", routed_sum)
    monkeypatch.setattr(moe_mxfp4_prefill, "packed_decode_applies",
                        lambda x: moe_mxfp4_prefill.ASM_SWITCH.error is None)
    monkeypatch.setattr(moe_mxfp4_prefill.ASM_SWITCH, "error", None)
    monkeypatch.setattr(moe_mxfp4_prefill.SWITCH, "error", None)
    args = (torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), None, None, None, None)
    with pytest.warns(RuntimeWarning, match="packed bf16 MXFP4 decode.*ptxas rejected the asm.*float32 decode"):
        first = moe_mxfp4_prefill._launch(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = moe_mxfp4_prefill._launch(*args)
    assert calls == [True, False, False]
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.ones(3))
    assert moe_mxfp4_prefill.SWITCH.error is None


@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_reference_equals_accumulate_routed(tokens, act_name):
    """moe_prefill_reference against the ResidentExperts provider (expert by expert through
    engine.experts.accumulate_routed on CPU), within the float32 summation-order bound."""
    activation = ACTIVATIONS[act_name]
    raw = {name: quant_experts.quantized_values((N_EXPERTS, *shape), tokens + i)
           for i, (name, shape) in enumerate(SHAPES.items())}
    stacked = {name: QuantTensor(torch.from_numpy(raw[name].copy()).reshape(-1), int(Q.MXFP4),
                                 (N_EXPERTS, *SHAPES[name])) for name in SHAPES}
    provider = ResidentExperts({0: stacked})
    roles = {name: ExpertRows(torch.from_numpy(raw[name].copy()), int(Q.MXFP4), SHAPES[name]) for name in SHAPES}
    x, chosen, weights = routing(tokens, seed=tokens + 40)
    expected = provider.routed(0, x, chosen, weights, activation)
    got = moe_prefill_reference(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    assert ((got.double() - expected.double()).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()
    exact = float64_reference(roles, x, chosen, weights, activation)
    assert ((got.double() - exact).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()


def test_reference_rejects_out_of_range_experts():
    roles = expert_roles(False)
    x, chosen, weights = routing(3, seed=3)
    chosen[0, 0] = N_EXPERTS
    with pytest.raises(IndexError):
        moe_prefill_reference(x, chosen, weights, roles["gate"], roles["up"], roles["down"], ACTIVATIONS["swiglu"])
