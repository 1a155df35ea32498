"""packer.builder + packer.adapters: GGUF -> Expert Pack, byte for byte, aligned, refusing what it does not know."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

import packer.builder as builder_mod
from expertpack import (
    ALIGNMENT,
    DIGEST_SIZE,
    PackError,
    check_experts_file_header,
    load_manifest,
)
from gguf_factory import quantized_bytes, truncate, write_gguf
from pack_fixtures import (
    deepseek4_metadata,
    deepseek4_tensors,
    kimi_k3_metadata,
    kimi_k3_tensors,
    write_deepseek4,
    write_kimi_k3,
)
from packer.adapters import UnsupportedLayoutError, plan_experts
from packer.builder import BuildCancelled, PackBuilder, build_pack, pack_path_for
from packer.errors import PackBuildError
from packer.gguf_source import GGUFFormatError, GGUFSource
from packer.preflight import probe_odirect
from packer.verify import verify_pack

SMALL = dict(buffer_bytes=2 * 24576, threads=3)  # 2 experts per group: several groups per layer


def files_of(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


def assert_pack_matches_source(pack: Path, source_path: Path) -> None:
    """Every block byte-equal to its source slice, every rule of the format, dense.gguf complete."""
    m = load_manifest(pack)
    experts = (pack / "experts.bin").read_bytes()
    assert len(experts) == m.experts_file_size
    check_experts_file_header(experts[:ALIGNMENT], m, pack)
    assert m.data_start % ALIGNMENT == 0 and m.expert_stride % ALIGNMENT == 0
    hashes = (pack / "expert_hashes.bin").read_bytes()
    with GGUFSource.open(source_path) as src:
        plan = plan_experts(src)
        assert [layer.block for layer in m.layers] == [layer.block for layer in plan.layers]
        for li, layer in enumerate(m.layers):
            for e in range(m.num_experts):
                off = m.block_offset(li, e)
                assert off == m.data_start + (li * m.num_experts + e) * m.expert_stride
                assert off % ALIGNMENT == 0
                end = 0
                for r, role in enumerate(layer.roles):
                    assert role.offset % ALIGNMENT == 0
                    assert not any(experts[off + end : off + role.offset]), "gap must be zero"
                    got = experts[off + role.offset : off + role.end]
                    assert got == src.expert_bytes(role.tensor, e).tobytes()
                    k = m.hash_index(li, e, r)
                    # The digest is keyed by the slice's place (docs/expert-pack-format.md).
                    want = hashlib.sha256(m.slice_key(li, e, r) + got).digest()
                    assert hashes[k * DIGEST_SIZE : (k + 1) * DIGEST_SIZE] == want
                    end = role.end
                assert not any(experts[off + end : off + m.expert_stride])
        # dense.gguf: every non-expert tensor byte-equal, every metadata key but split.*
        with GGUFSource.open(pack / "dense.gguf") as dense:
            want_meta = {k: v for k, v in src.metadata.items() if not k.startswith("split.")}
            assert dense.metadata == want_meta
            names = [n for n in src.tensors if n not in plan.expert_tensor_names]
            assert list(dense.tensors) == names
            for n in names:
                assert dense.tensors[n].ggml_type == src.tensors[n].ggml_type
                assert dense.tensors[n].shape == src.tensors[n].shape
                assert dense.tensor_bytes(n).tobytes() == src.tensor_bytes(n).tobytes()
    # The reference reader opens it too, with the original value types.
    reader = GGUFReader(pack / "dense.gguf")
    src_reader = GGUFReader(Path(source_path))
    for key, field in src_reader.fields.items():
        if key.startswith("split.") or key.startswith("GGUF."):
            continue
        assert reader.fields[key].types == field.types, key
        assert [bytes(p) for p in reader.fields[key].parts[2:]] == [bytes(p) for p in field.parts[2:]], key


@pytest.fixture(scope="module")
def ds4(tmp_path_factory):
    """A tiny deepseek4 GGUF and its pack, built once."""
    root = tmp_path_factory.mktemp("ds4")
    src = write_deepseek4(root / "src")
    pack = build_pack(src, root / "packs", **SMALL)
    return src, pack


def test_deepseek4_pack_is_byte_exact_and_aligned(ds4):
    src, pack = ds4
    assert pack.name == "tiny-ds4.expertpack"
    assert_pack_matches_source(pack, src)
    m = load_manifest(pack)
    assert m.complete and m.architecture == "deepseek4"
    assert m.role_names == ("gate", "up", "down")
    assert [r.type_name for r in m.layers[0].roles] == ["MXFP4"] * 3
    assert m.layers[0].roles[0].shape == (64, 128) and m.layers[0].roles[2].shape == (128, 64)
    assert (m.num_experts, m.expert_used_count, m.num_layers) == (4, 2, 4)
    assert not (pack.parent / (pack.name + ".partial")).exists()
    assert sorted(p.name for p in pack.iterdir()) == ["dense.gguf", "expert_hashes.bin", "experts.bin", "manifest.json"]
    assert verify_pack(pack).ok


def test_manifest_and_pack_are_deterministic(ds4, tmp_path):
    src, pack = ds4
    again = build_pack(src, tmp_path / "again.expertpack", direct_io=False)  # other path, other I/O mode
    assert files_of(again) == files_of(pack)
    text = (pack / "manifest.json").read_text()
    data = json.loads(text)
    assert data["source"]["files"][0]["name"] == "tiny-ds4.gguf"
    assert data["tool"].startswith("expertdesk ")


def test_kimi_k3_split_set(tmp_path):
    single = write_kimi_k3(tmp_path / "one")
    first = write_kimi_k3(tmp_path / "split", split=3)
    assert first.name == "tiny-kimi-00001-of-00003.gguf"
    pack = build_pack(first, tmp_path / "out", buffer_bytes=3 * 81920, threads=2)
    assert pack.name == "tiny-kimi.expertpack"
    assert_pack_matches_source(pack, first)
    m = load_manifest(pack)
    assert [layer.block for layer in m.layers] == [1, 2, 3]  # layer 0 is dense
    assert [r.type_name for r in m.layers[0].roles] == ["Q2_K", "Q2_K", "Q3_K"]
    assert m.layers[0].roles[0].shape == (256, 256)
    assert len(m.source_files) == 3
    with GGUFSource.open(pack / "dense.gguf") as dense:
        assert not any(k.startswith("split.") for k in dense.metadata)
        assert "blk.0.ffn_gate.weight" in dense.tensors
    # The same model as one file packs to the same experts and dense bytes.
    pack1 = build_pack(single, tmp_path / "out1", threads=2)
    a, b = files_of(pack), files_of(pack1)
    assert a["experts.bin"] == b["experts.bin"]
    assert a["dense.gguf"] == b["dense.gguf"]
    assert load_manifest(pack).config_sha256 == load_manifest(pack1).config_sha256


def test_pack_path_naming(tmp_path):
    assert pack_path_for("m/Model-Q2_K-00001-of-00038.gguf", tmp_path) == tmp_path / "Model-Q2_K.expertpack"
    assert pack_path_for("m/x.gguf", tmp_path) == tmp_path / "x.expertpack"
    assert pack_path_for("m/x.gguf", tmp_path / "mine.expertpack") == tmp_path / "mine.expertpack"
    with pytest.raises(PackBuildError):
        pack_path_for("m/x.gguf", tmp_path / "y.expertpack.partial")


def test_existing_pack_needs_overwrite(ds4, tmp_path):
    src, _ = ds4
    target = tmp_path / "p.expertpack"
    build_pack(src, target)
    with pytest.raises(PackBuildError, match="already exists.*--overwrite"):
        build_pack(src, target)
    (target / "experts.bin").write_bytes(b"junk")
    build_pack(src, target, overwrite=True)
    assert verify_pack(target).ok
    other = tmp_path / "photos.expertpack"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(PackBuildError, match="not an Expert Pack"):
        build_pack(src, other, overwrite=True)
    assert (other / "holiday.jpg").exists()


def test_delete_source_after_full_verify(tmp_path):
    src = write_deepseek4(tmp_path / "src", split=2)
    files = sorted((tmp_path / "src").iterdir())
    assert len(files) == 2
    b = PackBuilder(src, tmp_path / "out", delete_source=True)
    pack = b.run()
    assert b.stats.verified == "full" and b.stats.source_deleted
    assert not any(f.exists() for f in files)
    assert verify_pack(pack).ok


def test_buffered_and_direct_give_the_same_pack(ds4, tmp_path):
    src, pack = ds4
    b = PackBuilder(src, tmp_path / "b.expertpack", direct_io=False)
    b.run()
    assert b.stats.direct_io is False
    d = PackBuilder(src, tmp_path / "d.expertpack", direct_io="auto")
    d.run()
    assert d.stats.direct_io is probe_odirect(tmp_path).works  # auto uses O_DIRECT wherever it works
    assert files_of(tmp_path / "b.expertpack") == files_of(pack) == files_of(tmp_path / "d.expertpack")


def test_odirect_write_refused_falls_back_to_buffered(ds4, tmp_path, monkeypatch):
    src, pack = ds4
    real_open, real_write = builder_mod.open_for_write, builder_mod.pwrite_full
    direct_fds = set()

    def fake_open(path, direct, *, create=True):
        fd, used = real_open(path, direct, create=create)
        if used:
            direct_fds.add(fd)
        return fd, used

    def refusing_write(fd, view, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, view, offset)

    monkeypatch.setattr(builder_mod, "open_for_write", fake_open)
    monkeypatch.setattr(builder_mod, "pwrite_full", refusing_write)
    b = PackBuilder(src, tmp_path / "f.expertpack", **SMALL)
    b.run()
    assert direct_fds and b.stats.direct_io is False
    assert files_of(tmp_path / "f.expertpack") == files_of(pack)


def test_direct_io_required_but_refused(ds4, tmp_path, monkeypatch):
    src, _ = ds4
    def no_direct(path, direct, *, create=True):
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False  # as on tmpfs: O_DIRECT refused

    monkeypatch.setattr(builder_mod, "open_for_write", no_direct)
    with pytest.raises(PackBuildError, match="O_DIRECT"):
        build_pack(src, tmp_path / "x.expertpack", direct_io=True)


# --- resume, cancel, restart ---------------------------------------------------------------


def _cancel_after(n: int):
    event = threading.Event()
    calls = []

    def progress(done, total, rate, eta, phase):
        calls.append(phase)
        if len(calls) >= n:
            event.set()

    return event, progress, calls


def test_cancel_then_resume(ds4, tmp_path):
    src, pack = ds4
    target = tmp_path / "c.expertpack"
    event, progress, _ = _cancel_after(3)
    with pytest.raises(BuildCancelled, match="resume"):
        build_pack(src, target, progress=progress, cancel=event, **SMALL)
    partial = tmp_path / "c.expertpack.partial"
    assert partial.is_dir() and not target.exists()
    with pytest.raises(PackError):
        load_manifest(partial)
    journal = json.loads((partial / "progress.json").read_text())
    assert journal["layers"], "at least one layer was committed before the cancel took effect"
    b = PackBuilder(src, target, **SMALL)
    b.run()
    assert b.stats.layers_resumed == len(journal["layers"]) and not b.stats.restarted
    assert files_of(target) == files_of(pack)
    assert not partial.exists()


def test_resume_redoes_a_damaged_layer(ds4, tmp_path):
    src, pack = ds4
    target = tmp_path / "r.expertpack"
    event, progress, _ = _cancel_after(5)
    with pytest.raises(BuildCancelled):
        build_pack(src, target, progress=progress, cancel=event, **SMALL)
    partial = tmp_path / "r.expertpack.partial"
    m = load_manifest(pack)
    with open(partial / "experts.bin", "r+b") as f:  # damage layer 0 after it was journaled
        f.seek(m.block_offset(0, 1) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = PackBuilder(src, target, **SMALL)
    b.run()
    assert b.stats.layers_redone == 1
    assert files_of(target) == files_of(pack)


def test_source_changed_between_runs_restarts(tmp_path):
    src_dir = tmp_path / "src"
    src = write_deepseek4(src_dir)
    target = tmp_path / "s.expertpack"
    event, progress, _ = _cancel_after(3)
    with pytest.raises(BuildCancelled):
        build_pack(src, target, progress=progress, cancel=event, **SMALL)
    write_deepseek4(src_dir, salt=7)  # same name, other bytes: a re-download of another quant
    b = PackBuilder(src, target, **SMALL)
    b.run()
    assert b.stats.restarted and b.stats.layers_resumed == 0
    assert_pack_matches_source(target, src)


# --- disk space ----------------------------------------------------------------------------


def test_not_enough_space_is_refused_before_writing(ds4, tmp_path, monkeypatch):
    src, _ = ds4
    monkeypatch.setattr(builder_mod, "free_space", lambda path: (10_000, 10**12))
    with pytest.raises(PackBuildError, match=r"the pack needs .* free on .*free space or choose another folder"):
        build_pack(src, tmp_path / "n.expertpack")
    assert not (tmp_path / "n.expertpack.partial").exists()
    assert not (tmp_path / "n.expertpack").exists()


@pytest.mark.parametrize("fail_at", [1, 4, 12])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_mid_build(ds4, tmp_path, monkeypatch, fail_at, code):
    src, _ = ds4
    real = builder_mod.pwrite_full
    calls = [0]
    lock = threading.Lock()

    def filling_write(fd, view, offset):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n >= fail_at:
            raise OSError(code, "No space left on device")
        return real(fd, view, offset)

    monkeypatch.setattr(builder_mod, "pwrite_full", filling_write)
    with pytest.raises(PackBuildError) as info:
        build_pack(src, tmp_path / "full.expertpack", **SMALL)
    msg = str(info.value)
    assert "the pack needs" in msg and "free on" in msg and "free space or choose another folder" in msg
    assert not (tmp_path / "full.expertpack.partial").exists()
    assert not (tmp_path / "full.expertpack").exists()


# --- hostile inputs --------------------------------------------------------------------------


def _ds4_with(tmp_path, *, tensors=None, drop=(), rename=None, meta=None, name="bad"):
    t = deepseek4_tensors() if tensors is None else tensors
    for n in drop:
        del t[n]
    if rename:
        t = {rename.get(k, k): v for k, v in t.items()}
    md = deepseek4_metadata()
    md.update(meta or {})
    md = {k: v for k, v in md.items() if v is not None}
    return write_gguf(tmp_path / f"{name}.gguf", t, md, arch="deepseek4")


def test_refuses_unknown_expert_tensor_name(tmp_path):
    src = _ds4_with(tmp_path, rename={"blk.1.ffn_up_exps.weight": "blk.1.ffn_upx_exps.weight"})
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.1\.ffn_upx_exps\.weight"):
        build_pack(src, tmp_path / "o")


def test_refuses_expert_count_mismatch(tmp_path):

    from gguf_factory import Typed

    src = _ds4_with(tmp_path, meta={"deepseek4.expert_count": Typed(5, GGUFValueType.UINT32)})
    with pytest.raises(UnsupportedLayoutError,
                       match=r"blk\.0\.ffn_gate_exps\.weight holds 4 experts but deepseek4\.expert_count is 5"):
        build_pack(src, tmp_path / "o")
    assert not list(tmp_path.glob("o/*"))


def test_refuses_missing_role_and_missing_keys(tmp_path):
    src = _ds4_with(tmp_path, drop=["blk.2.ffn_up_exps.weight"], name="a")
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.2 lacks blk\.2\.ffn_up_exps\.weight"):
        build_pack(src, tmp_path / "o")
    src = _ds4_with(tmp_path, meta={"deepseek4.expert_used_count": None}, name="b")
    with pytest.raises(UnsupportedLayoutError, match="deepseek4.expert_used_count is missing"):
        build_pack(src, tmp_path / "o")
    t = deepseek4_tensors()
    for role in ("gate", "up", "down"):
        del t[f"blk.3.ffn_{role}_exps.weight"]
    src = _ds4_with(tmp_path, tensors=t, name="c")
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.3 has a router"):
        build_pack(src, tmp_path / "o")


def test_refuses_wrong_expert_shapes(tmp_path):
    t = deepseek4_tensors()
    t["blk.1.ffn_down_exps.weight"] = quantized_bytes((4, 64, 128), T.MXFP4)  # transposed down
    src = _ds4_with(tmp_path, tensors=t)
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.1\.ffn_down_exps\.weight has per-expert shape"):
        build_pack(src, tmp_path / "o")


def test_kimi_refuses_experts_in_dense_layer_and_wrong_latent(tmp_path):

    from gguf_factory import Typed

    t = kimi_k3_tensors()
    md = kimi_k3_metadata()
    md["kimi-k3.leading_dense_block_count"] = Typed(2, GGUFValueType.UINT32)
    src = write_gguf(tmp_path / "k1.gguf", t, md, arch="kimi-k3")
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.1.*leading_dense_block_count = 2"):
        build_pack(src, tmp_path / "o")
    md = kimi_k3_metadata()
    md["kimi-k3.expert_latent_length"] = Typed(512, GGUFValueType.UINT32)
    src = write_gguf(tmp_path / "k2.gguf", t, md, arch="kimi-k3")
    with pytest.raises(UnsupportedLayoutError, match=r"blk\.1\.ffn_gate_exps\.weight .* latent width"):
        build_pack(src, tmp_path / "o")


def test_truncated_source_is_refused(ds4, tmp_path):
    src, _ = ds4
    bad = tmp_path / "cut.gguf"
    shutil.copy(src, bad)
    truncate(bad, bad.stat().st_size - 1000)
    with pytest.raises(GGUFFormatError, match="truncated|incomplete"):
        build_pack(bad, tmp_path / "o")
    with pytest.raises(PackBuildError, match="no such file"):
        build_pack(tmp_path / "missing.gguf", tmp_path / "o")


def test_generic_architecture_fused_gate_up_with_biases(tmp_path):
    """Any architecture with stacked experts: fused gate_up plus per-expert biases."""
    E, H, F = 4, 64, 32
    t = {"token_embd.weight": np.zeros((16, H), dtype=np.float32)}
    for b in range(2):
        p = f"blk.{b}."
        t[p + "ffn_gate_inp.weight"] = np.ones((E, H), dtype=np.float32)
        t[p + "ffn_gate_up_exps.weight"] = quantized_bytes((E, 2 * F, H), T.Q8_0, seed=b)
        t[p + "ffn_down_exps.weight"] = quantized_bytes((E, H, F), T.Q8_0, seed=10 + b)
        t[p + "ffn_gate_up_exps.bias"] = np.arange(E * 2 * F, dtype=np.float32).reshape(E, 2 * F)
        t[p + "ffn_down_exps.bias"] = np.arange(E * H, dtype=np.float32).reshape(E, H)
    md = {"gpt-oss.expert_count": E, "gpt-oss.expert_used_count": 2, "gpt-oss.block_count": 2}
    src = write_gguf(tmp_path / "g.gguf", t, md, arch="gpt-oss")
    pack = build_pack(src, tmp_path / "o")
    m = load_manifest(pack)
    assert m.role_names == ("gate_up", "down", "gate_up.bias", "down.bias")
    assert_pack_matches_source(pack, src)


def test_aligned_source_is_read_straight_into_the_blocks(tmp_path, monkeypatch):
    """With 4096-aligned tensor data and 4096-byte slices the direct read needs no staging copy."""
    E = 4
    t = {"token_embd.weight": np.ones((8, 32), dtype=np.float32)}
    for b in range(2):
        rng = np.random.default_rng(b)
        t[f"blk.{b}.ffn_gate_inp.weight"] = np.ones((E, 32), dtype=np.float32)
        for role in ("gate", "up", "down"):
            t[f"blk.{b}.ffn_{role}_exps.weight"] = rng.standard_normal((E, 32, 32), dtype=np.float32)  # 4096 B/expert
    md = {"mix.expert_count": E, "mix.expert_used_count": 2}
    src = write_gguf(tmp_path / "aligned.gguf", t, md, arch="mix", alignment=4096)
    staged = []
    real_stage = builder_mod._SourceFiles._stage
    monkeypatch.setattr(builder_mod._SourceFiles, "_stage", lambda self, n: staged.append(n) or real_stage(self, n))
    b = PackBuilder(src, tmp_path / "o.expertpack")
    b.run()
    assert_pack_matches_source(tmp_path / "o.expertpack", src)
    if b.stats.direct_io:
        assert staged == [], "aligned ranges are read without the staging copy"


def test_source_odirect_read_refused_falls_back(ds4, tmp_path, monkeypatch):
    src, pack = ds4

    def refuse(self, fd, offset, nbytes, targets):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(builder_mod._SourceFiles, "_read_direct", refuse)
    build_pack(src, tmp_path / "fb.expertpack", **SMALL)
    assert files_of(tmp_path / "fb.expertpack") == files_of(pack)


# --- dense.gguf's header: raw values, written without GGUFWriter internals -------------------


def _rewrite_gguf(src: Path, out: Path, extra: list, alignment: int) -> Path:
    """`src` with more metadata fields and another alignment, written with the builder's
    header writer (GGUFWriter cannot write an empty array)."""
    from packer.builder import gguf_header_bytes
    from packer.gguf_source import MetadataField, read_header

    fields = [f for f in read_header(src).fields if f.key != "general.alignment"]
    fields += [*extra, MetadataField("general.alignment", int(GGUFValueType.UINT32), struct.pack("<I", alignment))]
    with GGUFSource.open(src) as source:
        tensors = list(source.tensors.values())
        data = bytearray(gguf_header_bytes(fields, tensors, alignment))
        data += bytes(-len(data) % alignment)
        for t in tensors:
            data += source.tensor_bytes(t.name).tobytes()
            data += bytes(-t.nbytes % alignment)
    out.write_bytes(bytes(data))
    return out


def test_dense_gguf_keeps_empty_arrays_custom_alignment_and_exact_value_bytes(tmp_path):
    from packer.gguf_source import MetadataField

    src = write_deepseek4(tmp_path / "a")
    extra = [
        MetadataField("x.empty_i32", int(GGUFValueType.ARRAY), struct.pack("<IQ", int(GGUFValueType.INT32), 0)),
        MetadataField("x.empty_str", int(GGUFValueType.ARRAY), struct.pack("<IQ", int(GGUFValueType.STRING), 0)),
        MetadataField("x.u64", int(GGUFValueType.UINT64), struct.pack("<Q", 2**63 + 5)),
        MetadataField("x.f64", int(GGUFValueType.FLOAT64), struct.pack("<d", 1 / 3)),
        MetadataField("x.bad_utf8", int(GGUFValueType.STRING), struct.pack("<Q", 3) + b"\xff\x00z"),
    ]
    odd = _rewrite_gguf(src, tmp_path / "odd.gguf", extra, alignment=64)
    reader = GGUFReader(odd)  # the reference reader accepts the rewritten source
    assert reader.alignment == 64 and reader.fields["x.empty_i32"].types == [GGUFValueType.ARRAY]
    pack = build_pack(odd, tmp_path / "packs", **SMALL)
    assert_pack_matches_source(pack, odd)  # every field: same types, same bytes
    dense = GGUFReader(pack / "dense.gguf")
    assert dense.alignment == 64
    for f in extra:
        got = dense.fields[f.key]
        assert got.types[0] == f.value_type, f.key
        assert b"".join(bytes(p) for p in got.parts[3:]) == f.data, f.key  # parts: key len, key, type, value


def test_dense_gguf_header_is_what_gguf_writer_writes(tmp_path):
    """For values GGUFWriter can express, dense.gguf's header is byte for byte GGUFWriter's."""
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    meta = deepseek4_metadata()
    meta["tokenizer.ggml.tokens"] = ["a", "b", "c"]  # GGUFWriter only takes valid UTF-8 from Python values
    src = write_gguf(tmp_path / "src" / "m.gguf", deepseek4_tensors(), meta, arch="deepseek4")
    pack = build_pack(src, tmp_path / "packs", **SMALL)

    reader = GGUFReader(src)
    writer = GGUFWriter(tmp_path / "ref.gguf", "deepseek4")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    with GGUFSource.open(src) as source:
        experts = plan_experts(source).expert_tensor_names
        for t in source.tensors.values():
            if t.name in experts:
                continue
            block, size = GGML_QUANT_SIZES[T(t.ggml_type)]
            writer.add_tensor_info(t.name, (*t.shape[:-1], t.shape[-1] // block * size), np.dtype(np.uint8),
                                   t.nbytes, raw_dtype=T(t.ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    ref = (tmp_path / "ref.gguf").read_bytes()
    assert len(ref) > 24 and (pack / "dense.gguf").read_bytes()[: len(ref)] == ref


def test_read_header_gives_raw_fields_and_fingerprint(ds4):
    from packer.gguf_source import read_header

    src, pack = ds4
    header = read_header(src)
    data = src.read_bytes()
    assert header.size == len(data) and header.alignment == 32
    assert header.sha256 == hashlib.sha256(data[: header.data_offset]).hexdigest()
    assert header.sha256 == load_manifest(pack).source_files[0].header_sha256
    tokens = {f.key: f for f in header.fields}["tokenizer.ggml.tokens"]
    assert tokens.value_type == GGUFValueType.ARRAY
    assert tokens.data == struct.pack("<IQ", int(GGUFValueType.STRING), 3) + b"".join(
        struct.pack("<Q", len(t)) + t for t in (b"a", b"\xff\xfe", b"c")
    )
    assert not any(f.key.startswith("GGUF.") for f in header.fields)
    cut = pack.parent / "cut.gguf"
    shutil.copyfile(src, cut)
    truncate(cut, 100)
    with pytest.raises(GGUFFormatError, match="cut.gguf"):
        read_header(cut)
