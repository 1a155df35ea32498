"""engine.kernels.kda: one token's KDA step, the one-launch kernel and the torch reference,
each against the same math in float64.

The error bound (first order in the unit roundoffs; `bound` below computes it from the
step's inputs in float64). Float32 arithmetic has u = 2**-24; the steps the model rounds
to its own dtype (the convolution's products and sums, the SiLU, f + dt_bias and its
bias, the norm's output, the gate's sigmoid and the output) have the dtype's unit uh
(2**-8 bfloat16, 2**-11 float16, u in float32). Per head, with x the window of a channel
and w its taps, |.| elementwise, d the head size:
- conv c = sum_j x_j w_j: taps roundings of at most sum_j |x_j w_j| (C) each: taps uh C;
  the SiLU (slope below 1.1) passes that on and adds an exponential (4 u: ex2.approx's
  2**-22), a sum and a division, then its rounding: 1.1 taps uh C + (6 u + uh) |y|;
- the l2 norm n = y / |y|: dy / |y| + |n| (|dy|_2 / |y| + (d / 2 + 4) u) (the sum of d
  squares, the square root, the division);
- the decay e = exp(g), g = lb sigmoid(-a (f + b)) (or a softplus(f + b)): f + b within
  uh (|f| + 2 |b|) (the bias rounded, then the sum), g within |lb a| / 4 of that plus
  4 u |g|, e within e (|dg| + 4 u); beta = sigmoid within 4 u;
- S1 = e S within |de S| + u |S1|; p = sum_key S1 k within sum(|dS1| |k| + |S1| |dk|)
  + d u sum |S1 k|; delta = (v - p) beta within (|dv| + |dp|) beta + (6 u) |v - p| beta;
- S2 = S1 + k delta within |dS1| + |dk| |delta| + |k| |ddelta| + 2 u (|S1| + |k delta|);
- o = scale sum_key S2 q within scale (sum(|dS2| |q| + |S2| |dq|) + (d + 1) u sum |S2 q|);
- r = sqrt(mean o^2 + eps) within r (sum |o| |do| / (d r^2) + (d / 2 + 4) u); z = w o / r
  within |w| (|do| + |o| dr / r) / r + (3 u + uh) |z|; out = z sigmoid(gate) within
  sigmoid(gate) |dz| + (5 u + 2 uh) |out|.
The kernel and the reference each stay within this of the float64 step (the reference's
sums run in torch's order, the kernel's in Triton's; which order, no matter: the bound
holds for any). Second-order terms (u**2 and below) are left out, far below it. The new
tails are copies of the window's rows: bitwise equal on both sides.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import attn_res, decode_attention, kda
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

EPS = 1e-5
LOWER_BOUND = -5.0  # Kimi-K3's gate lower bound
UNIT = {torch.float32: EPS32, torch.float16: U_F16, torch.bfloat16: U_BF16}
# name: (heads, head size, taps)
SHAPES = {"small": (3, 16, 4), "ragged": (2, 24, 4), "two-taps": (2, 32, 2), "three-taps": (2, 16, 3),
          "kimi-k3": (96, 128, 4)}


def _step(heads: int, d: int, taps: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """A token's inputs at realistic scales, in the model's dtype (S float32)."""
    g = torch.Generator().manual_seed(seed)
    width = heads * d

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    step = {
        "q": randn(1, width), "k": randn(1, width), "v": randn(1, width), "f": randn(1, width),
        "beta": randn(1, heads), "gate": randn(1, width),
        "conv": [randn(width, taps, std=0.5) for _ in range(3)],
        "tails": [randn(taps - 1, width) for _ in range(3)],
        "s": randn(heads, d, d, std=0.3),
        "dt_bias": randn(width, std=0.5), "a": -torch.exp(torch.rand(heads, generator=g) * 3 - 1.5),
        "o_norm": randn(d, std=0.1, mean=1.0),
    }
    rounded = ("q", "k", "v", "f", "beta", "gate", "tails")  # the rest is float32 in the model

    def placed(name, t):
        return (t.to(dtype) if name in rounded else t).to(device)

    return {name: [placed(name, t) for t in v] if isinstance(v, list) else placed(name, v)
            for name, v in step.items()}


def _call(fn, step: dict, lower_bound: float | None, *, in_place: bool = False):
    """fn (kda_step or kda_step_reference) on copies of the step's state; returns (out, tails, s)."""
    tails = [t.clone() for t in step["tails"]]
    s = step["s"].clone()
    tails_out = tails if in_place else [torch.full_like(t, float("nan")) for t in tails]
    s_out = s if in_place else torch.full_like(s, float("nan"))
    out = fn(step["q"], step["k"], step["v"], step["f"], step["beta"], step["gate"], step["conv"], tails, s,
             step["dt_bias"], step["a"], step["o_norm"], EPS, lower_bound, tails_out, s_out)
    return out, tails_out, s_out


