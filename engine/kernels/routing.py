"""The routers after their projection (DeepSeek-V4's and Kimi-K3's), in one launch on CUDA.

From the router's logits z [T, n_experts] (float32): scores s = sqrt(softplus(z))
(DeepSeek-V4) or sigmoid(z) (Kimi-K3, `sigmoid`), the top k of s + bias pick the experts
(the selection-only bias), their weights are s at those experts, normalised to sum 1
when the model says so, times the routed scaling. The normalisation divides by the sum
plus 1e-20 (DeepSeek-V4), or by the sum clamped at `sum_min` (Kimi-K3's 2**-14). In
torch that is 7 to 9 launches per MoE layer; `route` does it in one Triton program per
token (k rounds of argmax over the experts, in registers). The experts come out in
descending order of s + bias (torch's unsorted top-k gives some order of the same set:
only the order of the MoE's float32 sum over k differs). Set EXPERTDESK_ROUTE_TRITON=0
to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["route", "route_reference", "sqrt_softplus"]

SWITCH = TritonSwitch("EXPERTDESK_ROUTE_TRITON", "router")


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's expert scores from the router's logits."""
    return F.softplus(logits).sqrt()


def route_reference(logits: torch.Tensor, bias: torch.Tensor | None, k: int, normalize: bool, scaling: float,
                    chosen: torch.Tensor | None = None, *, sigmoid: bool = False,
                    sum_min: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [T, k] int64, weights [T, k]) from the router's logits [T, n_experts]; a hash
    layer passes its `chosen` experts (no bias) and gets their weights. `sigmoid` and
    `sum_min`: Kimi-K3's scores and normalisation (module docstring)."""
    scores = torch.sigmoid(logits) if sigmoid else sqrt_softplus(logits)
    if chosen is None:
        assert bias is not None  # a layer that selects by score has a selection bias
        chosen = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    if normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if sum_min is None else total.clamp(min=sum_min))
    return chosen, weights * scaling


def route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, normalize: bool, scaling: float,
          chosen: torch.Tensor | None = None, *, sigmoid: bool = False,
          sum_min: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`, in one launch on CUDA when the scores select (experts in
    descending order)."""

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return route_reference(logits, bias, k, normalize, scaling, chosen, sigmoid=sigmoid, sum_min=sum_min)

    selects = bias is not None and chosen is None
    if not selects or not SWITCH.applies(logits) or logits.dtype != torch.float32 or logits.dim() != 2 \
            or not 0 < k <= 64:
        return reference()

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        assert bias is not None  # `selects`
        t, n = logits.shape
        src = logits.contiguous()
        picked = torch.empty((t, k), dtype=torch.int64, device=src.device)
        weights = torch.empty((t, k), dtype=torch.float32, device=src.device)
        if t:
            _route_kernel[(t,)](src, bias.float().contiguous(), picked, weights, n, float(scaling),
                                0.0 if sum_min is None else float(sum_min), K=k,
                                K_BLOCK=triton.next_power_of_2(k), BLOCK=triton.next_power_of_2(n),
                                NORMALIZE=bool(normalize), SIGMOID=sigmoid, CLAMP=sum_min is not None,
                                num_warps=4)
        return picked, weights

    return SWITCH.run(logits.device, launch, reference)


if triton is not None:

    @triton.jit
    def _route_kernel(logits, bias, chosen, weights, n, scaling, sum_min, K: tl.constexpr, K_BLOCK: tl.constexpr,
                      BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, CLAMP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        live = e < n
        z = tl.load(logits + t * n + e, mask=live, other=0.0)
        if SIGMOID:
            s = tl.sigmoid(z)
        else:
            # softplus as torch computes it (threshold 20); log(1 + y) loses y's low bits for
            # small y, where its series y - y^2 / 2 is exact to float32.
            y = tl.exp(z)
            soft = tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
            s = tl.sqrt(tl.where(z > 20.0, z, soft))
        pick = tl.where(live, s + tl.load(bias + e, mask=live, other=0.0), float("-inf"))
        slots = tl.arange(0, K_BLOCK)
        picked = tl.zeros((K_BLOCK,), dtype=tl.int64)
        w = tl.zeros((K_BLOCK,), dtype=tl.float32)
        for i in tl.static_range(K):
            best = tl.argmax(pick, axis=0)
            picked = tl.where(slots == i, best.to(tl.int64), picked)
            w = tl.where(slots == i, tl.sum(tl.where(e == best, s, 0.0), axis=0), w)
            pick = tl.where(e == best, float("-inf"), pick)
        if NORMALIZE:
            if CLAMP:
                w = w / tl.maximum(tl.sum(w, axis=0), sum_min)
            else:
                w = w / (tl.sum(w, axis=0) + 1e-20)
        out = slots < K
        tl.store(chosen + t * K + slots, picked, mask=out)
        tl.store(weights + t * K + slots, w * scaling, mask=out)
