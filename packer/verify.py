"""Verify an Expert Pack: structure, alignment, file hashes and every slice's SHA-256.

`verify_pack(dir)` reads every byte (full) or a fixed sample of slices (quick). Both
check that every file is a regular file inside the pack (no link, FIFO or device) of
its manifest size, experts.bin's header (geometry and the layout digest that binds the
manifest's blocks), expert_hashes.bin's SHA-256, and the dense file: its sampled
SHA-256, GGUF header, tensor table and metadata (`config_sha256`); full mode also
hashes the whole dense file. Slice digests are keyed by place (layer, expert, role,
tensor, type, shape, offset), so blocks swapped with their digests are found too.

Corrupted content is reported, never raised: the report names each bad slice by model
block, expert and role. Only a pack that cannot be read at all (no manifest, unknown
format version, a manifest that fails its own checks) raises PackError.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from expertpack import (
    DIGEST_SIZE,
    PackError,
    PackManifest,
    check_experts_file_header,
    check_same_file,
    config_sha256,
    dense_sample_digest,
    load_manifest,
    open_pack_file,
    pack_file_problem,
)
from packer.diskio import aligned_buffer, open_for_read, pread_full
from packer.gguf_source import GGUFFormatError, GGUFSource

ProgressFn = Callable[[int, int, float, float, str], None]


class CancelLike(Protocol):
    """What long operations (build, verify, download) poll to stop early: a threading.Event will do."""

    def is_set(self) -> bool: ...

MAX_PROBLEMS = 100  # a pack with thousands of bad slices is reported by its first hundred
READ_CHUNK = 32 << 20  # one read request; several run at once
GROUP_BYTES = 256 << 20  # blocks read per step (bounds the buffer, never a whole layer)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a pack. `block`/`expert`/`role` locate a bad slice."""

    kind: str  # structure | alignment | hashes | dense | slice | padding
    message: str
    block: int | None = None
    expert: int | None = None
    role: str | None = None


@dataclass
class VerifyReport:
    """What `verify_pack` found. `ok` is True only when no problem was found."""

    pack_dir: Path
    quick: bool
    problems: list[Problem] = field(default_factory=list)
    problems_omitted: int = 0
    slices_checked: int = 0
    slices_total: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: Problem) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        else:
            self.problems_omitted += 1

    def summary(self) -> str:
        """One line for people: verdict, what was checked, the first problem."""
        mode = "quick" if self.quick else "full"
        head = f"{self.pack_dir}: {mode} verify, {self.slices_checked}/{self.slices_total} slices checked"
        if self.ok:
            return f"{head}: OK"
        n = len(self.problems) + self.problems_omitted
        return f"{head}: {n} problem(s); first: {self.problems[0].message}"

    def to_dict(self) -> dict:
        return {
            "pack_dir": str(self.pack_dir),
            "ok": self.ok,
            "quick": self.quick,
            "problems": [asdict(p) for p in self.problems],
            "problems_omitted": self.problems_omitted,
            "slices_checked": self.slices_checked,
            "slices_total": self.slices_total,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
        }

    def raise_if_failed(self) -> None:
        """PackError naming the first problem, for callers that must not run a bad pack."""
        if not self.ok:
            raise PackError(
                self.pack_dir,
                f"pack failed verification: {self.problems[0].message}"
                + (f" (and {len(self.problems) + self.problems_omitted - 1} more)" if len(self.problems) > 1 else ""),
                "rebuild the pack with `expertdesk pack` (the SSD may be failing if this repeats)",
            )


class ProgressMeter:
    """Turns byte counts into `progress(done, total, rate, eta, phase)` calls.

    The rate is measured over the last few seconds, so the ETA follows the current
    phase's speed rather than the average since the start.
    """

    WINDOW_S = 5.0

    def __init__(self, callback: ProgressFn | None, total: int) -> None:
        self.callback = callback
        self.total = total
        self.done = 0
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    def advance(self, nbytes: int, phase: str) -> None:
        """Count `nbytes` more as done (0 just announces `phase`) and report."""
        self.done += nbytes
        if self.callback is None:
            return
        now = time.monotonic()
        samples = self._samples
        samples.append((now, self.done))
        while len(samples) > 2 and now - samples[1][0] >= self.WINDOW_S:
            samples.popleft()
        t0, d0 = samples[0]
        rate = (self.done - d0) / (now - t0) if now > t0 else 0.0
        total = max(self.total, self.done)
        eta = (total - self.done) / rate if rate > 0 else float("inf")
        self.callback(self.done, total, rate, eta, phase)

    def forward(self, phase: str) -> ProgressFn:
        """A progress callback for a sub-task whose bytes count towards this meter."""
        seen = [0]

        def callback(done: int, total: int, rate: float, eta: float, sub_phase: str) -> None:
            self.advance(done - seen[0], sub_phase or phase)
            seen[0] = done

        return callback


