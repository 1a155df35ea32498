"""Read a source model in GGUF form: one ``.gguf`` file or a split set of shards.

The structure is parsed by ``gguf.GGUFReader`` (the reference reader from llama.cpp's
gguf-py), but never trusted blindly. Downloads of several hundred GB get cut short,
shards get mixed between models, and GGUFReader on hostile bytes does things we
cannot accept:

* it reads through ``memmap[a:b]`` slices, so a string length or element count that
  runs past the end of the file gives a *short* read: silently truncated strings, or,
  for an array of numbers at EOF, an empty view that does not advance the cursor, so
  a claimed length of 2**63 loops (and allocates) practically forever;
* it computes tensor sizes and offsets in ``uint64`` numpy arithmetic, which wraps
  around silently, so a tensor can end up "inside" the file with garbage bounds;
* unknown types, bad UTF-8, duplicate keys etc. surface as assorted ValueError,
  KeyError, IndexError or UnicodeDecodeError with no file name;
* it builds one numpy view per array element through ``np.memmap.__getitem__``,
  which takes ~13 s for a 160k-token vocabulary (tokens, scores, types, merges),
  and two views per string of a string array (~700 MB for 2M strings).

So :class:`_CheckedReader` subclasses GGUFReader and replaces its low-level
primitives: ``_get`` reads from a plain ndarray view of the map and raises on any
short read, ``_get_str`` bounds string lengths, and ``_get_field_parts`` handles
metadata arrays with a bounded fast path (numbers: one view; strings: one view of
all their bytes plus 8 bytes of offsets per string, decoded once). A hook before
``_build_tensors`` validates every tensor with Python integers (no wrap-around)
before GGUFReader makes views of it. Before GGUFReader even runs, the 24-byte
header is checked by hand: magic, version, byte order, and counts that cannot fit
in the file. Every count and size is checked before anything is read or allocated
for it, against the bytes left in the file and against ``packer.limits``
(explained in ``docs/limits.md``), so reading a header costs time and memory in
proportion to the file's real size. Every failure becomes a
:class:`GGUFFormatError` that names the file and, where it helps, what to do.

Split sets (``NAME-00001-of-00003.gguf`` ...) written by llama.cpp's gguf-split keep
all metadata in shard 0; every shard carries ``split.no`` (0-based), ``split.count``
and ``split.tensors.count``; a tensor never spans shards. :meth:`GGUFSource.open`
takes any shard, finds the others by name and checks that they form one set.

:func:`read_header` gives one file's header as stored (each metadata value's exact
bytes, where the tensor data starts, a SHA-256 fingerprint), with the same checks, for
writers that must copy metadata bit for bit (the builder's dense.gguf).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from packer.limits import (
    ARCH_COUNT_LIMITS,
    LIMITS_DOC,
    MAX_METADATA_ARRAY_ELEMENTS,
    MAX_METADATA_KEYS,
    MAX_METADATA_STRINGS,
    MAX_NAME_BYTES,
    MAX_SHARDS,
    MAX_STRING_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSORS,
)

__all__ = [
    "GGUFFormatError",
    "GGUFHeader",
    "GGUFSource",
    "MetadataField",
    "TensorInfo",
    "read_header",
    "split_set_paths",
    "SUPPORTED_GGUF_VERSIONS",
    "MAX_TENSOR_DIMS",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # v1 used 32-bit counts; v2 and v3 share one layout

# magic, version, tensor_count, kv_count (little-endian, GGUF v2+)
_HEADER = struct.Struct("<4sIQQ")
# Smallest possible encodings, used to reject counts that cannot fit in the file
# before GGUFReader starts looping over them.
_MIN_KV_BYTES = 12  # key length (8) + value type (4), before any key or value bytes
_MIN_TENSOR_INFO_BYTES = 24  # name length (8) + n_dims (4) + type (4) + offset (8)
# The MAX_* limits (imported above, re-exported) are in packer/limits.py, explained in docs/limits.md.

_SCALAR_DTYPES: dict[int, np.dtype] = {
    int(vtype): np.dtype(nptype) for vtype, nptype in GGUFReader.gguf_scalar_to_np.items()
}
_STRING = int(GGUFValueType.STRING)
_ARRAY = int(GGUFValueType.ARRAY)
_VALUE_TYPE_IDS = frozenset(int(t) for t in GGUFValueType)
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"

# GGML type id -> (name, elements per block, bytes per block), from this gguf version.
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(qtype): (qtype.name, block, size) for qtype, (block, size) in GGML_QUANT_SIZES.items()
}

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5,})-of-(?P<count>\d{5,})\.gguf$")

_HINT_REDOWNLOAD = "the file is damaged or incomplete: re-download it"
_HINT_TRUNCATED = "the file is incomplete (interrupted download?): re-download it"
_HINT_LIMIT = "no real model comes near this limit: the file is damaged or is not a model file"


def _over_limit(subject: str, limit: int, unit: str) -> str:
    """The problem text of a refused count or size: what, the limit, where the limits are explained."""
    return f"{subject}, more than the limit of {limit} {unit} (see {LIMITS_DOC})"


class GGUFFormatError(ValueError):
    """A file is not a usable GGUF file, or shards do not form one split set.

    ``str(e)`` is ``"{path}: {problem}"`` plus ``"; {hint}"`` when there is
    something useful to do about it. ``path`` is the file at fault (for a missing
    shard: the file name that was expected).
    """

    def __init__(self, path: str | os.PathLike, problem: str, hint: str | None = None):
        self.path = Path(path)
        self.problem = problem
        self.hint = hint
        message = f"{self.path}: {problem}"
        if hint:
            message += f"; {hint}"
        super().__init__(message)

    def __reduce__(self):  # keep it picklable (worker processes) despite the custom __init__
        return (type(self), (self.path, self.problem, self.hint))


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are and how to read them.

    ``ne`` is GGUF order (fastest dimension first); ``shape`` is numpy order (reversed),
    in elements. ``offset`` is absolute in ``file``; the bytes are ``nbytes`` long.
    """

    name: str
    ggml_type: int
    type_name: str
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    file: Path
    shard: int
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        """Number of elements (product of the shape)."""
        count = 1
        for dim in self.ne:
            count *= dim
        return count

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for plain float/int types)."""
        return _GGML_TYPES[self.ggml_type][1]

    @property
    def block_nbytes(self) -> int:
        """Bytes per quantization block (the element size for plain types)."""
        return _GGML_TYPES[self.ggml_type][2]

    @property
    def n_experts(self) -> int:
        """Experts stacked in this tensor: the outermost dimension (numpy ``shape[0]``).

        Valid for stacked expert weights (3-D) and stacked per-expert biases (2-D).
        """
        self._require_stacked()
        return self.shape[0]

    def expert_nbytes(self) -> int:
        """Bytes of one expert's slice of a stacked tensor (``nbytes // shape[0]``).

        Exact: blocks run along the fastest dimension, which every slice keeps whole.
        """
        self._require_stacked()
        return self.nbytes // self.shape[0]

    def _require_stacked(self) -> None:
        if len(self.shape) < 2:
            raise ValueError(
                f"tensor {self.name} has shape {self.shape}: not a stacked expert tensor "
                "(experts must be the outermost of 2 or 3 dimensions)"
            )


def _shown(value: object, limit: int = 80) -> str:
    """repr() of a name or value for an error message, cut short: a bad file's can be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ReadProblem(Exception):
    """Raised inside the reader; becomes a GGUFFormatError once the file is known."""

    def __init__(self, problem: str, hint: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


class _CheckedReader(GGUFReader):
    """GGUFReader with bounds-checked reads, a fast metadata-array path and tensor checks.

    The overridden methods are GGUFReader internals (gguf-py 0.17 .. 0.19); the base
    class's parsing logic stays in charge of the layout. If a future gguf-py renames
    them, the overrides simply stop being called and the tests for truncation and
    vocabulary speed fail, which is the signal to revisit this class.

    Every count is checked against the bytes left in the file and against
    ``packer.limits`` *before* anything is read or allocated for it, so the cost of
    reading a header is proportional to the bytes really there.

    A metadata array of strings is NOT in GGUFReader's form (two numpy views per
    string: ~700 MB for 2M strings): its one data part is a single view of all its
    bytes (length prefixes included), and ``string_bounds[key]`` holds the byte offset
    of each string's length prefix plus the end, from which :func:`_field_value`
    decodes the strings. ``field.contents()`` does not work for such a field.
    """

    _plain: np.ndarray | None = None  # the map as a plain ndarray (no memmap subclass overhead)
    _n_strings = 0  # strings seen in metadata arrays so far
    _n_elements = 0  # elements of metadata arrays seen so far (strings included)
    _pending_bounds: array[int] | None = None  # bounds of the string array just parsed, until its key is pushed
    string_bounds: dict[str, array[int]]  # key -> offsets of a string array's strings (see above)
    validated_tensors: list[tuple[str, tuple[int, ...], int, int, int]]  # name, ne, type, offset, nbytes

    def __init__(self, path, mode="r"):
        self.string_bounds = {}
        super().__init__(path, mode)

    def _buffer(self) -> np.ndarray:
        plain = self._plain
        if plain is None:
            # np.memmap's __getitem__ / __array_finalize__ cost ~10 us per slice;
            # a base-class view of the same mapping costs a fraction of that.
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(self, offset, dtype, count=1, override_order=None):
        """Like GGUFReader._get, but a read past the end of the file is an error."""
        plain = self._buffer()
        offset = int(offset)
        count = int(count)
        dtype = np.dtype(dtype)
        end = offset + dtype.itemsize * count
        if offset < 0 or count < 0 or end > plain.shape[0]:
            raise _ReadProblem(
                f"a field at byte {offset} needs {dtype.itemsize * count} bytes, "
                f"but the file ends at byte {plain.shape[0]}",
                _HINT_TRUNCATED,
            )
        arr = plain[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        if order == "I" or (order == "<" and _LITTLE_ENDIAN_HOST):
            return arr  # already in host order: the second view would change nothing (and costs ~1 us)
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_str(self, offset):
        """Like GGUFReader._get_str (keys, string values, tensor names), with the string length limit."""
        slen, data = super()._get_str(offset)  # through our _get: a string past the end is an error
        if data.shape[0] > MAX_STRING_BYTES:
            raise _ReadProblem(
                _over_limit(f"the field at byte {offset} is a {data.shape[0]}-byte string", MAX_STRING_BYTES, "bytes"),
                _HINT_LIMIT,
            )
        return slen, data

    def _get_field_parts(self, orig_offs, raw_type):
        """GGUFReader._get_field_parts with clear errors and a bounded array path.

        Arrays of numbers become ONE part holding all elements (``contents()`` flattens
        parts, so values are unchanged); arrays of strings become ONE part holding all
        their bytes, with the strings' offsets in ``string_bounds`` (see the class).
        An array's element count is checked against the bytes left in the file and the
        limits before a single element is read.
        """
        raw_type = int(raw_type)
        if raw_type not in _VALUE_TYPE_IDS:
            raise _ReadProblem(f"unknown metadata value type {raw_type} at byte {orig_offs}", _HINT_REDOWNLOAD)
        if raw_type != _ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)

        plain = self._buffer()
        offs = int(orig_offs)
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        offs += 12
        item_type = int(raw_itype[0])
        length = int(alen[0])
        if item_type == _ARRAY:
            raise _ReadProblem(f"metadata array of arrays at byte {orig_offs} is not supported")
        if item_type not in _VALUE_TYPE_IDS:
            raise _ReadProblem(
                f"unknown metadata array element type {item_type} at byte {orig_offs}", _HINT_REDOWNLOAD
            )
        min_item_bytes = 8 if item_type == _STRING else _SCALAR_DTYPES[item_type].itemsize
        remaining = plain.shape[0] - offs
        if length * min_item_bytes > remaining:
            raise _ReadProblem(
                f"metadata array at byte {orig_offs} claims {length} elements, "
                f"more than the {remaining} bytes left in the file can hold",
                _HINT_TRUNCATED,
            )
        self._n_elements += length
        if self._n_elements > MAX_METADATA_ARRAY_ELEMENTS:
            raise _ReadProblem(
                _over_limit(f"the metadata arrays hold {self._n_elements} elements (the array at byte {orig_offs} "
                            f"has {length})", MAX_METADATA_ARRAY_ELEMENTS, "elements"),
                _HINT_LIMIT,
            )
        parts: list[np.ndarray] = [raw_itype, alen]
        types = [GGUFValueType.ARRAY]
        if length == 0:
            return 12, parts, [], types  # GGUFReader gives empty arrays no element type either
        types.append(GGUFValueType(item_type))

        if item_type != _STRING:
            values = self._get(offs, _SCALAR_DTYPES[item_type], length)
            parts.append(values)
            return 12 + int(values.nbytes), parts, [2], types

        self._n_strings += length
        if self._n_strings > MAX_METADATA_STRINGS:
            raise _ReadProblem(
                _over_limit(f"the metadata arrays hold {self._n_strings} strings", MAX_METADATA_STRINGS, "strings"),
                _HINT_LIMIT,
            )
        # One pass over the length prefixes (they chain: no vectorised form), 8 bytes of
        # bounds per string; the strings themselves are decoded once, by _field_value.
        bounds = _scan_strings(plain, offs, length)
        parts.append(plain[offs:bounds[length]])
        self._pending_bounds = bounds
        return bounds[length] - orig_offs, parts, [2], types

    def _push_field(self, field, skip_sum=False):
        if field.name in self.fields:
            raise _ReadProblem(f"metadata key {_shown(field.name)} appears twice", _HINT_REDOWNLOAD)
        if skip_sum:  # a key/value from the file (GGUFReader pushes its GGUF.* pseudo-fields without skip_sum)
            name_bytes = int(field.parts[1].nbytes)  # parts: key length, key bytes, value type, value...
            if name_bytes > MAX_NAME_BYTES:
                raise _ReadProblem(
                    _over_limit(f"metadata key {_shown(field.name)} is {name_bytes} bytes long", MAX_NAME_BYTES,
                                "bytes"),
                    _HINT_LIMIT,
                )
            bounds, self._pending_bounds = self._pending_bounds, None
            if bounds is not None:
                self.string_bounds[field.name] = bounds
        return super()._push_field(field, skip_sum)

    def _build_tensors(self, start_offs, fields):
        """Validate every tensor info with Python integers, into ``validated_tensors``.

        GGUFReader's own ReaderTensor list (one enum, np.prod and two views per tensor:
        a third of the header's parse time) is not built: nothing here uses
        ``self.tensors``, which stays empty.
        """
        self.validated_tensors = _validate_tensor_infos(
            int(start_offs), fields, int(self.alignment), self._buffer().shape[0]
        )


_unpack_u64 = struct.Struct("<Q").unpack_from  # _check_header admits little-endian files only


def _scan_strings(plain: np.ndarray, offs: int, count: int) -> array[int]:
    """Byte offsets of the `count` strings of an array starting at `offs`, plus the end offset.

    Each string is ``u64 length + bytes``. The caller has checked that the file has room
    for `count` length prefixes, so the loop and the returned array (8 bytes per string)
    are bounded by the file's size; a string running past the end of the file or over
    MAX_STRING_BYTES is refused.
    """
    size = plain.shape[0]
    limit = MAX_STRING_BYTES
    bounds = array("q", bytes(8 * (count + 1)))
    unpack = _unpack_u64
    # An ndarray is a buffer; numpy's stubs say so for Python >= 3.12 only.
    with memoryview(plain) as raw:  # type: ignore[arg-type]
        for i in range(count):
            bounds[i] = offs
            try:
                (slen,) = unpack(raw, offs)
            except struct.error:
                raise _ReadProblem(
                    f"metadata string at byte {offs} is cut off by the end of the file", _HINT_TRUNCATED
                ) from None
            offs += 8 + slen
            if offs > size or slen > limit:
                start = bounds[i]
                if offs > size:
                    raise _ReadProblem(
                        f"metadata string at byte {start} claims {slen} bytes, past the end of the file",
                        _HINT_TRUNCATED,
                    )
                raise _ReadProblem(
                    _over_limit(f"the metadata string at byte {start} is a {slen}-byte string", limit, "bytes"),
                    _HINT_LIMIT,
                )
    bounds[count] = offs
    return bounds


def _validate_tensor_infos(
    data_start: int, fields: list, alignment: int, file_size: int
) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """Check each tensor info against the file; return (name, ne, type, offset, nbytes).

    Everything is computed with Python integers: the numpy uint64 arithmetic in
    GGUFReader wraps around on hostile values.
    """
    validated = []
    seen: set[str] = set()
    for field in fields:
        _name_len, name_data, n_dims_part, dims_part, type_part, offset_part = field.parts
        name = field.name
        if name_data.shape[0] > MAX_NAME_BYTES:
            raise _ReadProblem(
                _over_limit(f"tensor name {_shown(name)} is {name_data.shape[0]} bytes long", MAX_NAME_BYTES, "bytes"),
                _HINT_LIMIT,
            )
        if name in seen:
            raise _ReadProblem(f"tensor {_shown(name)} appears twice", _HINT_REDOWNLOAD)
        seen.add(name)
        n_dims = int(n_dims_part[0])
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            raise _ReadProblem(
                f"tensor {_shown(name)} has {n_dims} dimensions; GGUF allows 1 to {MAX_TENSOR_DIMS}", _HINT_REDOWNLOAD
            )
        ne = tuple(int(d) for d in dims_part)
        type_id = int(type_part[0])
        if type_id not in _GGML_TYPES:
            raise _ReadProblem(
                f"tensor {_shown(name)} has unknown GGML type id {type_id}",
                "the file is damaged, or it uses a quantization newer than this ExpertDesk knows",
            )
        type_name, block_size, block_nbytes = _GGML_TYPES[type_id]
        if any(d == 0 for d in ne):
            raise _ReadProblem(f"tensor {_shown(name)} has an empty dimension: ne={list(ne)}", _HINT_REDOWNLOAD)
        if ne[0] % block_size:
            raise _ReadProblem(
                f"tensor {_shown(name)} of type {type_name} has rows of {ne[0]} elements, "
                f"not a multiple of the block size {block_size}",
                _HINT_REDOWNLOAD,
            )
        n_elements = 1
        for d in ne:
            n_elements *= d
        nbytes = n_elements // block_size * block_nbytes
        relative = int(offset_part[0])
        if relative % alignment:
            raise _ReadProblem(
                f"tensor {_shown(name)} starts at data offset {relative}, not a multiple of the alignment {alignment}",
                _HINT_REDOWNLOAD,
            )
        offset = data_start + relative
        if offset + nbytes > file_size:
            raise _ReadProblem(
                f"tensor {_shown(name)} data runs past the end of the file (truncated download?): "
                f"bytes {offset}..{offset + nbytes} of a {file_size}-byte file",
                _HINT_TRUNCATED,
            )
        validated.append((name, ne, type_id, offset, nbytes))

    # Overlapping tensors mean a corrupt tensor table (writers never share bytes).
    by_offset = sorted(validated, key=lambda t: (t[3], t[4]))
    for before, after in zip(by_offset, by_offset[1:]):
        if after[3] < before[3] + before[4]:
            raise _ReadProblem(f"tensors {_shown(before[0])} and {_shown(after[0])} overlap in the file",
                               _HINT_REDOWNLOAD)
    return validated


@dataclass
class _ParsedFile:
    """One validated GGUF file: metadata values, tensors and the read-only map."""

    path: Path
    size: int
    version: int
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int, int, int]]  # name, ne, type, offset, nbytes
    buffer: np.ndarray  # plain uint8 view of the file's memory map


