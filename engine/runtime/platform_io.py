"""Uncached reads of experts.bin on each desktop OS, behind one small interface the store uses.

    fd = open_uncached(path)            # bypass the OS file cache where the OS allows it
    n = pread_into(fd, view, offset)    # positional read into an aligned buffer
    advise(fd, offset, length)          # "this range comes next" (macOS F_RDADVISE)

- Linux: `O_DIRECT` (offsets, lengths and buffer addresses aligned to the logical block
  size; the pack format aligns everything to 4096) and `os.preadv`.
- macOS: no O_DIRECT; `fcntl(F_NOCACHE, 1)` on the descriptor turns off the unified
  buffer cache for it (reads go to the drive, page-aligned buffers are read without a
  copy), `F_RDADVISE` starts the drive on a range before it is read; `os.preadv`.
- Windows: `CreateFileW(..., FILE_FLAG_NO_BUFFERING)`: reads must be whole sectors into
  sector-aligned memory (the volume's sector size, from `GetDiskFreeSpaceW`, must divide
  the pack's 4096 alignment); Python has no pread there, so reads are `ReadFile` with an
  OVERLAPPED offset on the handle behind the C runtime descriptor.

`support()` says, for this (or any) platform, what the read path provides; the wizard
shows it. Every system call is looked up through a module attribute (`_kernel32`,
`_msvcrt`, `_fcntl`), so tests replace them on machines that are not Windows or macOS.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIGNMENT = 4096  # expertpack.ALIGNMENT: every block offset and read length in a pack

# macOS <sys/fcntl.h>
F_RDADVISE = 44
F_NOCACHE = 48
# Windows <winbase.h> / <winnt.h>
GENERIC_READ = 0x80000000
FILE_SHARE_READ = 0x00000001
OPEN_EXISTING = 3
FILE_ATTRIBUTE_NORMAL = 0x80
FILE_FLAG_NO_BUFFERING = 0x20000000
INVALID_HANDLE_VALUE = ctypes.c_void_p(-1).value
ERROR_HANDLE_EOF = 38


@dataclass(frozen=True)
class UncachedReadSupport:
    """What the expert read path does on one platform (shown by the wizard's checks)."""

    platform: str  # "linux", "darwin", "win32"
    mechanism: str  # how the OS cache is bypassed
    read_call: str  # the positional read used
    prefetch_hint: str  # how a coming read is announced ("" if none)
    compute: str  # where the model runs there

    def describe(self) -> str:
        hint = f"; read-ahead hint: {self.prefetch_hint}" if self.prefetch_hint else ""
        return f"{self.mechanism}, reads with {self.read_call}{hint}; compute: {self.compute}"


def support(platform: str | None = None) -> UncachedReadSupport:
    platform = platform or sys.platform
    if platform == "win32":
        return UncachedReadSupport("win32", "CreateFileW with FILE_FLAG_NO_BUFFERING (sector-aligned buffers)",
                                   "ReadFile at an OVERLAPPED offset", "", "CUDA (NVIDIA) or CPU")
    if platform == "darwin":
        return UncachedReadSupport("darwin", "fcntl F_NOCACHE (no unified buffer cache)", "preadv",
                                   "fcntl F_RDADVISE", "Metal (MPS) on Apple silicon, or CPU")
    return UncachedReadSupport(platform, "O_DIRECT", "preadv", "", "CUDA (NVIDIA) or CPU")


def has_uncached_reads(platform: str | None = None) -> bool:
    """Whether `open_uncached` can work here: O_DIRECT, or the macOS / Windows mechanisms."""
    return (platform or sys.platform) in ("win32", "darwin") or bool(getattr(os, "O_DIRECT", 0))


def _kernel32() -> Any:
    return ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]


def _msvcrt() -> Any:
    import msvcrt  # Windows only

    return msvcrt


def _fcntl() -> Any:
    import fcntl  # POSIX only

    return fcntl


def _last_error() -> int:
    """GetLastError as ctypes saved it (use_last_error=True); the attribute exists on Windows only."""
    get = getattr(ctypes, "get_last_error", None)
    return int(get()) if get is not None else 0


def _win_error() -> OSError:
    code = _last_error()
    return OSError(22 if code == 87 else 5, f"Windows error {code}", None, code)


def windows_sector_size(path: str | os.PathLike) -> int:
    """Bytes per sector of the volume holding `path` (GetDiskFreeSpaceW)."""
    root = Path(os.path.abspath(path)).anchor or "\\"
    spc, bps, free, total = (ctypes.c_ulong() for _ in range(4))
    if not _kernel32().GetDiskFreeSpaceW(root, ctypes.byref(spc), ctypes.byref(bps), ctypes.byref(free),
                                         ctypes.byref(total)):
        raise _win_error()
    return int(bps.value)


def open_uncached(path: str | os.PathLike, platform: str | None = None, flags: int = 0) -> int:
    """A read-only descriptor of `path` that bypasses the OS file cache; OSError (EINVAL where the
    filesystem refuses) otherwise. `flags` are extra os.open flags (POSIX)."""
    platform = platform or sys.platform
    if platform == "win32":
        sector = windows_sector_size(path)
        if sector <= 0 or ALIGNMENT % sector:
            raise OSError(22, f"the volume's sector size is {sector} bytes, which does not divide the pack's "
                              f"{ALIGNMENT}-byte alignment", str(path))
        k32 = _kernel32()
        handle = k32.CreateFileW(str(path), GENERIC_READ, FILE_SHARE_READ, None, OPEN_EXISTING,
                                 FILE_ATTRIBUTE_NORMAL | FILE_FLAG_NO_BUFFERING, None)
        if handle in (None, INVALID_HANDLE_VALUE, -1):
            raise _win_error()
        return int(_msvcrt().open_osfhandle(handle, os.O_RDONLY))
    if platform == "darwin":
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            _fcntl().fcntl(fd, F_NOCACHE, 1)
        except OSError:
            os.close(fd)
            raise
        return fd
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        raise OSError(22, "this system has no O_DIRECT", str(path))
    return os.open(path, os.O_RDONLY | direct | flags)


def pread_into(fd: int, view: memoryview, offset: int, platform: str | None = None) -> int:
    """Read up to len(view) bytes at `offset` into `view`; the count (0 at end of file)."""
    if (platform or sys.platform) != "win32":
        return os.preadv(fd, [view], offset)
    ov = _Overlapped()
    ov.Offset = offset & 0xFFFFFFFF
    ov.OffsetHigh = offset >> 32
    got = ctypes.c_ulong(0)
    buf = (ctypes.c_char * len(view)).from_buffer(view)
    handle = _msvcrt().get_osfhandle(fd)
    if not _kernel32().ReadFile(handle, buf, len(view), ctypes.byref(got), ctypes.byref(ov)):
        if _last_error() == ERROR_HANDLE_EOF:
            return 0
        raise _win_error()
    return int(got.value)


def advise(fd: int, offset: int, length: int, platform: str | None = None) -> None:
    """Tell the OS a range will be read soon, where it has a way that works with uncached reads."""
    if (platform or sys.platform) == "darwin":
        try:
            _fcntl().fcntl(fd, F_RDADVISE, struct.pack("qi4x", offset, min(length, 2**31 - 1)))
        except OSError:
            pass  # a hint only


class _Overlapped(ctypes.Structure):
    _fields_ = [("Internal", ctypes.c_void_p), ("InternalHigh", ctypes.c_void_p), ("Offset", ctypes.c_ulong),
                ("OffsetHigh", ctypes.c_ulong), ("hEvent", ctypes.c_void_p)]
