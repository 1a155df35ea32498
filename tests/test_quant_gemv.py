"""The quantized GEMV (engine.kernels.quant_gemv) and the K-quant / Q8_0 expert kernels
(engine.kernels.moe_quant) against float64, and how the dense weights use them.

Where they run: on CUDA with Triton, or under Triton's interpreter on CPU tensors
(`TRITON_INTERPRET=1 pytest tests/test_quant_gemv.py` with triton installed); elsewhere
the kernel tests are skipped and the dispatch tests check the torch path.

Tolerances. The kernels decode the GGUF blocks exactly (the dequantized weights are
float32 values: gguf.quants' float32 operations, tested bit-exact in test_dequant) and
sum the products in float32 in an order of their own, with fused multiply-adds: a
length-K dot product in any order is within gamma_K = K u / (1 - K u) (u = 2**-24) of
the exact one, relative to sum |x| |w| (Higham, eq. 3.5; `dot_bound`). The float64
reference adds its own 2**-53 bound. A bfloat16 x is exact in float32 and float64; the
result is rounded once to bf16 (2**-8 of its value). For the expert MLP the bound is
quant_experts' float64 magnitude times 2 n u, n = d_in + inter + k terms (as
test_moe_mxfp4 argues).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine.experts import ExpertActivation, QuantTensor
from engine.kernels import dequantize, moe_quant, quant_gemv, quant_matmul
from engine.kernels.dequant import aligned_rows
from engine.kernels.moe import ExpertRows, grouped_expert_mlp, grouped_expert_mlp_reference
from engine.models.common import DenseWeights
from kernel_device import EPS32, INTERPRET, KERNEL_DEVICE, U_BF16, break_launches, needs_cuda, needs_kernels
from quant_experts import dot_bound, float64_reference, moved_to, weight

# (type, in_features): Q8_0 whole units and a last unit of 3 blocks (96 = 256 + 3 * 32 - 256);
# every K-quant over two super blocks (one step of the default SB = 2) and three (a masked step).
CASES = [(Q.Q8_0, 512), (Q.Q8_0, 352), (Q.Q2_K, 512), (Q.Q3_K, 768), (Q.Q4_K, 512), (Q.Q5_K, 768),
         (Q.Q6_K, 512)]
OUT = 9  # not a multiple of BLOCK_N: a masked last row block
WHOLE = 16  # a multiple of every BLOCK_N: no row mask (EVEN_N), the loads unpredicated on a GPU


def ids(case) -> str:
    return f"{Q(case[0]).name}-{case[1]}"


def run_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
    dev = torch.device(KERNEL_DEVICE)
    assert quant_gemv.gemv_applies(x.to(dev), ggml_type, shape)
    out = quant_gemv.quant_gemv(x.to(dev), raw.to(dev), ggml_type, shape)
    assert quant_gemv.SWITCH.error is None, f"the kernel fell back: {quant_gemv.SWITCH.error!r}"
    return out.cpu()


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize(("rows", "out"), [(1, OUT), (2, OUT), (1, WHOLE)])
def test_gemv_float32_equals_float64_within_summation_order(case, rows, out):
    ggml_type, k = case
    raw, w = weight(ggml_type, k, seed=k + rows, out=out)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = run_gemv(x, raw, ggml_type, (out, k))
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    exact = x.double() @ w.T
    bound = dot_bound(x, w)
    assert ((got.double() - exact).abs() <= bound).all()
    # The bound catches a real bug: one block's scale doubled moves its row far outside it.
    bad = raw.clone()
    block, size = GGML_QUANT_SIZES[Q(ggml_type)]
    offset = quant_experts.F16_FIELDS[Q(ggml_type)][0]
    at = (4 * k // block + 1) * size + offset  # the second block of row 4
    d = bad[at:at + 2].numpy().copy().view(np.float16) * np.float16(2)
    bad[at:at + 2] = torch.from_numpy(d.view(np.uint8))
    wrong = run_gemv(x, bad, ggml_type, (out, k))
    assert not ((wrong[:, 4].double() - exact[:, 4]).abs() <= bound[:, 4]).all()
    others = [i for i in range(out) if i != 4]
    assert ((wrong[:, others].double() - exact[:, others]).abs() <= bound[:, others]).all()


def test_a_lane_takes_one_two_or_four_words():
    assert [quant_gemv.lanes(Q.Q2_K, q) for q in (1, 2, 4)] == [16, 8, 4]
    assert quant_gemv.lanes(Q.Q8_0, 2) == 32 and quant_gemv.lanes(Q.Q4_K) == 32
    with pytest.raises(ValueError, match="1, 2 or 4 words"):  # 8 words would cross a sub-block half
        quant_gemv.lanes(Q.Q6_K, 8)


@needs_kernels
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3], CASES[6]], ids=ids)
@pytest.mark.parametrize("quads", [1, 2, 4])
def test_gemv_lanes_of_any_word_count_equal_float64_within_summation_order(case, quads, monkeypatch):
    # A lane of Q8_0, Q2_K, Q3_K or Q6_K takes 1, 2 or 4 words of 4 bytes (the benchmark's
    # sweep picks per type); each width walks every value of the row once.
    ggml_type, k = case
    block_n, sb, warps, _ = quant_gemv.config(ggml_type, k)
    monkeypatch.setattr(quant_gemv, "config", lambda t, width: (block_n, sb, warps, quads))
    raw, w = weight(ggml_type, k, seed=k + quads, out=OUT)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(quads))
    got = run_gemv(x, raw, ggml_type, (OUT, k))
    assert ((got.double() - x.double() @ w.T).abs() <= dot_bound(x, w)).all()


@needs_kernels
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=ids)
def test_gemv_bfloat16_x_rounds_once(case, monkeypatch):
    # float32 math on a bf16 x (a type without the integer path, or EXPERTDESK_X16=0; the
    # integer path has its own bounds in test_x16.py)
    monkeypatch.setenv("EXPERTDESK_X16", "0")
    ggml_type, k = case
    raw, w = weight(ggml_type, k, seed=3, out=OUT)
    x = torch.randn(2, 1, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)  # leading dims kept
    got = run_gemv(x, raw, ggml_type, (OUT, k))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1, OUT)
    exact = x.double() @ w.T
    u = 2 * U_BF16 if INTERPRET else U_BF16  # the interpreter truncates float32 -> bf16: twice the error
    bound = dot_bound(x, w) * (1 + u) + u * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize(("ggml_type", "x_dtype"), [(Q.BF16, torch.float32), (Q.F16, torch.float32),
                                                    (Q.F32, torch.bfloat16), (Q.BF16, torch.bfloat16)],
                         ids=["bf16-w-f32-x", "f16-w-f32-x", "f32-w-bf16-x", "bf16-w-bf16-x"])
def test_float_weights_are_read_in_place_in_any_x_dtype(ggml_type, x_dtype, monkeypatch):
    """A float weight in another dtype than x (a BF16 matrix in a float32 decode step) goes
    through the GEMV, not a converted copy: the values widened exactly, float32 sums."""
    from engine.kernels.dequant import FLOAT_DTYPES

    k = 768  # three 256-value units: one SB step of 2 and a masked one
    w = (torch.randn(OUT, k, generator=torch.Generator().manual_seed(21)) * 0.1).to(FLOAT_DTYPES[ggml_type])
    raw = w.reshape(-1).view(torch.uint8)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(22)).to(x_dtype)
    got = run_gemv(x, raw, ggml_type, (OUT, k))
    assert got.dtype == x_dtype
    exact = x.double() @ w.double().T
    u = 0.0 if x_dtype == torch.float32 else (2 * U_BF16 if INTERPRET else U_BF16)  # the bf16 result's rounding
    bound = dot_bound(x, w.double()) * (1 + u) + u * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    bad = w.clone()
    bad[4, 100] = bad[4, 100] * 4 + 1  # one value of row 4 changed: that row leaves the bound
    wrong = run_gemv(x, bad.reshape(-1).view(torch.uint8), ggml_type, (OUT, k))
    assert not ((wrong[:, 4].double() - exact[:, 4]).abs() <= bound[:, 4]).all()
    # QuantTensor.linear takes this kernel (no per-use conversion) for the other dtype.
    if FLOAT_DTYPES[ggml_type] != x_dtype:
        monkeypatch.setattr("engine.experts.quant_matmul", lambda *a: pytest.fail("converted per use"))
        dev = torch.device(KERNEL_DEVICE)
        tensor = QuantTensor(raw.to(dev), int(ggml_type), (OUT, k))
        assert torch.equal(tensor.linear(x.to(dev)).cpu(), got)


@needs_kernels
def test_grouped_gemv_multiplies_each_group_by_its_row_block():
    """DeepSeek-V4's grouped output projection: group g of x [n, G, in] times row block g."""
    groups, k = 3, 352
    raw = torch.from_numpy(quant_experts.quantized_values((groups * OUT, k), 12, Q.Q8_0).reshape(-1).copy())
    w = dequantize(raw, Q.Q8_0, (groups * OUT, k)).double().view(groups, OUT, k)
    x = torch.randn(2, groups, k, generator=torch.Generator().manual_seed(12))
    dev = torch.device(KERNEL_DEVICE)
    got = quant_gemv.quant_gemv(x.to(dev), raw.to(dev), Q.Q8_0, (groups * OUT, k), groups=groups).cpu()
    assert quant_gemv.SWITCH.error is None and got.shape == (2, groups * OUT)
    exact = torch.cat([x[:, g].double() @ w[g].T for g in range(groups)], dim=-1)
    bound = torch.cat([dot_bound(x[:, g], w[g]) for g in range(groups)], dim=-1)
    assert ((got.double() - exact).abs() <= bound).all()
    weight_ = QuantTensor(raw.to(dev), int(Q.Q8_0), (groups * OUT, k))
    assert torch.equal(weight_.grouped_linear(x.to(dev)).cpu(), got)