def _check_header(path: Path, size: int) -> None:
    """Validate the fixed 24-byte header ourselves, before GGUFReader sees the file."""
    if size < _HEADER.size:
        raise GGUFFormatError(path, f"truncated: {size} bytes, shorter than a GGUF header", _HINT_TRUNCATED)
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:  # shrank since stat()
        raise GGUFFormatError(path, "truncated: shorter than a GGUF header", _HINT_TRUNCATED)
    magic, version, tensor_count, kv_count = _HEADER.unpack(header)
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(
            path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})", "choose a .gguf model file"
        )
    if version not in SUPPORTED_GGUF_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and swapped in (1, 2, 3):
            raise GGUFFormatError(
                path, "big-endian GGUF files are not supported", "use the standard little-endian file of the model"
            )
        raise GGUFFormatError(
            path,
            f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_GGUF_VERSIONS))})",
            ("convert the model with a current llama.cpp" if version < min(SUPPORTED_GGUF_VERSIONS)
             else _HINT_REDOWNLOAD),
        )
    # GGUFReader loops `count` times; refuse counts the file cannot possibly hold.
    room = size - _HEADER.size
    if tensor_count > room // _MIN_TENSOR_INFO_BYTES or kv_count > room // _MIN_KV_BYTES or (
        tensor_count * _MIN_TENSOR_INFO_BYTES + kv_count * _MIN_KV_BYTES > room
    ):
        raise GGUFFormatError(
            path,
            f"header claims {tensor_count} tensors and {kv_count} metadata entries, "
            f"more than a {size}-byte file can hold",
            _HINT_REDOWNLOAD,
        )
    if tensor_count > MAX_TENSORS:
        raise GGUFFormatError(path, _over_limit(f"header claims {tensor_count} tensors", MAX_TENSORS, "tensors"),
                              _HINT_LIMIT)
    if kv_count > MAX_METADATA_KEYS:
        raise GGUFFormatError(
            path, _over_limit(f"header claims {kv_count} metadata entries", MAX_METADATA_KEYS, "entries"), _HINT_LIMIT
        )


