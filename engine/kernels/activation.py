"""Kimi-K3's SiTU activation, in one launch on CUDA.

SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta) (the
second factor is u itself when linear_beta is 0). In torch that is nine element-wise
launches, once per dense or shared-expert FFN a token; `situ` does them in one Triton
launch, rounding to the inputs' dtype after each operation as torch does, so the two
differ only in float32 evaluations of tanh, sigmoid and exp (a few units in the last
place; tests/test_activation.py derives the bound). The routed experts' SiTU lives
inside their fused kernels (`moe_quant`).

Set EXPERTDESK_ACT_TRITON=0 to use torch on CUDA too (`triton_switch`).
"""

from __future__ import annotations

import torch

from .triton_switch import TritonSwitch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

__all__ = ["situ", "situ_reference"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 1024
SWITCH = TritonSwitch("EXPERTDESK_ACT_TRITON", "SiTU")


def situ_reference(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU(g, u) = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)."""
    act = torch.tanh(gate * (1.0 / beta)) * beta * torch.sigmoid(gate)
    if linear_beta > 0:
        up = torch.tanh(up * (1.0 / linear_beta)) * linear_beta
    return act * up


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """`situ_reference`, in one launch on CUDA (no host sync)."""
    def reference() -> torch.Tensor:
        return situ_reference(gate, up, beta, linear_beta)

    if (not SWITCH.applies(gate) or gate.dtype not in _KERNEL_DTYPES or up.dtype != gate.dtype
            or up.shape != gate.shape or up.device != gate.device or beta <= 0):
        return reference()

    return SWITCH.run(gate.device, lambda: _launch(gate, up, beta, linear_beta), reference)


def _launch(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        _situ_kernel[(triton.cdiv(n, _BLOCK),)](g, u, out, n, 1.0 / beta, beta, 1.0 / max(linear_beta, 1e-30),
                                                linear_beta, LINEAR=linear_beta > 0, BLOCK=_BLOCK, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _tanh(x):
        """tanh in float32: its odd series below 1/16 (relative error under 1e-12), else
        (1 - e) / (1 + e) with e = exp(-2 |x|) (about 16 units in the last place at 1/16, fewer above)."""
        a = tl.abs(x)
        x2 = x * x
        series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        e = tl.exp(-2.0 * a)
        far = (1.0 - e) / (1.0 + e)
        return tl.where(a < 0.0625, series, tl.where(x < 0, -far, far))

    @triton.jit
    def _situ_kernel(gate_ptr, up_ptr, out_ptr, n, inv_beta, beta, inv_linear, linear, LINEAR: tl.constexpr,
                     BLOCK: tl.constexpr):
        dtype = gate_ptr.dtype.element_ty
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        g = tl.load(gate_ptr + i, mask=live, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + i, mask=live, other=0.0).to(tl.float32)
        scaled = (g * inv_beta).to(dtype).to(tl.float32)  # each step rounded as torch rounds it
        act = (_tanh(scaled).to(dtype).to(tl.float32) * beta).to(dtype).to(tl.float32)
        act = (act * tl.sigmoid(g).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if LINEAR:
            u = (u * inv_linear).to(dtype).to(tl.float32)
            u = (_tanh(u).to(dtype).to(tl.float32) * linear).to(dtype).to(tl.float32)
        tl.store(out_ptr + i, (act * u).to(dtype), mask=live)
