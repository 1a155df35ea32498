"""Which model fits this PC, and how fast will it run? Answered before anything is downloaded.

`estimate_fit(release, target_dir)` takes one release of the catalogue
(`resources/catalog.json`: repo, shards, sizes, quant types, per-token expert bytes)
and this machine's measurements and returns a `FitReport`:

- disk: the pack's size, the space needed when packing shard by shard while
  downloading (pack + one shard + margin) and when downloading everything first
  (pack + source), and what is free in the target folder;
- VRAM and RAM: the same checks and recommended cache sizes as `expertdesk check`
  (`packer.preflight.run_preflight`, fed the catalogue's sizes instead of a GGUF);
- speed: decode tokens/s from the bound model the benchmarks use
  (benchmarks/RESULTS.md: a decode step costs at least the SSD bytes it misses divided
  by the drive's read rate), with the read rate measured by a 2-second O_DIRECT read
  probe in the target folder.

The hit rate is the one unknown: it depends on the prompt. A cache holding a fraction
f of all expert bytes (VRAM cache + host-RAM tier) hits at least f (uniform routing;
nothing is hot) and, on the skewed routing the benchmarks replay, about f ** (1/3)
(RESULTS.md, `synthetic_trace` at 5%, 14% and 30% capacity: 0.37, 0.50, 0.69 against
f ** (1/3) = 0.37, 0.52, 0.67). The report gives the tokens/s range between those two;
it is an upper bound set by the drive (compute and PCIe copies only slow it further).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from expertpack import DIGEST_SIZE
from packer.diskio import (
    MIB,
    aligned_buffer,
    drop_cache,
    existing_ancestor,
    format_bytes,
    free_space,
    open_for_read,
    open_for_write,
    pread_full,
    pwrite_full,
    space_margin,
)
from packer.preflight import (
    GpuInfo,
    ModelSizes,
    ODirectProbe,
    PreflightReport,
    RamInfo,
    probe_gpu,
    probe_odirect,
    probe_ram,
    run_preflight,
)

ROLES = 3  # gate, up, down: the slices of one expert block (for the size of expert_hashes.bin)
SKEWED_HIT_EXPONENT = 1 / 3  # hit rate ~ f ** (1/3) on the benchmarks' skewed routing (module docstring)


class CatalogError(ValueError):
    """The catalogue file is missing, unreadable or names no such release."""


@dataclass(frozen=True)
class Release:
    """One downloadable GGUF release (one entry of resources/catalog.json)."""

    id: str
    name: str
    architecture: str
    repo: str
    include: str
    shards: int
    source_bytes: int
    dense_bytes: int
    moe_layers: int
    num_experts: int
    top_k: int
    expert_block_bytes: int
    per_token_expert_bytes: int
    quant_types: dict[str, str] = field(default_factory=dict)
    shard_pattern: str = ""
    unconfirmed: tuple[str, ...] = ()

    @property
    def expert_bytes(self) -> int:
        """All routed-expert blocks of the pack (every layer, every expert)."""
        return self.moe_layers * self.num_experts * self.expert_block_bytes

    @property
    def pack_bytes(self) -> int:
        """The pack on disk: expert blocks, their digests, dense.gguf (its header is a rounding error)."""
        return self.expert_bytes + self.moe_layers * self.num_experts * ROLES * DIGEST_SIZE + self.dense_bytes

    @property
    def shard_bytes(self) -> int:
        """The size of one shard of the split set (the largest, when they differ, is about this)."""
        return -(-self.source_bytes // max(1, self.shards))

    def sizes(self) -> ModelSizes:
        """What preflight needs to know about this release's pack."""
        return ModelSizes(architecture=self.architecture, pack_bytes=self.pack_bytes, dense_bytes=self.dense_bytes,
                          expert_block_bytes=self.expert_block_bytes, top_k=self.top_k, moe_layers=self.moe_layers,
                          num_experts=self.num_experts)


