"""Pieces every architecture shares: metadata helpers, dense GGUF weights, RMSNorm,
growing per-position caches, and the routed-expert dispatch through the provider.

One way to do each of these things: `deepseek4.py` and `kimi_k3.py` both use them, so
a fix here (or a faster kernel) reaches every model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from engine.experts import ExpertProvider, ExpertWeights, QuantTensor
from engine.kernels import dequantize, row_nbytes
from engine.runtime.errors import CacheCapacityError

# ---------------------------------------------------------------------------------------
# Metadata values


def as_int(value: Any) -> int:
    return int(value)


def as_float(value: Any) -> float:
    return float(value)


def as_list(value: Any) -> list:
    """A GGUF value as a list: arrays as they are, a scalar as a one-item list."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return [value]


def architecture_metadata(
    metadata: Mapping[str, Any],
    architecture: str,
    required: Sequence[str],
    error: type[Exception],
    model_name: str,
    converter: str,
) -> Callable[..., Any]:
    """Check a GGUF's metadata is `architecture`'s and has every `required` key (without
    the `architecture.` prefix); return `get(key, default=None)` for prefixed keys.

    Raises `error` naming a wrong architecture, or every missing key at once;
    `model_name` ("DeepSeek-V4") and `converter` ("a DeepSeek-V4 converter") word it.
    """
    arch = metadata.get("general.architecture")
    if arch != architecture:
        raise error(
            f"general.architecture is {arch!r}, not {architecture!r}: this is not a {model_name} GGUF"
        )
    p = f"{architecture}."
    missing = [p + key for key in required if p + key not in metadata]
    if missing:
        raise error(
            "GGUF metadata is missing " + ", ".join(missing)
            + f": the file was not written by {converter} this engine knows "
            "(llama.cpp's convert_hf_to_gguf.py); re-convert the model with a current llama.cpp"
        )

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(p + key, default)

    return get


