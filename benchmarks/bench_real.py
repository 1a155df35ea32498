"""Speed at real size: the product's loader and models on real-geometry GGUFs.

For one model geometry (a GGUF written by `benchmarks/real_geometry.py`: the real
model's metadata, vocabulary, tensor names, shapes and quant types, random weights,
N of its layers), this runs `engine.loader.load_model` exactly as the app does and
measures, in one run:

- resident (every expert in VRAM): load time, prefill tok/s at 512 and 4,096 tokens,
  decode ms/token and ms/layer (median, p90) at that context, kernels and host syncs
  per token and the GPU busy share (torch.profiler over a few decode steps), peak
  VRAM, and the HBM-bytes bound of a decode step (the bytes it must touch / HBM
  bandwidth);
- through an Expert Pack built by the product's packer, served from RAM (tmpfs: the
  machine's own disk is no PC drive) through the real ExpertStore with its read rate
  capped to emulate a PCIe 4 (7 GB/s) and a PCIe 5 (12.5 GB/s) drive, with budgets
  like the reference PC's scaled to the layers present: hit rate, SSD GB/token, drive
  busy share, decode ms/token against the bound max(drive time, compute time), the
  prompt before the decode (`--pack-context` tokens from an empty cache) against the
  drive's time for its reads, and the seed's profile (plain acquires, no prefetch, no
  RAM tier) on the same input.

`--dense gguf,bf16` measures one resident row per way of holding the dense weights:
kept in their GGUF types (the GPU default: decode reads them through
engine.kernels.quant_gemv) and dequantized once at load to the compute dtype (bf16 on a
GPU; the row is labelled bf16). `--dtype bfloat16,float32` likewise measures one resident
row per activation dtype, in the same run on the same file; an entry PREFILL/DECODE
(`bfloat16/float32`: bf16 prompt chunks, float32 decode steps and state, the engine's
`--decode-dtype`) measures that mixed mode.

    python3 benchmarks/bench_real.py --model deepseek-v4-flash --layers 8 --work /dev/shm/edbench

Prints a table and writes benchmarks/results/real-<model>-<host>-<stamp>.json (machine,
command, date). Emulation is stated in the JSON (`drive: emulated ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_timing import copy_gbps, pcie_gbps  # noqa: E402
from benchmarks.host_sampler import StackSampler, print_table  # noqa: E402
from benchmarks.pack_timeline import PackTimeline  # noqa: E402
from benchmarks.pack_timeline import print_summary as print_timeline  # noqa: E402
from engine.loader import load_model, open_model_source  # noqa: E402
from engine.memory_plan import prompt_chunk  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402

GIB = 1 << 30
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the copy this machine measured is in the JSON
# The reference PC (the seed's): VRAM expert cache and host-RAM tier for the whole model.
SEED_PC = {"deepseek-v4-flash": {"layers": 43, "cache_gib": 21, "host_gib": 16},
           "kimi-k3": {"layers": 93, "cache_gib": 5, "host_gib": 16}}


DEVICE = "cuda"  # --device; "cpu" is the smoke mode the tests run at small scale
PROFILE_PREFILL = False  # --profile-prefill
PROMPT_CHUNK: int | None = None  # --prompt-chunk (None: the service's choice)
RESIDENT_VARIANTS: list[str] = []  # --resident-variants


def sync() -> None:
    if DEVICE != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def machine() -> dict:
    info = {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "device": DEVICE}
    if DEVICE != "cpu":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return info


def d2d_copy_gbps() -> float | None:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling we reach)."""
    return None if DEVICE == "cpu" else copy_gbps(2 * GIB)


def chunk_of(model) -> int:
    """Prompt tokens per forward pass: --prompt-chunk, else the service's choice."""
    return PROMPT_CHUNK or prompt_chunk(model)


def prefill(model, n: int, seed: int = 0) -> tuple[object, float, int]:
    """A fresh state with `n` random prompt tokens (in `chunk_of` chunks, as the service feeds
    a prompt); returns (state, tok/s, last token)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (n,), generator=g)
    state = model.new_state()
    chunk = chunk_of(model)
    sync()
    t = time.perf_counter()
    logits = None
    for i in range(0, n, chunk):
        logits = model.forward(tokens[i:i + chunk], state, only_last=True)
    sync()
    return state, n / (time.perf_counter() - t), int(torch.argmax(logits[-1]))


def decode(model, state, token: int, steps: int) -> list[float]:
    """Greedy decode steps, each timed to the device's completion (ms)."""
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        logits = model.forward(torch.tensor([token]), state)
        token = int(torch.argmax(logits[-1]))  # the sampler's own sync
        times.append((time.perf_counter() - t) * 1e3)
    return times


