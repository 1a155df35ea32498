"""Build an Expert Pack from a GGUF model (one file or a split set).

    build_pack("DeepSeek-V4-Flash-MXFP4-00001-of-00004.gguf", "/mnt/ssd/packs")

writes `/mnt/ssd/packs/DeepSeek-V4-Flash-MXFP4.expertpack/` as
docs/expert-pack-format.md describes: experts.bin (one aligned block per MoE layer
and expert), expert_hashes.bin, dense.gguf (everything else, a standard GGUF) and
manifest.json.

How it stays fast: per layer and role, groups of experts are read from the source as
large sequential requests straight into their places in an aligned assembly buffer
(~256 MiB, never a whole layer), hashed in worker threads while they are hot, and
written with O_DIRECT as a few large aligned requests in flight at once. Several
buffers rotate, so reading one group overlaps writing the previous one: the build is
bound by the disks, not by Python.

How it stays safe: everything is written under `NAME.expertpack.partial/` with a
`progress.json` journal. A layer is journaled only after its bytes and digests are
fsynced; a rerun re-hashes journaled layers from disk and redoes any that differ, or
starts over if the source changed. The manifest is marked complete, fsynced, and only
then is the directory renamed to its final name. A full disk removes the partial
directory and says how much space is needed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUF_VERSION, GGUFValueType

from expertpack import (
    ALIGNMENT,
    DENSE_NAME,
    DIGEST_SIZE,
    EXPERTS_NAME,
    FORMAT_VERSION,
    HASHES_NAME,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    PackError,
    PackManifest,
    SourceFile,
    align_up,
    config_sha256,
    dense_sample_sha256,
    experts_file_header,
    experts_geometry,
    fsync_dir,
    sha256_file,
    write_manifest,
)
from packer.adapters import ExpertPlan, plan_experts
from packer.diskio import (
    MIB,
    aligned_buffer,
    allocated_bytes,
    drop_cache,
    format_bytes,
    free_space,
    is_disk_full,
    mount_point,
    open_for_read,
    open_for_write,
    pread_full,
    pwrite_full,
    space_margin,
)
from packer.errors import PackBuildError
from packer.gguf_source import (
    GGUFFormatError,
    GGUFHeader,
    GGUFSource,
    MetadataField,
    TensorInfo,
    read_header,
    split_set_paths,
)
from packer.verify import BlockHasher, CancelLike, ProgressFn, ProgressMeter, default_threads, verify_manifest

__all__ = [
    "BuildCancelled",
    "BuildStats",
    "PackBuildError",
    "PackBuilder",
    "build_pack",
    "dense_layout",
    "estimate_pack_bytes",
    "pack_path_for",
    "plan_pack",
]

log = logging.getLogger(__name__)

PACK_SUFFIX = ".expertpack"
JOURNAL_NAME = "progress.json"
BUFFER_BYTES = 256 * MIB  # one assembly buffer: groups of experts, never a whole layer
NUM_BUFFERS = 3  # read one group while the previous ones are hashed and written
READ_CHUNK = 16 * MIB  # one source read request (several run at once; one staging buffer per thread)
WRITE_CHUNK = 32 * MIB  # one O_DIRECT write request (several run at once)
DENSE_CHUNK = 64 * MIB


class BuildCancelled(Exception):
    """The build was cancelled; the partial pack stays and a rerun resumes it."""



@dataclass
class BuildStats:
    """What a build did, for the CLI and the benchmark."""

    pack_dir: Path | None = None
    source_bytes: int = 0
    pack_bytes: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    direct_io: bool | None = None  # O_DIRECT used for experts.bin (None: nothing written)
    layers_resumed: int = 0  # journaled layers that re-verified and were kept
    layers_redone: int = 0  # journaled layers whose bytes no longer matched
    restarted: bool = False  # an old partial build of another source was discarded
    verified: str = ""  # "quick" or "full"
    source_deleted: bool = False
    phases: dict[str, float] = field(default_factory=dict)


def _tool_name() -> str:
    try:
        from importlib.metadata import version

        return f"expertdesk {version('expertdesk')}"
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "expertdesk 0.0.0"


def pack_path_for(source_file: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The pack directory a build of `source_file` into `out` produces.

    `out` ending in `.expertpack` is the pack itself; any other `out` is a folder
    that receives `MODEL.expertpack` (MODEL = the file name without `.gguf` and
    without the `-0000k-of-0000n` shard suffix).
    """
    out = Path(out)
    if out.name.endswith(PARTIAL_SUFFIX):
        raise PackBuildError(f"{out}: a pack name cannot end in {PARTIAL_SUFFIX} (that marks unfinished builds); "
                             "choose another name")
    if out.name.endswith(PACK_SUFFIX):
        return out
    first = split_set_paths(source_file)[0]
    stem = first.name[: -len(".gguf")] if first.name.endswith(".gguf") else first.stem
    if len(split_set_paths(source_file)) > 1:
        stem = stem.rsplit("-", 3)[0]  # NAME-00001-of-00003 -> NAME
    return out / f"{stem}{PACK_SUFFIX}"


# --- source headers and dense.gguf's header ---------------------------------------------


