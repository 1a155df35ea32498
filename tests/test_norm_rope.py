"""engine.kernels.norm_rope: one-launch RMSNorm / rope against the torch references.

Tolerances. The kernel computes what the reference computes and rounds where it rounds
(after the norm, after the rope); two things differ. (1) The sum of squares of a row of
d values is added in another order: either sum is within d * 2**-24 of the exact one
(relative: every term is positive), so the norm's factor r = 1/sqrt(mean + eps) moves
by at most d/2 * 2**-24 relative, plus a few ulp for the square root and the division.
(2) A rotated feature a*c - b*s may become one fused multiply-add: one rounding fewer,
at most 2**-24 of |a*c| + |b*s|. In float32 every output is therefore within
(d/2 + 8) * 2**-24 of the reference relative to its pair's magnitude |a| + |b| (the
normalised values). In bfloat16 those float32 differences can flip a rounding: one bf16
ulp (2**-8 relative) after the norm and one after the rope, so 3 * 2**-8 of the pair's
magnitude covers both and the float32 part.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import norm_rope as nr
from kernel_device import EPS32, KERNEL_DEVICE, U_BF16, break_launches, needs_kernels, needs_rounding_bf16


def _angles(n: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(n, half, generator=g) * 6.3
    return theta.cos(), theta.sin()


def _pair_magnitude(y: torch.Tensor) -> torch.Tensor:
    """|a| + |b| of each element's rope pair (2i, 2i + 1), same shape as y."""
    pairs = y.abs().unflatten(-1, (-1, 2)).sum(-1, keepdim=True)
    return pairs.expand(*pairs.shape[:-1], 2).flatten(-2)


def _tolerance(d: int, dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    unit = 3 * U_BF16 if dtype == torch.bfloat16 else (d / 2 + 8) * EPS32
    return unit * magnitude + 1e-30


CASES = {
    # name: (shape of x, rope pairs or 0, weighted)
    "q-heads-norm-rope": ((3, 8, 64), 8, False),
    "kv-weighted-norm-rope": ((5, 64), 16, True),
    "rope-only-all-dims": ((2, 4, 32), 16, None),
    "weighted-norm-wide-row": ((4, 4096), 0, True),
    "unweighted-norm-three-pairs": ((3, 6), 0, False),
}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_rounding_bf16)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_matches_reference_within_summation_order(case, dtype):
    shape, pairs, weighted = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    d = shape[-1]
    weight = torch.rand(d, generator=g) + 0.5
    cos, sin = _angles(shape[0], pairs, 1) if pairs else (None, None)
    dev = torch.device(KERNEL_DEVICE)

    def both(fn):
        args = lambda device: [a.to(device) if isinstance(a, torch.Tensor) else a for a in fn[1]]  # noqa: E731
        want = fn[0](*args("cpu"))
        got = fn[2](*args(dev)).cpu()
        return want, got

    if weighted is None:
        want, got = both((nr.apply_rope_reference, [x, cos, sin], nr.apply_rope))
    elif pairs:
        def reference(x, w, c, s):
            normed = nr.rms_norm_reference(x, w, 1e-6) if weighted else nr.rms_norm_unweighted_reference(x, 1e-6)
            return nr.apply_rope_reference(normed, c, s)
        want, got = both((reference, [x, weight if weighted else None, cos, sin],
                          lambda x, w, c, s: nr.norm_rope(x, w, 1e-6, c, s)))
    elif weighted:
        want, got = both((lambda x, w: nr.rms_norm_reference(x, w, 1e-6), [x, weight],
                          lambda x, w: nr.rms_norm(x, w, 1e-6)))
    else:
        want, got = both((lambda x: nr.rms_norm_unweighted_reference(x, 1e-6), [x],
                          lambda x: nr.rms_norm_unweighted(x, 1e-6)))
    assert nr.SWITCH.error is None, f"the kernel fell back: {nr.SWITCH.error!r}"
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = _tolerance(d, dtype, _pair_magnitude(want.double()))
    assert ((got.double() - want.double()).abs() <= tol).all()


@needs_kernels
def test_rope_leaves_the_leading_features_bit_identical():
    """Only the trailing rope_dim features turn: the others are copied exactly."""
    dev = torch.device(KERNEL_DEVICE)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    cos, sin = _angles(2, 8, 2)
    got = nr.apply_rope(x.to(dev), cos.to(dev), sin.to(dev)).cpu()
    assert torch.equal(got[..., :48], x[..., :48])
    assert not torch.equal(got[..., 48:], x[..., 48:])


def test_on_cpu_without_the_interpreter_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 16)
    w = torch.rand(16)
    assert torch.equal(nr.rms_norm(x, w, 1e-6), nr.rms_norm_reference(x, w, 1e-6))
    cos, sin = _angles(4, 4, 3)
    assert torch.equal(nr.norm_rope(x, None, 1e-6, cos, sin),
                       nr.apply_rope_reference(nr.rms_norm_unweighted_reference(x, 1e-6), cos, sin))


@needs_kernels
def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    dev = torch.device(KERNEL_DEVICE)

    break_launches(monkeypatch, nr)
    x, w = torch.randn(3, 32), torch.rand(32)
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_NORM_ROPE_TRITON"):
        out = nr.rms_norm(x.to(dev), w.to(dev), 1e-6)
    assert isinstance(nr.SWITCH.error, RuntimeError)
    assert torch.equal(out.cpu(), nr.rms_norm_reference(x.to(dev), w.to(dev), 1e-6).cpu())  # the same device's torch
