"""A tiny random DeepSeek-V4 model (transformers) and its export to a `deepseek4` GGUF.

The GGUF follows llama.cpp's converter (`conversion/deepseek.py`, DeepseekV4Model) and
loader (`src/models/deepseek4.cpp`): the same tensor names, the same metadata keys,
and no tensor is permuted or transposed, because transformers, the original
checkpoint and llama.cpp all keep the original layout:

- 2-D weights are `[out_features, in_features]` (numpy order; GGUF ne reversed);
- `hc_*_fn` is `[(2 + hc) * hc, hc * hidden]`, `*_base` `[(2 + hc) * hc]`, `*_scale`
  `[3]` (the head: `[hc, hc * hidden]`, `[hc]`, `[1]`);
- compressor `ape` is `[ratio, coff * head_dim]` (coff 2 for CSA, 1 for HCA);
- `ffn_gate_tid2eid` is I32 `[vocab, n_expert_used]`;
- routed experts are stacked with experts outermost: gate/up `[E, ffn, hidden]`,
  down `[E, hidden, ffn]` (transformers' `gate_up_proj` is gate rows then up rows).

With quantized tensors the transformers model is given the DEQUANTIZED values back,
so it computes with exactly the weights the GGUF holds.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from engine.models.deepseek4_export import deepseek4_gguf_tensors, write_gguf_tensors

F32 = GGMLQuantizationType.F32
BF16 = GGMLQuantizationType.BF16
Q8_0 = GGMLQuantizationType.Q8_0
I32 = GGMLQuantizationType.I32
MXFP4 = GGMLQuantizationType.MXFP4

ARCH = "deepseek4"
CSA_RATIO = 4
HCA_RATIO = 8  # transformers accepts any HCA rate; 8 gives 37 windows in 300 tokens
_RATIO_OF_TYPE = {"sliding_attention": 0, "compressed_sparse_attention": CSA_RATIO,
                  "heavily_compressed_attention": HCA_RATIO}


def tiny_config(**overrides) -> DeepseekV4Config:
    """Six layers: 2 sliding-only, 2 CSA, 2 HCA; the first 3 hash-routed."""
    layer_types = [
        "sliding_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        num_experts_per_tok=3,
        n_routed_experts=8,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        max_position_embeddings=1024,  # = original 64 x factor 16 (keeps YaRN consistent)
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": CSA_RATIO,
                        "heavily_compressed_attention": HCA_RATIO},
        num_hash_layers=3,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=2.0,  # small, so the clamps really cut activations of a tiny model
        sliding_window=16,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=32,  # enough heads that ReLU ties between entries do not happen
        index_head_dim=32,
        index_topk=8,  # far fewer than the ~75 CSA entries of 300 tokens: top-k really selects
        num_nextn_predict_layers=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = DeepseekV4Config(**kwargs)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def tiny_model(seed: int = 0, **config_overrides) -> DeepseekV4ForCausalLM:
    """A random tiny model whose every parameter is away from its trivial default."""
    config = tiny_config(**config_overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)

    def randn(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            param.copy_(randn(param.shape))
        elif name.endswith("norm.weight"):
            param.copy_(randn(param.shape, 0.2, 1.0))  # RMSNorm gains around 1
        elif leaf == "sinks":
            param.copy_(randn(param.shape, 1.0))
        elif leaf in ("base", "hc_base"):
            param.copy_(randn(param.shape, 0.5))
        elif leaf in ("scale", "hc_scale"):
            param.copy_(randn(param.shape, 0.3, 1.0))
        elif leaf == "position_bias":
            param.copy_(randn(param.shape, 0.5))
        elif leaf == "gate_up_proj":
            param.copy_(randn(param.shape, 1.0 / math.sqrt(param.shape[-1])))
        elif leaf == "down_proj" and param.dim() == 3:
            param.copy_(randn(param.shape, 1.0 / math.sqrt(param.shape[-1])))
        elif param.dim() == 2:
            param.copy_(randn(param.shape, 1.0 / math.sqrt(param.shape[-1])))
        else:
            raise AssertionError(f"tiny_model: no initialisation rule for {name}")
    for layer_idx, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            table = torch.stack([
                torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                for _ in range(config.vocab_size)
            ])
            gate.tid2eid.copy_(table)
        else:
            gate.e_score_correction_bias.copy_(randn(gate.e_score_correction_bias.shape, 0.3))
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _quantize(values: np.ndarray, ggml_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to store, the float32 values those bytes decode to)."""
    if ggml_type == F32:
        return values.astype(np.float32), values.astype(np.float32)
    if ggml_type == BF16:
        as_bf16 = torch.from_numpy(values).to(torch.bfloat16)
        return as_bf16.view(torch.uint16).numpy().view(np.uint8).reshape(*values.shape[:-1], -1), \
            as_bf16.to(torch.float32).numpy()
    raw = gguf_quantize(values.astype(np.float32), ggml_type)
    return raw, gguf_dequantize(raw, ggml_type).reshape(values.shape).astype(np.float32)


