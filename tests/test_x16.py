"""x as 16-bit integers (engine.kernels.x16) and the integer-dot GEMV and expert kernels that
read it (quant_gemv._quad_dot_x16, moe_quant with X16), against a float64 model of the
quantization written here from its definition.

Where they run: on CUDA with Triton (dp2a in PTX), or under Triton's interpreter on CPU
tensors (the same integer sums in plain integer ops).

Tolerances. `quantize` is compared exactly with `x16_model` (round half to even of x / s,
s = 2**(floor(log2 max |x|) - 14) per group of 16). The GEMV multiplies those values: its
int32 sums are exact, and scaling them in float32 and adding K / 16 group sums is within
the float32 summation bound of a length-K dot product (`dot_bound`, the one
test_quant_gemv argues), so the kernel is checked against the float64 product of the
weights with the MODELLED x, plus bf16's rounding of the result (2**-8 of it, twice that
where the interpreter truncates). For the expert kernels the activation (float32 in the
kernel, float64 here) is quantized too: a value near a rounding boundary may round the
other way, and a group whose largest value sits at a power of two may get twice the step,
so each activation may differ from the model's by 1.5 of the model's steps
(`expert_bound`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

import quant_experts
from engine.experts import ExpertActivation
from engine.kernels import moe_quant, quant_gemv
from engine.kernels.moe import grouped_expert_mlp
from engine.kernels.x16 import quantize
from kernel_device import EPS32, INTERPRET, KERNEL_DEVICE, U_BF16, needs_cuda, needs_kernels
from quant_experts import dot_bound, float64_reference, moved_to, weight

U_OUT = 2 * U_BF16 if INTERPRET else U_BF16  # the interpreter truncates float32 -> bf16
X16_CASES = [(Q.Q2_K, 512), (Q.Q2_K, 768), (Q.Q3_K, 768), (Q.Q3_K, 512)]
OUT = 9  # not a multiple of BLOCK_N: a masked last row block
WHOLE = 16


def ids(case) -> str:
    return f"{Q(case[0]).name}-{case[1]}"


def x16_model(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q, s) of x [rows, width] from the definition: per group of 16 values, s = 2**(e - 14)
    with 2**e <= max |x| < 2**(e + 1) (at least 2**-126), twice that where the largest would
    round to 2**15, and q = x / s rounded half to even."""
    v = x.double().numpy().reshape(x.shape[0], -1, 16)
    amax = np.abs(v).max(axis=-1)
    e = np.floor(np.log2(np.where(amax > 0, amax, 2.0 ** -200)))
    s = 2.0 ** np.maximum(e - 14, -126)
    s = np.where(np.rint(amax / s) >= 2 ** 15, 2 * s, s)
    q = np.rint(v / s[..., None])
    assert np.abs(q).max() <= 32767
    return q.reshape(x.shape), s


