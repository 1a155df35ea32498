"""The manifest schema: what lies where in a pack, its JSON form and its validation.

`manifest.json` is the authority on a pack (docs/expert-pack-format.md): the builder
writes a `PackManifest`, the runtime and the verifier read one. `from_json` refuses
anything malformed or against the geometry rules with a PackError.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from expertpack.errors import PackError
from expertpack.layout import (
    ALIGNMENT,
    DENSE_NAME,
    DIGEST_SIZE,
    EXPERTS_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    HASHES_NAME,
    HEADER_SIZE,
    MANIFEST_NAME,
    align_up,
)

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


@dataclass(frozen=True)
class RoleEntry:
    """One role (gate, up, down, ...) of an expert: where its slice sits in the block."""

    name: str
    tensor: str
    offset: int
    nbytes: int
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class LayerEntry:
    """One MoE layer of the pack: its model block index and its roles in block order."""

    block: int
    roles: tuple[RoleEntry, ...]

    @property
    def read_nbytes(self) -> int:
        """Bytes of one aligned read that covers every role of an expert of this layer."""
        return align_up(self.roles[-1].end)

    def role(self, name: str) -> RoleEntry:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"no role {name!r} in layer blk.{self.block}")


@dataclass(frozen=True)
class SourceFile:
    """Fingerprint of one source GGUF file."""

    name: str
    size: int
    header_sha256: str


@dataclass(frozen=True)
class PackManifest:
    """The parsed, validated `manifest.json` of a pack."""

    architecture: str
    num_experts: int
    expert_used_count: int
    data_start: int
    expert_stride: int
    layers: tuple[LayerEntry, ...]
    experts_file_size: int
    hashes_sha256: str
    dense_sha256: str
    source_files: tuple[SourceFile, ...]
    source_tensor_count: int
    config_sha256: str
    tool: str
    complete: bool = False
    alignment: int = ALIGNMENT
    format_version: int = FORMAT_VERSION
    experts_file: str = EXPERTS_NAME
    dense_file: str = DENSE_NAME
    hashes_file: str = HASHES_NAME
    # The dense file's quick fingerprint (checked at every load): its size, the length of
    # its GGUF header and `dense_sample_sha256` (layout.dense_sample_digest).
    dense_file_size: int = 0
    dense_header_bytes: int = 0
    dense_sample_sha256: str = ""
    _block_to_index: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._block_to_index.update({layer.block: i for i, layer in enumerate(self.layers)})

    # Geometry ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(role.name for role in self.layers[0].roles) if self.layers else ()

    def layer_index(self, block: int) -> int:
        """Pack layer index of model block `block` (blk.N); KeyError if it has no routed experts."""
        try:
            return self._block_to_index[block]
        except KeyError:
            raise KeyError(f"blk.{block} has no routed experts in this pack") from None

    def layer_for_block(self, block: int) -> LayerEntry:
        return self.layers[self.layer_index(block)]

    def block_offset(self, layer_index: int, expert: int) -> int:
        """Byte offset in experts.bin of the block of (pack layer index, expert)."""
        if not 0 <= layer_index < self.num_layers:
            raise IndexError(f"layer index {layer_index} out of range 0..{self.num_layers - 1}")
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return self.data_start + (layer_index * self.num_experts + expert) * self.expert_stride

    def hash_index(self, layer_index: int, expert: int, role_index: int) -> int:
        """Position of a slice's digest in expert_hashes.bin (in digests, not bytes)."""
        return (layer_index * self.num_experts + expert) * len(self.role_names) + role_index

    # Binding: what each block is, under one digest ----------------------------------
    def layout_table(self) -> bytes:
        """The canonical layout table: every (layer, role) with its block, tensor, GGML type,
        shape, offset and size, and the geometry that places each expert's block.

        Canonical JSON (sorted keys, no spaces). Its SHA-256 (`layout_sha256`) is stored in
        manifest.json and in experts.bin's header, so the manifest cannot be edited (layers
        or roles swapped, renamed, retyped, moved) without the pack refusing to open.
        """
        table = {
            "alignment": self.alignment,
            "data_start": self.data_start,
            "expert_stride": self.expert_stride,
            "num_experts": self.num_experts,
            "experts_file_size": self.experts_file_size,
            "layers": [
                {
                    "index": li,
                    "block": layer.block,
                    "roles": [
                        {"name": r.name, "tensor": r.tensor, "offset": r.offset, "nbytes": r.nbytes,
                         "ggml_type": r.ggml_type, "type_name": r.type_name, "shape": list(r.shape)}
                        for r in layer.roles
                    ],
                }
                for li, layer in enumerate(self.layers)
            ],
        }
        return json.dumps(table, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @property
    def layout_sha256(self) -> str:
        """Hex SHA-256 of `layout_table()`."""
        return hashlib.sha256(self.layout_table()).hexdigest()

    def slice_key(self, layer_index: int, expert: int, role_index: int) -> bytes:
        """What a slice is, as the bytes hashed before its data (docs/expert-pack-format.md).

        Canonical JSON `[layer_index, block, expert, role, tensor, ggml_type, type_name,
        shape, offset in experts.bin, nbytes]` then a NUL byte: a slice's digest holds its
        place, so blocks (and their digests) swapped between layers or experts, or roles
        exchanged, no longer match.
        """
        layer = self.layers[layer_index]
        role = layer.roles[role_index]
        key = [layer_index, layer.block, expert, role.name, role.tensor, role.ggml_type, role.type_name,
               list(role.shape), self.block_offset(layer_index, expert) + role.offset, role.nbytes]
        return json.dumps(key, separators=(",", ":")).encode("utf-8") + b"\0"

    def slice_digest(self, layer_index: int, expert: int, role_index: int, data: ReadableBuffer) -> bytes:
        """The 32-byte digest expert_hashes.bin holds for this slice: SHA-256(slice_key || data)."""
        digest = hashlib.sha256(self.slice_key(layer_index, expert, role_index))
        digest.update(data)
        return digest.digest()

    @property
    def expert_bytes_total(self) -> int:
        """Payload bytes of all routed experts (without alignment padding)."""
        return self.num_experts * sum(role.nbytes for layer in self.layers for role in layer.roles)

    @property
    def hashes_file_size(self) -> int:
        """Exact size of expert_hashes.bin: one digest per (layer, expert, role)."""
        return self.num_layers * self.num_experts * len(self.role_names) * DIGEST_SIZE

    # Serialisation -----------------------------------------------------------
    def to_json(self) -> str:
        data = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "complete": self.complete,
            "architecture": self.architecture,
            "alignment": self.alignment,
            "experts_file": self.experts_file,
            "dense_file": self.dense_file,
            "hashes_file": self.hashes_file,
            "experts_file_size": self.experts_file_size,
            "data_start": self.data_start,
            "expert_stride": self.expert_stride,
            "num_experts": self.num_experts,
            "expert_used_count": self.expert_used_count,
            "layers": [
                {"block": layer.block, "roles": [{**asdict(r), "shape": list(r.shape)} for r in layer.roles]}
                for layer in self.layers
            ],
            "layout_sha256": self.layout_sha256,
            "hashes_sha256": self.hashes_sha256,
            "dense_sha256": self.dense_sha256,
            "dense_file_size": self.dense_file_size,
            "dense_header_bytes": self.dense_header_bytes,
            "dense_sample_sha256": self.dense_sample_sha256,
            "source": {
                "files": [asdict(f) for f in self.source_files],
                "tensor_count": self.source_tensor_count,
            },
            "config_sha256": self.config_sha256,
            "tool": self.tool,
        }
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, path: str | os.PathLike = MANIFEST_NAME) -> PackManifest:
        """Parse and validate a manifest; PackError on anything malformed."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PackError(path, f"manifest is not valid JSON ({exc})", "rebuild the pack") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise PackError(path, "not an ExpertDesk pack manifest", "point at a pack directory")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            older = isinstance(version, int) and not isinstance(version, bool) and version < FORMAT_VERSION
            raise PackError(
                path,
                f"pack format version {version!r}, this ExpertDesk reads version {FORMAT_VERSION}",
                "build it again from the GGUF with this version: `expertdesk pack MODEL.gguf --out DIR --overwrite`"
                if older else "update ExpertDesk, or build the pack again with this version (`expertdesk pack`)",
            )
        try:
            layers = tuple(
                LayerEntry(
                    block=int(layer["block"]),
                    roles=tuple(
                        RoleEntry(
                            name=str(r["name"]),
                            tensor=str(r["tensor"]),
                            offset=int(r["offset"]),
                            nbytes=int(r["nbytes"]),
                            ggml_type=int(r["ggml_type"]),
                            type_name=str(r["type_name"]),
                            shape=tuple(int(d) for d in r["shape"]),
                        )
                        for r in layer["roles"]
                    ),
                )
                for layer in data["layers"]
            )
            source = data["source"]
            manifest = cls(
                architecture=str(data["architecture"]),
                num_experts=int(data["num_experts"]),
                expert_used_count=int(data["expert_used_count"]),
                data_start=int(data["data_start"]),
                expert_stride=int(data["expert_stride"]),
                layers=layers,
                experts_file_size=int(data["experts_file_size"]),
                hashes_sha256=_sha256_field(data, "hashes_sha256", path),
                dense_sha256=_sha256_field(data, "dense_sha256", path),
                dense_file_size=int(data["dense_file_size"]),
                dense_header_bytes=int(data["dense_header_bytes"]),
                dense_sample_sha256=_sha256_field(data, "dense_sample_sha256", path),
                source_files=tuple(
                    SourceFile(name=str(f["name"]), size=int(f["size"]), header_sha256=str(f["header_sha256"]))
                    for f in source["files"]
                ),
                source_tensor_count=int(source["tensor_count"]),
                config_sha256=_sha256_field(data, "config_sha256", path),
                tool=str(data["tool"]),
                complete=data.get("complete") is True,
                alignment=int(data["alignment"]),
                experts_file=_plain_name(data.get("experts_file", EXPERTS_NAME), path),
                dense_file=_plain_name(data.get("dense_file", DENSE_NAME), path),
                hashes_file=_plain_name(data.get("hashes_file", HASHES_NAME), path),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PackError):
                raise
            raise PackError(path, f"manifest is missing or has a malformed field ({exc!r})",
                            "rebuild the pack") from None
        manifest.validate(path)
        if data.get("layout_sha256") != manifest.layout_sha256:
            raise PackError(
                path,
                "the block layout in manifest.json does not match its layout_sha256 (layers, experts or roles "
                "were swapped, renamed or moved after the build, or the file is damaged)",
                "rebuild the pack with `expertdesk pack`",
            )
        return manifest

    def validate(self, path: str | os.PathLike = MANIFEST_NAME) -> None:
        """Check the geometry rules of the format; PackError naming the first broken one."""
        a = self.alignment
        if a != ALIGNMENT:
            raise PackError(path, f"alignment {a}, expected {ALIGNMENT}", "rebuild the pack")
        if not self.layers or self.num_experts <= 0:
            raise PackError(path, "pack has no routed experts", "rebuild the pack")
        if not 0 < self.expert_used_count <= self.num_experts:
            raise PackError(path, f"expert_used_count {self.expert_used_count} not in 1..{self.num_experts}")
        if self.data_start % a or self.data_start < HEADER_SIZE:
            raise PackError(path, f"data_start {self.data_start} is not a multiple of {a}")
        if self.expert_stride <= 0 or self.expert_stride % a:
            raise PackError(path, f"expert_stride {self.expert_stride} is not a positive multiple of {a}")
        names = self.role_names
        if len(set(names)) != len(names):
            raise PackError(path, f"duplicate role names {names}")
        blocks = [layer.block for layer in self.layers]
        if len(set(blocks)) != len(blocks):
            raise PackError(path, "a model block appears twice in the layer list")
        for layer in self.layers:
            for role in layer.roles:
                if role.tensor != expert_tensor_name(layer.block, role.name):
                    raise PackError(path, f"blk.{layer.block} role {role.name} names tensor {role.tensor!r}, "
                                    f"expected {expert_tensor_name(layer.block, role.name)!r}")
            if tuple(r.name for r in layer.roles) != names:
                raise PackError(path,
                                f"blk.{layer.block} has roles {[r.name for r in layer.roles]}, expected {list(names)}")
            end = 0
            for role in layer.roles:
                if role.offset % a or role.offset < end or role.nbytes <= 0:
                    raise PackError(path, f"blk.{layer.block} role {role.name}: "
                                          f"offset {role.offset} misaligned or overlapping")
                end = role.end
            if layer.read_nbytes > self.expert_stride:
                raise PackError(path,
                                f"blk.{layer.block} needs {layer.read_nbytes} bytes, stride is {self.expert_stride}")
        expected_size = self.data_start + self.num_layers * self.num_experts * self.expert_stride
        if self.experts_file_size != expected_size:
            raise PackError(path, f"experts_file_size {self.experts_file_size}, geometry says {expected_size}")
        if not 0 <= self.dense_header_bytes <= self.dense_file_size:
            raise PackError(path, f"dense_header_bytes {self.dense_header_bytes} not in 0..dense_file_size "
                            f"{self.dense_file_size}")
        files = [MANIFEST_NAME, self.experts_file, self.dense_file, self.hashes_file]
        if len(set(files)) != len(files):
            raise PackError(path, f"a file name appears more than once in {files}", "rebuild the pack")
        if _SPLIT_SHARD.match(self.dense_file):
            raise PackError(path, f"dense_file {self.dense_file!r} looks like one shard of a split GGUF "
                            "(its reader would open the other shards too)", "rebuild the pack")


def _plain_name(value: object, path: str | os.PathLike) -> str:
    """A file name inside the pack; refuse anything that could point outside it (a path
    separator, a drive letter or stream (`:`), a NUL, `.`/`..`, a name starting with `~`)."""
    name = value if isinstance(value, str) else ""
    if (not name or name in (".", "..") or name.startswith("~") or len(name) > 255
            or any(c in name for c in "/\\:\0")):
        raise PackError(path, f"file name {value!r} in the manifest is not a plain name", "rebuild the pack")
    return name


def _sha256_field(data: dict, key: str, path: str | os.PathLike) -> str:
    """A hex SHA-256 field of the manifest (64 lower-case hex digits)."""
    value = data[key]
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        raise PackError(path, f"{key} {value!r} in the manifest is not a SHA-256", "rebuild the pack")
    return value


_SPLIT_SHARD = re.compile(r"^.+-\d{5,}-of-\d{5,}\.gguf$")


def expert_tensor_name(block: int, role: str) -> str:
    """The source tensor a role of model block `block` comes from (`gate` -> blk.N.ffn_gate_exps.weight,
    `gate.bias` -> blk.N.ffn_gate_exps.bias)."""
    base, _, bias = role.partition(".")
    return f"blk.{block}.ffn_{base}_exps.{'bias' if bias else 'weight'}"


def config_sha256(metadata: dict) -> str:
    """`config_sha256` of the format: canonical JSON of the metadata without `split.*`.

    Byte strings count as lists of ints, so the digest does not depend on how a reader
    chose to return raw bytes. Every load computes it (a real tokenizer's metadata is
    ~500k values), so only what JSON cannot write goes through Python (`default`).
    """

    def plain(value: object) -> object:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return list(bytes(value))
        item = getattr(value, "item", None)  # numpy scalar
        if item is not None:
            return item()
        raise TypeError(f"metadata value {value!r} cannot be written as JSON")

    clean = {k: v for k, v in metadata.items() if not k.startswith("split.")}
    text = json.dumps(clean, sort_keys=True, separators=(",", ":"), default=plain)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
