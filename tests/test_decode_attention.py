"""engine.kernels.decode_attention: one decode query's attention against float64.

Tolerances. Both the torch reference and the kernel are compared with the same
attention computed in float64 from the same (rounded) inputs. Per head, let N be the
number of visible keys, S = scale * max_j sum_i |q_i k_ji| (the largest logit a
reordered sum could reach) and M = sum_j p_j max_i |v_ji| (the output's magnitude, p the
exact softmax weights, sink included in the denominator).

float32: a logit is a d-term dot product: its float32 sum in any order is within
d * 2**-24 * S of the exact one, so each exp(logit - max) moves by at most a factor
exp(2 d 2**-24 S) (the max moves too) ~ 1 + 2 d 2**-24 S. The weighted sum of at most
N + 1 values (sink included) and the division add (N + 8) * 2**-24 relative. The rope
rotation of a pair adds one fused multiply-add. Every output is thus within
(4 d S + N + 16) * 2**-24 * M, and we allow that times 2 for the pair a rotated feature
mixes with.

bfloat16: the reference casts the probabilities to bf16 (2**-8 relative each), rounds
the window's and the entries' partial outputs and their sum (3 roundings), and the rope
rounds again; the kernel rounds its (unnormalised) weights to bf16, the output once and
after the rope. Both are within 6 * 2**-8 * M of float64 (pair included), on top of the
float32 part. float16 likewise, with its unit roundoff 2**-11.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_attention as da
from kernel_device import (
    EPS32,
    KERNEL_DEVICE,
    U_BF16,
    U_F16,
    break_launches,
    count_launches,
    needs_bf16_dot,
    needs_kernels,
    needs_rounding_bf16,
)


def _angles(half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(1, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return theta.cos(), theta.sin()


def _case(heads: int, d: int, width: int, rows: int, picks: int | None, pos: int, rope: int, seed: int,
          dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, d, generator=g) * 0.5).to(dtype)
    window = torch.randn(width, d, generator=g).to(dtype)
    entries = torch.randn(rows, d, generator=g).to(dtype) if rows else None
    chosen = None
    if picks is not None:
        # Real picks, -1 (no pick) and entries the query may not see yet (>= limit): all masked the same.
        chosen = torch.randint(-1, rows, (1, picks), generator=g)
    sinks = torch.randn(heads, generator=g)
    unrope = _angles(rope // 2, seed) if rope else None
    return q, window, torch.tensor([pos]), entries, chosen, sinks, unrope


CASES = {
    # name: heads, d, window rows, entry rows, picks (None: all entries), position, rope dims, ratio
    "hca-window-partly-empty": (4, 32, 16, 64, None, 9, 8, 4),
    "hca-full-window": (5, 64, 16, 64, None, 300, 16, 8),
    "csa-picks": (8, 32, 16, 64, 24, 200, 8, 4),
    "csa-early-most-picks-masked": (3, 16, 8, 64, 40, 5, 0, 4),
    "sliding-only": (20, 48, 32, None, None, 100, 16, 0),
    "many-heads-long-keys": (33, 64, 64, 256, 128, 2000, 16, 4),
}


def _exact(q, window, pos, window_on, entries, picks, ratio, sinks, scale, unrope, value_dim=None):
    dd = lambda t: None if t is None else t.double()  # noqa: E731
    rope = None if unrope is None else (unrope[0].double(), unrope[1].double())
    return da.decode_attention_reference(dd(q), dd(window), pos, window_on, dd(entries), picks, ratio, dd(sinks),
                                         scale, rope, value_dim)


def _bound(q, window, pos, window_on, entries, picks, ratio, sinks, scale, dtype, value_dim=None):
    """Per head: S (largest reordered logit magnitude), M (output magnitude over the value
    features), N (keys). No sink (None): no sink column in the softmax."""
    qd = q.double()[0]
    keys = [window.double()]
    if entries is not None:
        keys.append(entries.double() if picks is None else entries.double()[picks[0].clamp(min=0)])
    k = torch.cat(keys)
    s_abs = scale * (qd.abs() @ k.abs().t())  # [heads, keys]
    exact_logits = scale * (qd @ k.t())
    width = window.shape[0]
    visible = torch.arange(width) <= pos[0]  # a ring: row r holds position r until the window wraps
    if not window_on:
        visible = torch.zeros_like(visible)
    parts = [visible]
    if entries is not None:
        limit = (pos[0] + 1) // ratio
        idx = torch.arange(entries.shape[0]) if picks is None else picks[0]
        parts.append((idx >= 0) & (idx < limit))
    ok = torch.cat(parts)
    logits = exact_logits.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None]], dim=1)
    p = torch.softmax(logits, dim=1)[:, :k.shape[0]]
    dv = k.shape[1] if value_dim is None else value_dim
    magnitude = (p * k[:, :dv].abs().amax(dim=1)[None, :]).sum(dim=1)  # [heads]
    S = s_abs.masked_fill(~ok, 0).amax(dim=1)
    n = ok.sum()
    d = q.shape[-1]
    unit = (4 * d * S + n + 16) * EPS32
    if dtype in (torch.bfloat16, torch.float16):
        unit = unit + 6 * (U_BF16 if dtype == torch.bfloat16 else U_F16)
    return (2 * unit * magnitude)[None, :, None] + 1e-30


def _run(case: str, dtype: torch.dtype, fn, device: str):
    heads, d, width, rows, picks, pos, rope, ratio = CASES[case]
    q, window, pos_t, entries, chosen, sinks, unrope = _case(heads, d, width, rows or 0, picks, pos, rope,
                                                              len(case), dtype)
    scale = d ** -0.5
    args = (q, window, pos_t, True, entries, chosen, ratio, sinks, scale, unrope)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    if unrope is not None:
        moved[-1] = (unrope[0].to(device), unrope[1].to(device))
    got = fn(*moved).cpu()
    want = _exact(*args)
    return got, want, _bound(q, window, pos_t, True, entries, chosen, ratio, sinks, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reference_is_within_the_bound_of_float64(case, dtype):
    """The torch path (the CPU's and the fallback) meets the bound the kernel is held to."""
    got, want, tol = _run(case, dtype, da.decode_attention_reference, "cpu")
    assert got.dtype == dtype
    assert ((got.double() - want).abs() <= tol).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core logits run on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reference_on_cuda_is_within_the_bound_of_float64(case, dtype):
    """On CUDA the 16-bit reference takes its logits from one tensor-core matmul that
    accumulates in float32. Products of 16-bit values are exact in float32, so only the
    order of the sums differs, which the bound's d 2**-24 S term already allows."""
    assert da._MIXED_MATMUL, "this torch has no mm / bmm with a float32 result"
    got, want, tol = _run(case, dtype, da.decode_attention_reference, "cuda")
    assert got.dtype == dtype
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"worst excess {(err / tol).max():.2f}x the bound"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the tensor-core logits run on CUDA"))])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-keys", "picked-keys"])
def test_prefill_logits_are_float32_sums_of_exact_products(device, shared):
    """`_wide_logits` over 96 queries of 16 heads x 512 features (a prefill block): each
    logit is within d 2**-24 sum_i |q_i k_i| of the float64 dot product of the same bf16
    values (a float32 sum in any order; the products themselves are exact)."""
    g = torch.Generator().manual_seed(3)
    t, heads, d, n = 96, 16, 512, 40
    q = torch.randn(t, heads, d, generator=g).bfloat16()
    keys = torch.randn(n, d, generator=g).bfloat16() if shared else torch.randn(t, n, d, generator=g).bfloat16()
    got = da._wide_logits(q.to(device), keys.to(device)).cpu()
    assert got.dtype == torch.float32 and got.shape == (heads, t, n)
    qd, kd = q.double().transpose(0, 1), keys.double()
    if shared:
        exact, size = qd @ kd.t(), qd.abs() @ kd.abs().t()
    else:
        exact, size = torch.einsum("htd,tkd->htk", qd, kd), torch.einsum("htd,tkd->htk", qd.abs(), kd.abs())
    assert ((got.double() - exact).abs() <= d * EPS32 * size).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=[needs_rounding_bf16, needs_bf16_dot]),
                                   torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_is_within_the_bound_of_float64(case, dtype):
    got, want, tol = _run(case, dtype, da.decode_attention, KERNEL_DEVICE)
    assert da.SWITCH.error is None, f"the kernel fell back: {da.SWITCH.error!r}"
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"worst excess {(err / tol).max():.2f}x the bound"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_at_deepseek_v4_flash_size(dtype):
    """64 heads of 512 features, a window of 128 rows, 512 picks out of 1,024 entries, in
    both dtypes: the float32 tiles must fit the GPU's shared memory (the kernel runs, no
    fallback to torch)."""
    if dtype == torch.bfloat16 and KERNEL_DEVICE != "cuda":
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong")
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(1, 64, 512, generator=g) * 0.05).to(dtype)
    window = torch.randn(128, 512, generator=g).to(dtype)
    entries = torch.randn(1024, 512, generator=g).to(dtype)
    picks = torch.randperm(1024, generator=g)[:512].view(1, 512)
    sinks = torch.randn(64, generator=g)
    pos = torch.tensor([4000])
    unrope = _angles(32, 7)
    args = (q, window, pos, True, entries, picks, 4, sinks, 512 ** -0.5, unrope)
    dev = torch.device(KERNEL_DEVICE)
    moved = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
    moved[-1] = (unrope[0].to(dev), unrope[1].to(dev))
    got = da.decode_attention(*moved).cpu()
    assert da.SWITCH.error is None, f"the kernel fell back: {da.SWITCH.error!r}"
    tol = _bound(q, window, pos, True, entries, picks, 4, sinks, 512 ** -0.5, dtype)
    assert ((got.double() - _exact(*args)).abs() <= tol).all()