def _decode(part: np.ndarray) -> str:
    """UTF-8 text of a string part; invalid bytes survive as surrogate escapes.

    Some vocabularies contain tokens that are not valid UTF-8 on their own; they must
    not make the model unreadable, and ``s.encode("utf-8", "surrogateescape")`` gives
    the exact original bytes back.
    """
    raw = part.tobytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape")


def _decode_strings(blob: np.ndarray, bounds: array[int]) -> list[str]:
    """The strings of a string array: `blob` holds its bytes, `bounds` where each string starts (and the end).

    Same text as :func:`_decode` per string (``surrogateescape`` changes nothing for
    valid UTF-8), in one pass over one copy of the bytes.
    """
    data = blob.tobytes()
    base = bounds[0]  # the blob starts at the first string's length
    text = base - 8  # a string's text starts after its 8-byte length
    return [data[start - text:end - base].decode("utf-8", "surrogateescape") for start, end in zip(bounds, bounds[1:])]


def _field_value(field, string_bounds: dict[str, array[int]]) -> Any:
    """Python value of one metadata field (ReaderField), via its typed parts.

    `string_bounds` is the reader's: a string array's one part is all its bytes (see _CheckedReader).
    """
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        if types[1] == GGUFValueType.STRING:
            return _decode_strings(field.parts[field.data[0]], string_bounds[field.name])
        return field.parts[field.data[0]].tolist()  # numbers: one part holding every element
    if types[0] == GGUFValueType.STRING:
        return _decode(field.parts[-1])
    return field.contents()


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        return "(unknown version)"