@torch.no_grad()
def export_deepseek4_gguf(
    model: DeepseekV4ForCausalLM,
    path: str | Path,
    expert_type: GGMLQuantizationType = F32,
    *,
    realistic_dense: bool = False,
) -> Path:
    """Write `model` as a `deepseek4` GGUF at `path`.

    expert_type: F32 or MXFP4 for the routed experts. realistic_dense: store the
    attention/shared-expert/head matrices as Q8_0 and the compressor/indexer
    projections as BF16, like the real DeepSeek-V4-Flash file. Whatever is
    quantized is written back into `model` dequantized, so `model` stays the
    exact reference for the file.
    """
    path = Path(path)
    config = model.config
    n_layers = config.num_hidden_layers
    ratios = [_RATIO_OF_TYPE[t] for t in config.layer_types]
    rope = config.rope_parameters["compress"]
    big_type = Q8_0 if realistic_dense else F32
    side_type = BF16 if realistic_dense else F32

    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = []

    def put(name: str, param: torch.Tensor, ggml_type: GGMLQuantizationType = F32) -> None:
        raw, values = _quantize(_np(param), ggml_type)
        if ggml_type != F32:
            param.copy_(torch.from_numpy(values).reshape(param.shape))
        tensors.append((name, raw, ggml_type))

    for name, param, ggml_type in deepseek4_gguf_tensors(model, big_type=big_type, side_type=side_type,
                                                         expert_type=expert_type, f32=F32, i32=I32):
        if ggml_type == I32:
            tensors.append((name, param.to(torch.int32).numpy(), I32))
        else:
            put(name, param, ggml_type)

    writer = GGUFWriter(path, ARCH)
    k = f"{ARCH}."
    u32 = writer.add_uint32
    f32 = writer.add_float32
    writer.add_string("general.name", "tiny-deepseek4-test")
    writer.add_string("tokenizer.ggml.model", "none")  # logits-only fixture, no tokenizer
    u32(k + "vocab_size", config.vocab_size)
    u32(k + "context_length", config.max_position_embeddings)
    u32(k + "embedding_length", config.hidden_size)
    u32(k + "block_count", n_layers)
    u32(k + "attention.head_count", config.num_attention_heads)
    u32(k + "attention.head_count_kv", 1)
    u32(k + "attention.key_length", config.head_dim)
    u32(k + "attention.value_length", config.head_dim)
    f32(k + "attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    u32(k + "attention.q_lora_rank", config.q_lora_rank)
    u32(k + "attention.sliding_window", config.sliding_window)
    u32(k + "attention.output_group_count", config.o_groups)
    u32(k + "attention.output_lora_rank", config.o_lora_rank)
    # Like the real config: one trailing entry for the (absent) MTP layer.
    writer.add_array(k + "attention.compress_ratios", ratios + [0] * config.num_nextn_predict_layers)
    f32(k + "attention.compress_rope_freq_base", config.compress_rope_theta)
    u32(k + "attention.indexer.head_count", config.index_n_heads)
    u32(k + "attention.indexer.key_length", config.index_head_dim)
    u32(k + "attention.indexer.top_k", config.index_topk)
    u32(k + "rope.dimension_count", config.qk_rope_head_dim)
    f32(k + "rope.freq_base", config.rope_theta)
    writer.add_string(k + "rope.scaling.type", "yarn")
    f32(k + "rope.scaling.factor", rope["factor"])
    u32(k + "rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    f32(k + "rope.scaling.yarn_beta_fast", rope["beta_fast"])
    f32(k + "rope.scaling.yarn_beta_slow", rope["beta_slow"])
    u32(k + "expert_count", config.n_routed_experts)
    u32(k + "expert_used_count", config.num_experts_per_tok)
    u32(k + "expert_feed_forward_length", config.moe_intermediate_size)
    u32(k + "expert_shared_count", config.n_shared_experts)
    f32(k + "expert_weights_scale", config.routed_scaling_factor)
    writer.add_bool(k + "expert_weights_norm", bool(config.norm_topk_prob))
    u32(k + "expert_gating_func", 4)  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
    writer.add_key_value(k + "swiglu_clamp_exp", [float(config.swiglu_limit)] * n_layers,
                         GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    u32(k + "hash_layer_count", config.mlp_layer_types.count("hash_moe"))
    u32(k + "hyper_connection.count", config.hc_mult)
    u32(k + "hyper_connection.sinkhorn_iterations", config.hc_sinkhorn_iters)
    f32(k + "hyper_connection.epsilon", config.hc_eps)
    u32(k + "nextn_predict_layers", config.num_nextn_predict_layers)

    write_gguf_tensors(writer, tensors)
    return path


@torch.no_grad()
def reference_logits(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """transformers' one-shot prefill logits, float32 [T, vocab] (no cache)."""
    out = model(input_ids=token_ids.view(1, -1), use_cache=False)
    return out.logits[0].float()
