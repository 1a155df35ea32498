"""The quick check every load runs: is this the pack its manifest describes?

`check_pack(dir)` reads the manifest (schema, version, layout digest, file names), then
checks, per file: a regular file inside the pack (no symlink, FIFO or device), of the
exact size the manifest says; experts.bin's header (geometry and layout digest, so the
manifest's blocks are the ones the builder wrote); the SHA-256 of expert_hashes.bin; and
the dense file's sampled hash (its GGUF header whole plus 16 fixed 1 MiB samples).

What it reads does not grow with the pack's bytes: one header page, the hashes file
(32 bytes per slice, ~3 MB for a 1 TB pack) and the dense samples (~16 MiB plus the
GGUF header), so it takes milliseconds for any pack. It does not read expert blocks:
`expertdesk verify` (packer.verify) does, and every error here names it as the next step.
The engine adds the one check that needs a GGUF reader: the dense file's metadata
against `config_sha256`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from expertpack.errors import PackError
from expertpack.files import load_manifest, open_pack_file
from expertpack.layout import check_experts_file_header, dense_sample_digest
from expertpack.manifest import PackManifest


def verify_hint(pack_dir: str | os.PathLike) -> str:
    """The next step every load-time refusal names."""
    return (f"run `expertdesk verify {pack_dir}` for a full report; if it fails, rebuild the pack "
            "with `expertdesk pack`")


def check_pack(pack_dir: str | os.PathLike) -> PackManifest:
    """The manifest of the finished pack in `pack_dir` once the quick check passed; PackError
    naming the pack, the first problem and `expertdesk verify` otherwise (see the module doc)."""
    pack_dir = Path(pack_dir)
    try:
        manifest = load_manifest(pack_dir)
    except PackError as exc:
        fix = (f"{exc.fix}; or run `expertdesk verify {pack_dir}` for a full report" if exc.fix
               else verify_hint(pack_dir))
        raise PackError(pack_dir, exc.problem, fix) from None

    def refuse(problem: str) -> PackError:
        return PackError(pack_dir, problem, verify_hint(pack_dir))

    def open_checked(name: str, size: int) -> int:
        try:
            fd = open_pack_file(pack_dir, name)
        except PackError as exc:
            raise refuse(exc.problem) from None
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise refuse(f"{name} is {actual} bytes, the manifest says {size} (truncated, damaged or from "
                         "another build)")
        return fd

    fd = open_checked(manifest.experts_file, manifest.experts_file_size)
    try:
        head = _pread_all(fd, manifest.alignment, 0)
    finally:
        os.close(fd)
    try:
        check_experts_file_header(head, manifest, pack_dir)
    except PackError as exc:
        raise refuse(exc.problem) from None

    fd = open_checked(manifest.hashes_file, manifest.hashes_file_size)
    try:
        digest = hashlib.sha256(_read_all(fd, manifest.hashes_file_size)).hexdigest()
    finally:
        os.close(fd)
    if digest != manifest.hashes_sha256:
        raise refuse(f"{manifest.hashes_file} does not match its SHA-256 in the manifest (damaged or replaced)")

    fd = open_checked(manifest.dense_file, manifest.dense_file_size)
    try:
        sample = dense_sample_digest(manifest.dense_file_size, manifest.dense_header_bytes,
                                     lambda offset, length: _pread_all(fd, length, offset))
    finally:
        os.close(fd)
    if sample != manifest.dense_sample_sha256:
        raise refuse(f"{manifest.dense_file} does not match its sampled SHA-256 in the manifest (its header or "
                     "weights changed: damaged, or replaced by another model's)")
    return manifest


def dense_sample_sha256(path: str | os.PathLike, size: int, header_bytes: int) -> str:
    """`dense_sample_sha256` of the dense file at `path` (the builder records it, the checks recompute it)."""
    path = Path(path)
    fd = open_pack_file(path.parent, path.name)
    try:
        return dense_sample_digest(size, header_bytes, lambda offset, length: _pread_all(fd, length, offset))
    finally:
        os.close(fd)


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < length:
        n = min(length - done, 64 << 20)
        if hasattr(os, "pread"):
            chunk = os.pread(fd, n, offset + done)
        else:  # Windows
            os.lseek(fd, offset + done, os.SEEK_SET)
            chunk = os.read(fd, n)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def _read_all(fd: int, length: int) -> bytes:
    return _pread_all(fd, length, 0)
