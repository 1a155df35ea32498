"""Preflight: can this machine build and run a pack in this folder, and with what cache sizes?

`run_preflight(target_dir, source)` measures the target filesystem (does O_DIRECT
really work, is there room for the pack), the GPU (free VRAM against the dense
weights + reserve + one step's top-k working set) and RAM, and recommends
`cache_vram_mib`, `cache_vram_reserve_mib` and `host_cache_mib` from what it measured.
Every probe is a parameter, so tests (and the wizard's "what if") can simulate a
full disk, a filesystem without O_DIRECT or a machine without a GPU.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packer.diskio import (
    GIB,
    MIB,
    aligned_buffer,
    existing_ancestor,
    format_bytes,
    free_space,
    mount_point,
    open_for_read,
    open_for_write,
    space_margin,
)

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class Check:
    """One preflight verdict: `status` is pass, warn or fail; `fix` says what to do about it."""

    name: str
    status: str
    reason: str
    fix: str = ""


@dataclass(frozen=True)
class ODirectProbe:
    """Result of a real O_DIRECT write + read in a folder."""

    works: bool  # an aligned O_DIRECT write and read round-tripped
    unaligned_rejected: bool | None  # an unaligned O_DIRECT read failed with EINVAL (None: not tried)
    detail: str = ""


@dataclass(frozen=True)
class GpuInfo:
    name: str
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class RamInfo:
    available_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class ModelSizes:
    """What preflight needs to know about the model to be packed."""

    architecture: str
    pack_bytes: int
    dense_bytes: int
    expert_block_bytes: int  # one expert, all roles, as read from the pack
    top_k: int
    moe_layers: int
    num_experts: int


@dataclass
class PreflightReport:
    """All checks, the raw measurements and the recommended settings."""

    target_dir: Path
    checks: list[Check] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    recommended: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(c.status != FAIL for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_dir": str(self.target_dir),
            "ok": self.ok,
            "checks": [asdict(c) for c in self.checks],
            "measurements": self.measurements,
            "recommended": self.recommended,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


# --- probes ------------------------------------------------------------------------------


def probe_odirect(directory: str | os.PathLike) -> ODirectProbe:
    """Write and read back 1 MiB with O_DIRECT in `directory`, then try an unaligned read.

    The kernel must refuse an unaligned O_DIRECT read with EINVAL; a filesystem that
    accepts it is silently buffering "direct" I/O (the page cache is still in the path).
    """
    directory = existing_ancestor(directory)
    fd_probe = -1
    path = None
    try:
        fd_tmp, name = tempfile.mkstemp(prefix=".expertdesk-odirect-", dir=directory)
        os.close(fd_tmp)
        path = Path(name)
        fd_probe, direct = open_for_write(path, True, create=False)
        if not direct:
            return ODirectProbe(False, None, "the filesystem refused to open a file with O_DIRECT")
        size = 1 * MIB
        buf = aligned_buffer(size)
        pattern = bytes(range(256)) * (size // 256)
        buf[:] = pattern
        try:
            os.pwrite(fd_probe, memoryview(buf), 0)
            os.fsync(fd_probe)
        except OSError as exc:
            return ODirectProbe(False, None, f"an aligned O_DIRECT write failed ({exc.strerror})")
        os.close(fd_probe)
        fd_probe, direct = open_for_read(path, True)
        back = aligned_buffer(size)
        try:
            n = os.preadv(fd_probe, [memoryview(back)], 0)
        except OSError as exc:
            return ODirectProbe(False, None, f"an aligned O_DIRECT read failed ({exc.strerror})")
        if n != size or back[:] != pattern:
            return ODirectProbe(False, None, "an O_DIRECT read returned different bytes than were written")
        try:
            os.preadv(fd_probe, [memoryview(back)[:4096]], 1)  # offset 1: not aligned to any block size
            rejected = False
        except OSError as exc:
            rejected = exc.errno == errno.EINVAL
        buf.close()
        back.close()
        return ODirectProbe(True, rejected, "aligned O_DIRECT write and read work")
    except OSError as exc:
        return ODirectProbe(False, None, f"could not test in {directory}: {exc.strerror or exc}")
    finally:
        if fd_probe >= 0:
            try:
                os.close(fd_probe)
            except OSError:
                pass
        if path is not None:
            path.unlink(missing_ok=True)


def probe_gpu() -> GpuInfo | None:
    """The first CUDA GPU torch sees (name, free and total bytes), or None without one."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(0)
        return GpuInfo(torch.cuda.get_device_name(0), int(free), int(total))
    except Exception:  # a broken driver is "no usable GPU" for our purpose
        return None


