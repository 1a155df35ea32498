"""GGUF files with the real geometry of DeepSeek-V4-Flash and Kimi-K3, and random weights.

The benchmarks need files that look, to the packer and the engine, exactly like the
published releases: the same metadata keys and values, the same tensor names, shapes
and GGML types, a vocabulary (and a working tokenizer) of the real size; only the
weights are random and only the first N layers are there (`block_count = N`, the
hash / dense leading layers of the real model included as such). An 8-layer
DeepSeek-V4-Flash file is 29.8 GB, a DeepSeek layer about 3.6 GB, a Kimi-K3 layer about
10.9 GB (`--totals` prints the table). On a 16-core machine (an H200 box) the 8-layer
DeepSeek file took 21.7 s (1.37 GB/s, the disk's pace) and a 4-layer Kimi-K3 file
(34.6 GB) 31.7 s.

    python -m benchmarks.real_geometry --model deepseek-v4-flash --layers 8 --out /mnt/t/ds8.gguf
    python -m benchmarks.real_geometry --model kimi-k3 --layers 4 --out k3.gguf --scale small
    python -m benchmarks.real_geometry --model kimi-k3 --totals        # bytes only, writes nothing

Tensor types (numpy-order shapes are in `plan_tensors`):

DeepSeek-V4-Flash, the MXFP4 GGUF (the steering repo's architecture spec): routed
experts `ffn_{gate,up,down}_exps` MXFP4; the checkpoint's FP8 matrices (attn_q_a,
attn_q_b, attn_kv, attn_output_a/b, ffn_*_shexp) Q8_0; the compressor and indexer
projections (attn_compressor_kv/gate, indexer.attn_q_b, indexer.proj,
indexer_compressor_kv/gate) BF16; norms, sinks, hyper-connection parameters,
compressor `ape`, the router `ffn_gate_inp` and `exp_probs_b.bias` F32; the hash
layers' `ffn_gate_tid2eid` I32. The specs do not name the types of token_embd and
output: Q8_0 here, which is what llama.cpp's quantizer gives them for that release
(LLAMA_FTYPE_MOSTLY_MXFP4_MOE: `output` and every non-expert matrix Q8_0).
`dense_types="mxfp4-moe"` applies that quantizer rule to every 2-D weight instead
(compressor/indexer projections, hyper-connection `fn` and `ape` also Q8_0; the
router stays F32, as llama.cpp never quantizes `ffn_gate_inp`): 155.08 GB for the
full model against the 155.10 GB of the seed's blob, where the spec's types give
155.64 GB; the routed experts (147.17 GB) are the same either way.

Kimi-K3, the Q2_K split GGUF: the specs give the routed experts (gate/up Q2_K, down
Q3_K, as the seed's file); everything else is what llama.cpp's quantizer does for
LLAMA_FTYPE_MOSTLY_Q2_K (`llama_tensor_get_type` in src/llama-quant.cpp) on the
converter's tensors: default Q2_K; every `ffn_down*` (routed, shared, layer 0's dense)
Q3_K; `attn_output` Q3_K (the model does not have 8 experts); `attn_v` Q3_K (n_gqa() is
0 on KDA layer 0); `output` Q6_K; 1-D tensors, `*_norm`, `ffn_gate_inp`, `ssm_a` and the
biases stay F32. Rows whose width is not a multiple of 256 cannot be K-quantized:
llama.cpp falls back to IQ4_NL for `attn_k_b` and `ssm_f_b` (128 wide), a type
ExpertDesk's kernels do not dequantize, so those two are Q8_0 here (a real file made by
plain llama-quantize would need IQ4_NL support); the short-conv kernels (4 wide) stay
F32 (llama-quantize skips conv kernels, and llama.cpp's CUDA ssm_conv asserts F32 ones),
numpy shape (d_inner, 1, 4). Full model: 1009.05 GB of tensor data against the seed's
1009.51 GB.

Weights: every quantized tensor is made of valid random blocks written directly
(random quants, block scales drawn so that the dequantized values have the standard
deviation of a Gaussian init, 1/sqrt(fan_in) for matrices, 1 for token_embd; measured
against `gguf.quants.dequantize`), because quantizing real Gaussians with gguf-py runs
at a few tens of MB/s and a file is tens of GB. Float tensors are Gaussian: norm gains
around 1, hyper-connection bases, sinks, `ape`, router biases small; the tid2eid table
gives every token distinct random experts; Kimi's `ssm_a` is -exp(U(-1.5, 1.5)).
Activations stay finite and the routers' choices depend on the input (see
tests/test_real_geometry.py).

The tokenizer is a synthetic byte-level BPE of the real vocabulary size (all single
bytes, then merges building the two- and three-character strings of frequent
characters first), with the control tokens the built-in chat formats look for
(DeepSeek's <｜User｜> / <｜Assistant｜> / <｜end▁of▁sentence｜>, Kimi-K3's
<|open|> / <|sep|> / <|close|> / <|end_of_msg|>) at the real BOS / EOS ids. English
comes out in about twice the real tokenizers' token counts (2.2 characters a token):
prompts are longer in tokens than with the real vocabulary.

Writing streams: the header first, then every tensor in chunks of 16 MiB generated on
a thread pool (numpy's bit generators release the GIL) and written in order, so
memory stays at a few chunks per thread whatever the file size, and the bytes depend
only on the seed and the tensor names (not on the thread count or on N).
`--scale small` shrinks every dimension consistently (same tensor names, types and
layer schedule; widths kept multiples of the K-quant block) for tests.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from engine.text.tokenizer import _BYTE_TO_CHAR  # noqa: E402

T = GGMLQuantizationType
MODELS = ("deepseek-v4-flash", "kimi-k3")
SCALES = ("full", "small")
DENSE_TYPES = ("spec", "mxfp4-moe")
CHUNK_BYTES = 16 << 20
GB = 10**9

# ---------------------------------------------------------------------------------------
# Geometry


@dataclass(frozen=True)
class DeepSeekV4Geometry:
    """DeepSeek-V4-Flash's published configuration (transformers' DeepseekV4Config
    defaults and the specs), or a consistently shrunk copy (`small`)."""

    vocab: int = 129280
    hidden: int = 4096
    n_layers: int = 43
    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora: int = 1024
    o_groups: int = 8
    o_lora: int = 1024
    experts: int = 256
    top_k: int = 6
    expert_ffn: int = 2048
    shared: int = 1
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hash_layers: int = 3
    sliding_window: int = 128
    hc: int = 4
    csa_ratio: int = 4
    hca_ratio: int = 128
    context: int = 1048576

    def compress_ratio(self, layer: int) -> int:
        """0 (sliding window only) for layers 0-1, then CSA and HCA alternating from layer 2."""
        if layer < 2:
            return 0
        return self.csa_ratio if layer % 2 == 0 else self.hca_ratio

    def small(self) -> DeepSeekV4Geometry:
        return replace(self, vocab=4096, hidden=256, heads=4, head_dim=128, q_lora=128, o_groups=2, o_lora=64,
                       experts=16, expert_ffn=128, index_heads=8, index_head_dim=64)


@dataclass(frozen=True)
class KimiK3Geometry:
    """Kimi-K3's published text configuration (the specs), or a shrunk copy (`small`)."""

    vocab: int = 163840
    hidden: int = 7168
    n_layers: int = 93
    heads: int = 96
    kda_head_dim: int = 128
    conv: int = 4
    q_lora: int = 1536
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v_head: int = 128
    dense_layers: int = 1
    dense_ffn: int = 33792
    experts: int = 896
    top_k: int = 16
    expert_ffn: int = 3072
    shared: int = 2
    latent: int = 3584
    res_block: int = 12
    bos: int = 163584
    eos: int = 163586
    context: int = 262144  # not in the specs; only sets the service's context limit

    def is_mla(self, layer: int) -> bool:
        """MLA at 3, 7, 11, ..., 91 and the last layer (92); KDA elsewhere."""
        return layer % 4 == 3 or layer == 92

    def small(self) -> KimiK3Geometry:
        return replace(self, vocab=4096, hidden=256, heads=2, q_lora=256, kv_lora=256, dense_ffn=512, experts=32,
                       top_k=4, expert_ffn=256, latent=256, bos=4000, eos=4002)