def metadata_vocab_size(metadata: Mapping[str, Any], architecture: str) -> int:
    """`architecture.vocab_size`, else the tokenizer's token count, else 0 (taken from token_embd)."""
    vocab = metadata.get(f"{architecture}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in metadata:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    return as_int(vocab) if vocab is not None else 0


# ---------------------------------------------------------------------------------------
# Dense weights


class TensorSource(Protocol):
    """What the weights are read from: `packer.gguf_source.GGUFSource` (or a pack's dense.gguf)."""

    metadata: Mapping[str, Any]
    tensors: Mapping[str, Any]  # name -> TensorInfo (ggml_type, shape in numpy order, ...)

    def tensor_bytes(self, name: str) -> np.ndarray: ...


def is_routed_expert_tensor(name: str) -> bool:
    """`blk.N.ffn_{gate,up,down}_exps.weight`: served by the expert provider, not loaded here."""
    return name.startswith("blk.") and name.endswith("_exps.weight")


class DenseWeights:
    """Every non-expert tensor of a GGUF, kept in its GGUF type on one device.

    `quant(name)` gives the bytes as a `QuantTensor` (2-D weights are used through
    `QuantTensor.linear`, which dequantizes per use); `small(name)` gives a small
    tensor (norm gains, sinks, hyper-connection parameters, compressor `ape`, router
    bias, the hash table) dequantized once to float32 (int32 for I32).
    """

    def __init__(self, source: TensorSource, device: torch.device | str = "cpu",
                 keep: Callable[[str], bool] | None = None) -> None:
        """Copy the tensors to `device`; `keep(name)` False skips one (e.g. unused MTP layers)."""
        self.device = torch.device(device)
        self._quant: dict[str, QuantTensor] = {}
        self._small: dict[str, torch.Tensor] = {}
        for name, info in source.tensors.items():
            if is_routed_expert_tensor(name) or (keep is not None and not keep(name)):
                continue
            raw = torch.from_numpy(np.array(source.tensor_bytes(name), dtype=np.uint8).reshape(-1))
            self._quant[name] = QuantTensor(raw.to(self.device), int(info.ggml_type), tuple(int(s) for s in info.shape))

    def __contains__(self, name: str) -> bool:
        return name in self._quant

    def names(self) -> list[str]:
        return list(self._quant)

    def quant(self, name: str) -> QuantTensor:
        try:
            return self._quant[name]
        except KeyError:
            raise KeyError(f"the model file has no tensor {name!r}") from None

    def small(self, name: str) -> torch.Tensor:
        if name not in self._small:
            self._small[name] = self.quant(name).dequantize(torch.float32)
        return self._small[name]


def quant_rows(tensor: QuantTensor, start: int, stop: int) -> QuantTensor:
    """Rows [start, stop) of a 2-D GGUF tensor: a zero-copy byte slice (rows are contiguous)."""
    rows, cols = tensor.shape
    per_row = row_nbytes(tensor.ggml_type, cols)
    return QuantTensor(tensor.raw[start * per_row : stop * per_row], tensor.ggml_type, (stop - start, cols))


def embedding_rows(table: QuantTensor, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """token_embd rows for `token_ids`, dequantizing only those rows."""
    vocab, hidden = table.shape
    per_row = row_nbytes(table.ggml_type, hidden)
    rows = table.raw.view(vocab, per_row)[token_ids.to(table.raw.device)]
    return dequantize(rows.reshape(-1), table.ggml_type, (token_ids.numel(), hidden), dtype)


# ---------------------------------------------------------------------------------------
# Norms


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the numerically sensitive parts (norms, softmaxes, recurrent states):
    float32, or float64 when the model itself runs in float64 (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm in float32 (gains are fp32), cast back to x's dtype once."""
    h = x.to(wide_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.to(wide_dtype(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---------------------------------------------------------------------------------------
# Per-position caches


class GrowingRows:
    """A [n, width] tensor that grows by appending rows (capacity doubles: O(1) amortized)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self._data = torch.empty((0, width), dtype=dtype, device=device)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self._data.shape[0]:
            grown = torch.empty((max(need, 2 * self._data.shape[0], 16), self._data.shape[1]),
                                dtype=self._data.dtype, device=self._data.device)
            grown[: self.n] = self._data[: self.n]
            self._data = grown
        self._data[self.n : need] = rows
        self.n = need

    @property
    def rows(self) -> torch.Tensor:
        return self._data[: self.n]


# ---------------------------------------------------------------------------------------
# The model around the layers


class ModelBase:
    """What every architecture's model does the same way: bind the weights, the expert
    provider and the dtype (a vocab size of 0 is taken from token_embd), and check a
    chunk of token ids before a forward pass."""

    config: Any

    def _bind(self, config: Any, weights: DenseWeights, experts: ExpertProvider | None,
              dtype: torch.dtype) -> None:
        self.weights = weights
        self.experts = experts
        self.device = weights.device
        self.dtype = dtype
        self.token_embd = weights.quant("token_embd.weight")
        if config.vocab_size == 0:
            config = replace(config, vocab_size=self.token_embd.shape[0])
        self.config = config

    def _chunk_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`token_ids` flat on the model's device, each checked to be in the vocabulary.

        Raises RuntimeError without an expert provider, ValueError for an id out of range.
        """
        if self.experts is None:
            raise RuntimeError("the model has no expert provider: set model.experts before running it")
        token_ids = token_ids.reshape(-1).to(self.device)
        vocab = self.config.vocab_size
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        return token_ids


# ---------------------------------------------------------------------------------------
# Routed experts, only through the provider


def next_layer_guess(experts: ExpertProvider, x: torch.Tensor, block: int, k: int,
                     selection_scores: Callable[[], torch.Tensor]) -> Callable[[], None] | None:
    """A speculative prefetch of block `block`'s experts, for `run_routed_experts(after_acquire=...)`.

    Decode only (a chunk of several tokens needs most experts anyway) and only for a
    provider that prefetches. `selection_scores()` is the next layer's router (with its
    selection bias) on THIS layer's MoE input `x`; it is computed now, queued on the GPU
    before this layer's expert ids are read back, so it costs no extra wait. The guess
    is its top `k`, likeliest first: the cache lets only the first few read the SSD.
    Lossless: a guess only moves bytes earlier.
    """
    prefetch = getattr(experts, "prefetch", None)
    if prefetch is None or x.shape[0] != 1:
        return None
    guess = torch.topk(selection_scores(), k, dim=-1, sorted=True).indices
    return lambda: prefetch(block, guess, exact=False)


def run_routed_experts(
    experts: ExpertProvider,
    block: int,
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    mlp: Callable[[ExpertWeights, torch.Tensor], torch.Tensor],
    out_features: int | None = None,
    after_acquire: Callable[[], None] | None = None,
) -> torch.Tensor:
    """sum over k of weights[t, k] * mlp(expert chosen[t, k], x[t]), for every token t.

    x [T, d_in]; chosen, weights [T, k]. The experts of the whole chunk are asked for
    in ONE acquire (unique ids, ascending); each expert runs once on the tokens that
    chose it. A provider with a bounded cache (engine.runtime.ExpertCache) may refuse
    a request larger than its free slots with CacheCapacityError; its `acquire_chunks`
    then delivers the same experts in several batches. Either way the contributions
    are added in ascending expert order, so the result does not depend on delivery
    order or on how the request was split: every provider gives the same bits.

    `after_acquire` runs once this chunk's experts are requested (their reads planned)
    and before any is computed: where a model queues speculative prefetches for its next
    layer, so they wait behind this layer's reads instead of competing with them.
    """
    routed = x.new_zeros((x.shape[0], x.shape[-1] if out_features is None else out_features))
    expert_ids = sorted(set(chosen.flatten().tolist()))

    def contribution(expert: int, weights_of_expert: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
        token_idx, slot = torch.where(chosen == expert)
        y = mlp(weights_of_expert, x[token_idx])
        return token_idx, y * weights[token_idx, slot, None].to(y.dtype)

    # A streaming provider (engine.runtime.ExpertCache) yields experts as they arrive,
    # so resident experts compute while the misses are still being read.
    acquire_streaming = getattr(experts, "acquire_streaming", None)
    streaming = acquire_streaming is not None
    try:
        batch = acquire_streaming(block, expert_ids) if streaming else experts.acquire(block, expert_ids)
    except CacheCapacityError:
        # More distinct experts than the cache can hold at once (a long prefill chunk
        # with a small cache): take them in batches that fit, keep each expert's
        # output, and sum in expert order below, so the result equals one acquire.
        outputs = {}
        if after_acquire is not None:
            after_acquire()
        for part in experts.acquire_chunks(block, expert_ids):
            with part:
                for expert in part.expert_ids:
                    outputs[expert] = contribution(expert, part[expert])
        for expert in expert_ids:
            routed.index_add_(0, *outputs.pop(expert))
    else:
        with batch:
            if after_acquire is not None:
                after_acquire()
            if streaming:
                # Compute each expert as it becomes resident (resident ones first, misses
                # as their copies land), then add in ascending expert order below.
                outputs = {expert: contribution(expert, w) for expert, w in batch}
                for expert in expert_ids:
                    routed.index_add_(0, *outputs.pop(expert))
            else:
                # Ascending expert order: the sum does not depend on delivery order.
                for expert in expert_ids:
                    routed.index_add_(0, *contribution(expert, batch[expert]))
    return routed
