"""Build a runnable model from a GGUF file or an Expert Pack folder.

A model needs two things: its dense weights (read from the GGUF itself, or from the
pack's `dense.gguf`) and an expert provider for its routed experts. With a plain
GGUF the provider is `ResidentExperts` over the file's stacked expert tensors (every
expert in memory: meant for small models and tests); with a pack it is the expert
runtime, `engine.runtime.ExpertCache`, which streams experts from the SSD.
(A pack holds no stacked expert tensors, so ResidentExperts cannot be built from one.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.experts import ExpertProvider, QuantTensor, ResidentExperts
from packer.gguf_source import GGUFSource

from .common import DenseWeights, TensorSource
from .deepseek4 import DeepSeek4Config, DeepSeek4Model
from .kimi_k3 import KimiK3Config, KimiK3Model

PACK_DENSE_FILE = "dense.gguf"
MIB = 1 << 20
UNBOUNDED = 1 << 62  # "as much as fits": the runtime clamps its budgets to free memory

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")

# general.architecture -> (config class, model class)
ARCHITECTURES = {
    "deepseek4": (DeepSeek4Config, DeepSeek4Model),
    "kimi-k3": (KimiK3Config, KimiK3Model),
}


class UnsupportedModelError(ValueError):
    """The file is a model, but of an architecture (or layout) this engine cannot run."""


def open_model_source(path: str | os.PathLike) -> tuple[GGUFSource, Path | None]:
    """Open what `path` names: a GGUF (or any shard of a split set), or an Expert Pack folder.

    Returns the GGUFSource of the dense weights and metadata, and the pack folder
    (None for a plain GGUF).
    """
    path = Path(path)
    if path.is_dir():
        dense = path / PACK_DENSE_FILE
        if not dense.is_file():
            raise FileNotFoundError(
                f"{path} is a folder without {PACK_DENSE_FILE}: it is not an Expert Pack. "
                "Pass a .gguf file, or build a pack first with `expertdesk pack`."
            )
        return GGUFSource.open(dense), path
    return GGUFSource.open(path), None


def resident_experts(source: TensorSource, device: torch.device | str = "cpu",
                     blocks: set[int] | None = None) -> ResidentExperts:
    """A ResidentExperts provider holding every `blk.N.ffn_{gate,up,down}_exps.weight` of
    `source` on `device`, in its GGUF type (roles `gate`, `up`, `down`).

    This copies all routed experts into memory: use it for models that fit, and as
    the reference the streaming runtime must equal.
    """
    device = torch.device(device)
    stacked: dict[int, dict[str, QuantTensor]] = {}
    for name, info in source.tensors.items():
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            continue
        block, role = int(match.group(1)), match.group(2)
        if blocks is not None and block not in blocks:
            continue
        if role == "gate_up":
            raise UnsupportedModelError(
                f"{name}: fused gate/up expert tensors are not supported by this engine; "
                "use a GGUF with separate ffn_gate_exps / ffn_up_exps tensors"
            )
        raw = torch.from_numpy(np.array(source.tensor_bytes(name), dtype=np.uint8).reshape(-1)).to(device)
        stacked.setdefault(block, {})[role] = QuantTensor(raw, int(info.ggml_type), tuple(int(s) for s in info.shape))
    for block, roles in stacked.items():
        missing = {"gate", "up", "down"} - set(roles)
        if missing:
            raise UnsupportedModelError(f"blk.{block} has no ffn_{'/'.join(sorted(missing))}_exps tensor")
    return ResidentExperts(stacked)


def _block_of(name: str) -> int:
    """N of a `blk.N.*` tensor name; -1 for the model-level tensors."""
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def build_model(source: TensorSource, experts: ExpertProvider | None, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Any:
    """The model of `source`'s architecture over its dense weights and the given expert provider.

    `experts` may be None and set later (`model.experts = ...`), before the first forward.
    """
    arch = source.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"general.architecture is {arch!r}; this engine runs {', '.join(sorted(ARCHITECTURES))}"
        )
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls.from_metadata(source.metadata, list(source.tensors))
    weights = DenseWeights(source, device, keep=lambda name: _block_of(name) < config.n_layers)
    return model_cls(config, weights, experts, dtype=dtype)


def pack_expert_provider(pack_dir: Path, device: torch.device | str = "cpu", cache_mib: int | None = None,
                         host_cache_mib: int | None = None, direct_io: bool = True) -> ExpertProvider:
    """The streaming expert runtime over an Expert Pack: ExpertCache over an ExpertStore.

    cache_mib: the device-tier budget (default: all free memory of `device` but the
    runtime's reserve). host_cache_mib: the host-RAM tier (default 0, off). direct_io:
    O_DIRECT reads (the default; the store refuses to start where the filesystem
    cannot do them), False for explicitly buffered reads.
    """
    from engine.runtime import ExpertCache, ExpertStore

    store = ExpertStore(pack_dir, direct_io=direct_io)
    cache_bytes = cache_mib * MIB if cache_mib is not None else UNBOUNDED
    host_bytes = host_cache_mib * MIB if host_cache_mib is not None else 0
    return ExpertCache(store, device=device, cache_bytes=cache_bytes, host_cache_bytes=host_bytes)


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               experts: ExpertProvider | None = None, cache_mib: int | None = None,
               host_cache_mib: int | None = None, direct_io: bool = True) -> Any:
    """Load the model at `path` (a GGUF or an Expert Pack folder) onto `device`.

    `experts` overrides the expert provider. Otherwise a GGUF gets ResidentExperts
    (all experts in memory) and a pack gets the streaming ExpertCache with the
    given VRAM (`cache_mib`) and host RAM (`host_cache_mib`) budgets and I/O mode.
    """
    source, pack_dir = open_model_source(path)
    if experts is None and pack_dir is None:
        experts = resident_experts(source, device)
    model = build_model(source, experts, device, dtype)
    if model.experts is None:
        # The cache is sized from the memory left once the dense weights are in place.
        model.experts = pack_expert_provider(pack_dir, device, cache_mib, host_cache_mib, direct_io)
    return model