def profile_decode(model, state, token: int, steps: int = 3) -> dict:
    """Kernels, host syncs and GPU busy time per decode step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    decode(model, state, token, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE != "cpu" else [])
    with profile(activities=activities) as prof:
        sync()
        t = time.perf_counter()
        decode(model, state, token, steps)
        wall = time.perf_counter() - t
    tally = _tally(prof)
    return {"kernels_per_token": tally.kernels / steps, "host_syncs_per_token": tally.syncs / steps,
            "gpu_busy_share": tally.busy_us / 1e6 / wall, "gpu_busy_ms_per_token": tally.busy_us / 1e3 / steps,
            "top_kernels_ms_per_token": {name[:80]: round(us / 1e3 / steps, 3) for name, us in tally.top_kernels(8)},
            "wall_ms_per_token": wall * 1e3 / steps,
            # Host ops by self time (all threads), with calls per token: what the host spends a step on.
            "top_host_ops_per_token": {name[:60]: [round(us / 1e3 / steps, 3), round(calls / steps, 1)]
                                       for name, (us, calls) in tally.top_host(14)}}


@dataclass
class _Tally:
    """A torch.profiler trace summed: CUDA kernels (count, busy time, time by name), host
    syncs, and host ops by self CPU time (all threads) with their calls."""

    kernels: int = 0
    busy_us: float = 0.0
    syncs: int = 0
    kernel_us: dict[str, float] = field(default_factory=dict)
    host: dict[str, list[float]] = field(default_factory=dict)  # op -> [self CPU us, calls]

    def top_kernels(self, n: int) -> list[tuple[str, float]]:
        return sorted(self.kernel_us.items(), key=lambda kv: -kv[1])[:n]

    def top_host(self, n: int) -> list[tuple[str, list[float]]]:
        return sorted(self.host.items(), key=lambda kv: -kv[1][0])[:n]


def _tally(prof) -> _Tally:
    t = _Tally()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t.kernels += 1
            t.busy_us += e.time_range.elapsed_us()
            t.kernel_us[e.name] = t.kernel_us.get(e.name, 0.0) + e.time_range.elapsed_us()
            continue
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                      "aten::_local_scalar_dense"):
            t.syncs += 1
        entry = t.host.setdefault(e.name, [0.0, 0])
        entry[0] += e.self_cpu_time_total
        entry[1] += 1
    return t


def profile_prefill(model, n: int = 512) -> dict:
    """Where an n-token prompt's time goes (one forward pass: n tokens in one chunk): GPU busy
    share, kernels, the top kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    state, _, _ = prefill(model, n, seed=4)  # warm
    del state
    tokens = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE != "cpu" else [])
    state = model.new_state()
    if DEVICE != "cpu":
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if DEVICE != "cpu" else 0
    with profile(activities=activities) as prof:
        sync()
        t = time.perf_counter()
        model.forward(tokens, state, only_last=True)
        sync()
        wall = time.perf_counter() - t
    # what the pass needed beyond what was held before it: activations, logits, the new state
    extra = (torch.cuda.max_memory_allocated() - held) / GIB if DEVICE != "cpu" else None
    tally = _tally(prof)
    return {"prefill_profile_tokens": n, "prefill_profile_wall_ms": wall * 1e3, "prefill_kernels": tally.kernels,
            "prefill_gpu_busy_share": tally.busy_us / 1e6 / wall, "prefill_peak_extra_gib": extra,
            "prefill_host_syncs": tally.syncs,
            "prefill_top_kernels_ms": {name[:80]: round(us / 1e3, 2) for name, us in tally.top_kernels(10)},
            "prefill_top_host_ops_ms": {name[:60]: [round(us / 1e3, 2), int(calls)]
                                        for name, (us, calls) in tally.top_host(14)}}


