"""packer.gguf_source: reading single GGUF files and split sets, and refusing bad ones."""

from __future__ import annotations

import math
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_factory import (
    RawTensor,
    Typed,
    expert_stack,
    patch_bytes,
    quantized_bytes,
    shard_path,
    tensor_raw_bytes,
    truncate,
    write_gguf,
    write_shard,
    write_split_set,
)
from packer.gguf_source import (
    GGUFFormatError,
    GGUFSource,
    TensorInfo,
    split_set_paths,
)

V = GGUFValueType

# -- fixtures and helpers ------------------------------------------------------------

METADATA = {
    "general.name": "Tiny MoE",
    "general.empty": "",
    "testarch.block_count": Typed(2, V.UINT32),
    "testarch.expert_count": Typed(4, V.UINT32),
    "testarch.expert_used_count": Typed(2, V.UINT32),
    "testarch.rope.freq_base": Typed(10000.0, V.FLOAT32),
    "testarch.norm_eps": Typed(1e-6, V.FLOAT64),
    "testarch.big": Typed(2**40 + 3, V.UINT64),
    "testarch.neg": Typed(-7, V.INT64),
    "testarch.small": Typed(-3, V.INT8),
    "testarch.flag": True,
    "testarch.off": False,
    "testarch.layer_types": Typed([0, 1, 1, 0], V.ARRAY, V.UINT8),
    "testarch.scales": Typed([0.5, 0.25], V.ARRAY, V.FLOAT32),
    "tokenizer.ggml.tokens": ["<s>", "</s>", "héllo", "wörld", "🙂", ""],
    "tokenizer.ggml.token_type": Typed([3, 3, 1, 1, 1, 1], V.ARRAY, V.INT32),
}

EXPECTED_METADATA = {
    "general.architecture": "testarch",
    "general.name": "Tiny MoE",
    "general.empty": "",
    "testarch.block_count": 2,
    "testarch.expert_count": 4,
    "testarch.expert_used_count": 2,
    "testarch.rope.freq_base": 10000.0,
    "testarch.norm_eps": 1e-6,
    "testarch.big": 2**40 + 3,
    "testarch.neg": -7,
    "testarch.small": -3,
    "testarch.flag": True,
    "testarch.off": False,
    "testarch.layer_types": [0, 1, 1, 0],
    "testarch.scales": [0.5, 0.25],
    "tokenizer.ggml.tokens": ["<s>", "</s>", "héllo", "wörld", "🙂", ""],
    "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1],
}