def verify_pack(pack_dir: str | os.PathLike, quick: bool = False, progress: ProgressFn | None = None) -> VerifyReport:
    """Check a finished pack; see the module doc. PackError only if it cannot be read at all."""
    pack_dir = Path(pack_dir)
    manifest = load_manifest(pack_dir)
    return verify_manifest(pack_dir, manifest, quick=quick, progress=progress)


def verify_manifest(
    pack_dir: str | os.PathLike,
    manifest: PackManifest,
    *,
    quick: bool = False,
    progress: ProgressFn | None = None,
    threads: int | None = None,
    check_dense_hash: bool = True,
) -> VerifyReport:
    """Verify the files in `pack_dir` against `manifest` (which may not be marked complete yet).

    The builder calls this before it marks a pack complete; `verify_pack` calls it on
    finished packs. `check_dense_hash=False` skips hashing dense.gguf (the builder
    computed that hash from the bytes it just wrote and fsynced).
    """
    pack_dir = Path(pack_dir)
    report = VerifyReport(pack_dir=pack_dir, quick=quick)
    t0 = time.monotonic()
    experts_path = pack_dir / manifest.experts_file
    n_roles = len(manifest.role_names)
    report.slices_total = manifest.num_layers * manifest.num_experts * n_roles

    # Structure: regular files inside the pack (no link, FIFO or device), of their sizes --------
    experts_ok = _check_size(report, pack_dir, manifest.experts_file, manifest.experts_file_size)
    hashes_size = manifest.hashes_file_size
    hashes_ok = _check_size(report, pack_dir, manifest.hashes_file, hashes_size)
    dense_ok = _check_size(report, pack_dir, manifest.dense_file, manifest.dense_file_size)
    if experts_ok:
        # The header holds the layout digest: a manifest edited after the build stops here,
        # and its slices are not hashed (every one would differ).
        try:
            fd = open_pack_file(pack_dir, manifest.experts_file)
            try:
                head = os.pread(fd, manifest.alignment, 0)
            finally:
                os.close(fd)
            check_experts_file_header(head, manifest, experts_path)
        except PackError as exc:
            report.add(Problem("structure", exc.problem))
            experts_ok = False
    _check_alignment(report, manifest)

    samples = _quick_samples(manifest) if quick else None
    read_total = (
        (sum(manifest.layers[li].read_nbytes for li, _ in samples) if samples is not None
         else manifest.experts_file_size - manifest.data_start)
        + hashes_size
        + (manifest.dense_file_size if dense_ok and not quick and check_dense_hash else 0)
    )
    meter = ProgressMeter(progress, read_total)

    # File hashes ------------------------------------------------------------------
    digests = b""
    if hashes_ok:
        fd = open_pack_file(pack_dir, manifest.hashes_file)
        with os.fdopen(fd, "rb") as f:
            digests = f.read(hashes_size + 1)
        report.bytes_read += len(digests)
        meter.advance(len(digests), "verify: hashes")
        if hashlib.sha256(digests).hexdigest() != manifest.hashes_sha256:
            report.add(Problem("hashes", f"{manifest.hashes_file} does not match its SHA-256 in the manifest"))
    if dense_ok:
        _check_dense(report, pack_dir, manifest, full=not quick and check_dense_hash, meter=meter)

    # Slices -----------------------------------------------------------------------
    if experts_ok and hashes_ok:
        expected = np.frombuffer(digests, dtype=np.uint8).reshape(
            manifest.num_layers, manifest.num_experts, n_roles, DIGEST_SIZE
        )
        # Quick mode reads single blocks: buffers of one stride (the runtime runs it at every load).
        group_bytes = manifest.expert_stride if samples is not None else GROUP_BYTES
        with BlockHasher(experts_path, manifest, threads=threads, group_bytes=group_bytes) as hasher:
            if samples is not None:
                for li, e in samples:
                    got = hasher.hash_blocks(li, e, e + 1, check_padding=True)
                    _compare(report, manifest, li, e, got, expected[li, e : e + 1])
                    meter.advance(manifest.layers[li].read_nbytes, "verify: experts")
            else:
                for li, e0, e1, got in hasher.iter_layers(range(manifest.num_layers), check_padding=True):
                    _compare(report, manifest, li, e0, got, expected[li, e0:e1])
                    meter.advance((e1 - e0) * manifest.expert_stride, "verify: experts")
            report.bytes_read += hasher.bytes_read
            for li, e, where in hasher.padding_errors:
                report.add(Problem(
                    "padding",
                    f"blk.{manifest.layers[li].block} expert {e}: nonzero bytes in the block padding at +{where}",
                    block=manifest.layers[li].block, expert=e,
                ))
    report.seconds = time.monotonic() - t0
    return report


