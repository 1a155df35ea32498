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
    for layer in model.model.layers:
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
    clear_topk_for: torch.Tensor | None = None,
) -> Path:
    """Write `model` as a `deepseek4` GGUF at `path`.

    expert_type: F32 or MXFP4 for the routed experts. realistic_dense: store the
    attention/shared-expert/head matrices as Q8_0 and the compressor/indexer
    projections as BF16, like the real DeepSeek-V4-Flash file. Whatever is
    quantized is written back into `model` dequantized, so `model` stays the
    exact reference for the file. clear_topk_for: token ids whose top-k selections
    must have no near-ties; after quantization, `clear_topk_ties` nudges the
    (F32) selection biases for them and asserts the margins, before anything is
    written.
    """
    path = Path(path)
    config = model.config
    n_layers = config.num_hidden_layers
    ratios = [_RATIO_OF_TYPE[t] for t in config.layer_types]
    rope = config.rope_parameters["compress"]
    big_type = Q8_0 if realistic_dense else F32
    side_type = BF16 if realistic_dense else F32

    entries = list(deepseek4_gguf_tensors(model, big_type=big_type, side_type=side_type,
                                          expert_type=expert_type, f32=F32, i32=I32))
    # Quantize first and give the model the dequantized values back (the reference
    # computes with what the file holds); then settle the F32 selection biases on the
    # final weights; only then take the bytes of the F32 and I32 tensors.
    quantized: dict[str, np.ndarray] = {}
    for name, param, ggml_type in entries:
        if ggml_type not in (F32, I32):
            raw, values = _quantize(_np(param), ggml_type)
            param.copy_(torch.from_numpy(values).reshape(param.shape))
            quantized[name] = raw
    if clear_topk_for is not None:
        clear_topk_ties(model, clear_topk_for)

    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = []
    for name, param, ggml_type in entries:
        if ggml_type == I32:
            tensors.append((name, param.to(torch.int32).numpy(), I32))
        elif ggml_type == F32:
            tensors.append((name, _np(param).copy(), F32))
        else:
            tensors.append((name, quantized[name], ggml_type))

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


# -- clear top-k selections ------------------------------------------------------------------
#
# The model selects with top-k in two places: the router of every non-hash MoE layer
# (k = num_experts_per_tok of sqrtsoftplus(scores) + e_score_correction_bias) and the
# lightning indexer of every CSA layer (k = index_topk of the causally valid compressed
# entries). The engine and transformers compute those scores from float32 activations that
# differ by summation order only (a few 1e-7 relative after six layers), so where the k-th
# and (k+1)-th score of a row are that close, which entry wins depends on the CPU's
# kernels, and one flipped pick moves the logits by ~0.1. An exactness test must not rest
# on such a coin toss: the fixture makes every selection of its token sequence clear by
# MIN_TOPK_GAP and asserts it.
#
# MIN_TOPK_GAP is relative to the row's largest |score| (the scores here are O(1)):
# 1e-4 is ~800 float32 ulps, ~100x the engine-vs-transformers score differences measured
# on this model (<= 1.5e-6), so no summation order can flip a pick.

MIN_TOPK_GAP = 1e-4
_TARGET_GAP = 4 * MIN_TOPK_GAP  # what the search aims for when a selection is not clear