def test_grouped_linear_paths_agree():
    """QuantTensor.grouped_linear materialized (one bmm) and kept quantized (per group on
    the CPU) compute the same products."""
    groups, k = 2, 256
    raw = torch.from_numpy(quant_experts.quantized_values((groups * OUT, k), 13, Q.Q4_K).reshape(-1).copy())
    quantized = QuantTensor(raw, int(Q.Q4_K), (groups * OUT, k))
    x = torch.randn(1, groups, k, generator=torch.Generator().manual_seed(13))
    w = dequantize(raw, Q.Q4_K, (groups * OUT, k)).double().view(groups, OUT, k)
    exact = torch.cat([x[:, g].double() @ w[g].T for g in range(groups)], dim=-1)
    bound = torch.cat([dot_bound(x[:, g], w[g]) for g in range(groups)], dim=-1)
    for tensor in (quantized, quantized.materialized(torch.float32)):
        assert ((tensor.grouped_linear(x).double() - exact).abs() <= bound).all()


def test_gemv_applies_only_to_a_decode_steps_rows_and_walkable_types():
    raw, _ = weight(Q.Q8_0, 512, seed=5, out=OUT)
    x = torch.zeros(quant_gemv.MAX_ROWS, 512)
    on = quant_gemv.SWITCH.applies(x)  # CUDA or the interpreter
    assert quant_gemv.gemv_applies(x, Q.Q8_0, (OUT, 512)) == on
    assert not quant_gemv.gemv_applies(torch.zeros(quant_gemv.MAX_ROWS + 1, 512), Q.Q8_0, (OUT, 512))
    assert not quant_gemv.gemv_applies(x.double(), Q.Q8_0, (OUT, 512))
    assert not quant_gemv.gemv_applies(x, Q.MXFP4, (OUT, 512))
    assert not quant_gemv.gemv_applies(torch.zeros(1, 352), Q.Q4_K, (OUT, 352))  # not whole super blocks
    assert quant_gemv.gemv_applies(x, Q.BF16, (OUT, 512)) == on
    assert not quant_gemv.gemv_applies(torch.zeros(1, 320), Q.BF16, (OUT, 320))  # not whole 256-value units
    assert quant_gemv.reads_in_place(torch.device("cpu"), [Q.Q8_0, Q.BF16, Q.Q2_K]) == on
    assert not quant_gemv.reads_in_place(torch.device("cpu"), [Q.Q8_0, Q.Q4_0])


