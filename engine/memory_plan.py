"""One memory plan: who gets how much of the VRAM and the RAM, from the model and the machine.

Why one plan: the dense weights, the KV state, the activations and the expert cache
compete for the compute device's memory, and the host-RAM expert tier for RAM with
the OS and the app. Sizing the expert cache as "all free memory" leaves nothing for a
conversation's growing KV state, so a long chat runs out of memory. The plan:

    device memory = dense weights + KV state at the wanted context + activations
                    + safety margin + expert cache (what is left, whole experts)
    RAM           = host-RAM expert tier + margin for the OS, the app and page cache

KV state per architecture (`kv_size`, bytes of one sequence; the row buffers start
at 16 rows and double as they grow, so the plan counts `GROWTH` times the rows, and
`FIXED_SHAPE` times more for the GPU's fixed-shape decode buffers):
- DeepSeek-V4: a sliding window of `sliding_window - 1` K=V rows per layer (fixed),
  plus compressed entries: a CSA layer adds one `head_dim` entry and one indexer
  entry per 4 tokens, an HCA layer one entry per `ratio` (e.g. 128) tokens.
- Kimi-K3: KDA (linear attention) layers keep a fixed state (conv tails and an fp32
  [heads, d, d] recurrent matrix) whatever the context; MLA layers cache one
  `kv_lora_rank + rope` row per token.

Who uses it: the loader sizes the expert cache with it when no `cache_mib` was given
(`plan_for_loaded`, after the dense weights are in place), `expertdesk check` prints
it as one bar per consumer (`plan_for_source`, `MemoryPlan.bars`), and the service
calls `fit_context` before each reply: when a conversation outgrows the planned KV
budget, the expert cache shrinks in place (`ExpertCache.shrink`) rather than fail.
When nothing fits, `MemoryPlanError` says so with the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.models import DeepSeek4Config, KimiK3Config
from engine.models.common import PROMPT_PIECE
from engine.options import RuntimeOptions
from engine.runtime.errors import RuntimeStartError

MIB = 1 << 20
GIB = 1 << 30
GROWTH = 2  # GrowingRows doubles its capacity: up to twice the rows are allocated
# On a GPU, decode keeps the rows once more in fixed-shape buffers read up to a power-of-
# two bucket (engine/models/static_state.py): up to twice the rows again.
FIXED_SHAPE = 2
MIN_ROWS = 16  # ... and starts at 16 rows
DEFAULT_CONTEXT_TOKENS = 8192
# Prompt chunks the plan may choose, largest first. A chunk reads each MoE layer's experts
# once (from the drive, through a pack: a 512-token chunk picks nearly every expert of a
# layer, so a prompt's drive bytes fall as its chunks grow); the models run its attention
# and dense parts in pieces of engine.models.common.PROMPT_PIECE tokens (512), so what
# grows with the chunk is only the rows it holds whole (`chunk_row_bytes`). The plan gives
# the larger chunks at most 1/PROMPT_CACHE_SHARE of the expert cache it would otherwise
# have: a prompt past 512 tokens reads the drive 2-4x less, decode keeps >= 3/4 of its
# cache. At the seed PC's budgets (a 32 GB card) DeepSeek-V4-Flash gives 3% of its 21 GiB
# cache for chunks of 2048, Kimi-K3 15% of its 5 GiB for chunks of 1024 (a 512-token
# chunk of Kimi-K3 reads its whole terabyte of experts).
PROMPT_CHUNKS = (2048, 1024, PROMPT_PIECE)
PROMPT_CACHE_SHARE = 4
QUERY_BLOCK = 256  # queries per attention block (the models' query_block)


class MemoryPlanError(RuntimeStartError):
    """Nothing fits: the message gives every consumer's bytes and what to change."""