@contextlib.contextmanager
def _format_errors(path: Path) -> Iterator[None]:
    """Turn whatever GGUFReader (or our checks inside it) raises on bad bytes into GGUFFormatError."""
    try:
        yield
    except _ReadProblem as problem:
        raise GGUFFormatError(path, problem.problem, problem.hint) from None
    except UnicodeDecodeError as exc:
        raise GGUFFormatError(path, f"a key or tensor name is not valid UTF-8 ({exc.reason})",
                              _HINT_REDOWNLOAD) from None
    except RecursionError:
        raise GGUFFormatError(path, "metadata is nested too deeply", _HINT_REDOWNLOAD) from None
    except MemoryError:
        raise GGUFFormatError(path, "ran out of memory reading the file's header", _HINT_REDOWNLOAD) from None
    except Exception as exc:  # anything else GGUFReader throws on bad bytes
        raise GGUFFormatError(
            path, f"could not be read as GGUF ({type(exc).__name__}: {exc})", _HINT_REDOWNLOAD
        ) from None


def _open_reader(path: Path) -> tuple[_CheckedReader, int]:
    """(checked reader, file size) of one GGUF file; GGUFFormatError for anything wrong with it."""
    if path.is_dir():
        raise GGUFFormatError(path, "is a folder, not a .gguf file")
    size = path.stat().st_size
    _check_header(path, size)
    with _format_errors(path):
        return _CheckedReader(path, "r"), size


