"""Where the bytes of a pack lie: names, alignment, block geometry and the experts.bin header.

Pure arithmetic on the rules of docs/expert-pack-format.md; nothing here touches a
file except through bytes handed in.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from expertpack.errors import PackError

if TYPE_CHECKING:  # annotations only: manifest.py imports this module
    from expertpack.manifest import LayerEntry, PackManifest

FORMAT_NAME = "expertdesk-pack"
FORMAT_VERSION = 2  # 2: layout digest in manifest and header, slice digests keyed by place, dense samples
ALIGNMENT = 4096
DIGEST_SIZE = 32  # one SHA-256 in expert_hashes.bin

# The dense file's sampled hash (`dense_sample_sha256`): its header, then this many fixed
# samples of this size spread over its tensor data (all of it when that is smaller).
DENSE_SAMPLES = 16
DENSE_SAMPLE_BYTES = 1 << 20

# The files of a pack directory (the manifest names the other three; these are the defaults).
MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"
HASHES_NAME = "expert_hashes.bin"
DENSE_NAME = "dense.gguf"
PARTIAL_SUFFIX = ".partial"  # a directory ending in this is an unfinished build, never a pack

HEADER_MAGIC = b"EXPTPACK"
# magic, format_version, alignment, data_start, expert_stride, num_layers, num_experts, layout_sha256
_HEADER = struct.Struct("<8sIIQQII32s")
_HEADER_V1 = struct.Struct("<8sI")  # what every version shares: enough to name an old file's version
HEADER_SIZE = _HEADER.size  # bytes of the header proper; experts.bin pads it to `alignment`


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


def role_offsets(nbytes: Sequence[int], alignment: int = ALIGNMENT) -> list[int]:
    """Offsets inside a block of roles of these sizes, back to back, each one aligned."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = align_up(end + n, alignment)
    return offsets


def experts_geometry(layers: Sequence[LayerEntry], num_experts: int) -> tuple[int, int, int]:
    """(data_start, expert_stride, experts_file_size) of experts.bin for these layers.

    The header takes the first aligned page; the stride is the largest block so that
    one formula addresses every (layer, expert).
    """
    data_start = ALIGNMENT
    stride = max(layer.read_nbytes for layer in layers)
    return data_start, stride, data_start + len(layers) * num_experts * stride


def experts_file_header(manifest: PackManifest) -> bytes:
    """The first `alignment` bytes of experts.bin for this manifest (its geometry and layout digest)."""
    head = _HEADER.pack(
        HEADER_MAGIC,
        manifest.format_version,
        manifest.alignment,
        manifest.data_start,
        manifest.expert_stride,
        manifest.num_layers,
        manifest.num_experts,
        bytes.fromhex(manifest.layout_sha256),
    )
    return head.ljust(manifest.alignment, b"\0")


def check_experts_file_header(data: bytes, manifest: PackManifest, path: str | os.PathLike) -> None:
    """Raise PackError if experts.bin's header (`data`, its first bytes) disagrees with the manifest.

    The header carries the layout digest the builder wrote, so a manifest whose blocks,
    roles, tensors, types, shapes or offsets were changed after the build is refused
    here even when the manifest's own `layout_sha256` was recomputed.
    """
    name = manifest.experts_file
    fix = "rebuild the pack with `expertdesk pack`"
    if len(data) < _HEADER.size or data[:8] != HEADER_MAGIC:
        raise PackError(path, f"{name} has no ExpertDesk header", fix)
    version = _HEADER_V1.unpack_from(data)[1]
    if version != manifest.format_version:
        raise PackError(path, f"{name} is format version {version}, manifest.json says {manifest.format_version}", fix)
    want = experts_file_header(manifest)
    if data[: _HEADER.size - DIGEST_SIZE] != want[: _HEADER.size - DIGEST_SIZE]:
        raise PackError(path, f"{name} header disagrees with manifest.json (geometry)", fix)
    if data[_HEADER.size - DIGEST_SIZE : _HEADER.size] != want[_HEADER.size - DIGEST_SIZE : _HEADER.size]:
        raise PackError(
            path,
            f"{name} was written for another block layout than manifest.json describes (layout_sha256 differs: "
            "layers, experts or roles were swapped or renamed in the manifest)",
            fix,
        )
    if data[_HEADER.size : manifest.alignment].strip(b"\0"):
        raise PackError(path, f"{name} header padding is not zero", fix)


def dense_sample_ranges(size: int, header_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the parts of the dense file that `dense_sample_sha256` hashes.

    The header `[0, header_bytes)` whole, then DENSE_SAMPLES samples of DENSE_SAMPLE_BYTES
    spread evenly over the rest (the first right after the header, the last ending at the
    end of the file), or the whole rest when it is no larger than the samples together.
    """
    ranges = [(0, header_bytes)] if header_bytes else []
    span = size - header_bytes
    if span <= DENSE_SAMPLES * DENSE_SAMPLE_BYTES:
        return ranges + ([(header_bytes, span)] if span > 0 else [])
    step = (span - DENSE_SAMPLE_BYTES) // (DENSE_SAMPLES - 1)
    return ranges + [(header_bytes + k * step, DENSE_SAMPLE_BYTES) for k in range(DENSE_SAMPLES)]


def dense_sample_digest(size: int, header_bytes: int, read: Callable[[int, int], bytes]) -> str:
    """Hex `dense_sample_sha256` of a dense file of `size` bytes; `read(offset, length)` gives its bytes.

    SHA-256 of `b"expertdesk-dense-sample\\0"`, u64 size, u64 header_bytes, then for each
    range of `dense_sample_ranges` its u64 offset and its bytes.
    """
    digest = hashlib.sha256(b"expertdesk-dense-sample\0" + struct.pack("<QQ", size, header_bytes))
    for offset, length in dense_sample_ranges(size, header_bytes):
        data = read(offset, length)
        if len(data) != length:
            raise OSError(f"short read at {offset}: {len(data)} of {length} bytes (the file shrank?)")
        digest.update(struct.pack("<Q", offset))
        digest.update(data)
    return digest.hexdigest()
