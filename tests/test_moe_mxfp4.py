"""The fused MXFP4 expert kernels (engine.kernels.moe_mxfp4) against float64 and the torch path.

Where they run. On CUDA with Triton; or, with no GPU, under Triton's interpreter
(`TRITON_INTERPRET=1 pytest tests/test_moe_mxfp4.py` with triton installed), which runs
the same kernels on CPU tensors. Otherwise the kernel tests are skipped, and what runs
everywhere is the dispatch: on CPU `grouped_expert_mlp` takes the torch path.

Tolerances (float32 x). The kernels compute the float32 products of the dequantized
weights (the MXFP4 decoding and every scaling in it are exact: powers of two) and
sum them in float32, in an order of their own: per output, n = d_in + inter + k
rounded terms along the way (the dot products over d_in, the activation's inputs
feeding the dot product over inter, the sum over k). Any order keeps the result
within n * 2**-24 of the exact value relative to the sum of the terms' magnitudes;
the activation adds a few ulp of its own value (exp, tanh, one division), which that
same magnitude covers many times over. The test compares with a float64 evaluation of
the same dequantized weights and allows 2 * n * 2**-24 times the magnitude, computed
with |W|, |x| and the activation of the absolute sums (an upper bound of |act| for
swiglu and situ), as tests/test_moe_kernels.py does.

Tolerances (bfloat16 x). Against float64 (of the bf16 x): the float32 bound above plus
the one rounding of the output to bf16 (2**-8 of its value: bf16 keeps 8 significant
bits). Against the torch path in bf16: that path rounds to bf16 (unit roundoff
u = 2**-8) the gate and up outputs, the activation, the down output, the routing
weights, their product with it, and the sum over k (at most k - 1 roundings). A
relative error u in the gate moves the activation by at most 1.28 u of its magnitude
(max |z act'(z)| / act(|z|) over silu and situ's gate factor: 1 + max z (1 - sigmoid z)
= 1.28), in the up input by at most u. That is (1.28 + 1 + 1 + 1 + 1 + 1 + (k - 1)) u,
plus the fused path's own output rounding u; the test allows 2**-8 * (8 + k) times the
magnitude, plus both paths' float32 bounds.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine.experts import ExpertActivation
from engine.kernels import moe_mxfp4
from engine.kernels.moe import ExpertRows, grouped_expert_mlp, grouped_expert_mlp_reference
from engine.kernels.moe_mxfp4 import fused_applies, fused_error, fused_expert_mlp, supported
from quant_experts import dense, float64_reference, moved_to

D_IN, INTER, N_EXPERTS, K = 256, 96, 8, 6
EPS32 = 2.0 ** -24
U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)
N_TERMS = D_IN + INTER + K

HAS_TRITON = moe_mxfp4.triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if HAS_TRITON and torch.cuda.is_available():
    KERNEL_DEVICE: str | None = "cuda"
elif HAS_TRITON and INTERPRET:
    KERNEL_DEVICE = "cpu"  # Triton's interpreter runs the kernels on CPU tensors
else:
    KERNEL_DEVICE = None

needs_kernels = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="needs CUDA and Triton, or Triton with TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()) or INTERPRET, reason="needs CUDA and Triton (not interpreted)")

ACTIVATIONS = {
    "swiglu": ExpertActivation("swiglu", limit=0.0),
    "swiglu-limit7": ExpertActivation("swiglu", limit=7.0),
    "situ": ExpertActivation("situ", beta=3.0, linear_beta=5.0),
}
# The kernels' default blocks (at these widths a partial last step: masked loads); small
# ones: several steps over d_in, a partial last step over inter (96 = 1.5 * 64) and a
# partial last block of rows (96 of 2 * 64); and blocks that divide both widths, so
# that no load is masked (the path real model widths take).
CONFIGS = {"default": None, "small-blocks": ((64, 64, 4), (64, 64, 2)), "unmasked": ((32, 128, 4), (32, 32, 2))}


def expert_roles(strided: bool, seed: int = 0) -> dict[str, ExpertRows]:
    """This module's experts (N_EXPERTS, D_IN, INTER): see quant_experts.expert_roles."""
    return quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, strided, seed)


