"""How a model runs: one value from the CLI and the GUI down to the expert runtime.

`RuntimeOptions` carries the device, the activation dtype, the expert-cache budgets and
the I/O settings. The CLI builds it from its flags (`app.cli_options`), the GUI from
its preferences, and `engine.loader.load_model` / `engine.service.EngineService` hand
it to the expert provider unchanged, so each setting has one name everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: `expertdesk --help` stays fast
    import torch

MIB = 1 << 20


@dataclass(frozen=True)
class RuntimeOptions:
    """Settings of one loaded model (all optional; None means "the runtime decides").

    device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1".
    dtype: activations: None (bfloat16 on CUDA, float32 on CPU), or a torch dtype / its
        name ("float32", "bfloat16").
    decode_dtype: the activations of one-token decode steps, and the dtype the conversation
        state (KV cache, compressor and recurrent states) is kept in: None = as `dtype`.
        "float32" with a bfloat16 `dtype` prefills in bf16 (tensor cores) and decodes in
        float32: the state is written exactly (bf16 values widened), each decode step
        computes and appends in float32, and a later prompt chunk reads the state rounded
        to bf16 (benchmarks/bench_precision.py measures its agreement with float32).
    cache_mib: the expert cache on the device (packs): None = free memory minus the
        runtime's reserve.
    host_cache_mib: the host-RAM tier below it (packs): None = 0, off.
    direct_io: O_DIRECT pack reads. None = O_DIRECT, and for the demo model a buffered
        fallback where the filesystem has none; True = O_DIRECT or refuse; False =
        buffered reads through the page cache.
    speculative_reads: how many of a next-layer guess's likeliest experts may read the
        drive while it idles (the rest are only moved up from RAM).
    read_rate_limit_gbps: cap the pack's read rate (GB/s); an emulation knob for
        benchmarks, None = no cap.
    read_rate_shared: with read_rate_limit_gbps, the emulated drive shares its rate
        among the reads in flight (a read started later slows the ones before it)
        instead of serving them first come, first served (engine.runtime.store.ReadRateLimiter).
    read_splits: parallel aligned sub-reads per expert block. 1 (default): one O_DIRECT
        read, which an NVMe drive serves at full speed (the kernel queues it as many
        requests). A RAM-backed emulated drive copies each read on one thread (~3.4 GB/s
        on the H200 machine), so benchmarks split reads to serve one expert at the
        emulated drive's speed.
    verify_reads: hash every expert block read from the drive against the pack's
        expert_hashes.bin; a mismatch raises ExpertReadError (never used or cached) and
        counts in telemetry (hash_mismatches, io_errors). Off by default: it costs one
        SHA-256 pass over every byte read (benchmarks/bench_verify_reads.py).
    trace_file: record the router's choices (per token and MoE layer: experts, weights,
        next-layer guess) and write them there when the model is closed (format:
        docs/traces.md); None = no recording.
    """

    device: str = "auto"
    dtype: torch.dtype | str | None = None
    decode_dtype: torch.dtype | str | None = None
    cache_mib: int | None = None
    host_cache_mib: int | None = None
    direct_io: bool | None = None
    speculative_reads: int = 2
    read_rate_limit_gbps: float | None = None
    read_rate_shared: bool = False
    read_splits: int = 1
    verify_reads: bool = False
    trace_file: str | None = None

    def with_(self, **changes: object) -> RuntimeOptions:
        """A copy with `changes` applied (e.g. a new cache budget)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def resolved_device(self) -> torch.device:
        """The device this names, "auto" resolved; a clear error for one that is absent."""
        import torch

        name = (self.device or "auto").strip().lower()
        if name == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {self.device!r}: use auto, cpu, cuda or cuda:N") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} was asked for, but torch sees no CUDA GPU "
                                 "(is the CPU build of torch installed?); use --device cpu")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            elif device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA GPU(s) present")
        elif device.type != "cpu":
            raise ValueError(f"device {self.device!r} is not supported: use auto, cpu, cuda or cuda:N")
        return device

    def resolved_dtype(self, device: torch.device | None = None) -> torch.dtype:
        """The activation dtype: as given, else bfloat16 on CUDA and float32 on CPU."""
        import torch

        if self.dtype is None:
            device = device if device is not None else self.resolved_device()
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _named_dtype(self.dtype)

    def resolved_decode_dtype(self, device: torch.device | None = None) -> torch.dtype:
        """The decode steps' (and the state's) dtype: as given, else the activation dtype."""
        return self.resolved_dtype(device) if self.decode_dtype is None else _named_dtype(self.decode_dtype)

    @property
    def cache_bytes(self) -> int | None:
        return None if self.cache_mib is None else int(self.cache_mib) * MIB

    @property
    def host_cache_bytes(self) -> int:
        return 0 if self.host_cache_mib is None else int(self.host_cache_mib) * MIB


def _named_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or the dtype a name gives ("float32", "bf16", ...); ValueError otherwise."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float64": torch.float64}
    try:
        return names[str(value).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}: use float32 or bfloat16") from None
