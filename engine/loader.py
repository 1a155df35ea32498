"""Build a runnable model from a GGUF file or an Expert Pack folder: the one place where
an architecture (`engine.models`) meets its expert provider (`engine.experts` or the
expert runtime, `engine.runtime`).

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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from engine.experts import ExpertProvider, QuantTensor, ResidentExperts
from engine.kernels.quant_gemv import reads_in_place
from engine.memory_plan import MemoryPlan, plan_for_loaded
from engine.models import ARCHITECTURES
from engine.models.common import DenseWeights, TensorSource, is_routed_expert_tensor
from engine.models.protocol import Model
from engine.options import RuntimeOptions
from expertpack import PackError, check_pack, config_sha256, verify_hint
from packer.gguf_source import GGUFFormatError, GGUFSource

if TYPE_CHECKING:
    from engine.runtime import ExpertCache

I32_TYPE = 26  # GGML_TYPE_I32: index tables (the hash layers' tid2eid), never a matrix
CPU = RuntimeOptions(device="cpu")  # the library default: the float32 reference on the CPU
UNBOUNDED = 1 << 62  # "as much as fits": the runtime clamps its budgets to free memory

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")

class UnsupportedModelError(ValueError):
    """The file is a model, but of an architecture (or layout) this engine cannot run."""


def open_model_source(path: str | os.PathLike) -> tuple[GGUFSource, Path | None]:
    """Open what `path` names: a GGUF (or any shard of a split set), or an Expert Pack folder.

    Returns the GGUFSource of the dense weights and metadata, and the pack folder
    (None for a plain GGUF). A pack passes the quick load check first
    (`expertpack.check_pack`: manifest, sizes, experts.bin header and layout digest,
    hashes, the dense file's sampled hash; milliseconds for any size) and its dense
    weights are the file the manifest names, whose metadata must match the manifest's
    `config_sha256`. A pack that fails raises PackError naming the pack, the problem
    and `expertdesk verify`.
    """
    path = Path(path)
    if path.is_dir():
        manifest = check_pack(path)
        try:
            source = GGUFSource.open(path / manifest.dense_file)
        except GGUFFormatError as exc:
            raise PackError(path, f"{manifest.dense_file} is not a readable GGUF ({exc.problem})",
                            verify_hint(path)) from None
        if config_sha256(source.metadata) != manifest.config_sha256:
            source.close()
            raise PackError(path, f"{manifest.dense_file}'s metadata does not match config_sha256 in the "
                            "manifest (the dense weights belong to another model or build)", verify_hint(path))
        return source, path
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


def _dense_dtype(source: TensorSource, device: torch.device, dtype: torch.dtype,
                 keep: Callable[[str], bool]) -> torch.dtype | None:
    """The dtype the dense matrices are dequantized into once at load, or None to keep
    them as the file has them.

    On a GPU where the quantized GEMV reads every dense matrix's type in place
    (`engine.kernels.quant_gemv.reads_in_place`), they stay quantized: a decode step
    reads their GGUF bytes (half of bf16's for Q8_0, a sixth for Q2_K), computes with
    the file's exact values, and the VRAM saved goes to the expert cache; a prefill
    chunk dequantizes them per use. Otherwise they are dequantized once where the copies
    fit the memory plan (at most half the free VRAM, or a quarter of the available RAM
    on the CPU), else kept quantized and dequantized per use."""
    matrices, types = 0, set()
    for name, info in source.tensors.items():
        if (is_routed_expert_tensor(name) or not keep(name) or name == "token_embd.weight"
                or len(info.shape) != 2 or int(info.ggml_type) == I32_TYPE):
            continue
        matrices += int(np.prod(info.shape))
        types.add(int(info.ggml_type))
    if device.type == "cuda" and reads_in_place(device, types):
        return None
    need = matrices * torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] // 2
    else:
        free = psutil.virtual_memory().available // 4
    return dtype if need <= free else None


def build_model(source: TensorSource, experts: ExpertProvider | None, options: RuntimeOptions = CPU) -> Model:
    """The model of `source`'s architecture over its dense weights and the given expert provider.

    `experts` may be None and set later (`model.experts = ...`), before the first forward.
    """
    arch = source.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"general.architecture is {arch!r}; this engine runs {', '.join(sorted(ARCHITECTURES))}"
        )
    device = options.resolved_device()
    dtype = options.resolved_dtype(device)
    decode_dtype = options.resolved_decode_dtype(device)
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls.from_metadata(source.metadata, list(source.tensors))

    def keep(name: str) -> bool:
        return _block_of(name) < config.n_layers

    # Dequantized copies (where kept at all) in the wider of the two dtypes: a float32
    # decode step reads exact values; a bf16 prompt chunk rounds them per use.
    wider = torch.promote_types(dtype, decode_dtype)
    weights = DenseWeights(source, device, keep=keep, materialize=_dense_dtype(source, device, wider, keep))
    model = model_cls(config, weights, experts, dtype=dtype, decode_dtype=decode_dtype)
    weights.release_quantized()
    return model


PACK_SWITCH_INTERVAL_S = 0.0005


def pack_expert_provider(pack_dir: Path, options: RuntimeOptions = CPU,
                         plan: MemoryPlan | None = None) -> ExpertCache:
    """The streaming expert runtime over an Expert Pack: ExpertCache over an ExpertStore,
    with the options' device, budgets (cache_mib: the device tier; host_cache_mib: the
    host-RAM tier, default off; where cache_mib is None, `plan` (engine.memory_plan) sizes
    the device tier, and the host tier unless host_cache_mib is given; with neither,
    all free device memory but the runtime's reserve), I/O mode (O_DIRECT unless
    direct_io is False; the store refuses to start where the filesystem cannot do it),
    read verification (verify_reads: every block read is hashed against the pack) and
    guess reads."""
    from engine.runtime import ExpertCache, ExpertStore

    # The decode thread and the store's I/O threads hand the GIL back and forth hundreds
    # of times a token (every read's completion, every copy); at Python's default 5 ms
    # switch interval the decode thread waits up to that long each time it wants it back.
    # 0.5 ms decoded 6% faster through a pack at an emulated 12.5 GB/s (RESULTS.md).
    sys.setswitchinterval(min(sys.getswitchinterval(), PACK_SWITCH_INTERVAL_S))
    store = ExpertStore(pack_dir, direct_io=options.direct_io is not False, verify=options.verify_reads,
                        read_splits=options.read_splits,
                        rate_limit_bytes_per_s=None if options.read_rate_limit_gbps is None
                        else options.read_rate_limit_gbps * 1e9, rate_limit_shared=options.read_rate_shared)
    cache_bytes = options.cache_bytes if options.cache_bytes is not None else UNBOUNDED
    host_bytes, reserve = options.host_cache_bytes, {}
    if plan is not None and options.cache_bytes is None:  # the memory plan sizes the tiers
        cache_bytes, reserve = plan.expert_cache_bytes, {"reserve_bytes": plan.reserve_bytes}
        host_bytes = host_bytes if options.host_cache_mib is not None else plan.host_cache_bytes
    return ExpertCache(store, device=options.resolved_device(), cache_bytes=cache_bytes, host_cache_bytes=host_bytes,
                       speculative_reads=options.speculative_reads,
                       **reserve)  # type: ignore[arg-type]  # one int keyword; mypy checks ** against every parameter


def open_model(path: str | os.PathLike, options: RuntimeOptions = CPU, *,
               experts: ExpertProvider | None = None,
               buffered_fallback: Callable[[], None] | None = None) -> tuple[Model, GGUFSource]:
    """`load_model`, also returning the GGUFSource of the dense weights and metadata
    (the tokenizer and the chat template are read from it).

    `buffered_fallback`: where the pack's filesystem cannot do O_DIRECT and
    `options.direct_io` is None ("the runtime decides"), call it (to say so) and read the
    pack through the page cache instead of refusing; the service does this for the demo.
    """
    from engine.runtime.errors import DirectIOUnsupportedError

    source, pack_dir = open_model_source(path)
    if experts is None and pack_dir is None:
        experts = resident_experts(source, options.resolved_device())
    model = build_model(source, experts, options)
    if model.experts is None:
        assert pack_dir is not None  # a GGUF got resident experts above (or `experts` was given)
        # The cache is sized from the memory left once the dense weights are in place: by the
        # memory plan (KV state, activations and a margin first) unless cache_mib is given.
        plan = None
        if options.cache_mib is None:
            manifest = check_pack(pack_dir)
            plan = plan_for_loaded(model, manifest.expert_stride, manifest.expert_used_count,
                                   manifest.num_layers * manifest.num_experts, options.resolved_device())
            model.memory_plan = plan  # type: ignore[attr-defined]  # engine.memory_plan.fit_context reads it
        planned = () if plan is None else (plan,)  # (a two-argument call without a plan)
        try:
            model.experts = pack_expert_provider(pack_dir, options, *planned)
        except DirectIOUnsupportedError:
            if buffered_fallback is None or options.direct_io is not None:
                raise
            buffered_fallback()
            model.experts = pack_expert_provider(pack_dir, options.with_(direct_io=False), *planned)
    if options.trace_file is not None:  # `--trace FILE`: record the routing, written at close
        from engine.runtime.trace import RoutingRecorder

        meta = {"source": "recorded", "architecture": source.metadata.get("general.architecture"),
                "model": source.metadata.get("general.name"), "moe_layers": model.config.n_layers}
        RoutingRecorder(save_on_close=options.trace_file, meta=meta).install(model.experts)
    return model, source


def load_model(path: str | os.PathLike, options: RuntimeOptions = CPU, *,
               experts: ExpertProvider | None = None) -> Model:
    """Load the model at `path` (a GGUF or an Expert Pack folder) as `options` say.

    The library default is the CPU in float32 (the reference); the CLI and the GUI
    pass their own options (device "auto"). `experts` overrides the expert provider.
    Otherwise a GGUF gets ResidentExperts (all experts in memory) and a pack gets the
    streaming ExpertCache with the options' budgets and I/O mode.
    """
    return open_model(path, options, experts=experts)[0]
