"""Disk helpers shared by the pack builder, the verifier, preflight and the benchmark.

O_DIRECT needs the file offset, the length and the buffer address aligned; anonymous
mmap gives page-aligned memory, so every buffer for direct I/O comes from
`aligned_buffer`. Everything here is headless and standard-library only.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path

from expertpack import ALIGNMENT

GIB = 1 << 30
MIB = 1 << 20

# errno values that mean "the disk (or the user's quota) is full".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned anonymous buffer of at least `nbytes` (rounded up to 4096)."""
    size = max(ALIGNMENT, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def open_for_write(path: str | os.PathLike, direct: bool, *, create: bool = True) -> tuple[int, bool]:
    """Open `path` read-write; with `direct`, try O_DIRECT first.

    Returns (fd, direct_used). Falls back to a buffered descriptor only when the
    filesystem refuses O_DIRECT at open time (EINVAL, as tmpfs and some FUSE
    filesystems do); any other error is raised.
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def open_for_read(path: str | os.PathLike, direct: bool) -> tuple[int, bool]:
    """Open `path` read-only, with O_DIRECT when asked and supported; (fd, direct_used)."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


def pread_full(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `fd` at `offset`; EOF before the end is an error (a truncated file)."""
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done} (file truncated?)")
        done += n


def pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` to `fd` at `offset` (pwrite may write less than asked)."""
    done = 0
    total = len(view)
    while done < total:
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n} at byte {offset + done}")
        done += n


def drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop clean cached pages of a range (0 length = to the end).

    Used on source files after reading them, so packing a terabyte does not push
    everything else out of the page cache, and by the benchmark before timing reads.
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path` itself or its nearest existing parent (to ask about a folder not made yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_space(path: str | os.PathLike) -> tuple[int, int]:
    """(free bytes for an unprivileged user, total bytes) of the filesystem holding `path`."""
    usage = shutil.disk_usage(existing_ancestor(path))
    return usage.free, usage.total


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the filesystem holding `path` (for messages such as 'on /mnt/ssd')."""
    p = existing_ancestor(path).resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def allocated_bytes(path: str | os.PathLike) -> int:
    """Bytes a file or directory tree really occupies on disk (sparse holes excluded)."""
    p = Path(path)
    if not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_blocks * 512
    return sum(f.stat().st_blocks * 512 for f in p.rglob("*") if f.is_file())


def space_margin(nbytes: int) -> int:
    """Safety margin over a pack's size: 5%, and at least 1 GiB (filesystem overhead, journals)."""
    return max(nbytes // 20, GIB)


def is_disk_full(exc: BaseException) -> bool:
    """True for the OSErrors a full disk or an exhausted quota raise."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def format_bytes(n: float) -> str:
    """Human size in decimal units, as drive makers and file managers show them ('147.2 GB')."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def format_duration(seconds: float) -> str:
    """'1h02m', '3m05s', '12s' for progress lines."""
    if seconds != seconds or seconds == float("inf"):  # NaN or unknown
        return "--"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
