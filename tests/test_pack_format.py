"""expertpack: the pack format on its own (manifest schema, layout, header), with no engine or packer."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import expertpack
from expertpack import (
    ALIGNMENT,
    FORMAT_VERSION,
    HASHES_NAME,
    PackError,
    PackManifest,
    align_up,
    check_experts_file_header,
    experts_file_header,
    load_manifest,
    role_offsets,
)
from pack_factory import make_pack

ROOT = Path(__file__).resolve().parents[1]


def test_importing_expertpack_loads_no_project_or_model_code():
    """The format is a leaf at run time too: no engine, packer, app, torch, gguf (or numpy)."""
    code = (
        "import sys, expertpack\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('engine', 'packer', 'app', 'torch', 'gguf', 'numpy', 'PySide6'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_public_name_is_exported_from_the_package():
    for name in expertpack.__all__:
        assert getattr(expertpack, name) is not None, name


def test_manifest_round_trip_and_sizes(tmp_path):
    pack = make_pack(tmp_path / "p.expertpack")
    m = load_manifest(pack.path)
    assert m == pack.manifest
    assert PackManifest.from_json(m.to_json()) == m
    assert m.to_json() == (pack.path / "manifest.json").read_text()
    assert m.hashes_file_size == (pack.path / HASHES_NAME).stat().st_size
    assert m.format_version == FORMAT_VERSION == 2
    head = (pack.path / m.experts_file).read_bytes()[:ALIGNMENT]
    assert head == experts_file_header(m)
    check_experts_file_header(head, m, pack.path)
    assert json.loads(m.to_json())["layout_sha256"] == m.layout_sha256 == hashlib.sha256(m.layout_table()).hexdigest()
    assert bytes.fromhex(m.layout_sha256) in head  # the header carries the layout digest too
    assert expertpack.check_pack(pack.path) == m


def test_slice_digests_are_keyed_by_place(tmp_path):
    """expert_hashes.bin holds SHA-256(slice_key || bytes); the key names the slice's place and kind."""
    pack = make_pack(tmp_path / "p.expertpack")
    m = pack.manifest
    hashes = (pack.path / HASHES_NAME).read_bytes()
    li, e, r = 1, 5, 2
    layer, role = m.layers[li], m.layers[li].roles[r]
    key = m.slice_key(li, e, r)
    assert json.loads(key[:-1]) == [li, layer.block, e, role.name, role.tensor, role.ggml_type, role.type_name,
                                    list(role.shape), m.block_offset(li, e) + role.offset, role.nbytes]
    data = pack.role_bytes(layer.block, e, role.name)
    at = m.hash_index(li, e, r) * 32
    assert hashes[at : at + 32] == hashlib.sha256(key + data).digest() == m.slice_digest(li, e, r, data)
    assert m.slice_digest(li, e + 1, r, data) != m.slice_digest(li, e, r, data)  # the same bytes elsewhere differ


def test_dense_sample_ranges():
    from expertpack import DENSE_SAMPLE_BYTES as S
    from expertpack import DENSE_SAMPLES as N
    from expertpack import dense_sample_ranges

    assert dense_sample_ranges(100, 40) == [(0, 40), (40, 60)]  # small: all of it
    assert dense_sample_ranges(40, 40) == [(0, 40)]
    size, head = 10 * N * S + 123, 5000
    ranges = dense_sample_ranges(size, head)
    assert ranges[0] == (0, head) and len(ranges) == N + 1
    assert ranges[1] == (head, S) and ranges[-1][0] + S <= size and size - (ranges[-1][0] + S) < N
    assert all(b[0] >= a[0] + a[1] for a, b in zip(ranges, ranges[1:]))  # in order, never overlapping


def test_layout_math():
    assert align_up(0) == 0 and align_up(1) == ALIGNMENT and align_up(ALIGNMENT) == ALIGNMENT
    assert role_offsets([10, ALIGNMENT, 1]) == [0, ALIGNMENT, 2 * ALIGNMENT]


def test_header_disagreeing_with_the_manifest_is_refused(tmp_path):
    m = make_pack(tmp_path / "p.expertpack").manifest
    other = replace(m, num_experts=m.num_experts - 1,
                    experts_file_size=m.experts_file_size - len(m.layers) * m.expert_stride)
    with pytest.raises(PackError, match="disagrees"):
        check_experts_file_header(experts_file_header(other), m, "x")
    swapped = replace(m, layers=(m.layers[1], m.layers[0]))  # same geometry, another layout
    with pytest.raises(PackError, match="another block layout"):
        check_experts_file_header(experts_file_header(swapped), m, "x")
    with pytest.raises(PackError, match="no ExpertDesk header"):
        check_experts_file_header(bytes(ALIGNMENT), m, "x")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["layers"][0]["roles"][1].update(offset=100), "misaligned or overlapping"),
        (lambda d: d.update(experts_file="../experts.bin"), "not a plain name"),
        (lambda d: d.update(experts_file_size=d["experts_file_size"] + 1), "geometry says"),
        (lambda d: d.update(expert_used_count=0), "expert_used_count"),
        (lambda d: d.update(format_version=3), "pack format version 3.*update ExpertDesk"),
        (lambda d: d.update(format_version=1), "pack format version 1.*`expertdesk pack MODEL.gguf"),
        (lambda d: d.update(dense_sample_sha256=""), "not a SHA-256"),
        (lambda d: d.update(dense_header_bytes=d["dense_file_size"] + 1), "dense_header_bytes"),
        (lambda d: d["layers"][0]["roles"][0].update(tensor="blk.9.ffn_gate_exps.weight"), "names tensor"),
        (lambda d: d["layers"][0]["roles"][0].update(ggml_type=2), "layout_sha256"),
        (lambda d: d.pop("layers"), "missing or has a malformed field"),
    ],
)
def test_malformed_manifests_are_refused(tmp_path, edit, message):
    data = json.loads(make_pack(tmp_path / "p.expertpack").manifest.to_json())
    edit(data)
    with pytest.raises(PackError, match=message):
        PackManifest.from_json(json.dumps(data), tmp_path / "manifest.json")


def test_unfinished_builds_are_never_packs(tmp_path):
    pack = make_pack(tmp_path / "p.expertpack", complete=False)
    with pytest.raises(PackError, match="not marked complete"):
        load_manifest(pack.path)
    assert not load_manifest(pack.path, require_complete=False).complete
    with pytest.raises(PackError, match="unfinished build"):
        load_manifest(tmp_path / "q.expertpack.partial")
