"""Kimi-K3 (GGUF architecture `kimi-k3`), exact, over GGUF weights and an expert provider.

Reads top to bottom like the architecture: configuration (from GGUF metadata, with
the tensor names checked against the layout llama.cpp's converter writes), dense
weights, then the forward pass: embedding, per layer a token mixer and an FFN joined
by block attention residuals, and the final residual mix before the output norm and
the vocabulary projection.

- Token mixers. `attention.head_count_kv` is a per-layer array: 0 marks a KDA layer
  (Kimi Delta Attention, linear attention with a per-channel decay and a fp32
  recurrent state per head), 1 an MLA layer (multi-head latent attention WITHOUT
  rope: the "rope" part of the key is one shared, unrotated slice; the output is
  gated by sigmoid(attn_gate x) before attn_output).
- Block attention residuals (AttnRes). Instead of one running residual, every
  `attn_res.block_size` layers the residual stream is banked and restarted; the
  input of each mixer / FFN / the head is a per-token softmax mix of the banked
  snapshots and the current partial sum, scored by <RMSNorm(v), score vector>.
- FFNs. Layers below `leading_dense_block_count` are dense; the others are latent
  MoE: the router scores the full-width input (sigmoid, top-k on score + bias,
  weights renormalised), the routed experts run on `ffn_routed_down(x)` at the
  latent width, their weighted sum is RMS-normed and projected back up by
  `ffn_routed_up`; shared experts run on x at full width. Every FFN uses SiTU:
  b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2).

The numerics follow llama.cpp's `src/models/kimi-k3.cpp` (with the gated delta rule
of `delta-net-base.cpp` / ggml's `gated_delta_net` and `build_moe_ffn`) operation by
operation; tensor names and layouts are llama.cpp's (`conversion/kimi_k3.py`). No
tensor is transposed at load. One deliberate difference: a prefill chunk runs the KDA
delta rule in its parallel (chunked, WY) form instead of token by token; the two are
the same function (they agree to ~1e-12 in float64), the parallel one is far fewer
kernel launches on a GPU.

Routed experts never live in this file: each MoE layer asks the `ExpertProvider` for
exactly the experts its router chose, once per layer and chunk of tokens.

The model is incremental: `forward(token_ids, state)` appends a chunk of tokens to
`state` (short-conv tails and recurrent states of the KDA layers, the latent KV
cache of the MLA layers), so one-shot prefill, chunked prefill and token-by-token
decode compute the same logits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from engine.experts import ExpertActivation, ExpertProvider, NextLayer, QuantTensor
from engine.graphs import StepGraphs
from engine.kernels.activation import situ
from engine.kernels.attn_res import attn_res_mix
from engine.kernels.decode_attention import decode_attention
from engine.kernels.kda import delta_rule, gated_output, kda_decay, kda_step, l2_normalize, short_conv
from engine.kernels.routing import route

from .common import (
    DenseWeights,
    GrowingRows,
    ModelBase,
    Projections,
    architecture_metadata,
    as_float,
    as_int,
    as_list,
    embedding_rows,
    main_layer_count,
    metadata_vocab_size,
    pieces,
    rms_norm,
    wide_dtype,
)
from .kimi_k3_static import KimiStaticState, StaticKDA, StaticMLA
from .protocol import LayerHook, ModelConfigError

ARCHITECTURE = "kimi-k3"
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# build_moe_ffn clamps the sum of the selected weights to the smallest normal fp16.
WEIGHT_SUM_MIN = 6.103515625e-5

# ---------------------------------------------------------------------------------------
# Configuration


class KimiK3ConfigError(ModelConfigError):
    """The GGUF does not describe a Kimi-K3 model (in a layout) this engine can run."""


@dataclass(frozen=True)
class KimiK3Config:
    """Hyper-parameters, read from `kimi-k3.*` GGUF metadata by `from_metadata`."""

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int  # KDA and MLA layers have the same number of heads
    mla_layers: tuple[bool, ...]  # per layer: True = MLA (head_count_kv 1), False = KDA (0)
    # KDA
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # None: kimi-linear's softplus decay instead of the sigmoid one
    # MLA (NoPE)
    q_lora_rank: int  # 0: a plain attn_q projection
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int  # the shared, unrotated key slice
    v_head_dim: int
    # FFN
    n_dense_layers: int
    dense_ffn: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    n_shared_experts: int
    latent_size: int  # 0: the experts run at the full width (no routed_down / routed_up)
    routed_scaling: float  # applied unless 0 or 1, like llama.cpp
    norm_topk: bool
    situ_beta: float
    situ_linear_beta: float  # <= 0: the up branch is not squashed
    attn_res_block_size: int  # 0: plain residual stream
    rms_eps: float

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Sequence[str] | None = None
    ) -> KimiK3Config:
        """Read the config from GGUF metadata (a mapping key -> Python value).

        `tensor_names`, when given, are checked against the layout llama.cpp's
        converter writes: a tensor from another converter (unfused attention-residual
        norm/projection, `ffn_latent_*`, ...) or of unknown purpose is refused with
        its name. Raises KimiK3ConfigError naming every missing key at once.
        """
        p = f"{ARCHITECTURE}."
        required = [
            "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
            "attention.layer_norm_rms_epsilon", "attention.kv_lora_rank", "attention.key_length_mla",
            "attention.value_length_mla", "rope.dimension_count", "ssm.conv_kernel", "kda.head_dim",
            "expert_count", "expert_used_count", "expert_feed_forward_length", "expert_gating_func",
            "activation.situ_beta", "activation.situ_linear_beta", "attn_res.block_size",
        ]
        get = architecture_metadata(metadata, ARCHITECTURE, required, KimiK3ConfigError,
                                    "Kimi-K3", "the Kimi-K3 converter")

        block_count, n_layers = main_layer_count(get, tensor_names)

        heads = _per_layer_ints(get("attention.head_count"), block_count, p + "attention.head_count")
        if len(set(heads[:n_layers])) != 1:
            raise KimiK3ConfigError(f"{p}attention.head_count varies by layer ({heads}); Kimi-K3 has one head count")
        kv_heads = _per_layer_ints(get("attention.head_count_kv"), block_count, p + "attention.head_count_kv")
        for i, n_kv in enumerate(kv_heads[:n_layers]):
            if n_kv not in (0, 1):
                raise KimiK3ConfigError(
                    f"{p}attention.head_count_kv[{i}] is {n_kv}: Kimi-K3 layers are KDA (0) or MLA served as "
                    "one latent KV head (1)"
                )
        gating = as_int(get("expert_gating_func"))
        if gating != GATING_SIGMOID:
            raise KimiK3ConfigError(
                f"{p}expert_gating_func is {gating}; Kimi-K3 routes with a sigmoid ({GATING_SIGMOID})"
            )
        groups = as_int(get("expert_group_count", 0))
        if groups > 1:
            raise KimiK3ConfigError(
                f"{p}expert_group_count is {groups}: group-limited routing is not part of Kimi-K3 (one group)"
            )
        key_mla = as_int(get("attention.key_length_mla"))
        rope_dim = as_int(get("rope.dimension_count"))
        kv_lora = as_int(get("attention.kv_lora_rank"))
        if not 0 < rope_dim < key_mla:
            raise KimiK3ConfigError(
                f"{p}rope.dimension_count {rope_dim} must be below {p}attention.key_length_mla {key_mla}"
            )
        key_length = get("attention.key_length")
        if key_length is not None and as_int(key_length) != kv_lora + rope_dim:
            raise KimiK3ConfigError(
                f"{p}attention.key_length is {key_length}, but MLA served as MQA caches kv_lora_rank + "
                f"rope dims = {kv_lora + rope_dim}"
            )
        expert_ffn = _per_layer_ints(get("expert_feed_forward_length"), block_count, p + "expert_feed_forward_length")
        n_dense = as_int(get("leading_dense_block_count", 0))
        moe_ffn = set(expert_ffn[n_dense:n_layers])
        if len(moe_ffn) > 1:
            raise KimiK3ConfigError(f"{p}expert_feed_forward_length varies by layer ({expert_ffn})")
        dense_ffn = 0
        if n_dense > 0:
            if p + "feed_forward_length" not in metadata:
                raise KimiK3ConfigError(f"{p}feed_forward_length is missing but the model has {n_dense} dense layers")
            dense_ffn = _per_layer_ints(get("feed_forward_length"), block_count, p + "feed_forward_length")[0]
        lower_bound = get("kda.gate_lower_bound")

        config = cls(
            vocab_size=metadata_vocab_size(metadata, ARCHITECTURE),  # 0: taken from token_embd
            hidden_size=as_int(get("embedding_length")),
            n_layers=n_layers,
            n_heads=heads[0],
            mla_layers=tuple(bool(n) for n in kv_heads[:n_layers]),
            kda_head_dim=as_int(get("kda.head_dim")),
            conv_kernel=as_int(get("ssm.conv_kernel")),
            gate_lower_bound=None if lower_bound is None else as_float(lower_bound),
            q_lora_rank=as_int(get("attention.q_lora_rank", 0)),
            kv_lora_rank=kv_lora,
            qk_nope_dim=key_mla - rope_dim,
            qk_rope_dim=rope_dim,
            v_head_dim=as_int(get("attention.value_length_mla")),
            n_dense_layers=n_dense,
            dense_ffn=dense_ffn,
            n_experts=as_int(get("expert_count")),
            n_experts_used=as_int(get("expert_used_count")),
            expert_ffn=expert_ffn[min(n_dense, block_count - 1)],
            n_shared_experts=as_int(get("expert_shared_count", 0)),
            latent_size=as_int(get("expert_latent_length", 0)),
            routed_scaling=as_float(get("expert_weights_scale", 0.0)),
            norm_topk=bool(get("expert_weights_norm", False)),
            situ_beta=as_float(get("activation.situ_beta")),
            situ_linear_beta=as_float(get("activation.situ_linear_beta")),
            attn_res_block_size=as_int(get("attn_res.block_size")),
            rms_eps=as_float(get("attention.layer_norm_rms_epsilon")),
        )
        if not 0 < config.n_experts_used <= config.n_experts:
            raise KimiK3ConfigError(f"{p}expert_used_count {config.n_experts_used} is not in 1..{config.n_experts}")
        if config.conv_kernel < 1:
            raise KimiK3ConfigError(f"{p}ssm.conv_kernel is {config.conv_kernel}")
        if tensor_names is not None:
            config.check_tensor_names(tensor_names)
        return config

    def layer_kind(self, layer: int) -> str:
        """'mla' or 'kda'."""
        return "mla" if self.mla_layers[layer] else "kda"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def check_tensor_names(self, names: Sequence[str]) -> None:
        """Refuse, naming the tensor, a file whose names are not llama.cpp's Kimi-K3 layout.

        Other converters' variants are recognised and explained; anything else that
        this engine would not read is refused too (llama.cpp refuses unused tensors
        as well), because silently ignoring a weight computes a different model.
        """
        allowed_global = {"token_embd.weight", "output_norm.weight", "output.weight"}
        if self.attn_res_block_size > 0:
            allowed_global.add("output_res_score.weight")
        for name in sorted(names):
            why = _foreign_layout(name)
            if why is not None:
                raise KimiK3ConfigError(f"tensor {name}: {why}")
            match = re.match(r"blk\.(\d+)\.(.+)$", name)
            if match is None:
                if name not in allowed_global:
                    raise KimiK3ConfigError(
                        f"tensor {name} is not part of a Kimi-K3 GGUF as llama.cpp's converter writes it; "
                        "refusing to guess what it does"
                    )
                continue
            block, rest = int(match.group(1)), match.group(2)
            if block >= self.n_layers:
                continue  # MTP layers the model does not run
            if rest not in self._layer_tensor_names(block):
                kind = self.layer_kind(block).upper()
                raise KimiK3ConfigError(
                    f"tensor {name} is not part of a Kimi-K3 {kind} layer as llama.cpp's converter writes it; "
                    "refusing to guess what it does"
                )

    def _layer_tensor_names(self, i: int) -> set[str]:
        names = {"attn_norm.weight", "ffn_norm.weight"}
        if self.attn_res_block_size > 0:
            names |= {"attn_res_score.weight", "ffn_res_score.weight"}
        if self.layer_kind(i) == "kda":
            names |= {f"ssm_conv1d_{x}.weight" for x in "qkv"} | {f"attn_{x}.weight" for x in "qkv"}
            names |= {"ssm_f_a.weight", "ssm_f_b.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias",
                      "ssm_g.weight", "ssm_norm.weight", "attn_output.weight"}
        else:
            names |= {"attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_q.weight",
                      "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight",
                      "attn_kv_b.weight", "attn_gate.weight", "attn_output.weight"}
        if self.is_moe(i):
            names |= {"ffn_gate_inp.weight", "exp_probs_b.bias"}
            names |= {f"ffn_{role}_{kind}.weight" for role in ("gate", "up", "down") for kind in ("exps", "shexp")}
            if self.latent_size > 0:
                names |= {"ffn_routed_down.weight", "ffn_routed_up.weight", "ffn_routed_norm.weight"}
        else:
            names |= {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
        return names


def _foreign_layout(name: str) -> str | None:
    """Why `name` marks a converter other than llama.cpp's, or None."""
    if re.search(r"(^|\.)(attn|ffn|output|self_attention|mlp|output_attn)_res_(proj|norm)(\.|$)", name):
        return ("the attention-residual norm and projection are stored apart (another converter); "
                "llama.cpp's converter fuses them into one *_res_score vector (norm * proj), which is "
                "what ExpertDesk reads. Re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    if ".ffn_latent_" in name:
        return ("latent-MoE projections named ffn_latent_* come from another converter; ExpertDesk reads "
                "llama.cpp's ffn_routed_down / ffn_routed_up / ffn_routed_norm. Re-convert the model with "
                "llama.cpp's convert_hf_to_gguf.py")
    if re.search(r"\.(ssm_a_log|a_log|ssm_a\.weight)$", name, re.IGNORECASE):
        return ("the KDA decay parameter is stored as A_log (or under another name); llama.cpp's converter "
                "writes blk.N.ssm_a = -exp(A_log). Re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    return None


def _per_layer_ints(value: Any, n_layers: int, key: str) -> list[int]:
    """A per-layer integer array, or one scalar for every layer (llama.cpp's get_key_or_arr)."""
    values = [as_int(v) for v in as_list(value)]
    if len(values) == 1:
        return values * n_layers
    if len(values) < n_layers:
        raise KimiK3ConfigError(f"{key} has {len(values)} entries for {n_layers} layers")
    return values


# ---------------------------------------------------------------------------------------
# Incremental state


@dataclass
class KDAState:
    """A KDA layer's memory: the last conv_kernel - 1 projected q/k/v rows (pre-conv) and
    the fp32 recurrent state S [heads, key dim, value dim]."""

    conv: list[torch.Tensor]  # q, k, v: [conv_kernel - 1, heads * head_dim] each
    recurrent: torch.Tensor


@dataclass
class MLAState:
    """An MLA layer's memory: per position the normed latent c (kv_lora_rank) followed by
    the shared key slice k_pe (rope dims), i.e. llama.cpp's MQA cache row."""

    cache: GrowingRows


@dataclass
class KimiK3State:
    """Everything the model remembers about the tokens processed so far."""

    position: int  # number of tokens already processed = position of the next token
    layers: list[KDAState | MLAState]
    # True while the model's KimiStaticState holds this state (decode on a GPU): the
    # tensors of `layers` are stale until the model stores them back.
    in_static: bool = False


@dataclass
class MLAStep:
    """An MLA layer's fixed-shape cache in a decode step: the token at `pos` (a device
    tensor [1]) is written to its row, and attention reads the first `rows` rows."""

    cache: torch.Tensor
    pos: torch.Tensor
    rows: int


# ---------------------------------------------------------------------------------------
# Per-layer weights


@dataclass
class KDAWeights:
    conv: list[torch.Tensor]  # q, k, v depthwise kernels [heads * head_dim, conv_kernel], oldest tap first
    f_b: QuantTensor  # [heads * head_dim, head_dim]
    dt_bias: torch.Tensor  # [heads * head_dim]
    a: torch.Tensor  # [heads] = -exp(A_log)
    o_norm: torch.Tensor  # [head_dim]
    o: QuantTensor  # [hidden, heads * head_dim]
    # Everything that reads the layer's input: q, k, v [heads * head_dim, hidden], f_a
    # [head_dim, hidden], beta [heads, hidden], g [heads * head_dim, hidden] (output gate).
    proj: Projections


@dataclass
class MLAWeights:
    q_a_norm: torch.Tensor | None  # with q LoRA (q_a in proj)
    q_b: QuantTensor | None  # [heads * (nope + rope), q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    k_b: QuantTensor | None  # [heads, kv_lora_rank, nope]  (split form, llama.cpp's converter)
    v_b: QuantTensor | None  # [heads, v_head_dim, kv_lora_rank]
    kv_b: QuantTensor | None  # [heads * (nope + v_head_dim), kv_lora_rank] (fused form)
    gate: QuantTensor | None  # [heads * v_head_dim, hidden] (in proj too; None: no output gate)
    o: QuantTensor  # [hidden, heads * v_head_dim]
    # Everything that reads the layer's input: q [heads * (nope + rope), hidden] without q
    # LoRA, else q_a [q_lora_rank, hidden]; kv_a [kv_lora_rank + rope, hidden]; the gate.
    proj: Projections


@dataclass
class MoEWeights:
    router: QuantTensor  # [n_experts, hidden]
    router_bias: torch.Tensor  # [n_experts], selection only
    routed_down: QuantTensor | None  # [latent, hidden] (in proj too)
    routed_up: QuantTensor | None  # [hidden, latent]
    routed_norm: torch.Tensor | None  # [latent]
    shared_down: QuantTensor | None  # the shared experts' down projection (gate, up in proj)
    proj: Projections  # routed_down, shared gate and up (those there are): what reads x


@dataclass
class LayerWeights:
    index: int
    kind: str  # 'kda' or 'mla'
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn_res_score: torch.Tensor | None
    ffn_res_score: torch.Tensor | None
    kda: KDAWeights | None
    mla: MLAWeights | None
    dense_down: QuantTensor | None  # a leading dense layer's FFN: down here, gate and up in dense_proj
    dense_proj: Projections | None
    moe: MoEWeights | None


# ---------------------------------------------------------------------------------------
# The model


class KimiK3Model(ModelBase):
    """Kimi-K3 forward pass over dense GGUF weights plus an expert provider."""

    # MLA attention runs in blocks of at most this many queries, fewer when the
    # [heads, queries, cached positions] score tensor would exceed attention_budget values.
    query_block = 256
    attention_budget = 1 << 26
    # KDA prefill runs the delta rule in chunks of this many tokens (the parallel form,
    # equal to the token-by-token recurrence up to rounding); 0: always token by token.
    # Memory O(heads * chunk^2 * head_dim) per layer.
    kda_chunk = 32

    def __init__(
        self,
        config: KimiK3Config,
        weights: DenseWeights,
        experts: ExpertProvider | None,
        dtype: torch.dtype = torch.float32,
        decode_dtype: torch.dtype | None = None,
    ) -> None:
        self._bind(config, weights, experts, dtype, decode_dtype)
        self._check_tensors()

        config = self.config
        self.output = weights.matrix("output.weight")
        self.output_norm = weights.small("output_norm.weight")
        self.output_res_score = weights.small("output_res_score.weight") if config.attn_res_block_size > 0 else None
        self.layers = [self._layer_weights(i) for i in range(config.n_layers)]
        # The routed experts' SiTU (the provider runs it between their matmuls).
        self.activation = ExpertActivation("situ", beta=config.situ_beta, linear_beta=config.situ_linear_beta)
        self._mla_up_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs = StepGraphs()
        self._static: KimiStaticState | None = None  # the fixed-shape decode state (kimi_k3_static)
        self.static_decode: bool | None = None  # None: on a GPU with CUDA graphs (_static_applies)

    # -- construction ---------------------------------------------------------------------

    def _check_tensors(self) -> None:
        """Fail early, naming the tensor, if a tensor is missing or its shape (or the
        sign of ssm_a) is not what llama.cpp's converter writes for this metadata."""
        c, w = self.config, self.weights
        H, heads = c.hidden_size, c.n_heads  # H: hidden width
        d_inner = heads * c.kda_head_dim
        k_mla = c.qk_nope_dim + c.qk_rope_dim
        expected: dict[str, tuple[int, ...] | None] = {
            "token_embd.weight": (c.vocab_size, H),
            "output.weight": (c.vocab_size, H),
            "output_norm.weight": (H,),
        }
        if c.attn_res_block_size > 0:
            expected["output_res_score.weight"] = (H,)
        for i in range(c.n_layers):
            b = f"blk.{i}."
            expected[b + "attn_norm.weight"] = (H,)
            expected[b + "ffn_norm.weight"] = (H,)
            if c.attn_res_block_size > 0:
                expected[b + "attn_res_score.weight"] = (H,)
                expected[b + "ffn_res_score.weight"] = (H,)
            if c.layer_kind(i) == "kda":
                for x in "qkv":
                    expected[f"{b}attn_{x}.weight"] = (d_inner, H)
                    expected[f"{b}ssm_conv1d_{x}.weight"] = None  # 3-D or 4-D: checked in _conv_kernel
                expected[b + "ssm_f_a.weight"] = (c.kda_head_dim, H)
                expected[b + "ssm_f_b.weight"] = (d_inner, c.kda_head_dim)
                expected[b + "ssm_beta.weight"] = (heads, H)
                expected[b + "ssm_a"] = None  # checked in _decay_scale
                expected[b + "ssm_dt.bias"] = (d_inner,)
                expected[b + "ssm_g.weight"] = (d_inner, H)
                expected[b + "ssm_norm.weight"] = (c.kda_head_dim,)
                expected[b + "attn_output.weight"] = (H, d_inner)
            else:
                for one, other in (("attn_kv_b", "attn_k_b"), ("attn_kv_b", "attn_v_b"), ("attn_q", "attn_q_a")):
                    if f"{b}{one}.weight" in w and f"{b}{other}.weight" in w:
                        raise KimiK3ConfigError(
                            f"tensors {b}{one}.weight and {b}{other}.weight are both present: the file holds two "
                            "versions of one MLA projection; refusing to guess which one is meant"
                        )
                if b + "attn_q_a_norm.weight" in w:
                    expected[b + "attn_q_a_norm.weight"] = (c.q_lora_rank,)
                    expected[b + "attn_q_a.weight"] = (c.q_lora_rank, H)
                    expected[b + "attn_q_b.weight"] = (heads * k_mla, c.q_lora_rank)
                else:
                    expected[b + "attn_q.weight"] = (heads * k_mla, H)
                expected[b + "attn_kv_a_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_dim, H)
                expected[b + "attn_kv_a_norm.weight"] = (c.kv_lora_rank,)
                if b + "attn_kv_b.weight" in w:
                    expected[b + "attn_kv_b.weight"] = (heads * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank)
                else:
                    expected[b + "attn_k_b.weight"] = (heads, c.kv_lora_rank, c.qk_nope_dim)
                    expected[b + "attn_v_b.weight"] = (heads, c.v_head_dim, c.kv_lora_rank)
                if b + "attn_gate.weight" in w:
                    expected[b + "attn_gate.weight"] = (heads * c.v_head_dim, H)
                expected[b + "attn_output.weight"] = (H, heads * c.v_head_dim)
            if c.is_moe(i):
                expected[b + "ffn_gate_inp.weight"] = (c.n_experts, H)
                expected[b + "exp_probs_b.bias"] = (c.n_experts,)
                if c.latent_size > 0:
                    expected[b + "ffn_routed_down.weight"] = (c.latent_size, H)
                    expected[b + "ffn_routed_up.weight"] = (H, c.latent_size)
                    if b + "ffn_routed_norm.weight" in w:
                        expected[b + "ffn_routed_norm.weight"] = (c.latent_size,)
                shared = [f"{b}ffn_{r}_shexp.weight" for r in ("gate", "up", "down")]
                if any(name in w for name in shared):
                    width = c.expert_ffn * max(1, c.n_shared_experts)
                    expected[shared[0]] = (width, H)
                    expected[shared[1]] = (width, H)
                    expected[shared[2]] = (H, width)
            else:
                expected[b + "ffn_gate.weight"] = (c.dense_ffn, H)
                expected[b + "ffn_up.weight"] = (c.dense_ffn, H)
                expected[b + "ffn_down.weight"] = (H, c.dense_ffn)
        missing = [name for name in expected if name not in w]
        if missing:
            raise KimiK3ConfigError(
                f"the model file lacks tensors {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}: "
                "it is incomplete or not a Kimi-K3 file as llama.cpp's converter writes it"
            )
        for name, shape in expected.items():
            if shape is not None and tuple(w.quant(name).shape) != shape:
                raise KimiK3ConfigError(
                    f"tensor {name} has shape {tuple(w.quant(name).shape)}, the metadata implies {shape}"
                )

    def _conv_kernel(self, name: str) -> torch.Tensor:
        """A KDA short-conv kernel as [channels, conv_kernel] (tap 0 = the oldest position).

        llama.cpp stores it with ne [d_conv, 1, d_inner, 1] (numpy (1, d_inner, 1, d_conv)),
        or 3-D ne [d_conv, 1, d_inner] when quantization dropped the trailing 1.
        """
        c = self.config
        d_inner = c.n_heads * c.kda_head_dim
        shape = tuple(self.weights.quant(name).shape)
        if shape not in ((1, d_inner, 1, c.conv_kernel), (d_inner, 1, c.conv_kernel)):
            raise KimiK3ConfigError(
                f"tensor {name} has shape {shape}; llama.cpp's converter writes {(1, d_inner, 1, c.conv_kernel)} "
                f"(or {(d_inner, 1, c.conv_kernel)}) for {d_inner} channels and ssm.conv_kernel {c.conv_kernel}"
            )
        return self.weights.small(name).reshape(d_inner, c.conv_kernel)

    def _decay_scale(self, name: str) -> torch.Tensor:
        """ssm_a as [heads]: llama.cpp's converter folds A_log into -exp(A_log), one per head."""
        c = self.config
        shape = tuple(self.weights.quant(name).shape)
        if shape != (c.n_heads,):
            hint = " (one per channel of a head: another converter's layout)" if shape == (c.kda_head_dim,) else ""
            raise KimiK3ConfigError(
                f"tensor {name} has shape {shape}{hint}; Kimi-K3's ssm_a holds -exp(A_log) as a plain "
                f"[{c.n_heads}] vector (one per KDA head)"
            )
        a = self.weights.small(name)
        if not bool(torch.isfinite(a).all()) or not bool((a < 0).all()):
            sign = "positive (+exp(A_log) or raw A_log?)" if bool((a >= 0).all()) else "not all negative"
            raise KimiK3ConfigError(
                f"tensor {name} is {sign}; llama.cpp's converter stores -exp(A_log) < 0. The file comes from "
                "another converter: re-convert the model with llama.cpp's convert_hf_to_gguf.py"
            )
        return a

    def _layer_weights(self, i: int) -> LayerWeights:
        c, w, b = self.config, self.weights, f"blk.{i}."

        def opt_quant(name: str) -> QuantTensor | None:
            return w.matrix(name) if name in w else None

        def opt_raw(name: str) -> QuantTensor | None:  # dequantized whole (_mla_up), not a matrix
            return w.matrix(name) if name in w else None

        def opt_small(name: str) -> torch.Tensor | None:
            return w.small(name) if name in w else None

        kda = mla = dense_down = moe = dense_proj = None
        if c.layer_kind(i) == "kda":
            # Taken before the matrices, which then become views of the stacked one.
            proj = w.projections({role: f"{b}{name}.weight" for role, name in (
                ("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("f_a", "ssm_f_a"), ("beta", "ssm_beta"),
                ("g", "ssm_g"))})
            kda = KDAWeights(
                conv=[self._conv_kernel(f"{b}ssm_conv1d_{x}.weight") for x in "qkv"],
                f_b=w.matrix(b + "ssm_f_b.weight"),
                dt_bias=w.small(b + "ssm_dt.bias"),
                a=self._decay_scale(b + "ssm_a"),
                o_norm=w.small(b + "ssm_norm.weight"),
                o=w.matrix(b + "attn_output.weight"),
                proj=proj,
            )
        else:
            has_lora = b + "attn_q_a_norm.weight" in w
            proj = w.projections({"q": None if has_lora else b + "attn_q.weight",
                                  "q_a": b + "attn_q_a.weight" if has_lora else None,
                                  "kv_a": b + "attn_kv_a_mqa.weight", "gate": b + "attn_gate.weight"})
            mla = MLAWeights(
                q_a_norm=w.small(b + "attn_q_a_norm.weight") if has_lora else None,
                q_b=w.matrix(b + "attn_q_b.weight") if has_lora else None,
                kv_a_norm=w.small(b + "attn_kv_a_norm.weight"),
                k_b=opt_raw(b + "attn_k_b.weight") if b + "attn_kv_b.weight" not in w else None,
                v_b=opt_raw(b + "attn_v_b.weight") if b + "attn_kv_b.weight" not in w else None,
                kv_b=opt_raw(b + "attn_kv_b.weight"),
                gate=opt_quant(b + "attn_gate.weight"),
                o=w.matrix(b + "attn_output.weight"),
                proj=proj,
            )
        if c.is_moe(i):
            proj = w.projections({"routed_down": b + "ffn_routed_down.weight", "gate": b + "ffn_gate_shexp.weight",
                                  "up": b + "ffn_up_shexp.weight"})
            moe = MoEWeights(
                router=w.matrix(b + "ffn_gate_inp.weight", wide_dtype(self.dtype)),
                router_bias=w.small(b + "exp_probs_b.bias"),
                routed_down=opt_quant(b + "ffn_routed_down.weight"),
                routed_up=opt_quant(b + "ffn_routed_up.weight"),
                routed_norm=opt_small(b + "ffn_routed_norm.weight"),
                shared_down=opt_quant(b + "ffn_down_shexp.weight"),
                proj=proj,
            )
        else:
            dense_proj = w.projections({r: f"{b}ffn_{r}.weight" for r in ("gate", "up")})
            dense_down = w.matrix(b + "ffn_down.weight")
        res = c.attn_res_block_size > 0
        return LayerWeights(
            index=i,
            kind=c.layer_kind(i),
            attn_norm=w.small(b + "attn_norm.weight"),
            ffn_norm=w.small(b + "ffn_norm.weight"),
            attn_res_score=w.small(b + "attn_res_score.weight") if res else None,
            ffn_res_score=w.small(b + "ffn_res_score.weight") if res else None,
            kda=kda,
            mla=mla,
            dense_down=dense_down,
            dense_proj=dense_proj,
            moe=moe,
        )

    # -- state ----------------------------------------------------------------------------

    def new_state(self) -> KimiK3State:
        """An empty state: no tokens seen (kept in the decode dtype)."""
        c, dev, dt = self.config, self.device, self.decode_dtype
        d_inner = c.n_heads * c.kda_head_dim
        layers: list[KDAState | MLAState] = []
        for layer in self.layers:
            if layer.kind == "kda":
                layers.append(KDAState(
                    conv=[torch.zeros((c.conv_kernel - 1, d_inner), dtype=dt, device=dev) for _ in range(3)],
                    recurrent=torch.zeros((c.n_heads, c.kda_head_dim, c.kda_head_dim), dtype=wide_dtype(dt),
                                          device=dev),
                ))
            else:
                layers.append(MLAState(GrowingRows(c.kv_lora_rank + c.qk_rope_dim, dt, dev)))
        return KimiK3State(position=0, layers=layers)

    # -- forward --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, state: KimiK3State, *, only_last: bool = False,
                on_layer: LayerHook | None = None) -> torch.Tensor:
        """Process the chunk `token_ids` [T] after the tokens in `state` (updated in place).

        Returns float32 logits [T, vocab] for every position of the chunk (float64 when
        the model runs in float64); with `only_last`, [1, vocab] for the last one.
        `on_layer`: see `protocol.Model.forward`.
        """
        c = self.config
        token_ids = self._chunk_token_ids(token_ids)
        n = token_ids.numel()
        if n == 0:
            return torch.empty((0, c.vocab_size), dtype=torch.float32, device=self.device)
        self._begin(n)
        if n == 1 and self._static_applies(token_ids):
            return self._decode_static(token_ids, state)
        if state.in_static:  # a chunk after decode steps: the rows back into the eager state
            assert self._static is not None  # it holds the state
            self._static.give_back(state)
        return self._run(token_ids, state.layers, state, n, only_last, on_layer)

    def _run(self, token_ids: torch.Tensor, layer_states: list, state: KimiK3State | None, n: int,
             only_last: bool = False, on_layer: LayerHook | None = None) -> torch.Tensor:
        """The layers over the chunk with these per-layer states; logits [n, vocab] (the
        last position's alone, [1, vocab], with `only_last`)."""
        # The residual stream (and the AttnRes bank) stays in float32 (wide_dtype) whatever
        # the compute dtype, so bf16 rounding does not pile up over the layers.
        x = embedding_rows(self.token_embd, token_ids, wide_dtype(self.compute))
        bank: list[torch.Tensor] = []  # AttnRes snapshots of this chunk's tokens (per token: no state)
        for layer, layer_state in zip(self.layers, layer_states):
            x = self._block(layer, x, bank, layer_state)
            if on_layer is not None:
                on_layer(layer.index + 1, len(self.layers))
        if state is not None:
            state.position += n
        if only_last:
            x, bank = x[-1:], [b[-1:] for b in bank]
        return self._logits(x, bank)

    __call__ = forward

    # -- decode with fixed-shape state (kimi_k3_static) -----------------------------------

    def _static_applies(self, token_ids: torch.Tensor) -> bool:
        """Whether a one-token step runs on the fixed-shape buffers (kimi_k3_static): on a GPU
        with graphs on (or `static_decode` True, for tests). With a graph-safe expert
        provider the step is one CUDA graph, else one graph per stretch between routing
        points (`_step_pieces`)."""
        return self.static_decode if self.static_decode is not None else (
            self.device.type == "cuda" and self._graphs.enabled)

    def _decode_static(self, token_ids: torch.Tensor, state: KimiK3State) -> torch.Tensor:
        static = self._static
        if static is None:
            bank = torch.zeros((max(1, self._n_banked(len(self.layers))), self.config.hidden_size),
                               dtype=wide_dtype(self.decode_dtype), device=self.device)
            static = self._static = KimiStaticState.like(self.new_state(), bank)
        position = state.position
        static.prepare(state, self._graphs)
        # the step's token and position, read in place by each of its graphs
        token_ids, pos = self._graphs.staged(self.device, token_ids, torch.full((1,), position, dtype=torch.long))
        rows = static.rows(position)
        assert self.experts is not None  # forward() checked it
        if self.experts.graph_safe(token_ids.view(1, 1), self.config.n_experts_used):
            logits = self._graphs.run(("step", rows), partial(self._step_static, rows), token_ids, pos,
                                      mutates=static.tensors())
        else:
            logits = self._step_pieces(rows, token_ids, pos)
        state.position += 1
        return logits.clone()  # a graph's output buffer is overwritten by the next step

    def _step_static(self, rows: int, token_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._run(token_ids, self._step_states(rows, pos), None, 1)

    def _step_states(self, rows: int, pos: torch.Tensor) -> list:
        """Each layer's state in a fixed-shape step at `pos` (a device tensor [1])."""
        assert self._static is not None  # _decode_static made it
        return [MLAStep(sl.cache, pos, rows) if isinstance(sl, StaticMLA) else sl for sl in self._static.layers]

    def _n_banked(self, layers: int) -> int:
        """How many of the first `layers` layers bank their input (index % block size == 0)."""
        size = self.config.attn_res_block_size
        return 0 if size <= 0 else -(-layers // size)

    def _step_pieces(self, rows: int, token_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """A step whose routed experts a provider serves eagerly (a pack): one CUDA graph per
        stretch between routing points, on the fixed-shape buffers; the bank of AttnRes
        snapshots lives in the static state's `bank` rows, so no graph copies it in.
        Stretches: from a MoE layer's experts (or the embedding) through the next MoE
        layer's router; then the last layer's experts into the logits."""
        static = self._static
        assert static is not None and self.experts is not None  # _decode_static made it; forward() checked
        moe = [layer.index for layer in self.layers if layer.moe is not None]
        routed: torch.Tensor | None = None
        carried: tuple[torch.Tensor, ...] = ()
        start = 0
        for stop in [*moe, len(self.layers)]:
            tensors = (token_ids, pos) if routed is None else (routed, pos, *carried)
            out = self._graphs.run(("stretch", start, stop, rows), partial(self._stretch, start, stop, rows),
                                   *tensors, mutates=static.tensors(start, stop))
            if stop == len(self.layers):
                return out
            prefix, h, guess_scores, latent, chosen, weights, *carried_list = out
            layer = self.layers[stop]
            routed = self.experts.routed(stop, latent, chosen, weights, self.activation,
                                         next_layer=self._next_layer(layer, h, guess_scores))
            carried = (prefix, *carried_list)
            start = stop
        raise AssertionError("unreachable: the last stretch returns the logits")

    def _stretch(self, start: int, stop: int, rows: int, first: torch.Tensor, pos: torch.Tensor,
                 *carried: torch.Tensor):
        """Layers start .. stop - 1 whole (with `start`'s routed experts' output `first` and
        the tensors its router stretch `carried`), then layer `stop` up to its routed
        experts; or, at start 0, from the token ids `first`. Returns (prefix, h, the next
        MoE layer's router scores on h for the provider's guess or None, latent, chosen,
        weights, shared gate and up ...) at a MoE layer, the logits at the end."""
        assert self._static is not None  # _decode_static made it
        bank_rows = self._static.bank
        states = self._step_states(rows, pos)
        # The snapshots banked before this stretch (layers 0 .. start, or none at the embedding).
        bank = [bank_rows[j:j + 1] for j in range(self._n_banked(start + 1 if carried else 0))]
        if start == 0 and not carried:
            x = embedding_rows(self.token_embd, first, wide_dtype(self.compute))
            i = 0
        else:
            prefix, *shared = carried
            x = prefix + self._moe_out(self.layers[start], first, *shared)
            i = start + 1
        for layer in self.layers[i:stop]:
            x = self._block(layer, x, bank, states[layer.index])
            self._keep_banked(bank, bank_rows)
        if stop == len(self.layers):
            return self._logits(x, bank)
        layer = self.layers[stop]
        prefix, h = self._block_in(layer, x, bank, states[stop])
        self._keep_banked(bank, bank_rows)
        guess = self._next_layer(layer, h)  # the provider's guess's scores, in the graph
        return (prefix, h, None if guess is None else guess.scores(), *self._moe_in(layer, h))

    @staticmethod
    def _keep_banked(bank: list[torch.Tensor], rows: torch.Tensor) -> None:
        """A snapshot a layer just banked goes into its row of the static bank (read there
        by the later stretches)."""
        j = len(bank) - 1
        if j >= 0 and bank[j].data_ptr() != rows[j:j + 1].data_ptr():
            rows[j:j + 1].copy_(bank[j])
            bank[j] = rows[j:j + 1]

    def _mixer(self, layer: LayerWeights, h: torch.Tensor, st: Any) -> torch.Tensor:
        """The layer's KDA or MLA on its eager state or its fixed-shape buffers."""
        # layer.kind decides which mixer's weights the layer has, and new_state gave it that mixer's
        # state (a StaticKDA's buffers are written in place: one-token steps only).
        return (self._kda(layer.kda, h, st) if layer.kind == "kda"  # type: ignore[arg-type]
                else self._mla(layer.mla, h, st))  # type: ignore[arg-type]

    def _block(self, layer: LayerWeights, x: torch.Tensor, bank: list[torch.Tensor],
               st: Any) -> torch.Tensor:
        """One layer: mixer then FFN, their inputs mixed from the AttnRes bank."""
        if len(pieces(x.shape[0])) > 1:
            return self._block_in_pieces(layer, x, bank, st)
        prefix, h = self._block_in(layer, x, bank, st)
        if layer.dense_down is not None:
            out = self._dense_ffn(layer, h)
        elif self._graph_moe(h, st):
            # The whole MoE (routed experts included) replays from a CUDA graph in eager decode
            # (the fixed-shape step is one graph already).
            out = self._graphs.run(("moe", layer.index), partial(self._moe, layer), h)
        else:
            out = self._moe(layer, h)
        return prefix + out

    def _block_in_pieces(self, layer: LayerWeights, x: torch.Tensor, bank: list[torch.Tensor],
                         st: Any) -> torch.Tensor:
        """A layer over a long prompt chunk: the mixer and the FFN's input piece after piece
        (`common.pieces`; the mixer's state carries from one to the next as between chunks,
        each piece sees its rows of the bank), then the routed experts once over every token
        of the chunk, then each piece's MoE output into its stream. A dense FFN runs per piece."""
        out = torch.empty_like(x)  # the stream after the mixer, then after the FFN
        spans = pieces(x.shape[0])
        hs, moe_ins = [], []  # per piece of a MoE layer: the FFN input, `_moe_in`'s tensors
        for part in spans:
            prefix, h = self._block_in(layer, x[part], [b[part] for b in bank], st)
            if layer.dense_down is not None:
                out[part] = prefix + self._dense_ffn(layer, h)
            else:
                out[part] = prefix
                hs.append(h)
                moe_ins.append(self._moe_in(layer, h))
        if self._banks(layer):
            bank.append(x)  # `_block_in` banked each piece's rows in a copy of the list: the whole chunk's here
        if moe_ins:
            assert self.experts is not None  # forward() checked the provider
            latent, chosen, weights = (torch.cat([m[i] for m in moe_ins]) for i in range(3))
            routed = self.experts.routed(layer.index, latent, chosen, weights, self.activation,
                                         next_layer=self._next_layer(layer, torch.cat(hs)))
            for part, (_, _, _, *shared) in zip(spans, moe_ins):
                out[part] += self._moe_out(layer, routed[part], *shared)
        return out

    def _banks(self, layer: LayerWeights) -> bool:
        """Whether `layer` is an AttnRes checkpoint: it banks its input (index % block_size == 0)."""
        block = self.config.attn_res_block_size
        return block > 0 and layer.index % block == 0

    def _dense_ffn(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        c = self.config
        assert layer.dense_proj is not None and layer.dense_down is not None  # a dense FFN layer
        p = layer.dense_proj(h)
        return layer.dense_down.linear(situ(p["gate"], p["up"], c.situ_beta, c.situ_linear_beta))

    def _graph_moe(self, h: torch.Tensor, st: Any) -> bool:
        assert self.experts is not None  # forward() checked it
        return self.experts.graph_safe(h, self.config.n_experts_used) and not isinstance(st, (StaticKDA, MLAStep))

    def _block_in(self, layer: LayerWeights, x: torch.Tensor, bank: list[torch.Tensor],
                  st: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's mixer, its output into the stream; (prefix, the FFN's normed input h).

        On a checkpoint layer (index % block_size == 0) the raw layer input is banked
        and the partial sum restarts from the mixer's output.
        """
        c = self.config
        eps = c.rms_eps
        prefix = x
        h = attn_res_mix(prefix, bank, layer.attn_res_score, eps) if layer.attn_res_score is not None and bank \
            else prefix
        banked = self._banks(layer)
        if banked:
            bank.append(prefix)
        h = rms_norm(h, layer.attn_norm, eps).to(self.compute)
        mixed = self._mixer(layer, h, st)
        # The mixer's output is in the compute dtype: a restarted partial sum is widened like the stream.
        prefix = mixed.to(x.dtype) if banked else prefix + mixed

        h = attn_res_mix(prefix, bank, layer.ffn_res_score, eps) if layer.ffn_res_score is not None and bank \
            else prefix
        return prefix, rms_norm(h, layer.ffn_norm, eps).to(self.compute)

    def _logits(self, x: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        """The last layer's stream (mixed with the bank) into vocabulary logits, wide dtype."""
        c = self.config
        if self.output_res_score is not None:
            x = attn_res_mix(x, bank, self.output_res_score, c.rms_eps)
        return self.output.linear(rms_norm(x, self.output_norm, c.rms_eps).to(self.compute)).to(
            wide_dtype(self.compute))

    # -- KDA ------------------------------------------------------------------------------

    def _short_conv(self, proj: torch.Tensor, kernel: torch.Tensor, st: KDAState, which: int) -> torch.Tensor:
        """Causal depthwise conv over [conv tail; proj] then SiLU; keeps the new tail."""
        taps = kernel.shape[1]
        kept, window = self.joined(st.conv[which], proj)  # [taps - 1 + n, channels]
        if taps > 1:
            st.conv[which] = self.kept(kept[kept.shape[0] - (taps - 1):])
        return short_conv(window, kernel)

    def _kda(self, w: KDAWeights, x: torch.Tensor, st: KDAState | StaticKDA) -> torch.Tensor:
        """Kimi Delta Attention over the chunk, carrying the conv tails and the state S.

        Per head, with S [key, value] in fp32:
          S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(d)
        A one-token step is `kernels.kda.kda_step` (one launch on CUDA); it writes a StaticKDA's
        buffers in place and gives an eager state new tensors.
        """
        c = self.config
        n = x.shape[0]
        heads, d = c.n_heads, c.kda_head_dim
        eps = c.rms_eps
        wide = wide_dtype(x.dtype)
        p = w.proj(x)
        f = w.f_b.linear(p["f_a"])
        if n == 1:
            in_place = isinstance(st, StaticKDA)
            tails = st.conv if in_place else [torch.empty_like(t) for t in st.conv]
            s = st.recurrent if in_place else torch.empty_like(st.recurrent)
            mixed = kda_step(p["q"], p["k"], p["v"], f, p["beta"], p["g"], w.conv, st.conv, st.recurrent,
                             w.dt_bias, w.a, w.o_norm, eps, c.gate_lower_bound, tails, s)
            st.conv, st.recurrent = tails, s
            return w.o.linear(mixed)
        assert isinstance(st, KDAState)  # fixed-shape buffers serve one-token steps only
        q = l2_normalize(self._short_conv(p["q"], w.conv[0], st, 0).view(n, heads, d), eps)
        k = l2_normalize(self._short_conv(p["k"], w.conv[1], st, 1).view(n, heads, d), eps)
        v = self._short_conv(p["v"], w.conv[2], st, 2).view(n, heads, d).to(wide)
        # Per-channel log decay. The converter stores a = -exp(A_log) per head.
        g = kda_decay(f, w.dt_bias, w.a, c.gate_lower_bound)
        beta = torch.sigmoid(p["beta"].to(wide))  # [n, heads]
        if self.kda_chunk > 0:
            out = self._delta_rule_chunked(q, k, v, g, beta, st)  # [n, heads, d] in the wide dtype
        else:
            out, st.recurrent = delta_rule(q, k, v, g, beta, st.recurrent)
        return w.o.linear(gated_output(out, w.o_norm, p["g"], eps, x.dtype))

    def _delta_rule_chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, st: KDAState) -> torch.Tensor:
        """The same recurrence, `kda_chunk` tokens at a time (WY form, as fla's chunked KDA).

        Within a chunk, with G_t = g_1 + ... + g_t (per key channel, <= 0) and the state
        S0 at its start, the delta-rule updates u_t (S_t = D_t S_{t-1} + k_t u_t^T) solve
            u_t + beta_t sum_{j<t} (k_t . e^{G_t - G_j} k_j) u_j = beta_t (v_t - S0^T (e^{G_t} k_t)),
        a unit lower-triangular system; then
            o_t  = S0^T (e^{G_t} q_t) + sum_{j<=t} (q_t . e^{G_t - G_j} k_j) u_j
            S_C  = e^{G_C} S0 + sum_j (e^{G_C - G_j} k_j) u_j^T.
        Every exponent is <= 0 (decays only shrink), so nothing overflows.
        """
        n, heads, d = q.shape
        scale = d ** -0.5
        s = st.recurrent
        out = torch.empty((n, heads, d), dtype=s.dtype, device=q.device)
        for start in range(0, n, self.kda_chunk):
            stop = min(n, start + self.kda_chunk)
            size = stop - start
            qc, kc, vc = (t[start:stop].transpose(0, 1) for t in (q, k, v))  # [heads, C, d]
            cum = g[start:stop].transpose(0, 1).cumsum(dim=1)  # G [heads, C, d]
            bc = beta[start:stop].transpose(0, 1).unsqueeze(-1)  # [heads, C, 1]
            causal = torch.ones((size, size), dtype=torch.bool, device=q.device).tril()
            gap = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal[None, :, :, None], float("-inf"))
            decay = gap.exp()  # [heads, C(t), C(j), d] = e^{G_t - G_j} for j <= t, else 0
            decayed_k = decay * kc.unsqueeze(1)  # e^{G_t - G_j} k_j
            kk = (decayed_k * kc.unsqueeze(2)).sum(-1)  # [heads, t, j]
            qk = (decayed_k * qc.unsqueeze(2)).sum(-1)
            eye = torch.eye(size, dtype=s.dtype, device=q.device)
            system = eye + (kk * bc).tril(-1)
            rhs = bc * (vc - torch.matmul(kc * cum.exp(), s))
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            o = torch.matmul(qc * cum.exp(), s) + torch.matmul(qk, u)
            out[start:stop] = (o * scale).transpose(0, 1)
            last = cum[:, -1:, :]  # [heads, 1, d]
            s = s * last.transpose(1, 2).exp() + torch.matmul((kc * (last - cum).exp()).transpose(1, 2), u)
        st.recurrent = s
        return out

    # -- MLA ------------------------------------------------------------------------------

    def _mla_up(self, w: MLAWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head latent up-projections: k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora].

        Dequantized once per layer, in the decode dtype (a step's, not per step); a chunk in
        another dtype rounds that copy per chunk (the values `dequantize` gives in its dtype),
        so only one copy per layer is held."""
        key = id(w)
        if key not in self._mla_up_cache:
            c, held = self.config, self.decode_dtype
            if w.kv_b is None:
                assert w.k_b is not None and w.v_b is not None  # the split form
                up = w.k_b.dequantize(held), w.v_b.dequantize(held)
            else:
                kv_b = w.kv_b.dequantize(held).view(c.n_heads, c.qk_nope_dim + c.v_head_dim, c.kv_lora_rank)
                up = kv_b[:, :c.qk_nope_dim].transpose(1, 2), kv_b[:, c.qk_nope_dim:]
            self._mla_up_cache[key] = up
        k_b, v_b = self._mla_up_cache[key]
        return (k_b, v_b) if k_b.dtype == dtype else (k_b.to(dtype), v_b.to(dtype))

    def _mla(self, w: MLAWeights, x: torch.Tensor, st: MLAState | MLAStep) -> torch.Tensor:
        """Multi-head latent attention, no rope, absorbed form (as llama.cpp runs it).

        score(t, s) = (k_b^T q_nope) . c_s + q_pe . k_pe_s, scaled by (nope + rope)^-0.5;
        the output is v_b (sum_s p c_s), gated by sigmoid(attn_gate x), then attn_output.
        """
        c = self.config
        n = x.shape[0]
        heads, nope, rope, lora = c.n_heads, c.qk_nope_dim, c.qk_rope_dim, c.kv_lora_rank
        p = w.proj(x)
        if w.q_b is not None:
            assert w.q_a_norm is not None  # q LoRA: q_a (in proj), its norm and q_b
            q = w.q_b.linear(rms_norm(p["q_a"], w.q_a_norm, c.rms_eps))
        else:
            q = p["q"]  # no q LoRA: one q projection
        q = q.view(n, heads, nope + rope)
        kv = p["kv_a"]
        latent = rms_norm(kv[:, :lora], w.kv_a_norm, c.rms_eps)
        row = torch.cat([latent, kv[:, lora:]], dim=-1)
        k_b, v_b = self._mla_up(w, x.dtype)
        q_abs = torch.einsum("thn,hln->thl", q[..., :nope], k_b)
        query = torch.cat([q_abs, q[..., nope:]], dim=-1)  # [n, heads, lora + rope]
        scale = (nope + rope) ** -0.5
        if n == 1:  # a decode step: one query at `pos` over the cache's rows 0 .. pos
            if isinstance(st, MLAStep):  # the fixed-shape cache: the rows after pos are masked
                st.cache.index_copy_(0, st.pos, row)
                keys, pos = st.cache[: st.rows], st.pos
            else:
                pos = torch.full((1,), st.cache.n, dtype=torch.long, device=x.device)
                st.cache.append(row)
                keys = st.cache.rows.to(row.dtype)
            # Row r holds position r: a window that has not wrapped, no sink, the latent the value.
            mixed = decode_attention(query, keys, pos, True, None, None, 1, None, scale, None, value_dim=lora)
            out = torch.einsum("thl,hvl->thv", mixed, v_b)
        else:
            assert isinstance(st, MLAState)  # fixed-shape steps are one token
            out = self._mla_chunk(query, row, st.cache, v_b, scale)
        out = out.reshape(n, heads * c.v_head_dim)
        if w.gate is not None:
            out = out * torch.sigmoid(p["gate"])
        return w.o.linear(out)

    def _mla_chunk(self, query: torch.Tensor, row: torch.Tensor, cache: GrowingRows, v_b: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """The chunk's queries [n, heads, lora + rope] over the cache after appending its rows
        (causal), in blocks of queries that bound the logits' memory; [n, heads, v]. The
        logits are a bf16 matmul's (float32 ones would leave the tensor cores), where a
        decode step's are float32 (kernels.decode_attention)."""
        n, heads, lora = query.shape[0], query.shape[1], v_b.shape[-1]
        n_cached = cache.n
        cache.append(row)
        keys = cache.rows.to(row.dtype)  # [S, lora + rope]
        q_positions = n_cached + torch.arange(n, device=query.device)
        by_head = query.transpose(0, 1)  # [heads, n, lora + rope]
        out = torch.empty((n, heads, v_b.shape[1]), dtype=query.dtype, device=query.device)
        block = max(1, min(self.query_block, self.attention_budget // (heads * keys.shape[0])))
        for start in range(0, n, block):
            stop = min(n, start + block)
            visible = n_cached + stop  # keys 0 .. visible - 1 can be seen by the block's last query
            logits = torch.matmul(by_head[:, start:stop], keys[:visible].t()).to(wide_dtype(query.dtype)) * scale
            key_pos = torch.arange(visible, device=query.device)
            q_pos = q_positions[start:stop]
            logits = logits.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            probs = torch.softmax(logits, dim=-1).to(query.dtype)
            mixed = torch.matmul(probs, keys[:visible, :lora])  # [heads, block, lora]
            out[start:stop] = torch.einsum("htl,hvl->thv", mixed, v_b)
        return out

    # -- latent mixture of experts ----------------------------------------------------------

    def _moe(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """Sigmoid router on the full-width x (fp32), top-k on score + bias, the routed
        experts at the latent width (the provider's `routed`),
        RMSNorm and routed_up, plus the shared experts on x."""
        assert self.experts is not None  # forward() checked the provider
        latent, chosen, weights, *shared = self._moe_in(layer, x)
        out = self.experts.routed(layer.index, latent, chosen, weights, self.activation,
                                  next_layer=self._next_layer(layer, x))
        return self._moe_out(layer, out, *shared)

    def _moe_in(self, layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Up to the routed experts: (their input latent, chosen, weights, the shared
        experts' gate and up, if any)."""
        c, m = self.config, layer.moe
        assert m is not None  # an MoE layer
        # The bias picks the experts, it does not weigh them (kernels.routing: one launch on CUDA).
        scaling = c.routed_scaling if c.routed_scaling not in (0.0, 1.0) else 1.0
        chosen, weights = route(m.router.linear(x.to(wide_dtype(x.dtype))), m.router_bias, c.n_experts_used,
                                c.norm_topk, scaling, sigmoid=True, sum_min=WEIGHT_SUM_MIN)
        p = m.proj(x)
        latent = p["routed_down"] if m.routed_down is not None else x
        shared = (p["gate"], p["up"]) if m.shared_down is not None else ()
        return (latent, chosen, weights, *shared)

    def _moe_out(self, layer: LayerWeights, out: torch.Tensor, *shared: torch.Tensor) -> torch.Tensor:
        """The routed experts' output `out` through routed_norm and routed_up, plus the
        shared experts (their gate and up from `_moe_in`)."""
        c, m = self.config, layer.moe
        assert m is not None  # an MoE layer
        if m.routed_norm is not None:
            out = rms_norm(out, m.routed_norm, c.rms_eps)
        if m.routed_up is not None:
            out = m.routed_up.linear(out)
        if m.shared_down is not None:
            gate, up = shared
            out = out + m.shared_down.linear(situ(gate, up, c.situ_beta, c.situ_linear_beta))
        return out

    def _next_layer(self, layer: LayerWeights, x: torch.Tensor,
                    scores: torch.Tensor | None = None) -> NextLayer | None:
        """The next MoE layer's sigmoid router (with the selection bias) on this layer's
        MoE input, for the provider's guess. `scores`: those already computed (a decode
        step's graph did)."""
        nxt = layer.index + 1  # self.layers[i].index == i
        m = self.layers[nxt].moe if nxt < len(self.layers) else None
        if m is None:
            return None
        if scores is not None:
            return NextLayer(nxt, self.config.n_experts_used, lambda: scores)
        return NextLayer(nxt, self.config.n_experts_used,
                         lambda: torch.sigmoid(m.router.linear(x.to(wide_dtype(x.dtype)))) + m.router_bias)
