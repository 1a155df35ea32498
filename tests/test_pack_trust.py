"""A pack that verifies is the pack that runs (issue "verified means safe to run").

One test (or one parametrized group) per finding:
- the loader opens exactly the dense file the manifest names, and verify checks;
- every load runs a quick check (schema, version, sizes, config, dense samples, header,
  hashes) that refuses damage fast, naming the pack, the problem and `expertdesk verify`;
- the manifest binds every block to its (layer, expert, role, tensor, type, shape,
  offset): swapped layers, experts or gate/up names are caught by full verify and load;
- nothing in a pack is followed through a symlink, and no FIFO or device is opened;
- `--verify-reads` hashes every expert read, counts a mismatch and never caches it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

import expertpack
from engine.loader import open_model_source
from expertpack import PackError, load_manifest, write_manifest
from pack_factory import flip
from pack_fixtures import write_deepseek4
from packer.builder import build_pack
from packer.verify import verify_pack


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two packs of the same tiny architecture with different weights (salt 0 and 1)."""
    root = tmp_path_factory.mktemp("trust")
    a = build_pack(write_deepseek4(root / "src_a"), root / "a", threads=2)
    b = build_pack(write_deepseek4(root / "src_b", salt=1), root / "b", threads=2)
    return a, b


@pytest.fixture
def pack(builds, tmp_path):
    """A private copy of pack A that the test may damage."""
    return shutil.copytree(builds[0], tmp_path / builds[0].name)


def refused_by_full_verify(pack) -> bool:
    """Full verify reports a problem, or refuses the pack outright."""
    try:
        return not verify_pack(pack).ok
    except PackError:
        return True


def assert_load_refused(pack, *fragments):
    """open_model_source (what every load runs) refuses with the pack, the problem and the next step."""
    with pytest.raises(PackError) as info:
        source, _ = open_model_source(pack)
        source.close()
    message = str(info.value)
    assert str(pack) in message and "expertdesk verify" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def edit_manifest(pack, edit):
    path = pack / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


# --- finding 1: the dense file the manifest names ----------------------------------------


def test_loader_opens_the_dense_file_the_manifest_names(pack, builds):
    os.rename(pack / "dense.gguf", pack / "weights.gguf")
    edit_manifest(pack, lambda d: d.update(dense_file="weights.gguf"))
    shutil.copyfile(builds[1] / "dense.gguf", pack / "dense.gguf")  # a decoy under the old name
    assert verify_pack(pack).ok  # verify checks weights.gguf, the file the manifest names
    source, pack_dir = open_model_source(pack)
    try:
        assert pack_dir == pack
        assert source.files == [pack / "weights.gguf"]
    finally:
        source.close()


def test_swapped_dense_weights_are_refused_at_load(pack, builds):
    shutil.copyfile(builds[1] / "dense.gguf", pack / "dense.gguf")  # same layout, other weights
    assert refused_by_full_verify(pack)
    assert_load_refused(pack, "dense.gguf")


# --- finding 2: a quick check at every load ----------------------------------------------


def _truncate_experts(pack):
    with open(pack / "experts.bin", "r+b") as f:
        f.truncate((pack / "experts.bin").stat().st_size - 4096)


def _flip_dense_data(pack):
    flip(pack / "dense.gguf", (pack / "dense.gguf").stat().st_size - 5000)  # tensor data, not the header


def _flip_hashes(pack):
    flip(pack / "expert_hashes.bin", 40)


def _flip_header(pack):
    flip(pack / "experts.bin", 30)  # inside the header proper (geometry fields)


def _other_config(pack):
    edit_manifest(pack, lambda d: d.update(config_sha256="1" * 64))


def _grow_dense(pack):
    with open(pack / "dense.gguf", "ab") as f:
        f.write(b"\0" * 32)


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (_truncate_experts, "experts.bin"),
        (_flip_dense_data, "dense.gguf"),
        (_grow_dense, "dense.gguf"),
        (_flip_hashes, "expert_hashes.bin"),
        (_flip_header, "experts.bin"),
        (_other_config, "config"),
    ],
    ids=["experts-truncated", "dense-byte", "dense-size", "hashes-byte", "header-byte", "config"],
)
def test_load_refuses_a_damaged_pack(pack, damage, fragment):
    damage(pack)
    assert_load_refused(pack, fragment)


def test_verify_quick_covers_the_dense_file(pack):
    _flip_dense_data(pack)
    report = verify_pack(pack, quick=True)
    assert [p.kind for p in report.problems] == ["dense"]


def test_verify_quick_checks_the_config(pack):
    _other_config(pack)
    assert any(p.kind == "dense" and "config" in p.message for p in verify_pack(pack, quick=True).problems)


