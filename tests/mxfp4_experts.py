"""MXFP4 routed experts for the fused-kernel tests (test_moe_mxfp4, test_moe_mxfp4_prefill):
gguf-quantized weights as tables of expert rows, and the routed sum in float64."""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from engine.kernels import dequantize, row_nbytes
from engine.kernels.moe import ExpertRows


def quantized_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """MXFP4 bytes [rows, nbytes] of Gaussian weights with std 1/sqrt(in_features), via gguf."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    raw = quants.quantize(values.reshape(-1, shape[-1]), Q.MXFP4)
    return raw.view(np.uint8).reshape(shape[0], -1)


def expert_roles(n_experts: int, d_in: int, inter: int, strided: bool, seed: int = 0) -> dict[str, ExpertRows]:
    """gate/up [E, inter, d_in], down [E, d_in, inter] as tables of expert rows.

    strided: like the expert cache's slot pool, one buffer row per expert holds the three
    roles one after another, plus padding, and the pool starts at a nonzero storage
    offset; padding and the bytes before the pool are random, so a misread shows.
    """
    shapes = {"gate": (inter, d_in), "up": (inter, d_in), "down": (d_in, inter)}
    raw = {name: quantized_values((n_experts, *shape), seed + i) for i, (name, shape) in enumerate(shapes.items())}
    if not strided:
        return {name: ExpertRows(torch.from_numpy(raw[name].copy()), int(Q.MXFP4), shapes[name]) for name in shapes}
    widths = [raw[name].shape[1] for name in shapes]
    stride, lead = sum(widths) + 37, 11
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, 256, (lead + n_experts * stride,), dtype=torch.uint8, generator=g)
    pool = buffer[lead:].view(n_experts, stride)
    rows, offset = {}, 0
    for name, width in zip(shapes, widths):
        pool[:, offset:offset + width] = torch.from_numpy(raw[name])
        rows[name] = ExpertRows(pool[:, offset:offset + width], int(Q.MXFP4), shapes[name])
        offset += width
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
