"""Tiny Expert Packs for runtime tests, written directly per docs/expert-pack-format.md.

Independent of the GGUF packer on purpose: the runtime is tested against the format,
not against one builder. Role bytes are random, so any mix-up of experts, layers or
roles shows as a byte mismatch.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from expertpack import (
    DENSE_NAME,
    EXPERTS_NAME,
    HASHES_NAME,
    LayerEntry,
    PackManifest,
    RoleEntry,
    SourceFile,
    dense_sample_sha256,
    experts_file_header,
    experts_geometry,
    role_offsets,
    write_manifest,
)

# (ggml type id, name, bytes per block of 32 values) of the types used here.
Q8_0 = (8, "Q8_0", 34)
Q4_0 = (2, "Q4_0", 18)


def role_spec(name: str, rows: int, cols: int, qtype: tuple[int, str, int] = Q8_0) -> tuple:
    """(name, ggml_type, type_name, shape, nbytes) of one role of one expert."""
    type_id, type_name, block_bytes = qtype
    assert cols % 32 == 0
    return name, type_id, type_name, (rows, cols), rows * cols // 32 * block_bytes


DEFAULT_ROLES = (role_spec("gate", 24, 256), role_spec("up", 24, 256), role_spec("down", 64, 96))


@dataclass
class TinyPack:
    path: Path
    manifest: PackManifest
    roles: dict[tuple[int, int], dict[str, bytes]]  # (block, expert) -> role -> bytes

    def role_bytes(self, block: int, expert: int, role: str) -> bytes:
        return self.roles[(block, expert)][role]

    def block_bytes(self, block: int, expert: int) -> bytes:
        """The expert's whole aligned block as stored (roles plus zero padding)."""
        layer = self.manifest.layer_for_block(block)
        out = bytearray(layer.read_nbytes)
        for role in layer.roles:
            out[role.offset : role.end] = self.roles[(block, expert)][role.name]
        return bytes(out)


def make_pack(
    directory: str | Path,
    *,
    blocks: tuple[int, ...] = (1, 3),
    num_experts: int = 8,
    top_k: int = 2,
    roles: tuple = DEFAULT_ROLES,
    layer_roles: dict[int, tuple] | None = None,
    seed: int = 0,
    complete: bool = True,
) -> TinyPack:
    """Write a pack into `directory` (created) and return it with its source bytes.

    `layer_roles` overrides the role specs of some blocks (mixed-quant packs: same role
    names, other types/sizes; the stride is the largest block).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    layers = []
    for block in blocks:
        specs = (layer_roles or {}).get(block, roles)
        offsets = role_offsets([nbytes for *_, nbytes in specs])
        layers.append(LayerEntry(block, tuple(
            RoleEntry(name, f"blk.{block}.ffn_{name}_exps.weight", offset, nbytes, type_id, type_name, shape)
            for (name, type_id, type_name, shape, nbytes), offset in zip(specs, offsets))))
    data_start, stride, file_size = experts_geometry(layers, num_experts)
    source: dict[tuple[int, int], dict[str, bytes]] = {}
    digests = []
    # The header needs a manifest; geometry is all it reads, so build it twice.
    manifest = _manifest(layers, num_experts, top_k, data_start, stride, file_size, "0" * 64, "0" * 64, complete)
    with open(path / EXPERTS_NAME, "wb") as f:
        f.write(experts_file_header(manifest))
        for layer_index, layer in enumerate(layers):
            for expert in range(num_experts):
                block = bytearray(stride)
                source[(layer.block, expert)] = {}
                for r, role in enumerate(layer.roles):
                    data = rng.integers(0, 256, role.nbytes, dtype=np.uint8).tobytes()
                    block[role.offset : role.end] = data
                    source[(layer.block, expert)][role.name] = data
                    digests.append(manifest.slice_digest(layer_index, expert, r, data))
                assert f.tell() == manifest.block_offset(layer_index, expert)
                f.write(block)
    hashes = b"".join(digests)
    (path / HASHES_NAME).write_bytes(hashes)
    dense = b"GGUF" + bytes(60)  # placeholder: the runtime never opens dense.gguf
    (path / DENSE_NAME).write_bytes(dense)
    manifest = replace(
        _manifest(layers, num_experts, top_k, data_start, stride, file_size,
                  hashlib.sha256(hashes).hexdigest(), hashlib.sha256(dense).hexdigest(), complete),
        dense_file_size=len(dense), dense_header_bytes=4,
        dense_sample_sha256=dense_sample_sha256(path / DENSE_NAME, len(dense), 4),
    )
    write_manifest(path, manifest)
    return TinyPack(path, manifest, source)


def _manifest(layers, num_experts, top_k, data_start, stride, file_size, hashes_sha, dense_sha,
              complete) -> PackManifest:
    return PackManifest(
        architecture="tiny-moe",
        num_experts=num_experts,
        expert_used_count=top_k,
        data_start=data_start,
        expert_stride=stride,
        layers=tuple(layers),
        experts_file_size=file_size,
        hashes_sha256=hashes_sha,
        dense_sha256=dense_sha,
        source_files=(SourceFile("tiny.gguf", 0, "0" * 64),),
        source_tensor_count=0,
        config_sha256="0" * 64,
        tool="expertdesk tests",
        complete=complete,
    )


def fail_first_read(monkeypatch) -> None:
    """The next `os.preadv` raises EIO (a drive hiccup); every later one reads normally."""
    real, failed = os.preadv, []

    def eio_once(fd, buffers, offset, *args):
        if not failed:
            failed.append(offset)
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", eio_once)


class GatedReads:
    """Every `os.preadv` from now on records (offset, time) in `started` as it begins, then
    waits for `gate` (set it to let them all finish); `wait_started(n)` waits until n began."""

    def __init__(self, monkeypatch) -> None:
        import threading

        self.real = os.preadv
        self.gate = threading.Event()
        self.started: list[tuple[int, float]] = []
        self._seen = threading.Condition()
        monkeypatch.setattr(os, "preadv", self._read)

    def _read(self, fd, buffers, offset, *args):
        with self._seen:
            self.started.append((offset, time.perf_counter()))
            self._seen.notify_all()
        self.gate.wait(10)
        return self.real(fd, buffers, offset, *args)

    def wait_started(self, n: int = 1, condition=None, timeout: float = 10.0) -> list[int]:
        """The offsets begun, once `n` have (or `condition(offsets)` holds); fails after `timeout` s."""
        def ready() -> bool:
            offsets = [o for o, _t in self.started]
            return condition(offsets) if condition is not None else len(offsets) >= n

        with self._seen:
            assert self._seen.wait_for(ready, timeout), self.started
            return [o for o, _t in self.started]


def flip(path: Path, offset: int) -> None:
    """Damage one byte of the file at `path`: flip the lowest bit of the byte at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
