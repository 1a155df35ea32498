"""Where the bytes of a pack lie: names, alignment, block geometry and the experts.bin header.

Pure arithmetic on the rules of docs/expert-pack-format.md; nothing here touches a
file except through bytes handed in.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from expertpack.errors import PackError

if TYPE_CHECKING:  # annotations only: manifest.py imports this module
    from expertpack.manifest import LayerEntry, PackManifest

FORMAT_NAME = "expertdesk-pack"
FORMAT_VERSION = 1
ALIGNMENT = 4096
DIGEST_SIZE = 32  # one SHA-256 in expert_hashes.bin

# The files of a pack directory (the manifest names the other three; these are the defaults).
MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"
HASHES_NAME = "expert_hashes.bin"
DENSE_NAME = "dense.gguf"
PARTIAL_SUFFIX = ".partial"  # a directory ending in this is an unfinished build, never a pack

HEADER_MAGIC = b"EXPTPACK"
# magic, format_version, alignment, data_start, expert_stride, num_layers, num_experts
_HEADER = struct.Struct("<8sIIQQII")
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
    """The first `alignment` bytes of experts.bin for this manifest."""
    head = _HEADER.pack(
        HEADER_MAGIC,
        manifest.format_version,
        manifest.alignment,
        manifest.data_start,
        manifest.expert_stride,
        manifest.num_layers,
        manifest.num_experts,
    )
    return head.ljust(manifest.alignment, b"\0")


def check_experts_file_header(data: bytes, manifest: PackManifest, path: str | os.PathLike) -> None:
    """Raise PackError if experts.bin's header (`data`, its first bytes) disagrees with the manifest."""
    if len(data) < _HEADER.size or data[:8] != HEADER_MAGIC:
        raise PackError(path, "experts file has no ExpertDesk header", "rebuild the pack")
    if data[: manifest.alignment] != experts_file_header(manifest)[: len(data[: manifest.alignment])]:
        raise PackError(path, "experts file header disagrees with manifest.json", "rebuild the pack")