def test_an_old_format_pack_names_the_fix(pack):
    edit_manifest(pack, lambda d: d.update(format_version=1))
    with pytest.raises(PackError, match=r"version 1.*expertdesk pack"):
        open_model_source(pack)


def _sparse_terabyte_pack(path: Path) -> Path:
    """A pack of real size (~1 TB experts, 12 GB dense) as sparse files: what the load check reads."""
    from expertpack import LayerEntry, PackManifest, RoleEntry, SourceFile, experts_geometry, role_offsets

    path.mkdir()
    nbytes = [9 << 20, 9 << 20, 9 << 20]
    blocks = range(1, 93)  # 92 MoE layers
    layers = tuple(
        LayerEntry(b, tuple(RoleEntry(n, f"blk.{b}.ffn_{n}_exps.weight", off, nb, 39, "MXFP4", (2048, 8672))
                            for n, off, nb in zip(("gate", "up", "down"), role_offsets(nbytes), nbytes)))
        for b in blocks
    )
    num_experts = 384
    data_start, stride, size = experts_geometry(layers, num_experts)
    assert size > 1e12
    hashes = os.urandom(len(layers) * num_experts * 3 * 32)
    (path / "expert_hashes.bin").write_bytes(hashes)
    dense_size, header = 12 << 30, 8 << 20
    with open(path / "dense.gguf", "wb") as f:
        f.write(b"GGUF" + os.urandom(header - 4))
        f.truncate(dense_size)
    import hashlib

    manifest = PackManifest(
        architecture="deepseek4", num_experts=num_experts, expert_used_count=8, data_start=data_start,
        expert_stride=stride, layers=layers, experts_file_size=size,
        hashes_sha256=hashlib.sha256(hashes).hexdigest(), dense_sha256="0" * 64,
        source_files=(SourceFile("big.gguf", 1, "0" * 64),), source_tensor_count=1, config_sha256="0" * 64,
        tool="test", complete=True, dense_file_size=dense_size, dense_header_bytes=header,
        dense_sample_sha256=expertpack.dense_sample_sha256(path / "dense.gguf", dense_size, header),
    )
    with open(path / "experts.bin", "wb") as f:
        f.write(expertpack.experts_file_header(manifest))
        f.truncate(size)
    write_manifest(path, manifest)
    return path


def test_the_load_check_of_a_terabyte_pack_takes_well_under_a_second(tmp_path):
    pack = _sparse_terabyte_pack(tmp_path / "big.expertpack")
    expertpack.check_pack(pack)  # warm the page cache: the timing below is the check's own work
    t0 = time.perf_counter()
    manifest = expertpack.check_pack(pack)
    seconds = time.perf_counter() - t0
    assert manifest.experts_file_size > 1e12
    assert seconds < 0.5, f"the load check of a 1 TB pack took {seconds:.3f} s"
    flip(pack / "dense.gguf", 1 << 20)  # inside dense.gguf's header: always hashed
    with pytest.raises(PackError, match="dense.gguf.*expertdesk verify"):
        expertpack.check_pack(pack)
    flip(pack / "dense.gguf", 1 << 20)
    flip(pack / "expert_hashes.bin", 5)
    with pytest.raises(PackError, match="expert_hashes.bin.*expertdesk verify"):
        expertpack.check_pack(pack)


# --- finding 3: every block bound to its place -------------------------------------------


def _swap_layer_entries(data):
    data["layers"][0], data["layers"][1] = data["layers"][1], data["layers"][0]


def _exchange_gate_up(data):
    for layer in data["layers"]:
        gate, up = layer["roles"][0], layer["roles"][1]
        gate["name"], up["name"] = up["name"], gate["name"]
        gate["tensor"], up["tensor"] = up["tensor"], gate["tensor"]


@pytest.mark.parametrize("edit", [_swap_layer_entries, _exchange_gate_up], ids=["layers-swapped", "gate-up-exchanged"])
def test_a_manifest_edited_against_its_layout_is_refused(pack, edit):
    edit_manifest(pack, edit)
    assert refused_by_full_verify(pack)
    assert_load_refused(pack, "layout")


@pytest.mark.parametrize("edit", [_swap_layer_entries, _exchange_gate_up], ids=["layers-swapped", "gate-up-exchanged"])
def test_a_consistent_manifest_of_another_layout_is_refused_by_experts_bin(pack, edit):
    """The manifest edited and its layout digest recomputed: experts.bin's header still says otherwise."""
    data = json.loads((pack / "manifest.json").read_text())
    edit(data)
    data.pop("layout_sha256", None)
    m = load_manifest(pack)
    edited = replace(m, layers=layers_of(data))
    write_manifest(pack, edited)  # a self-consistent manifest
    assert refused_by_full_verify(pack)
    assert_load_refused(pack, "experts.bin")


