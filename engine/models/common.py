"""Pieces every architecture shares: metadata helpers, dense GGUF weights, RMSNorm
(from `engine.kernels.norm_rope`, one launch per norm on CUDA),
growing per-position caches, and the model base (the routed experts themselves come
through the provider: `engine.experts`).

One way to do each of these things: `deepseek4.py` and `kimi_k3.py` both use them, so
a fix here (or a faster kernel) reaches every model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from engine.experts import ExpertProvider, QuantTensor
from engine.graphs import StepGraphs
from engine.kernels import dequantize, row_nbytes
from engine.kernels.norm_rope import rms_norm, rms_norm_unweighted, wide_dtype  # noqa: F401  (the models' norms)

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


def main_layer_count(get: Callable[..., Any], tensor_names: Sequence[str] | None) -> tuple[int, int]:
    """(block_count, the layers inference runs): trailing `nextn` (MTP) layers are skipped
    when the file holds their tensors (`blk.{block_count - nextn}.nextn.*`), as llama.cpp does."""
    block_count = as_int(get("block_count"))
    nextn = as_int(get("nextn_predict_layers", 0))
    if nextn and tensor_names is not None and any(
            name.startswith(f"blk.{block_count - nextn}.nextn.") for name in tensor_names):
        return block_count, block_count - nextn
    return block_count, block_count


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

    # Read-only (properties), so that a source holding a dict or a dict subclass fits.
    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...  # name -> TensorInfo (ggml_type, shape in numpy order, ...)

    def tensor_bytes(self, name: str) -> np.ndarray: ...


def is_routed_expert_tensor(name: str) -> bool:
    """`blk.N.ffn_{gate,up,down}_exps.weight`: served by the expert provider, not loaded here."""
    return name.startswith("blk.") and name.endswith("_exps.weight")


class DenseWeights:
    """Every non-expert tensor of a GGUF, kept in its GGUF type on one device.

    `matrix(name)` gives a 2-D weight used through `QuantTensor.linear`: dequantized
    once into the compute dtype when `materialize` is set (the loader sets it when the
    dequantized copies fit the memory plan), else kept quantized and dequantized per
    use. `quant(name)` gives the bytes as they are (the embedding table, row slices);
    `small(name)` gives a small tensor (norm gains, sinks, hyper-connection parameters,
    compressor `ape`, router bias, the hash table) dequantized once to float32 (int32
    for I32).
    """

    def __init__(self, source: TensorSource, device: torch.device | str = "cpu",
                 keep: Callable[[str], bool] | None = None, materialize: torch.dtype | None = None) -> None:
        """Copy the tensors to `device`; `keep(name)` False skips one (e.g. unused MTP layers)."""
        self.device = torch.device(device)
        self.materialize = materialize
        self._quant: dict[str, QuantTensor] = {}
        self._small: dict[str, torch.Tensor] = {}
        self._matrix: dict[tuple[str, torch.dtype | None], QuantTensor] = {}
        self._handed_out: set[str] = set()  # matrices given out as they are (kept quantized)
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

    def matrix(self, name: str, dtype: torch.dtype | None = None) -> QuantTensor:
        """A 2-D weight for `linear`: in `dtype` (default: the materialize dtype) once, when
        materializing; else the quantized bytes."""
        dtype = dtype if dtype is not None else self.materialize
        if self.materialize is None or dtype is None:
            self._handed_out.add(name)
            return self.quant(name)
        key = (name, dtype)
        if key not in self._matrix:
            self._matrix[key] = self.quant(name).materialized(dtype)
        return self._matrix[key]

    def projections(self, roles: Mapping[str, str | None]) -> Projections:
        """The matrices that read one input (role -> tensor name; a None or absent name is
        left out), stacked as the row blocks of ONE matrix where they can be: all of them
        when materializing; when kept quantized, those of one GGML type (their bytes
        concatenated: rows are contiguous). A decode step then runs one GEMV per stack
        instead of one per matrix (fewer launches, one long read of the weights instead of
        several short ones). `matrix(name)` gives a view into its stack afterwards: no
        weight is held twice. Take them here before `matrix(name)` is called for any of them."""
        names = {role: name for role, name in roles.items() if name is not None and name in self}
        key = self.materialize
        taken = [name for name in names.values() if (name, key) in self._matrix or name in self._handed_out]
        if taken:  # a holder of the standalone copy would keep it: the weight held twice
            raise RuntimeError(f"{', '.join(taken)} taken before being stacked")
        parts = {role: self.quant(name) if key is None else self.matrix(name) for role, name in names.items()}
        groups: dict[str | tuple[int, int], list[str]] = {}
        for role, part in parts.items():
            group: str | tuple[int, int] = "values" if part.values is not None else (part.ggml_type, part.shape[1])
            groups.setdefault(group, []).append(role)
        stacks = []
        for group, members in groups.items():
            if len(members) < 2:
                continue
            if group == "values":
                values = torch.cat([parts[role].values for role in members])  # type: ignore[misc]
                stack = QuantTensor(values.new_empty(0, dtype=torch.uint8), parts[members[0]].ggml_type,
                                    tuple(values.shape), values)
            else:
                raw = torch.cat([parts[role].raw for role in members])
                stack = QuantTensor(raw, parts[members[0]].ggml_type,
                                    (sum(parts[role].shape[0] for role in members), parts[members[0]].shape[1]))
            start = 0
            for role in members:
                rows = parts[role].shape[0]
                view = stack.rows(start, start + rows)
                if key is not None:  # each weight keeps its own GGML type (a stack may mix them)
                    view = replace(parts[role], values=view.values)
                parts[role] = self._matrix[(names[role], key)] = view
                if key is None:
                    self._quant[names[role]] = parts[role]  # the original bytes go
                start += rows
            stacks.append((stack, tuple(members)))
        return Projections(parts, tuple(stacks))

    def materialized_matrices(self) -> list[QuantTensor]:
        """Every matrix materialized so far (its `values` set), in any dtype."""
        return [m for m in self._matrix.values() if m.values is not None]

    def release_quantized(self) -> None:
        """Let go of the raw bytes of every materialized matrix (after the model took its
        weights): `quant(name)` then gives the materialized tensor (same type and shape)."""
        for (name, dtype), tensor in self._matrix.items():
            if dtype == self.materialize:
                self._quant[name] = tensor

    def small(self, name: str) -> torch.Tensor:
        if name not in self._small:
            self._small[name] = self.quant(name).dequantize(torch.float32)
        return self._small[name]


@dataclasses.dataclass(frozen=True)
class Projections:
    """The weights that read one input, by role (`DenseWeights.projections`): `p(x)` gives
    every role's output, one GEMV per stack (a matrix whose row blocks, in the order of
    its roles, are those roles' weights) and one per weight outside any stack."""

    weights: dict[str, QuantTensor]
    stacks: tuple[tuple[QuantTensor, tuple[str, ...]], ...] = ()

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for stack, roles in self.stacks:
            rows = [self.weights[role].shape[0] for role in roles]
            out.update(zip(roles, stack.linear(x).split(rows, dim=-1)))
        return {role: out[role] if role in out else w.linear(x) for role, w in self.weights.items()}