def model_tensors(seed: int = 0) -> dict[str, np.ndarray | RawTensor]:
    """A small MoE-like tensor set: dense weights, stacked experts (Q8_0, MXFP4, F32), a bias stack."""
    rng = np.random.default_rng(seed)
    return {
        "token_embd.weight": rng.standard_normal((6, 32), dtype=np.float32),
        "output_norm.weight": rng.standard_normal(32, dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((32, 32)).astype(np.float16),
        "blk.0.ffn_gate_exps.weight": expert_stack(4, 8, 64, Q.Q8_0, seed=seed + 1),
        "blk.0.ffn_up_exps.weight": expert_stack(4, 8, 64, Q.MXFP4, seed=seed + 2),
        "blk.0.ffn_down_exps.weight": expert_stack(4, 64, 8, Q.F32, seed=seed + 3),
        "blk.0.ffn_gate_exps.bias": rng.standard_normal((4, 8), dtype=np.float32),
        "blk.1.ffn_gate_exps.weight": quantized_bytes((4, 2, 256), Q.Q4_K, seed=seed + 4),
    }


@pytest.fixture
def model_file(tmp_path) -> tuple[Path, dict]:
    """A single GGUF with every metadata type and stacked expert tensors."""
    tensors = model_tensors()
    return write_gguf(tmp_path / "tiny.gguf", tensors, METADATA), tensors


@pytest.fixture
def small_file(tmp_path) -> Path:
    """A few-hundred-byte GGUF used for byte patching, truncation and fuzzing."""
    return write_small(tmp_path / "small.gguf")


def write_small(path: Path) -> Path:
    return write_gguf(
        path,
        {
            "t.a": np.arange(8, dtype=np.float32).reshape(2, 4),
            "t.b": quantized_bytes((2, 1, 32), Q.Q8_0, seed=5),
        },
        {"general.name": "small", "x.count": Typed(3, V.UINT32), "x.list": Typed([1, 2], V.ARRAY, V.UINT16)},
    )


def expect_error(path: Path, *fragments: str, opened: Path | None = None) -> GGUFFormatError:
    """Open `opened` (default `path`); expect GGUFFormatError about `path` mentioning every fragment."""
    with pytest.raises(GGUFFormatError) as info:
        GGUFSource.open(opened or path)
    err = info.value
    assert err.path == path
    assert path.name in str(err)
    for fragment in fragments:
        assert fragment in str(err), str(err)
    return err


def kv_layout(path: Path) -> dict[str, int]:
    """Byte offset of each metadata key's value type field, via the plain GGUFReader."""
    reader = GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            out[name] = field.offset + 8 + len(name.encode())
    return out


def tensor_info_layout(path: Path) -> dict[str, dict[str, int]]:
    """Byte offsets of the parts of each tensor info (name length, n_dims, dims, type, offset)."""
    reader = GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        start = tensor.field.offset
        n_dims_at = start + 8 + len(tensor.name.encode())
        n_dims = len(tensor.shape)
        out[tensor.name] = {
            "name_len": start,
            "name": start + 8,
            "n_dims": n_dims_at,
            "dims": n_dims_at + 4,
            "type": n_dims_at + 4 + 8 * n_dims,
            "offset": n_dims_at + 8 + 8 * n_dims,
        }
    return out


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def data_end(source: GGUFSource) -> int:
    return max(t.offset + t.nbytes for t in source.tensors.values())


# -- single files --------------------------------------------------------------------


def test_metadata_values(model_file):
    path, _ = model_file
    with GGUFSource.open(path) as source:
        assert source.architecture == "testarch"
        assert source.files == [path]
        assert source.file_sizes == [path.stat().st_size]
        assert source.total_bytes == path.stat().st_size
        for key, expected in EXPECTED_METADATA.items():
            value = source.metadata[key]
            if isinstance(expected, float):
                assert math.isclose(value, expected, rel_tol=1e-6), key
            else:
                assert value == expected, key
                assert type(value) is type(expected), key
        assert set(source.metadata) == set(EXPECTED_METADATA)


def test_metadata_agrees_with_plain_gguf_reader(model_file):
    """Our fast array path must give the values GGUFReader.contents() gives."""
    path, _ = model_file
    plain = GGUFReader(path)
    with GGUFSource.open(path) as source:
        for name, field in plain.fields.items():
            if name.startswith("GGUF."):
                continue
            assert source.metadata[name] == field.contents(), name


def test_tensor_shapes_types_and_order(model_file):
    path, tensors = model_file
    with GGUFSource.open(path) as source:
        assert list(source.tensors) == list(tensors)
        assert len(source) == len(tensors) and "token_embd.weight" in source
        gate = source.tensors["blk.0.ffn_gate_exps.weight"]
        assert isinstance(gate, TensorInfo)
        assert gate.shape == (4, 8, 64) and gate.ne == (64, 8, 4)
        assert (gate.ggml_type, gate.type_name) == (int(Q.Q8_0), "Q8_0")
        assert gate.nbytes == 4 * 8 * (64 // 32) * 34
        assert gate.n_experts == 4 and gate.expert_nbytes() == 8 * 2 * 34
        up = source.tensors["blk.0.ffn_up_exps.weight"]
        assert up.type_name == "MXFP4" and up.nbytes == 4 * 8 * 2 * 17
        assert source.tensors["blk.1.ffn_gate_exps.weight"].type_name == "Q4_K"
        assert source.tensors["blk.0.attn_q.weight"].type_name == "F16"
        norm = source.tensors["output_norm.weight"]
        assert norm.shape == (32,) and norm.ne == (32,)
        for name, tensor in tensors.items():
            info = source.tensors[name]
            shape = tensor.element_shape if isinstance(tensor, RawTensor) else tensor.shape
            assert info.shape == tuple(shape), name
            assert info.ne == tuple(reversed(shape)), name
            assert info.file == path and info.shard == 0
            assert info.offset % 32 == 0  # default GGUF alignment
        assert source.tensor_data_bytes == sum(len(tensor_raw_bytes(t)) for t in tensors.values())


def test_tensor_bytes_are_exact_zero_copy_read_only(model_file):
    path, tensors = model_file
    raw_file = path.read_bytes()
    with GGUFSource.open(path) as source:
        for name, tensor in tensors.items():
            info = source.tensors[name]
            data = source.tensor_bytes(name)
            assert data.dtype == np.uint8 and data.shape == (info.nbytes,)
            assert data.tobytes() == tensor_raw_bytes(tensor), name
            assert raw_file[info.offset:info.offset + info.nbytes] == tensor_raw_bytes(tensor)
            assert not data.flags.owndata and not data.flags.writeable
            with pytest.raises(ValueError):
                data[0] = 1


def test_expert_bytes_are_the_expert_slices(model_file):
    path, tensors = model_file
    with GGUFSource.open(path) as source:
        for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                     "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.bias", "blk.1.ffn_gate_exps.weight"):
            tensor = tensors[name]
            stacked = tensor.data if isinstance(tensor, RawTensor) else tensor
            info = source.tensors[name]
            whole = source.tensor_bytes(name)
            for expert in range(info.n_experts):
                got = source.expert_bytes(name, expert)
                assert got.tobytes() == np.ascontiguousarray(stacked[expert]).tobytes(), (name, expert)
                assert np.shares_memory(got, whole)
                assert got.nbytes == info.expert_nbytes()
            assert source.expert_bytes(name, np.int64(1)).tobytes() == stacked[1].tobytes()


def test_expert_bytes_rejects_bad_requests(model_file):
    path, _ = model_file
    with GGUFSource.open(path) as source:
        name = "blk.0.ffn_gate_exps.weight"
        for bad in (-1, 4, 10**12):
            with pytest.raises(IndexError, match=r"expert .* out of range .* 0\.\.3"):
                source.expert_bytes(name, bad)
        with pytest.raises(TypeError):
            source.expert_bytes(name, 1.0)
        with pytest.raises(ValueError, match="not a stacked expert tensor"):
            source.expert_bytes("output_norm.weight", 0)
        with pytest.raises(KeyError, match="no tensor named"):
            source.tensor_bytes("blk.9.nope")


def test_custom_alignment(tmp_path):
    tensors = {"a": np.ones(3, np.float32), "b": np.arange(5, dtype=np.float32)}
    path = write_gguf(tmp_path / "aligned.gguf", tensors, alignment=256)
    with GGUFSource.open(path) as source:
        assert source.metadata["general.alignment"] == 256
        for name, tensor in tensors.items():
            assert source.tensors[name].offset % 256 == 0
            assert source.tensor_bytes(name).tobytes() == tensor.tobytes()


def test_file_without_tensors(tmp_path):
    path = write_gguf(tmp_path / "meta.gguf", {}, {"general.name": "x"})
    with GGUFSource.open(path) as source:
        assert source.tensors == {} and source.metadata["general.name"] == "x"


def test_close_releases_and_keeps_earlier_views_valid(model_file):
    path, tensors = model_file
    source = GGUFSource.open(path)
    kept = source.tensor_bytes("token_embd.weight")
    source.close()
    assert source.closed
    source.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        source.tensor_bytes("token_embd.weight")
    assert kept.tobytes() == tensors["token_embd.weight"].tobytes()
    assert "closed" in repr(source)


def test_large_vocabulary_is_fast(tmp_path):
    """GGUFReader alone needs ~13 s for this; the checked reader must stay well under 2 s."""
    n = 163840
    tokens = [f"tok{i}é" for i in range(n)]
    path = write_gguf(
        tmp_path / "vocab.gguf",
        {"w": np.zeros((2, 4), np.float32)},
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": Typed([float(i) for i in range(n)], V.ARRAY, V.FLOAT32),
            "tokenizer.ggml.token_type": Typed([1] * n, V.ARRAY, V.INT32),
            "tokenizer.ggml.merges": [f"a{i} b" for i in range(n)],
        },
    )
    start = time.perf_counter()
    with GGUFSource.open(path) as source:
        elapsed = time.perf_counter() - start
        assert source.metadata["tokenizer.ggml.tokens"] == tokens
        assert source.metadata["tokenizer.ggml.scores"][-1] == float(n - 1)
        assert len(source.metadata["tokenizer.ggml.merges"]) == n
    assert elapsed < 2.0, f"opening a {n}-token vocabulary took {elapsed:.2f} s"


