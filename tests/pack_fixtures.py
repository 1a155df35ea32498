"""Tiny GGUF models with real tensor names and metadata, for the pack builder's tests.

`write_deepseek4` and `write_kimi_k3` write a few-layer model of that architecture:
routed experts in the real quant types (MXFP4 for DeepSeek-V4; Q2_K gate/up and Q3_K
down at latent width for Kimi-K3), dense tensors in Q8_0/BF16/F32/I32, and the
metadata keys the adapters check. The bytes are random: the packer only moves them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from gguf_factory import RawTensor, Typed, quantized_bytes, write_gguf, write_split_set

DS4 = dict(layers=4, experts=4, top_k=2, hidden=128, ff=64, vocab=64)
KIMI = dict(layers=4, lead=1, experts=8, top_k=2, hidden=512, latent=256, ff=256, dense_ff=512, vocab=64)


def _f32(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _seed(name: str, salt: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}:{name}".encode()).digest()[:4], "little")


def deepseek4_tensors(salt: int = 0, **overrides: int) -> dict[str, Any]:
    """Tensors of a tiny deepseek4 model, in llama.cpp's file order."""
    g = {**DS4, **overrides}
    H, F, E, V = g["hidden"], g["ff"], g["experts"], g["vocab"]
    t: dict[str, Any] = {}

    def q(name, shape, qtype):
        t[name] = quantized_bytes(shape, qtype, seed=_seed(name, salt))

    q("token_embd.weight", (V, H), T.Q8_0)
    for b in range(g["layers"]):
        p = f"blk.{b}."
        t[p + "attn_norm.weight"] = _f32((H,), _seed(p + "an", salt))
        q(p + "attn_q_a.weight", (32, H), T.Q8_0)
        q(p + "attn_kv.weight", (32, H), T.BF16)
        t[p + "ffn_norm.weight"] = _f32((H,), _seed(p + "fn", salt))
        t[p + "ffn_gate_inp.weight"] = _f32((E, H), _seed(p + "gi", salt))
        if b < 3:
            t[p + "ffn_gate_tid2eid.weight"] = np.arange(V * g["top_k"], dtype=np.int32).reshape(V, g["top_k"]) % E
        else:
            t[p + "exp_probs_b.bias"] = _f32((E,), _seed(p + "pb", salt))
        q(p + "ffn_gate_exps.weight", (E, F, H), T.MXFP4)
        q(p + "ffn_up_exps.weight", (E, F, H), T.MXFP4)
        q(p + "ffn_down_exps.weight", (E, H, F), T.MXFP4)
        q(p + "ffn_gate_shexp.weight", (F, H), T.Q8_0)
        q(p + "ffn_down_shexp.weight", (H, F), T.Q8_0)
    t["output_norm.weight"] = _f32((H,), _seed("on", salt))
    q("output.weight", (V, H), T.Q8_0)
    return t


