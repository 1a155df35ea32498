"""The grouped routed-expert path (engine.kernels.moe) against the expert-by-expert
reference (engine.experts.accumulate_routed), and the CUDA decode pieces (grouped
resident experts, CUDA graphs) against eager runs of the same model.

Tolerances. Both paths compute the same float32 products; they differ only in the
order of summation: the dot products over d_in (gate/up) and over the intermediate
width (down) may be blocked differently by mm and bmm, and the k routed outputs are
summed by index_add_ (ascending expert) or by a sum over k. Each output is a sum of
n = d_in + inter + k rounded terms, so each path is within n * 2**-24 of the exact
value relative to the sum of the terms' magnitudes; the test compares both with a
float64 evaluation of the same dequantized weights and allows 2 * n * 2**-24 times
that magnitude (computed with |W| and |x|), not a blanket tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from engine.experts import ExpertActivation, QuantTensor, ResidentExperts, TokensByExpert, accumulate_routed
from engine.kernels import dequantize
from engine.kernels.moe import ExpertRows, grouped_expert_mlp

D_IN, INTER, N_EXPERTS, K = 256, 128, 8, 3
EPS32 = 2.0 ** -24


def stacked_experts(ggml_type: Q, seed: int) -> dict[str, QuantTensor]:
    """gate/up [E, INTER, D_IN] and down [E, D_IN, INTER], Gaussian weights quantized by gguf."""
    rng = np.random.default_rng(seed)
    roles = {}
    for role, shape in (("gate", (N_EXPERTS, INTER, D_IN)), ("up", (N_EXPERTS, INTER, D_IN)),
                        ("down", (N_EXPERTS, D_IN, INTER))):
        values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        raw = quants.quantize(values.reshape(-1, shape[-1]), ggml_type).reshape(-1)
        roles[role] = QuantTensor(torch.from_numpy(raw.view(np.uint8).copy()), int(ggml_type), shape)
    return roles


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D_IN, generator=g)
    chosen = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g) + 0.1
    return x, chosen, weights


def float64_reference(roles, x, chosen, weights, activation, absolute: bool = False) -> torch.Tensor:
    """The routed sum in float64 from the dequantized weights; with `absolute`, the sum of the
    terms' magnitudes (|W|, |x|, |act|) that bounds float32 rounding."""
    w = {name: dequantize(t.raw, t.ggml_type, t.shape).double() for name, t in roles.items()}
    xs = x.double().abs() if absolute else x.double()
    out = torch.zeros(x.shape[0], D_IN, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(K):
            e = int(chosen[t, slot])
            gate, up, down = (w[name][e].abs() if absolute else w[name][e] for name in ("gate", "up", "down"))
            act = activation(gate @ xs[t], up @ xs[t])
            out[t] += float(weights[t, slot]) * (down @ (act.abs() if absolute else act))
    return out


@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_0, Q.MXFP4], ids=lambda q: q.name)
@pytest.mark.parametrize("activation", [ExpertActivation("swiglu", limit=10.0),
                                        ExpertActivation("situ", beta=3.0, linear_beta=5.0)],
                         ids=lambda a: a.kind)
def test_grouped_path_equals_reference_within_summation_order(ggml_type, activation):
    roles = stacked_experts(ggml_type, seed=int(ggml_type))
    provider = ResidentExperts({0: roles})
    x, chosen, weights = routing(tokens=2, seed=1)
    rows = provider._expert_rows(0)
    grouped = grouped_expert_mlp(x, chosen, weights, rows["gate"], rows["up"], rows["down"], activation)
    groups = TokensByExpert.of(chosen, weights)
    assert groups.ids == sorted(set(chosen.flatten().tolist()))
    with provider.acquire(0, groups.ids) as batch:
        ref = accumulate_routed(((e, batch[e]) for e in groups.ids), x, groups, activation)
    exact = float64_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    bound = 2 * (D_IN + INTER + K) * EPS32 * magnitude
    assert ((grouped.double() - exact).abs() <= bound).all()
    assert ((ref.double() - exact).abs() <= bound).all()
    # A real bug (one expert swapped for another) is far outside that bound.
    wrong = chosen.clone()
    wrong[0, 0] = (wrong[0, 0] + 1) % N_EXPERTS
    if not (wrong[0, 0] == chosen[0, 1:]).any():
        bad = grouped_expert_mlp(x, wrong, weights, rows["gate"], rows["up"], rows["down"], activation)
        assert not ((bad.double() - exact).abs() <= bound).all()


def test_expert_rows_gather_one_dequantization_per_role():
    roles = stacked_experts(Q.Q8_0, seed=3)
    t = roles["gate"]
    rows = ExpertRows(t.raw.view(N_EXPERTS, -1), t.ggml_type, (INTER, D_IN))
    got = rows.gather(torch.tensor([5, 2, 5]), torch.float32)
    full = dequantize(t.raw, t.ggml_type, t.shape)
    assert torch.equal(got, full[[5, 2, 5]])


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.MXFP4], ids=lambda q: q.name)
def test_resident_provider_on_cuda_runs_grouped_and_matches_cpu(ggml_type):
    roles = stacked_experts(ggml_type, seed=7)
    cpu = ResidentExperts({0: roles})
    gpu = ResidentExperts({0: {n: QuantTensor(t.raw.cuda(), t.ggml_type, t.shape) for n, t in roles.items()}})
    x, chosen, weights = routing(tokens=1, seed=2)
    activation = ExpertActivation("swiglu", limit=10.0)
    assert gpu.graph_safe(x.cuda(), K) and not cpu.graph_safe(x, K)
    got = gpu.routed(0, x.cuda(), chosen.cuda(), weights.cuda(), activation).cpu()
    want = cpu.routed(0, x, chosen, weights, activation)
    magnitude = float64_reference(roles, x, chosen, weights, activation, absolute=True)
    # TF32 is off for float32 matmuls by default in torch; the same summation-order bound holds.
    assert ((got.double() - want.double()).abs() <= 4 * (D_IN + INTER + K) * EPS32 * magnitude).all()