def test_invalid_utf8_token_survives_losslessly(tmp_path):
    path = write_gguf(tmp_path / "bytes.gguf", {}, {"tokenizer.ggml.tokens": [b"ok", b"\xff\xfe", b"a\xc3"]})
    with GGUFSource.open(path) as source:
        tokens = source.metadata["tokenizer.ggml.tokens"]
        assert tokens[0] == "ok"
        assert [t.encode("utf-8", "surrogateescape") for t in tokens] == [b"ok", b"\xff\xfe", b"a\xc3"]


# -- malformed single files -----------------------------------------------------------


def test_missing_path_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        GGUFSource.open(tmp_path / "nothing.gguf")
    folder = tmp_path / "dir.gguf"
    folder.mkdir()
    expect_error(folder, "folder")


def test_empty_and_tiny_files_are_truncated(tmp_path):
    for size in (0, 1, 4, 23):
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(16))
        truncate(path, size)
        expect_error(path, "truncated")


def test_bad_magic(small_file):
    patch_bytes(small_file, 0, b"GGML")
    expect_error(small_file, "not a GGUF file")


@pytest.mark.parametrize("version", [0, 1, 4, 99, 2**32 - 1])
def test_unsupported_version(small_file, version):
    patch_bytes(small_file, 4, u32(version))
    expect_error(small_file, f"unsupported GGUF version {version}")