def geometry(model: str, scale: str = "full") -> DeepSeekV4Geometry | KimiK3Geometry:
    """The geometry of `model` ("deepseek-v4-flash" or "kimi-k3") at `scale` ("full" or "small")."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; use one of {', '.join(MODELS)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; use one of {', '.join(SCALES)}")
    g = DeepSeekV4Geometry() if model == "deepseek-v4-flash" else KimiK3Geometry()
    return g.small() if scale == "small" else g


# ---------------------------------------------------------------------------------------
# The tensors


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: name, numpy-order shape, GGML type and how to fill it.

    init: "normal" (Gaussian of `mean`, `std`; for a quantized type, random blocks whose
    values have that std), "tid2eid" (each row: shape[-1] distinct expert ids out of
    `arg` experts) or "neg_exp" (-exp(U(-1.5, 1.5)), Kimi's ssm_a).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    init: str = "normal"
    std: float = 1.0
    mean: float = 0.0
    arg: int = 0

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block * size

    @property
    def block(self) -> int | None:
        """The layer index of a `blk.N.*` tensor, None for the model-level ones."""
        if not self.name.startswith("blk."):
            return None
        return int(self.name.split(".")[1])

    @property
    def is_routed_expert(self) -> bool:
        return self.name.endswith("_exps.weight")


def _matrix(name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> TensorPlan:
    """A weight matrix (or a stack of them) with the Gaussian init std 1/sqrt(fan_in)."""
    return TensorPlan(name, tuple(shape), ggml_type, std=shape[-1] ** -0.5)


def _gain(name: str, width: int) -> TensorPlan:
    """An RMSNorm gain: F32 around 1."""
    return TensorPlan(name, (width,), T.F32, std=0.2, mean=1.0)


def _small(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0,
           ggml_type: GGMLQuantizationType = T.F32) -> TensorPlan:
    return TensorPlan(name, tuple(shape), ggml_type, std=std, mean=mean)


def deepseek_v4_tensors(g: DeepSeekV4Geometry, n_layers: int, dense_types: str = "spec") -> list[TensorPlan]:
    """Every tensor of an `n_layers` DeepSeek-V4-Flash file, in llama.cpp's converter order."""
    if dense_types not in DENSE_TYPES:
        raise ValueError(f"unknown dense_types {dense_types!r}; use one of {', '.join(DENSE_TYPES)}")
    big = T.Q8_0
    side = T.BF16 if dense_types == "spec" else T.Q8_0  # compressor / indexer projections
    small2d = T.F32 if dense_types == "spec" else T.Q8_0  # hyper-connection fn, compressor ape
    H, hc, mix = g.hidden, g.hc, (2 + g.hc) * g.hc
    t = [
        replace(_matrix("token_embd.weight", (g.vocab, H), big), std=1.0),  # unit variance: the streams' scale
        _gain("output_norm.weight", H),
        _matrix("output.weight", (g.vocab, H), big),
        _matrix("output_hc_fn.weight", (hc, hc * H), small2d),
        _small("output_hc_base.weight", (hc,), 0.5),
        _small("output_hc_scale.weight", (1,), 0.3, 1.0),
    ]
    for i in range(n_layers):
        b = f"blk.{i}."
        for kind in ("attn", "ffn"):
            t += [_matrix(f"{b}hc_{kind}_fn.weight", (mix, hc * H), small2d),
                  _small(f"{b}hc_{kind}_base.weight", (mix,), 0.5),
                  _small(f"{b}hc_{kind}_scale.weight", (3,), 0.3, 1.0)]
        t += [
            _gain(b + "attn_norm.weight", H),
            _small(b + "attn_sinks.weight", (g.heads,), 1.0),
            _matrix(b + "attn_q_a.weight", (g.q_lora, H), big),
            _gain(b + "attn_q_a_norm.weight", g.q_lora),
            _matrix(b + "attn_q_b.weight", (g.heads * g.head_dim, g.q_lora), big),
            _matrix(b + "attn_kv.weight", (g.head_dim, H), big),
            _gain(b + "attn_kv_a_norm.weight", g.head_dim),
            _matrix(b + "attn_output_a.weight", (g.o_groups * g.o_lora, g.heads * g.head_dim // g.o_groups), big),
            _matrix(b + "attn_output_b.weight", (H, g.o_groups * g.o_lora), big),
        ]
        ratio = g.compress_ratio(i)
        if ratio:
            coff = 2 if ratio == g.csa_ratio else 1
            t += [_matrix(b + "attn_compressor_kv.weight", (coff * g.head_dim, H), side),
                  _matrix(b + "attn_compressor_gate.weight", (coff * g.head_dim, H), side),
                  _small(b + "attn_compressor_ape.weight", (ratio, coff * g.head_dim), 0.5, ggml_type=small2d),
                  _gain(b + "attn_compressor_norm.weight", g.head_dim)]
        if ratio == g.csa_ratio:
            t += [_matrix(b + "indexer.attn_q_b.weight", (g.index_heads * g.index_head_dim, g.q_lora), side),
                  _matrix(b + "indexer.proj.weight", (g.index_heads, H), side),
                  _matrix(b + "indexer_compressor_kv.weight", (2 * g.index_head_dim, H), side),
                  _matrix(b + "indexer_compressor_gate.weight", (2 * g.index_head_dim, H), side),
                  _small(b + "indexer_compressor_ape.weight", (ratio, 2 * g.index_head_dim), 0.5, ggml_type=small2d),
                  _gain(b + "indexer_compressor_norm.weight", g.index_head_dim)]
        t += [_gain(b + "ffn_norm.weight", H), _matrix(b + "ffn_gate_inp.weight", (g.experts, H), T.F32)]
        if i < g.hash_layers:
            t.append(TensorPlan(b + "ffn_gate_tid2eid.weight", (g.vocab, g.top_k), T.I32, init="tid2eid",
                                arg=g.experts))
        else:
            t.append(_small(b + "exp_probs_b.bias", (g.experts,), 0.1))
        t += [_matrix(b + "ffn_gate_exps.weight", (g.experts, g.expert_ffn, H), T.MXFP4),
              _matrix(b + "ffn_up_exps.weight", (g.experts, g.expert_ffn, H), T.MXFP4),
              _matrix(b + "ffn_down_exps.weight", (g.experts, H, g.expert_ffn), T.MXFP4),
              _matrix(b + "ffn_gate_shexp.weight", (g.expert_ffn * g.shared, H), big),
              _matrix(b + "ffn_up_shexp.weight", (g.expert_ffn * g.shared, H), big),
              _matrix(b + "ffn_down_shexp.weight", (H, g.expert_ffn * g.shared), big)]
    return t


def kimi_q2k_type(name: str, shape: Sequence[int]) -> GGMLQuantizationType:
    """The type llama.cpp's quantizer gives a Kimi-K3 tensor for LLAMA_FTYPE_MOSTLY_Q2_K
    (see the module docstring), with Q8_0 where it would fall back to IQ4_NL."""
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ffn_gate_inp.weight" in name:
        return T.F32
    if "ssm_conv1d" in name:  # llama.cpp never quantizes conv kernels; its CUDA ssm_conv needs F32
        return T.F32
    if name == "output.weight":
        qtype = T.Q6_K
    elif "attn_v.weight" in name or "ffn_down" in name or "attn_output.weight" in name:
        qtype = T.Q3_K
    else:
        qtype = T.Q2_K
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # ne[0] is the numpy shape's last dimension
        # llama.cpp: Q2_K / Q3_K -> IQ4_NL (unsupported here: Q8_0), F16 below 32-wide rows
        return T.Q8_0 if shape[-1] % 32 == 0 else T.F16
    return qtype


def kimi_k3_tensors(g: KimiK3Geometry, n_layers: int) -> list[TensorPlan]:
    """Every tensor of an `n_layers` Kimi-K3 file, in llama.cpp's converter order."""
    H, heads = g.hidden, g.heads
    d_inner = heads * g.kda_head_dim
    k_mla = g.nope + g.rope

    def mat(name: str, *shape: int) -> TensorPlan:
        return _matrix(name, shape, kimi_q2k_type(name, shape))

    t = [replace(mat("token_embd.weight", g.vocab, H), std=1.0)]
    for i in range(n_layers):
        b = f"blk.{i}."
        t += [_gain(b + "attn_norm.weight", H)]
        if g.res_block:
            t += [_small(b + "attn_res_score.weight", (H,), H ** -0.5),
                  _small(b + "ffn_res_score.weight", (H,), H ** -0.5)]
        if not g.is_mla(i):
            for x in "qkv":
                t.append(mat(f"{b}attn_{x}.weight", d_inner, H))
            for x in "qkv":
                name = f"{b}ssm_conv1d_{x}.weight"
                t.append(_small(name, (d_inner, 1, g.conv), 0.5,
                                ggml_type=kimi_q2k_type(name, (d_inner, 1, g.conv))))
            t += [mat(b + "ssm_f_a.weight", g.kda_head_dim, H),
                  mat(b + "ssm_f_b.weight", d_inner, g.kda_head_dim),
                  mat(b + "ssm_beta.weight", heads, H),
                  TensorPlan(b + "ssm_a", (heads,), T.F32, init="neg_exp"),
                  _small(b + "ssm_dt.bias", (d_inner,), 1.5, -1.5),
                  mat(b + "ssm_g.weight", d_inner, H),
                  _gain(b + "ssm_norm.weight", g.kda_head_dim),
                  mat(b + "attn_output.weight", H, d_inner)]
        else:
            k_b = b + "attn_k_b.weight"
            v_b = b + "attn_v_b.weight"
            t += [mat(b + "attn_q_a.weight", g.q_lora, H),
                  _gain(b + "attn_q_a_norm.weight", g.q_lora),
                  mat(b + "attn_q_b.weight", heads * k_mla, g.q_lora),
                  mat(b + "attn_kv_a_mqa.weight", g.kv_lora + g.rope, H),
                  _gain(b + "attn_kv_a_norm.weight", g.kv_lora),
                  # k_b is kv_b's key half transposed per head: its fan-in is still kv_lora
                  replace(mat(k_b, heads, g.kv_lora, g.nope), std=g.kv_lora ** -0.5),
                  mat(v_b, heads, g.v_head, g.kv_lora),
                  mat(b + "attn_gate.weight", heads * g.v_head, H),
                  mat(b + "attn_output.weight", H, heads * g.v_head)]
        t.append(_gain(b + "ffn_norm.weight", H))
        if i < g.dense_layers:
            t += [mat(b + "ffn_gate.weight", g.dense_ffn, H),
                  mat(b + "ffn_up.weight", g.dense_ffn, H),
                  mat(b + "ffn_down.weight", H, g.dense_ffn)]
            continue
        width = g.expert_ffn * g.shared
        t += [_matrix(b + "ffn_gate_inp.weight", (g.experts, H), T.F32),
              _small(b + "exp_probs_b.bias", (g.experts,), 0.1),
              mat(b + "ffn_routed_down.weight", g.latent, H),
              mat(b + "ffn_routed_up.weight", H, g.latent),
              _gain(b + "ffn_routed_norm.weight", g.latent),
              mat(b + "ffn_gate_exps.weight", g.experts, g.expert_ffn, g.latent),
              mat(b + "ffn_up_exps.weight", g.experts, g.expert_ffn, g.latent),
              mat(b + "ffn_down_exps.weight", g.experts, g.latent, g.expert_ffn),
              mat(b + "ffn_gate_shexp.weight", width, H),
              mat(b + "ffn_up_shexp.weight", width, H),
              mat(b + "ffn_down_shexp.weight", H, width)]
    if g.res_block:
        t.append(_small("output_res_score.weight", (H,), H ** -0.5))
    t += [_gain("output_norm.weight", H), mat("output.weight", g.vocab, H)]
    return t


def plan_tensors(model: str, n_layers: int, *, scale: str = "full", vocab: int | None = None,
                 dense_types: str = "spec") -> list[TensorPlan]:
    """The tensors of an `n_layers` file of `model` (see the module docstring for types)."""
    g = _geometry_with_vocab(model, scale, vocab)
    if not 1 <= n_layers <= g.n_layers:
        raise ValueError(f"{model} has {g.n_layers} layers; --layers must be 1..{g.n_layers}")
    if model == "deepseek-v4-flash":
        return deepseek_v4_tensors(g, n_layers, dense_types)
    return kimi_k3_tensors(g, n_layers)


def _geometry_with_vocab(model: str, scale: str, vocab: int | None):
    g = geometry(model, scale)
    if vocab is None or vocab == g.vocab:
        return g
    if vocab < 1024:
        raise ValueError(f"vocab {vocab} is too small for the synthetic tokenizer; use 1024 or more")
    if isinstance(g, KimiK3Geometry):  # the control tokens keep their distance from the end
        return replace(g, vocab=vocab, bos=vocab - (g.vocab - g.bos), eos=vocab - (g.vocab - g.eos))
    return replace(g, vocab=vocab)


# ---------------------------------------------------------------------------------------
# Metadata and tokenizer


def _special_tokens(model: str, g) -> dict[int, tuple[str, int]]:
    """id -> (text, token type) of the control / user-defined tokens."""
    control, user = 3, 4
    if model == "deepseek-v4-flash":
        tail = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
        out = {0: ("<｜begin▁of▁sentence｜>", control), 1: ("<｜end▁of▁sentence｜>", control),
               2: ("<｜▁pad▁｜>", control)}
        for k, text in enumerate(tail):
            out[g.vocab - len(tail) + k] = (text, user if "think" in text else control)
        return out
    texts = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|sep|>", "<|close|>", "<|im_end|>"]
    return {g.bos + k: (text, control) for k, text in enumerate(texts)}


def tokenizer_metadata(model: str, g) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """`tokenizer.ggml.*` keys of a synthetic byte-level BPE of g.vocab tokens (see the module docstring)."""
    specials = _special_tokens(model, g)
    n_normal = g.vocab - len(specials)
    base = [_BYTE_TO_CHAR[b] for b in range(256)]
    # Frequent characters first, so the merges build the common two- and three-letter pieces.
    order = " etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,'\"-?!:;()/\n"
    alphabet = [_BYTE_TO_CHAR[ord(c)] for c in order]
    alphabet += [ch for ch in (_BYTE_TO_CHAR[b] for b in range(33, 127)) if ch not in alphabet]
    vocab_set = set(base)
    normal, merges, stems = list(base), [], list(alphabet)
    k = 0
    while len(normal) < n_normal:
        left, right = stems[k // len(alphabet)], alphabet[k % len(alphabet)]
        k += 1
        if left + right in vocab_set:
            continue
        vocab_set.add(left + right)
        normal.append(left + right)
        merges.append(f"{left} {right}")
        stems.append(left + right)
    tokens, types, it = [], [], iter(normal)
    for i in range(g.vocab):
        if i in specials:
            text, kind = specials[i]
            tokens.append(text)
            types.append(kind)
        else:
            tokens.append(next(it))
            types.append(1)
    S, A, I32 = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.INT32
    U32 = GGUFValueType.UINT32
    ds = model == "deepseek-v4-flash"
    bos, eos = (0, 1) if ds else (g.bos, g.eos)
    return {
        "tokenizer.ggml.model": ("gpt2", S, None),
        "tokenizer.ggml.pre": ("deepseek-v3" if ds else "kimi-k2", S, None),
        "tokenizer.ggml.tokens": (tokens, A, S),
        "tokenizer.ggml.token_type": (types, A, I32),
        "tokenizer.ggml.merges": (merges, A, S),
        "tokenizer.ggml.bos_token_id": (bos, U32, None),
        "tokenizer.ggml.eos_token_id": (eos, U32, None),
        "tokenizer.ggml.add_bos_token": (ds, GGUFValueType.BOOL, None),
        "tokenizer.ggml.add_eos_token": (False, GGUFValueType.BOOL, None),
    }


def model_metadata(model: str, g, n_layers: int) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """The architecture keys (every one the engine's config readers require, and the
    others llama.cpp's converter writes) of an `n_layers` file."""
    U32, F32, B, S, A = (GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL, GGUFValueType.STRING,
                         GGUFValueType.ARRAY)
    if model == "deepseek-v4-flash":
        p = "deepseek4."
        keys: dict[str, tuple[object, GGUFValueType, GGUFValueType | None]] = {
            "vocab_size": (g.vocab, U32, None), "context_length": (g.context, U32, None),
            "embedding_length": (g.hidden, U32, None), "block_count": (n_layers, U32, None),
            "attention.head_count": (g.heads, U32, None), "attention.head_count_kv": (1, U32, None),
            "attention.key_length": (g.head_dim, U32, None), "attention.value_length": (g.head_dim, U32, None),
            "attention.layer_norm_rms_epsilon": (1e-6, F32, None), "attention.q_lora_rank": (g.q_lora, U32, None),
            "attention.sliding_window": (g.sliding_window, U32, None),
            "attention.output_group_count": (g.o_groups, U32, None),
            "attention.output_lora_rank": (g.o_lora, U32, None),
            # The file holds no MTP layer, so no trailing entry and nextn_predict_layers 0.
            "attention.compress_ratios": ([g.compress_ratio(i) for i in range(n_layers)], A, U32),
            "attention.compress_rope_freq_base": (160000.0, F32, None),
            "attention.indexer.head_count": (g.index_heads, U32, None),
            "attention.indexer.key_length": (g.index_head_dim, U32, None),
            "attention.indexer.top_k": (g.index_topk, U32, None),
            "rope.dimension_count": (g.rope_dim, U32, None), "rope.freq_base": (10000.0, F32, None),
            "rope.scaling.type": ("yarn", S, None), "rope.scaling.factor": (16.0, F32, None),
            "rope.scaling.original_context_length": (65536, U32, None),
            "rope.scaling.yarn_beta_fast": (32.0, F32, None), "rope.scaling.yarn_beta_slow": (1.0, F32, None),
            "expert_count": (g.experts, U32, None), "expert_used_count": (g.top_k, U32, None),
            "expert_feed_forward_length": (g.expert_ffn, U32, None),
            "expert_shared_count": (g.shared, U32, None), "expert_weights_scale": (1.5, F32, None),
            "expert_weights_norm": (True, B, None), "expert_gating_func": (4, U32, None),  # sqrtsoftplus
            "swiglu_clamp_exp": ([10.0] * n_layers, A, F32), "swiglu_clamp_shexp": ([10.0] * n_layers, A, F32),
            "hash_layer_count": (g.hash_layers, U32, None), "leading_dense_block_count": (0, U32, None),
            "hyper_connection.count": (g.hc, U32, None), "hyper_connection.sinkhorn_iterations": (20, U32, None),
            "hyper_connection.epsilon": (1e-6, F32, None), "nextn_predict_layers": (0, U32, None),
        }
        name, file_type = "DeepSeek-V4-Flash", 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    else:
        p = "kimi-k3."
        keys = {
            "vocab_size": (g.vocab, U32, None), "context_length": (g.context, U32, None),
            "embedding_length": (g.hidden, U32, None), "block_count": (n_layers, U32, None),
            "feed_forward_length": (g.dense_ffn, U32, None), "attention.head_count": (g.heads, U32, None),
            "attention.head_count_kv": ([1 if g.is_mla(i) else 0 for i in range(n_layers)], A, U32),
            "attention.layer_norm_rms_epsilon": (1e-5, F32, None), "attention.q_lora_rank": (g.q_lora, U32, None),
            "attention.kv_lora_rank": (g.kv_lora, U32, None),
            "attention.key_length": (g.kv_lora + g.rope, U32, None),
            "attention.value_length": (g.kv_lora, U32, None),
            "attention.key_length_mla": (g.nope + g.rope, U32, None),
            "attention.value_length_mla": (g.v_head, U32, None), "rope.dimension_count": (g.rope, U32, None),
            "ssm.conv_kernel": (g.conv, U32, None), "kda.head_dim": (g.kda_head_dim, U32, None),
            "kda.gate_lower_bound": (-5.0, F32, None), "expert_count": (g.experts, U32, None),
            "expert_used_count": (g.top_k, U32, None), "expert_feed_forward_length": (g.expert_ffn, U32, None),
            "expert_shared_count": (g.shared, U32, None), "leading_dense_block_count": (g.dense_layers, U32, None),
            "expert_weights_scale": (1.0, F32, None), "expert_weights_norm": (True, B, None),
            "expert_gating_func": (2, U32, None),  # sigmoid
            "expert_latent_length": (g.latent, U32, None), "activation.situ_beta": (4.0, F32, None),
            "activation.situ_linear_beta": (25.0, F32, None), "attn_res.block_size": (g.res_block, U32, None),
        }
        name, file_type = "Kimi-K3", 10  # LLAMA_FTYPE_MOSTLY_Q2_K
    out = {p + key: value for key, value in keys.items()}
    out["general.name"] = (f"{name} real geometry, random weights ({n_layers} of {g.n_layers} layers)", S, None)
    out["general.file_type"] = (file_type, U32, None)
    out["general.quantization_version"] = (2, U32, None)
    return out


# ---------------------------------------------------------------------------------------
# Random contents


# Where the block scales sit in each quantized type (byte offsets of fp16 d / dmin), and
# dmin / d, chosen so that the values of a block have mean ~0 (d*sc*q - dmin*m).
_FP16_SCALES = {
    T.Q8_0: (0, None, 0.0),
    T.Q2_K: (80, 82, 1.5),  # E[sc q] = 7.5 * 1.5 = E[m] * 1.5
    T.Q3_K: (108, None, 0.0),
    T.Q4_K: (0, 2, 7.5),  # E[sc q] = 31.5 * 7.5 = E[m] * 7.5
    T.Q6_K: (208, None, 0.0),
}
_JITTER = np.linspace(0.7, 1.3, 256)  # per-block spread of the scales around their mean


def _fill_scales(blocks: np.ndarray, qtype: GGMLQuantizationType, d: float) -> None:
    """Overwrite the fp16 scale fields of random `blocks` [n, type_size] with d * jitter,
    the jitter picked by the (random) byte already there."""
    at, at_min, ratio = _FP16_SCALES[qtype]
    pick = blocks[:, at].copy()
    lut = (d * _JITTER).astype(np.float16).view(np.uint16)
    blocks[:, at:at + 2] = lut[pick].view(np.uint8).reshape(-1, 2)
    if at_min is not None:
        lut_min = (d * ratio * _JITTER).astype(np.float16).view(np.uint16)
        blocks[:, at_min:at_min + 2] = lut_min[pick].view(np.uint8).reshape(-1, 2)


def _mxfp4_exponents(blocks: np.ndarray, e_lo: int, p_high: float) -> None:
    """Set the E8M0 byte of random MXFP4 `blocks`: e_lo + 1 with probability p_high, else e_lo."""
    lut = np.where(np.arange(256) < round(p_high * 256), e_lo + 1, e_lo).clip(1, 254).astype(np.uint8)
    blocks[:, 0] = lut[blocks[:, 0]]


@cache
def _unit_rms(qtype: GGMLQuantizationType) -> float:
    """RMS of the dequantized values of random blocks with unit scales (MXFP4: e = 127),
    measured with gguf.quants.dequantize, ggml's own decoding."""
    rng = np.random.Generator(np.random.SFC64(12345))
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = np.frombuffer(rng.bytes(4096 * size), dtype=np.uint8).reshape(4096, size).copy()
    if qtype == T.MXFP4:
        blocks[:, 0] = 127
    else:
        lut_one = np.array([1.0], dtype=np.float16).view(np.uint16)
        at, at_min, ratio = _FP16_SCALES[qtype]
        blocks[:, at:at + 2] = lut_one.view(np.uint8)
        if at_min is not None:
            blocks[:, at_min:at_min + 2] = np.array([ratio], dtype=np.float16).view(np.uint8)
    values = gguf_dequantize(blocks, qtype).astype(np.float64)
    return float(np.sqrt(np.mean(values**2)))


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` valid random blocks of `qtype` (uint8 [n_blocks, type_size]) whose
    dequantized values have standard deviation `std` (random quants, random scales)."""
    size = GGML_QUANT_SIZES[qtype][1]
    nbytes = n_blocks * size
    raw = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    blocks = raw.reshape(n_blocks, size)
    if qtype == T.MXFP4:
        # value = kv * 2^(e - 127) * 0.5: pick e from two neighbours so the mean square is exact
        t = math.log2(std / _unit_rms(qtype))
        low = math.floor(t)
        _mxfp4_exponents(blocks, 127 + low, (4 ** (t - low) - 1) / 3)
    elif qtype in _FP16_SCALES:
        _fill_scales(blocks, qtype, std / (_unit_rms(qtype) * float(np.sqrt(np.mean(_JITTER**2)))))
    else:
        raise ValueError(f"no random-block generator for {qtype.name}")
    return blocks


def _float_bytes(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == T.F32:
        return values.astype(np.float32, copy=False).view(np.uint8)
    if qtype == T.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == T.BF16:  # round to nearest even, as torch / ggml convert
        bits = values.astype(np.float32, copy=False).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
    raise ValueError(f"{qtype.name} is not a float type")


def _chunks(plan: TensorPlan) -> list[tuple[int, int]]:
    """(first unit, units) of each chunk; a unit is a block (quantized), a row
    (tid2eid) or a value (floats)."""
    if plan.init == "tid2eid":
        unit_bytes, units = plan.shape[-1] * 4, math.prod(plan.shape[:-1])
    else:
        block, size = GGML_QUANT_SIZES[plan.ggml_type]
        unit_bytes, units = size, plan.n_elements // block
    per_chunk = max(1, CHUNK_BYTES // unit_bytes)
    if plan.init == "neg_exp":
        per_chunk = units
    return [(start, min(per_chunk, units - start)) for start in range(0, units, per_chunk)]


def chunk_bytes(plan: TensorPlan, start: int, count: int, seed: int) -> np.ndarray:
    """The bytes of units [start, start + count) of `plan` (uint8, contiguous). They
    depend only on (seed, the tensor's name, start), so any thread may make any chunk."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(plan.name.encode()), start])))
    qtype = plan.ggml_type
    if plan.init == "tid2eid":  # random ids, rows with a repeated id drawn again
        ids = rng.integers(0, plan.arg, (count, plan.shape[-1]), dtype=np.int32)
        while True:
            ordered = np.sort(ids, axis=1)
            repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            if not repeated.any():
                return ids.view(np.uint8).reshape(-1)
            ids[repeated] = rng.integers(0, plan.arg, (int(repeated.sum()), plan.shape[-1]), dtype=np.int32)
    if plan.init == "neg_exp":
        return _float_bytes(-np.exp(rng.uniform(-1.5, 1.5, count)).astype(np.float32), qtype)
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(count, dtype=np.float32)
        values *= np.float32(plan.std)
        values += np.float32(plan.mean)
        return _float_bytes(values, qtype)
    return random_blocks(qtype, count, plan.std, rng).reshape(-1)


# ---------------------------------------------------------------------------------------
# Writing


def _add_metadata(writer: GGUFWriter, metadata: dict) -> None:
    for key, (value, vtype, sub_type) in metadata.items():
        writer.add_key_value(key, value, vtype, sub_type)


def write_real_geometry_gguf(
    path: str | os.PathLike,
    model: str,
    n_layers: int,
    *,
    seed: int = 0,
    scale: str = "full",
    vocab: int | None = None,
    dense_types: str = "spec",
    threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write an `n_layers` GGUF of `model` with random weights at `path`; returns the path.

    Streams: memory stays at about 2 x `threads` chunks of 16 MiB whatever the size.
    progress(bytes_written, total_bytes) is called after every chunk.
    """
    path = Path(path)
    g = _geometry_with_vocab(model, scale, vocab)
    plans = plan_tensors(model, n_layers, scale=scale, vocab=g.vocab, dense_types=dense_types)
    arch = "deepseek4" if model == "deepseek-v4-flash" else "kimi-k3"
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    try:
        _add_metadata(writer, model_metadata(model, g, n_layers))
        _add_metadata(writer, tokenizer_metadata(model, g))
        for plan in plans:
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        _write_tensor_data(fout, plans, seed, threads or os.cpu_count() or 1, writer.data_alignment, progress)
        fout.flush()
    finally:
        writer.close()
    return path


def _write_tensor_data(fout, plans: Sequence[TensorPlan], seed: int, threads: int, alignment: int,
                       progress: Callable[[int, int], None] | None) -> None:
    """Every tensor's bytes in file order, each padded to `alignment`; chunks are made
    ahead on `threads` threads and written in order."""
    total = sum(p.nbytes for p in plans)
    jobs: Iterator[tuple[TensorPlan, int, int, bool]] = (
        (plan, start, count, k == len(chunks) - 1)
        for plan in plans for chunks in [_chunks(plan)] for k, (start, count) in enumerate(chunks)
    )
    done = 0
    pending: deque = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="real-geometry") as pool:
        def submit_next() -> bool:
            job = next(jobs, None)
            if job is None:
                return False
            plan, start, count, last = job
            pending.append((plan, last, pool.submit(chunk_bytes, plan, start, count, seed)))
            return True

        while len(pending) < 2 * threads and submit_next():
            pass
        while pending:
            plan, last, future = pending.popleft()
            data = future.result()
            fout.write(memoryview(data))
            done += data.nbytes
            if last:
                pad = -plan.nbytes % alignment
                if pad:
                    fout.write(bytes(pad))
            submit_next()
            if progress is not None:
                progress(done, total)


# ---------------------------------------------------------------------------------------
# Byte totals


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    kind: str
    dense: int
    experts: int


def layer_bytes(model: str, scale: str = "full", *, dense_types: str = "spec") -> tuple[list[LayerBytes], int]:
    """Per layer of the FULL model (all its layers): dense and routed-expert tensor bytes;
    plus the bytes of the model-level tensors (embedding, head)."""
    g = geometry(model, scale)
    plans = plan_tensors(model, g.n_layers, scale=scale, dense_types=dense_types)
    rows = {}
    other = 0
    for plan in plans:
        if plan.block is None:
            other += plan.nbytes
            continue
        row = rows.setdefault(plan.block, [0, 0])
        row[1 if plan.is_routed_expert else 0] += plan.nbytes
    out = []
    for i in sorted(rows):
        if model == "deepseek-v4-flash":
            kind = {0: "sliding", g.csa_ratio: "csa"}.get(g.compress_ratio(i), "hca")
            kind += "+hash" if i < g.hash_layers else ""
        else:
            kind = ("mla" if g.is_mla(i) else "kda") + ("+dense" if i < g.dense_layers else "")
        out.append(LayerBytes(i, kind, rows[i][0], rows[i][1]))
    return out, other


def totals_report(model: str, scale: str = "full", *, n_layers: int | None = None, dense_types: str = "spec") -> str:
    """A printable table: bytes per layer kind, totals of the full model, and of an
    `n_layers` file."""
    rows, other = layer_bytes(model, scale, dense_types=dense_types)
    types = dense_types if model == "deepseek-v4-flash" else "llama.cpp Q2_K rules"
    lines = [f"{model} ({scale} scale, dense types: {types}): {len(rows)} layers"]
    seen: dict[tuple[str, int, int], list[int]] = {}
    for r in rows:
        seen.setdefault((r.kind, r.dense, r.experts), []).append(r.layer)
    lines.append(f"  {'layers':<24} {'kind':<12} {'dense/layer':>14} {'experts/layer':>15}")
    for (kind, dense, experts), layers in seen.items():
        span = f"{layers[0]}" if len(layers) == 1 else f"{len(layers)} layers from {layers[0]}"
        lines.append(f"  {span:<24} {kind:<12} {dense / 1e6:>11.2f} MB {experts / 1e6:>12.2f} MB")
    dense = sum(r.dense for r in rows) + other
    experts = sum(r.experts for r in rows)
    lines.append(f"  embedding + head + globals: {other / 1e9:.3f} GB")
    lines.append(f"  full model: dense {dense / GB:.3f} GB + routed experts {experts / GB:.3f} GB = "
                 f"{(dense + experts) / GB:.3f} GB of tensor data")
    if n_layers is not None:
        part = rows[:n_layers]
        d = sum(r.dense for r in part) + other
        e = sum(r.experts for r in part)
        lines.append(f"  {n_layers}-layer file: dense {d / GB:.3f} GB + experts {e / GB:.3f} GB = "
                     f"{(d + e) / GB:.3f} GB")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_geometry", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--layers", type=int, help="layers to write (block_count); the first N of the real model")
    p.add_argument("--out", help="the .gguf to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the real one)")
    p.add_argument("--scale", choices=SCALES, default="full", help="small: shrunk dimensions for tests")
    p.add_argument("--dense-types", choices=DENSE_TYPES, default="spec",
                   help="DeepSeek only: the specs' dense types, or llama-quantize MXFP4_MOE's (see the docstring)")
    p.add_argument("--threads", type=int, default=None, help="generator threads (default: all cores)")
    p.add_argument("--totals", action="store_true", help="print the byte totals and exit")
    args = p.parse_args(argv)

    print(totals_report(args.model, args.scale, n_layers=args.layers, dense_types=args.dense_types))
    if args.totals:
        return 0
    if args.layers is None or args.out is None:
        p.error("--layers and --out are needed to write a file (or pass --totals)")
    started = last = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= 2.0 or done == total:
            last = now
            rate = done / max(now - started, 1e-9)
            print(f"  {done / GB:7.2f} / {total / GB:.2f} GB  {rate / GB:.2f} GB/s", flush=True)

    path = write_real_geometry_gguf(args.out, args.model, args.layers, seed=args.seed, scale=args.scale,
                                    vocab=args.vocab, dense_types=args.dense_types, threads=args.threads,
                                    progress=report)
    elapsed = time.perf_counter() - started
    size = path.stat().st_size
    print(f"wrote {path}: {size / GB:.3f} GB in {elapsed:.1f} s ({size / GB / max(elapsed, 1e-9):.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
