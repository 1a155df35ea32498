"""Reading and writing a pack's files on disk: the manifest (atomically), whole-file hashes,
and opening a pack's files safely.

A pack's files are regular files directly inside its folder: `open_pack_file` never
follows a symlink (O_NOFOLLOW, and an lstat first) and never opens a FIFO, socket or
device (it looks before it opens, opens non-blocking, and checks the descriptor again).
The folder the user names may itself be reached through a link; nothing inside it is.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from expertpack.errors import PackError
from expertpack.layout import MANIFEST_NAME, PARTIAL_SUFFIX
from expertpack.manifest import PackManifest


def load_manifest(pack_dir: str | os.PathLike, *, require_complete: bool = True) -> PackManifest:
    """Read and validate `PACK/manifest.json`.

    With `require_complete` (the default) an unfinished build is refused: only a pack
    whose builder finished and verified it may be run.
    """
    pack_dir = Path(pack_dir)
    if pack_dir.name.endswith(PARTIAL_SUFFIX):
        raise PackError(pack_dir, "this is an unfinished build, not a pack", "run `expertdesk pack` again to resume it")
    path = pack_dir / MANIFEST_NAME
    if not os.path.lexists(path):
        raise PackError(pack_dir, "no manifest.json: not an Expert Pack",
                        "build one with `expertdesk pack MODEL.gguf`")
    fd = open_pack_file(pack_dir, MANIFEST_NAME)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise PackError(pack_dir, f"cannot read manifest.json ({exc.strerror})",
                        "check the drive is connected") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise PackError(pack_dir, f"manifest.json is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a pack manifest",
                        "rebuild the pack")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PackError(pack_dir, "manifest.json is not UTF-8 text (damaged)", "rebuild the pack") from None
    manifest = PackManifest.from_json(text, path)
    if require_complete and not manifest.complete:
        raise PackError(pack_dir, "pack is not marked complete", "run `expertdesk pack` again to finish it")
    return manifest


def write_manifest(pack_dir: str | os.PathLike, manifest: PackManifest) -> None:
    """Write manifest.json atomically (temp file, fsync, rename, fsync dir)."""
    pack_dir = Path(pack_dir)
    tmp = pack_dir / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pack_dir / MANIFEST_NAME)
    fsync_dir(pack_dir)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_MANIFEST_BYTES = 64 << 20  # a 1 TB pack's manifest is well under 1 MiB
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


def pack_file_problem(pack_dir: str | os.PathLike, name: str) -> str | None:
    """Why `name` cannot be a file of the pack in `pack_dir` (missing, a symlink, not a regular
    file), or None when it is a regular file directly inside the folder. Never opens it."""
    path = Path(pack_dir) / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"cannot look at {name} ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return (f"{name} is a symlink; a pack never follows links, every file must lie in the pack folder "
                "itself (copy the file in instead of linking it)")
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is a {_kind(st.st_mode)}, not a regular file; a pack opens only regular files"
    return None


def check_pack_file(pack_dir: str | os.PathLike, name: str) -> os.stat_result:
    """lstat of the regular file `name` in the pack; PackError for anything else (see pack_file_problem)."""
    problem = pack_file_problem(pack_dir, name)
    if problem is not None:
        raise PackError(pack_dir, problem, "rebuild the pack with `expertdesk pack`")
    return os.lstat(Path(pack_dir) / name)


def check_same_file(fd: int, pack_dir: str | os.PathLike, name: str) -> None:
    """After opening `name` by another means (O_DIRECT, mmap): the descriptor must be that regular
    file of the pack, not something a link led to or that replaced it meanwhile."""
    st = os.fstat(fd)
    here = check_pack_file(pack_dir, name)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):
        raise PackError(pack_dir, f"{name} changed while it was opened (replaced by a link or another file)",
                        "make sure nothing else writes to the pack folder, then try again")


def open_pack_file(pack_dir: str | os.PathLike, name: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file `name` directly inside `pack_dir` (see the module doc).

    PackError if it is missing, a symlink, a FIFO, a device, a folder or anything else.
    """
    check_pack_file(pack_dir, name)
    path = Path(pack_dir) / name
    try:
        fd = os.open(path, flags | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise PackError(pack_dir, f"{name} is missing", "rebuild the pack with `expertdesk pack`") from None
    except OSError as exc:
        problem = pack_file_problem(pack_dir, name) or f"cannot open {name} ({exc.strerror or exc})"
        raise PackError(pack_dir, problem, "check the drive and the file's permissions") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PackError(pack_dir, f"{name} is a {_kind(mode)}, not a regular file; a pack opens only regular files",
                            "rebuild the pack with `expertdesk pack`")
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sha256_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Hex SHA-256 of a whole file, read in large chunks (`hashes_sha256`, `dense_sha256`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
