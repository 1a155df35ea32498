"""What the setup wizard does, without Qt: inspect a GGUF, check a target folder, build and verify.

Every function here runs on a worker thread (the wizard pages call them through
``wizard_workers.BackgroundTask``) and is tested without a window. Nothing here keeps a
GGUF memory-mapped after it returns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertpack import PARTIAL_SUFFIX, PackError
from packer.diskio import GIB, MIB, format_bytes, format_duration
from packer.preflight import FAIL, PASS, WARN, Check, GpuInfo, ModelSizes, PreflightReport, run_preflight

if TYPE_CHECKING:
    from engine.options import RuntimeOptions

_SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")

# How the wizard names the preflight checks.
CHECK_TITLES = {
    "direct_io": "Direct I/O (O_DIRECT)",
    "free_space": "Free space",
    "vram": "GPU memory",
    "ram": "RAM",
    "gpu": "GPU and driver",
    "target": "Pack folder",
    "memory_plan": "Memory plan",
}


# --- page 1: the model ---------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFInfo:
    """What the wizard shows about a source model (one file or a whole split set)."""

    path: Path  # the file the user chose
    files: tuple[Path, ...]  # all shards, in order
    file_sizes: tuple[int, ...]
    name: str
    architecture: str
    parameters: int  # sum of tensor elements
    tensor_count: int
    quant_counts: tuple[tuple[str, int], ...]  # (type name, tensors), most bytes first
    quant_bytes: tuple[tuple[str, int], ...]  # (type name, bytes), most bytes first
    supported: bool
    reason: str = ""  # why not, when unsupported
    sizes: ModelSizes | None = None  # for preflight (None when unsupported)
    pack_bytes: int = 0  # estimated pack size (0 when unsupported)
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.file_sizes)

    @property
    def shards(self) -> int:
        return len(self.files)

    @property
    def stem(self) -> str:
        """The model's file name without ``.gguf`` and shard suffix (what the pack is named after)."""
        stem = self.files[0].name
        stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else Path(stem).stem
        return _SHARD_SUFFIX.sub("", stem)

    def quant_summary(self) -> str:
        return ", ".join(f"{name} ×{n}" for name, n in self.quant_counts)


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Open and validate a GGUF (every shard of a split set) and describe it.

    Raises FileNotFoundError, GGUFFormatError (with what is wrong and what to do) or
    OSError; a model the packer cannot handle is *not* an error: ``supported`` is
    False and ``reason`` says why.
    """
    from packer.adapters import plan_experts
    from packer.builder import estimate_pack_bytes
    from packer.errors import PackBuildError
    from packer.gguf_source import GGUFSource
    from packer.preflight import model_sizes

    path = Path(path).expanduser()
    with GGUFSource.open(path) as src:
        tensors = list(src.tensors.values())
        counts: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for t in tensors:
            counts[t.type_name] += 1
            nbytes[t.type_name] += t.nbytes
        order = sorted(counts, key=lambda k: (-nbytes[k], k))
        name = src.metadata.get("general.name")
        common = dict(
            path=path, files=tuple(src.files), file_sizes=tuple(src.file_sizes),
            architecture=src.architecture, parameters=sum(t.n_elements for t in tensors),
            tensor_count=len(tensors), quant_counts=tuple((k, counts[k]) for k in order),
            quant_bytes=tuple((k, nbytes[k]) for k in order),
        )
        try:
            plan = plan_experts(src)
            sizes = model_sizes(src)
            pack_bytes = estimate_pack_bytes(src, plan)
        except PackBuildError as exc:  # UnsupportedLayoutError and friends: say why, do not fail
            info = GGUFInfo(name="", supported=False, reason=str(exc), **common)
        else:
            info = GGUFInfo(name="", supported=True, sizes=sizes, pack_bytes=pack_bytes,
                            moe_layers=sizes.moe_layers, num_experts=sizes.num_experts, top_k=sizes.top_k, **common)
    display = str(name).strip() if isinstance(name, str) and name.strip() else info.stem
    return _replace(info, name=display)


def _replace(info: GGUFInfo, **values: Any) -> GGUFInfo:
    return dataclasses.replace(info, **values)


def format_count(n: int) -> str:
    """'284.3 B', '1.03 T', '98.3 K' parameters (decimal, as model cards write them)."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.1f} {unit}"
    return str(n)


# --- page 2: the target folder ---------------------------------------------------------


