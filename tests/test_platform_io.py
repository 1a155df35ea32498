"""engine.runtime.platform_io: the uncached read path on Linux (for real) and on Windows and macOS
(their system calls replaced: CI runs on Linux), and the store reading a pack through it."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

import pytest

from engine.runtime import platform_io
from engine.runtime.store import ExpertStore

DATA = bytes(range(256)) * 64  # 16 KiB


class FakeKernel32:
    """CreateFileW / ReadFile / GetDiskFreeSpaceW over a bytes object, enforcing what
    FILE_FLAG_NO_BUFFERING requires: sector-multiple offsets and lengths, sector-aligned buffers."""

    def __init__(self, data: bytes, sector: int = 4096) -> None:
        self.data, self.sector = data, sector
        self.opened: list[tuple[str, int, int]] = []
        self.reads: list[tuple[int, int]] = []

    def GetDiskFreeSpaceW(self, root, spc, bps, free, total):  # noqa: N802 - the Win32 name
        ctypes.cast(bps, ctypes.POINTER(ctypes.c_ulong)).contents.value = self.sector
        return 1

    def CreateFileW(self, path, access, share, security, disposition, flags, template):  # noqa: N802
        self.opened.append((path, access, flags))
        return 1234

    def ReadFile(self, handle, buf, length, got, ov):  # noqa: N802
        o = ctypes.cast(ov, ctypes.POINTER(platform_io._Overlapped)).contents
        offset = o.Offset | (o.OffsetHigh << 32)
        assert handle == 1234
        assert offset % self.sector == 0 and length % self.sector == 0, "unaligned offset or length"
        assert ctypes.addressof(buf) % self.sector == 0, "buffer not sector-aligned"
        chunk = self.data[offset : offset + length]
        ctypes.memmove(buf, chunk, len(chunk))
        ctypes.cast(got, ctypes.POINTER(ctypes.c_ulong)).contents.value = len(chunk)
        self.reads.append((offset, length))
        return 1


class FakeMsvcrt:
    def open_osfhandle(self, handle, flags):
        assert flags == os.O_RDONLY
        return 77

    def get_osfhandle(self, fd):
        assert fd == 77
        return 1234


def test_windows_opens_without_buffering_and_reads_aligned_sectors(monkeypatch, tmp_path):
    k32 = FakeKernel32(DATA)
    monkeypatch.setattr(platform_io, "_kernel32", lambda: k32)
    monkeypatch.setattr(platform_io, "_msvcrt", lambda: FakeMsvcrt())
    fd = platform_io.open_uncached(tmp_path / "experts.bin", platform="win32")
    assert fd == 77
    (_, access, flags), = k32.opened
    assert flags & platform_io.FILE_FLAG_NO_BUFFERING and access == platform_io.GENERIC_READ
    buf = mmap.mmap(-1, 8192)  # page-aligned, as the store's staging buffers
    view = memoryview(buf)
    assert platform_io.pread_into(fd, view, 4096, platform="win32") == 8192
    assert bytes(view) == DATA[4096:12288]
    assert platform_io.pread_into(fd, view, 1 << 33, platform="win32") == 0  # past the end: EOF
    assert k32.reads[0] == (4096, 8192) and k32.reads[1] == (1 << 33, 8192)  # 64-bit offsets reach ReadFile
    del view
    buf.close()


def test_windows_refuses_a_sector_size_that_breaks_the_alignment(monkeypatch, tmp_path):
    monkeypatch.setattr(platform_io, "_kernel32", lambda: FakeKernel32(DATA, sector=8192 * 3))
    with pytest.raises(OSError, match="sector size is 24576"):
        platform_io.open_uncached(tmp_path / "experts.bin", platform="win32")


class FakeFcntl:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, object]] = []

    def fcntl(self, fd, cmd, arg=0):
        self.calls.append((fd, cmd, arg))
        return 0


def test_macos_turns_off_the_cache_and_advises_reads(monkeypatch, tmp_path):
    path = tmp_path / "experts.bin"
    path.write_bytes(DATA)
    fake = FakeFcntl()
    monkeypatch.setattr(platform_io, "_fcntl", lambda: fake)
    fd = platform_io.open_uncached(path, platform="darwin")
    try:
        assert fake.calls == [(fd, platform_io.F_NOCACHE, 1)]
        platform_io.advise(fd, 1 << 32, 12 << 20, platform="darwin")
        _, cmd, arg = fake.calls[1]
        assert cmd == platform_io.F_RDADVISE
        assert struct.unpack("qi4x", arg) == (1 << 32, 12 << 20)  # struct radvisory {off_t; int;}
        view = memoryview(bytearray(4096))
        assert platform_io.pread_into(fd, view, 4096, platform="darwin") == 4096
        assert bytes(view) == DATA[4096:8192]
    finally:
        os.close(fd)


def test_support_describes_each_platform():
    assert "FILE_FLAG_NO_BUFFERING" in platform_io.support("win32").describe()
    mac = platform_io.support("darwin").describe()
    assert "F_NOCACHE" in mac and "F_RDADVISE" in mac and "Metal" in mac
    assert "O_DIRECT" in platform_io.support("linux").describe()
    assert platform_io.has_uncached_reads("win32") and platform_io.has_uncached_reads("darwin")


def test_store_reads_a_pack_through_the_macos_path(monkeypatch, tmp_path):
    """Without O_DIRECT (as on macOS) the store opens experts.bin through open_uncached, which sets
    F_NOCACHE, and every expert still reads back byte-exact."""
    from engine.runtime import store as store_mod
    from pack_factory import make_pack

    pack = make_pack(tmp_path / "tiny.expertpack", blocks=(1, 3), num_experts=4, top_k=2)
    fake = FakeFcntl()
    with monkeypatch.context() as m:
        m.setattr(store_mod, "O_DIRECT", 0)
        m.setattr(platform_io.sys, "platform", "darwin")
        m.setattr(platform_io, "_fcntl", lambda: fake)
        store = ExpertStore(pack.path, io_threads=2, stage_slots=2)
    with store:
        assert [c[1:] for c in fake.calls] == [(platform_io.F_NOCACHE, 1)]
        assert fake.calls[0][0] == store._fd
        for li, layer in enumerate(pack.manifest.layers):
            for e in range(pack.manifest.num_experts):
                assert bytes(store.read_expert(li, e).numpy()) == pack.block_bytes(layer.block, e)


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this OS")
def test_linux_path_is_o_direct_for_real(tmp_path):
    path = tmp_path / "experts.bin"
    path.write_bytes(DATA)
    try:
        fd = platform_io.open_uncached(path)
    except OSError as exc:  # tmpfs and some overlay filesystems refuse O_DIRECT at open
        pytest.skip(f"O_DIRECT refused in {tmp_path}: {exc}")
    try:
        import fcntl

        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        buf = mmap.mmap(-1, 4096)
        assert platform_io.pread_into(fd, memoryview(buf), 8192) == 4096
        assert buf[:] == DATA[8192:12288]
        buf.close()
    finally:
        os.close(fd)
