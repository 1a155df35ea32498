"""A transformers DeepSeek-V4 model's tensors under their `deepseek4` GGUF names, and the
GGUF write-out.

Used where a GGUF (or the demo's weights file) is made from a transformers
`DeepseekV4ForCausalLM`: `resources/demo/train_demo.py` (the shipped demo weights) and
the test fixture; `engine.demo` writes its GGUF with `write_gguf_tensors`. Nothing here
imports transformers: the model is only walked by attribute.

The names and order follow llama.cpp's converter (`conversion/deepseek.py`) and loader
(`src/models/deepseek4.cpp`); no tensor is permuted or transposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def deepseek4_gguf_tensors(model: Any, *, big_type: Any, side_type: Any, expert_type: Any,
                           f32: Any, i32: Any) -> Iterator[tuple[str, Any, Any]]:
    """(GGUF name, parameter, GGUF type) for every tensor of `model`, in file order.

    big_type: token_embd, output, attention and shared-expert matrices; side_type:
    compressor and indexer projections; expert_type: the routed experts; f32: norms,
    sinks, hyper-connection and compressor `ape` parameters, router weights and bias.
    A hash layer's `ffn_gate_tid2eid` comes as (name, the int table, i32): the caller
    stores it as int32, it is not quantized.
    """
    config = model.config
    m = model.model
    yield "token_embd.weight", m.embed_tokens.weight, big_type
    yield "output_norm.weight", m.norm.weight, f32
    yield "output.weight", model.lm_head.weight, big_type
    yield "output_hc_fn.weight", m.hc_head.hc_fn, f32
    yield "output_hc_base.weight", m.hc_head.hc_base, f32
    yield "output_hc_scale.weight", m.hc_head.hc_scale, f32

    for i, layer in enumerate(m.layers):
        b = f"blk.{i}."
        attn = layer.self_attn
        for kind, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
            yield f"{b}hc_{kind}_fn.weight", hc.fn, f32
            yield f"{b}hc_{kind}_base.weight", hc.base, f32
            yield f"{b}hc_{kind}_scale.weight", hc.scale, f32
        yield f"{b}attn_norm.weight", layer.input_layernorm.weight, f32
        yield f"{b}attn_sinks.weight", attn.sinks, f32
        yield f"{b}attn_q_a.weight", attn.q_a_proj.weight, big_type
        yield f"{b}attn_q_a_norm.weight", attn.q_a_norm.weight, f32
        yield f"{b}attn_q_b.weight", attn.q_b_proj.weight, big_type
        yield f"{b}attn_kv.weight", attn.kv_proj.weight, big_type
        yield f"{b}attn_kv_a_norm.weight", attn.kv_norm.weight, f32
        yield f"{b}attn_output_a.weight", attn.o_a_proj.weight, big_type
        yield f"{b}attn_output_b.weight", attn.o_b_proj.weight, big_type
        comp = attn.compressor
        if comp is not None:
            yield f"{b}attn_compressor_kv.weight", comp.kv_proj.weight, side_type
            yield f"{b}attn_compressor_gate.weight", comp.gate_proj.weight, side_type
            yield f"{b}attn_compressor_ape.weight", comp.position_bias, f32
            yield f"{b}attn_compressor_norm.weight", comp.kv_norm.weight, f32
            indexer = getattr(comp, "indexer", None)
            if indexer is not None:
                yield f"{b}indexer.attn_q_b.weight", indexer.q_b_proj.weight, side_type
                yield f"{b}indexer.proj.weight", indexer.scorer.weights_proj.weight, side_type
                yield f"{b}indexer_compressor_kv.weight", indexer.kv_proj.weight, side_type
                yield f"{b}indexer_compressor_gate.weight", indexer.gate_proj.weight, side_type
                yield f"{b}indexer_compressor_ape.weight", indexer.position_bias, f32
                yield f"{b}indexer_compressor_norm.weight", indexer.kv_norm.weight, f32
        yield f"{b}ffn_norm.weight", layer.post_attention_layernorm.weight, f32
        mlp = layer.mlp
        yield f"{b}ffn_gate_inp.weight", mlp.gate.weight, f32
        if mlp.is_hash:
            yield f"{b}ffn_gate_tid2eid.weight", mlp.gate.tid2eid, i32
        else:
            yield f"{b}exp_probs_b.bias", mlp.gate.e_score_correction_bias, f32
        inter = config.moe_intermediate_size
        gate_up = mlp.experts.gate_up_proj
        for role, param in (("gate", gate_up[:, :inter]), ("up", gate_up[:, inter:]),
                            ("down", mlp.experts.down_proj)):
            yield f"{b}ffn_{role}_exps.weight", param, expert_type
        yield f"{b}ffn_gate_shexp.weight", mlp.shared_experts.gate_proj.weight, big_type
        yield f"{b}ffn_up_shexp.weight", mlp.shared_experts.up_proj.weight, big_type
        yield f"{b}ffn_down_shexp.weight", mlp.shared_experts.down_proj.weight, big_type


def write_gguf_tensors(writer: Any, tensors: Iterable[tuple[str, Any, Any]]) -> None:
    """Add `tensors` (name, stored array, GGUF type) to a `gguf.GGUFWriter` whose metadata
    is set, then write the file and close it.

    F32 and I32 arrays are added as they are; any other type as raw bytes of shape
    [..., bytes per row] (gguf derives the element shape from the type).
    """
    from gguf import GGMLQuantizationType

    for name, raw, ggml_type in tensors:
        ggml_type = GGMLQuantizationType(ggml_type)
        if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.I32):
            writer.add_tensor(name, raw)
        else:
            writer.add_tensor(name, raw, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
