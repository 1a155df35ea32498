"""What every model exposes to the engine service, the CLI and the benchmarks.

Both architectures (`deepseek4.DeepSeek4Model`, `kimi_k3.KimiK3Model`) implement this
one small surface, so nothing above `engine.models` holds a per-model special case:

- load: `engine.loader.load_model(path, options)` (or `build_model`);
- reset: `new_state()` gives an empty per-conversation state (no tokens seen);
- prefill and decode: `forward(token_ids, state)` runs a chunk of T tokens after those
  in `state` (a prompt chunk, or one token for a decode step) and returns float32
  logits [T, vocab] (`only_last`: the last token's, all a prompt chunk needs); a forward
  over one token is a decode step whoever calls it (it computes in `decode_dtype`, a
  longer chunk in `dtype`);
- config: `config` (`ModelConfig`), `device`, `dtype`, `decode_dtype` (also the state's)
  and the expert provider `experts`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.experts import ExpertProvider

# Called after each layer of an eager forward pass (every prompt chunk; a decode step on the
# fixed-shape state does not call it) with (layers done, layers): the service's prefill
# progress and cancel. An exception it raises stops the pass and leaves the state partly
# advanced (some layers have seen the chunk): drop that state.
LayerHook = Callable[[int, int], None]


class ModelConfigError(ValueError):
    """The GGUF does not describe a model of its architecture that this engine can run
    (missing or inconsistent metadata, missing tensors, wrong shapes)."""


class ModelConfig(Protocol):
    """The part of an architecture's config that the engine reads."""

    vocab_size: int
    n_layers: int
    hidden_size: int
    n_experts: int
    n_experts_used: int


class Model(Protocol):
    config: Any  # the architecture's config dataclass; satisfies ModelConfig
    experts: ExpertProvider | None
    device: torch.device
    dtype: torch.dtype
    decode_dtype: torch.dtype

    def new_state(self) -> Any:
        """An empty state: no tokens seen (reset)."""
        ...

    def forward(self, token_ids: torch.Tensor, state: Any, *, only_last: bool = False,
                on_layer: LayerHook | None = None) -> torch.Tensor:
        """Run `token_ids` [T] after the tokens in `state` (updated in place); float32 logits
        [T, vocab], or [1, vocab] for the last token with `only_last` (prompt chunks).
        `on_layer(done, layers)` after each layer of a chunk (`LayerHook`)."""
        ...