def _check_size(report: VerifyReport, pack_dir: Path, name: str, expected: int) -> bool:
    """`name` is a regular file inside the pack (never a link, FIFO or device) of `expected` bytes."""
    problem = pack_file_problem(pack_dir, name)
    if problem is not None:
        report.add(Problem("structure", problem))
        return False
    size = os.lstat(pack_dir / name).st_size
    if size != expected:
        report.add(Problem("structure",
                           f"{name} is {size} bytes, the manifest says {expected} (truncated or damaged)"))
        return False
    return True


def _check_alignment(report: VerifyReport, manifest: PackManifest) -> None:
    a = manifest.alignment
    if manifest.data_start % a or manifest.expert_stride % a:
        report.add(Problem("alignment", f"data_start {manifest.data_start} / stride {manifest.expert_stride} "
                                        f"not multiples of {a}"))
    for layer in manifest.layers:
        for role in layer.roles:
            if role.offset % a:
                report.add(Problem("alignment",
                                   f"blk.{layer.block} role {role.name} at +{role.offset} is not {a}-aligned",
                                   block=layer.block, role=role.name))


def _check_dense(report: VerifyReport, pack_dir: Path, manifest: PackManifest, *, full: bool,
                 meter: ProgressMeter) -> None:
    """The dense file: its whole SHA-256 (`full`), always its sampled SHA-256 (what every load
    checks), its GGUF header and tensor table, and its metadata against `config_sha256`."""
    name = manifest.dense_file
    try:
        fd = open_pack_file(pack_dir, name)
    except PackError as exc:
        report.add(Problem("dense", exc.problem))
        return
    with os.fdopen(fd, "rb") as f:
        if full:
            digest = hashlib.sha256()
            while chunk := f.read(16 << 20):
                digest.update(chunk)
                report.bytes_read += len(chunk)
                meter.advance(len(chunk), "verify: dense")
            if digest.hexdigest() != manifest.dense_sha256:
                report.add(Problem("dense", f"{name} does not match its SHA-256 in the manifest"))
                return

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            report.bytes_read += length
            return f.read(length)

        try:
            sample = dense_sample_digest(manifest.dense_file_size, manifest.dense_header_bytes, read)
        except OSError as exc:
            report.add(Problem("dense", f"{name} could not be read ({exc})"))
            return
    if sample != manifest.dense_sample_sha256:
        report.add(Problem("dense", f"{name} does not match its sampled SHA-256 in the manifest (its header or "
                                    "weights changed)"))
        return
    # The GGUF header must parse, its tensor table fit in the file, its metadata be the pack's.
    expert_tensors = {r.tensor for layer in manifest.layers for r in layer.roles}
    try:
        with GGUFSource.open(pack_dir / name) as dense:
            names = set(dense.tensors)
            config = config_sha256(dense.metadata)
    except (GGUFFormatError, OSError) as exc:
        report.add(Problem("dense", f"{name} is not a readable GGUF ({exc})"))
        return
    want = manifest.source_tensor_count - len(expert_tensors)
    if len(names) != want or names & expert_tensors:
        report.add(Problem("dense", f"{name} holds {len(names)} tensors, expected {want}"))
    if config != manifest.config_sha256:
        report.add(Problem("dense", f"{name}'s metadata does not match config_sha256 in the manifest "
                                    "(another model's configuration)"))


def _quick_samples(manifest: PackManifest) -> list[tuple[int, int]]:
    """One expert per layer, chosen by a seed fixed by the pack, plus the first and last blocks."""
    rng = random.Random(manifest.config_sha256 + manifest.hashes_sha256)
    picks = {(0, 0), (manifest.num_layers - 1, manifest.num_experts - 1)}
    picks.update((li, rng.randrange(manifest.num_experts)) for li in range(manifest.num_layers))
    return sorted(picks)


def _compare(report: VerifyReport, manifest: PackManifest, li: int, e0: int, got: np.ndarray, want: np.ndarray) -> None:
    layer = manifest.layers[li]
    report.slices_checked += got.shape[0] * got.shape[1]
    if np.array_equal(got, want):
        return
    bad = np.argwhere(np.any(got != want, axis=2))
    for k, r in bad:
        role = layer.roles[int(r)].name
        e = e0 + int(k)
        report.add(Problem(
            "slice",
            f"blk.{layer.block} expert {e} role {role}: SHA-256 mismatch (the bytes on disk changed)",
            block=layer.block, expert=e, role=role,
        ))