@dataclass(frozen=True)
class KVSize:
    """Bytes of one sequence's attention state: `fixed` (windows, recurrent states) plus
    `per_token` for every token of context."""

    architecture: str
    fixed: int
    per_token: float
    detail: str

    def at(self, tokens: int) -> int:
        """Bytes allocated at `tokens` of context (row buffers counted at worst-case growth)."""
        return self.fixed + math.ceil((GROWTH + FIXED_SHAPE) * self.per_token * max(0, int(tokens)))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_size(config: Any, dtype: torch.dtype) -> KVSize:
    """The KV state of `config` (DeepSeek4Config or KimiK3Config) kept in `dtype` (the decode dtype)."""
    b = _itemsize(dtype)
    if isinstance(config, DeepSeek4Config):
        kinds = [config.layer_kind(i) for i in range(config.n_layers)]
        fixed = config.n_layers * (config.sliding_window - 1) * config.head_dim * b
        per_token = 0.0
        for i, kind in enumerate(kinds):
            ratio = config.compress_ratios[i]
            if kind == "sliding":
                continue
            overlap = 2 if kind == "csa" else 1
            # the open window's kv and gate rows, and the entries buffer's first 16 rows
            fixed += (2 * ratio * overlap + MIN_ROWS) * config.head_dim * b
            per_token += config.head_dim * b / ratio
            if kind == "csa":  # the indexer's own compressed keys
                fixed += (2 * ratio * 2 + MIN_ROWS) * config.index_head_dim * b
                per_token += config.index_head_dim * b / ratio
        hca = sorted({config.compress_ratios[i] for i, k in enumerate(kinds) if k == "hca"})
        detail = (f"DeepSeek-V4 compressed KV: {kinds.count('sliding')} sliding-window layers, "
                  f"{kinds.count('csa')} CSA (1 entry + 1 indexer key per 4 tokens), {kinds.count('hca')} HCA "
                  f"(1 entry per {'/'.join(map(str, hca)) or '-'} tokens), window {config.sliding_window}")
        return KVSize("deepseek4", fixed, per_token, detail)
    if isinstance(config, KimiK3Config):
        wide = 8 if dtype == torch.float64 else 4  # the recurrent state runs in the wide dtype
        mla = sum(1 for m in config.mla_layers if m)
        kda = config.n_layers - mla
        inner = config.n_heads * config.kda_head_dim
        row = (config.kv_lora_rank + config.qk_rope_dim) * b
        fixed = kda * (3 * (config.conv_kernel - 1) * inner * b
                       + config.n_heads * config.kda_head_dim ** 2 * wide) + mla * MIN_ROWS * row
        per_token = mla * row
        detail = (f"Kimi-K3: {kda} KDA linear-attention layers (fixed state, "
                  f"{config.n_heads} x {config.kda_head_dim}^2 fp32 each), {mla} MLA layers "
                  f"({config.kv_lora_rank} + {config.qk_rope_dim} per token)")
        return KVSize("kimi-k3", fixed, float(per_token), detail)
    raise TypeError(f"no KV model for {type(config).__name__}")