# An MLA cache (Kimi-K3): rows 0 .. rows - 1 hold positions 0 .. rows - 1, the values are each
# row's first value_dim features (the latent), the rest key-only (the rope slice); no sink.
MLA_CASES = {
    # name: heads, value features, key-only features, cache rows, position
    "small": (20, 64, 16, 48, 30),
    "last-row": (5, 32, 16, 40, 39),
    "odd-tail": (3, 48, 6, 24, 0),
    "kimi-k3-size": (96, 512, 64, 1024, 700),
}


def _mla_run(case: str, dtype: torch.dtype, fn, device: str):
    heads, dv, tail, rows, pos = MLA_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    d = dv + tail
    q = (torch.randn(1, heads, d, generator=g) * 0.5 * d ** -0.25).to(dtype)
    cache = (torch.randn(rows, d, generator=g) * d ** -0.25).to(dtype)
    cache[pos + 1:] = float("nan")  # rows no position has reached yet: never read
    pos_t = torch.tensor([pos])
    scale = 192 ** -0.5  # Kimi-K3's (nope + rope) ** -0.5, not d's
    args = (q, cache, pos_t, True, None, None, 1, None, scale, None)
    moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    got = fn(*moved, value_dim=dv).cpu()
    clean = cache.clone()
    clean[pos + 1:] = 0
    want = _exact(q, clean, pos_t, True, None, None, 1, None, scale, None, dv)
    return got, want, _bound(q, clean, pos_t, True, None, None, 1, None, scale, dtype, dv)