def _shard_headers(source: GGUFSource) -> list[GGUFHeader]:
    """Per shard: the header digest (fingerprint) and every metadata value's exact bytes.

    GGUFSource gives metadata as Python values; dense.gguf must carry each value with
    its original GGUF type and bytes (u32 vs i32, empty arrays, non-UTF-8 tokens), so
    the raw fields are read again with gguf_source's checked header reader.
    """
    try:
        return [read_header(path) for path in source.files]
    except (GGUFFormatError, OSError) as exc:  # validated by GGUFSource.open: anything now is a changed file
        path = getattr(exc, "path", None) or getattr(exc, "filename", None) or source.files[0]
        problem = getattr(exc, "problem", None) or getattr(exc, "strerror", None) or str(exc)
        raise GGUFFormatError(path, f"could not re-read the header ({problem})",
                              "the file changed during packing?") from None


def _gguf_string(text: str) -> bytes:
    """A GGUF string: u64 byte length, then the UTF-8 bytes."""
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def gguf_header_bytes(fields: Sequence[MetadataField], tensors: Sequence[TensorInfo], alignment: int) -> bytes:
    """The header of a GGUF v3 file holding `fields` and `tensors`, up to (not including) the padding
    before the tensor data.

    Layout (gguf-py's GGUFWriter writes the same bytes; the GGUF spec in llama.cpp's
    docs/gguf.md): u32 magic, u32 version, u64 tensor count, u64 metadata count; per
    metadata entry the key as a string, u32 value type, the value; per tensor the name,
    u32 dimension count, u64 dimensions (fastest first, `ne`), u32 GGML type and u64
    offset from the start of the data, each tensor padded to `alignment`.

    Written here from gguf's public constants instead of through GGUFWriter because the
    values are copied as stored (`MetadataField.data`), never re-encoded from Python
    values: GGUFWriter has no public way to write raw bytes, and cannot write an empty
    array at all.
    """
    out = bytearray(struct.pack("<IIQQ", GGUF_MAGIC, GGUF_VERSION, len(tensors), len(fields)))
    for f in fields:
        out += _gguf_string(f.key)
        out += struct.pack("<I", GGUFValueType(f.value_type))
        out += f.data
    offset = 0
    for t in tensors:
        out += _gguf_string(t.name)
        out += struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.ggml_type, offset)
        offset += align_up(t.nbytes, alignment)
    return bytes(out)


def _dense_fields(headers: Sequence[GGUFHeader]) -> list[MetadataField]:
    """dense.gguf's metadata: every key of the source but split.*, general.architecture first
    (as llama.cpp's writers put it), each key once (shard 1 wins)."""
    fields: dict[str, MetadataField] = {}
    for h in headers:
        for f in h.fields:
            if f.key not in fields and not f.key.startswith("split."):
                fields[f.key] = f
    arch = fields.pop("general.architecture")  # GGUFSource.open refuses a source without it
    return [arch, *fields.values()]


def plan_pack(source: GGUFSource) -> tuple[ExpertPlan, PackManifest, list[GGUFHeader]]:
    """The pack's whole layout (expert plan, manifest without digests, shard headers) from the
    source's headers alone: no tensor byte is read, so packing while downloading
    (packer.shard_pack) plans from header-only stand-ins exactly as a build plans from the files."""
    plan = plan_experts(source)
    entries = plan.layer_entries()
    data_start, stride, experts_size = experts_geometry(entries, plan.num_experts)
    headers = _shard_headers(source)
    manifest = PackManifest(
        architecture=plan.architecture,
        num_experts=plan.num_experts,
        expert_used_count=plan.expert_used_count,
        data_start=data_start,
        expert_stride=stride,
        layers=entries,
        experts_file_size=experts_size,
        hashes_sha256="",
        dense_sha256="",
        source_files=tuple(SourceFile(h.path.name, h.size, h.sha256) for h in headers),
        source_tensor_count=len(source.tensors),
        config_sha256=config_sha256(source.metadata),
        tool=_tool_name(),
    )
    return plan, manifest, headers


def dense_layout(headers: Sequence[GGUFHeader], tensors: Sequence[TensorInfo]) -> tuple[bytes, list[int], int]:
    """dense.gguf's header bytes, each tensor's offset in the file and the file's size: the header,
    zero padding to the alignment, then each tensor padded to it (what _write_dense writes)."""
    alignment = headers[0].alignment
    header = gguf_header_bytes(_dense_fields(headers), tensors, alignment)
    pos = align_up(len(header), alignment)
    offsets = []
    for t in tensors:
        offsets.append(pos)
        pos += align_up(t.nbytes, alignment)
    return header, offsets, pos


# --- size estimate ---------------------------------------------------------------------