def _exact(step: dict, lower_bound: float | None):
    """The step in float64 (the reference's code, every tensor widened)."""
    wide = {name: ([t.double() for t in v] if isinstance(v, list) else v.double()) for name, v in step.items()}
    wide["conv"] = [t.to(step["q"].dtype).double() for t in step["conv"]]  # the model rounds its taps
    return _call(kda.kda_step_reference, wide, lower_bound)


def bound(step: dict, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The error bounds of the output [1, width] and of S [heads, d, d] (module docstring), in float64."""
    u, uh = EPS32, UNIT[step["q"].dtype]
    w = {name: ([t.double().cpu() for t in v] if isinstance(v, list) else v.double().cpu()) for name, v in step.items()}
    heads, d = w["s"].shape[0], w["s"].shape[1]
    taps = w["conv"][0].shape[1]
    rows, errs = [], []
    for row, kernel, tail in zip((w["q"], w["k"], w["v"]), w["conv"], w["tails"]):
        window = torch.cat([tail, row])  # [taps, width]
        kernel = kernel.to(step["q"].dtype).double()
        c = (window * kernel.t()).sum(0)
        big_c = (window * kernel.t()).abs().sum(0)
        y = torch.nn.functional.silu(c)
        rows.append(y.view(heads, d))
        errs.append((1.1 * taps * uh * big_c + (6 * u + uh) * y.abs()).view(heads, d))

    def normed(y, dy):
        norm = y.norm(dim=-1, keepdim=True)
        n = y / torch.sqrt(norm ** 2 + EPS)
        return n, dy / norm + n.abs() * (dy.norm(dim=-1, keepdim=True) / norm + (d / 2 + 4) * u)

    q, dq = normed(rows[0], errs[0])
    k, dk = normed(rows[1], errs[1])
    v, dv = rows[2], errs[2]
    bias = w["dt_bias"].to(step["q"].dtype).double()
    g_in = (w["f"].view(-1) + bias).view(heads, d)
    dg_in = uh * (w["f"].view(-1).abs() + 2 * bias.abs()).view(heads, d)
    a = w["a"].view(heads, 1)
    if lower_bound is not None:
        g = torch.sigmoid(-(g_in * a)) * lower_bound
        dg = abs(lower_bound) * a.abs() / 4 * dg_in + 4 * u * g.abs()
    else:
        g = torch.nn.functional.softplus(g_in) * a
        dg = a.abs() * (dg_in + 2 * u) + 4 * u * g.abs()  # log(1 + e^x): an absolute u or two
    e = g.exp()
    de = e * (dg + 4 * u)
    beta = torch.sigmoid(w["beta"].view(heads, 1))
    s = w["s"]
    s1 = e.unsqueeze(-1) * s
    ds1 = de.unsqueeze(-1) * s.abs() + u * s1.abs()
    p = (s1 * k.unsqueeze(-1)).sum(1)
    dp = ((ds1 * k.abs().unsqueeze(-1) + s1.abs() * dk.unsqueeze(-1)).sum(1)
          + d * u * (s1 * k.unsqueeze(-1)).abs().sum(1))
    delta = (v - p) * beta
    ddelta = (dv + dp) * beta + 6 * u * delta.abs()
    s2 = s1 + k.unsqueeze(-1) * delta.unsqueeze(1)
    kd = (k.unsqueeze(-1) * delta.unsqueeze(1)).abs()
    ds2 = ds1 + dk.unsqueeze(-1) * delta.abs().unsqueeze(1) + k.abs().unsqueeze(-1) * ddelta.unsqueeze(1) \
        + 2 * u * (s1.abs() + kd)
    scale = d ** -0.5
    o = scale * (s2 * q.unsqueeze(-1)).sum(1)
    do = scale * ((ds2 * q.abs().unsqueeze(-1) + s2.abs() * dq.unsqueeze(-1)).sum(1)
                  + (d + 1) * u * (s2 * q.unsqueeze(-1)).abs().sum(1))
    r = torch.sqrt((o ** 2).mean(-1, keepdim=True) + EPS)
    dr = r * ((o.abs() * do).sum(-1, keepdim=True) / (d * r ** 2) + (d / 2 + 4) * u)
    z = w["o_norm"] * o / r
    dz = w["o_norm"].abs() * (do + o.abs() * dr / r) / r + (3 * u + uh) * z.abs()
    sig = torch.sigmoid(w["gate"].view(heads, d))
    out = z * sig
    dout = sig * dz + (5 * u + 2 * uh) * out.abs()
    return dout.reshape(1, heads * d), ds2


def _check(ours, exact, tolerance, what: str) -> None:
    err = (ours.double().cpu() - exact.double().cpu()).abs()
    over = err - tolerance
    worst = int(over.argmax())
    assert torch.isfinite(ours).all(), f"{what}: not finite"
    assert (over <= 0).all(), (f"{what}: element {worst} off by {err.view(-1)[worst]:.3e}, "
                               f"bound {tolerance.reshape(-1)[worst]:.3e}")


def _assert_within(result, exact, tolerances, step) -> None:
    (out, tails, s), (out64, tails64, s64) = result, exact
    tol_out, tol_s = tolerances
    _check(out, out64, tol_out, "output")
    _check(s, s64, tol_s, "S")
    for ours, ref in zip(tails, tails64):  # copies of rows in the model's dtype
        assert torch.equal(ours.double().cpu(), ref.cpu())
    for ours, window_rows in zip(tails, zip(step["tails"], (step["q"], step["k"], step["v"]))):
        assert torch.equal(ours, torch.cat([window_rows[0][1:], window_rows[1]]))


def _both_within_the_bound(step: dict, lower_bound: float | None, monkeypatch) -> None:
    """The reference and the kernel (which must run) each within the bound of the float64 step."""
    exact = _exact(step, lower_bound)
    tolerances = bound(step, lower_bound)
    _assert_within(_call(kda.kda_step_reference, step, lower_bound), exact, tolerances, step)
    launches = count_launches(monkeypatch, kda)
    _assert_within(_call(kda.kda_step, step, lower_bound), exact, tolerances, step)
    assert launches and kda.SWITCH.error is None  # the kernel ran


@needs_kernels
@pytest.mark.parametrize("lower_bound", [LOWER_BOUND, None], ids=["k3-gate", "softplus-gate"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_and_reference_within_the_float32_bound(shape, lower_bound, monkeypatch):
    _both_within_the_bound(_step(*SHAPES[shape], torch.float32, KERNEL_DEVICE), lower_bound, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_rounding_bf16)])
def test_half_precision_within_the_bound_of_its_roundings(dtype, monkeypatch):
    """The model's dtype rounds the convolution, the SiLU, the decay's input, the norm, the
    gate and the output: both sides within the bound with that dtype's unit there."""
    _both_within_the_bound(_step(*SHAPES["kimi-k3"], dtype, KERNEL_DEVICE, seed=1), LOWER_BOUND, monkeypatch)


@needs_kernels
def test_in_place_equals_separate_outputs(monkeypatch):
    """The fixed-shape state writes its buffers in place: the kernel reads each value it
    writes first, so aliasing changes nothing, bit for bit."""
    step = _step(*SHAPES["small"], torch.float32, KERNEL_DEVICE, seed=2)
    launches = count_launches(monkeypatch, kda)
    apart = _call(kda.kda_step, step, LOWER_BOUND)
    inside = _call(kda.kda_step, step, LOWER_BOUND, in_place=True)
    assert len(launches) == 2 and kda.SWITCH.error is None
    for a, b in zip((apart[0], apart[2], *apart[1]), (inside[0], inside[2], *inside[1])):
        assert torch.equal(a, b)


@needs_kernels
def test_the_bound_catches_a_wrong_step():
    """The bound is tight enough to see a step that gets the math slightly wrong: the
    kernel run on a decay bias off by 0.1% (a rounding of dt_bias to 10 bits, say)."""
    step = _step(*SHAPES["kimi-k3"], torch.float32, KERNEL_DEVICE, seed=3)
    exact = _exact(step, LOWER_BOUND)
    tolerances = bound(step, LOWER_BOUND)
    wrong = dict(step, dt_bias=step["dt_bias"] * 1.001)
    with pytest.raises(AssertionError, match="off by"):
        _assert_within(_call(kda.kda_step, wrong, LOWER_BOUND), exact, tolerances, step)


def _call_args(step: dict, lower_bound: float | None) -> tuple:
    return (step["q"], step["k"], step["v"], step["f"], step["beta"], step["gate"], step["conv"], step["tails"],
            step["s"], step["dt_bias"], step["a"], step["o_norm"], EPS, lower_bound,
            [t.clone() for t in step["tails"]], step["s"].clone())


def test_the_kernel_refuses_what_it_does_not_compute(monkeypatch):
    """Where the kernel would not compute the reference's step, the reference runs: a float64
    model, a head over 128, convolutions of one or five taps, tails in another dtype, a non-contiguous S
    (with the family on, as on a GPU)."""
    monkeypatch.setattr(kda.SWITCH, "applies", lambda x: True)
    base = _step(2, 16, 4, torch.float32, "cpu")
    assert kda._applies(*_call_args(base, LOWER_BOUND))
    cases = {
        "float64": _step(2, 16, 4, torch.float64, "cpu"),
        "head 256": _step(1, 256, 4, torch.float32, "cpu"),
        "one tap": _step(2, 16, 1, torch.float32, "cpu"),
        "five taps": _step(2, 16, 5, torch.float32, "cpu"),
        "bf16 tails": dict(base, tails=[t.bfloat16() for t in base["tails"]]),
        "strided S": dict(base, s=base["s"].transpose(1, 2)),
    }
    for name, step in cases.items():
        assert not kda._applies(*_call_args(step, LOWER_BOUND)), name


@needs_kernels
def test_failed_launch_falls_back_to_the_reference(monkeypatch):
    step = _step(*SHAPES["small"], torch.float32, KERNEL_DEVICE, seed=4)
    expected = _call(kda.kda_step_reference, step, LOWER_BOUND)
    got = falls_back_once(monkeypatch, kda, lambda: _call(kda.kda_step, step, LOWER_BOUND),
                          "KDA step kernels unavailable")
    for a, b in zip((got[0], got[2], *got[1]), (expected[0], expected[2], *expected[1])):
        assert torch.equal(a, b)


@needs_kernels
def test_the_models_fixed_shape_decode_runs_the_kernel_and_matches_llama_cpp(monkeypatch):
    """Kimi-K3's one-token steps on the fixed-shape state (its GPU path) through the kernel:
    one launch per KDA layer and step, every AttnRes mix in its kernel, the MLA layers'
    attention in decode_attention's kernel, the logits equal
    llama.cpp's within the model tests' tolerance (tests/test_kimi_k3.py)."""
    import engine.experts
    from test_kimi_k3 import REL_TOL, Case, assert_matches

    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    launches = []
    real_launch = kda._launch
    monkeypatch.setattr(kda, "_launch", lambda *args: launches.append(1) or real_launch(*args))
    mixes = {"kernel": 0, "torch": 0}  # the AttnRes mixes (engine.kernels.attn_res) run the kernel too
    real_mix, real_mix_reference = attn_res._launch, attn_res.attn_res_mix_reference

    def mix_kernel(*args):
        mixes["kernel"] += 1
        return real_mix(*args)

    def mix_reference(*args):
        mixes["torch"] += 1
        return real_mix_reference(*args)

    monkeypatch.setattr(attn_res, "_launch", mix_kernel)
    monkeypatch.setattr(attn_res, "attn_res_mix_reference", mix_reference)
    attention = count_launches(monkeypatch, decode_attention)  # the MLA layers' decode attention
    case = Case("f32")
    model = case.model
    if KERNEL_DEVICE == "cuda":
        pytest.skip("the fixture model loads on the CPU; tests/test_runtime_cuda.py runs models on the GPU")
    model.static_decode = True
    state = model.new_state()
    prompt = 70
    logits = [model.forward(case.tokens[:prompt], state)]
    logits += [model.forward(case.tokens[i:i + 1], state) for i in range(prompt, len(case.tokens))]
    steps = len(case.tokens) - prompt
    kda_layers = sum(layer.kind == "kda" for layer in model.layers)
    assert len(launches) == steps * kda_layers
    assert len(attention) == steps * (len(model.layers) - kda_layers)
    assert mixes["kernel"] > 0 and mixes["torch"] == 0
    assert_matches(torch.cat(logits)[prompt:], case.prefill_ref[prompt:], REL_TOL)