def deepseek4_metadata(**overrides: int) -> dict[str, Any]:
    g = {**DS4, **overrides}
    return {
        "general.name": "tiny deepseek4",
        "deepseek4.block_count": Typed(g["layers"], GGUFValueType.UINT32),
        "deepseek4.embedding_length": Typed(g["hidden"], GGUFValueType.UINT32),
        "deepseek4.expert_count": Typed(g["experts"], GGUFValueType.UINT32),
        "deepseek4.expert_used_count": Typed(g["top_k"], GGUFValueType.UINT32),
        "deepseek4.expert_feed_forward_length": g["ff"],
        "deepseek4.expert_weights_scale": 1.5,
        "deepseek4.expert_weights_norm": True,
        "deepseek4.swiglu_clamp_exp": [10.0] * g["layers"],
        "deepseek4.attention.compress_ratios": Typed([0, 0, 4, 128], GGUFValueType.ARRAY, GGUFValueType.UINT32),
        "tokenizer.ggml.model": "none",
        # A token that is not valid UTF-8 on its own: must survive byte for byte.
        "tokenizer.ggml.tokens": Typed([b"a", b"\xff\xfe", b"c"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        "general.tags": Typed(["moe", "test"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    }


def write_deepseek4(folder: str | Path, name: str = "tiny-ds4", *, salt: int = 0, split: int = 1,
                    **overrides: int) -> Path:
    """Write a tiny deepseek4 model (one file, or `split` shards); return the (first) file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = deepseek4_tensors(salt, **overrides)
    meta = deepseek4_metadata(**overrides)
    if split == 1:
        return write_gguf(folder / f"{name}.gguf", tensors, meta, arch="deepseek4")
    return _split(folder, name, tensors, meta, "deepseek4", split)


def kimi_k3_tensors(salt: int = 0, **overrides: int) -> dict[str, Any]:
    """Tensors of a tiny kimi-k3 model: layer 0 dense, latent-width Q2_K/Q3_K experts after."""
    g = {**KIMI, **overrides}
    H, L, F, E, V = g["hidden"], g["latent"], g["ff"], g["experts"], g["vocab"]
    t: dict[str, Any] = {}

    def q(name, shape, qtype):
        t[name] = quantized_bytes(shape, qtype, seed=_seed(name, salt))

    q("token_embd.weight", (V, H), T.Q8_0)
    for b in range(g["layers"]):
        p = f"blk.{b}."
        t[p + "attn_norm.weight"] = _f32((H,), _seed(p + "an", salt))
        t[p + "attn_res_score.weight"] = _f32((H,), _seed(p + "rs", salt))
        q(p + "attn_q.weight", (64, H), T.Q8_0)
        t[p + "ffn_norm.weight"] = _f32((H,), _seed(p + "fn", salt))
        if b < g["lead"]:
            q(p + "ffn_gate.weight", (g["dense_ff"], H), T.Q8_0)
            q(p + "ffn_up.weight", (g["dense_ff"], H), T.Q8_0)
            q(p + "ffn_down.weight", (H, g["dense_ff"]), T.Q8_0)
            continue
        t[p + "ffn_gate_inp.weight"] = _f32((E, H), _seed(p + "gi", salt))
        t[p + "exp_probs_b.bias"] = _f32((E,), _seed(p + "pb", salt))
        q(p + "ffn_routed_down.weight", (L, H), T.Q8_0)
        q(p + "ffn_routed_up.weight", (H, L), T.Q8_0)
        t[p + "ffn_routed_norm.weight"] = _f32((L,), _seed(p + "rn", salt))
        q(p + "ffn_gate_exps.weight", (E, F, L), T.Q2_K)
        q(p + "ffn_up_exps.weight", (E, F, L), T.Q2_K)
        q(p + "ffn_down_exps.weight", (E, L, F), T.Q3_K)
        q(p + "ffn_gate_shexp.weight", (64, H), T.Q8_0)
    t["output_norm.weight"] = _f32((H,), _seed("on", salt))
    q("output.weight", (V, H), T.Q8_0)
    return t


def kimi_k3_metadata(**overrides: int) -> dict[str, Any]:
    g = {**KIMI, **overrides}
    return {
        "general.name": "tiny kimi-k3",
        "kimi-k3.block_count": Typed(g["layers"], GGUFValueType.UINT32),
        "kimi-k3.embedding_length": Typed(g["hidden"], GGUFValueType.UINT32),
        "kimi-k3.expert_count": Typed(g["experts"], GGUFValueType.UINT32),
        "kimi-k3.expert_used_count": Typed(g["top_k"], GGUFValueType.UINT32),
        "kimi-k3.expert_feed_forward_length": g["ff"],
        "kimi-k3.expert_latent_length": Typed(g["latent"], GGUFValueType.UINT32),
        "kimi-k3.leading_dense_block_count": Typed(g["lead"], GGUFValueType.UINT32),
        "kimi-k3.attention.head_count_kv": Typed([0, 0, 0, 1][: g["layers"]] or [0], GGUFValueType.ARRAY,
                                                 GGUFValueType.INT32),
        "kimi-k3.activation.situ_beta": 4.0,
        "tokenizer.ggml.model": "none",
    }


def write_kimi_k3(folder: str | Path, name: str = "tiny-kimi", *, salt: int = 0, split: int = 1,
                  **overrides: int) -> Path:
    """Write a tiny kimi-k3 model (one file, or `split` shards); return the (first) file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = kimi_k3_tensors(salt, **overrides)
    meta = kimi_k3_metadata(**overrides)
    if split == 1:
        return write_gguf(folder / f"{name}.gguf", tensors, meta, arch="kimi-k3")
    return _split(folder, name, tensors, meta, "kimi-k3", split)


def _split(folder: Path, name: str, tensors: dict[str, Any], meta: dict[str, Any], arch: str, count: int) -> Path:
    items = list(tensors.items())
    per = -(-len(items) // count)
    shards = [dict(items[i * per : (i + 1) * per]) for i in range(count)]
    return write_split_set(folder, name, shards, meta, arch=arch)[0]


def tensor_bytes(tensor: Any) -> bytes:
    """The bytes a fixture tensor is stored as."""
    data = tensor.data if isinstance(tensor, RawTensor) else tensor
    return np.ascontiguousarray(data).tobytes()