@dataclass(frozen=True)
class TargetState:
    """What is already at the place the pack would go."""

    final: Path  # NAME.expertpack
    partial: Path  # NAME.expertpack.partial
    existing: str = "none"  # none | same (a finished pack of this model) | other (something else)
    detail: str = ""
    journaled_layers: int = 0  # layers an interrupted build already wrote (0: none)


def pack_location(info: GGUFInfo, folder: str | os.PathLike) -> Path:
    from packer.builder import pack_path_for

    return pack_path_for(info.files[0], Path(folder).expanduser())


def journaled_layers(partial: Path) -> int:
    """How many layers an interrupted build recorded as written (from its progress.json)."""
    from packer.builder import JOURNAL_NAME

    try:
        data = json.loads((partial / JOURNAL_NAME).read_text(encoding="utf-8"))
        return len(data.get("layers") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def examine_target(info: GGUFInfo, folder: str | os.PathLike) -> TargetState:
    """Is there a finished pack of this model, something else, or an interrupted build at the target?"""
    from expertpack import load_manifest

    final = pack_location(info, folder)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    done = journaled_layers(partial) if partial.is_dir() else 0
    if not final.exists():
        return TargetState(final, partial, journaled_layers=done)
    try:
        manifest = load_manifest(final)
    except PackError as exc:
        return TargetState(final, partial, "other", f"{final} exists but is not a finished pack ({exc.problem})",
                           journaled_layers=done)
    names = [(s.name, s.size) for s in manifest.source_files]
    if (names == [(f.name, s) for f, s in zip(info.files, info.file_sizes)]
            and manifest.architecture == info.architecture):
        return TargetState(final, partial, "same", f"a finished pack of this model is already at {final}")
    return TargetState(final, partial, "other", f"{final} holds a pack of another model")


def target_check(state: TargetState, layers: int) -> Check:
    """The wizard's own check about what is already at the target."""
    if state.existing == "same":
        return Check("target", PASS, f"{state.detail}: it is verified and used instead of building it again",
                     "choose another folder to build a fresh copy")
    if state.existing == "other":
        return Check("target", FAIL, state.detail, "choose another folder, or remove it in a file manager first")
    if state.journaled_layers:
        return Check("target", PASS,
                     f"an interrupted build is at {state.partial.name}: {state.journaled_layers} of {layers} layers "
                     "are already written; the build resumes from them (or starts over if the source changed)")
    return Check("target", PASS, f"nothing is in the way: {state.final.name} will be created in {state.final.parent}")


def gpu_check(gpu: GpuInfo | None) -> Check:
    """GPU and driver as torch sees them (the preflight's VRAM check covers the memory)."""
    try:
        import torch

        build = f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda
                                                else ", CPU-only build")
    except Exception:  # pragma: no cover - torch is a dependency
        build = "torch not importable"
    if gpu is None:
        return Check("gpu", WARN, f"torch sees no CUDA GPU ({build})",
                     "install the NVIDIA driver and the CUDA build of torch (the installer does both) to use the GPU")
    return Check("gpu", PASS, f"{gpu.name}, {format_bytes(gpu.total_bytes)} ({build})")


