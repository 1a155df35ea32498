"""The synthetic Expert Pack the benchmarks write: its layout, its manifest and the files
around experts.bin (format per docs/expert-pack-format.md).

`bench_runtime.py` fills experts.bin its own way (random slices of a pool); the rest is this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from expertpack import (
    LayerEntry,
    PackManifest,
    RoleEntry,
    SourceFile,
    dense_sample_sha256,
    experts_geometry,
    role_offsets,
    write_manifest,
)

UNKNOWN_SHA = "0" * 64


def bench_layers(blocks: Iterable[int], roles: Sequence[tuple]) -> tuple[LayerEntry, ...]:
    """One LayerEntry per block, every block with the same `roles` (name, ggml_type,
    type_name, shape, nbytes), back to back and aligned, named like llama.cpp's routed experts."""
    offsets = role_offsets([nbytes for *_, nbytes in roles])
    return tuple(
        LayerEntry(block, tuple(RoleEntry(name, f"blk.{block}.ffn_{name}_exps.weight", offset, nbytes, type_id,
                                          type_name, shape)
                                for (name, type_id, type_name, shape, nbytes), offset in zip(roles, offsets)))
        for block in blocks
    )


def bench_manifest(layers: tuple[LayerEntry, ...], *, num_experts: int, top_k: int, tool: str,
                   hashes_sha: str = UNKNOWN_SHA, dense_sha: str = UNKNOWN_SHA) -> PackManifest:
    """The manifest of a complete synthetic pack (the header of experts.bin needs it too:
    geometry is all it reads, so the checksums may be left unknown there)."""
    data_start, stride, size = experts_geometry(layers, num_experts)
    return PackManifest(
        architecture="deepseek4-bench", num_experts=num_experts, expert_used_count=top_k,
        data_start=data_start, expert_stride=stride, layers=layers, experts_file_size=size,
        hashes_sha256=hashes_sha, dense_sha256=dense_sha,
        source_files=(SourceFile("synthetic.gguf", 0, UNKNOWN_SHA),), source_tensor_count=0,
        config_sha256=UNKNOWN_SHA, tool=tool, complete=True,
    )


def finish_pack(directory: Path, layers: tuple[LayerEntry, ...], hashes: bytes, *, num_experts: int, top_k: int,
                tool: str) -> None:
    """After experts.bin: expert_hashes.bin, a placeholder dense.gguf (the runtime never
    opens it) and the manifest with both checksums."""
    (directory / "expert_hashes.bin").write_bytes(hashes)
    dense = b"GGUF" + bytes(60)
    (directory / "dense.gguf").write_bytes(dense)
    manifest = bench_manifest(layers, num_experts=num_experts, top_k=top_k, tool=tool,
                              hashes_sha=hashlib.sha256(hashes).hexdigest(),
                              dense_sha=hashlib.sha256(dense).hexdigest())
    write_manifest(directory, replace(manifest, dense_file_size=len(dense), dense_header_bytes=4,
                                      dense_sample_sha256=dense_sample_sha256(directory / "dense.gguf", len(dense), 4)))