def _read_file(path: Path) -> _ParsedFile:
    """Parse and validate one GGUF file; every failure becomes GGUFFormatError."""
    reader, size = _open_reader(path)
    with _format_errors(path):
        metadata = {
            name: _field_value(field, reader.string_bounds)
            for name, field in reader.fields.items()
            # GGUFReader adds the header as pseudo-fields named GGUF.*; they are not metadata.
            if not name.startswith("GGUF.")
        }
        version = int(reader.fields["GGUF.version"].parts[0][0])
        n_reader_tensors = int(reader.fields["GGUF.tensor_count"].parts[0][0])
        tensors = getattr(reader, "validated_tensors", None)
        buffer = reader._buffer()
    if tensors is None or len(tensors) != n_reader_tensors:
        # Our _build_tensors hook did not run: gguf-py changed its internals. A bug, not a bad file.
        raise RuntimeError(f"gguf {_gguf_version()} is not compatible with packer.gguf_source")
    if buffer.shape[0] != size:
        raise GGUFFormatError(path, "the file changed while it was being opened", "try again")
    return _ParsedFile(path, size, version, metadata, tensors, buffer)


@dataclass(frozen=True)
class MetadataField:
    """One metadata entry exactly as the file stores it.

    ``data`` is the encoded value that follows the key and the value type: for a
    scalar its little-endian bytes, for a string ``u64 length + bytes``, for an array
    ``u32 element type + u64 count + elements``. Writing ``key, value_type, data``
    into another GGUF file reproduces the value bit for bit (u32 stays u32, empty
    arrays and non-UTF-8 strings survive), which a round trip through Python values
    cannot promise.
    """

    key: str
    value_type: int  # a gguf.GGUFValueType
    data: bytes


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before one GGUF file's tensor data: where the data starts and the raw metadata.

    ``sha256`` is the SHA-256 of bytes ``[0, data_offset)`` (magic, counts, metadata,
    tensor table and padding): a cheap fingerprint of the file. ``fields`` are in
    file order, without GGUFReader's ``GGUF.*`` pseudo-fields.
    """

    path: Path
    size: int
    data_offset: int
    alignment: int
    sha256: str
    fields: tuple[MetadataField, ...]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The :class:`GGUFHeader` of one GGUF file, read with the same checks as :meth:`GGUFSource.open`.

    Raises GGUFFormatError for a file that is not a usable GGUF file, FileNotFoundError
    if it does not exist, OSError for I/O failures.
    """
    path = Path(path)
    reader, size = _open_reader(path)
    with _format_errors(path):
        data = reader._buffer()
        fields = []
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            # A field is: u64 key length, key bytes, u32 value type, then the value.
            end = int(field.offset) + sum(int(part.nbytes) for part in field.parts)
            start = int(field.offset) + 8 + len(name.encode("utf-8")) + 4
            fields.append(MetadataField(name, int(field.types[0]), data[start:end].tobytes()))
        data_offset = int(reader.data_offset)
        header = GGUFHeader(
            path=path,
            size=int(data.shape[0]),
            data_offset=data_offset,
            alignment=int(reader.alignment),
            # An ndarray is a buffer; numpy's stubs say so for Python >= 3.12 only.
            sha256=hashlib.sha256(data[:data_offset]).hexdigest(),  # type: ignore[arg-type]
            fields=tuple(fields),
        )
    if header.size != size:
        raise GGUFFormatError(path, "the file changed while it was being opened", "try again")
    return header


