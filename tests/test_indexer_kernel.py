"""engine.kernels.indexer: the lightning indexer's scores against float64.

Tolerance. A score is scale * sum_h w_h * ReLU(s_h), s_h = q_h . k a d-term dot product
(bf16 and fp16 inputs multiply exactly in float32). Summed in any order in float32, s_h is within
d * 2**-24 * sum_i |q_hi k_i| of the exact value (ReLU does not increase a difference),
and the weighted sum over H heads with its two scalings adds (H + 4) * 2**-24 of
sum_h |w_h| |s_h| <= sum_h |w_h| sum_i |q_hi k_i|. So both the reference and the kernel
are within scale * (d + H + 4) * 2**-24 * sum_h |w_h| sum_i |q_hi k_i| of the float64
score.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import indexer as ix
from kernel_device import EPS32, KERNEL_DEVICE, break_launches, needs_bf16_dot, needs_kernels

CASES = {
    # name: queries, heads, d, entries
    "decode": (1, 8, 32, 64),
    "prefill-block": (5, 4, 16, 40),
    "heads-not-a-power-of-two": (2, 12, 24, 33),
    "deepseek-v4-flash": (1, 64, 128, 1024),
}


def _inputs(case: str, dtype: torch.dtype):
    n, heads, d, entries = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    proj = torch.randn(n, heads, generator=g).to(dtype)
    keys = torch.randn(entries, d, generator=g).to(dtype)
    limit = torch.randint(0, entries + 1, (n,), generator=g)
    limit[0] = entries - 3  # at least one query with future entries
    return q, proj, keys, limit


def _exact_and_bound(q, proj, keys, limit):
    heads, d = q.shape[1], q.shape[2]
    qd, kd, w = q.double(), keys.double(), proj.double() * heads ** -0.5
    s = torch.einsum("thd,ed->the", qd, kd)
    exact = (torch.relu(s) * d ** -0.5 * w[..., None]).sum(1)
    future = torch.arange(keys.shape[0])[None, :] >= limit[:, None]
    exact = exact.masked_fill(future, float("-inf"))
    magnitude = (torch.einsum("thd,ed->the", qd.abs(), kd.abs()) * w.abs()[..., None]).sum(1)
    return exact, d ** -0.5 * (d + heads + 4) * EPS32 * magnitude


def _check(got, exact, bound):
    assert got.dtype == torch.float32 and got.shape == exact.shape
    masked = torch.isinf(exact)
    assert torch.equal(torch.isinf(got), masked) and (got[masked] < 0).all()
    err = (got.double() - exact).abs().masked_fill(masked, 0)
    assert (err <= bound).all(), f"worst excess {(err / bound).max():.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reference_is_within_the_bound_of_float64(case, dtype):
    q, proj, keys, limit = _inputs(case, dtype)
    _check(ix.index_scores_reference(q, proj, keys, limit), *_exact_and_bound(q, proj, keys, limit))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_dot),
                                   torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_is_within_the_bound_of_float64(case, dtype):
    q, proj, keys, limit = _inputs(case, dtype)
    dev = torch.device(KERNEL_DEVICE)
    got = ix.index_scores(q.to(dev), proj.to(dev), keys.to(dev), limit.to(dev)).cpu()
    assert ix.SWITCH.error is None, f"the kernel fell back: {ix.SWITCH.error!r}"
    _check(got, *_exact_and_bound(q, proj, keys, limit))


@needs_kernels
def test_many_queries_take_the_matrix_product(monkeypatch):
    """A prefill block (more than MAX_QUERIES queries) runs the reference, not the kernel."""
    def broken(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(ix, "_launch", broken)
    dev = torch.device(KERNEL_DEVICE)
    q, proj, keys, limit = (t.to(dev) for t in _inputs("decode", torch.float32))
    many = ix.MAX_QUERIES + 1
    q, proj, limit = q.expand(many, -1, -1), proj.expand(many, -1), limit.expand(many)
    assert torch.equal(ix.index_scores(q, proj, keys, limit), ix.index_scores_reference(q, proj, keys, limit))
    assert ix.SWITCH.error is None


def test_on_cpu_without_the_interpreter_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _inputs("decode", torch.float32)
    assert torch.equal(ix.index_scores(*args), ix.index_scores_reference(*args))


@needs_kernels
def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    dev = torch.device(KERNEL_DEVICE)

    break_launches(monkeypatch, ix)
    args = [t.to(dev) for t in _inputs("decode", torch.float32)]
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_INDEXER_TRITON"):
        out = ix.index_scores(*args)
    assert isinstance(ix.SWITCH.error, RuntimeError)
    assert torch.equal(out.cpu(), ix.index_scores_reference(*args).cpu())