@pytest.mark.parametrize("case", MLA_CASES, ids=list(MLA_CASES))
def test_mla_reference_is_within_the_bound_of_float64(case):
    """The torch path with key-only features and no sink; the NaN rows after the position
    are masked out (an additive -inf mask times a NaN row would still be NaN: the
    reference's matmul reads them, so they are zeroed for it)."""
    heads, dv, tail, rows, pos = MLA_CASES[case]
    got, want, tol = _mla_run(case, torch.float32,
                              lambda q, cache, *rest, **kw: da.decode_attention_reference(
                                  q, torch.nan_to_num(cache), *rest, **kw), "cpu")
    assert got.shape == (1, heads, dv)
    assert ((got.double() - want).abs() <= tol).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=[needs_rounding_bf16, needs_bf16_dot])],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("case", MLA_CASES, ids=list(MLA_CASES))
def test_mla_kernel_is_within_the_bound_of_float64(case, dtype, monkeypatch):
    """The kernel's key-only tail joins the logits and not the output; rows after the
    position (NaN) are never read."""
    launches = count_launches(monkeypatch, da)
    got, want, tol = _mla_run(case, dtype, da.decode_attention, KERNEL_DEVICE)
    assert launches and da.SWITCH.error is None, f"the kernel did not run: {da.SWITCH.error!r}"
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"worst excess {(err / tol).max():.2f}x the bound"