def split_set_paths(path: str | os.PathLike) -> list[Path]:
    """All file names of the split set ``path`` belongs to, in shard order.

    ``NAME-0000k-of-0000n.gguf`` gives ``NAME-00001-of-0000n.gguf`` ..
    ``NAME-0000n-of-0000n.gguf`` in the same folder (whether or not they exist);
    any other name gives ``[path]``. A name whose own numbers are impossible
    (shard 0, or shard k > n) raises GGUFFormatError.
    """
    path = Path(path)
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    index, count = int(match["index"]), int(match["count"])
    if count == 0 or index == 0 or index > count:
        raise GGUFFormatError(
            path,
            f"the file name says shard {index} of {count}, which is impossible",
            "shards are numbered 00001 .. N in NAME-0000k-of-0000N.gguf; restore the original file names",
        )
    if count > MAX_SHARDS:
        raise GGUFFormatError(
            path,
            f"the file name says {count} shards; a split set has at most {MAX_SHARDS} shards (see {LIMITS_DOC})",
            "restore the original file names",
        )
    width = len(match["count"])
    return [path.with_name(f"{match['prefix']}-{k:0{width}d}-of-{match['count']}.gguf") for k in range(1, count + 1)]


def _stray_shards(expected: list[Path]) -> list[Path]:
    """Files next to the set whose name claims the same model but is not one of its shards."""
    match = _SPLIT_NAME.match(expected[0].name)
    assert match is not None
    prefix = match["prefix"]
    wanted = {p.name for p in expected}
    strays = []
    for entry in expected[0].parent.iterdir():
        other = _SPLIT_NAME.match(entry.name)
        if other and other["prefix"] == prefix and entry.name not in wanted:
            strays.append(entry)
    return sorted(strays)