@needs_cuda
@pytest.mark.parametrize("model", ["deepseek4-demo", "kimi-k3-tiny"])
def test_decode_from_cuda_graphs_is_bit_identical_to_eager(tmp_path, model):
    from pathlib import Path

    from engine.demo import write_demo_gguf
    from engine.graphs import StepGraphs
    from engine.loader import load_model
    from engine.options import RuntimeOptions

    if model == "deepseek4-demo":
        path = write_demo_gguf(tmp_path / "demo.gguf")
    else:
        path = Path(__file__).parent / "fixtures" / "kimi_k3" / "tiny-f32.gguf"
    tokens = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for graphs in (False, True):
        model = load_model(path, RuntimeOptions(device="cuda", dtype=torch.float32))
        model._graphs = StepGraphs(enabled=graphs)
        if hasattr(model, "static_decode"):  # the fixed-shape decode state, eager vs captured
            model.static_decode = True
        state = model.new_state()
        out = [model.forward(tokens[:8], state)]
        out += [model.forward(tokens[i:i + 1], state) for i in range(8, len(tokens))]
        runs[graphs] = torch.cat(out).cpu()
        if graphs:
            assert model._graphs.captures > 0 and model._graphs.replays > model._graphs.captures
    assert torch.equal(runs[True], runs[False])


@needs_cuda
@pytest.mark.parametrize("model", ["deepseek4-demo", "kimi-k3-tiny"])
def test_pack_decode_with_expert_graphs_is_bit_identical(tmp_path, model):
    """Through a pack on a GPU (a cache of top-k + 2 slots: misses every step), a decode step's
    grouped expert kernels replay as one CUDA graph per layer (`PackRouting.graphed`),
    reading the router's output in place and read in place by the model's next graph:
    the logits equal those of the same kernels launched eagerly, bit for bit. (That the
    pack's grouped path equals the resident model's is tested on the CPU, test_deepseek4
    and test_kimi_k3; on a GPU the resident step is one graph of other pieces.)"""
    from pathlib import Path

    from engine.demo import write_demo_gguf
    from engine.graphs import is_graph_output
    from engine.loader import load_model
    from engine.options import RuntimeOptions
    from packer.builder import build_pack

    if model == "deepseek4-demo":
        path = write_demo_gguf(tmp_path / "demo.gguf")
    else:
        path = Path(__file__).parent / "fixtures" / "kimi_k3" / "tiny-f32.gguf"
    pack = build_pack(path, tmp_path / "pack.expertpack")
    tokens = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, graphed in (("eager", False), ("graphed", True)):
        model = load_model(pack, RuntimeOptions(device="cuda", dtype=torch.float32))
        cache = model.experts
        cache.shrink((cache.manifest.expert_used_count + 2) * cache.stride)  # misses every step
        cache.graphed = graphed
        state = model.new_state()
        out = [model.forward(tokens[:8], state)]
        out += [model.forward(tokens[i:i + 1], state) for i in range(8, len(tokens))]
        # The model's graphs dropped (as at their cap, or when its state grows): the expert graphs that
        # read their outputs can never replay again, and go at the next capture; one per layer is left.
        model._graphs.reset()
        out += [model.forward(tokens[i:i + 1], state) for i in range(len(tokens) - 2, len(tokens))]
        if name == "graphed":
            blocks = [key[0][1] for key in cache._expert_graphs()._graphs]
            assert len(blocks) == len(set(blocks)) > 0
        runs[name] = torch.cat(out).cpu()
        if name == "graphed":
            graphs = cache._expert_graphs()
            assert graphs.captures > 0 and graphs.replays > graphs.captures
            # in place: each experts' graph reads the router's output (x, a model graph's output), and a
            # model graph reads the experts' output
            experts_out = {id(out) for _graph, _inputs, out in graphs._graphs.values()}
            assert all(is_graph_output(inputs[0]) for _graph, inputs, _out in graphs._graphs.values())
            assert any(id(t) in experts_out for _graph, inputs, _out in model._graphs._graphs.values() for t in inputs)
        cache.close()
        cache.store.close()
    assert torch.equal(runs["graphed"], runs["eager"])


@needs_cuda
def test_sinkhorn_kernel_matches_torch_reference():
    from engine.kernels.sinkhorn import sinkhorn, sinkhorn_reference

    logits = torch.randn(37, 4, 4, generator=torch.Generator().manual_seed(5)) * 3
    want = sinkhorn_reference(logits.double(), 20, 1e-6)
    got = sinkhorn(logits.cuda(), 20, 1e-6).cpu().double()
    ours_torch = sinkhorn_reference(logits, 20, 1e-6).double()
    # float32: each round divides by 4-term sums (a few ulp each); over 20 rounds both the
    # kernel and torch's float32 run stay within ~100 ulp of the float64 result.
    tol = 100 * EPS32 * want.abs() + 1e-12
    assert ((got - want).abs() <= tol).all()
    assert ((ours_torch - want).abs() <= tol).all()
    cols = got.sum(-2)
    assert torch.allclose(cols, torch.ones_like(cols), atol=1e-5)  # the last step normalises columns