def test_version_2_is_read(small_file):
    patch_bytes(small_file, 4, u32(2))  # v2 and v3 share the layout
    with GGUFSource.open(small_file) as source:
        assert source.metadata["general.name"] == "small"


def test_big_endian_file_is_refused(small_file):
    patch_bytes(small_file, 4, struct.pack(">I", 3))
    expect_error(small_file, "big-endian")


def test_every_truncation_point_is_an_error(small_file, tmp_path):
    """Any cut before the end of the last tensor's data is refused; later cuts only lose padding."""
    original = small_file.read_bytes()
    with GGUFSource.open(small_file) as source:
        end_of_data = data_end(source)
        expected = {name: source.tensor_bytes(name).tobytes() for name in source.tensors}
    cut_file = tmp_path / "cut.gguf"
    for size in range(len(original)):
        cut_file.write_bytes(original[:size])
        if size < end_of_data:
            err = expect_error(cut_file)
            assert err.problem
        else:
            with GGUFSource.open(cut_file) as source:
                assert {n: source.tensor_bytes(n).tobytes() for n in source.tensors} == expected


def test_tensor_data_past_end_of_file(small_file):
    with GGUFSource.open(small_file) as source:
        cut = source.tensors["t.b"].offset + 5
    truncate(small_file, cut)
    err = expect_error(small_file, "tensor 't.b' data runs past the end of the file", "truncated")
    assert "re-download" in str(err)


def test_tensor_offset_past_end_of_file(small_file):
    where = tensor_info_layout(small_file)["t.a"]["offset"]
    for bad in (2**20, 2**64 - 32):  # the second wraps around in GGUFReader's uint64 maths
        patch_bytes(small_file, where, u64(bad))
        expect_error(small_file, "runs past the end of the file")


@pytest.mark.parametrize("field,bad", [("tensor_count", 2**63), ("tensor_count", 1000),
                                       ("kv_count", 2**64 - 1), ("kv_count", 500)])