def _relative_gaps(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: (k-th - (k+1)-th largest score) / largest |score|; -inf entries are not
    candidates, and a row with at most k candidates has nothing to decide (gap inf)."""
    scores = scores.double()
    n_finite = torch.isfinite(scores).sum(dim=-1)
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:-1], math.inf, dtype=torch.float64)
    top = scores.topk(k + 1, dim=-1).values
    scale = scores.masked_fill(~torch.isfinite(scores), 0.0).abs().amax(dim=-1).clamp_min(1e-30)
    gaps = (top[..., k - 1] - top[..., k]) / scale
    return torch.where(n_finite > k, gaps, torch.full_like(gaps, math.inf))


def _router_scores(gate, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Selection scores of a top-k router: transformers' DeepseekV4TopKRouter.forward."""
    flat = x.reshape(-1, gate.hidden_dim)
    bias = gate.e_score_correction_bias if bias is None else bias
    return gate.score_fn(torch.nn.functional.linear(flat, gate.weight)) + bias


def _indexer_scores(indexer, args: tuple) -> torch.Tensor:
    """Indexer scores [S, entries] of one forward call, -inf where not causally valid
    (transformers' DeepseekV4Indexer.forward masks them the same way)."""
    seen = []
    handle = indexer.scorer.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        indexer(*args)
    finally:
        handle.remove()
    scores = seen[0][0]  # [S, entries], batch 1
    position_ids = args[2].reshape(-1)
    limit = (position_ids + 1) // indexer.compress_rate
    future = torch.arange(scores.shape[-1])[None, :] >= limit[:, None]
    return scores.masked_fill(future, float("-inf"))


def _capture_selection_inputs(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor) -> dict:
    """{("indexer" | "router", layer): the module and its inputs} in one one-shot forward."""
    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        indexer = getattr(comp, "indexer", None) if comp is not None else None
        if indexer is not None:
            handles.append(indexer.register_forward_pre_hook(
                lambda mod, args, i=i: captured.__setitem__(("indexer", i), (mod, tuple(args)))))
        if not layer.mlp.is_hash:
            handles.append(layer.mlp.gate.register_forward_pre_hook(
                lambda mod, args, i=i: captured.__setitem__(("router", i), (mod, args[0]))))
    try:
        reference_logits(model, token_ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _selection_gaps(kind: str, module, inputs) -> torch.Tensor:
    if kind == "router":
        return _relative_gaps(_router_scores(module, inputs), module.top_k)
    return _relative_gaps(_indexer_scores(module, inputs), module.index_topk)


@torch.no_grad()
def topk_margins(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor) -> dict[tuple[str, int], float]:
    """{("router" | "indexer", layer): smallest relative top-k gap over the tokens} of
    transformers' one-shot forward of `token_ids`."""
    captured = _capture_selection_inputs(model, token_ids)
    return {key: float(_selection_gaps(key[0], *captured[key]).min())
            for key in sorted(captured, key=lambda k: (k[1], k[0]))}


def assert_clear_topk(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor,
                      min_gap: float = MIN_TOPK_GAP) -> dict[tuple[str, int], float]:
    margins = topk_margins(model, token_ids)
    assert margins, "the tiny model must have data-dependent top-k selections"
    close = {key: gap for key, gap in margins.items() if not gap >= min_gap}
    assert not close, f"near-tie top-k selections (relative gap < {min_gap:g}): {close}"
    return margins


@torch.no_grad()
def _search(knob: torch.Tensor, min_gap_of, gen: torch.Generator, *, batch_gaps=None) -> float:
    """Random local search on `knob` (in place) for a smallest gap >= _TARGET_GAP.

    min_gap_of(value) -> smallest gap with the knob at value; batch_gaps(values [N, ...])
    -> [N] smallest gaps, when the candidates can be scored at once. Steps start tiny, so
    the knob moves no more than the selections need.
    """
    best, best_gap = knob.clone(), min_gap_of(knob)
    for sigma in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        for _ in range(8):
            if best_gap >= _TARGET_GAP:
                break
            n = 256 if batch_gaps is not None else 16
            cands = best + sigma * torch.randn((n, *knob.shape), generator=gen)
            gaps = batch_gaps(cands) if batch_gaps is not None else torch.tensor([min_gap_of(c) for c in cands])
            i = int(gaps.argmax())
            if gaps[i] > best_gap:
                best, best_gap = cands[i].clone(), float(gaps[i])
    knob.copy_(best)
    return best_gap


@torch.no_grad()
def clear_topk_ties(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor, seed: int = 0) -> dict:
    """Nudge the two selection-only knobs until every top-k of `token_ids` is clear.

    The knobs only move which entries are selected, nothing else: a router's
    e_score_correction_bias (it ranks the experts, it does not weight them) and a CSA
    indexer's compressor position bias (its compressed keys only score entries; the
    attended entries come from the outer compressor). Both are stored as F32, so the
    GGUF holds them exactly. Layers are handled in order (indexer, then router), each
    measured after the earlier ones settled, since a pick changes everything after it.
    Returns topk_margins after asserting them.
    """
    gen = torch.Generator().manual_seed(seed)
    for i in range(len(model.model.layers)):
        for kind in ("indexer", "router"):
            captured = _capture_selection_inputs(model, token_ids)
            if (kind, i) not in captured:
                continue
            module, inputs = captured[(kind, i)]
            if float(_selection_gaps(kind, module, inputs).min()) >= _TARGET_GAP:
                continue
            if kind == "router":
                scores = module.score_fn(torch.nn.functional.linear(
                    inputs.reshape(-1, module.hidden_dim), module.weight)).double()
                k = module.top_k
                _search(module.e_score_correction_bias,
                        lambda b, scores=scores, k=k: float(_relative_gaps(scores + b, k).min()), gen,
                        batch_gaps=lambda bs, scores=scores, k=k: _relative_gaps(
                            scores[None] + bs[:, None].double(), k).amin(dim=-1))
            else:
                knob = module.position_bias

                def min_gap_of(value, module=module, inputs=inputs, knob=knob):
                    saved = knob.clone()
                    knob.copy_(value)
                    try:
                        return float(_relative_gaps(_indexer_scores(module, inputs), module.index_topk).min())
                    finally:
                        knob.copy_(saved)

                _search(knob, min_gap_of, gen)
    return assert_clear_topk(model, token_ids)