def test_linear_without_the_kernel_dequantizes_then_multiplies(monkeypatch):
    """QuantTensor.linear: a float type in x's dtype is read in place; a quantized weight
    goes through quant_matmul where the GEMV does not apply (here: switched off)."""
    monkeypatch.setenv("EXPERTDESK_QUANT_GEMV", "0")
    raw, w = weight(Q.Q6_K, 512, seed=6, out=OUT)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6))
    assert torch.equal(QuantTensor(raw, int(Q.Q6_K), (OUT, 512)).linear(x), quant_matmul(x, raw, Q.Q6_K, (OUT, 512)))
    bf16 = torch.randn(OUT, 512).to(torch.bfloat16)
    plain = QuantTensor(bf16.view(torch.uint8).reshape(-1), int(Q.BF16), (OUT, 512))
    xb = x.to(torch.bfloat16)
    assert torch.equal(plain.linear(xb), torch.nn.functional.linear(xb, bf16))


@needs_kernels
def test_gemv_kernel_failure_falls_back_to_dequantize_then_matmul(monkeypatch):
    break_launches(monkeypatch, quant_gemv)
    raw, _ = weight(Q.Q2_K, 512, seed=7, out=OUT)
    x = torch.randn(1, 512).to(KERNEL_DEVICE)
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_QUANT_GEMV"):
        got = quant_gemv.quant_gemv(x, raw.to(x.device), Q.Q2_K, (OUT, 512))
    assert torch.equal(got, quant_matmul(x, raw.to(x.device), Q.Q2_K, (OUT, 512)))
    assert not quant_gemv.gemv_applies(x, Q.Q2_K, (OUT, 512))  # off for the rest of the process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QuantTensor(raw.to(x.device), int(Q.Q2_K), (OUT, 512)).linear(x)  # no second warning


