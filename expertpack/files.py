"""Reading and writing a pack's files on disk: the manifest (atomically) and whole-file hashes."""

from __future__ import annotations

import hashlib
import os
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
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PackError(pack_dir, "no manifest.json: not an Expert Pack", "build one with `expertdesk pack MODEL.gguf`") from None
    except OSError as exc:
        raise PackError(pack_dir, f"cannot read manifest.json ({exc.strerror})", "check the drive is connected") from None
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


def sha256_file(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Hex SHA-256 of a whole file, read in large chunks (`hashes_sha256`, `dense_sha256`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