def load_catalog(path: str | os.PathLike) -> list[Release]:
    """The releases of a catalogue file (resources/catalog.json)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f for f in Release.__dataclass_fields__}
        return [Release(**{**{k: v for k, v in r.items() if k in known},
                           "unconfirmed": tuple(r.get("unconfirmed", ()))}) for r in data["releases"]]
    except OSError as exc:
        raise CatalogError(f"cannot read the model catalogue {path}: {exc.strerror}; reinstall ExpertDesk") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CatalogError(f"the model catalogue {path} is damaged ({exc}); reinstall ExpertDesk") from None


def find_release(releases: list[Release], name: str) -> Release:
    """The release whose id (or repo) is `name`, case-insensitive."""
    for r in releases:
        if name.lower() in (r.id.lower(), r.repo.lower()):
            return r
    known = ", ".join(r.id for r in releases)
    raise CatalogError(f"no release {name!r} in the catalogue; choose one of: {known}")


# --- the drive ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadProbe:
    """What a timed read of a freshly written file measured."""

    bytes_per_s: float
    direct: bool  # O_DIRECT reads (False: buffered after dropping the cache; may read from RAM)
    bytes_read: int
    seconds: float
    detail: str = ""


def probe_read_speed(directory: str | os.PathLike, *, seconds: float = 2.0, file_bytes: int = 256 * MIB,
                     block_bytes: int = 8 * MIB, threads: int = 8) -> ReadProbe:
    """Read rate of the drive holding `directory`: O_DIRECT reads of `block_bytes`, `threads` in flight.

    Writes a scratch file of `file_bytes` (O_DIRECT, so nothing of it stays in the page
    cache), then reads it block by block from several threads for `seconds`, as the
    expert store reads experts (one request per block, many at once), and deletes it.
    Where O_DIRECT is refused the file is written buffered, its cache dropped and read
    buffered: `direct` is then False and the rate may be RAM's, not the drive's.
    """
    block = max(4096, block_bytes // 4096 * 4096)
    nblocks = max(1, file_bytes // block)
    where = existing_ancestor(directory)
    fd_tmp, name = tempfile.mkstemp(prefix=".expertdesk-readprobe-", dir=where)
    os.close(fd_tmp)
    path = Path(name)
    buf = aligned_buffer(block)
    try:
        buf[:] = os.urandom(4096) * (block // 4096)  # not zeros: some drives compress or skip them
        fd, direct = open_for_write(path, True, create=False)
        try:
            for k in range(nblocks):
                pwrite_full(fd, memoryview(buf), k * block)
            os.fsync(fd)
            drop_cache(fd)
        finally:
            os.close(fd)
        fd, direct = open_for_read(path, direct)
        drop_cache(fd)
        counts = [0] * threads
        deadline = time.monotonic() + seconds
        t0 = time.monotonic()

        def reader(i: int) -> None:
            own = aligned_buffer(block)
            try:
                k = i
                while time.monotonic() < deadline:
                    pread_full(fd, memoryview(own), (k % nblocks) * block)
                    counts[i] += block
                    k += threads
            finally:
                own.close()

        workers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.monotonic() - t0
        os.close(fd)
        total = sum(counts)
        detail = "O_DIRECT reads" if direct else "buffered reads (O_DIRECT refused here): may be the page cache's speed"
        return ReadProbe(total / elapsed if elapsed > 0 else 0.0, direct, total, elapsed, detail)
    finally:
        buf.close()
        path.unlink(missing_ok=True)


# --- the estimate -----------------------------------------------------------------------------


@dataclass
class FitReport:
    """Does `release` fit this PC, and at what speed (see the module docstring for the model)."""

    release: Release
    target_dir: Path
    disk_free: int
    disk_needed_streaming: int  # pack + one shard + margin: packing while downloading, deleting shards
    disk_needed_full: int  # pack + the whole source + margin: download everything, then pack
    cache_vram_bytes: int
    host_cache_bytes: int
    read: ReadProbe
    preflight: PreflightReport

    @property
    def cache_fraction(self) -> float:
        """Share of all expert bytes the VRAM cache and the host-RAM tier hold together."""
        return min(1.0, (self.cache_vram_bytes + self.host_cache_bytes) / max(1, self.release.expert_bytes))

    @property
    def hit_range(self) -> tuple[float, float]:
        f = self.cache_fraction
        return f, f ** SKEWED_HIT_EXPONENT

    @property
    def ssd_bytes_per_token(self) -> tuple[float, float]:
        """SSD bytes one decoded token reads: (at the skewed hit rate, at the uniform one)."""
        low, high = self.hit_range
        per = self.release.per_token_expert_bytes
        return (1 - high) * per, (1 - low) * per

    @property
    def tokens_per_s(self) -> tuple[float | None, float | None]:
        """Decode tokens/s bound by the drive: (uniform routing, skewed routing); None: not drive-bound."""
        rate = self.read.bytes_per_s
        best, worst = self.ssd_bytes_per_token
        return (rate / worst if worst > 0 else None), (rate / best if best > 0 else None)

    @property
    def fits_disk(self) -> bool:
        return self.disk_free >= self.disk_needed_streaming

    @property
    def ok(self) -> bool:
        """The pack fits (packed while downloading) and no preflight check failed."""
        return self.fits_disk and self.preflight.ok

    def to_dict(self) -> dict[str, Any]:
        low, high = self.tokens_per_s
        return {
            "release": asdict(self.release) | {"pack_bytes": self.release.pack_bytes,
                                               "shard_bytes": self.release.shard_bytes},
            "target_dir": str(self.target_dir),
            "ok": self.ok,
            "disk": {"free_bytes": self.disk_free, "needed_streaming_bytes": self.disk_needed_streaming,
                     "needed_full_bytes": self.disk_needed_full, "fits": self.fits_disk},
            "cache": {"vram_bytes": self.cache_vram_bytes, "host_bytes": self.host_cache_bytes,
                      "fraction_of_experts": self.cache_fraction},
            "hit_rate_range": list(self.hit_range),
            "per_token_expert_bytes": self.release.per_token_expert_bytes,
            "ssd_bytes_per_token_range": list(self.ssd_bytes_per_token),
            "read_probe": asdict(self.read),
            "decode_tokens_per_s_range": [low, high],
            "preflight": self.preflight.to_dict(),
        }

    def lines(self) -> list[str]:
        """The report as the CLI prints it and the wizard shows it."""
        r = self.release
        low, high = self.tokens_per_s
        hit_low, hit_high = self.hit_range
        best, worst = self.ssd_bytes_per_token
        speed = ("the whole model fits in the caches: the drive does not limit decoding" if high is None
                 else f"{low or 0:.2f} to {high:.2f} tokens/s" if low is not None else f"up to {high:.2f} tokens/s")
        disk_verdict = "fits" if self.fits_disk else "does NOT fit"
        out = [
            f"{r.name}  [{r.id}]  {r.repo} ({r.include}, {r.shards} shards)",
            f"  disk: pack {format_bytes(r.pack_bytes)}; needs {format_bytes(self.disk_needed_streaming)} packing "
            f"while downloading (pack + one {format_bytes(r.shard_bytes)} shard), "
            f"{format_bytes(self.disk_needed_full)} downloading first; "
            f"{format_bytes(self.disk_free)} free in {self.target_dir}: {disk_verdict}",
            f"  caches: {format_bytes(self.cache_vram_bytes)} VRAM + {format_bytes(self.host_cache_bytes)} RAM = "
            f"{self.cache_fraction:.1%} of the {format_bytes(r.expert_bytes)} of experts",
            f"  per token: top-{r.top_k} of {r.num_experts} experts x {r.moe_layers} layers = "
            f"{format_bytes(r.per_token_expert_bytes)}; hit rate {hit_low:.0%}-{hit_high:.0%} -> "
            f"{format_bytes(best)}-{format_bytes(worst)} from the SSD",
            f"  drive: {format_bytes(self.read.bytes_per_s)}/s ({self.read.detail}, {self.read.seconds:.1f} s)",
            f"  expected decode speed (drive bound): {speed}",
        ]
        for c in self.preflight.checks:
            if c.status != "pass":
                out.append(f"  {c.status.upper()} {c.name}: {c.reason}" + (f" (fix: {c.fix})" if c.fix else ""))
        if r.unconfirmed:
            out.append(f"  not confirmed against the hub: {', '.join(r.unconfirmed)} (checked at download)")
        return out


def estimate_fit(
    release: Release,
    target_dir: str | os.PathLike,
    *,
    read_probe: ReadProbe | None = None,
    probe_seconds: float = 2.0,
    free_space_fn: Callable[[Path], tuple[int, int]] = free_space,
    gpu_fn: Callable[[], GpuInfo | None] = probe_gpu,
    ram_fn: Callable[[], RamInfo] = probe_ram,
    odirect_fn: Callable[[Path], ODirectProbe] = probe_odirect,
) -> FitReport:
    """Measure this PC against `release` (see the module docstring). The *_fn arguments and
    `read_probe` replace the real probes (tests, "what if"); one read probe serves many releases."""
    target = Path(target_dir)
    where = existing_ancestor(target)
    report = run_preflight(target, sizes=release.sizes(), free_space_fn=free_space_fn, gpu_fn=gpu_fn,
                           ram_fn=ram_fn, odirect_fn=odirect_fn)
    # The pack is written while shards arrive: the space check is for pack + one shard, not the pack alone.
    report.checks = [c for c in report.checks if c.name != "free_space"]
    free, _ = free_space_fn(where)
    pack = release.pack_bytes
    streaming = pack + release.shard_bytes + space_margin(pack)
    full = pack + release.source_bytes + space_margin(pack)
    probe = read_probe if read_probe is not None else probe_read_speed(where, seconds=probe_seconds)
    return FitReport(
        release=release, target_dir=target, disk_free=free, disk_needed_streaming=streaming,
        disk_needed_full=full, cache_vram_bytes=report.recommended.get("cache_vram_mib", 0) * MIB,
        host_cache_bytes=report.recommended.get("host_cache_mib", 0) * MIB, read=probe, preflight=report,
    )


# --- a pack already on disk, and the compute side ----------------------------------------------


def release_from_pack(pack_dir: str | os.PathLike, *, name: str | None = None) -> Release:
    """The catalogue entry a built pack would have, read from its manifest.

    Why: the benchmark (benchmarks/bench_fit.py) checks the estimate against a pack it
    can run, through the same `estimate_fit` a catalogue release goes through. The
    per-token bytes are what the expert store reads: top-k aligned expert reads per MoE
    layer (`LayerEntry.read_nbytes`)."""
    from expertpack import load_manifest

    m = load_manifest(pack_dir)
    reads = [layer.read_nbytes for layer in m.layers]
    source = sum(f.size for f in m.source_files)
    return Release(
        id=Path(pack_dir).name, name=name or Path(pack_dir).name, architecture=m.architecture, repo=str(pack_dir),
        include="(built pack)", shards=max(1, len(m.source_files)), source_bytes=source,
        dense_bytes=m.dense_file_size, moe_layers=m.num_layers, num_experts=m.num_experts, top_k=m.expert_used_count,
        expert_block_bytes=-(-sum(reads) // max(1, len(reads))),
        per_token_expert_bytes=m.expert_used_count * sum(reads),
    )


@dataclass(frozen=True)
class SpeedRange:
    """Decode tokens/s once compute is counted too, and which side limits it.

    A decode step costs the compute of a resident model (1 / compute_tokens_per_s) and the
    SSD time of its misses (bytes / drive rate). `low`: the two one after the other at the
    uniform hit rate; `high`: fully overlapped (the slower of the two) at the skewed one.
    `bound`: "compute" when compute alone takes longer than the worst-case reads, "drive"
    when the best-case reads take longer than compute, else "mixed"."""

    low: float
    high: float
    bound: str
    compute_tokens_per_s: float
    drive_tokens_per_s: tuple[float | None, float | None]


def speed_with_compute(report: FitReport, compute_tokens_per_s: float) -> SpeedRange:
    """Combine the drive bound of `report` with a measured compute rate (see SpeedRange)."""
    if compute_tokens_per_s <= 0:
        raise ValueError(f"compute rate must be positive, got {compute_tokens_per_s}")
    rate = max(report.read.bytes_per_s, 1e-9)
    best, worst = report.ssd_bytes_per_token
    compute_s = 1 / compute_tokens_per_s
    low = 1 / (compute_s + worst / rate)
    high = 1 / max(compute_s, best / rate)
    bound = "compute" if compute_s >= worst / rate else "drive" if best / rate >= compute_s else "mixed"
    return SpeedRange(low, high, bound, compute_tokens_per_s, report.tokens_per_s)