def estimate_pack_bytes(source: GGUFSource, plan: ExpertPlan | None = None) -> int:
    """Bytes a pack of `source` will take on disk (experts, hashes, dense.gguf, manifest)."""
    plan = plan or plan_experts(source)
    entries = plan.layer_entries()
    _, _, experts_size = experts_geometry(entries, plan.num_experts)
    hashes = len(entries) * plan.num_experts * len(plan.role_names) * DIGEST_SIZE
    experts = plan.expert_tensor_names
    dense_data = sum(align_up(t.nbytes, 32) for t in source.tensors.values() if t.name not in experts)
    # dense.gguf's header is the source's metadata plus a shorter tensor table: bounded by shard 1's.
    first = min((t.offset for t in source.tensors.values() if t.file == source.files[0]), default=source.file_sizes[0])
    manifest = 4096 + 2048 * len(entries) * len(plan.role_names)
    return experts_size + hashes + dense_data + first + manifest


# --- journal ---------------------------------------------------------------------------


@dataclass
class _Journal:
    """progress.json: what an interrupted build may keep. Written atomically after fsynced data."""

    path: Path
    fingerprint: str
    layers: dict[int, str] = field(default_factory=dict)  # pack layer index -> sha256 of its digests
    dense_sha256: str | None = None

    @classmethod
    def load(cls, path: Path) -> _Journal | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                path=path,
                fingerprint=str(data["fingerprint"]),
                layers={int(k): str(v) for k, v in data["layers"].items()},
                dense_sha256=data.get("dense_sha256"),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        text = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "layers": {str(k): v for k, v in sorted(self.layers.items())},
                "dense_sha256": self.dense_sha256,
            },
            indent=1,
        )
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)


# --- the builder -----------------------------------------------------------------------