def modelled(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: q * s, float64."""
    q, s = x16_model(x)
    return torch.from_numpy((q.reshape(x.shape[0], -1, 16) * s[..., None]).reshape(x.shape))


def steps(x: torch.Tensor) -> torch.Tensor:
    """Each value's group step s, float64 [rows, width]."""
    _, s = x16_model(x)
    return torch.from_numpy(np.repeat(s, 16, axis=-1))


def wide_x(rows: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """randn times 2**[-12, 4]: groups spanning more than the 2**7 a bf16 value keeps exactly,
    so some values round."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * 2.0 ** torch.randint(-12, 5, (rows, width), generator=g)).to(dtype)


def gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
    dev = torch.device(KERNEL_DEVICE)
    xd = x.to(dev)
    assert quant_gemv.integer_x(xd, ggml_type) and quant_gemv.gemv_applies(xd, ggml_type, shape)
    out = quant_gemv.quant_gemv(xd, raw.to(dev), ggml_type, shape)
    assert quant_gemv.SWITCH.error is None, f"the kernel fell back: {quant_gemv.SWITCH.error!r}"
    return out.cpu()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_its_definition(dtype):
    x = wide_x(3, 1024 + 48, seed=1, dtype=dtype)  # 67 groups: a masked last program of 64
    x[1, 16:32] = 0  # an all-zero group
    x[2, 0] = -2.0 ** 15  # a group whose largest |x| is a power of two
    x[2, 16:32] = x[2, 16:32].clamp(-1, 1)
    x[2, 16] = 2 - 2.0 ** -23  # the largest (float32 only): x / s = 32767.99..., which takes the next s
    q = quantize(x.to(KERNEL_DEVICE))
    want_q, want_s = x16_model(x)
    assert np.array_equal(q.q.cpu().numpy(), want_q)
    assert np.array_equal(q.groups[..., 0].cpu().double().numpy(), want_s)
    assert np.array_equal(q.groups[..., 1].cpu().double().numpy(), want_s * want_q.reshape(3, -1, 16).sum(-1))
    # what the docstring promises: off by at most s / 2, exact within 2**7 of a bf16 group's largest
    err = (modelled(x) - x.double()).abs()
    assert (err <= steps(x) / 2).all()
    if dtype == torch.bfloat16:
        near = x.double().abs() >= steps(x) * 2.0 ** 7
        assert near.any() and (err[near] == 0).all() and (err > 0).any()
    if dtype == torch.float32:
        assert want_s[2, 1] == 2.0 ** -13 and want_q[2, 16] == 2 ** 14  # the coarser s: no overflow


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaN
def test_non_finite_x_gives_nan_not_a_finite_product():
    x = torch.randn(1, 512).to(torch.bfloat16)
    x[0, 20], x[0, 300] = float("inf"), float("nan")
    q = quantize(x.to(KERNEL_DEVICE))
    s = q.groups[0, :, 0].cpu()
    assert s[1].isnan() and s[18].isnan() and s[[0, 2, 17, 19]].isfinite().all()
    raw, _ = weight(Q.Q2_K, 512, seed=9, out=OUT)
    got = gemv(x, raw, Q.Q2_K, (OUT, 512))
    assert got.isnan().all()


def test_quantize_refuses_widths_off_the_group():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.zeros(1, 40))


@needs_kernels
def test_only_a_reduced_precision_decode_takes_integer_x(monkeypatch):
    bf16 = torch.zeros(1, 256, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    f32 = torch.zeros(1, 256, device=KERNEL_DEVICE)
    assert quant_gemv.integer_x(bf16, Q.Q2_K) and quant_gemv.integer_x(bf16.half(), Q.Q3_K)
    assert not quant_gemv.integer_x(f32, Q.Q2_K)  # float32 decode: float32 math, as exact as before
    assert not quant_gemv.integer_x(bf16, Q.Q4_K)  # types `_quad_dot_x16` does not walk
    assert not quant_gemv.integer_x(bf16, Q.Q6_K) and not quant_gemv.integer_x(bf16, Q.Q8_0)  # no faster
    monkeypatch.setenv("EXPERTDESK_X16", "0")
    assert not quant_gemv.integer_x(bf16, Q.Q2_K)


@needs_kernels
@pytest.mark.parametrize("case", X16_CASES, ids=ids)
@pytest.mark.parametrize(("rows", "out"), [(1, OUT), (2, OUT), (1, WHOLE)])
def test_x16_gemv_is_the_modelled_product_within_summation_order(case, rows, out):
    ggml_type, k = case
    raw, w = weight(ggml_type, k, seed=k + rows, out=out)
    x = wide_x(rows, k, seed=rows)
    got = gemv(x, raw, ggml_type, (out, k))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    xq = modelled(x)
    exact = xq @ w.T
    bound = dot_bound(xq, w) * (1 + U_OUT) + U_OUT * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    # and the modelled x is what it reads: against x itself the error is larger where x rounds
    assert ((got.double() - x.double() @ w.T).abs()
            <= bound + steps(x) / 2 @ w.abs().T).all()
    # the bound catches a real bug: one block's scale doubled moves its row far outside it
    bad = raw.clone()
    block, size = GGML_QUANT_SIZES[Q(ggml_type)]
    at = (4 * k // block + 1) * size + quant_experts.F16_FIELDS[Q(ggml_type)][0]  # the second block of row 4
    d = bad[at:at + 2].numpy().copy().view(np.float16) * np.float16(2)
    bad[at:at + 2] = torch.from_numpy(d.view(np.uint8))
    wrong = gemv(x, bad, ggml_type, (out, k))
    assert not ((wrong[:, 4].double() - exact[:, 4]).abs() <= bound[:, 4]).all()


@needs_kernels
@pytest.mark.parametrize("case", X16_CASES[1:3], ids=ids)
@pytest.mark.parametrize("quads", [1, 2, 4])
def test_x16_lanes_of_fewer_words_add_each_offset_once(case, quads, monkeypatch):
    # With fewer than 4 words a lane holds part of a sub-block: only its first lane adds the
    # sub-block's offset or minimum term.
    ggml_type, k = case
    block_n, sb, warps, _ = quant_gemv.X16_CONFIGS[ggml_type]
    monkeypatch.setitem(quant_gemv.X16_CONFIGS, int(ggml_type), (block_n, sb, warps, quads))
    raw, w = weight(ggml_type, k, seed=k + quads, out=OUT)
    x = wide_x(1, k, seed=quads)
    xq = modelled(x)
    exact = xq @ w.T
    got = gemv(x, raw, ggml_type, (OUT, k))
    assert ((got.double() - exact).abs() <= dot_bound(xq, w) * (1 + U_OUT) + U_OUT * exact.abs()).all()


# ------------------------------------------------------------------ expert kernels

N_EXPERTS, D_IN, INTER, K = 6, 512, 256, 3
KIMI = {"gate": Q.Q2_K, "up": Q.Q2_K, "down": Q.Q3_K}
Q3 = {"gate": Q.Q3_K, "up": Q.Q3_K, "down": Q.Q2_K}


def expert_reference(roles, x, chosen, weights, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routed sum with x and each activation as the kernels read them, and the bound
    of `expert_bound`'s activation term: sum of route * |W_down| * 1.5 steps)."""
    w = {name: quant_experts.dense(r) for name, r in roles.items()}
    xq = modelled(x)
    out = torch.zeros(x.shape[0], w["down"].shape[1], dtype=torch.float64)
    slack = torch.zeros_like(out)
    for e in range(N_EXPERTS):
        tokens, slots = torch.where(chosen == e)
        if tokens.numel() == 0:
            continue
        act = activation(xq[tokens] @ w["gate"][e].T, xq[tokens] @ w["up"][e].T)
        route = weights[tokens, slots].double()[:, None]
        out.index_add_(0, tokens, (modelled(act) @ w["down"][e].T) * route)
        slack.index_add_(0, tokens, (1.5 * steps(act) @ w["down"][e].abs().T) * route.abs())
    return out, slack


@needs_kernels
@pytest.mark.parametrize("types", ["kimi", "q3_k-q2_k"])
def test_x16_experts_are_the_modelled_mlp_within_rounding(types):
    activation = ExpertActivation("swiglu", limit=7.0)
    roles = quant_experts.expert_roles(N_EXPERTS, D_IN, INTER, True, seed=1,
                                       types=KIMI if types == "kimi" else Q3, align=4)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, D_IN, generator=g) * 4).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:K] for _ in range(2)])
    weights = torch.rand(2, K, generator=g) + 0.1
    dev = torch.device(KERNEL_DEVICE)
    moved = moved_to(dev, roles)
    gate, up, down = moved["gate"], moved["up"], moved["down"]
    assert moe_quant.fused_applies(x.to(dev), gate, up, down, activation)
    got = grouped_expert_mlp(x.to(dev), chosen.to(dev), weights.to(dev), gate, up, down, activation).cpu()
    assert moe_quant.SWITCH.error is None, f"the kernels fell back: {moe_quant.SWITCH.error!r}"
    assert got.dtype == torch.bfloat16
    exact, slack = expert_reference(roles, x, chosen, weights, activation)
    magnitude = float64_reference(roles, modelled(x), chosen, weights, activation, absolute=True)
    bound = 2 * (D_IN + INTER + K) * EPS32 * magnitude + slack + U_OUT * (exact.abs() + slack)
    assert ((got.double() - exact).abs() <= bound).all()
    wrong = chosen.clone()
    wrong[0, 0] = next(e for e in range(N_EXPERTS) if e not in chosen[0].tolist())
    bad = grouped_expert_mlp(x.to(dev), wrong.to(dev), weights.to(dev), gate, up, down, activation).cpu()
    assert not ((bad.double() - exact).abs() <= bound).all()