def test_absurd_header_counts(small_file, field, bad):
    patch_bytes(small_file, 8 if field == "tensor_count" else 16, u64(bad))
    expect_error(small_file, "header claims", "can hold")


@pytest.mark.parametrize("bad_len", [2**62, 2**64 - 1, 10_000])
def test_absurd_key_length(small_file, bad_len):
    patch_bytes(small_file, 24, u64(bad_len))  # length of the first key
    expect_error(small_file, "the file ends at byte")


def test_absurd_string_value_length(small_file):
    where = kv_layout(small_file)["general.name"] + 4  # after the value type
    patch_bytes(small_file, where, u64(2**63))
    expect_error(small_file)


def test_string_cut_by_end_of_file_is_not_silently_shortened(tmp_path):
    """GGUFReader returns 'hello w' for this file; we must refuse it."""
    path = write_gguf(tmp_path / "s.gguf", {}, {"general.name": "hello world"})
    path.write_bytes(path.read_bytes().rstrip(b"\0")[:-4])
    expect_error(path, "the file ends at byte")


@pytest.mark.parametrize("item_type", [V.UINT8, V.UINT16, V.STRING])
def test_absurd_array_length_fails_fast(tmp_path, item_type):
    """Plain GGUFReader loops (and allocates) ~forever on a huge uint8 array count at EOF."""
    values = {V.UINT8: [1, 2], V.UINT16: [0x0101, 0x0202], V.STRING: ["a", "b"]}[item_type]
    path = write_gguf(tmp_path / "arr.gguf", {}, {"z.arr": Typed(values, V.ARRAY, item_type)})
    where = kv_layout(path)["z.arr"] + 4 + 4  # value type, element type, then the count
    path.write_bytes(path.read_bytes().rstrip(b"\0"))  # array data ends exactly at EOF
    for bad in (2**40, 2**64 - 1, 3):
        patch_bytes(path, where, u64(bad))
        start = time.perf_counter()
        expect_error(path)
        assert time.perf_counter() - start < 1.0


def test_unknown_ggml_type(small_file):
    where = tensor_info_layout(small_file)["t.a"]["type"]
    for bad in (99, 31, 2**32 - 1):  # 31 = removed Q4_0_4_4
        patch_bytes(small_file, where, u32(bad))
        expect_error(small_file, f"unknown GGML type id {bad}")


def test_unknown_metadata_value_type(small_file):
    patch_bytes(small_file, kv_layout(small_file)["x.count"], u32(77))
    expect_error(small_file, "unknown metadata value type 77")


def test_nested_array_is_refused(small_file):
    patch_bytes(small_file, kv_layout(small_file)["x.list"] + 4, u32(int(V.ARRAY)))
    expect_error(small_file, "array of arrays")


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_bad_dimension_count(small_file, n_dims):
    patch_bytes(small_file, tensor_info_layout(small_file)["t.b"]["n_dims"], u32(n_dims))
    err = expect_error(small_file)
    if n_dims == 0:
        assert "has 0 dimensions" in str(err)


def test_row_not_a_multiple_of_the_block_size(small_file):
    patch_bytes(small_file, tensor_info_layout(small_file)["t.b"]["dims"], u64(33))  # Q8_0 blocks of 32
    expect_error(small_file, "not a multiple of the block size 32")


def test_zero_dimension(small_file):
    patch_bytes(small_file, tensor_info_layout(small_file)["t.a"]["dims"], u64(0))
    expect_error(small_file, "empty dimension")


def test_misaligned_and_overlapping_tensors(small_file, tmp_path):
    layout = tensor_info_layout(small_file)
    copy = shutil.copy(small_file, tmp_path / "copy.gguf")
    patch_bytes(small_file, layout["t.b"]["offset"], u64(4))
    expect_error(small_file, "not a multiple of the alignment")
    patch_bytes(copy, layout["t.b"]["offset"], u64(0))
    expect_error(Path(copy), "overlap")