def step_bytes(model) -> dict:
    """The bytes one decode step must read: every dense weight once (as stored now), the
    top-k experts of every MoE layer (quantized), the embedding row."""
    dense = 0
    for name in model.weights.names():
        if name == "token_embd.weight":
            continue
        t = model.weights.quant(name)
        dense += t.values.numel() * t.values.element_size() if t.values is not None else t.raw.numel()
    expert = 0
    stacked = getattr(model.experts, "_stacked", None)
    if stacked:
        for roles in stacked.values():
            expert += sum(t.raw.numel() // t.shape[0] for t in roles.values()) * model.config.n_experts_used
    return {"dense_bytes": dense, "expert_bytes": expert, "bound_ms": (dense + expert) / HBM_BYTES_PER_S * 1e3}


def summary(times: list[float], n_layers: int) -> dict:
    times = sorted(times)
    med = statistics.median(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return {"ms_per_token_median": med, "ms_per_token_p90": p90, "ms_per_token_mean": statistics.fmean(times),
            "ms_per_layer_median": med / n_layers, "ms_per_layer_p90": p90 / n_layers, "tok_per_s": 1e3 / med}


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if DEVICE != "cpu" else None


def dtype_label(dtype: torch.dtype, decode_dtype: torch.dtype) -> str:
    """"bfloat16", or "bfloat16/float32" for bf16 chunks with float32 decode steps."""
    names = [str(d).removeprefix("torch.") for d in (dtype, decode_dtype)]
    return names[0] if dtype == decode_dtype else "/".join(names)


def run_resident(gguf: Path, dtype: torch.dtype, decode_dtype: torch.dtype, context: int, steps: int) -> dict:
    if DEVICE != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = load_model(gguf, RuntimeOptions(device=DEVICE, dtype=dtype, decode_dtype=decode_dtype))
    sync()
    load_s = time.perf_counter() - t
    n_layers = model.config.n_layers
    prefill(model, 512, seed=0)  # compiles the Triton kernels and warms the allocator: not timed
    # one 512-token chunk lasts ~0.1-0.2 s: the median of three (a single one varied 2x between rows)
    pp512 = statistics.median(prefill(model, 512, seed=seed)[1] for seed in (1, 3, 5))
    state, pp_ctx, token = prefill(model, context, seed=2)
    warm = decode(model, state, token, 2)  # the first step captures the decode graph
    times = decode(model, state, token, steps)
    row = {"mode": "resident", "dtype": dtype_label(dtype, decode_dtype), "load_s": load_s,
           "prefill_512_tok_s": pp512, f"prefill_{context}_tok_s": pp_ctx, "context": context,
           "prompt_chunk": chunk_of(model),
           **summary(times, n_layers), **profile_decode(model, state, token),
           "graph_captures": getattr(getattr(model, "_graphs", None), "captures", None),
           "first_steps_ms": warm,
           "peak_vram_gib": peak_memory_gib(), **step_bytes(model), "layers": n_layers}
    row["of_hbm_bound"] = row["bound_ms"] / row["ms_per_token_median"]
    row["kernels_per_layer"] = row["kernels_per_token"] / n_layers
    row["variants"] = [resident_variant(model, state, token, steps, v) for v in RESIDENT_VARIANTS if v]
    del state
    if PROFILE_PREFILL:
        row.update(profile_prefill(model))
        row["prefill_profile_context"] = profile_prefill(model, context)
    del model
    empty_cache()
    return row


# The environment switches each kernel variant turns off (see the kernel modules).
VARIANT_SWITCHES = {
    "fused": ("EXPERTDESK_FUSED_MOE",),
    "rowops": ("EXPERTDESK_NORM_ROPE_TRITON", "EXPERTDESK_HC_TRITON", "EXPERTDESK_ROUTE_TRITON"),
    "attention": ("EXPERTDESK_ATTENTION_TRITON", "EXPERTDESK_COMPRESSOR_TRITON", "EXPERTDESK_INDEXER_TRITON"),
    "quant-experts": ("EXPERTDESK_FUSED_MOE_QUANT",),
    "x16": ("EXPERTDESK_X16",),
    "kda": ("EXPERTDESK_KDA_TRITON", "EXPERTDESK_ATTN_RES_TRITON", "EXPERTDESK_ACT_TRITON"),
}


@contextlib.contextmanager
def dense_policy(dense: str, dtype: torch.dtype):
    """The loader's choice for the dense weights (auto), or one forced: kept in their GGUF
    types (gguf) or dequantized to `dtype` once at load (bf16)."""
    import engine.loader

    if dense not in ("auto", "gguf", "bf16"):
        raise ValueError(f"unknown --dense {dense!r}: auto, gguf or bf16")
    saved = engine.loader._dense_dtype
    if dense != "auto":
        engine.loader._dense_dtype = lambda *args: None if dense == "gguf" else dtype
    try:
        yield
    finally:
        engine.loader._dense_dtype = saved


def resident_variant(model, state, token: int, steps: int, variant: str) -> dict:
    """The same model and state, decoding with one lever off, for an A/B in one run:
    "static" (the fixed-shape state and whole-step graph: attention eager again), "fused"
    (the fused MXFP4 expert kernels: gather + dequantize + bmm again), "rowops" (the
    one-launch RMSNorm/rope, hyper-connection and router kernels: torch's ops again) or
    "attention" (the decode-attention, compressor-step and indexer-score kernels) or
    "quant-experts" (the fused Q8_0 / K-quant expert kernels) or "x16" (x as 16-bit integers
    in the quantized GEMV and expert kernels: float32 math on x again)."""
    if variant != "static" and variant not in VARIANT_SWITCHES:
        raise ValueError(f"unknown resident variant {variant!r}")
    switches = VARIANT_SWITCHES.get(variant, ())
    saved_env = {name: os.environ.get(name) for name in switches}
    if variant == "static":
        model.static_decode = False
    for name in switches:
        os.environ[name] = "0"
    graphs = getattr(model, "_graphs", None)
    if graphs is not None:
        graphs.reset()  # a captured step keeps the kernels it was captured with
    try:
        decode(model, state, token, 4)  # captures, if any
        times = decode(model, state, token, steps)
        out = {"variant": f"-{variant}", **summary(times, model.config.n_layers),
               **profile_decode(model, state, token)}
    finally:
        model.static_decode = None
        if graphs is not None:
            graphs.reset()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    print(f"resident {out['variant']}: {out['ms_per_token_median']:.2f} ms/token", flush=True)
    return out


def apply_kernel_configs(paths: list[Path]) -> dict:
    """Set the kernels' configurations to the best of sweep result files (bench_quant_gemv.py's
    "x16_best", bench_moe_quant.py's "best_by_kernel"): a tuning measured and used in one run.
    Returns what it set, for the result file."""
    from gguf.constants import GGMLQuantizationType

    from engine.kernels import moe_quant, quant_gemv

    applied: dict = {}
    for path in paths:
        if not path.is_file():
            print(f"--kernel-configs: no {path}; the defaults stay", flush=True)
            continue
        found = json.loads(path.read_text())
        tables = (("configs", quant_gemv.X16_CONFIGS), ("many_rows_configs", quant_gemv.X16_MANY_ROWS_CONFIGS))
        for cls, table in tables:
            for name, cfg in found.get("x16_best", {}).get(cls, {}).items():
                table[int(GGMLQuantizationType[name])] = tuple(cfg)
                applied.setdefault("x16_" + cls, {})[name] = cfg
        settings = found.get("settings", {})
        for kernel, cfg in found.get("best_by_kernel", {}).items():
            name = settings.get("gate_type" if kernel == "gate_up" else "down_type")
            if name:
                moe_quant.KERNEL_CONFIGS[kernel][int(GGMLQuantizationType[name])] = tuple(cfg)
                applied.setdefault("moe_quant", {})[f"{kernel} {name}"] = cfg
    if applied:
        print(f"kernel configs from the sweeps: {applied}", flush=True)
    return applied


def empty_cache() -> None:
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def run_precision(gguf: Path, n: int = 256) -> dict:
    """bf16 against float32 on the same n tokens (one prefill chunk, then decode steps):
    per-position relative L2 of the logits and top-1 agreement."""
    logits = {}
    tokens = None
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(gguf, RuntimeOptions(device=DEVICE, dtype=dtype))
        if tokens is None:
            tokens = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
        state = model.new_state()
        half = n // 2
        out = [model.forward(tokens[:half], state)]
        out += [model.forward(tokens[i:i + 1], state) for i in range(half, n)]
        logits[dtype] = torch.cat(out).double().cpu()
        del model, state
        empty_cache()
    ref, low = logits[torch.float32], logits[torch.bfloat16]
    rel = (low - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"mode": "precision", "tokens": n, "bf16_vs_f32_rel_l2_mean": float(rel.mean()),
            "bf16_vs_f32_rel_l2_max": float(rel.max()),
            "top1_agreement": float((low.argmax(-1) == ref.argmax(-1)).double().mean())}


def build_pack(gguf: Path, work: Path) -> Path:
    from packer.builder import build_pack as pack

    out = work / (gguf.stem + ".expertpack")
    if (out / "manifest.json").is_file():
        return out
    t = time.perf_counter()
    path = pack(gguf, out, direct_io="auto")
    print(f"packed {gguf.name} in {time.perf_counter() - t:.1f} s", flush=True)
    return path


def store_probe(pack: Path, io_threads: int, read_splits: int, in_flight: int, reads: int = 96) -> dict:
    """The pack's raw read rate through the product's ExpertStore, no rate cap: `reads`
    expert blocks, `in_flight` at a time, each as `read_splits` sub-reads on `io_threads`
    threads. Emulating a drive faster than this is impossible: the cap only slows reads."""
    from engine.runtime.store import ExpertStore

    with ExpertStore(pack, io_threads=io_threads, read_splits=read_splits, stage_slots=in_flight) as store:
        layers = len(store.manifest.layers)
        n_experts = store.manifest.num_experts
        buffers = [store.staging.view(i) for i in range(in_flight)]
        t = time.perf_counter()
        total = 0
        for start in range(0, reads, in_flight):
            handles = [store.submit((start + i) % layers, (start + i) * 7 % n_experts, buffers[i])
                       for i in range(min(in_flight, reads - start))]
            for h in handles:
                total += h.result().numel()
        wall = time.perf_counter() - t
    return {"io_threads": io_threads, "read_splits": read_splits, "in_flight": in_flight, "reads": reads,
            "bytes": total, "gb_per_s": total / wall / 1e9}


def emulation_splits(gbps: float, one_thread_gbps: float) -> int:
    """Sub-reads per expert for an emulated drive of `gbps`: the RAM-backed drive copies each
    read on one reader thread (`one_thread_gbps`, measured by `store_probe`), so one expert
    read alone reaches the drive's rate only when split; 1.2x headroom, at most 8. The
    product reads an expert in one piece (an NVMe drive serves one large read at full
    speed), and every sub-read is Python on a reader thread that the decode thread competes
    with for the GIL: more sub-reads than needed would charge the emulation's cost to the
    runtime."""
    return max(1, min(8, math.ceil(1.2 * gbps / one_thread_gbps)))


# (I/O threads, sub-reads per expert, experts in flight) of `--probe`.
PROBES = ((1, 1, 1), (16, 1, 1), (16, 8, 1), (16, 1, 16), (16, 8, 16))


def run_pack(pack: Path, model_name: str, dtype: torch.dtype, decode_dtype: torch.dtype, gbps: float, steps: int,
             seed_profile: bool,
             context: int, direct_io: bool | None, budgets: tuple[int | None, int | None] = (None, None),
             sample: bool = False, variant: str = "", read_splits: int = 1, timeline: bool = False,
             shared_drive: bool = False) -> dict:
    """Decode through the pack; budgets (cache MiB, host MiB) default to the seed PC's, scaled.
    `sample`: a host stack sampler (host_sampler.py) over the timed steps. `variant`: a
    comma-separated list of runtime switches to turn off for an A/B row (the cache's "grouped",
    "graphed", ..., the store's "later_after_urgent"; "static":
    the model's fixed-shape decode state and its graphs; "staged": the step's token and
    position copied into every graph's inputs, not read in place), or
    "si=S" for Python's thread switch interval (sys.setswitchinterval) during the row
    (the loader sets 0.5 ms), "rs=N" for N sub-reads per expert, "spec=MODE" for when
    guesses may read (idle, tail, ram), "sr=N" for how many of a guess's experts may.
    `read_splits`: sub-reads per expert (RuntimeOptions.read_splits): the RAM-backed
    drive copies one read on one thread, slower than the drive it emulates. `shared_drive`:
    the emulated drive shares its rate among the reads in flight instead of serving them
    first come, first served (ReadRateLimiter)."""
    pc = SEED_PC[model_name]
    source, _ = open_model_source(pack)
    n_layers = int(source.metadata.get(f"{source.metadata['general.architecture']}.block_count"))
    scale = n_layers / pc["layers"]
    cache_mib = budgets[0] if budgets[0] is not None else int(pc["cache_gib"] * 1024 * scale)
    host_mib = 0 if seed_profile else budgets[1] if budgets[1] is not None else int(pc["host_gib"] * 1024 * scale)
    options = RuntimeOptions(device=DEVICE, dtype=dtype, decode_dtype=decode_dtype, cache_mib=max(1, cache_mib),
                             host_cache_mib=host_mib,
                             direct_io=direct_io, read_rate_limit_gbps=gbps, read_rate_shared=shared_drive,
                             read_splits=read_splits)
    read_splits = next((int(v[3:]) for v in variant.split(",") if v.startswith("rs=")), read_splits)
    model = load_model(pack, options.with_(read_splits=read_splits))
    cache = model.experts
    if seed_profile:
        cache.streaming = cache.prefetching = cache.grouped = False
    interval = sys.getswitchinterval()
    for switch in filter(None, variant.split(",")):
        if switch.startswith("si="):
            sys.setswitchinterval(float(switch[3:]))
        elif switch == "static":  # decode steps eager, without the fixed-shape state's graphs
            model.static_decode = False
        elif switch == "staged":  # each graph copies the step's token and position into its own inputs
            model._graphs.stage_inputs = False
        elif switch.startswith("spec="):  # when guesses may read: idle, tail or ram
            cache.speculative = switch[5:]
        elif switch.startswith("sr="):  # how many of a guess's likeliest experts may read
            cache.speculative_reads = int(switch[3:])
        elif not switch.startswith("rs="):  # a lever of the cache, else of its store ("later_after_urgent")
            owner = next((o for o in (cache, cache.store) if hasattr(o, switch)), None)
            if owner is None:
                raise SystemExit(f"--variants: no switch {switch!r} on the cache or its store")
            setattr(owner, switch, False)
    read_before = cache.telemetry.snapshot().get("pack_read_bytes", 0)
    state, prefill_tok_s, token = prefill(model, context, seed=2)  # the cache starts empty: a cold prompt
    prefill_read = cache.telemetry.snapshot().get("pack_read_bytes", 0) - read_before
    warm = decode(model, state, token, 8)  # the cache settles into decode's working set
    before = cache.telemetry.snapshot()
    sampler = StackSampler() if sample else None
    if sampler is not None:
        sampler.start()
    t = time.perf_counter()
    times = decode(model, state, token, steps)
    wall = time.perf_counter() - t
    if sampler is not None:
        sampler.stop()
    after = cache.telemetry.snapshot()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after.get(k), (int, float))}
    hits, misses = delta.get("cache_hits", 0), delta.get("cache_misses", 0)
    read = delta.get("pack_read_bytes", 0)
    drive_s = read / (gbps * 1e9)
    mode = "pack-seed" if seed_profile else "pack" + (f" -{variant}" if variant else "")
    sharing = "shared" if shared_drive else "in order"  # how the rate is divided among reads in flight
    row = {"mode": mode, "drive": f"emulated {gbps} GB/s (tmpfs + rate cap, {sharing})", "read_splits": read_splits,
           "cache_mib": cache_mib, "host_cache_mib": host_mib, **summary(times, n_layers),
           "hit_rate": hits / max(1, hits + misses), "ssd_gb_per_token": read / 1e9 / steps,
           "drive_busy_share": delta.get("drive_busy_seconds", 0.0) / wall,
           "drive_ms_per_token": drive_s * 1e3 / steps, "warm_ms": statistics.median(warm),
           "read_ms_per_token": delta.get("read_seconds", 0.0) * 1e3 / steps,
           "h2d_gb_per_token": delta.get("h2d_bytes", 0) / 1e9 / steps,
           "d2h_gb_per_token": delta.get("d2h_bytes", 0) / 1e9 / steps,
           # the prompt before the timed steps (`context` tokens, `prompt_chunk` a pass) against the
           # drive's time for its reads
           "prefill_tokens": context, "prompt_chunk": chunk_of(model), "prefill_tok_s": prefill_tok_s,
           "prefill_ssd_gb": prefill_read / 1e9,
           "prefill_drive_ms": prefill_read / (gbps * 1e9) * 1e3,
           "prefill_of_drive": prefill_read / (gbps * 1e9) / (context / prefill_tok_s)}
    if sampler is not None:
        row["host_samples"] = sampler.table(25)
        print_table(row["host_samples"])
        row["profile"] = profile_decode(model, state, token, 3)
        for name, (ms, calls) in row["profile"]["top_host_ops_per_token"].items():
            print(f"  host op {ms:8.2f} ms/token {calls:7.1f} calls  {name}")
    if timeline:
        with PackTimeline(model) as recorder:
            t = time.perf_counter()
            decode(model, state, token, steps)
            row["timeline_ms_per_token"] = (time.perf_counter() - t) * 1e3 / steps
        row["timeline"] = recorder.summary()
        print_timeline(row["timeline"])
    sys.setswitchinterval(interval)
    cache.close()
    cache.store.close()
    del model, state
    empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SEED_PC), default="deepseek-v4-flash")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, default=Path("/dev/shm/expertdesk-bench"),
                        help="where the GGUF and the pack are written (tmpfs: the emulated drive)")
    parser.add_argument("--context", type=int, default=4096, help="tokens before the timed decode (resident)")
    parser.add_argument("--pack-context", type=int, default=512, help="tokens before the timed decode (pack runs)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16",
                        help="activation dtype, or PREFILL/DECODE (bfloat16/float32: bf16 chunks, float32 decode "
                             "steps); comma-separated for one resident row each (the pack runs take the first)")
    parser.add_argument("--drives", default="12.5,7", help="emulated drive speeds in GB/s ('' skips the pack runs)")
    parser.add_argument("--shared-drive", action="store_true",
                        help="the emulated drive shares its rate among the reads in flight (processor sharing) "
                             "instead of serving them first come, first served")
    parser.add_argument("--skip-resident", action="store_true")
    parser.add_argument("--precision", action="store_true", help="also bf16 vs float32 over 256 tokens")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--device", default="cuda", help="cuda; cpu is a smoke mode for tests (with --scale small)")
    parser.add_argument("--scale", choices=("full", "small"), default="full",
                        help="small: the generator's shrunk dimensions (tests)")
    parser.add_argument("--buffered-io", action="store_true", help="pack reads through the page cache")
    parser.add_argument("--sample", action="store_true", help="host stack samples over the timed pack decode")
    parser.add_argument("--variants", default="",
                        help="extra pack rows at the first drive speed, each with these runtime switches off, "
                             "';'-separated (e.g. 'grouped;grouped,prefetching')")
    parser.add_argument("--read-splits", default="auto",
                        help="sub-reads per expert in pack runs, or 'auto' (default): the fewest that serve one "
                             "expert alone at the emulated drive's rate (`emulation_splits`)")
    parser.add_argument("--timeline", action="store_true",
                        help="per pack row, a timeline of where each MoE layer's time goes (pack_timeline.py)")
    parser.add_argument("--probe", action="store_true",
                        help="first the pack's raw read rate through the store (no cap), see PROBES")
    parser.add_argument("--cache-mib", type=int, default=None,
                        help="VRAM expert cache (default: the seed PC's, scaled)")
    parser.add_argument("--host-cache-mib", type=int, default=None,
                        help="host-RAM tier (default: the seed PC's, scaled)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="resident: also torch.profiler over one 512-token and one --context-token forward pass")
    parser.add_argument("--resident-variants", default="",
                        help="levers to turn off for A/B rows on the resident model: "
                             "static,fused,rowops,attention,quant-experts,x16,kda")
    parser.add_argument("--dense", default="auto",
                        help="resident rows by how the dense weights are held: auto (the loader's choice), "
                             "gguf (kept in their GGUF types: quant_gemv), bf16 (dequantized once at load to the "
                             "compute dtype, bf16 on a GPU); comma-separated for several rows")
    parser.add_argument("--prompt-chunk", type=int, default=None,
                        help="prompt tokens per forward pass (default: the service's, engine.memory_plan.prompt_chunk)")
    parser.add_argument("--kernel-configs", nargs="*", type=Path, default=[],
                        help="result files of bench_quant_gemv.py --sweep / bench_moe_quant.py --sweep whose best "
                             "configurations the kernels take for this run (recorded in the result)")
    args = parser.parse_args()
    global DEVICE, PROFILE_PREFILL, PROMPT_CHUNK
    DEVICE = args.device
    PROFILE_PREFILL = args.profile_prefill
    PROMPT_CHUNK = args.prompt_chunk
    RESIDENT_VARIANTS[:] = [v for v in args.resident_variants.split(",") if v]
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: run this on the GPU machine (or --device cpu --scale small for a smoke run)")
        return 2
    dtypes, device = [], torch.device(DEVICE)
    for entry in args.dtype.split(","):
        chunk, _, step = entry.partition("/")
        options = RuntimeOptions(dtype=chunk, decode_dtype=step or None)
        dtypes.append((options.resolved_dtype(device), options.resolved_decode_dtype(device)))
    dtype, decode_dtype = dtypes[0]
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = args.work / f"{args.model}-{args.layers}l{'' if args.scale == 'full' else '-' + args.scale}.gguf"
    if not gguf.is_file():
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.real_geometry", "--model", args.model, "--layers",
                        str(args.layers), "--out", str(gguf), "--scale", args.scale], check=True, cwd=ROOT)
        print(f"wrote {gguf} ({gguf.stat().st_size / 1e9:.1f} GB) in {time.perf_counter() - t:.1f} s", flush=True)

    result = {"benchmark": "bench_real", "command": " ".join(sys.argv), "date": dt.datetime.now().isoformat(),
              "machine": machine(), "model": args.model, "layers": args.layers, "gguf": str(gguf),
              "gguf_bytes": gguf.stat().st_size, "scale": args.scale, "d2d_copy_gbps": d2d_copy_gbps(),
              "pcie_gbps": None if DEVICE == "cpu" else pcie_gbps(), "rows": [],
              "kernel_configs": apply_kernel_configs(args.kernel_configs)}
    if result["pcie_gbps"]:
        print("pinned copies, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in result["pcie_gbps"].items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"real-{args.model}-{socket.gethostname()}-{stamp}.json"

    def save() -> None:  # after every row: a run cut short still leaves what it measured
        path.write_text(json.dumps(result, indent=1))

    if not args.skip_resident:
        for row_dtype, row_decode_dtype in dtypes:
            for dense in args.dense.split(","):
                with dense_policy(dense, torch.promote_types(row_dtype, row_decode_dtype)):
                    result["rows"].append({"dense": dense, **run_resident(gguf, row_dtype, row_decode_dtype,
                                                                          args.context, args.steps)})
                row = result["rows"][-1]
                print(f"resident, {row['dtype']}, dense weights {dense}: {row['ms_per_token_median']:.2f} "
                      f"ms/token, prefill-512 {row['prefill_512_tok_s']:.0f} tok/s", flush=True)
                save()
    if args.precision:
        result["precision"] = run_precision(gguf)
        print(json.dumps(result["precision"], indent=1), flush=True)
        save()
    drives = [float(x) for x in args.drives.split(",") if x.strip()]
    if drives:
        pack = build_pack(gguf, args.work)
        if args.probe:
            result["store_probe"] = [store_probe(pack, *probe) for probe in PROBES]
            print(json.dumps(result["store_probe"], indent=1), flush=True)
        splits = {gbps: int(args.read_splits) for gbps in drives} if args.read_splits != "auto" else None
        if splits is None:  # the reader threads' own copy rate on this machine
            one = store_probe(pack, 1, 1, 1, reads=24)
            result["one_thread_read_gbps"] = one["gb_per_s"]
            splits = {gbps: emulation_splits(gbps, one["gb_per_s"]) for gbps in drives}
            print(f"one reader thread copies {one['gb_per_s']:.1f} GB/s from the RAM-backed pack: sub-reads per "
                  f"expert {splits}", flush=True)
        runs = [(gbps, seed, "") for gbps in drives for seed in (True, False)]
        runs[2:2] = [(drives[0], False, v) for v in args.variants.split(";") if v]
        if not any(r["mode"] == "resident" for r in result["rows"]):
            # compile the kernels of a prompt through the pack first, so that the first row's prefill is not
            # charged with them (a throwaway run of the default runtime)
            run_pack(pack, args.model, dtype, decode_dtype, drives[0], 1, False, args.pack_context,
                     False if args.buffered_io else None, (args.cache_mib, args.host_cache_mib),
                     read_splits=splits[drives[0]], shared_drive=args.shared_drive)
        for gbps, seed, variant in runs:
            row = run_pack(pack, args.model, dtype, decode_dtype, gbps, args.steps, seed, args.pack_context,
                           False if args.buffered_io else None, (args.cache_mib, args.host_cache_mib),
                           sample=args.sample and not seed, variant=variant, read_splits=splits[gbps],
                           timeline=args.timeline, shared_drive=args.shared_drive)
            resident = next((r for r in result["rows"] if r["mode"] == "resident"), None)
            # bound: the drive's time for the bytes read, or the compute (the resident decode)
            row["bound_ms"] = max(row["drive_ms_per_token"], resident["ms_per_token_median"] if resident else 0.0)
            if resident is None:
                row["bound_note"] = "the drive's time only: this run measured no resident decode"
            row["of_bound"] = row["bound_ms"] / row["ms_per_token_median"]
            result["rows"].append(row)
            print(json.dumps(result["rows"][-1], indent=1), flush=True)
            save()
    save()
    print(f"\n{'mode':10} {'dtype':9} {'drive':44} {'ms/tok':>8} {'ms/layer':>8} {'tok/s':>7} {'hit':>5} {'GB/tok':>7} "
          f"{'bound ms':>8} {'of bound':>8}")
    for r in result["rows"]:
        print(f"{r['mode']:10} {r.get('dtype', ''):9} {r.get('drive', 'HBM'):44} {r['ms_per_token_median']:8.2f} "
              f"{r['ms_per_layer_median']:8.3f} {r['tok_per_s']:7.2f} {r.get('hit_rate', 1.0):5.2f} "
              f"{r.get('ssd_gb_per_token', 0.0):7.3f} {r.get('bound_ms', 0.0):8.2f} "
              f"{r.get('of_bound', r.get('of_hbm_bound', 0.0)):8.2f}")
    for r in result["rows"]:
        if "prefill_tok_s" in r:
            print(f"{r['mode']:10} prompt of {r['prefill_tokens']} through the pack: {r['prefill_tok_s']:8.1f} tok/s, "
                  f"{r['prefill_ssd_gb']:.2f} GB read, the drive's time {r['prefill_drive_ms']:.0f} ms, "
                  f"{r['prefill_of_drive']:.2f} of it")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