class PackBuilder:
    """One pack build; `build_pack` is the usual entry point, this class also exposes `stats`.

    Options beyond build_pack's: `overwrite` replaces an existing pack at the target;
    `buffer_bytes`, `num_buffers` and `threads` size the copy pipeline (tests use tiny
    buffers to get many groups per layer).
    """

    def __init__(
        self,
        source_path: str | os.PathLike,
        out_dir: str | os.PathLike,
        *,
        progress: ProgressFn | None = None,
        cancel: CancelLike | None = None,
        delete_source: bool = False,
        direct_io: bool | str = "auto",
        overwrite: bool = False,
        buffer_bytes: int = BUFFER_BYTES,
        num_buffers: int = NUM_BUFFERS,
        threads: int | None = None,
    ) -> None:
        if direct_io not in ("auto", True, False):
            raise ValueError(f"direct_io must be 'auto', True or False, not {direct_io!r}")
        self.source_path = Path(source_path)
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.cancel = cancel
        self.delete_source = delete_source
        self.direct_io = direct_io
        self.overwrite = overwrite
        self.buffer_bytes = int(buffer_bytes)
        self.num_buffers = max(1, int(num_buffers))
        self.threads = threads or default_threads()
        self.stats = BuildStats()
        self._meter: ProgressMeter | None = None
        self._fd_lock = threading.Lock()
        self._experts_fd = -1
        self._old_fds: list[int] = []
        self._direct = False
        self._experts_path: Path | None = None
        self._headers: list[GGUFHeader] = []

    # -- entry ----------------------------------------------------------------------
    def run(self) -> Path:
        """Build (or resume) the pack and return its final directory."""
        t0 = time.monotonic()
        try:
            source = GGUFSource.open(self.source_path)
        except FileNotFoundError:
            raise PackBuildError(f"{self.source_path}: no such file; "
                                 "choose the .gguf model file (or any shard of a split set)") from None
        try:
            path = self._run(source)
        finally:
            source.close()
        if self.delete_source:
            self._delete_source(source.files)
        self.stats.seconds = time.monotonic() - t0
        return path

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def _run(self, source: GGUFSource) -> Path:
        plan, manifest, headers = plan_pack(source)
        self._headers = headers
        manifest.validate(self.source_path)
        self.stats.source_bytes = source.total_bytes
        pack_bytes = estimate_pack_bytes(source, plan)
        self.stats.pack_bytes = pack_bytes

        final = pack_path_for(source.files[0], self.out_dir)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        self.stats.pack_dir = final
        replaced = self._check_target(final)

        fingerprint = _fingerprint(manifest, source, plan, headers)
        journal = _Journal.load(partial / JOURNAL_NAME) if partial.is_dir() else None
        if partial.exists():
            if journal is None and self._finish_renamed(partial, final, manifest):
                return final
            if journal is None or journal.fingerprint != fingerprint:
                # Another source, another layout, or an unreadable journal: nothing can be trusted.
                log.info("discarding %s: it was built from a different source", partial)
                self.stats.restarted = True
                shutil.rmtree(partial)
                journal = None

        # Refuse early when the pack cannot fit (what is already written counts as used).
        free, _ = free_space(final.parent)
        have = allocated_bytes(partial) + (allocated_bytes(final) if replaced else 0)
        need = pack_bytes + space_margin(pack_bytes) - have
        if free < need:
            raise PackBuildError(
                f"not enough free space: the pack needs {format_bytes(pack_bytes)} "
                f"(+{format_bytes(space_margin(pack_bytes))} margin), "
                f"{format_bytes(free + have)} free on {mount_point(final.parent)}; free space or choose another folder"
            )
        try:
            if replaced:
                shutil.rmtree(final)
                fsync_dir(final.parent)
            partial.mkdir(parents=True, exist_ok=True)
            fsync_dir(partial.parent)
            if journal is None:
                journal = _Journal(partial / JOURNAL_NAME, fingerprint)
                journal.save()
            return self._build(source, plan, manifest, partial, final, journal)
        except OSError as exc:
            if is_disk_full(exc):
                shutil.rmtree(partial, ignore_errors=True)
                free, _ = free_space(final.parent)
                raise PackBuildError(
                    f"the disk filled up while writing the pack: the pack needs {format_bytes(pack_bytes)}, "
                    f"{format_bytes(free)} free on {mount_point(final.parent)}; free space or choose another folder"
                ) from None
            raise PackBuildError(
                f"building {final.name} failed: {exc.strerror or exc} "
                f"({getattr(exc, 'filename', None) or 'I/O error'}); "
                "check the drives and run the same command again to resume"
            ) from None

    def _check_target(self, final: Path) -> bool:
        """True if an existing pack at `final` is to be replaced; PackBuildError if it must not be."""
        if not final.exists():
            return False
        if not self.overwrite:
            raise PackBuildError(
                f"{final} already exists; pass --overwrite to replace it, or choose another folder"
            )
        if final.is_dir() and ((final / MANIFEST_NAME).is_file() or not any(final.iterdir())):
            return True
        raise PackBuildError(f"{final} exists and is not an Expert Pack; refusing to replace it, choose another folder")

    def _finish_renamed(self, partial: Path, final: Path, manifest: PackManifest) -> bool:
        """A build killed between marking its manifest complete and renaming: finish the rename."""
        try:
            done = PackManifest.from_json((partial / MANIFEST_NAME).read_text(encoding="utf-8"))
        except (OSError, PackError):
            return False
        same = replace(manifest, hashes_sha256=done.hashes_sha256, dense_sha256=done.dense_sha256,
                       dense_file_size=done.dense_file_size, dense_header_bytes=done.dense_header_bytes,
                       dense_sample_sha256=done.dense_sample_sha256, complete=done.complete)
        if not done.complete or done != same:
            return False
        quick = not self.delete_source
        if not verify_manifest(partial, done, quick=quick, threads=self.threads).ok:
            return False
        (partial / JOURNAL_NAME).unlink(missing_ok=True)
        os.rename(partial, final)
        fsync_dir(final.parent)
        self.stats.verified = "quick" if quick else "full"
        return True

    # -- the build ------------------------------------------------------------------
    def _build(self, source, plan: ExpertPlan, manifest: PackManifest, partial: Path, final: Path,
               journal: _Journal) -> Path:
        E = manifest.num_experts
        stride = manifest.expert_stride
        layer_bytes = E * stride
        dense_tensors = [t for t in source.tensors.values() if t.name not in plan.expert_tensor_names]
        dense_bytes = sum(t.nbytes for t in dense_tensors)

        experts_path = self._experts_path = partial / EXPERTS_NAME
        hashes_path = partial / HASHES_NAME
        want_direct = self.direct_io is not False
        self._experts_fd, self._direct = open_for_write(experts_path, want_direct)
        if self.direct_io is True and not self._direct:
            os.close(self._experts_fd)
            raise PackBuildError(
                f"the filesystem of {partial.parent} does not support O_DIRECT, which was required; "
                "choose a folder on an ext4/xfs/btrfs NVMe drive or allow buffered writes"
            )
        hashes_fd = os.open(hashes_path, os.O_RDWR | os.O_CREAT, 0o644)
        sources: _SourceFiles | None = None
        pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="pack-io")
        try:
            os.ftruncate(self._experts_fd, manifest.experts_file_size)
            os.ftruncate(hashes_fd, manifest.hashes_file_size)
            header = aligned_buffer(ALIGNMENT)
            header[:] = experts_file_header(manifest)
            self._write(memoryview(header), 0)
            header.close()

            verify_bytes = ((manifest.experts_file_size + dense_bytes) if self.delete_source
                            else (manifest.num_layers + 2) * stride)
            journaled = sum(1 for li in journal.layers if 0 <= li < manifest.num_layers)
            dense_todo = dense_bytes
            # Journaled layers count once (re-checked); any that fail the re-check are added back below.
            self._meter = ProgressMeter(self.progress, manifest.num_layers * layer_bytes + dense_bytes + verify_bytes)
            kept = self._recheck_layers(partial, manifest, journal, hashes_fd)
            todo = [li for li in range(manifest.num_layers) if li not in kept]
            self._meter.total += (journaled - len(kept)) * layer_bytes  # layers that must be written after all
            if journal.dense_sha256 and self._dense_intact(partial, journal):
                dense_todo = 0
                self._meter.advance(dense_bytes, "resume: dense.gguf intact")

            sources = _SourceFiles(source.files, direct=self.direct_io is not False)

            t = time.monotonic()
            self._copy_experts(plan, manifest, todo, sources, pool, hashes_fd, journal)
            self.stats.phases["experts"] = time.monotonic() - t
            self.stats.direct_io = self._direct

            t = time.monotonic()
            if dense_todo:
                journal.dense_sha256 = None
                journal.save()
                journal.dense_sha256 = self._write_dense(dense_tensors, partial / DENSE_NAME, sources.buffered, pool)
                journal.save()
            self.stats.phases["dense"] = time.monotonic() - t
        finally:
            pool.shutdown(wait=True)
            if sources is not None:
                sources.close()
            for fd in [hashes_fd, self._experts_fd, *self._old_fds]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._old_fds.clear()

        # Finish: hash of the hashes, verify from disk, mark complete, rename.
        t = time.monotonic()
        # dense.gguf was found intact or written above, so dense_sha256 is set; only a model with
        # no dense tensors (dense_bytes == 0) would leave it None.
        manifest = replace(manifest, hashes_sha256=sha256_file(hashes_path),
                           dense_sha256=journal.dense_sha256,  # type: ignore[arg-type]
                           **dense_fingerprint(partial / DENSE_NAME))
        quick = not self.delete_source
        self._phase("verify")
        report = verify_manifest(
            partial, manifest, quick=quick, threads=self.threads,
            progress=self._meter.forward("verify") if self._meter else None,
            check_dense_hash=not quick,
        )
        if not report.ok:
            bad = {manifest.layer_index(p.block) for p in report.problems if p.block is not None}
            for li in bad:
                journal.layers.pop(li, None)
            if any(p.kind == "dense" for p in report.problems):
                journal.dense_sha256 = None
            journal.save()
            raise PackBuildError(
                f"the new pack failed verification when read back ({report.problems[0].message}); "
                "run the same command again to rewrite the damaged parts, and check the drive if it repeats"
            )
        self.stats.verified = "quick" if quick else "full"
        write_manifest(partial, replace(manifest, complete=True))
        (partial / JOURNAL_NAME).unlink()
        fsync_dir(partial)
        os.rename(partial, final)
        fsync_dir(final.parent)
        self.stats.phases["finish"] = time.monotonic() - t
        self._phase("done")
        return final

    def _phase(self, name: str) -> None:
        if self._meter is not None:
            self._meter.advance(0, name)

    def _check_cancel(self) -> None:
        if self._cancelled():
            raise BuildCancelled("pack build cancelled; run the same command again to resume it")

    # -- experts ----------------------------------------------------------------------
    def _recheck_layers(self, partial: Path, manifest: PackManifest, journal: _Journal, hashes_fd: int) -> set[int]:
        """Layers the journal calls done whose bytes on disk still hash to their digests."""
        if not journal.layers:
            return set()
        E, R = manifest.num_experts, len(manifest.role_names)
        chunk = E * R * DIGEST_SIZE
        layers = sorted(li for li in journal.layers if 0 <= li < manifest.num_layers)
        meter = self._meter
        assert meter is not None  # made by _build before the re-check
        kept: set[int] = set()
        expected: dict[int, bytes] = {}
        for li in layers:
            data = os.pread(hashes_fd, chunk, li * chunk)
            if hashlib.sha256(data).hexdigest() == journal.layers[li]:
                expected[li] = data
        with BlockHasher(partial / EXPERTS_NAME, manifest, threads=self.threads,
                         group_bytes=self.buffer_bytes) as hasher:
            good = {li: True for li in expected}
            for li, e0, e1, got in hasher.iter_layers(sorted(expected)):
                want = np.frombuffer(expected[li], dtype=np.uint8).reshape(E, R, DIGEST_SIZE)[e0:e1]
                if not np.array_equal(got, want):
                    good[li] = False
                meter.advance((e1 - e0) * manifest.expert_stride, "resume: re-checking written layers")
                self._check_cancel()
        for li in layers:
            if li not in expected:  # its digests in expert_hashes.bin were damaged: re-check skipped
                meter.advance(E * manifest.expert_stride, "resume: re-checking written layers")
        kept = {li for li, ok in good.items() if ok}
        self.stats.layers_resumed = len(kept)
        self.stats.layers_redone = len(layers) - len(kept)
        for li in layers:
            if li not in kept:
                journal.layers.pop(li)
        if self.stats.layers_redone:
            journal.save()
        return kept

    def _copy_experts(self, plan: ExpertPlan, manifest: PackManifest, todo: list[int], sources: _SourceFiles,
                      pool, hashes_fd: int, journal: _Journal) -> None:
        if not todo:
            return
        meter = self._meter
        assert meter is not None  # made by _build before the copy
        E, R, stride = manifest.num_experts, len(manifest.role_names), manifest.expert_stride
        group = max(1, min(E, self.buffer_bytes // stride))
        groups = [(li, e0, min(E, e0 + group)) for li in todo for e0 in range(0, E, group)]
        nbuf = min(self.num_buffers, len(groups))
        free_buffers = [aligned_buffer(group * stride) for _ in range(nbuf)]
        all_buffers = list(free_buffers)
        coordinators = ThreadPoolExecutor(max_workers=nbuf, thread_name_prefix="pack-group")
        digests = {li: np.zeros((E, R, DIGEST_SIZE), dtype=np.uint8) for li in todo}
        remaining = {li: 0 for li in todo}
        for li, _, _ in groups:
            remaining[li] += 1
        inflight: deque[tuple[int, int, int, Any, Future]] = deque()

        def finish_oldest() -> None:
            li, e0, e1, buf, fut = inflight.popleft()
            got = fut.result()
            free_buffers.append(buf)
            digests[li][e0:e1] = got
            remaining[li] -= 1
            meter.advance((e1 - e0) * stride, f"copying experts: layer {li + 1} of {manifest.num_layers}")
            if remaining[li] == 0:
                self._commit_layer(manifest, li, digests.pop(li), hashes_fd, journal)

        try:
            for li, e0, e1 in groups:
                if self._cancelled():
                    break
                if not free_buffers:
                    finish_oldest()
                buf = free_buffers.pop()
                fut = coordinators.submit(self._copy_group, plan, manifest, li, e0, e1, buf, sources, pool)
                inflight.append((li, e0, e1, buf, fut))
            while inflight:
                finish_oldest()
        finally:
            # Never leave a thread writing into a buffer or fd that is about to be closed.
            for *_, fut in inflight:
                fut.exception()
            coordinators.shutdown(wait=True)
            for buf in all_buffers:
                try:
                    buf.close()
                except BufferError:
                    pass
        self._check_cancel()

    def _copy_group(self, plan: ExpertPlan, manifest: PackManifest, li: int, e0: int, e1: int, buf,
                    sources: _SourceFiles, pool) -> np.ndarray:
        """Assemble blocks [e0, e1) of layer li in `buf`, hash every slice, write them; return digests."""
        stride = manifest.expert_stride
        entry = manifest.layers[li]
        roles = plan.layers[li].roles
        n = e1 - e0
        view = memoryview(buf)
        arr = np.frombuffer(buf, dtype=np.uint8, count=n * stride)
        # The gaps after each role are zero in the format; the buffer may hold an older layer there.
        gaps = [(r.end, nxt.offset) for r, nxt in zip(entry.roles, entry.roles[1:]) if nxt.offset > r.end]
        gaps.append((entry.roles[-1].end, stride))
        blocks = arr.reshape(n, stride)
        for a, b in gaps:
            blocks[:, a:b] = 0
        out = np.zeros((n, len(roles), DIGEST_SIZE), dtype=np.uint8)
        tasks = []
        for r, (rp, re) in enumerate(zip(roles, entry.roles)):
            per_read = max(1, READ_CHUNK // rp.nbytes)
            for a in range(0, n, per_read):
                b = min(n, a + per_read)
                targets = [view[k * stride + re.offset : k * stride + re.end] for k in range(a, b)]
                tasks.append(pool.submit(_read_and_hash, sources, rp, e0 + a, targets, out[a:b, r],
                                         lambda e, data, r=r: manifest.slice_digest(li, e, r, data)))
        for t in tasks:
            t.result()
        base = manifest.block_offset(li, e0)
        span = n * stride
        writes = [pool.submit(self._write, view[a : min(a + WRITE_CHUNK, span)], base + a)
                  for a in range(0, span, WRITE_CHUNK)]
        for w in writes:
            w.result()
        del view, arr, blocks
        return out

    def _write(self, view: memoryview, offset: int) -> None:
        """pwrite to experts.bin; switch to buffered writes if the filesystem rejects O_DIRECT writes."""
        fd = self._experts_fd
        try:
            pwrite_full(fd, view, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self._direct or self.direct_io is True:
                raise
            with self._fd_lock:
                if self._experts_fd == fd:  # first thread to notice swaps the descriptor
                    log.warning("O_DIRECT writes refused on this filesystem; using buffered writes + fsync")
                    self._old_fds.append(fd)
                    assert self._experts_path is not None  # set by _build with the descriptor
                    self._experts_fd, self._direct = open_for_write(self._experts_path, False, create=False)
            pwrite_full(self._experts_fd, view, offset)

    def _commit_layer(self, manifest: PackManifest, li: int, digests: np.ndarray, hashes_fd: int,
                      journal: _Journal) -> None:
        """Make layer li durable (data, then its digests, then the journal entry)."""
        os.fsync(self._experts_fd)
        if not self._direct:
            # Buffered writes went through the page cache; drop them so a terabyte does not evict everything.
            drop_cache(self._experts_fd, manifest.block_offset(li, 0), manifest.num_experts * manifest.expert_stride)
        data = digests.tobytes()
        pwrite_full(hashes_fd, memoryview(data), li * len(data))
        os.fsync(hashes_fd)
        journal.layers[li] = hashlib.sha256(data).hexdigest()
        journal.save()
        self.stats.bytes_copied += manifest.num_experts * manifest.expert_stride

    # -- dense.gguf ---------------------------------------------------------------------
    def _dense_intact(self, partial: Path, journal: _Journal) -> bool:
        path = partial / DENSE_NAME
        return path.is_file() and sha256_file(path) == journal.dense_sha256

    def _write_dense(self, tensors: list[TensorInfo], path: Path, source_fds, pool) -> str:
        """Write dense.gguf: all metadata but split.*, every non-expert tensor; return its SHA-256."""
        meter = self._meter
        assert meter is not None  # made by _build before dense.gguf is written
        alignment = self._headers[0].alignment
        header = gguf_header_bytes(_dense_fields(self._headers), tensors, alignment)
        header_len = len(header)
        with open(path, "wb") as f:
            f.write(header)

        # The file's SHA-256 is computed from the bytes as they are written: header, then data.
        digest = hashlib.sha256(header)
        # (source fd, offset, length, padding after it): tensors in chunks, each tensor padded.
        chunks = []
        for t in tensors:
            for a in range(0, t.nbytes, DENSE_CHUNK):
                n = min(DENSE_CHUNK, t.nbytes - a)
                pad = align_up(t.nbytes, alignment) - t.nbytes if a + n == t.nbytes else 0
                chunks.append((source_fds[t.file], t.offset + a, n, pad))
        zeros = memoryview(bytes(alignment))
        bufs = [aligned_buffer(DENSE_CHUNK) for _ in range(2)] if chunks else []
        fd = os.open(path, os.O_WRONLY)
        pending: Future | None = None
        try:
            pos = align_up(header_len, alignment)
            digest.update(zeros[: pos - header_len])
            pwrite_full(fd, zeros[: pos - header_len], header_len)

            def read(i: int) -> memoryview:
                src_fd, off, n, _ = chunks[i]
                view = memoryview(bufs[i % 2])[:n]
                pread_full(src_fd, view, off)
                return view

            # Read chunk i+1 while chunk i is hashed and written.
            pending = pool.submit(read, 0) if chunks else None
            for i, (src_fd, off, n, pad) in enumerate(chunks):
                self._check_cancel()
                assert pending is not None  # chunk i was submitted before this iteration
                data = pending.result()
                pending = pool.submit(read, i + 1) if i + 1 < len(chunks) else None
                digest.update(data)
                pwrite_full(fd, data, pos)
                pos += n
                if pad:
                    digest.update(zeros[:pad])
                    pwrite_full(fd, zeros[:pad], pos)
                    pos += pad
                drop_cache(src_fd, off, n)
                meter.advance(n, "writing dense.gguf")
                del data
            os.fsync(fd)
            drop_cache(fd)
        finally:
            if pending is not None:
                pending.exception()  # never free a buffer a read is still filling
            os.close(fd)
            for b in bufs:
                try:
                    b.close()
                except BufferError:  # a view still alive in a traceback: the GC frees it
                    pass
        return digest.hexdigest()

    # -- source deletion ----------------------------------------------------------------
    def _delete_source(self, files: list[Path]) -> None:
        """Remove the source GGUF files (only reached after a full verify of the new pack)."""
        if self.stats.verified != "full":
            raise PackBuildError("the source was not deleted: the pack has not passed a full verification")
        for path in files:
            path.unlink()
        for parent in {p.parent for p in files}:
            fsync_dir(parent)
        self.stats.source_deleted = True


def _read_and_hash(sources: _SourceFiles, role: Any, first: int, targets: list[memoryview], out: np.ndarray,
                   digest: Callable[[int, memoryview], bytes]) -> None:
    """Read consecutive experts of one role (contiguous in the source) into their blocks, hash each
    (`digest(expert, bytes)`: the manifest's keyed slice digest)."""
    sources.read_slices(role.tensor.file, role.source_offset(first), role.nbytes, targets)
    for k, t in enumerate(targets):
        out[k] = np.frombuffer(digest(first + k, t), dtype=np.uint8)


class _SourceFiles:
    """Open source files for the bulk copy: O_DIRECT where the filesystem allows, else buffered.

    O_DIRECT lets one large request go to the drive as many parallel commands (buffered
    reads trickle through readahead) and keeps a terabyte out of the page cache. GGUF
    offsets are only 32-aligned, so a direct read covers the aligned superset of the
    range in a per-thread staging buffer and the slices are copied into their blocks
    (numpy copies release the GIL); when a range happens to be aligned, it is read
    straight into the blocks.
    """

    def __init__(self, paths: list[Path], direct: bool) -> None:
        self.buffered: dict[Path, int] = {}
        self.direct: dict[Path, int | None] = {}
        self._fds: list[int] = []
        self._local = threading.local()
        self._staging: list[Any] = []
        self._lock = threading.Lock()
        for path in paths:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._fds.append(fd)
            self.buffered[path] = fd
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            dfd, used = open_for_read(path, direct) if direct else (None, False)
            if used:
                assert dfd is not None  # open_for_read used O_DIRECT: a descriptor
                self._fds.append(dfd)
            elif dfd is not None:
                os.close(dfd)
            self.direct[path] = dfd if used else None

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for buf in self._staging:
            try:
                buf.close()
            except BufferError:
                pass

    def _stage(self, nbytes: int):
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = aligned_buffer(nbytes)
            with self._lock:
                self._staging.append(buf)
            self._local.buf = buf
        return buf

    def read_slices(self, path: Path, offset: int, nbytes: int, targets: list[memoryview]) -> None:
        """Read len(targets) consecutive slices of `nbytes` starting at `offset` into `targets`."""
        fd = self.direct.get(path)
        if fd is not None:
            try:
                self._read_direct(fd, offset, nbytes, targets)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("O_DIRECT reads refused for %s; reading it buffered", path)
                self.direct[path] = None
        fd = self.buffered[path]
        for i in range(0, len(targets), 512):  # IOV_MAX is 1024 on Linux
            _preadv_full(fd, targets[i : i + 512], offset + i * nbytes)
        drop_cache(fd, offset, len(targets) * nbytes)

    def _read_direct(self, fd: int, offset: int, nbytes: int, targets: list[memoryview]) -> None:
        length = nbytes * len(targets)
        start = offset - offset % ALIGNMENT
        delta = offset - start
        if delta == 0 and nbytes % ALIGNMENT == 0:
            for i in range(0, len(targets), 512):
                _preadv_full(fd, targets[i : i + 512], offset + i * nbytes)
            return
        span = align_up(delta + length)
        buf = self._stage(span)
        view = memoryview(buf)
        got = 0
        while got < delta + length:
            n = os.preadv(fd, [view[got:span]], start + got)
            if n <= 0:
                raise OSError(errno.EIO, f"unexpected end of file at byte {start + got} (file truncated?)")
            got += n
        data = np.frombuffer(buf, dtype=np.uint8, count=span)
        for k, t in enumerate(targets):
            np.frombuffer(t, dtype=np.uint8)[:] = data[delta + k * nbytes : delta + (k + 1) * nbytes]
        del view, data


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> None:
    """preadv that retries short reads; EOF early means the source file shrank."""
    total = sum(len(v) for v in views)
    done = os.preadv(fd, views, offset)
    if done == total:
        return
    for v in views:  # rare: a short read; finish view by view
        n = len(v)
        if done >= n:
            done -= n
            offset += n
            continue
        pread_full(fd, v[done:], offset + done)
        offset += n
        done = 0


def dense_fingerprint(path: Path) -> dict[str, Any]:
    """The manifest's quick fingerprint of the dense file just written: size, GGUF header
    length and the sampled SHA-256 that every load checks (expertpack.dense_sample_sha256)."""
    size = path.stat().st_size
    header_bytes = read_header(path).data_offset
    return {"dense_file_size": size, "dense_header_bytes": header_bytes,
            "dense_sample_sha256": dense_sample_sha256(path, size, header_bytes)}


FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 64 * 1024


def _data_samples_sha256(path: Path, data_offset: int) -> str:
    """SHA-256 of a few fixed 64 KiB samples of a file's tensor data (and its last bytes).

    Two files can share a header (a fine-tune with unchanged metadata, a re-download
    of another revision), so resuming trusts a partial pack only if the data agrees
    at these places too. 17 small reads per file: free next to copying it.
    """
    size = path.stat().st_size
    digest = hashlib.sha256()
    span = max(0, size - data_offset)
    with open(path, "rb") as f:
        points = [data_offset + span * k // FINGERPRINT_SAMPLES for k in range(FINGERPRINT_SAMPLES)]
        points.append(max(data_offset, size - FINGERPRINT_SAMPLE_BYTES))
        for at in points:
            f.seek(at)
            digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()


def _fingerprint(manifest: PackManifest, source: GGUFSource, plan: ExpertPlan, headers: list[GGUFHeader]) -> str:
    """Identity of a build: same source files, metadata and layout -> same partial pack may be resumed."""
    data = {
        "samples": [_data_samples_sha256(h.path, h.data_offset) for h in headers],
        "format_version": FORMAT_VERSION,
        "source": [(f.name, f.size, f.header_sha256) for f in manifest.source_files],
        "config": manifest.config_sha256,
        "layout": json.loads(replace(manifest, tool="").to_json())["layers"],
        "geometry": [manifest.data_start, manifest.expert_stride, manifest.experts_file_size],
        "dense": [(t.name, t.ggml_type, t.nbytes) for t in source.tensors.values()
                  if t.name not in plan.expert_tensor_names],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def build_pack(
    source_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: ProgressFn | None = None,
    cancel: CancelLike | None = None,
    delete_source: bool = False,
    direct_io: bool | str = "auto",
    overwrite: bool = False,
    **options: Any,
) -> Path:
    """Build the Expert Pack of a GGUF model and return the pack directory.

    source_path: a .gguf file or any shard of a split set. out_dir: the pack
    directory (`NAME.expertpack`) or a folder to put `MODEL.expertpack` in.
    progress(done_bytes, total_bytes, rate_bytes_per_s, eta_s, phase) is called from
    this thread as work completes; cancel (a threading.Event) stops the build at the
    next group with BuildCancelled (rerun to resume). direct_io: "auto" uses O_DIRECT
    where the filesystem supports it, True requires it, False writes buffered.
    delete_source removes the source files after a full verification of the pack.
    An existing pack at the target is an error unless overwrite=True.
    Raises PackBuildError (with what to do), GGUFFormatError for a broken source,
    BuildCancelled.
    """
    return PackBuilder(
        source_path, out_dir, progress=progress, cancel=cancel, delete_source=delete_source,
        direct_io=direct_io, overwrite=overwrite, **options,
    ).run()