@needs_kernels
def test_integer_path_failure_falls_back_to_float_math(monkeypatch):
    # a GPU that cannot run the integer kernels keeps the GEMV (float32 math on x), not the
    # per-use dequantization the whole family falls back to
    monkeypatch.setattr(quant_gemv.X16_SWITCH, "error", None)
    monkeypatch.setattr(quant_gemv.SWITCH, "error", None)

    def broken(x):
        raise RuntimeError("no dp2a")

    monkeypatch.setattr(quant_gemv, "quantize", broken)
    raw, w = weight(Q.Q2_K, 512, seed=5, out=OUT)
    x = torch.randn(1, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    dev = torch.device(KERNEL_DEVICE)
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_X16"):
        got = quant_gemv.quant_gemv(x.to(dev), raw.to(dev), Q.Q2_K, (OUT, 512)).cpu()
    assert quant_gemv.SWITCH.error is None and quant_gemv.X16_SWITCH.error is not None
    assert not quant_gemv.integer_x(x, Q.Q2_K)
    monkeypatch.setenv("EXPERTDESK_X16", "0")
    assert torch.equal(got, quant_gemv.quant_gemv(x.to(dev), raw.to(dev), Q.Q2_K, (OUT, 512)).cpu())


def test_matrices_of_many_rows_take_their_own_config():
    few, many = quant_gemv.x16_config(Q.Q2_K, 7168), quant_gemv.x16_config(Q.Q2_K, quant_gemv.X16_MANY_ROWS)
    assert few == quant_gemv.X16_CONFIGS[Q.Q2_K] and many == quant_gemv.X16_MANY_ROWS_CONFIGS[Q.Q2_K]
    assert quant_gemv.x16_config(Q.Q3_K, 1 << 20) == quant_gemv.X16_CONFIGS[Q.Q3_K]


@needs_cuda
def test_x16_gemv_is_capturable_and_quantizes_on_every_replay():
    """Captured by the decode step's graph cache (warm-up, then capture, on the same input
    tensor), then replayed on new values of that input: the quantization is in the graph,
    so each replay reads this step's x, not the warm-up's."""
    from engine.graphs import StepGraphs

    raw, _ = weight(Q.Q2_K, 512, seed=8, out=OUT)
    raw = raw.cuda()

    def step(x: torch.Tensor) -> torch.Tensor:
        return quant_gemv.quant_gemv(x, raw, Q.Q2_K, (OUT, 512))

    graphs = StepGraphs(enabled=True)
    graphs.run("gemv", step, torch.randn(1, 512, device="cuda").to(torch.bfloat16))
    x2 = torch.randn(1, 512, device="cuda").to(torch.bfloat16)
    got = graphs.run("gemv", step, x2).clone()
    assert (graphs.captures, graphs.replays) == (1, 2)
    assert quant_gemv.integer_x(x2, Q.Q2_K) and torch.equal(got, step(x2))