def probe_ram() -> RamInfo:
    """Available and total RAM (psutil's 'available': free + reclaimable cache)."""
    import psutil

    vm = psutil.virtual_memory()
    return RamInfo(int(vm.available), int(vm.total))


def model_sizes(source: Any) -> ModelSizes:
    """Sizes of the pack a source (path or GGUFSource) makes, from its tensor table only."""
    from packer.adapters import plan_experts
    from packer.builder import estimate_pack_bytes
    from packer.gguf_source import GGUFSource

    own = not isinstance(source, GGUFSource)
    src = GGUFSource.open(source) if own else source
    try:
        plan = plan_experts(src)
        entries = plan.layer_entries()
        experts = plan.expert_tensor_names
        return ModelSizes(
            architecture=plan.architecture,
            pack_bytes=estimate_pack_bytes(src, plan),
            dense_bytes=sum(t.nbytes for t in src.tensors.values() if t.name not in experts),
            expert_block_bytes=max(e.read_nbytes for e in entries),
            top_k=plan.expert_used_count,
            moe_layers=len(entries),
            num_experts=plan.num_experts,
        )
    finally:
        if own:
            src.close()


# --- the report ---------------------------------------------------------------------------


def _mib(n: float) -> int:
    return int(n // MIB)


def vram_reserve_bytes(total_vram: int) -> int:
    """VRAM kept out of the expert cache (CUDA context, activations, KV cache, fragmentation).

    About 6% of the card, at least 1 GiB, in 256 MiB steps: 2 GiB on a 32 GB card,
    the value the seed used for DeepSeek-V4-Flash on an RTX 5090.
    """
    step = 256 * MIB
    return max(GIB, -(-int(total_vram * 0.06) // step) * step)


def run_preflight(
    target_dir: str | os.PathLike,
    source: Any = None,
    *,
    requested_cache_mib: int | None = None,
    free_space_fn: Callable[[Path], tuple[int, int]] = free_space,
    gpu_fn: Callable[[], GpuInfo | None] = probe_gpu,
    ram_fn: Callable[[], RamInfo] = probe_ram,
    odirect_fn: Callable[[Path], ODirectProbe] = probe_odirect,
    sizes: ModelSizes | None = None,
) -> PreflightReport:
    """Run every check for building into / running from `target_dir`.

    source: the model (GGUF path or GGUFSource) to size the pack from; without it the
    space and VRAM checks can only report what is there. The *_fn arguments replace
    the real probes (tests, simulations); `sizes` replaces reading the source.
    """
    target = Path(target_dir)
    report = PreflightReport(target_dir=target)
    m = report.measurements
    if sizes is None and source is not None:
        sizes = model_sizes(source)
    if sizes is not None:
        m["model"] = asdict(sizes)

    # O_DIRECT ------------------------------------------------------------------------
    where = existing_ancestor(target)
    probe = odirect_fn(where)
    m["odirect"] = asdict(probe)
    if not probe.works:
        report.checks.append(Check(
            "direct_io", FAIL,
            f"O_DIRECT does not work in {where}: {probe.detail}. The fast SSD path reads experts with O_DIRECT",
            "choose a folder on a local NVMe drive formatted ext4, xfs or btrfs (not tmpfs, a network share or FUSE), "
            "or build with `expertdesk pack --buffered` and run with --buffered-io (slower)",
        ))
    elif probe.unaligned_rejected is False:
        report.checks.append(Check(
            "direct_io", WARN,
            f"the filesystem of {where} accepted an unaligned O_DIRECT read: it silently buffers 'direct' I/O, "
            "so reads still go through the page cache",
            "for full speed use a local ext4/xfs/btrfs drive",
        ))
    else:
        report.checks.append(Check("direct_io", PASS,
                                   f"O_DIRECT works in {where} (aligned I/O verified, unaligned refused)"))

    # Free space ----------------------------------------------------------------------
    free, total = free_space_fn(where)
    m["disk"] = {"free_bytes": free, "total_bytes": total, "mount": str(mount_point(where))}
    mount = m["disk"]["mount"]
    if sizes is None:
        report.checks.append(Check(
            "free_space", WARN, f"{format_bytes(free)} free on {mount}; the pack size is unknown without the model",
            "choose the model file to check that its pack fits",
        ))
    else:
        need = sizes.pack_bytes + space_margin(sizes.pack_bytes)
        m["disk"]["needed_bytes"] = need
        if free >= need:
            report.checks.append(Check(
                "free_space", PASS,
                f"the pack needs {format_bytes(sizes.pack_bytes)} (+ margin), {format_bytes(free)} free on {mount}",
            ))
        else:
            report.checks.append(Check(
                "free_space", FAIL,
                f"the pack needs {format_bytes(sizes.pack_bytes)} "
                f"plus a {format_bytes(need - sizes.pack_bytes)} margin, "
                f"only {format_bytes(free)} free on {mount}",
                f"free {format_bytes(need - free)} on {mount} or choose a folder on another drive",
            ))

    # GPU / VRAM ----------------------------------------------------------------------
    gpu = gpu_fn()
    ram = ram_fn()
    m["gpu"] = asdict(gpu) if gpu else None
    m["ram"] = asdict(ram)
    rec = report.recommended
    block = sizes.expert_block_bytes if sizes else 0
    if gpu is None:
        report.checks.append(Check(
            "vram", WARN, "no CUDA GPU found: the app will run on the CPU, slowly",
            "install an NVIDIA driver and the CUDA build of torch (see installer/) to use the GPU",
        ))
        rec["cache_vram_mib"] = 0
        rec["cache_vram_reserve_mib"] = 0
    else:
        reserve = vram_reserve_bytes(gpu.total_bytes)
        rec["cache_vram_reserve_mib"] = _mib(reserve)
        if sizes is None:
            usable = max(0, gpu.free_bytes - reserve)
            report.checks.append(Check(
                "vram", PASS, f"{gpu.name}: {format_bytes(gpu.free_bytes)} free of {format_bytes(gpu.total_bytes)}",
            ))
        else:
            working_set = sizes.top_k * block
            need = sizes.dense_bytes + reserve + working_set
            usable = max(0, gpu.free_bytes - sizes.dense_bytes - reserve)
            detail = (
                f"{gpu.name}: {format_bytes(gpu.free_bytes)} free; "
                f"needs {format_bytes(sizes.dense_bytes)} dense weights + {format_bytes(reserve)} reserve "
                f"+ {format_bytes(working_set)} for one step's top-{sizes.top_k} experts"
            )
            if gpu.free_bytes < need:
                report.checks.append(Check(
                    "vram", FAIL, f"not enough VRAM: {detail}",
                    f"free {format_bytes(need - gpu.free_bytes)} of VRAM (close other GPU programs) "
                    "or use a larger GPU",
                ))
            elif usable < sizes.moe_layers * working_set:
                report.checks.append(Check(
                    "vram", WARN,
                    f"{detail}; the expert cache holds less than one token's experts for all "
                    f"{sizes.moe_layers} layers, so most experts will stream from the SSD every token",
                    "expect low speed; a GPU with more memory helps most",
                ))
            else:
                report.checks.append(Check("vram", PASS, detail))
        if block:
            usable = usable // block * block  # whole experts only: a partial slot is useless
        if requested_cache_mib is not None:
            usable = min(usable, requested_cache_mib * MIB)
        rec["cache_vram_mib"] = _mib(usable)

    # RAM -----------------------------------------------------------------------------
    headroom = max(4 * GIB, int(ram.total_bytes * 0.15))  # the OS, the app, the page cache for dense
    on_cpu = sizes.dense_bytes if (gpu is None and sizes) else 0
    budget = ram.available_bytes - headroom - on_cpu
    host = max(0, int(budget * 0.75))
    if block:
        host = host // block * block
    rec["host_cache_mib"] = _mib(host)
    ram_text = f"{format_bytes(ram.available_bytes)} available of {format_bytes(ram.total_bytes)}"
    if gpu is None and sizes and ram.available_bytes < sizes.dense_bytes + 2 * GIB:
        report.checks.append(Check(
            "ram", FAIL,
            f"{ram_text}; running on the CPU needs the {format_bytes(sizes.dense_bytes)} of dense weights in RAM",
            "close other programs, add RAM, or use a CUDA GPU",
        ))
    elif budget <= 0 or (block and host < block):
        report.checks.append(Check(
            "ram", WARN, f"{ram_text}: no room for a host-RAM expert cache without risking swap",
            "close other programs to let ExpertDesk keep hot experts in RAM",
        ))
    else:
        report.checks.append(Check("ram", PASS, f"{ram_text}; {format_bytes(host)} for the host-RAM expert cache"))
    return report