def test_duplicate_tensor_names_in_one_file(small_file):
    patch_bytes(small_file, tensor_info_layout(small_file)["t.b"]["name"], b"t.a")
    expect_error(small_file, "'t.a' appears twice")


def test_duplicate_metadata_keys(tmp_path):
    path = write_gguf(tmp_path / "dup.gguf", {}, {"k.aa": Typed(1, V.UINT32), "k.bb": Typed(2, V.UINT32)})
    patch_bytes(path, GGUFReader(path).fields["k.bb"].offset + 8, b"k.aa")
    expect_error(path, "metadata key 'k.aa' appears twice")


def test_invalid_utf8_key(small_file):
    patch_bytes(small_file, GGUFReader(small_file).fields["x.count"].offset + 8, b"\xff")
    expect_error(small_file, "not valid UTF-8")


def test_bad_alignment_value(tmp_path):
    path = write_gguf(tmp_path / "align.gguf", {"a": np.ones(4, np.float32)}, alignment=64)
    patch_bytes(path, kv_layout(path)["general.alignment"] + 4, u32(48))
    expect_error(path, "alignment")


def test_missing_architecture(tmp_path):
    path = write_gguf(tmp_path / "noarch.gguf", {"a": np.ones(4, np.float32)}, arch=None)
    expect_error(path, "no general.architecture")


def test_error_is_a_value_error_with_parts(small_file):
    patch_bytes(small_file, 0, b"XXXX")
    err = expect_error(small_file)
    assert isinstance(err, ValueError)
    assert str(err).startswith(f"{small_file}: {err.problem}")


# -- split sets -----------------------------------------------------------------------


def split_shards(seed: int = 0) -> list[dict]:
    tensors = model_tensors(seed)
    names = list(tensors)
    return [
        {n: tensors[n] for n in names[:3]},
        {n: tensors[n] for n in names[3:6]},
        {n: tensors[n] for n in names[6:]},
    ]


@pytest.fixture
def split_set(tmp_path) -> tuple[list[Path], list[dict]]:
    shards = split_shards()
    return write_split_set(tmp_path, "Model-Q4", shards, METADATA), shards


def test_split_set_paths(tmp_path):
    assert split_set_paths(tmp_path / "model.gguf") == [tmp_path / "model.gguf"]
    assert split_set_paths(tmp_path / "M-00002-of-00003.gguf") == [
        tmp_path / "M-00001-of-00003.gguf",
        tmp_path / "M-00002-of-00003.gguf",
        tmp_path / "M-00003-of-00003.gguf",
    ]
    assert split_set_paths("a-b-00001-of-00001.gguf") == [Path("a-b-00001-of-00001.gguf")]
    for impossible in ("M-00004-of-00003.gguf", "M-00000-of-00003.gguf", "M-00001-of-00000.gguf"):
        with pytest.raises(GGUFFormatError, match="impossible"):
            split_set_paths(tmp_path / impossible)


@pytest.mark.parametrize("opened", [0, 1, 2])
def test_split_set_opens_from_any_shard(split_set, opened):
    paths, shards = split_set
    with GGUFSource.open(paths[opened]) as source:
        assert source.files == paths
        assert source.file_sizes == [p.stat().st_size for p in paths]
        assert source.architecture == "testarch"
        for key, expected in EXPECTED_METADATA.items():
            if not isinstance(expected, float):
                assert source.metadata[key] == expected, key
        assert source.metadata["split.no"] == 0
        assert source.metadata["split.count"] == 3
        assert source.metadata["split.tensors.count"] == 8
        assert list(source.tensors) == [n for shard in shards for n in shard]
        for shard_index, shard in enumerate(shards):
            for name, tensor in shard.items():
                info = source.tensors[name]
                assert info.shard == shard_index and info.file == paths[shard_index]
                assert source.tensor_bytes(name).tobytes() == tensor_raw_bytes(tensor)
        stacked = shards[2]["blk.1.ffn_gate_exps.weight"].data
        for expert in range(4):
            assert source.expert_bytes("blk.1.ffn_gate_exps.weight", expert).tobytes() == stacked[expert].tobytes()