def chunk_row_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes a prompt chunk holds per token for the whole chunk while its pieces run (a
    generous count, every row at least float32): the residual stream in and out (and
    Kimi-K3's AttnRes checkpoints of it), the MoE's input, its gathered copy and its output,
    and the routed (token, expert) pairs' intermediate and output rows."""
    b = max(4, _itemsize(dtype))
    stream = config.hidden_size * getattr(config, "hc_mult", 1) * 4
    block = getattr(config, "attn_res_block_size", 0)
    checkpoints = -(-config.n_layers // block) if block else 0
    width = getattr(config, "latent_size", 0) or config.hidden_size  # the routed experts' width
    pairs = config.n_experts_used * (config.expert_ffn + width) * b
    return (2 + checkpoints) * stream + 3 * config.hidden_size * b + pairs


def activation_bytes(config: Any, context_tokens: int, dtype: torch.dtype, chunk: int = PROMPT_PIECE) -> int:
    """A generous estimate of one forward pass's working memory at `context_tokens`: a
    piece's hidden states (streams, projections, expert inputs and outputs), one block of
    attention scores over what a query attends to, and the rows a chunk longer than a piece
    holds whole (`chunk_row_bytes`)."""
    b = max(4, _itemsize(dtype))  # norms, softmaxes and the residual streams are float32
    hidden = config.hidden_size * getattr(config, "hc_mult", 1)
    piece = min(chunk, PROMPT_PIECE)
    if isinstance(config, DeepSeek4Config):
        attended = config.sliding_window + config.index_topk + context_tokens // max(
            [r for r in config.compress_ratios if r > 4] or [1])
    else:
        attended = context_tokens
    whole = chunk_row_bytes(config, dtype) * chunk if chunk > PROMPT_PIECE else 0
    return piece * hidden * b * 32 + QUERY_BLOCK * config.n_heads * (attended + piece) * 4 + whole


@dataclass(frozen=True)
class MemoryPlan:
    """The budget of every consumer, in bytes, on the compute device and in RAM."""

    device: str  # "cuda:0", "cpu"
    context_tokens: int
    kv: KVSize
    expert_bytes: int  # one expert slot (the pack's stride)
    min_experts: int  # one MoE layer's top-k: the least the cache may hold
    device_total: int  # what the plan shares out on the device (free memory + what it already holds)
    device_parts: dict[str, int]  # dense weights, kv, activations, margin, expert cache
    ram_total: int = 0  # RAM it shares out (available RAM), on a CUDA machine
    ram_parts: dict[str, int] = field(default_factory=dict)  # host expert tier, margin
    prompt_chunk: int = PROMPT_PIECE  # prompt tokens a forward pass takes (the activations' size)

    @property
    def expert_cache_bytes(self) -> int:
        return self.device_parts["expert cache"]

    @property
    def host_cache_bytes(self) -> int:
        return self.ram_parts.get("host expert tier", 0)

    @property
    def reserve_bytes(self) -> int:
        """Device memory the expert cache must leave free: KV, activations and margin."""
        return sum(v for k, v in self.device_parts.items() if k not in ("dense weights", "expert cache"))

    def for_context(self, tokens: int) -> MemoryPlan:
        """This plan after the context grows to `tokens`: the KV budget grows, the expert
        cache gives the difference (whole experts); MemoryPlanError if it cannot."""
        need = self.kv.at(tokens)
        have = self.device_parts["kv state"]
        if need <= have:
            return self
        cache = (self.expert_cache_bytes - (need - have)) // self.expert_bytes * self.expert_bytes
        if cache < self.min_experts * self.expert_bytes:
            raise MemoryPlanError(
                f"a context of {tokens} tokens needs {_fmt(need)} of KV state ({self.kv.detail}); with "
                f"{_fmt(self.device_parts['dense weights'])} dense weights, {_fmt(self.device_parts['activations'])} "
                f"activations and a {_fmt(self.device_parts['margin'])} margin, the {_fmt(self.device_total)} of "
                f"{self.device} leave {_fmt(max(0, cache))} for the expert cache, less than one layer's "
                f"{self.min_experts} experts ({_fmt(self.min_experts * self.expert_bytes)}); start a new "
                "conversation, or free device memory")
        parts = dict(self.device_parts, **{"kv state": need, "expert cache": cache})
        return replace(self, context_tokens=int(tokens), device_parts=parts)

    def bars(self, width: int = 32) -> str:
        """One text bar per consumer, for `expertdesk check` and logs."""
        lines = []
        for title, total, parts in ((f"{self.device} memory", self.device_total, self.device_parts),
                                    ("RAM", self.ram_total, self.ram_parts)):
            if not parts:
                continue
            chunk = f", prompt chunks of {self.prompt_chunk} tokens" if parts is self.device_parts else ""
            lines.append(f"{title}: {_fmt(total)} planned, context {self.context_tokens} tokens{chunk}")
            for name, nbytes in parts.items():
                share = nbytes / total if total else 0.0
                filled = min(width, round(share * width))
                label = f"KV @ {self.context_tokens} tok" if name == "kv state" else name
                lines.append(f"  {label:18} [{'#' * filled}{'.' * (width - filled)}] {_fmt(nbytes):>10} "
                             f"{share:6.1%}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "context_tokens": self.context_tokens, "prompt_chunk": self.prompt_chunk,
                "kv": vars(self.kv),
                "kv_bytes_per_token": self.kv.per_token, "expert_bytes": self.expert_bytes,
                "device_total": self.device_total, "device_parts": dict(self.device_parts),
                "ram_total": self.ram_total, "ram_parts": dict(self.ram_parts)}


def _fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def device_margin(device_kind: str, total: int) -> int:
    """Device memory no consumer gets: on CUDA 6% of the card, at least 1 GiB (the CUDA
    context, the allocator's fragmentation); on the CPU the host safety margin (10% of
    RAM, at least 2 GiB), since the "device" is RAM the OS needs too."""
    if device_kind == "cuda":
        return max(GIB, int(total * 0.06))
    return max(2 * GIB, total // 10)


def plan_memory(*, config: Any, dtype: torch.dtype, context_tokens: int, device: str, device_total: int,
                device_free: int, dense_bytes: int, expert_bytes: int, top_k: int, margin: int,
                expert_count: int, ram_available: int = 0, ram_margin: int = 0,
                state_dtype: torch.dtype | None = None) -> MemoryPlan:
    """Share `device_free` (plus `dense_bytes`, counted as held by the dense weights)
    between the consumers; the expert cache gets what is left, in whole experts, at
    most all `expert_count` experts of the model. On a CUDA device the RAM plan gives
    3/4 of what the margin leaves to the host tier (at most the experts the device
    tier does not hold). MemoryPlanError, with the numbers, when not even one layer's
    experts fit. `dtype`: the prompt chunks' activations; `state_dtype`: the KV state's
    (the decode dtype; default `dtype`)."""

    kv = kv_size(config, dtype if state_dtype is None else state_dtype)

    def shared_out(chunk: int) -> tuple[dict[str, int], int]:
        parts = {"dense weights": int(dense_bytes), "kv state": kv.at(context_tokens),
                 "activations": activation_bytes(config, context_tokens, dtype, chunk), "margin": int(margin)}
        left = device_free - sum(v for k, v in parts.items() if k != "dense weights")
        return parts, min(max(0, left) // expert_bytes, int(expert_count)) * expert_bytes

    parts, cache = shared_out(PROMPT_PIECE)
    chunk = PROMPT_PIECE
    # the largest that leaves the cache at least 1 - 1/PROMPT_CACHE_SHARE of it
    for larger in (c for c in PROMPT_CHUNKS if c > PROMPT_PIECE):
        more, smaller = shared_out(larger)
        if cache - smaller <= cache // PROMPT_CACHE_SHARE and smaller >= top_k * expert_bytes:
            parts, cache, chunk = more, smaller, larger
            break
    if cache < top_k * expert_bytes:
        need = sum(parts.values()) + top_k * expert_bytes
        raise MemoryPlanError(
            f"the model does not fit {device}: dense weights {_fmt(parts['dense weights'])} + KV state at "
            f"{context_tokens} tokens {_fmt(parts['kv state'])} ({kv.detail}) + activations "
            f"{_fmt(parts['activations'])} + margin {_fmt(margin)} + one layer's {top_k} experts "
            f"{_fmt(top_k * expert_bytes)} = {_fmt(need)}, but only {_fmt(device_free + dense_bytes)} is free; "
            f"use a shorter context (now {context_tokens} tokens), close programs using that memory, or a "
            "device with more memory")
    parts["expert cache"] = cache
    plan = MemoryPlan(device=device, context_tokens=int(context_tokens), kv=kv, expert_bytes=int(expert_bytes),
                      min_experts=int(top_k), device_total=int(device_free + dense_bytes), device_parts=parts,
                      prompt_chunk=chunk)
    if device.startswith("cuda") and ram_available:
        host = min(max(0, int((ram_available - ram_margin) * 0.75)) // expert_bytes,
                   int(expert_count) - cache // expert_bytes) * expert_bytes
        plan = replace(plan, ram_total=int(ram_available),
                       ram_parts={"host expert tier": host, "OS + app margin": int(ram_available - host)})
    return plan


def plan_for_loaded(model: Any, expert_bytes: int, top_k: int, expert_count: int, device: torch.device,
                    context_tokens: int | None = None) -> MemoryPlan:
    """The plan for a model whose dense weights are already on `device` (the loader,
    before it sizes the expert cache): free memory measured now. On the CPU the
    process's resident memory stands for the dense weights (they are part of it)."""
    import psutil

    from engine import memory

    config = model.config
    tokens = int(context_tokens or min(DEFAULT_CONTEXT_TOKENS, getattr(config, "context_length", 0)
                                       or DEFAULT_CONTEXT_TOKENS))
    free = memory.free_device_memory(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        dense = int(torch.cuda.memory_allocated(device))
    else:
        total, dense = memory.total_ram(), int(psutil.Process().memory_info().rss)
    return plan_memory(config=config, dtype=model.dtype, state_dtype=model.decode_dtype, context_tokens=tokens,
                       device=str(device),
                       device_total=total, device_free=free, dense_bytes=dense, expert_bytes=expert_bytes,
                       top_k=top_k, margin=device_margin(device.type, total), expert_count=expert_count,
                       ram_available=memory.available_ram(), ram_margin=memory.host_safety_margin())


def plan_for_source(metadata: dict[str, Any], tensor_names: list[str], *, dense_bytes: int, expert_bytes: int,
                    top_k: int, expert_count: int, gpu_free: int | None, gpu_total: int | None,
                    ram_available: int, ram_total: int, context_tokens: int | None = None,
                    options: RuntimeOptions | None = None) -> MemoryPlan:
    """The plan for a model not loaded yet (`expertdesk check`, the setup wizard): from its
    GGUF metadata and sizes, on the GPU when there is one, else on the CPU, in the dtypes
    `options` will run it in (default: bfloat16 on the GPU, float32 on the CPU; the state in
    the decode dtype, so "Compute replies in float32" plans a float32 KV state)."""
    from engine.models import ARCHITECTURES

    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise MemoryPlanError(f"no memory model for architecture {arch!r}; ExpertDesk runs "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    config = ARCHITECTURES[arch][0].from_metadata(metadata, tensor_names)
    context = int(metadata.get(f"{arch}.context_length") or DEFAULT_CONTEXT_TOKENS)
    tokens = int(context_tokens or min(DEFAULT_CONTEXT_TOKENS, context))
    ram_margin = max(2 * GIB, ram_total // 10)
    options = options or RuntimeOptions()
    on_gpu = gpu_free is not None and bool(gpu_total)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype, state_dtype = options.resolved_dtype(device), options.resolved_decode_dtype(device)
    if on_gpu:
        assert gpu_free is not None and gpu_total is not None
        return plan_memory(config=config, dtype=dtype, state_dtype=state_dtype, context_tokens=tokens, device="cuda",
                           device_total=gpu_total, device_free=gpu_free - dense_bytes, dense_bytes=dense_bytes,
                           expert_bytes=expert_bytes, top_k=top_k, margin=device_margin("cuda", gpu_total),
                           expert_count=expert_count, ram_available=ram_available, ram_margin=ram_margin)
    return plan_memory(config=config, dtype=dtype, state_dtype=state_dtype, context_tokens=tokens, device="cpu",
                       device_total=ram_total, device_free=ram_available - dense_bytes, dense_bytes=dense_bytes,
                       expert_bytes=expert_bytes, top_k=top_k, margin=device_margin("cpu", ram_total),
                       expert_count=expert_count)


def prompt_chunk(model: Any) -> int:
    """Prompt tokens per forward pass for `model`: its memory plan's choice (a model on an
    Expert Pack whose cache the plan sized); else, where the plan manages nothing (every
    expert resident, or a cache of a given size), the largest of PROMPT_CHUNKS whose
    activations take at most a quarter of the memory free on its device now."""
    plan: MemoryPlan | None = getattr(model, "memory_plan", None)
    if plan is not None:
        return plan.prompt_chunk
    from engine import memory

    free = memory.free_device_memory(model.device)
    return next((c for c in PROMPT_CHUNKS if activation_bytes(model.config, DEFAULT_CONTEXT_TOKENS, model.dtype, c)
                 <= free // 4), PROMPT_PIECE)


def fit_context(model: Any, tokens: int) -> MemoryPlan | None:
    """Before a reply that may reach `tokens` of context: if the model's memory plan
    (`model.memory_plan`, set by the loader) budgets less KV than that, shrink its
    expert cache in place by the difference and keep the new plan. Returns the plan in
    force (None for a model without one); MemoryPlanError when even the smallest
    cache would not leave room."""
    plan: MemoryPlan | None = getattr(model, "memory_plan", None)
    if plan is None:
        return None
    grown = plan.for_context(tokens)
    if grown is not plan:
        model.experts.shrink(grown.expert_cache_bytes)
        model.memory_plan = grown
    return grown
