"""DeepSeek-V4 (GGUF architecture `deepseek4`), exact, over GGUF weights and an expert provider.

Reads top to bottom like the architecture: configuration (from GGUF metadata), dense
weights, rotary embeddings, then the forward pass: embedding into `hc` parallel
streams, per layer a hyper-connection (Sinkhorn-mixed) around attention and around
the MoE, and the hyper-connection head before the output norm and the vocabulary
projection.

Attention is one shared K = V head over (a) a sliding window of the latest positions
and (b) compressed entries: CSA layers (ratio 4) pool overlapping windows and let a
lightning indexer pick the top-k entries per query; HCA layers (any other ratio) pool
disjoint windows and attend to all of them. A learned per-head sink joins the softmax
denominator and the output's rope slice is rotated back to the query position.

The numerics follow transformers' `models/deepseek_v4` operation by operation (fp32
norms, hyper-connections, softmaxes; interleaved partial rope on the trailing dims;
YaRN with attention factor 1 on compressed layers). Tensor names and layouts are
llama.cpp's (`src/models/deepseek4.cpp`), which keeps the checkpoint's layout: no
tensor is transposed.

Routed experts never live in this file: each MoE layer asks the `ExpertProvider`
for exactly the experts its router chose, once per layer and chunk of tokens.

The model is incremental: `forward(token_ids, state)` appends a chunk of tokens to
`state` (sliding-window keys, partial compressor windows, compressed entries), so
one-shot prefill, chunked prefill and token-by-token decode compute the same logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from engine.experts import ExpertActivation, ExpertProvider, NextLayer, QuantTensor
from engine.graphs import StepGraphs
from engine.kernels.compressor import compress_step, pool_windows
from engine.kernels.decode_attention import additive_mask, attend, decode_attention
from engine.kernels.hyper_connection import hc_post, hc_pre
from engine.kernels.indexer import index_scores
from engine.kernels.norm_rope import apply_rope, norm_rope
from engine.kernels.routing import route, sqrt_softplus

from .common import (  # noqa: F401  (DenseWeights and friends are re-exported for older imports)
    DenseWeights,
    GrowingRows,
    ModelBase,
    Projections,
    TensorSource,
    architecture_metadata,
    as_float,
    as_int,
    as_list,
    embedding_rows,
    is_routed_expert_tensor,
    main_layer_count,
    metadata_vocab_size,
    pieces,
    rms_norm,
    rms_norm_unweighted,
    wide_dtype,
)
from .deepseek4_static import StaticCompressor, StaticLayer, StaticState
from .protocol import LayerHook, ModelConfigError
from .static_state import MIN_BUCKET

ARCHITECTURE = "deepseek4"
GATING_SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
CSA_RATIO = 4  # llama.cpp: ratio 4 is compressed sparse attention, any other non-zero one is HCA

# ---------------------------------------------------------------------------------------
# Configuration


class DeepSeek4ConfigError(ModelConfigError):
    """The GGUF does not describe a DeepSeek-V4 model this engine can run."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling of the compressed layers (the attention factor is forced to 1)."""

    factor: float
    original_context_length: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class DeepSeek4Config:
    """Hyper-parameters, read from `deepseek4.*` GGUF metadata by `from_metadata`."""

    vocab_size: int
    hidden_size: int
    n_layers: int  # main layers that run (MTP layers, if the file has them, do not)
    n_heads: int
    head_dim: int  # K = V width of the single kv head
    rope_dim: int  # trailing dims of every head that get rope
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per main layer: 0 sliding only, 4 CSA, else HCA
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    n_shared_experts: int
    routed_scaling: float
    norm_topk: bool
    n_hash_layers: int
    swiglu_limit: tuple[float, ...]  # per layer; 0 means no clamp
    swiglu_limit_shared: tuple[float, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_eps: float

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Sequence[str] | None = None
    ) -> DeepSeek4Config:
        """Read the config from GGUF metadata (a mapping key -> Python value).

        `tensor_names`, when given, decides whether trailing `nextn` (MTP) layers are
        present in the file and must be skipped, as llama.cpp does. Raises
        DeepSeek4ConfigError naming every missing key at once.
        """
        p = f"{ARCHITECTURE}."
        required = [
            "embedding_length", "block_count", "attention.head_count", "attention.key_length",
            "attention.layer_norm_rms_epsilon", "attention.q_lora_rank", "attention.sliding_window",
            "attention.output_group_count", "attention.output_lora_rank", "attention.compress_ratios",
            "attention.compress_rope_freq_base", "attention.indexer.head_count",
            "attention.indexer.key_length", "attention.indexer.top_k", "rope.dimension_count",
            "rope.freq_base", "expert_count", "expert_used_count", "expert_feed_forward_length",
            "expert_shared_count", "expert_weights_scale", "expert_gating_func", "hash_layer_count",
            "hyper_connection.count", "hyper_connection.sinkhorn_iterations", "hyper_connection.epsilon",
        ]
        get = architecture_metadata(metadata, ARCHITECTURE, required, DeepSeek4ConfigError,
                                    "DeepSeek-V4", "a DeepSeek-V4 converter")

        block_count, n_layers = main_layer_count(get, tensor_names)

        kv_heads = get("attention.head_count_kv", 1)
        if as_int(kv_heads if not isinstance(kv_heads, list) else kv_heads[0]) != 1:
            raise DeepSeek4ConfigError(f"{p}attention.head_count_kv is {kv_heads}, DeepSeek-V4 has one K = V head")
        head_dim = as_int(get("attention.key_length"))
        value_length = as_int(get("attention.value_length", head_dim))
        if value_length != head_dim:
            raise DeepSeek4ConfigError(f"key_length {head_dim} != value_length {value_length}: DeepSeek-V4 has K = V")
        gating = as_int(get("expert_gating_func"))
        if gating != GATING_SQRT_SOFTPLUS:
            raise DeepSeek4ConfigError(
                f"{p}expert_gating_func is {gating}; DeepSeek-V4 routes with sqrtsoftplus ({GATING_SQRT_SOFTPLUS})"
            )
        ratios = [as_int(r) for r in as_list(get("attention.compress_ratios"))]
        if len(ratios) < n_layers:
            raise DeepSeek4ConfigError(
                f"{p}attention.compress_ratios has {len(ratios)} entries for {n_layers} layers"
            )
        clamp = _per_layer(get("swiglu_clamp_exp", 0.0), block_count, p + "swiglu_clamp_exp")
        clamp_shared = _per_layer(get("swiglu_clamp_shexp"), block_count, p + "swiglu_clamp_shexp") \
            if get("swiglu_clamp_shexp") is not None else clamp

        yarn = None
        scaling_type = get("rope.scaling.type", "none")
        if scaling_type == "yarn":
            for key in ("rope.scaling.factor", "rope.scaling.original_context_length"):
                if p + key not in metadata:
                    raise DeepSeek4ConfigError(f"rope.scaling.type is yarn but {p}{key} is missing")
            yarn = YarnScaling(
                factor=as_float(get("rope.scaling.factor")),
                original_context_length=as_int(get("rope.scaling.original_context_length")),
                beta_fast=as_float(get("rope.scaling.yarn_beta_fast", 32.0)) or 32.0,
                beta_slow=as_float(get("rope.scaling.yarn_beta_slow", 1.0)) or 1.0,
            )
        elif scaling_type not in ("none", None):
            raise DeepSeek4ConfigError(f"{p}rope.scaling.type {scaling_type!r} is not supported (yarn or none)")

        return cls(
            vocab_size=metadata_vocab_size(metadata, ARCHITECTURE),  # 0: taken from token_embd
            hidden_size=as_int(get("embedding_length")),
            n_layers=n_layers,
            n_heads=as_int(get("attention.head_count")),
            head_dim=head_dim,
            rope_dim=as_int(get("rope.dimension_count")),
            q_lora_rank=as_int(get("attention.q_lora_rank")),
            o_groups=as_int(get("attention.output_group_count")),
            o_lora_rank=as_int(get("attention.output_lora_rank")),
            sliding_window=as_int(get("attention.sliding_window")),
            compress_ratios=tuple(ratios[:n_layers]),
            rope_theta=as_float(get("rope.freq_base")),
            compress_rope_theta=as_float(get("attention.compress_rope_freq_base")),
            yarn=yarn,
            index_n_heads=as_int(get("attention.indexer.head_count")),
            index_head_dim=as_int(get("attention.indexer.key_length")),
            index_topk=as_int(get("attention.indexer.top_k")),
            n_experts=as_int(get("expert_count")),
            n_experts_used=as_int(get("expert_used_count")),
            expert_ffn=as_int(get("expert_feed_forward_length")),
            n_shared_experts=as_int(get("expert_shared_count")),
            routed_scaling=as_float(get("expert_weights_scale")),
            norm_topk=bool(get("expert_weights_norm", False)),
            n_hash_layers=min(as_int(get("hash_layer_count")), n_layers),
            swiglu_limit=clamp[:n_layers],
            swiglu_limit_shared=clamp_shared[:n_layers],
            hc_mult=as_int(get("hyper_connection.count")),
            hc_sinkhorn_iters=as_int(get("hyper_connection.sinkhorn_iterations")),
            hc_eps=as_float(get("hyper_connection.epsilon")),
            rms_eps=as_float(get("attention.layer_norm_rms_epsilon")),
        )

    def layer_kind(self, layer: int) -> str:
        """'sliding' (window only), 'csa' (overlapping windows + indexer) or 'hca'."""
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return "sliding"
        return "csa" if ratio == CSA_RATIO else "hca"