class BlockHasher:
    """Reads expert blocks from experts.bin (O_DIRECT when the filesystem allows) and hashes slices.

    Reads run as several large requests at once and SHA-256 runs in the same worker
    threads (hashlib releases the GIL), so hashing a pack is bound by the disk.
    """

    def __init__(self, path: Path, manifest: PackManifest, *, threads: int | None = None,
                 group_bytes: int = GROUP_BYTES) -> None:
        self.manifest = manifest
        self.fd, self.direct = open_for_read(path, direct=True)
        try:
            check_same_file(self.fd, path.parent, path.name)  # no link or special file was followed
        except BaseException:
            os.close(self.fd)
            raise
        self.group = max(1, min(manifest.num_experts, group_bytes // manifest.expert_stride))
        self.buffers = [aligned_buffer(self.group * manifest.expert_stride) for _ in range(2)]
        self.pool = ThreadPoolExecutor(max_workers=threads or default_threads(), thread_name_prefix="pack-hash")
        # Two groups at once (one per buffer): the next group is read while this one is hashed.
        self._coord = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pack-hash-group")
        self.bytes_read = 0
        self.padding_errors: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> BlockHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._coord.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        os.close(self.fd)
        for buf in self.buffers:
            try:
                buf.close()
            except BufferError:  # a view still alive (e.g. in a traceback): the GC frees it later
                pass

    def hash_blocks(self, li: int, e0: int, e1: int, *, check_padding: bool = False, buffer: int = 0) -> np.ndarray:
        """Digests (e1-e0, roles, 32) of the blocks of experts [e0, e1) of pack layer `li`."""
        return self._submit(li, e0, e1, check_padding, self.buffers[buffer]).result()

    def iter_layers(self, layers: Sequence[int], *,
                    check_padding: bool = False) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """(li, e0, e1, digests) for every group of every layer, reading one group ahead."""
        groups = [(li, e0, min(e0 + self.group, self.manifest.num_experts))
                  for li in layers for e0 in range(0, self.manifest.num_experts, self.group)]
        pending: tuple[int, int, int, Future] | None = None  # the group submitted last: li, e0, e1, digests
        for k, (li, e0, e1) in enumerate(groups):
            fut = self._submit(li, e0, e1, check_padding, self.buffers[k % 2])
            if pending is not None:
                yield (*pending[:3], pending[3].result())
            pending = (li, e0, e1, fut)
        if pending is not None:
            yield (*pending[:3], pending[3].result())

    def _submit(self, li: int, e0: int, e1: int, check_padding: bool, buf) -> Future:
        # Coordinating threads run whole groups; they only wait on the worker pool, whose
        # tasks never wait, so nothing can deadlock.
        return self._coord.submit(self._group, li, e0, e1, check_padding, buf)

    def _group(self, li: int, e0: int, e1: int, check_padding: bool, buf) -> np.ndarray:
        m = self.manifest
        layer = m.layers[li]
        n = e1 - e0
        stride = m.expert_stride
        base = m.block_offset(li, e0)
        view = memoryview(buf)
        # Contiguous blocks: read them as a few large aligned requests at once.
        span = n * stride if n > 1 else layer.read_nbytes
        reads = [self.pool.submit(pread_full, self.fd, view[a : min(a + READ_CHUNK, span)], base + a)
                 for a in range(0, span, READ_CHUNK)]
        for f in reads:
            f.result()
        with self._lock:
            self.bytes_read += span
        roles = layer.roles
        out = np.zeros((n, len(roles), DIGEST_SIZE), dtype=np.uint8)

        whole = np.frombuffer(buf, dtype=np.uint8, count=span)
        block_len = stride if n > 1 else span

        def hash_one(k: int) -> None:
            at = k * stride
            for r, role in enumerate(roles):
                digest = m.slice_digest(li, e0 + k, r, view[at + role.offset : at + role.end])
                out[k, r] = np.frombuffer(digest, dtype=np.uint8)
            if check_padding:
                # The format says gaps are zero; anything else is damage even if no slice changed.
                block = whole[at : at + block_len]
                end = 0
                for role in roles:
                    if role.offset > end and block[end : role.offset].any():
                        self.padding_errors.append((li, e0 + k, end))
                    end = role.end
                if block[end:].any():
                    self.padding_errors.append((li, e0 + k, end))

        for f in [self.pool.submit(hash_one, k) for k in range(n)]:
            f.result()
        return out


def default_threads() -> int:
    """Worker threads for reading and hashing: enough to keep an NVMe queue busy and use every core."""
    return max(8, min(32, (os.cpu_count() or 2) + 4))