@needs_cuda
def test_gemv_is_capturable_in_a_cuda_graph():
    """Captured by the decode step's own graph cache (engine.graphs.StepGraphs), then
    replayed on a new input: the same result as the eager launch."""
    from engine.graphs import StepGraphs

    raw, _ = weight(Q.Q3_K, 768, seed=8, out=OUT)
    raw = raw.cuda()

    def step(x: torch.Tensor) -> torch.Tensor:
        return quant_gemv.quant_gemv(x, raw, Q.Q3_K, (OUT, 768))

    graphs = StepGraphs(enabled=True)
    graphs.run("gemv", step, torch.randn(1, 768, device="cuda"))
    x2 = torch.randn(1, 768, device="cuda")
    got = graphs.run("gemv", step, x2).clone()
    assert (graphs.captures, graphs.replays) == (1, 2)
    assert torch.equal(got, step(x2))


# ------------------------------------------------------------------ expert kernels

N_EXPERTS, D_IN, INTER, K = 6, 512, 256, 3
N_TERMS = D_IN + INTER + K
EXPERT_TYPES = {
    "kimi": {"gate": Q.Q2_K, "up": Q.Q2_K, "down": Q.Q3_K},
    "q8_0": {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q8_0},
    "q4_k-q6_k": {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K},
}
ACTIVATIONS = {
    "swiglu-limit7": ExpertActivation("swiglu", limit=7.0),
    "situ": ExpertActivation("situ", beta=3.0, linear_beta=5.0),
}


def routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D_IN, generator=g) * 4
    chosen = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g) + 0.1
    return x, chosen, weights


@needs_kernels
@pytest.mark.parametrize("types", list(EXPERT_TYPES))
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
def test_fused_quant_experts_equal_float64_within_summation_order(types, act_name, strided):
    activation = ACTIVATIONS[act_name]
    # strided: a slot pool's tables, 4-aligned like a pack's (which aligns every role to 4096)
    roles = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, strided, seed=1, types=EXPERT_TYPES[types], align=4)
    x, chosen, weights = routing(2, seed=2)
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    gate, up, down = moved["gate"], moved["up"], moved["down"]
    assert moe_quant.fused_applies(x.to(dev), gate, up, down, activation)
    got = grouped_expert_mlp(x.to(dev), chosen.to(dev), weights.to(dev), gate, up, down, activation).cpu()
    assert moe_quant.SWITCH.error is None, f"the kernels fell back: {moe_quant.SWITCH.error!r}"
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    bound = 2 * N_TERMS * EPS32 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    if act_name == "swiglu-limit7":  # the clamp was exercised
        gate_out = x.double() @ quant_experts.dense(roles["gate"])[int(chosen[0, 0])].T
        assert (gate_out > 7).any()
    wrong = chosen.clone()
    wrong[0, 0] = next(e for e in range(N_EXPERTS) if e not in chosen[0].tolist())
    bad = grouped_expert_mlp(x.to(dev), wrong.to(dev), weights.to(dev), gate, up, down, activation).cpu()
    assert not ((bad.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("types", ["kimi", "q8_0"])
def test_quant_experts_in_misaligned_tables_take_the_torch_path(types):
    """The kernels read 16- and 32-bit words: tables at odd offsets are not theirs (a
    misaligned load would fault on a GPU), and the torch path gives the same sums."""
    activation = ACTIVATIONS["situ"]
    roles = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, True, seed=1, types=EXPERT_TYPES[types], align=1)
    assert roles["gate"].table.data_ptr() % 2 == 1
    x, chosen, weights = routing(2, seed=2)
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    assert not moe_quant.fused_applies(x.to(dev), moved["gate"], moved["up"], moved["down"], activation)
    aligned = moved_to(dev, quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, True, seed=1,
                                                       types=EXPERT_TYPES[types], align=4))
    assert moe_quant.fused_applies(x.to(dev), aligned["gate"], aligned["up"], aligned["down"], activation)
    got = grouped_expert_mlp(x.to(dev), chosen.to(dev), weights.to(dev), moved["gate"], moved["up"], moved["down"],
                             activation).cpu()
    exact = float64_reference(roles, x, chosen, weights, activation)
    bound = 2 * N_TERMS * EPS32 * float64_reference(roles, x, chosen, weights, activation, absolute=True)
    assert ((got.double() - exact).abs() <= bound).all()


