"""The SSD side of the expert runtime: whole expert blocks from experts.bin, by O_DIRECT.

One manifest lookup gives an expert's byte range (`block_offset`, `read_nbytes`); the
store reads it into an aligned host buffer as `read_splits` aligned sub-reads issued
in parallel on `io_threads` reader threads (os.preadv releases the GIL, so the reads
really overlap and the drive sees a deep queue); behind a queue that already holds
WHOLE_READS_BEHIND sub-reads for every reader thread, an expert is read whole. `submit`
returns at once; many experts can be in flight together. A sub-read costs its thread
little Python (a task off a queue, the read, one lock to count it): the decode thread
competes with the readers for the GIL, hundreds of times a token.

Direct I/O is the default. Everything it depends on (pack offsets, read ranges,
buffer addresses, filesystem support) is checked at start-up and the store refuses
to start (`RuntimeStartError`) rather than silently falling back to the page cache.
`direct_io=False` chooses the buffered path explicitly; its reads are counted in
`buffered_reads`.

`rate_limit_bytes_per_s` caps the bytes the store delivers per second, across all of
its read threads (`ReadRateLimiter`): benchmarks serve a pack from RAM (tmpfs) through
this real read path and emulate a PC's NVMe drive (7 GB/s PCIe 4, 12.5 GB/s PCIe 5)
on a machine whose own disk is slower. Off (None) by default, and then free.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import os
import queue
import stat
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Literal

import torch

from expertpack import (
    ALIGNMENT,
    DIGEST_SIZE,
    PackError,
    PackManifest,
    align_up,
    check_experts_file_header,
    load_manifest,
    open_pack_file,
    pack_file_problem,
)

from . import platform_io, staging
from .errors import DirectIOUnsupportedError, ExpertReadError, RuntimeStartError
from .telemetry import Telemetry

O_DIRECT = getattr(os, "O_DIRECT", 0)

# A non-urgent read waits at most this long for the urgent ones in flight to end
# (`later_after_urgent`): one decode layer's misses take a few ms on a PC's drive, tens of
# ms on a slow one.
LATER_HOLD_S = 0.05

# An expert submitted behind this many queued sub-reads per reader thread is read whole
# (`submit`): a decode layer's misses and guesses (Kimi-K3: 8 experts, 5 sub-reads each
# on the H100 machine's emulation, against 16 threads) stay below it.
WHOLE_READS_BEHIND = 4

# errno values that mean the drive or the file went away under us.
_GONE_ERRNOS = frozenset({errno.ENODEV, errno.ENXIO, errno.ENOENT, errno.EBADF, errno.ESTALE})


class ShortReadError(OSError):
    """The file ended before the expert's block did (truncated or replaced pack)."""