def test_split_set_with_architecture_in_every_shard(tmp_path):
    paths = write_split_set(tmp_path, "M", split_shards(), METADATA, arch_in_every_shard=True)
    with GGUFSource.open(paths[1]) as source:
        assert source.architecture == "testarch" and len(source.tensors) == 8


def test_missing_shard(split_set):
    paths, _ = split_set
    paths[1].unlink()
    err = expect_error(paths[1], "shard 2 of 3 is missing", "same folder", opened=paths[2])
    assert "Model-Q4-00002-of-00003.gguf" in str(err)


def test_extra_shard_with_larger_index(split_set):
    paths, _ = split_set
    stray = shutil.copy(paths[2], paths[0].with_name("Model-Q4-00004-of-00003.gguf"))
    expect_error(Path(stray), "does not fit the set of 3", opened=paths[0])
    expect_error(Path(stray), "shard 4 of 3, which is impossible")


def test_shard_of_a_differently_sized_set_in_the_folder(split_set, tmp_path):
    paths, _ = split_set
    other = write_split_set(tmp_path / "other", "Model-Q4", split_shards()[:2], METADATA)
    moved = shutil.move(other[0], paths[0].parent / other[0].name)  # Model-Q4-00001-of-00002.gguf
    expect_error(Path(moved), "does not fit the set of 3", opened=paths[1])


def test_split_count_disagrees_with_file_name(split_set):
    paths, shards = split_set
    paths[1].unlink()
    write_shard(paths[0].parent, "Model-Q4", 1, 4, 8, shards[1], file_count=3)
    expect_error(paths[1], "split.count is 4, but the file names say 3")


def test_split_no_disagrees_with_file_name(split_set):
    paths, shards = split_set
    paths[1].unlink()
    write_shard(paths[0].parent, "Model-Q4", 2, 3, 8, shards[1], file_index=2)
    expect_error(paths[1], "split.no says shard 3 of 3, but the file name says shard 2")


def test_shards_from_different_sets(split_set):
    paths, shards = split_set
    # Same name pattern and count, but from a model with another tensor total.
    paths[2].unlink()
    write_shard(paths[0].parent, "Model-Q4", 2, 3, 9, shards[2])
    expect_error(paths[2], "split.tensors.count is 9, but shard 1 says 8", "different download")


def test_shard_with_another_architecture(tmp_path):
    paths = write_split_set(tmp_path, "M", split_shards(), METADATA, arch_in_every_shard=True)
    paths[1].unlink()
    write_shard(tmp_path, "M", 1, 3, 8, split_shards()[1], arch="otherarch")
    expect_error(paths[1], "general.architecture is 'otherarch'")


def test_tensor_total_disagrees_with_split_tensors_count(tmp_path):
    shards = split_shards()
    for no, tensors in enumerate(shards):
        write_shard(tmp_path, "M", no, 3, 7, tensors, METADATA if no == 0 else None,
                    arch="testarch" if no == 0 else None)
    expect_error(shard_path(tmp_path, "M", 1, 3), "hold 8 tensors, but split.tensors.count says 7")


def test_duplicate_tensor_names_across_shards(tmp_path):
    shards = split_shards()
    shards[2] = {"token_embd.weight": shards[0]["token_embd.weight"], **shards[2]}
    paths = write_split_set(tmp_path, "M", shards, METADATA)
    err = expect_error(paths[2], "'token_embd.weight' is also in M-00001-of-00003.gguf")
    assert "different sets" in str(err)


def test_renamed_shard_opened_alone(split_set, tmp_path):
    paths, _ = split_set
    renamed = Path(shutil.copy(paths[0], tmp_path / "model.gguf"))
    expect_error(renamed, "shard 1 of 3 of a split model", "restore the original file names")


def test_split_named_file_without_split_metadata(tmp_path):
    path = write_gguf(tmp_path / "M-00001-of-00002.gguf", model_tensors())
    write_gguf(tmp_path / "M-00002-of-00002.gguf", {})
    expect_error(path, "no split.no/split.count metadata")