@dataclass
class TargetReport:
    """Preflight of a folder plus the wizard's own checks."""

    folder: Path
    state: TargetState
    preflight: PreflightReport
    checks: list[Check] = field(default_factory=list)  # in display order
    memory_plan: Any = None  # engine.memory_plan.MemoryPlan of the model on this machine (None: none fits or none)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def blockers(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def recommended_cache(self, info: GGUFInfo) -> tuple[int, int]:
        """(GPU cache MiB, host-RAM tier MiB) from what preflight measured, never more than all experts."""
        rec = self.preflight.recommended
        vram, host = int(rec.get("cache_vram_mib", 0)), int(rec.get("host_cache_mib", 0))
        sizes = info.sizes
        if sizes is not None and sizes.expert_block_bytes:
            everything = -(-sizes.moe_layers * sizes.num_experts * sizes.expert_block_bytes // MIB) + 1
            vram = min(vram, everything)
            host = min(host, max(0, everything - vram))
        return vram, host


def probe_gpu_for_app() -> GpuInfo | None:
    """The GPU as preflight sees it, counting memory this app's torch holds as free.

    The app itself may have a model loaded (its weights and expert cache are in VRAM);
    loading the new model releases them, so they must not count against it.
    """
    from packer.preflight import probe_gpu

    gpu = probe_gpu()
    if gpu is None:
        return None
    try:
        import torch

        ours = int(torch.cuda.memory_reserved(0))
    except Exception:  # no CUDA context in this process yet: nothing of ours to count
        ours = 0
    return GpuInfo(gpu.name, min(gpu.total_bytes, gpu.free_bytes + ours), gpu.total_bytes)


def check_target(info: GGUFInfo, folder: str | os.PathLike, options: RuntimeOptions | None = None,
                 **probes: Callable) -> TargetReport:
    """Run the preflight checks for building ``info`` into ``folder`` (probes: run_preflight's *_fn);
    the memory plan in the dtypes ``options`` (the app's settings) will run the model in."""
    folder = Path(folder).expanduser()
    state = examine_target(info, folder)
    gpu_fn = probes.pop("gpu_fn", probe_gpu_for_app)
    gpu_seen: list[GpuInfo | None] = []

    def gpu() -> GpuInfo | None:
        gpu_seen.append(gpu_fn())
        return gpu_seen[-1]

    sizes = info.sizes
    if sizes is not None and state.existing == "same":
        sizes = dataclasses.replace(sizes, pack_bytes=0)  # already there: needs no more space
    report = run_preflight(folder, sizes=sizes, gpu_fn=gpu, **probes)
    order = ["target", "direct_io", "free_space", "gpu", "vram", "ram"]
    checks = {c.name: c for c in report.checks}
    checks["target"] = target_check(state, info.moe_layers)
    checks["gpu"] = gpu_check(gpu_seen[-1] if gpu_seen else None)
    if "direct_io" in checks:  # what this OS's expert read path provides (O_DIRECT, F_NOCACHE, NO_BUFFERING)
        from engine.runtime.platform_io import support

        c = checks["direct_io"]
        checks["direct_io"] = dataclasses.replace(c, reason=f"{c.reason}. This system's expert reads: "
                                                            f"{support().describe()}")
    ordered = [checks[n] for n in order if n in checks] + [c for n, c in checks.items() if n not in order]
    from app.memory_plan_source import plan_or_check

    plan, plan_failed = (plan_or_check(info.files[0], report.measurements, options) if info.supported
                         else (None, None))
    return TargetReport(folder, state, report, ordered + ([plan_failed] if plan_failed else []), plan)


# --- page 3: build and verify ----------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One progress report of the build or the verification."""

    stage: str  # "build" | "verify"
    done: int
    total: int
    rate: float  # bytes per second
    eta: float  # seconds (inf: unknown)
    phase: str  # the packer's words

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def text(self) -> str:
        """'1.2 GB of 147.2 GB · 2.1 GB/s · about 1m10s left'"""
        parts = [f"{format_bytes(self.done)} of {format_bytes(self.total)}"]
        if self.rate > 0:
            parts.append(f"{format_bytes(self.rate)}/s")
        if self.done < self.total:
            eta = format_duration(self.eta)
            parts.append(f"about {eta} left" if eta != "--" else "time left unknown")
        return " · ".join(parts)


def describe_phase(stage: str, phase: str) -> str:
    """The packer's phase words as a sentence for the progress label."""
    if stage == "verify":
        return "Verifying the whole pack: reading every byte back and checking its SHA-256"
    if phase.startswith("resume: re-checking"):
        return "Resuming: re-checking the layers an earlier build already wrote"
    if phase.startswith("resume: dense"):
        return "Resuming: the dense weights are already written"
    if phase.startswith("verify"):
        return "Checking the new pack (quick verification)"
    if phase == "done":
        return "Pack written"
    return phase[:1].upper() + phase[1:] if phase else "Building"


@dataclass
class BuildOutcome:
    """A finished build (or a reused pack) and its full verification."""

    pack_dir: Path
    reused: bool  # a finished pack of this model was already there: not rebuilt
    layers_resumed: int = 0
    layers_redone: int = 0
    restarted: bool = False
    verify_ok: bool = False
    verify_summary: str = ""
    verify_mode: str = "full"
    seconds: float = 0.0
    pack_bytes: int = 0

    def resume_text(self) -> str:
        """What the builder reported about an earlier attempt ('' when it started fresh)."""
        if self.reused:
            return "A finished pack of this model was already there: it was verified instead of rebuilt."
        notes = []
        if self.restarted:
            notes.append("The unfinished build in that folder was made from different source files: it started over.")
        if self.layers_resumed:
            notes.append(f"Resumed: {self.layers_resumed} layers were already done (re-checked and kept).")
        if self.layers_redone:
            notes.append(f"{self.layers_redone} layers written earlier had changed on disk and were written again.")
        return " ".join(notes)


class Cancelled(Exception):
    """The user cancelled (the build keeps what it wrote; a rerun resumes)."""


def build_and_verify(
    info: GGUFInfo,
    folder: str | os.PathLike,
    *,
    progress: Callable[[Progress], None] | None = None,
    cancel: threading.Event | None = None,
    builder_options: dict[str, Any] | None = None,
) -> BuildOutcome:
    """Build the pack (resuming an interrupted build) or reuse a finished one, then verify it in full.

    Raises Cancelled, PackBuildError / GGUFFormatError (with what to do) or OSError.
    """
    import time

    from packer.builder import BuildCancelled, PackBuilder
    from packer.diskio import allocated_bytes

    cancel = cancel or threading.Event()
    report = progress or (lambda p: None)
    t0 = time.monotonic()
    state = examine_target(info, folder)
    if state.existing == "other":
        from packer.errors import PackBuildError

        raise PackBuildError(f"{state.detail}; choose another folder")
    outcome = BuildOutcome(pack_dir=state.final, reused=state.existing == "same")
    if not outcome.reused:
        options = dict(builder_options or {})
        hook = options.pop("progress_hook", None)  # tests: runs on this thread after each report

        def on_build(done: int, total: int, rate: float, eta: float, phase: str) -> None:
            report(Progress("build", done, total, rate, eta, phase))
            if hook is not None:
                hook(done, total, rate, eta, phase)

        builder = PackBuilder(info.files[0], Path(folder).expanduser(), progress=on_build, cancel=cancel, **options)
        try:
            outcome.pack_dir = builder.run()
        except BuildCancelled:
            raise Cancelled("the build was cancelled; what was written is kept and the next build resumes it") from None
        stats = builder.stats
        outcome.layers_resumed, outcome.layers_redone, outcome.restarted = (
            stats.layers_resumed, stats.layers_redone, stats.restarted)

    full_verification(outcome, cancel, report)
    outcome.seconds = time.monotonic() - t0
    outcome.pack_bytes = allocated_bytes(outcome.pack_dir)
    return outcome


def full_verification(outcome: BuildOutcome, cancel: threading.Event, report: Callable[[Progress], None]) -> None:
    """Read the whole pack back and check every SHA-256; the result goes into `outcome`
    (after a build, and after a download packed shard by shard). Raises Cancelled."""
    from packer.verify import verify_pack

    def on_verify(done: int, total: int, rate: float, eta: float, phase: str) -> None:
        if cancel.is_set():
            raise Cancelled("verification cancelled; the pack is finished, the next attempt verifies it again")
        report(Progress("verify", done, total, rate, eta, phase))

    result = verify_pack(outcome.pack_dir, quick=False, progress=on_verify)
    outcome.verify_ok = result.ok
    outcome.verify_summary = (f"full verification: {result.slices_checked} of {result.slices_total} slices and the "
                              f"dense weights match their SHA-256 ({format_bytes(result.bytes_read)} read in "
                              f"{result.seconds:.1f} s)") if result.ok else result.summary()


# --- page 4: the source files -------------------------------------------------------------


def source_disk_bytes(files: tuple[Path, ...] | list[Path]) -> int:
    """Bytes the source files really occupy (what deleting them frees)."""
    total = 0
    for f in files:
        try:
            total += f.stat().st_blocks * 512
        except OSError:
            continue
    return total


def delete_source_files(files: tuple[Path, ...] | list[Path]) -> int:
    """Delete the source GGUF files; returns the bytes freed. Missing files are skipped."""
    freed = 0
    for f in files:
        try:
            size = f.stat().st_blocks * 512
            f.unlink()
        except FileNotFoundError:
            continue
        freed += size
    for parent in {f.parent for f in files}:
        try:
            fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
    return freed


__all__ = [
    "CHECK_TITLES", "GGUFInfo", "inspect_gguf", "format_count", "TargetState", "TargetReport", "examine_target",
    "check_target", "pack_location", "journaled_layers", "Progress", "describe_phase", "BuildOutcome", "Cancelled",
    "build_and_verify", "source_disk_bytes", "delete_source_files", "GIB",
]