def layers_of(data):
    """The LayerEntry tuple of a manifest's JSON `data` (no checks: the test builds bad ones)."""
    from expertpack import LayerEntry, RoleEntry

    return tuple(LayerEntry(int(layer["block"]), tuple(
        RoleEntry(r["name"], r["tensor"], r["offset"], r["nbytes"], r["ggml_type"], r["type_name"], tuple(r["shape"]))
        for r in layer["roles"])) for layer in data["layers"])


def _swap_blocks_and_digests(pack, a, b):
    """Exchange two expert blocks in experts.bin and their digests in expert_hashes.bin, then fix
    the manifest's hashes_sha256: every per-file check still agrees."""
    import hashlib

    m = load_manifest(pack)
    R, D = len(m.role_names), 32
    with open(pack / "experts.bin", "r+b") as f:
        blocks = []
        for li, e in (a, b):
            f.seek(m.block_offset(li, e))
            blocks.append(f.read(m.expert_stride))
        for (li, e), data in zip((a, b), reversed(blocks)):
            f.seek(m.block_offset(li, e))
            f.write(data)
    hashes = bytearray((pack / "expert_hashes.bin").read_bytes())
    ia, ib = (m.hash_index(li, e, 0) * D for li, e in (a, b))
    hashes[ia : ia + R * D], hashes[ib : ib + R * D] = hashes[ib : ib + R * D], hashes[ia : ia + R * D]
    (pack / "expert_hashes.bin").write_bytes(hashes)
    edit_manifest(pack, lambda d: d.update(hashes_sha256=hashlib.sha256(hashes).hexdigest()))
    return m


@pytest.mark.parametrize(("a", "b"), [((0, 1), (0, 2)), ((0, 3), (1, 3))], ids=["experts", "layers"])
def test_blocks_swapped_with_their_digests_are_caught(pack, a, b):
    m = _swap_blocks_and_digests(pack, a, b)
    report = verify_pack(pack)
    assert not report.ok
    bad = {(p.block, p.expert) for p in report.problems if p.kind == "slice"}
    assert bad == {(m.layers[li].block, e) for li, e in (a, b)}


# --- finding 4: no symlinks, FIFOs or devices; names stay inside --------------------------

PACK_FILES = ["manifest.json", "experts.bin", "expert_hashes.bin", "dense.gguf"]


@pytest.mark.parametrize("name", PACK_FILES)
def test_a_symlinked_pack_file_is_refused(pack, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    shutil.copyfile(pack / name, outside)  # the same bytes, but not inside the pack
    (pack / name).unlink()
    (pack / name).symlink_to(outside)
    assert refused_by_full_verify(pack)
    assert_load_refused(pack, name, "symlink")


def _in_thread(fn, timeout=20.0):
    """fn() in a thread; (finished, exception). A FIFO open() without a writer blocks forever."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), box.get("error")


def _release_fifo(path):
    """Unblock a reader stuck opening `path` (open a writer, close it: the reader sees EOF)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
@pytest.mark.parametrize("name", PACK_FILES)
def test_a_fifo_in_a_pack_is_refused_without_blocking(pack, name):
    (pack / name).unlink()
    os.mkfifo(pack / name)
    try:
        finished, error = _in_thread(lambda: open_model_source(pack))
        assert finished, f"loading a pack whose {name} is a FIFO blocked"
        assert isinstance(error, PackError) and name in str(error) and "regular file" in str(error), error
        box: dict = {}
        finished, error = _in_thread(lambda: box.setdefault("report", verify_pack(pack, quick=True)))
        assert finished, f"verifying a pack whose {name} is a FIFO blocked"
        if error is None:  # reported as a problem rather than raised
            assert any(name in p.message and "regular file" in p.message for p in box["report"].problems)
        else:
            assert isinstance(error, PackError) and name in str(error) and "regular file" in str(error), error
    finally:
        _release_fifo(pack / name)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_the_store_never_opens_a_link_or_a_fifo(tmp_path, kind):
    """ExpertStore on its own (benchmarks, tools) refuses too, without blocking."""
    from engine.runtime import ExpertStore, RuntimeStartError
    from pack_factory import make_pack

    tiny = make_pack(tmp_path / "tiny.expertpack")
    experts = tiny.path / "experts.bin"
    os.rename(experts, tmp_path / "elsewhere.bin")
    if kind == "symlink":
        experts.symlink_to(tmp_path / "elsewhere.bin")
    else:
        os.mkfifo(experts)
    try:
        finished, error = _in_thread(lambda: ExpertStore(tiny.path, direct_io=False).close())
        assert finished, "the store blocked opening a FIFO"
        assert isinstance(error, RuntimeStartError) and kind in str(error).lower(), error
    finally:
        if kind == "fifo":
            _release_fifo(experts)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="creating a device node needs root")