def _split_int(parsed: _ParsedFile, key: str) -> int | None:
    """An integer split.* value, None when absent; a non-integer is a format error."""
    value = parsed.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFFormatError(parsed.path, f"{key} is {_shown(value)}, not an integer", _HINT_REDOWNLOAD)
    return value


def _check_model_counts(shards: list[_ParsedFile], architecture: str) -> None:
    """Refuse ``{architecture}.block_count`` etc. outside 0..limit (packer.limits.ARCH_COUNT_LIMITS).

    The adapters and the models loop over and size tables by these counts; 2**32-1
    layers must be a clear error here, not a MemoryError somewhere later. Values that
    are not integers are left to the code that reads them (it names the key).
    """
    for name, limit in ARCH_COUNT_LIMITS.items():
        key = f"{architecture}.{name}"
        for shard in shards:
            value = shard.metadata.get(key)
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            if not 0 <= value <= limit:
                raise GGUFFormatError(
                    shard.path, f"{key} is {value}, not a count from 0 to at most {limit} (see {LIMITS_DOC})",
                    _HINT_LIMIT,
                )


def _check_split_set(shards: list[_ParsedFile]) -> None:
    """Check that parsed shards (in file-name order) are one complete split set."""
    count = len(shards)
    first = shards[0]
    set_tensors = _split_int(first, "split.tensors.count")
    hint_mixed = "this shard belongs to a different download; all shards must come from the same model file set"
    for index, shard in enumerate(shards):
        shard_no = _split_int(shard, "split.no")
        shard_count = _split_int(shard, "split.count")
        if shard_no is None and shard_count is None and count == 1:
            continue  # NAME-00001-of-00001.gguf without split keys: just a single file
        if shard_no is None or shard_count is None:
            raise GGUFFormatError(
                shard.path,
                f"named as shard {index + 1} of {count}, but it has no split.no/split.count metadata",
                "it is not a gguf-split shard; restore the original file names",
            )
        if shard_count != count:
            raise GGUFFormatError(
                shard.path, f"split.count is {shard_count}, but the file names say {count} shards", hint_mixed
            )
        if shard_no != index:
            raise GGUFFormatError(
                shard.path,
                f"split.no says shard {shard_no + 1} of {count}, but the file name says shard {index + 1}",
                "a shard was renamed or comes from another set; restore the original files",
            )
        if index == 0:
            continue
        own_tensors = _split_int(shard, "split.tensors.count")
        if set_tensors is not None and own_tensors is not None and own_tensors != set_tensors:
            raise GGUFFormatError(
                shard.path,
                f"split.tensors.count is {own_tensors}, but shard 1 says {set_tensors}",
                hint_mixed,
            )
        # Later shards carry (almost) no metadata; whatever they share with shard 1 must agree.
        for key, value in shard.metadata.items():
            if key in ("split.no", "split.tensors.count") or key not in first.metadata:
                continue
            if first.metadata[key] != value:
                raise GGUFFormatError(
                    shard.path, f"{key} is {_shown(value)}, but shard 1 says {_shown(first.metadata[key])}", hint_mixed
                )
    if count > 1 and set_tensors is None:
        raise GGUFFormatError(first.path, "split set without split.tensors.count metadata", _HINT_REDOWNLOAD)
    total = sum(len(s.tensors) for s in shards)
    if set_tensors is not None and total != set_tensors:
        raise GGUFFormatError(
            first.path,
            f"the {count} shards hold {total} tensors, but split.tensors.count says {set_tensors}",
            "a shard is damaged or comes from another download; re-download the set",
        )


