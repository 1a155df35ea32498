"""Routed experts for the fused-kernel tests (test_moe_mxfp4, test_moe_mxfp4_prefill,
test_quant_gemv): quantized weights as tables of expert rows, and the routed sum in float64."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

from engine.kernels import dequantize, row_nbytes
from engine.kernels.moe import ExpertRows

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h block_* structs).
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def moderate_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Random blocks [n_blocks, type_size] of a 32/256-value type whose fp16 scale fields are
    uniform in [scale/5, 2 scale]: random quants, well-conditioned dot products."""
    _, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[Q(ggml_type)]:
        d = rng.uniform(scale / 5, 2 * scale, n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def quantized_values(shape: tuple[int, ...], seed: int, ggml_type: int = Q.MXFP4) -> np.ndarray:
    """Bytes [rows, nbytes] of `ggml_type`: MXFP4 and Q8_0 of Gaussian weights with std
    1/sqrt(in_features) via gguf; the K-quants (which gguf cannot quantize) random blocks
    of about that scale."""
    rng = np.random.default_rng(seed)
    if ggml_type in (Q.MXFP4, Q.Q8_0):
        values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        raw = quants.quantize(values.reshape(-1, shape[-1]), Q(ggml_type))
        return raw.view(np.uint8).reshape(shape[0], -1)
    block_size, _ = GGML_QUANT_SIZES[Q(ggml_type)]
    blocks = moderate_blocks(ggml_type, int(np.prod(shape)) // block_size, rng, 0.2 / np.sqrt(shape[-1]))
    return blocks.reshape(shape[0], -1)


def expert_roles(n_experts: int, d_in: int, inter: int, strided: bool, seed: int = 0,
                 types: Mapping[str, int] | None = None, align: int = 1) -> dict[str, ExpertRows]:
    """gate/up [E, inter, d_in], down [E, d_in, inter] as tables of expert rows, of the
    GGML type `types[role]` (default MXFP4 for all three).

    strided: like the expert cache's slot pool, one buffer row per expert holds the three
    roles one after another, plus padding, and the pool starts at a nonzero storage
    offset; padding and the bytes before the pool are random, so a misread shows. The
    pool's start, its row stride and each role's offset are multiples of `align` (a pack
    aligns them to 4096; 1: odd offsets, which kernels that read words must refuse).
    """
    shapes = {"gate": (inter, d_in), "up": (inter, d_in), "down": (d_in, inter)}
    kinds = {name: int((types or {}).get(name, Q.MXFP4)) for name in shapes}
    raw = {name: quantized_values((n_experts, *shape), seed + i, kinds[name])
           for i, (name, shape) in enumerate(shapes.items())}
    if not strided:
        return {name: ExpertRows(torch.from_numpy(raw[name].copy()), kinds[name], shapes[name]) for name in shapes}
    def up(n: int) -> int:
        return -(-n // align) * align

    widths = [raw[name].shape[1] for name in shapes]
    offsets = [up(sum(up(w) for w in widths[:i])) for i in range(len(widths))]
    stride, lead = up(offsets[-1] + widths[-1] + 37), up(11)
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, 256, (lead + n_experts * stride + align,), dtype=torch.uint8, generator=g)
    start = lead + (-buffer.data_ptr() - lead) % align  # the pool's address a multiple of align
    pool = buffer[start:start + n_experts * stride].view(n_experts, stride)
    rows = {}
    for name, width, offset in zip(shapes, widths, offsets):
        pool[:, offset:offset + width] = torch.from_numpy(raw[name])
        rows[name] = ExpertRows(pool[:, offset:offset + width], kinds[name], shapes[name])
    assert rows["up"].table.storage_offset() > 0 and rows["up"].table.stride(0) == stride
    return rows


def dense(rows: ExpertRows) -> torch.Tensor:
    """float64 [E, out, in]: each expert's row of the table, dequantized (exact in float64)."""
    nbytes = rows.shape[0] * row_nbytes(rows.ggml_type, rows.shape[1])
    return torch.stack([dequantize(rows.table[e, :nbytes].contiguous(), rows.ggml_type, rows.shape).double()
                        for e in range(rows.table.shape[0])])


def float64_reference(roles, x, chosen, weights, activation, absolute=False) -> torch.Tensor:
    """The routed sum in float64; with `absolute`, the sum of the terms' magnitudes (|W|,
    |x|, |act|, |weight|), which bounds float32 rounding."""
    w = {name: dense(r) for name, r in roles.items()}
    if absolute:
        w = {name: v.abs() for name, v in w.items()}
    xs = x.double().abs() if absolute else x.double()
    out = torch.zeros(x.shape[0], w["down"].shape[1], dtype=torch.float64)
    for e in range(w["gate"].shape[0]):
        tokens, slots = torch.where(chosen.cpu() == e)
        if tokens.numel() == 0:
            continue
        act = activation(xs[tokens] @ w["gate"][e].T, xs[tokens] @ w["up"][e].T)
        y = (act.abs() if absolute else act) @ w["down"][e].T
        route = weights.cpu()[tokens, slots].double()
        out.index_add_(0, tokens, y * (route.abs() if absolute else route)[:, None])
    return out


def moved_to(device, roles: dict[str, ExpertRows]) -> dict[str, ExpertRows]:
    """The roles' tables moved to `device` with their strides and offsets (the whole buffer moves)."""
    moved = {}
    for name, r in roles.items():
        t = r.table
        base = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).to(device)
        moved[name] = ExpertRows(base.as_strided(t.shape, t.stride(), t.storage_offset()), r.ggml_type, r.shape)
    return moved


def routing_with_a_hot_expert(tokens: int, seed: int, d_in: int, k: int, used: int,
                              scale: float = 4.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, d_in] with std `scale` (gate outputs of std ~4: the limit 7 clamps some); k
    distinct experts per token from 0..used-1, expert 0 always among them (used.. never
    chosen); token 1 (if any) picks one expert twice; routing weights in [0.1, 1.1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g) * scale
    rows = []
    for _ in range(tokens):
        others = (torch.randperm(used - 1, generator=g)[:k - 1] + 1).tolist()
        picks = torch.tensor([0, *others])
        rows.append(picks[torch.randperm(k, generator=g)])
    chosen = torch.stack(rows)
    if tokens > 1:
        chosen[1, 3] = chosen[1, 0]
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return x, chosen, weights


def weight(ggml_type: int, in_features: int, seed: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF bytes, float64 values) of an out x in_features weight of moderate blocks."""
    raw = torch.from_numpy(quantized_values((out, in_features), seed, ggml_type).reshape(-1).copy())
    return raw, dequantize(raw, ggml_type, (out, in_features)).double()


def dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 bound of x @ w.T in any summation order, with fused multiply-adds: gamma_K
    = K u / (1 - K u), u = 2**-24, relative to |x| @ |w|.T (Higham, eq. 3.5), plus the
    float64 reference's own 2**-53 bound."""
    k = x.shape[-1]
    gamma32, gamma64 = k * 2.0 ** -24 / (1 - k * 2.0 ** -24), k * 2.0 ** -53 / (1 - k * 2.0 ** -53)
    return (gamma32 + gamma64) * (x.double().abs() @ w.abs().T)