def test_a_device_file_in_a_pack_is_refused(pack):
    (pack / "experts.bin").unlink()
    os.mknod(pack / "experts.bin", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    assert refused_by_full_verify(pack)
    assert_load_refused(pack, "experts.bin", "regular file")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(dense_file="experts.bin"), "more than once"),
        (lambda d: d.update(hashes_file="manifest.json"), "more than once"),
        (lambda d: d.update(dense_file="dense-00001-of-00002.gguf"), "shard"),
        (lambda d: d.update(dense_file="C:dense.gguf"), "not a plain name"),
        (lambda d: d.update(dense_file="dense\0.gguf"), "not a plain name"),
        (lambda d: d.update(dense_file=".."), "not a plain name"),
    ],
    ids=["dense-is-experts", "hashes-is-manifest", "split-shard", "drive-letter", "nul", "dotdot"],
)
def test_manifest_file_names_stay_inside_the_pack(pack, edit, message):
    edit_manifest(pack, edit)
    with pytest.raises(PackError, match=message):
        load_manifest(pack)


# --- finding 5: read verification ----------------------------------------------------------


def test_verify_reads_flag_reaches_the_store(tmp_path):
    from app.cli_options import add_runtime_arguments, runtime_flags, runtime_options
    from engine.loader import pack_expert_provider
    from engine.options import RuntimeOptions
    from pack_factory import make_pack

    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    options = runtime_options(parser.parse_args(["--verify-reads", "--buffered-io"]))
    assert options.verify_reads is True
    assert "--verify-reads" in runtime_flags(options)
    assert runtime_options(parser.parse_args([])).verify_reads is False
    tiny = make_pack(tmp_path / "tiny.expertpack")
    for verify in (False, True):
        cache = pack_expert_provider(tiny.path, RuntimeOptions(device="cpu", direct_io=False, verify_reads=verify))
        try:
            assert cache.store.verify is verify
        finally:
            cache.close()


def test_wrong_bytes_from_the_drive_are_detected_counted_and_not_cached(tmp_path, monkeypatch):
    from engine.runtime import ExpertCache, ExpertReadError, ExpertStore
    from engine.runtime import store as store_mod
    from pack_factory import make_pack

    tiny = make_pack(tmp_path / "tiny.expertpack", blocks=(1, 3), num_experts=8, top_k=2)
    store = ExpertStore(tiny.path, direct_io=False, io_threads=2, stage_slots=2, verify=True)
    stride = tiny.manifest.expert_stride
    cache = ExpertCache(store, device="cpu", cache_bytes=4 * stride, reserve_bytes=0)
    real, bad = os.preadv, [1]

    def lying_drive(fd, buffers, offset, *args):
        n = real(fd, buffers, offset, *args)
        if bad and n > 100:
            bad.pop()
            view = memoryview(buffers[0]).cast("B")
            view[100] ^= 0x40  # the drive hands back one wrong bit
        return n

    monkeypatch.setattr(store_mod.os, "preadv", lying_drive)
    try:
        with pytest.raises(ExpertReadError, match="SHA-256"):
            with cache.acquire(3, [5]):
                pass
        snap = cache.telemetry.snapshot()
        assert snap["hash_mismatches"] == 1 and snap["io_errors"] == 1
        reads = snap["reads"]
        with cache.acquire(3, [5]) as batch:  # read again from the drive (nothing bad was cached)
            for role in tiny.manifest.layer_for_block(3).roles:
                assert bytes(batch[5][role.name].raw.numpy()) == tiny.role_bytes(3, 5, role.name)
        assert cache.telemetry.get("reads") == reads + 1
    finally:
        cache.close()
        store.close()


def test_a_demo_pack_of_an_older_format_is_built_again(tmp_path, monkeypatch):
    """The demo's pack lives in the user cache: after an upgrade it is rebuilt, not refused."""
    from engine.demo import ensure_demo_pack

    monkeypatch.setenv("EXPERTDESK_HOME", str(tmp_path / "home"))
    pack = ensure_demo_pack()
    edit_manifest(pack, lambda d: d.update(format_version=1))  # what an older ExpertDesk left there
    assert ensure_demo_pack() == pack
    assert load_manifest(pack).format_version == expertpack.FORMAT_VERSION
    expertpack.check_pack(pack)
