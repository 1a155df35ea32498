"""packer.verify: every problem found and located; unusable packs refused."""

from __future__ import annotations

import json
import shutil

import pytest

from expertpack import PackError, load_manifest
from pack_factory import flip
from pack_fixtures import write_deepseek4
from packer.builder import build_pack
from packer.verify import _quick_samples, verify_pack


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    src = write_deepseek4(root / "src")
    return build_pack(src, root / "packs", threads=2)


@pytest.fixture
def pack(built, tmp_path):
    """A private copy of the pack that the test may damage."""
    return shutil.copytree(built, tmp_path / built.name)


def test_intact_pack_passes_full_and_quick(pack):
    full = verify_pack(pack)
    assert full.ok and full.slices_checked == full.slices_total == 4 * 4 * 3
    assert full.bytes_read > (pack / "experts.bin").stat().st_size - 4096
    quick = verify_pack(pack, quick=True)
    assert quick.ok and 0 < quick.slices_checked < quick.slices_total
    json.dumps(full.to_dict())
    assert "OK" in full.summary()
    full.raise_if_failed()


def test_one_flipped_byte_is_located(pack):
    m = load_manifest(pack)
    li, e = 2, 3
    role = m.layers[li].role("up")
    flip(pack / "experts.bin", m.block_offset(li, e) + role.offset + 100)
    report = verify_pack(pack)
    assert not report.ok
    assert [(p.kind, p.block, p.expert, p.role) for p in report.problems] == [("slice", m.layers[li].block, 3, "up")]
    assert "blk.2 expert 3 role up" in report.problems[0].message
    with pytest.raises(PackError, match="failed verification"):
        report.raise_if_failed()


def test_every_slice_reported_up_to_the_cap(pack):
    m = load_manifest(pack)
    for li in range(m.num_layers):
        for e in range(m.num_experts):
            flip(pack / "experts.bin", m.block_offset(li, e) + m.layers[li].roles[0].offset)
    report = verify_pack(pack)
    assert len(report.problems) == m.num_layers * m.num_experts
    assert {p.role for p in report.problems} == {"gate"}


def test_nonzero_padding_is_reported(pack):
    m = load_manifest(pack)
    gate = m.layers[1].roles[0]
    flip(pack / "experts.bin", m.block_offset(1, 0) + gate.end + 10)
    report = verify_pack(pack)
    assert [(p.kind, p.block, p.expert) for p in report.problems] == [("padding", 1, 0)]


def test_quick_verify_samples_are_fixed_and_catch_their_slices(pack):
    m = load_manifest(pack)
    samples = _quick_samples(m)
    assert samples == _quick_samples(m)
    assert (0, 0) in samples and (m.num_layers - 1, m.num_experts - 1) in samples
    assert {li for li, _ in samples} == set(range(m.num_layers))
    li, e = samples[len(samples) // 2]
    flip(pack / "experts.bin", m.block_offset(li, e) + m.layers[li].roles[2].offset)
    report = verify_pack(pack, quick=True)
    assert [(p.block, p.expert, p.role) for p in report.problems] == [(m.layers[li].block, e, "down")]


def test_dense_and_hashes_damage(pack):
    size = (pack / "dense.gguf").stat().st_size
    flip(pack / "dense.gguf", size - 5000)  # tensor data: the quick check's samples cover it too
    assert [p.kind for p in verify_pack(pack, quick=True).problems] == ["dense"]
    kinds = [p.kind for p in verify_pack(pack).problems]
    assert kinds == ["dense"]
    flip(pack / "dense.gguf", size - 5000)
    assert verify_pack(pack, quick=True).ok
    flip(pack / "dense.gguf", 2)  # the GGUF magic
    assert [p.kind for p in verify_pack(pack, quick=True).problems] == ["dense"]


def test_hashes_file_damage(pack):
    flip(pack / "expert_hashes.bin", 40)
    problems = verify_pack(pack).problems
    assert problems[0].kind == "hashes"
    # The digest that changed now disagrees with its (intact) slice: blk.0 expert 0 role up.
    assert [(p.kind, p.block, p.expert, p.role) for p in problems[1:]] == [("slice", 0, 0, "up")]


def test_structure_problems(pack):
    with open(pack / "experts.bin", "r+b") as f:
        f.truncate(4096 * 10)
    report = verify_pack(pack)
    assert not report.ok and "experts.bin is 40960 bytes" in report.problems[0].message
    (pack / "dense.gguf").unlink()
    assert any("dense.gguf is missing" in p.message for p in verify_pack(pack, quick=True).problems)


def test_header_mismatch(pack):
    flip(pack / "experts.bin", 0)
    assert any(p.kind == "structure" and "header" in p.message for p in verify_pack(pack).problems)


def test_unusable_packs_raise(pack, tmp_path):
    with pytest.raises(PackError, match="no manifest.json"):
        verify_pack(tmp_path / "nothing")
    partial = tmp_path / "x.expertpack.partial"
    shutil.copytree(pack, partial)
    with pytest.raises(PackError, match="unfinished build"):
        verify_pack(partial)
    data = json.loads((pack / "manifest.json").read_text())
    data["format_version"] = 3
    (pack / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackError, match="version 3.*version 2.*update ExpertDesk"):
        verify_pack(pack)
    data["format_version"] = 1  # a pack of an older ExpertDesk: build it again
    (pack / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackError, match="version 1.*version 2.*expertdesk pack MODEL.gguf"):
        verify_pack(pack)
    data["format_version"] = 2
    data["complete"] = False
    (pack / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackError, match="not marked complete"):
        verify_pack(pack)


def test_progress_reports_bytes(pack):
    calls = []
    verify_pack(pack, progress=lambda *a: calls.append(a))
    done, total, rate, eta, phase = calls[-1]
    assert done == total and rate > 0 and phase.startswith("verify")
