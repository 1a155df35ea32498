"""Helpers that write tiny GGUF files (single files and split sets) for tests.

Everything goes through ``gguf.GGUFWriter`` so the files are byte-for-byte what
the reference writer produces; tests that need broken files write a valid one
and then patch bytes with :func:`patch_bytes` / :func:`truncate`.

Tensors are given as a mapping name -> array:

* a float/int numpy array (F32, F16, F64, I8..I64) is stored as that type;
* a :class:`RawTensor` stores already-quantized bytes (``uint8`` in *byte*
  shape, i.e. the last dimension counts bytes) under a GGML quant type.

Metadata values are plain python values (int -> INT32, float -> FLOAT32, bool,
str, list of one of those) or :class:`Typed` when the GGUF type matters
(``split.no`` is UINT16, for example).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

DEFAULT_ARCH = "testarch"
SHARD_NAME_FORMAT = "{name}-{index:05d}-of-{count:05d}.gguf"


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (and element type for arrays)."""

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class RawTensor:
    """Already-quantized tensor bytes.

    ``data`` is uint8 in byte shape: numpy order, last dimension in bytes
    (``cols // block_size * bytes_per_block``).
    """

    data: np.ndarray
    ggml_type: GGMLQuantizationType

    @property
    def element_shape(self) -> tuple[int, ...]:
        """Numpy-order shape in elements (what the GGUF file will describe)."""
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        *outer, row_bytes = self.data.shape
        return (*outer, row_bytes // type_size * block_size)


def quantized_bytes(
    shape: Sequence[int], ggml_type: GGMLQuantizationType, seed: int = 0
) -> RawTensor:
    """Random bytes of a quantized tensor whose numpy-order element shape is ``shape``.

    The content is noise (scales may be NaN): the source reader only moves bytes.
    """
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    *outer, cols = shape
    if cols % block_size:
        raise ValueError(f"last dim {cols} is not a multiple of the block size {block_size}")
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(*outer, cols // block_size * type_size), dtype=np.uint8)
    return RawTensor(data, ggml_type)


def expert_stack(
    n_experts: int,
    rows: int,
    cols: int,
    ggml_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    seed: int = 0,
) -> RawTensor | np.ndarray:
    """A stacked expert tensor of numpy shape (n_experts, rows, cols).

    F32 gives a float32 array; any quant type gives a :class:`RawTensor`.
    """
    if ggml_type == GGMLQuantizationType.F32:
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n_experts, rows, cols), dtype=np.float32)
    return quantized_bytes((n_experts, rows, cols), ggml_type, seed)


def tensor_raw_bytes(tensor: np.ndarray | RawTensor) -> bytes:
    """The exact bytes the writer stores for ``tensor`` (little-endian host)."""
    data = tensor.data if isinstance(tensor, RawTensor) else tensor
    return np.ascontiguousarray(data).tobytes()


def _add_metadata(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, Typed):
        writer.add_key_value(key, value.value, value.vtype, value.sub_type)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        # add_string() silently drops empty strings; add_key_value keeps them.
        writer.add_key_value(key, value, GGUFValueType.STRING)
    elif isinstance(value, (list, tuple)):
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY)
    else:
        raise TypeError(f"unsupported metadata value for {key}: {value!r}")


def write_gguf(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray | RawTensor] | None = None,
    metadata: Mapping[str, Any] | None = None,
    *,
    arch: str | None = DEFAULT_ARCH,
    alignment: int | None = None,
) -> Path:
    """Write one GGUF file and return its path.

    ``arch=None`` (or "") leaves out ``general.architecture``, as later shards of
    a split set do. ``alignment`` sets ``general.alignment``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch or "")
    try:
        if alignment is not None:
            writer.add_custom_alignment(alignment)
        for key, value in (metadata or {}).items():
            _add_metadata(writer, key, value)
        for name, tensor in (tensors or {}).items():
            if isinstance(tensor, RawTensor):
                writer.add_tensor(name, tensor.data, raw_dtype=tensor.ggml_type)
            else:
                writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def shard_path(folder: str | os.PathLike, name: str, index: int, count: int) -> Path:
    """``folder/NAME-0000index-of-0000count.gguf`` (index is 1-based, as in the name)."""
    return Path(folder) / SHARD_NAME_FORMAT.format(name=name, index=index, count=count)


def split_metadata(shard_no: int, split_count: int, tensors_count: int) -> dict[str, Typed]:
    """The three ``split.*`` keys llama.cpp's gguf-split writes into every shard."""
    return {
        "split.no": Typed(shard_no, GGUFValueType.UINT16),
        "split.count": Typed(split_count, GGUFValueType.UINT16),
        "split.tensors.count": Typed(tensors_count, GGUFValueType.INT32),
    }


def write_shard(
    folder: str | os.PathLike,
    name: str,
    shard_no: int,
    split_count: int,
    tensors_count: int,
    tensors: Mapping[str, np.ndarray | RawTensor] | None = None,
    metadata: Mapping[str, Any] | None = None,
    *,
    arch: str | None = None,
    file_index: int | None = None,
    file_count: int | None = None,
) -> Path:
    """Write one shard with explicit split.* values (for building broken sets).

    ``file_index`` / ``file_count`` override the numbers in the file name
    (default: ``shard_no + 1`` and ``split_count``).
    """
    path = shard_path(
        folder,
        name,
        shard_no + 1 if file_index is None else file_index,
        split_count if file_count is None else file_count,
    )
    meta = dict(split_metadata(shard_no, split_count, tensors_count))
    meta.update(metadata or {})
    return write_gguf(path, tensors, meta, arch=arch)


def write_split_set(
    folder: str | os.PathLike,
    name: str,
    shard_tensors: Sequence[Mapping[str, np.ndarray | RawTensor]],
    metadata: Mapping[str, Any] | None = None,
    *,
    arch: str = DEFAULT_ARCH,
    arch_in_every_shard: bool = False,
) -> list[Path]:
    """Write a split set ``NAME-0000k-of-0000n.gguf`` the way gguf-split does.

    Shard 0 carries ``general.architecture`` and all of ``metadata``; the others
    carry only the split.* keys (plus the architecture if ``arch_in_every_shard``).
    Returns the shard paths in order.
    """
    count = len(shard_tensors)
    total = sum(len(t) for t in shard_tensors)
    paths = []
    for shard_no, tensors in enumerate(shard_tensors):
        first = shard_no == 0
        paths.append(
            write_shard(
                folder,
                name,
                shard_no,
                count,
                total,
                tensors,
                metadata if first else None,
                arch=arch if (first or arch_in_every_shard) else None,
            )
        )
    return paths


def patch_bytes(path: str | os.PathLike, offset: int, data: bytes) -> None:
    """Overwrite ``data`` at ``offset`` in place (the file keeps its size unless extended)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path: str | os.PathLike, size: int) -> None:
    """Cut the file to ``size`` bytes."""
    with open(path, "r+b") as f:
        f.truncate(size)