class GGUFSource:
    """A source model: one GGUF file or a whole split set, validated and memory-mapped.

    Use :meth:`open`. Attributes: ``files`` (shard order), ``file_sizes``,
    ``metadata`` (merged, Python values, ``split.*`` kept as in shard 1),
    ``tensors`` (name -> :class:`TensorInfo`, file order, shard 1 first),
    ``architecture``. Tensor bytes come back as zero-copy, read-only uint8 views.
    """

    files: list[Path]
    file_sizes: list[int]
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    architecture: str

    def __init__(self, parsed: list[_ParsedFile]):
        """Internal: build from validated, parsed files. Use :meth:`GGUFSource.open`."""
        self.files = [p.path for p in parsed]
        self.file_sizes = [p.size for p in parsed]
        self._buffers: list[np.ndarray] | None = [p.buffer for p in parsed]
        self.metadata = dict(parsed[0].metadata)
        for shard in parsed[1:]:
            for key, value in shard.metadata.items():
                self.metadata.setdefault(key, value)
        self.tensors = {}
        for shard_index, shard in enumerate(parsed):
            for name, ne, type_id, offset, nbytes in shard.tensors:
                if name in self.tensors:
                    raise GGUFFormatError(
                        shard.path,
                        f"tensor {_shown(name)} is also in {self.tensors[name].file.name}",
                        "shards from different sets are mixed in this folder",
                    )
                self.tensors[name] = TensorInfo(
                    name=name,
                    ggml_type=type_id,
                    type_name=_GGML_TYPES[type_id][0],
                    ne=ne,
                    shape=tuple(reversed(ne)),
                    file=shard.path,
                    shard=shard_index,
                    offset=offset,
                    nbytes=nbytes,
                )
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str) or not architecture:
            raise GGUFFormatError(
                self.files[0], "no general.architecture in the metadata", "this is not a model file llama.cpp can run"
            )
        _check_model_counts(parsed, architecture)
        self.architecture = architecture

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFSource:
        """Open one ``.gguf`` file, or a whole split set given any of its shards.

        Raises GGUFFormatError for anything wrong with the file(s) or the set
        (missing, extra or mismatched shards), FileNotFoundError if ``path`` itself
        does not exist, and OSError for I/O failures.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file")
        expected = split_set_paths(path)
        if len(expected) == 1 and not _SPLIT_NAME.match(path.name):
            parsed = _read_file(path)
            split_count = _split_int(parsed, "split.count")
            if split_count is not None and split_count > 1:
                shard_no = _split_int(parsed, "split.no")
                shard_desc = (f"shard {shard_no + 1} of {split_count}" if shard_no is not None
                              else f"one of {split_count} shards")
                raise GGUFFormatError(
                    path,
                    f"this file is {shard_desc} of a split model, but its name is not NAME-0000k-of-0000n.gguf",
                    "restore the original file names so the other shards can be found",
                )
            return cls([parsed])

        for shard_path in expected:
            if not shard_path.is_file():
                raise GGUFFormatError(
                    shard_path,
                    f"shard {expected.index(shard_path) + 1} of {len(expected)} is missing",
                    "all shards must be in the same folder: download the missing file",
                )
        strays = _stray_shards(expected)
        if strays:
            raise GGUFFormatError(
                strays[0],
                f"looks like a shard of the same model, but does not fit the set of {len(expected)} "
                f"({expected[0].name} .. {expected[-1].name})",
                "move leftover shards of other downloads out of this folder",
            )
        parsed_shards = [_read_file(p) for p in expected]
        _check_split_set(parsed_shards)
        return cls(parsed_shards)

    # -- tensor data ---------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        """The TensorInfo of ``name``; KeyError naming the model if there is none."""
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.files[0].name}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """All bytes of tensor ``name``: a zero-copy, read-only uint8 view of the file map."""
        info = self.tensor(name)
        return self._view(info.shard, info.offset, info.nbytes)

    def expert_bytes(self, name: str, expert: int) -> np.ndarray:
        """Bytes of expert ``expert`` of stacked tensor ``name`` (experts outermost).

        A zero-copy, read-only uint8 view of ``expert_nbytes()`` bytes at
        ``offset + expert * expert_nbytes()``. IndexError for an expert out of range.
        """
        info = self.tensor(name)
        n_experts = info.n_experts
        if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)):
            raise TypeError(f"expert index must be an int, not {type(expert).__name__}")
        if not 0 <= expert < n_experts:
            raise IndexError(f"expert {expert} out of range for tensor {name!r}: it has experts 0..{n_experts - 1}")
        per_expert = info.expert_nbytes()
        return self._view(info.shard, info.offset + int(expert) * per_expert, per_expert)

    def _view(self, shard: int, offset: int, nbytes: int) -> np.ndarray:
        if self._buffers is None:
            raise ValueError(f"{self.files[0]}: GGUFSource is closed")
        return self._buffers[shard][offset:offset + nbytes]

    # -- sizes ---------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Size of all files of the model together."""
        return sum(self.file_sizes)

    @property
    def tensor_data_bytes(self) -> int:
        """Bytes of all tensors together (without headers and padding)."""
        return sum(t.nbytes for t in self.tensors.values())

    # -- lifetime ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._buffers is None

    def close(self) -> None:
        """Drop this source's references to the memory maps.

        Each map is unmapped once nothing refers to it any more; views returned
        earlier stay valid because they keep their map alive. (Never call
        ``mmap.close()`` here: numpy does not hold a buffer export on the mmap, so
        closing it under a live view would make that view read unmapped memory.)
        """
        self._buffers = None

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"<GGUFSource {self.architecture} {self.files[0].name} ({len(self.files)} file(s), {state})>"