def _per_layer(value: Any, n_layers: int, key: str) -> tuple[float, ...]:
    """A per-layer float array, or one scalar for every layer (llama.cpp's get_key_or_arr)."""
    values = [float(v) for v in as_list(value)]
    if len(values) == 1:
        return tuple(values * n_layers)
    if len(values) < n_layers:
        raise DeepSeek4ConfigError(f"{key} has {len(values)} entries for {n_layers} layers")
    return tuple(values)


# ---------------------------------------------------------------------------------------
# Small numeric building blocks (transformers' exact order of operations)


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def yarn_inv_freq(theta: float, dim: int, yarn: YarnScaling) -> torch.Tensor:
    """YaRN-interpolated inverse frequencies (transformers' `_compute_yarn_parameters`, truncate=True)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_context_length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [n, rope_dim / 2] (one angle per interleaved pair)."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)
    return freqs.cos(), freqs.sin()


# ---------------------------------------------------------------------------------------
# Incremental state


@dataclass
class CompressorState:
    """What a compressor carries across chunks.

    pending_*: projections of the tokens of the window still open (< ratio tokens);
    overlap_*: for CSA, the first-half ("Ca") slice of the last closed window, which
    the next window pools together with its own second half; entries: every
    compressed entry emitted so far (normed and rotated), in window order.
    """

    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    overlap_kv: torch.Tensor | None
    overlap_gate: torch.Tensor | None
    entries: GrowingRows


@dataclass
class LayerState:
    window: torch.Tensor  # rotated K = V of the latest sliding_window - 1 positions
    compressor: CompressorState | None
    indexer: CompressorState | None


@dataclass
class DeepSeek4State:
    """Everything the model remembers about the tokens processed so far."""

    position: int  # number of tokens already processed = position of the next token
    layers: list[LayerState]
    # True while the model's StaticState holds this state's rows (decode on a GPU): the
    # eager fields of `layers` are stale until the model stores them back.
    in_static: bool = False


# ---------------------------------------------------------------------------------------
# Per-layer weights


@dataclass
class HyperConnectionWeights:
    fn: torch.Tensor  # [(2 + hc) * hc, hc * hidden]
    base: torch.Tensor  # [(2 + hc) * hc]
    scale: torch.Tensor  # [3]


@dataclass
class CompressorWeights:
    kv: QuantTensor  # [coff * head_dim, hidden]
    gate: QuantTensor
    ape: torch.Tensor  # [ratio, coff * head_dim] absolute position bias of the window slots
    norm: torch.Tensor  # [head_dim]
    ratio: int
    head_dim: int
    overlap: bool  # CSA: entry w pools the second half of window w and the first half of w - 1


@dataclass
class IndexerWeights:
    compressor: CompressorWeights
    q_b: QuantTensor  # [n_heads * head_dim, q_lora_rank]
    proj: QuantTensor  # [n_heads, hidden] per-head weights of the index score
    n_heads: int
    head_dim: int
    top_k: int


@dataclass
class LayerWeights:
    index: int
    kind: str
    attn_hc: HyperConnectionWeights
    ffn_hc: HyperConnectionWeights
    attn_norm: torch.Tensor
    sinks: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: QuantTensor
    kv_norm: torch.Tensor
    o_a: QuantTensor  # [groups * o_lora_rank, heads * head_dim / groups]: row block g serves group g
    o_b: QuantTensor
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None
    ffn_norm: torch.Tensor
    router: QuantTensor  # [n_experts, hidden]
    router_bias: torch.Tensor | None  # selection-only bias (non-hash layers)
    tid2eid: torch.Tensor | None  # [vocab, n_used] expert ids by token (hash layers)
    tid2eid_host: torch.Tensor | None  # the same on the host: the step's hints need no device sync
    shared_down: QuantTensor  # the shared expert's down projection (gate and up: shared_proj)
    activation: ExpertActivation  # the routed experts' clamped SwiGLU
    shared_activation: ExpertActivation
    # The projections of the attention's input (q_a, kv, the compressors' kv and gate, the
    # indexer's head weights) and the shared expert's gate and up: one GEMV each when the
    # dense weights are materialized (`DenseWeights.projections`).
    attn_proj: Projections
    shared_proj: Projections


# ---------------------------------------------------------------------------------------
# The model


class DeepSeek4Model(ModelBase):
    """DeepSeek-V4 forward pass over dense GGUF weights plus an expert provider."""

    # Attention runs in blocks of this many queries: memory O(block * (window + entries)).
    query_block = 256
    # The indexer's [queries, heads, entries] score tensor is capped at this many values.
    indexer_budget = 1 << 24

    def __init__(
        self,
        config: DeepSeek4Config,
        weights: DenseWeights,
        experts: ExpertProvider | None,
        dtype: torch.dtype = torch.float32,
        decode_dtype: torch.dtype | None = None,
    ) -> None:
        self._bind(config, weights, experts, dtype, decode_dtype)
        self._check_shapes()

        c = self.config
        self.output = weights.matrix("output.weight")
        self.output_norm = weights.small("output_norm.weight")
        self.head_hc = HyperConnectionWeights(
            weights.small("output_hc_fn.weight"),
            weights.small("output_hc_base.weight"),
            weights.small("output_hc_scale.weight"),
        )
        self.layers = [self._layer_weights(i) for i in range(c.n_layers)]
        self._graphs = StepGraphs()
        self._static: StaticState | None = None  # the fixed-shape decode state, made at the first step
        self.static_decode: bool | None = None  # None: on a GPU with CUDA graphs (_static_applies)

        # Sliding-only layers: plain rope with rope_theta. Compressed layers, their
        # compressors and the indexer: compress_rope_theta with YaRN (factor 1 mscale).
        self.inv_freq_main = default_inv_freq(c.rope_theta, c.rope_dim).to(self.device)
        self.inv_freq_compress = (
            yarn_inv_freq(c.compress_rope_theta, c.rope_dim, c.yarn) if c.yarn is not None
            else default_inv_freq(c.compress_rope_theta, c.rope_dim)
        ).to(self.device)

    # -- construction ---------------------------------------------------------------------

    def _check_shapes(self) -> None:
        """Fail early, naming the tensor, if the file's shapes disagree with the metadata."""
        c, w = self.config, self.weights
        expected = {
            "token_embd.weight": (c.vocab_size, c.hidden_size),
            "output.weight": (c.vocab_size, c.hidden_size),
            "output_hc_fn.weight": (c.hc_mult, c.hc_mult * c.hidden_size),
        }
        mix = (2 + c.hc_mult) * c.hc_mult
        for i in range(c.n_layers):
            b = f"blk.{i}."
            expected[b + "attn_q_b.weight"] = (c.n_heads * c.head_dim, c.q_lora_rank)
            expected[b + "attn_kv.weight"] = (c.head_dim, c.hidden_size)
            expected[b + "attn_output_a.weight"] = (c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups)
            expected[b + "attn_output_b.weight"] = (c.hidden_size, c.o_groups * c.o_lora_rank)
            expected[b + "hc_attn_fn.weight"] = (mix, c.hc_mult * c.hidden_size)
            expected[b + "hc_ffn_fn.weight"] = (mix, c.hc_mult * c.hidden_size)
            expected[b + "ffn_gate_inp.weight"] = (c.n_experts, c.hidden_size)
            kind = c.layer_kind(i)
            if kind != "sliding":
                coff = 2 if kind == "csa" else 1
                expected[b + "attn_compressor_kv.weight"] = (coff * c.head_dim, c.hidden_size)
                expected[b + "attn_compressor_ape.weight"] = (c.compress_ratios[i], coff * c.head_dim)
            if kind == "csa":
                expected[b + "indexer.attn_q_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
                expected[b + "indexer_compressor_kv.weight"] = (2 * c.index_head_dim, c.hidden_size)
            if i < c.n_hash_layers:
                expected[b + "ffn_gate_tid2eid.weight"] = (c.vocab_size, c.n_experts_used)
        missing = [name for name in expected if name not in w]
        if missing:
            raise DeepSeek4ConfigError(
                f"the model file lacks tensors {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}: "
                "it is incomplete or not a DeepSeek-V4 file"
            )
        for name, shape in expected.items():
            if tuple(w.quant(name).shape) != shape:
                raise DeepSeek4ConfigError(
                    f"tensor {name} has shape {tuple(w.quant(name).shape)}, the metadata implies {shape}"
                )
        if c.n_heads % c.o_groups or c.rope_dim > c.head_dim or c.rope_dim > c.index_head_dim:
            raise DeepSeek4ConfigError("inconsistent head/group/rope sizes in the metadata")

    def _hc(self, name: str) -> HyperConnectionWeights:
        w = self.weights
        return HyperConnectionWeights(w.small(f"{name}_fn.weight"), w.small(f"{name}_base.weight"),
                                      w.small(f"{name}_scale.weight"))

    def _compressor(self, prefix: str, ratio: int, head_dim: int, overlap: bool) -> CompressorWeights:
        w = self.weights
        return CompressorWeights(
            kv=w.matrix(f"{prefix}_kv.weight"),
            gate=w.matrix(f"{prefix}_gate.weight"),
            ape=w.small(f"{prefix}_ape.weight"),
            norm=w.small(f"{prefix}_norm.weight"),
            ratio=ratio,
            head_dim=head_dim,
            overlap=overlap,
        )

    def _layer_weights(self, i: int) -> LayerWeights:
        c, w, b = self.config, self.weights, f"blk.{i}."
        kind = c.layer_kind(i)
        attn_roles = {"q_a": b + "attn_q_a.weight", "kv": b + "attn_kv.weight"}
        if kind != "sliding":
            attn_roles |= {"compressor.kv": b + "attn_compressor_kv.weight",
                           "compressor.gate": b + "attn_compressor_gate.weight"}
        if kind == "csa":
            attn_roles |= {"indexer.kv": b + "indexer_compressor_kv.weight",
                           "indexer.gate": b + "indexer_compressor_gate.weight",
                           "indexer.proj": b + "indexer.proj.weight"}
        attn_proj = w.projections(attn_roles)  # before the matrices are taken: they become its views
        shared_proj = w.projections({role: f"{b}ffn_{role}_shexp.weight" for role in ("gate", "up")})
        compressor = indexer = None
        if kind != "sliding":
            compressor = self._compressor(b + "attn_compressor", c.compress_ratios[i], c.head_dim, kind == "csa")
        if kind == "csa":
            indexer = IndexerWeights(
                compressor=self._compressor(b + "indexer_compressor", c.compress_ratios[i], c.index_head_dim, True),
                q_b=w.matrix(b + "indexer.attn_q_b.weight"),
                proj=w.matrix(b + "indexer.proj.weight"),
                n_heads=c.index_n_heads,
                head_dim=c.index_head_dim,
                top_k=c.index_topk,
            )
        o_a = w.matrix(b + "attn_output_a.weight")
        hashed = i < c.n_hash_layers
        tid2eid = w.small(b + "ffn_gate_tid2eid.weight").long() if hashed else None
        return LayerWeights(
            index=i,
            kind=kind,
            attn_hc=self._hc(b + "hc_attn"),
            ffn_hc=self._hc(b + "hc_ffn"),
            attn_norm=w.small(b + "attn_norm.weight"),
            sinks=w.small(b + "attn_sinks.weight"),
            q_a_norm=w.small(b + "attn_q_a_norm.weight"),
            q_b=w.matrix(b + "attn_q_b.weight"),
            kv_norm=w.small(b + "attn_kv_a_norm.weight"),
            o_a=o_a,
            o_b=w.matrix(b + "attn_output_b.weight"),
            compressor=compressor,
            indexer=indexer,
            ffn_norm=w.small(b + "ffn_norm.weight"),
            router=w.matrix(b + "ffn_gate_inp.weight", wide_dtype(self.dtype)),
            router_bias=None if hashed else w.small(b + "exp_probs_b.bias"),
            tid2eid=tid2eid,
            tid2eid_host=None if tid2eid is None else tid2eid.cpu(),
            shared_down=w.matrix(b + "ffn_down_shexp.weight"),
            activation=ExpertActivation("swiglu", limit=c.swiglu_limit[i]),
            shared_activation=ExpertActivation("swiglu", limit=c.swiglu_limit_shared[i]),
            attn_proj=attn_proj,
            shared_proj=shared_proj,
        )

    # -- state ----------------------------------------------------------------------------

    def new_state(self) -> DeepSeek4State:
        """An empty state: no tokens seen (kept in the decode dtype)."""
        c, dev, dt = self.config, self.device, self.decode_dtype

        def compressor_state(cw: CompressorWeights | None) -> CompressorState | None:
            if cw is None:
                return None
            width = cw.kv.shape[0]
            return CompressorState(
                pending_kv=torch.empty((0, width), dtype=dt, device=dev),
                pending_gate=torch.empty((0, width), dtype=dt, device=dev),
                overlap_kv=None,
                overlap_gate=None,
                entries=GrowingRows(cw.head_dim, dt, dev),
            )

        return DeepSeek4State(
            position=0,
            layers=[
                LayerState(
                    window=torch.empty((0, c.head_dim), dtype=dt, device=dev),
                    compressor=compressor_state(layer.compressor),
                    indexer=compressor_state(layer.indexer.compressor if layer.indexer else None),
                )
                for layer in self.layers
            ],
        )

    # -- forward --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, state: DeepSeek4State, *, only_last: bool = False,
                on_layer: LayerHook | None = None) -> torch.Tensor:
        """Process the chunk `token_ids` [T] after the tokens in `state` (updated in place).

        Returns float32 logits [T, vocab] for every position of the chunk; with
        `only_last`, [1, vocab] for the last one (a prompt chunk: the head's matmul and
        the [T, vocab] logits are then one row's). `on_layer`: see `protocol.Model.forward`.
        """
        host_ids = token_ids.reshape(-1).cpu()  # the ids as given (on the host, as a rule: no copy)
        token_ids = self._chunk_token_ids(token_ids)
        n = token_ids.numel()
        if n == 0:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
        self._begin(n)
        if n == 1 and self._static_applies():
            return self._decode_static(token_ids, host_ids, state)
        if state.in_static:  # a chunk after decode steps: the rows back into the eager state
            self._static_state().give_back(state)
        positions = torch.arange(state.position, state.position + n, device=self.device)
        self._prefetch_hash_layer_experts(host_ids)
        x, rope = self._embed(token_ids, positions)
        for layer, layer_state in zip(self.layers, state.layers):
            x = self._block(layer, x, token_ids, positions, rope, layer_state)
            if on_layer is not None:
                on_layer(layer.index + 1, len(self.layers))
        state.position += n
        return self._head(x[-1:] if only_last else x)

    __call__ = forward

    def _embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The streams x [T, hc, hidden] of the chunk's tokens, and the rope angles of its positions."""
        # Embedding, copied into hc parallel streams. The streams are the residual: kept in
        # float32 (wide_dtype) whatever the compute dtype, so bf16 rounding does not pile up
        # over the layers; block inputs are cast.
        h = embedding_rows(self.token_embd, token_ids, wide_dtype(self.compute))
        x = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        return x, self._rope(positions)

    def _rope(self, positions: torch.Tensor) -> dict:
        return {
            "main": rope_cos_sin(self.inv_freq_main, positions),
            "compress": rope_cos_sin(self.inv_freq_compress, positions),
        }

    # -- decode with fixed-shape state (deepseek4_static) ---------------------------------

    def _static_applies(self) -> bool:
        """Whether a one-token step runs on the fixed-shape state: by default on a GPU with
        CUDA graphs on (`static_decode` set True runs it on any device, for tests)."""
        if self.static_decode is not None:
            return self.static_decode
        return self.device.type == "cuda" and self._graphs.enabled

    def _static_state(self) -> StaticState:
        if self._static is None:
            c, dev, dt = self.config, self.device, self.decode_dtype
            wide = wide_dtype(dt)

            def compressor(cw: CompressorWeights | None) -> StaticCompressor | None:
                if cw is None:
                    return None
                return StaticCompressor.empty(cw.ratio, cw.kv.shape[0], cw.head_dim, cw.overlap, MIN_BUCKET, dt,
                                              wide, dev)

            self._static = StaticState([
                StaticLayer(torch.zeros((max(1, c.sliding_window), c.head_dim), dtype=dt, device=dev),
                            compressor(layer.compressor),
                            compressor(layer.indexer.compressor if layer.indexer else None))
                for layer in self.layers
            ])
        return self._static

    def _decode_static(self, token_ids: torch.Tensor, host_ids: torch.Tensor, state: DeepSeek4State) -> torch.Tensor:
        """One decode step on the fixed-shape state. With a graph-safe expert provider the
        whole step is one CUDA graph; otherwise one graph per stretch between routing
        points, the provider's experts between them (`_step_pieces`)."""
        static = self._static_state()
        position = state.position
        static.prepare(state, self._graphs)
        self._prefetch_hash_layer_experts(host_ids)
        # the step's token and position, read in place by each of its graphs
        token_ids, pos = self._graphs.staged(self.device, token_ids, torch.full((1,), position, dtype=torch.long))
        rows = static.rows(position)
        buckets = tuple(sorted(rows.items()))
        assert self.experts is not None  # forward() checked it
        if self.experts.graph_safe(token_ids.view(1, 1), self.config.n_experts_used):
            logits = self._graphs.run(("step", buckets), partial(self._step_static, rows), token_ids, pos,
                                      mutates=static.tensors())
        else:
            logits = self._step_pieces(rows, buckets, token_ids, pos)
        state.position += 1
        return logits.clone()  # a graph's output buffer is overwritten by the next step

    def _step_pieces(self, rows: dict[int, int], buckets: tuple, token_ids: torch.Tensor,
                     pos: torch.Tensor) -> torch.Tensor:
        """A step whose routed experts a provider serves eagerly (a pack): one CUDA graph per
        stretch between routing points (the embedding or a layer's experts' output through
        the next layer's router; the last layer's into the logits), the experts between."""
        static = self._static_state()
        assert self.experts is not None  # forward() checked it
        routed: torch.Tensor | None = None
        carried: tuple[torch.Tensor, ...] = ()
        for stop in range(len(self.layers) + 1):
            tensors = (token_ids, pos) if routed is None else (routed, pos, token_ids, *carried)
            touched = static.layers[stop].tensors() if stop < len(self.layers) else []
            out = self._graphs.run(("stretch", stop, buckets), partial(self._stretch, stop, rows), *tensors,
                                   mutates=touched)
            if stop == len(self.layers):
                return out
            x, post, comb, h, chosen, weights, guess_scores = out
            layer = self.layers[stop]
            routed = self.experts.routed(layer.index, h, chosen, weights, layer.activation,
                                         next_layer=self._next_layer(layer, h, guess_scores))
            carried = (x, h, post, comb)
        raise AssertionError("unreachable: the last stretch returns the logits")

    def _stretch(self, stop: int, rows: dict[int, int], first: torch.Tensor, pos: torch.Tensor,
                 *rest: torch.Tensor):
        """Layer stop - 1's experts' output `first` into its stream (`rest`: the token ids
        and the x, h, post, comb its router stretch returned), then layer `stop` up to its
        routed experts: `_ffn_in`'s (x, post, comb, h, chosen, weights) and the next layer's
        router scores on h for the provider's guess (None where `_next_layer` has none), in
        the graph rather than eagerly between graphs; or, at stop 0, from the token ids
        `first`; at the end, the logits."""
        if rest:
            token_ids, x, h, post, comb = rest
            x = self._ffn_out(self.layers[stop - 1], x, h, first, post, comb)
        else:
            token_ids = first
            x, _ = self._embed(token_ids, pos)
        if stop == len(self.layers):
            return self._head(x)
        layer = self.layers[stop]
        out = self._pre_moe_static(layer, self._static_state().layers[stop], rows, x, token_ids, pos)
        guess = self._next_layer(layer, out[3])
        return (*out, None if guess is None else guess.scores())

    def _step_static(self, rows: dict[int, int], token_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The whole decode step (graph-safe provider): logits [1, vocab]."""
        static = self._static_state()
        x, rope = self._embed(token_ids, pos)
        angles = self._step_angles(pos, rows)
        for layer, sl in zip(self.layers, static.layers):
            post, comb, h = self._attn_in(layer, x)
            attn_out = self._attention_static(layer, h, pos, rope, angles, sl, rows)
            x = self._ffn(layer, x, attn_out, post, comb, token_ids)
        return self._head(x)

    def _pre_moe_static(self, layer: LayerWeights, sl: StaticLayer, rows: dict[int, int], x: torch.Tensor,
                        token_ids: torch.Tensor, pos: torch.Tensor):
        """A layer up to its routed experts: (x, post, comb, h, chosen, weights) as `_ffn_in`."""
        post, comb, h = self._attn_in(layer, x)
        attn_out = self._attention_static(layer, h, pos, self._rope(pos), self._step_angles(pos, rows), sl, rows)
        return self._ffn_in(layer, x, attn_out, post, comb, token_ids)

    def _step_angles(self, pos: torch.Tensor, rows: dict[int, int]) -> dict:
        """What every layer of the step shares: per compress ratio, the rope angles of the
        open window's first position."""
        return {ratio: rope_cos_sin(self.inv_freq_compress, pos // ratio * ratio) for ratio in rows}

    def _attention_static(self, layer: LayerWeights, x: torch.Tensor, pos: torch.Tensor, rope: dict, angles: dict,
                          sl: StaticLayer, rows: dict[int, int]) -> torch.Tensor:
        """`_attention` for one query at position `pos` (a device tensor [1]) on the fixed-shape
        state: the masks come from `pos` inside `kernels.decode_attention`."""
        cos, sin = rope["main"] if layer.kind == "sliding" else rope["compress"]
        q_residual, q, kv, p = self._qkv(layer, x, cos, sin)
        window = sl.window
        window.index_copy_(0, pos % window.shape[0], kv)  # a ring: row p % W holds position p
        entries = picks = None
        ratio = 0
        if layer.compressor is not None:
            sc = sl.compressor
            assert sc is not None  # a layer with a compressor has its buffers
            ratio, n_rows = sc.ratio, rows[sc.ratio]
            self._compress_static(layer.compressor, p["compressor.kv"], p["compressor.gate"], sc, pos,
                                  angles[sc.ratio])
            entries = sc.entries[:n_rows]
            if layer.indexer is not None:
                si = sl.indexer
                assert si is not None  # likewise for the indexer
                self._compress_static(layer.indexer.compressor, p["indexer.kv"], p["indexer.gate"], si, pos,
                                      angles[si.ratio])
                picks = self._pick(layer.indexer, p["indexer.proj"], q_residual, pos, si.entries[:n_rows],
                                   rope["compress"])
        out = decode_attention(q, window, pos, self.config.sliding_window >= 1, entries, picks, ratio, layer.sinks,
                               self.config.head_dim ** -0.5, (cos, sin))
        return self._o_proj(layer, out)

    def _compress_static(self, cw: CompressorWeights, kv: torch.Tensor, gate: torch.Tensor, sc: StaticCompressor,
                         pos: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`_compress` for the token at `pos` (its projections kv, gate [1, width]): its rows
        into the open window's slot, and the window pooled into entry pos // ratio (final once
        the window closes); `rope` holds the angles of the window's first position
        (`kernels.compressor`)."""
        compress_step(kv, gate, sc.pending_kv, sc.pending_gate, sc.overlap_kv,
                      sc.overlap_gate, sc.entries, cw.ape, cw.norm, rope[0], rope[1], pos, cw.ratio, cw.head_dim,
                      cw.overlap, self.config.rms_eps)

    def _prefetch_hash_layer_experts(self, host_ids: torch.Tensor) -> None:
        """Tell the provider the hash layers' experts now: they depend on the token ids
        (`host_ids`, on the host) alone, looked up in the host copy of each table, so the
        hints cost no device sync.

        Exact, not speculative: these experts will be asked for in this very step, so a
        streaming provider's reads overlap the attention of the layers before them.
        """
        assert self.experts is not None  # forward() checked it
        for layer in self.layers[: self.config.n_hash_layers]:
            if layer.tid2eid_host is not None:
                self.experts.hint(layer.index, layer.tid2eid_host[host_ids])

    def _block(self, layer: LayerWeights, x: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
               rope: dict, layer_state: LayerState) -> torch.Tensor:
        """One decoder layer: HC(attention) then HC(MoE). In a decode step everything but
        the attention (and routed experts a provider must serve eagerly) replays from
        CUDA graphs (`graphs.StepGraphs`)."""
        assert self.experts is not None  # forward() checked it
        i = layer.index
        if len(pieces(x.shape[0])) > 1:
            return self._block_in_pieces(layer, x, token_ids, positions, rope, layer_state)
        post, comb, h = self._graphs.run(("attn_in", i), partial(self._attn_in, layer), x)
        attn_out = self._attention(layer, h, positions, rope, layer_state)
        if self.experts.graph_safe(attn_out, self.config.n_experts_used):
            return self._graphs.run(("ffn", i), partial(self._ffn, layer), x, attn_out, post, comb, token_ids)
        x, post, comb, h, chosen, weights = self._graphs.run(
            ("ffn_in", i), partial(self._ffn_in, layer), x, attn_out, post, comb, token_ids)
        routed = self.experts.routed(i, h, chosen, weights, layer.activation, next_layer=self._next_layer(layer, h))
        return self._graphs.run(("ffn_out", i), partial(self._ffn_out, layer), x, h, routed, post, comb)

    def _block_in_pieces(self, layer: LayerWeights, x: torch.Tensor, token_ids: torch.Tensor,
                         positions: torch.Tensor, rope: dict, layer_state: LayerState) -> torch.Tensor:
        """A layer over a long prompt chunk: the attention and the MoE's input, piece after
        piece (`common.pieces`; the attention state carries from one to the next as between
        chunks), then the routed experts once over every token of the chunk, then each
        piece's MoE output into its streams. Only the streams and the MoE's rows are held
        for the whole chunk."""
        assert self.experts is not None  # forward() checked it
        out = torch.empty_like(x)  # the streams after the attention, then after the MoE
        spans = pieces(x.shape[0])
        mixes, moe_ins = [], []  # per piece: (post, comb), (h, chosen, weights)
        for part in spans:
            part_rope = {k: (cos[part], sin[part]) for k, (cos, sin) in rope.items()}
            post, comb, h = self._attn_in(layer, x[part])
            attn_out = self._attention(layer, h, positions[part], part_rope, layer_state)
            out[part], post, comb, *moe_in = self._ffn_in(layer, x[part], attn_out, post, comb, token_ids[part])
            mixes.append((post, comb))
            moe_ins.append(moe_in)
        h, chosen, weights = (torch.cat([m[i] for m in moe_ins]) for i in range(3))
        routed = self.experts.routed(layer.index, h, chosen, weights, layer.activation,
                                     next_layer=self._next_layer(layer, h))
        for part, (post, comb) in zip(spans, mixes):
            out[part] = self._ffn_out(layer, out[part], h[part], routed[part], post, comb)
        return out

    def _attn_in(self, layer: LayerWeights, x: torch.Tensor):
        """The attention's mixing weights and its normed input."""
        return self._hc_pre(layer.attn_hc, x, layer.attn_norm)

    def _ffn_in(self, layer: LayerWeights, x: torch.Tensor, attn_out: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, token_ids: torch.Tensor):
        """The attention's output into the streams; the MoE's mixing weights, normed input and routing."""
        x = hc_post(x, attn_out, post, comb)
        post, comb, h = self._hc_pre(layer.ffn_hc, x, layer.ffn_norm)
        chosen, weights = self._route(layer, h, token_ids)
        return x, post, comb, h, chosen, weights

    def _ffn_out(self, layer: LayerWeights, x: torch.Tensor, h: torch.Tensor, routed: torch.Tensor,
                 post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The shared expert joins the routed output; the MoE's output into the streams."""
        return hc_post(x, routed + self._shared_expert(layer, h), post, comb)

    def _shared_expert(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        p = layer.shared_proj(h)
        return layer.shared_down.linear(layer.shared_activation(p["gate"], p["up"]))

    def _ffn(self, layer: LayerWeights, x: torch.Tensor, attn_out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Everything after the attention, routed experts included (a graph-safe provider)."""
        x, post, comb, h, chosen, weights = self._ffn_in(layer, x, attn_out, post, comb, token_ids)
        assert self.experts is not None  # forward() checked it
        routed = self.experts.routed(layer.index, h, chosen, weights, layer.activation)
        return self._ffn_out(layer, x, h, routed, post, comb)

    # -- hyper-connections ----------------------------------------------------------------

    def _hc_pre(self, hc: HyperConnectionWeights, x: torch.Tensor, norm: torch.Tensor):
        """Mixing weights from the streams, and the streams collapsed into the block input
        (RMSNorm'd with the block's gains `norm`): post [T, hc], comb [T, hc, hc] (comb[j, k]:
        stream j into output stream k) and h [T, hidden] (`kernels.hyper_connection`)."""
        c = self.config
        return hc_pre(x, hc.fn, hc.base, hc.scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_eps, self.compute, norm)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Collapse the streams (sigmoid weights, no Sinkhorn), output norm, vocabulary logits."""
        hc = self.head_hc
        flat = rms_norm_unweighted(x.reshape(x.shape[0], -1).float(), self.config.rms_eps)
        mixes = F.linear(flat, hc.fn.float())
        pre = torch.sigmoid(mixes * hc.scale.float() + hc.base.float()) + self.config.hc_eps
        h = (pre.unsqueeze(-1) * x).sum(dim=1).to(self.compute)
        h = rms_norm(h, self.output_norm, self.config.rms_eps)
        return self.output.linear(h).float()

    # -- attention ------------------------------------------------------------------------

    def _attention(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, rope: dict,
                   st: LayerState) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        cos, sin = rope["main"] if layer.kind == "sliding" else rope["compress"]

        q_residual, q, kv, p = self._graphs.run(("qkv", layer.index), partial(self._qkv, layer), x, cos, sin)
        n_cached = st.window.shape[0]
        kept, window = self.joined(st.window, kv)  # positions position0 - n_cached .. end
        keep = c.sliding_window - 1
        st.window = self.kept(kept[max(0, kept.shape[0] - keep):] if keep > 0 else kept[:0])

        entries = None
        selected = None
        if layer.compressor is not None:
            assert st.compressor is not None  # new_state gives a layer with a compressor its state
            entries = self._compress(layer.compressor, p["compressor.kv"], p["compressor.gate"], st.compressor)
        if layer.indexer is not None:
            assert st.indexer is not None  # likewise for the indexer
            selected = self._index(layer.indexer, p, q_residual, positions, st.indexer)

        out = torch.empty_like(q)
        for start in range(0, n, self.query_block):
            stop = min(n, start + self.query_block)
            # Keys this block can see in the window: from (first query - W + 1) to its last query.
            k_lo = max(0, n_cached + start - (c.sliding_window - 1))
            k_hi = n_cached + stop
            key_pos = positions[0] - n_cached + torch.arange(k_lo, k_hi, device=x.device)
            qpos = positions[start:stop]
            visible = (key_pos[None, :] <= qpos[:, None]) & (key_pos[None, :] > qpos[:, None] - c.sliding_window)
            mask_w = additive_mask(visible, q.dtype)
            comp_keys = comp_mask = None
            if entries is not None and entries.shape[0] > 0:
                assert layer.compressor is not None  # the entries are its output
                limit = (qpos + 1) // layer.compressor.ratio  # query t sees entry w iff w < (t + 1) // ratio
                if selected is None:  # HCA: every causally complete entry
                    comp_keys = entries
                    ok = torch.arange(entries.shape[0], device=x.device)[None, :] < limit[:, None]
                else:  # CSA: only the indexer's picks (-1: no pick)
                    picks = selected[start:stop]
                    comp_keys = entries[picks.clamp(min=0)]  # [block, k, head_dim]
                    ok = (picks >= 0) & (picks < limit[:, None])
                comp_mask = additive_mask(ok, q.dtype)
            out[start:stop] = attend(q[start:stop], window[k_lo:k_hi], mask_w, comp_keys, comp_mask, layer.sinks,
                                     c.head_dim ** -0.5)

        return self._graphs.run(("attn_out", layer.index), partial(self._attn_out, layer), out, cos, sin)

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries: low-rank q (its normed residual also feeds the indexer), per-head
        unweighted RMSNorm, rope on the trailing rope_dim; the single K = V head of the
        new positions. Returns (q_residual, q [n, heads, head_dim], kv [n, head_dim], and
        every projection of x by role: q_a, kv, and on compressed layers compressor.kv /
        .gate, on CSA layers indexer.kv / .gate / .proj)."""
        c, eps, n = self.config, self.config.rms_eps, x.shape[0]
        p = layer.attn_proj(x)
        q_residual = rms_norm(p["q_a"], layer.q_a_norm, eps)
        q = layer.q_b.linear(q_residual).view(n, c.n_heads, c.head_dim)
        q = norm_rope(q, None, eps, cos, sin)
        kv = norm_rope(p["kv"], layer.kv_norm, eps, cos, sin)
        return q_residual, q, kv, p

    def _attn_out(self, layer: LayerWeights, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """K = V carried rope into the values: rotate the output's rope slice back to the
        query position; then the grouped low-rank output projection."""
        return self._o_proj(layer, apply_rope(out, cos, -sin))

    def _o_proj(self, layer: LayerWeights, out: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection of the heads' outputs [n, heads, head_dim]."""
        c, n = self.config, out.shape[0]
        return layer.o_b.linear(layer.o_a.grouped_linear(out.reshape(n, c.o_groups, -1)))

    # -- compressors and the lightning indexer --------------------------------------------

    def _compress(self, cw: CompressorWeights, kv_new: torch.Tensor, gate_new: torch.Tensor,
                  st: CompressorState) -> torch.Tensor:
        """Feed the chunk (its kv and gate projections [T, width]) to a compressor; returns
        all entries so far [E, head_dim].

        Each closed window of `ratio` tokens emits one entry: a softmax(gate + ape)
        weighted sum of its kv rows (per feature, fp32 softmax), RMSNorm, rope at the
        window's first position. CSA (overlap) pools 2 * ratio slots: the first half of
        the previous window's rows and the second half of its own.
        """
        kept_kv, kv = self.joined(st.pending_kv, kv_new)  # the open window's rows, then the chunk's
        kept_gate, gate = self.joined(st.pending_gate, gate_new)
        m, d = cw.ratio, cw.head_dim
        n_windows = kv.shape[0] // m
        usable = n_windows * m
        st.pending_kv, st.pending_gate = self.kept(kept_kv[usable:]), self.kept(kept_gate[usable:])
        if n_windows == 0:
            return st.entries.rows.to(kv_new.dtype)
        first_entry = st.entries.n
        chunk_kv = kv[:usable].view(n_windows, m, -1)
        chunk_gate = gate[:usable].view(n_windows, m, -1) + cw.ape
        window_pos = (torch.arange(n_windows, device=kv.device) + first_entry) * m
        cos, sin = rope_cos_sin(self.inv_freq_compress, window_pos)
        st.entries.append(pool_windows(chunk_kv, chunk_gate, st.overlap_kv, st.overlap_gate, cw.norm, m, d, cw.overlap,
                                       self.config.rms_eps, cos, sin))
        if cw.overlap:  # the last window's first half, from the kept rows
            st.overlap_kv = self.kept(kept_kv[usable - m:usable, :d])
            st.overlap_gate = kept_gate[usable - m:usable, :d] + cw.ape[:, :d]  # gate + ape: float32 (wide)
        return st.entries.rows.to(kv_new.dtype)

    def _index(self, iw: IndexerWeights, p: dict[str, torch.Tensor], q_residual: torch.Tensor,
               positions: torch.Tensor, st: CompressorState) -> torch.Tensor:
        """Lightning indexer: per query, the top-k causally complete CSA entries ([T, k], -1 = none).

        score(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s)) / sqrt(head_dim), with
        w = proj(x) / sqrt(n_heads); keys come from the indexer's own compressor. `p` holds
        the projections of the attention's input (`_qkv`).
        """
        keys = self._compress(iw.compressor, p["indexer.kv"], p["indexer.gate"], st)
        return self._pick(iw, p["indexer.proj"], q_residual, positions, keys)

    def _pick(self, iw: IndexerWeights, head_proj: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The indexer's top-k over the entries `keys` [E, head_dim] (head_proj [T, heads]:
        proj(x)); entries the queries may not see yet (w >= (t + 1) // ratio) are never
        picked ([T, k], -1 = none)."""
        n = q_residual.shape[0]
        n_entries = keys.shape[0]
        top_k = min(iw.top_k, n_entries)
        if top_k == 0:
            return torch.full((n, 0), -1, dtype=torch.long, device=keys.device)
        cos, sin = rope_cos_sin(self.inv_freq_compress, positions) if rope is None else rope
        q = apply_rope(iw.q_b.linear(q_residual).view(n, iw.n_heads, iw.head_dim), cos, sin)
        limit = (positions + 1) // iw.compressor.ratio
        rows = max(1, self.indexer_budget // max(1, iw.n_heads * n_entries))
        blocks = []
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            scores = index_scores(q[start:stop], head_proj[start:stop], keys, limit[start:stop])  # [rows, entries]
            # Ties are real here (a ReLU'd score is often exactly 0), and torch's top-k breaks
            # them differently on each device: a stable sort keeps the earlier entry, everywhere.
            top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
            blocks.append(top.masked_fill(top >= limit[start:stop, None], -1))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    # -- mixture of experts ---------------------------------------------------------------

    def _route(self, layer: LayerWeights, x: torch.Tensor,
               token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts and their weights [T, k]. The router runs in float32
        (wide_dtype): its scores pick the experts."""
        c = self.config
        logits = layer.router.linear(x.to(wide_dtype(x.dtype)))
        # A hash layer's experts are fixed by the token id; the others' are selected with the
        # bias (the weights do not use it): kernels.routing.
        hashed = None if layer.tid2eid is None else layer.tid2eid[token_ids]
        return route(logits, layer.router_bias, c.n_experts_used, c.norm_topk, c.routed_scaling, hashed)

    def _next_layer(self, layer: LayerWeights, x: torch.Tensor,
                    scores: torch.Tensor | None = None) -> NextLayer | None:
        """The next layer's router on this layer's MoE input, for the provider's guess;
        none for a hash layer, whose experts are hinted exactly. `scores`: those already
        computed (a decode step's graph did)."""
        nxt = layer.index + 1  # self.layers[i].index == i
        if nxt >= len(self.layers) or self.layers[nxt].tid2eid is not None:
            return None
        following = self.layers[nxt]
        bias = following.router_bias
        assert bias is not None  # every non-hash layer has one
        if scores is not None:
            return NextLayer(following.index, self.config.n_experts_used, lambda: scores)
        return NextLayer(following.index, self.config.n_experts_used,
                         lambda: sqrt_softplus(following.router.linear(x.to(wide_dtype(x.dtype)))) + bias)