def test_mla_tail_counts_in_the_logits():
    """Dropping the key-only features changes the answer by far more than the bound: the
    bound test above could not pass with a kernel that ignored them."""
    heads, dv, tail, rows, pos = MLA_CASES["small"]
    got, want, tol = _mla_run("small", torch.float32, lambda q, cache, *rest, value_dim: (
        da.decode_attention_reference(q[..., :value_dim], torch.nan_to_num(cache)[:, :value_dim], *rest)), "cpu")
    assert ((got.double() - want).abs() > 100 * tol).any()


@needs_kernels
def test_no_visible_key_leaves_only_the_sink():
    """A window of 0 (nothing visible) and no entries: the sink takes all the weight."""
    dev = torch.device(KERNEL_DEVICE)
    q = torch.randn(1, 4, 16, device=dev)
    out = da.decode_attention(q, torch.randn(1, 16, device=dev), torch.tensor([3], device=dev), False, None, None,
                              0, torch.randn(4, device=dev), 0.25, None)
    assert torch.equal(out.cpu(), torch.zeros(1, 4, 16))


@needs_kernels
def test_masked_keys_are_never_read():
    """Rows the query may not see (future entries, unpicked ones, empty window rows) hold NaN:
    the output stays finite and equal to the one with those rows zeroed."""
    dev = torch.device(KERNEL_DEVICE)
    q, window, pos, entries, picks, sinks, unrope = _case(4, 32, 16, 64, 24, 9, 8, 3, torch.float32)
    limit = (9 + 1) // 4
    poisoned_entries = entries.clone()
    unpicked = torch.ones(entries.shape[0], dtype=torch.bool)
    unpicked[picks[0].clamp(min=0)] = False
    poisoned_entries[unpicked] = float("nan")  # visible or not, an entry not picked is not read
    poisoned_entries[limit:] = float("nan")
    poisoned_window = window.clone()
    poisoned_window[9 + 1:] = float("nan")  # rows no position has reached
    moved = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    rope = tuple(moved(*unrope))
    clean = da.decode_attention(*moved(q, window, pos), True, *moved(entries, picks), 4, sinks.to(dev), 0.2, rope)
    dirty = da.decode_attention(*moved(q, poisoned_window, pos), True, *moved(poisoned_entries, picks), 4,
                                sinks.to(dev), 0.2, rope)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)


def test_on_cpu_without_the_interpreter_the_reference_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, window, pos, entries, picks, sinks, unrope = _case(4, 32, 16, 64, 24, 50, 8, 5, torch.float32)
    args = (q, window, pos, True, entries, picks, 4, sinks, 0.2, unrope)
    assert torch.equal(da.decode_attention(*args), da.decode_attention_reference(*args))


@needs_kernels
def test_a_failing_kernel_warns_once_and_falls_back(monkeypatch):
    dev = torch.device(KERNEL_DEVICE)

    break_launches(monkeypatch, da)
    q, window, pos, entries, picks, sinks, unrope = _case(4, 32, 16, 64, None, 50, 8, 6, torch.float32)
    args = [t.to(dev) for t in (q, window, pos)] + [True, entries.to(dev), None, 4, sinks.to(dev), 0.2,
                                                    (unrope[0].to(dev), unrope[1].to(dev))]
    with pytest.warns(RuntimeWarning, match="EXPERTDESK_ATTENTION_TRITON"):
        out = da.decode_attention(*args)
    assert isinstance(da.SWITCH.error, RuntimeError)
    assert torch.equal(out.cpu(), da.decode_attention_reference(*args).cpu())