def test_one_of_one_without_split_metadata(tmp_path):
    path = write_gguf(tmp_path / "M-00001-of-00001.gguf", model_tensors(), METADATA)
    with GGUFSource.open(path) as source:
        assert len(source.tensors) == 8


def test_broken_shard_is_named(split_set):
    paths, _ = split_set
    truncate(paths[1], paths[1].stat().st_size // 2)
    expect_error(paths[1], "past the end of the file", opened=paths[0])


# -- fuzzing --------------------------------------------------------------------------

def _small_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as folder:
        return write_small(Path(folder) / "base.gguf").read_bytes()


_BASE = _small_file_bytes()
_INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                    2**63 - 1, 2**63, 2**64 - 1, len(_BASE), len(_BASE) - 24]

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(_BASE) - 1), st.integers(0, 7)),
    st.tuples(st.just("byte"), st.integers(0, len(_BASE) - 1), st.integers(0, 255)),
    st.tuples(st.just("u32"), st.integers(0, len(_BASE) - 4),
              st.sampled_from([0, 1, 4, 5, 8, 9, 12, 13, 99, 2**32 - 1])),
    st.tuples(st.just("u64"), st.integers(0, len(_BASE) - 8), st.sampled_from(_INTERESTING_U64)),
    st.tuples(st.just("cut"), st.integers(0, len(_BASE)), st.just(0)),
)


def _mutate(data: bytes, mutations) -> bytes:
    buf = bytearray(data)
    for kind, at, value in mutations:
        if kind == "cut":
            del buf[at:]
            continue
        if at >= len(buf):
            continue
        if kind == "flip":
            buf[at] ^= 1 << value
        elif kind == "byte":
            buf[at] = value
        elif kind == "u32":
            buf[at:at + 4] = struct.pack("<I", value)[: len(buf) - at]
        else:
            buf[at:at + 8] = struct.pack("<Q", value)[: len(buf) - at]
    return bytes(buf)


@settings(max_examples=800, deadline=2000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_mutation, min_size=1, max_size=6))
def test_fuzz_mutated_file_opens_cleanly_or_raises_format_error(mutations):
    data = _mutate(_BASE, mutations)
    folder = Path(tempfile.mkdtemp(prefix="gguf-fuzz-"))
    path = folder / "fuzz.gguf"
    try:
        path.write_bytes(data)
        try:
            source = GGUFSource.open(path)
        except GGUFFormatError as err:
            assert err.path == path and path.name in str(err)
            return
        with source:
            size = len(data)
            assert source.file_sizes == [size]
            assert isinstance(source.architecture, str)
            for name, info in source.tensors.items():
                assert 0 <= info.offset and info.offset + info.nbytes <= size
                view = source.tensor_bytes(name)
                assert view.shape == (info.nbytes,)
                assert view.tobytes() == data[info.offset:info.offset + info.nbytes]
                if len(info.shape) >= 2:
                    last = source.expert_bytes(name, info.shape[0] - 1)
                    assert last.nbytes == info.expert_nbytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_string_array_cap(tmp_path, monkeypatch):
    import packer.gguf_source as gguf_source

    monkeypatch.setattr(gguf_source, "MAX_METADATA_STRINGS", 5)
    path = write_gguf(tmp_path / "many.gguf", {}, {"a.list": ["x"] * 4, "b.list": ["y"] * 2})
    expect_error(path, "hold 6 strings, more than the limit of 5 strings", "docs/limits.md")


def test_long_names_are_cut_short_in_messages(tmp_path):
    name = "blk." + "x" * 5000
    path = write_gguf(tmp_path / "long.gguf", {name: np.ones(4, np.float32)})
    with GGUFSource.open(path) as source:
        cut = source.tensors[name].offset + 8
    truncate(path, cut)
    err = expect_error(path, "runs past the end of the file")
    assert len(str(err)) < 500


def test_format_error_pickles(small_file):
    import pickle

    patch_bytes(small_file, 0, b"XXXX")
    err = expect_error(small_file)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.path, copy.problem, copy.hint, str(copy)) == (err.path, err.problem, err.hint, str(err))