def routing(tokens: int, seed: int, scale: float = 4.0):
    """x with std `scale` (gate outputs of std ~4: the limit 7 clamps some), K distinct experts
    per token, but token 1 (if any) picks one expert twice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D_IN, generator=g) * scale
    chosen = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(tokens)])
    if tokens > 1:
        chosen[1, 3] = chosen[1, 0]
    weights = torch.rand(tokens, K, generator=g) + 0.1
    return x, chosen, weights


def run_fused(roles, x, chosen, weights, activation) -> torch.Tensor:
    """fused_expert_mlp on the kernel device (the interpreter's CPU or CUDA), result on the CPU."""
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    assert supported(x.to(dev), moved["gate"], moved["up"], moved["down"], activation)
    out = fused_expert_mlp(x.to(dev), chosen.to(dev), weights.to(dev), moved["gate"], moved["up"], moved["down"],
                           activation)
    assert fused_error() is None, f"the kernels fell back: {fused_error()!r}"
    return out.cpu()


@pytest.fixture
def config(request, monkeypatch):
    blocks = CONFIGS[request.param]
    if blocks is not None:
        monkeypatch.setattr(moe_mxfp4, "GATE_UP_CONFIG", blocks[0])
        monkeypatch.setattr(moe_mxfp4, "DOWN_CONFIG", blocks[1])
    return request.param


@needs_kernels
@pytest.mark.parametrize("config", list(CONFIGS), indirect=True)
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize("act_name", list(ACTIVATIONS))
@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_float32_equals_float64_within_summation_order(tokens, act_name, strided, config):
    activation = ACTIVATIONS[act_name]
    roles = expert_roles(strided, seed=tokens)
    x, chosen, weights = routing(tokens, seed=tokens + 10)
    got = run_fused(roles, x, chosen, weights, activation)
    assert got.dtype == torch.float32 and got.shape == (tokens, D_IN)
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    bound = 2 * N_TERMS * EPS32 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    if act_name == "swiglu-limit7":  # the clamp was exercised
        gate = torch.einsum("oi,ti->to", dense(roles["gate"])[int(chosen[0, 0])], x.double())
        assert (gate > 7).any()
    # A real bug (one expert swapped for another) is far outside that bound.
    wrong = chosen.clone()
    wrong[0, 0] = next(e for e in range(N_EXPERTS) if e not in chosen[0].tolist())
    bad = run_fused(roles, x, wrong, weights, activation)
    assert not ((bad.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("act_name", ["swiglu-limit7", "situ"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_bfloat16_against_float64_and_the_torch_path(tokens, act_name):
    activation = ACTIVATIONS[act_name]
    roles = expert_roles(strided=True, seed=3)
    x, chosen, weights = routing(tokens, seed=tokens + 20)
    x = x.to(torch.bfloat16)
    got = run_fused(roles, x, chosen, weights, activation)
    assert got.dtype == torch.bfloat16
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    fp32_bound = 2 * N_TERMS * EPS32 * magnitude
    assert ((got.double() - exact).abs() <= fp32_bound * (1 + U_BF16) + U_BF16 * exact.abs()).all()
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    ref = grouped_expert_mlp_reference(x.to(dev), chosen.to(dev), weights.to(dev), moved["gate"], moved["up"],
                                       moved["down"], activation).cpu()
    assert ref.dtype == torch.bfloat16
    bound = U_BF16 * (8 + K) * magnitude + 2 * fp32_bound
    assert ((got.double() - ref.double()).abs() <= bound).all()


@needs_kernels
def test_float16_x_and_int32_rows():
    activation = ACTIVATIONS["swiglu"]
    roles = expert_roles(strided=False, seed=5)
    x, chosen, weights = routing(2, seed=30, scale=1.0)
    x = x.to(torch.float16)
    got = run_fused(roles, x, chosen.to(torch.int32), weights, activation)
    assert got.dtype == torch.float16
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    # float16 output: 11 significant bits, unit roundoff 2**-11.
    bound = 2 * N_TERMS * EPS32 * magnitude * (1 + 2.0 ** -11) + 2.0 ** -11 * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()


@needs_cuda
def test_grouped_expert_mlp_runs_fused_on_cuda():
    activation = ACTIVATIONS["situ"]
    roles = moved_to("cuda", expert_roles(strided=True, seed=7))
    x, chosen, weights = (t.cuda() for t in routing(2, seed=40))
    assert fused_applies(x, roles["gate"], roles["up"], roles["down"], activation)
    got = grouped_expert_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    want = fused_expert_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"], activation)
    assert torch.equal(got, want) and fused_error() is None


@needs_cuda
def test_fused_is_capturable_in_a_cuda_graph():
    activation = ACTIVATIONS["swiglu-limit7"]
    roles = moved_to("cuda", expert_roles(strided=True, seed=8))
    x, chosen, weights = (t.cuda() for t in routing(2, seed=50))
    static_x, static_rows, static_w = x.clone(), chosen.clone(), weights.clone()

    def step() -> torch.Tensor:
        return fused_expert_mlp(static_x, static_rows, static_w, roles["gate"], roles["up"], roles["down"],
                                activation)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    first = static_out.clone()
    assert torch.equal(first, fused_expert_mlp(x, chosen, weights, roles["gate"], roles["up"], roles["down"],
                                               activation))
    x2, chosen2, weights2 = (t.cuda() for t in routing(2, seed=51))
    static_x.copy_(x2)
    static_rows.copy_(chosen2)
    static_w.copy_(weights2)
    graph.replay()
    eager = fused_expert_mlp(x2, chosen2, weights2, roles["gate"], roles["up"], roles["down"], activation)
    torch.cuda.synchronize()
    assert fused_error() is None
    assert torch.equal(static_out, eager) and not torch.equal(static_out, first)


def test_on_cpu_grouped_expert_mlp_takes_the_torch_path():
    activation = ACTIVATIONS["swiglu-limit7"]
    roles = expert_roles(strided=True, seed=9)
    x, chosen, weights = routing(2, seed=60)
    gate, up, down = roles["gate"], roles["up"], roles["down"]
    assert supported(x, gate, up, down, activation)  # the operands would do; the device does not
    assert not fused_applies(x, gate, up, down, activation)
    got = grouped_expert_mlp(x, chosen, weights, gate, up, down, activation)
    assert torch.equal(got, grouped_expert_mlp_reference(x, chosen, weights, gate, up, down, activation))
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    assert ((got.double() - exact).abs() <= 2 * N_TERMS * EPS32 * magnitude).all()


def test_supported_operands():
    roles = expert_roles(strided=True, seed=11)
    gate, up, down = roles["gate"], roles["up"], roles["down"]
    x = torch.zeros(1, D_IN)
    assert supported(x, gate, up, down, ACTIVATIONS["situ"])
    assert supported(x.to(torch.bfloat16), gate, up, down, ACTIVATIONS["swiglu"])
    assert not supported(x.double(), gate, up, down, ACTIVATIONS["swiglu"])
    assert not supported(x, gate, up, down, ExpertActivation("gelu"))
    assert not supported(x, gate, up, down, ExpertActivation("situ", beta=0.0))
    assert not supported(x, gate, up, down, lambda g, u: g * u)  # a plain callable: the torch path
    q8 = ExpertRows(gate.table, int(Q.Q8_0), gate.shape)
    assert not supported(x, q8, up, down, ACTIVATIONS["swiglu"])
    assert not supported(torch.zeros(1, D_IN + 32), gate, up, down, ACTIVATIONS["swiglu"])
    short = ExpertRows(gate.table[:, :-1], gate.ggml_type, gate.shape)  # a row shorter than an expert
    assert not supported(x, short, up, down, ACTIVATIONS["swiglu"])


def test_kernel_failure_falls_back_to_the_torch_path(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(moe_mxfp4, "_launch", broken)
    monkeypatch.setattr(moe_mxfp4.SWITCH, "error", None)
    activation = ACTIVATIONS["situ"]
    roles = expert_roles(strided=False, seed=12)
    x, chosen, weights = routing(1, seed=70)
    gate, up, down = roles["gate"], roles["up"], roles["down"]
    with pytest.warns(RuntimeWarning, match="torch path"):
        got = fused_expert_mlp(x, chosen, weights, gate, up, down, activation)
    assert isinstance(fused_error(), RuntimeError)
    assert torch.equal(got, grouped_expert_mlp_reference(x, chosen, weights, gate, up, down, activation))
    assert not fused_applies(x, gate, up, down, activation)  # off from then on
    monkeypatch.setenv("EXPERTDESK_FUSED_MOE", "0")
    monkeypatch.setattr(moe_mxfp4.SWITCH, "error", None)
    assert not fused_applies(x, gate, up, down, activation)