def test_gemv_reads_a_misaligned_weight_through_an_aligned_copy():
    """A weight whose bytes start at an odd address is copied before the kernel reads words."""
    raw = torch.arange(10, dtype=torch.uint8)
    assert quant_gemv.words_aligned(raw, Q.Q2_K) and not quant_gemv.words_aligned(raw[1:], Q.Q8_0)
    assert quant_gemv.words_aligned(raw[2:], Q.Q8_0) and not quant_gemv.words_aligned(raw[2:], Q.Q2_K)
    assert quant_gemv.words_aligned(raw[1:], Q.Q4_K)  # read a byte a load
    rows = torch.arange(12, dtype=torch.bfloat16).view(2, 6)[:, :4]  # rows of x 6 values apart: read as they are
    assert aligned_rows(rows, 4) is rows
    for x in (torch.arange(10, dtype=torch.float32)[1:9].view(2, 4),  # starts 4 bytes off a pair
              torch.arange(10, dtype=torch.bfloat16).view(2, 5)[:, :4]):  # second row at an odd element
        got = aligned_rows(x, 2 * x.element_size())
        assert got.data_ptr() % (2 * x.element_size()) == 0 and got.stride(0) % 2 == 0 and torch.equal(got, x)


def test_quant_experts_on_cpu_take_the_torch_path():
    activation = ACTIVATIONS["situ"]
    roles = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, True, seed=3, types=EXPERT_TYPES["kimi"], align=4)
    x, chosen, weights = routing(1, seed=4)
    gate, up, down = roles["gate"], roles["up"], roles["down"]
    assert moe_quant.supported(x, gate, up, down, activation)
    assert moe_quant.fused_applies(x, gate, up, down, activation) == moe_quant.SWITCH.applies(x)
    mixed = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, True, seed=3,
                                       types={"gate": Q.Q2_K, "up": Q.Q3_K, "down": Q.Q3_K}, align=4)
    assert not moe_quant.supported(x, mixed["gate"], mixed["up"], mixed["down"], activation)
    short = ExpertRows(down.table[:, :-1], down.ggml_type, down.shape)  # a row shorter than an expert
    assert not moe_quant.supported(x, gate, up, short, activation)
    if not moe_quant.SWITCH.applies(x):
        got = grouped_expert_mlp(x, chosen, weights, gate, up, down, activation)
        assert torch.equal(got, grouped_expert_mlp_reference(x, chosen, weights, gate, up, down, activation))


# ------------------------------------------------------------------ dense weights kept quantized


@dataclass
class _Info:
    ggml_type: int
    shape: tuple[int, ...]


class _Source:
    """A TensorSource of a few dense matrices."""

    def __init__(self, tensors: dict[str, tuple[int, np.ndarray]]) -> None:
        self._bytes = {name: raw for name, (_, raw) in tensors.items()}
        self.tensors = {name: _Info(t, (OUT, 512)) for name, (t, _) in tensors.items()}
        self.metadata: dict = {}

    def tensor_bytes(self, name: str) -> np.ndarray:
        return self._bytes[name]