# A prompt chunk longer than this runs each layer's attention and dense parts in pieces of
# at most this many tokens, and its routed experts once over the whole chunk: a layer's
# experts are then read (from the drive, or from the GPU's memory) once per chunk, while the
# working memory that grows with the chunk is only the residual stream and the MoE's rows.
PROMPT_PIECE = 512


def pieces(n: int, most: int | None = None) -> list[slice]:
    """`n` rows in as few near-equal pieces of at most `most` (default PROMPT_PIECE) as
    can be: [0:n] itself when it fits, and no piece of one row when n > 1 (a one-row
    piece would run as a decode step)."""
    most = PROMPT_PIECE if most is None else most
    count = max(1, -(-n // most))
    size, extra = divmod(n, count)
    out, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out


def embedding_rows(table: QuantTensor, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """token_embd rows for `token_ids`, dequantizing only those rows."""
    vocab, hidden = table.shape
    per_row = row_nbytes(table.ggml_type, hidden)
    rows = table.raw.view(vocab, per_row)[token_ids.to(table.raw.device)]
    return dequantize(rows.reshape(-1), table.ggml_type, (token_ids.numel(), hidden), dtype)


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

    @property
    def capacity(self) -> torch.Tensor:
        """The whole buffer, rows not yet filled included (what the cache really holds)."""
        return self._data


def state_bytes(state: Any) -> dict[str, int]:
    """{"used", "allocated"} bytes of every tensor reachable from a model state
    (dataclasses, lists, dicts, GrowingRows; a storage shared by two views counts once).
    `used`: the rows that hold tokens; `allocated`: what the buffers reserve. The
    memory plan's KV formulas are checked against it (tests, benchmarks/bench_context.py)."""
    seen: set[int] = set()
    used = allocated = 0
    todo = [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, GrowingRows):
            used += obj.rows.nbytes
            buffer = obj.capacity
            if buffer.untyped_storage().data_ptr() not in seen:
                seen.add(buffer.untyped_storage().data_ptr())
                allocated += buffer.nbytes
        elif isinstance(obj, torch.Tensor):
            used += obj.nbytes
            if obj.numel() == 0 or obj.untyped_storage().data_ptr() not in seen:
                seen.add(obj.untyped_storage().data_ptr())
                allocated += obj.nbytes
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif dataclasses.is_dataclass(obj):
            todo.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return {"used": used, "allocated": allocated}


# ---------------------------------------------------------------------------------------
# The model around the layers


class ModelBase:
    """What every architecture's model does the same way: bind the weights, the expert
    provider and the dtypes (a vocab size of 0 is taken from token_embd), and check a
    chunk of token ids before a forward pass.

    Two activation dtypes: `dtype` for prompt chunks (several tokens) and `decode_dtype`
    for one-token decode steps; the conversation state is kept in `decode_dtype`. A
    forward pass computes in `compute` (set by `_begin`): its chunk reads the state cast
    to `compute` and writes it back widened (`kept`), so with bf16 chunks and float32
    decode a chunk runs exactly as in bf16 and every decode step exactly as in float32 on
    that state.
    """

    config: Any
    _graphs: StepGraphs  # the decode step's CUDA graphs (each model makes its own)

    def _bind(self, config: Any, weights: DenseWeights, experts: ExpertProvider | None,
              dtype: torch.dtype, decode_dtype: torch.dtype | None) -> None:
        self.weights = weights
        self.experts = experts
        self.device = weights.device
        self.dtype = dtype
        self.decode_dtype = dtype if decode_dtype is None else decode_dtype
        self.compute = dtype
        self.token_embd = weights.quant("token_embd.weight")
        if config.vocab_size == 0:
            config = replace(config, vocab_size=self.token_embd.shape[0])
        self.config = config

    def _begin(self, tokens: int) -> None:
        """The compute dtype of a forward pass over `tokens` tokens (a decode step: one);
        a decode step also tells the step's graphs (`StepGraphs.step_begins`)."""
        self.compute = self.decode_dtype if tokens == 1 else self.dtype
        if tokens == 1:
            self._graphs.step_begins()

    def joined(self, held: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """State rows `held` followed by a chunk's `new` rows: (in the state's dtype, for what
        the state keeps: rows of decode steps stay as they were; in the chunk's, for what it
        computes with)."""
        kept = torch.cat([held, new.to(held.dtype)], dim=0)
        return kept, kept.to(new.dtype)

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` as the state keeps them: a copy in the state's dtype (never a view that
        would hold a larger buffer alive)."""
        return rows.to(self.decode_dtype, copy=True)

    def _chunk_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`token_ids` flat on the model's device, each checked to be in the vocabulary.

        Raises RuntimeError without an expert provider, ValueError for an id out of range.
        """
        if self.experts is None:
            raise RuntimeError("the model has no expert provider: set model.experts before running it")
        token_ids = token_ids.reshape(-1)
        vocab = self.config.vocab_size
        # Checked where the ids are (the host, as a rule): on the GPU the check is a sync.
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        return token_ids.to(self.device)