def split_ranges(nbytes: int, splits: int, alignment: int = ALIGNMENT) -> list[tuple[int, int]]:
    """Cut `nbytes` into at most `splits` aligned (offset, length) sub-ranges covering it."""
    part = align_up(-(-nbytes // max(1, splits)), alignment)
    return [(start, min(part, nbytes - start)) for start in range(0, nbytes, part)]


def no_direct_io_message(path: Path) -> str:
    return (
        f"the filesystem at {path.parent} does not support O_DIRECT (it rejected an aligned "
        f"direct read of {path.name}); move the pack to an ext4/xfs/btrfs/NTFS drive or run "
        "with --buffered-io to read through the page cache"
    )


class ReadRateLimiter:
    """A cap on the bytes per second delivered by one store's read threads: an emulated drive.

    Each sub-read calls `start(nbytes)` before its real read and `finish(ticket)` after
    it; `finish` returns once the emulated drive has delivered those bytes. The aggregate
    rate never exceeds the cap however many reads are in flight, and no credit builds up
    while the drive idles (a burst after a pause is served at the cap too, as by a real
    drive running at its sequential peak). How the rate is divided among the reads in
    flight is `shared`:

    - False (first come, first served): each read is booked on one clock at max(now,
      the end of the previous booking) and ends nbytes / rate later. A read started
      behind others never slows them: a drive that serves its queue in order (each die's
      queue of page reads in arrival order, the way a large read striped over every die
      behaves).
    - True (processor sharing): the reads in flight share the rate equally, each at
      rate / n while n are in flight; a read started later slows every read already in
      flight. The pessimistic model of a drive that serves its whole queue at once: a
      guess read started beside a layer's misses delays them.

    Shared is fluid-flow bookkeeping on a virtual clock: `_served` is the bytes each
    read in flight has been served since the drive last idled (it grows at rate / n),
    and a read of nbytes started when it stood at v is done when it reaches v + nbytes.
    """

    def __init__(self, bytes_per_s: float, *, shared: bool = False, clock=time.perf_counter,
                 sleep=time.sleep) -> None:
        if not (bytes_per_s > 0 and bytes_per_s != float("inf")):
            raise RuntimeStartError(f"rate_limit_bytes_per_s is {bytes_per_s}; use a positive number or None")
        self.bytes_per_s = float(bytes_per_s)
        self.shared = bool(shared)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._free_at = float("-inf")  # first come, first served: clock time the last booking ends
        self._served = 0.0  # shared: bytes served to each read in flight, since the drive last idled
        self._served_at = float("-inf")  # shared: clock time `_served` was brought up to
        self._ends: list[float] = []  # shared: heap of the reads in flight's end marks on `_served`

    def start(self, nbytes: int, now: float | None = None) -> float:
        """A read of `nbytes` begins (`now`: when); the ticket `finish` waits on."""
        now = self._clock() if now is None else now
        with self._lock:
            if not self.shared:
                start = max(now, self._free_at)
                self._free_at = start + nbytes / self.bytes_per_s
                return self._free_at
            self._advance(max(now, self._served_at))
            end = self._served + nbytes
            heapq.heappush(self._ends, end)
            return end

    def finish(self, ticket: float) -> None:
        """Wait until the emulated drive has delivered the read `ticket` stands for."""
        if not self.shared:
            remaining = ticket - self._clock()
            if remaining > 0:
                self._sleep(remaining)
            return
        while True:
            with self._lock:
                now = self._clock()
                self._advance(max(now, self._served_at))
                if self._served >= ticket:
                    return
                remaining = self._seconds_until(ticket)
            # Reads started meanwhile only push the end later: wake at the estimate, look again.
            self._sleep(max(remaining, 1e-6))

    def _advance(self, now: float) -> None:
        """Bring `_served` up to clock time `now`, retiring the reads that ended on the way."""
        ends, rate = self._ends, self.bytes_per_s
        elapsed = now - self._served_at
        self._served_at = now
        while ends and elapsed > 0:
            n = len(ends)
            to_next = (ends[0] - self._served) * n / rate  # seconds until the nearest end
            if to_next > elapsed:
                self._served += elapsed * rate / n
                return
            self._served = heapq.heappop(ends)
            elapsed -= to_next
        # Idle (nothing in flight), `_served` stands still: no credit is kept for later.

    def _seconds_until(self, ticket: float) -> float:
        """Seconds until `_served` reaches `ticket` if no other read starts meanwhile."""
        seconds, served, n = 0.0, self._served, len(self._ends)
        for end in sorted(self._ends):
            if end > ticket:
                break
            seconds += (end - served) * n / self.bytes_per_s
            served, n = end, n - 1
        return seconds


class ReadHandle:
    """One expert read in flight. `result()` waits for it and raises `ExpertReadError` on failure.

    `future` is done when every sub-read has finished (and, with verify, the bytes were
    hashed), so callers can wait on "any expert finished" (concurrent.futures.wait, or a
    done callback)."""

    def __init__(self, store: ExpertStore, layer_index: int, expert: int, offset: int,
                 buffer: torch.Tensor, parts: int) -> None:
        self.store = store
        self.layer_index = layer_index
        self.expert = expert
        self.offset = offset
        self.buffer = buffer
        self.future: Future = Future()
        self.read_seconds = 0.0  # summed over the sub-reads
        self._remaining = parts
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._outcome: ExpertReadError | None | Literal[False] = False  # False = not evaluated yet
        self._verify_error: ExpertReadError | None = None

    def _part_done(self, error: BaseException | None, seconds: float) -> None:
        """A sub-read ended (on its reader thread); the last one completes the handle."""
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self.read_seconds += seconds
            self._remaining -= 1
            if self._remaining:
                return
        try:
            # On the I/O thread that finished the read: experts are hashed in parallel
            # (hashlib releases the GIL), never one after another on the caller's thread.
            if self.store.verify and not self._errors:
                self._verify_error = self.store._verify(self)
        except Exception as exc:  # the check itself failed: the bytes are not trusted
            self._verify_error = ExpertReadError(f"could not verify expert {self.expert}: {exc!r}",
                                                 layer_index=self.layer_index, expert=self.expert, cause=exc)
        finally:
            with contextlib.suppress(InvalidStateError):  # cancelled: nobody waits for it
                self.future.set_result(None)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> torch.Tensor:
        """The filled buffer (`read_nbytes` bytes) once every sub-read has finished."""
        self.future.result()  # every sub-read finished (the buffer is no longer written) and was checked
        if self._outcome is False:
            self._outcome = self.store._finish(self, self._errors)
        if self._outcome is not None:
            raise self._outcome
        return self.buffer


def _serve(tasks: queue.SimpleQueue, store_ref: weakref.ref) -> None:
    """A reader thread: one sub-read per token off `tasks` (the store's next, see
    `ExpertStore._next_read`) until a None."""
    while True:
        if tasks.get() is None:
            return
        store = store_ref()
        if store is None:  # collected without close(): nothing left to read for
            return
        handle, view, offset, urgent = store._next_read()
        start = time.perf_counter()
        try:
            store._read_range(view, offset, start)
            error = None
        except BaseException as exc:  # handed to the reader of this expert (result() raises it)
            error = exc
        if urgent:
            store._urgent_done()  # before the completion's callbacks: a held-back read starts now
        handle._part_done(error, time.perf_counter() - start)
        # Nothing of this read stays referenced while waiting for the next: an error's
        # traceback holds the store, which would then never be collected.
        del store, handle, view, error


def _stop_readers(tasks: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    for _ in threads:
        tasks.put(None)


class ExpertStore:
    """Reads routed-expert blocks of one Expert Pack (see module docstring).

    Parameters: `direct_io` (O_DIRECT, default; False = page cache, explicitly),
    `read_splits` (aligned sub-reads per expert, issued in parallel), `io_threads`
    (reads in flight at once across all experts), `stage_slots` (aligned staging
    buffers for reads with no other destination), `pin_memory` (page-lock the staging
    buffers; default: when CUDA is available), `verify` (check every read against
    expert_hashes.bin; off by default, costs a SHA-256 pass), `rate_limit_bytes_per_s`
    (cap the aggregate read rate of all I/O threads: drive emulation for benchmarks,
    see `ReadRateLimiter`; None, the default, reads at whatever the drive gives),
    `rate_limit_shared` (the capped rate is shared among the reads in flight instead of
    served first come, first served; see `ReadRateLimiter`), `later_after_urgent`
    (default on: a non-urgent read starts only while no urgent one is in flight, see
    `submit`).
    """

    def __init__(
        self,
        pack_dir: str | os.PathLike,
        *,
        direct_io: bool = True,
        read_splits: int = 1,
        io_threads: int = 16,
        stage_slots: int = 16,
        pin_memory: bool | None = None,
        verify: bool = False,
        telemetry: Telemetry | None = None,
        rate_limit_bytes_per_s: float | None = None,
        rate_limit_shared: bool = False,
        later_after_urgent: bool = True,
    ) -> None:
        if read_splits < 1:
            raise RuntimeStartError(f"read_splits is {read_splits}; use 1 or more")
        if io_threads < 1:
            raise RuntimeStartError(f"io_threads is {io_threads}; use 1 or more")
        self.pack_dir = Path(pack_dir)
        self.manifest: PackManifest = load_manifest(self.pack_dir)
        self.path = self.pack_dir / self.manifest.experts_file
        self.direct_io = bool(direct_io)
        self.read_splits = int(read_splits)
        self.io_threads = int(io_threads)
        self.verify = bool(verify)
        self.rate_limit_bytes_per_s = rate_limit_bytes_per_s
        self._rate_limiter = (None if rate_limit_bytes_per_s is None
                              else ReadRateLimiter(rate_limit_bytes_per_s, shared=rate_limit_shared))
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.telemetry.set(direct_io=self.direct_io, read_splits=self.read_splits)
        self._fd = -1
        # The reader threads take one token off `_tasks` per sub-read, then the sub-read
        # itself (`_next_read`, under `_queued`): the oldest urgent one (an acquire's), else
        # the oldest of the rest, which with `later_after_urgent` waits until no urgent one
        # is in flight (`_urgent_active`).
        self._tasks: queue.SimpleQueue | None = None
        self.later_after_urgent = bool(later_after_urgent)
        self._queued = threading.Condition(threading.Lock())
        self._urgent: deque[tuple[ReadHandle, memoryview, int]] = deque()
        self._later: deque[tuple[ReadHandle, memoryview, int, float]] = deque()  # ..., queued at
        self._urgent_active = 0
        self._threads: list[threading.Thread] = []
        # Orders submits against close(): none is accepted once the readers' stops are queued
        # (a prefetch started from a reader thread may submit while close() joins them).
        self._submit_lock = threading.Lock()
        self._closed = False
        self._ranges = [split_ranges(layer.read_nbytes, self.read_splits) for layer in self.manifest.layers]
        self._check_geometry()
        pinned = staging.pinning_available() if pin_memory is None else bool(pin_memory)
        self.staging = staging.StagingPool(stage_slots, self.manifest.expert_stride, pinned=pinned)
        self._fd = self._open()
        try:
            self._probe()
            self._hashes = self._load_hashes() if self.verify else b""
        except BaseException:
            self.close()
            raise
        self._tasks = queue.SimpleQueue()
        # Readers start with the first reads (a store that never reads starts none); they
        # stop at close(), or when the store is collected without it.
        self._stopper = weakref.finalize(self, _stop_readers, self._tasks, self._threads)
        self._busy_lock = threading.Lock()
        self._reads_active = 0  # sub-reads in preadv right now
        self._busy_since = 0.0

    # Start-up checks ----------------------------------------------------------
    def _check_geometry(self) -> None:
        """Every offset and length an expert read can use must be aligned (O_DIRECT contract).

        Block offsets are data_start + k * stride, so data_start and stride being
        aligned makes every block aligned; inside a block each role and each sub-read
        must start aligned, and each read length must be a multiple of the alignment.
        """
        m, a = self.manifest, ALIGNMENT
        fix = "rebuild the pack with `expertdesk pack` (this file was not written by a compatible builder)"
        if m.data_start % a:
            raise RuntimeStartError(f"{self.path}: data_start {m.data_start} is not a multiple of {a}; {fix}")
        if m.expert_stride % a:
            raise RuntimeStartError(f"{self.path}: expert_stride {m.expert_stride} is not a multiple of {a}; {fix}")
        for li, layer in enumerate(m.layers):
            for role in layer.roles:
                if role.offset % a:
                    raise RuntimeStartError(
                        f"{self.path}: blk.{layer.block} role {role.name} starts at block offset "
                        f"{role.offset}, not a multiple of {a}; {fix}"
                    )
            for start, length in self._ranges[li]:
                if start % a or (length % a):
                    raise RuntimeStartError(
                        f"{self.path}: blk.{layer.block} read range [{start}, {start + length}) "
                        f"is not aligned to {a}; {fix}"
                    )
            if layer.read_nbytes > m.expert_stride:
                raise RuntimeStartError(f"{self.path}: blk.{layer.block} reads past its stride; {fix}")

    def _open(self) -> int:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        uncached = self.direct_io and not O_DIRECT  # macOS F_NOCACHE, Windows FILE_FLAG_NO_BUFFERING
        if self.direct_io:
            if not O_DIRECT and not platform_io.has_uncached_reads():
                raise DirectIOUnsupportedError(
                    f"this operating system has no O_DIRECT, needed to read {self.path} directly; "
                    "run with --buffered-io to read through the page cache"
                )
            flags |= O_DIRECT
        # A pack's files are regular files inside it: look first (never open a FIFO or a
        # device), then open without following a link and check what was opened.
        problem = pack_file_problem(self.pack_dir, self.manifest.experts_file) if os.path.lexists(self.path) else None
        if problem is not None:
            raise RuntimeStartError(f"{self.path}: {problem}; rebuild the pack with `expertdesk pack`")
        flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = platform_io.open_uncached(self.path, flags=flags) if uncached else os.open(self.path, flags)
        except FileNotFoundError:
            raise RuntimeStartError(
                f"{self.path} is missing: the pack is incomplete or its drive is not connected; "
                "reconnect the drive or rebuild the pack"
            ) from None
        except OSError as exc:
            if self.direct_io and exc.errno == errno.EINVAL:
                raise DirectIOUnsupportedError(no_direct_io_message(self.path)) from exc
            raise RuntimeStartError(
                f"cannot open {self.path}: {exc.strerror}; check the drive and permissions") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RuntimeStartError(f"{self.path} is not a regular file; rebuild the pack with `expertdesk pack`")
            if getattr(os, "O_NONBLOCK", 0):
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        size = st.st_size
        if size != self.manifest.experts_file_size:
            os.close(fd)
            raise RuntimeStartError(
                f"{self.path} is {size} bytes but the manifest says {self.manifest.experts_file_size}: "
                "the pack is truncated or mixed with another build; verify or rebuild it"
            )
        return fd

    def _probe(self) -> None:
        """One aligned read of the header: proves the filesystem takes O_DIRECT reads and
        that experts.bin belongs to this manifest."""
        index = self.staging.take()
        try:
            buf = self.staging.view(index)[:ALIGNMENT]
            staging.check_buffer_aligned(buf, "probe buffer")
            try:
                # An ndarray is a buffer; numpy's stubs say so for Python >= 3.12 only.
                n = platform_io.pread_into(self._fd, memoryview(buf.numpy()), 0)  # type: ignore[arg-type]
            except OSError as exc:
                if self.direct_io and exc.errno == errno.EINVAL:
                    raise DirectIOUnsupportedError(no_direct_io_message(self.path)) from exc
                raise RuntimeStartError(f"cannot read {self.path}: {exc.strerror}; check the drive") from exc
            if n != ALIGNMENT:
                raise RuntimeStartError(f"{self.path}: header read returned {n} bytes; the file is truncated")
            check_experts_file_header(bytes(buf.numpy()), self.manifest, self.path)
        finally:
            self.staging.give(index)

    def _load_hashes(self) -> bytes:
        m = self.manifest
        path = self.pack_dir / m.hashes_file
        try:
            with os.fdopen(open_pack_file(self.pack_dir, m.hashes_file), "rb") as f:
                data = f.read(m.hashes_file_size + 1)
        except PackError as exc:
            raise RuntimeStartError(f"verify=True needs {path}: {exc.problem}; rebuild the pack or turn verify off"
                                    ) from None
        except OSError as exc:
            raise RuntimeStartError(
                f"verify=True needs {path}: {exc.strerror}; rebuild the pack or turn verify off") from exc
        if hashlib.sha256(data).hexdigest() != m.hashes_sha256:
            raise RuntimeStartError(f"{path} does not match the manifest's hashes_sha256; rebuild the pack")
        expected = m.num_layers * m.num_experts * len(m.role_names) * DIGEST_SIZE
        if len(data) != expected:
            raise RuntimeStartError(f"{path} is {len(data)} bytes, expected {expected}; rebuild the pack")
        return data

    # Reads ------------------------------------------------------------------
    def read_nbytes(self, layer_index: int) -> int:
        return self.manifest.layers[layer_index].read_nbytes

    def submit(self, layer_index: int, expert: int, buffer: torch.Tensor, *, urgent: bool = True) -> ReadHandle:
        """Start reading expert `expert` of pack layer `layer_index` into `buffer`.

        `buffer`: a contiguous uint8 CPU tensor, aligned, of at least `read_nbytes`
        bytes (a staging or host-tier slot). The caller must not touch it until the
        handle's `result()` returned or raised. `urgent=False` (prefetches): its
        sub-reads wait while any urgent one (an acquire's) is queued, so a layer's
        misses never queue behind reads that are only guesses or for later layers, and
        with `later_after_urgent` also while one is in flight: a drive shares its rate
        among the reads it holds (or serves them in turn), so a guess read beside a
        layer's misses would slow them; held back by its reader thread, it starts the
        moment the last of them ends, when the drive would otherwise idle while the
        model computes that layer. Submitted early (with the acquire's reads), it costs
        the model's thread nothing at that moment.
        """
        nbytes = self.read_nbytes(layer_index)
        offset = self.manifest.block_offset(layer_index, expert)
        target = buffer[:nbytes]
        if buffer.numel() < nbytes or staging.misalignment(target) or buffer.device.type != "cpu":
            raise ValueError(f"read buffer at {buffer.data_ptr():#x} ({buffer.numel()} bytes) is not an aligned "
                             f"host buffer of {nbytes} bytes")
        # An ndarray is a buffer; numpy's stubs say so for Python >= 3.12 only.
        view = memoryview(target.numpy())  # type: ignore[arg-type]
        with self._submit_lock:
            tasks = self._tasks
            if tasks is None or self._closed:
                raise RuntimeError("the expert store is closed")
            with self._queued:
                # Sub-reads are for experts that would otherwise leave reader threads idle. Behind
                # WHOLE_READS_BEHIND queued sub-reads per reader thread (a prompt's batch of hundreds
                # of experts; a decode layer's misses and guesses stay below it), the read goes
                # whole: the same bytes in flight, a fraction of the reader threads' per-read work.
                deep = len(self._urgent) + len(self._later) >= WHOLE_READS_BEHIND * self.io_threads
                ranges = [(0, nbytes)] if deep else self._ranges[layer_index]
                handle = ReadHandle(self, layer_index, expert, offset, target, len(ranges))
                if urgent:
                    self._urgent.extend((handle, view[start : start + length], offset + start)
                                        for start, length in ranges)
                    if self._later:
                        self._queued.notify_all()  # a reader holding back a later read takes this one
                else:
                    now = time.perf_counter()
                    self._later.extend((handle, view[start : start + length], offset + start, now)
                                       for start, length in ranges)
            self._start_readers(len(ranges))
            for _ in ranges:
                tasks.put(True)  # after its sub-read: a reader with a token always finds one
        return handle

    def _next_read(self) -> tuple[ReadHandle, memoryview, int, bool]:
        """The next sub-read for a reader thread that took a token, and whether it is
        urgent: the oldest urgent one, else the oldest other (with `later_after_urgent`,
        once no urgent one is in flight). One is there (each token follows its sub-read):
        a reader that finds only a held-back one waits, and takes an urgent one queued
        meanwhile instead (the held-back one stays for the reader holding that one's token)."""
        with self._queued:
            while True:
                if self._urgent:
                    self._urgent_active += 1
                    handle, view, offset = self._urgent.popleft()
                    return handle, view, offset, True
                if not self._later:
                    self._queued.wait()
                    continue
                # Held back at most LATER_HOLD_S: urgent reads that keep overlapping (acquires
                # on several threads) never starve it; one an acquire waits for is promoted.
                held = self._later[0][3] + LATER_HOLD_S - time.perf_counter()
                if self.later_after_urgent and self._urgent_active and held > 0:
                    self._queued.wait(held)
                    continue
                handle, view, offset, _queued_at = self._later.popleft()
                return handle, view, offset, False

    def promote(self, handle: ReadHandle) -> None:
        """Make the sub-reads of `handle` not started yet urgent (an acquire now waits for
        this prefetch read): they go ahead of the other non-urgent ones and are no longer
        held back."""
        with self._queued:
            if not any(read[0] is handle for read in self._later):
                return
            self._urgent.extend(read[:3] for read in self._later if read[0] is handle)
            self._later = deque(read for read in self._later if read[0] is not handle)
            self._queued.notify_all()

    def _urgent_done(self) -> None:
        """An urgent sub-read ended: the last one in flight lets the held-back reads start."""
        with self._queued:
            self._urgent_active -= 1
            if not self._urgent_active and self._later:
                self._queued.notify_all()

    def _start_readers(self, wanted: int) -> None:
        """Reader threads up to `io_threads`, one more per sub-read just queued."""
        threads = self._threads
        while len(threads) < self.io_threads and wanted > 0:
            thread = threading.Thread(target=_serve, args=(self._tasks, weakref.ref(self)),
                                      name=f"expert-io-{len(threads)}", daemon=True)
            threads.append(thread)
            thread.start()
            wanted -= 1

    def _read_range(self, view: memoryview, offset: int, start: float) -> None:
        """Fill `view` from experts.bin at `offset` (runs on a reader thread, which began at
        `start`). Also keeps `drive_busy_seconds`: time with at least one read in flight,
        so busy / wall time says how much of a run the drive was working (the rest it
        waited for the model). With a rate cap the read then waits until the limiter's
        emulated drive has delivered it; that wait counts as drive time, as it would on
        the drive being emulated."""
        with self._busy_lock:
            if self._reads_active == 0:
                self._busy_since = start
            self._reads_active += 1
        done, total = 0, len(view)
        try:
            limiter = self._rate_limiter
            ticket = limiter.start(total, start) if limiter is not None else None
            while done < total:
                n = platform_io.pread_into(self._fd, view[done:], offset + done)
                if n <= 0:
                    raise ShortReadError(
                        errno.EIO, f"file ended at byte {offset + done}, {total - done} bytes short"
                    )
                done += n
            if limiter is not None and ticket is not None:
                limiter.finish(ticket)
        finally:
            end = time.perf_counter()
            with self._busy_lock:
                self._reads_active -= 1
                busy = end - self._busy_since if self._reads_active == 0 else None
            if busy is not None:
                self.telemetry.add("drive_busy_seconds", busy)

    def _finish(self, handle: ReadHandle, errors: Sequence[BaseException | None]) -> ExpertReadError | None:
        """Account one finished expert read; the error to raise, if it failed."""
        m = self.manifest
        layer = m.layers[handle.layer_index]
        exc = next((e for e in errors if e is not None), None)
        if exc is None and self.verify:
            exc = handle._verify_error  # hashed on the I/O thread when the read completed
            if exc is not None:
                self.telemetry.add("hash_mismatches")
        if exc is None:
            self.telemetry.add_many(pack_read_bytes=layer.read_nbytes, reads=1,
                                    buffered_reads=0 if self.direct_io else 1, read_seconds=handle.read_seconds)
            return None
        self.telemetry.add_many(io_errors=1, read_seconds=handle.read_seconds)
        what = (f"expert {handle.expert} of blk.{layer.block} (pack layer {handle.layer_index}) "
                f"from {self.path} at offset {handle.offset}")
        if isinstance(exc, ShortReadError):
            message = (f"short read of {what}: {exc.strerror}. The pack file is shorter than its "
                       "manifest says (truncated, or replaced while running); verify or rebuild the pack")
        elif isinstance(exc, OSError) and exc.errno in _GONE_ERRNOS:
            message = (f"could not read {what}: {exc.strerror or exc}. The drive holding the pack seems "
                       "to have been disconnected or the file removed; reconnect it and restart the runtime")
        elif isinstance(exc, OSError) and exc.errno == errno.EIO:
            message = (f"I/O error reading {what}: {exc.strerror or exc}. The drive reported a read error; "
                       "check its health (SMART) and its cable/slot, then retry")
        elif isinstance(exc, OSError) and exc.errno == errno.EINVAL and self.direct_io:
            message = (f"O_DIRECT rejected the read of {what} ({exc.strerror}); this is a bug, please "
                       "report it; run with --buffered-io meanwhile")
        elif isinstance(exc, ExpertReadError):
            message = str(exc)
        else:
            message = f"could not read {what}: {exc!r}"
        return ExpertReadError(message, block=layer.block, layer_index=handle.layer_index,
                               expert=handle.expert, cause=exc)

    def _verify(self, handle: ReadHandle) -> ExpertReadError | None:
        """Check one finished read against expert_hashes.bin: each role's digest is keyed by
        its place (PackManifest.slice_digest), so bytes of another expert, layer or role
        fail too, not only damaged ones."""
        m = self.manifest
        layer = m.layers[handle.layer_index]
        data = handle.buffer.numpy().data  # a memoryview of the read buffer
        for r, role in enumerate(layer.roles):
            at = m.hash_index(handle.layer_index, handle.expert, r) * DIGEST_SIZE
            want = self._hashes[at : at + DIGEST_SIZE]
            got = m.slice_digest(handle.layer_index, handle.expert, r, data[role.offset : role.end])
            if got != want:
                return ExpertReadError(
                    f"expert {handle.expert} of blk.{layer.block} role {role.name} read from {self.path} "
                    "does not match its SHA-256 in expert_hashes.bin: the drive returned wrong data "
                    f"or the pack was modified; it was not used or cached. Run `expertdesk verify {self.pack_dir}`, "
                    "and check the drive (SMART) if the pack verifies",
                    block=layer.block, layer_index=handle.layer_index, expert=handle.expert,
                )
        return None

    def read_expert(self, layer_index: int, expert: int) -> torch.Tensor:
        """One expert's `read_nbytes` bytes as a new CPU tensor (synchronous; tools and tests)."""
        index = self.staging.take()
        try:
            return self.submit(layer_index, expert, self.staging.view(index)).result().clone()
        finally:
            self.staging.give(index)

    # Lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Wait for reads in flight, then close the file."""
        with self._submit_lock:
            stopping = self._tasks is not None and not self._closed
            self._closed = True
            if stopping:
                self._stopper()  # one stop per reader, queued after every read accepted
        if stopping:
            for thread in self._threads:
                thread.join()
            self._threads.clear()
            self._tasks = None
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