def test_projections_kept_quantized_stack_by_type():
    """Kept quantized, the matrices that read one input are stacked per GGML type (their
    bytes concatenated; the model's weights are byte views of the stack, the originals let
    go), and each role's output equals its own product."""
    types = {"a": Q.Q8_0, "b": Q.Q2_K, "c": Q.Q8_0, "d": Q.Q2_K, "e": Q.Q6_K}
    source = _Source({name: (int(t), quant_experts.quantized_values((OUT, 512), i, t).reshape(-1))
                      for i, (name, t) in enumerate(types.items())})
    weights = DenseWeights(source)
    alone = {name: QuantTensor(weights.quant(name).raw.clone(), int(t), (OUT, 512)) for name, t in types.items()}
    p = weights.projections({name: name for name in types})
    assert [roles for _, roles in p.stacks] == [("a", "c"), ("b", "d")]
    for stack, roles in p.stacks:
        assert stack.shape == (OUT * len(roles), 512) and stack.values is None
        for i, role in enumerate(roles):
            view = weights.matrix(role)
            assert view is p.weights[role] and view.raw.data_ptr() == stack.raw[i * view.raw.numel():].data_ptr()
            assert torch.equal(view.raw, alone[role].raw)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(9))
    out = p(x)
    assert list(out) == list(types)
    for name in types:  # the stack's product and each one's are the same dequantized weights
        w = dequantize(alone[name].raw, alone[name].ggml_type, (OUT, 512)).double()
        assert ((out[name].double() - x.double() @ w.T).abs() <= 2 * dot_bound(x, w)).all(), name


def test_loader_keeps_dense_weights_quantized_where_the_gemv_reads_them(monkeypatch):
    """On a GPU whose quantized GEMV reads every dense matrix's type, the loader keeps the
    dense weights as the file stores them (no bf16 copies); it asks about the matrices'
    types only (routed experts and the embedding table are not multiplied here)."""
    import engine.loader

    asked = []

    def reads_in_place(device, types):
        asked.append((device.type, set(types)))
        return True

    monkeypatch.setattr(engine.loader, "reads_in_place", reads_in_place)
    source = _Source({"blk.0.attn_q_a.weight": (int(Q.Q8_0), quant_experts.quantized_values((OUT, 512), 1, Q.Q8_0)),
                      "blk.0.ffn_gate.weight": (int(Q.Q2_K), quant_experts.quantized_values((OUT, 512), 2, Q.Q2_K)),
                      "blk.0.ffn_up_exps.weight": (int(Q.MXFP4), np.zeros(1, np.uint8)),
                      "token_embd.weight": (int(Q.Q4_0), np.zeros(1, np.uint8))})
    keep = lambda name: True  # noqa: E731
    assert engine.loader._dense_dtype(source, torch.device("cuda"), torch.bfloat16, keep) is None
    assert asked == [("cuda", {int(Q.Q8_0), int(Q.Q2_K)})]
    # On the CPU the copies are made where they fit (a few KB here).
    assert engine.loader._dense_dtype(source, torch.device("cpu"), torch.bfloat16, keep) == torch.bfloat16
    assert len(asked) == 1


def test_kept_quantized_stacking_refuses_a_matrix_already_handed_out():
    """A holder of the original bytes would keep them beside the stack: refused, as when
    materializing."""
    source = _Source({name: (int(Q.Q8_0), quant_experts.quantized_values((OUT, 512), i, Q.Q8_0).reshape(-1))
                      for i, name in enumerate(("a", "b"))})
    weights = DenseWeights(source)
    weights.matrix("a")
    with pytest.raises(RuntimeError, match="a taken before being stacked"):
        weights.projections({"q": "a", "k": "b"})
    fresh = DenseWeights(source)
    p = fresh.projections({"q": "a", "k": "b"})
    assert fresh.matrix("a") is p.weights["q"]  # afterwards: the view into the stack


def test_reads_in_place_runs_each_quantized_type_once(monkeypatch):
    """The loader's question compiles and runs the kernel of each type: a GPU
    whose compiler cannot build it gets the bf16 copies (or per-use dequantization), not
    weights kept quantized for a kernel that will never run."""
    monkeypatch.setattr(quant_gemv.SWITCH, "applies", lambda x: True)
    monkeypatch.setattr(quant_gemv.SWITCH, "error", None)
    launched = []

    def launch(x, raw, ggml_type, out_features, in_features, groups, x16):
        launched.append(ggml_type)
        return torch.zeros(1, out_features)

    monkeypatch.setattr(quant_gemv, "_launch", launch)
    cpu = torch.device("cpu")
    assert quant_gemv.reads_in_place(cpu, [Q.Q8_0, Q.BF16, Q.Q2_K, Q.Q8_0])
    assert launched == [int(Q.Q8_0), int(Q.Q2_K), int(Q.BF16)]  # BF16: read in place by an f32 decode
    assert not quant_gemv.reads_in_place(cpu, [Q.Q8_0, Q.MXFP4])  # a type it does not walk
    break_launches(monkeypatch, quant_gemv)
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_QUANT_GEMV"):
        assert not quant_gemv.reads_in_place(cpu, [Q.Q6_K])
