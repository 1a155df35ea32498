"""Pack while downloading (packer.shard_pack) against the mock hub (tests/hub_mock.py).

The reference is `build_pack` on the complete split set: the pack made shard by shard
must be byte-identical to it, `expertdesk verify` must pass on it, and the disk, sampled
after every step, must never hold more than the pack plus 1.2 shards.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import huggingface_hub
import pytest

from hub_mock import MockHub
from pack_fixtures import write_deepseek4
from packer.builder import BuildCancelled, build_pack
from packer.download import DownloadCancelled, resolve
from packer.gguf_source import split_set_paths
from packer.shard_pack import ShardPacker

REPO = "tester/Tiny-DS4-GGUF"
PATTERN = "MXFP4_MOE/*.gguf"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_deepseek4(tmp_path_factory.mktemp("src"), split=3)


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> Path:
    return build_pack(source, tmp_path_factory.mktemp("ref"))


@pytest.fixture
def hub(source, monkeypatch, tmp_path):
    files = {f"MXFP4_MOE/{p.name}": p.read_bytes() for p in split_set_paths(source)}
    files["README.md"] = b"# tiny\n"
    with MockHub(REPO, files) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
        yield h


def disk_bytes(*roots: Path) -> int:
    """Bytes really allocated under `roots` (sparse holes excluded, symlinks not followed)."""
    total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                st = os.lstat(os.path.join(dirpath, n))
                if not os.path.islink(os.path.join(dirpath, n)):
                    total += st.st_blocks * 512
    return total


def same_files(a: Path, b: Path) -> None:
    names_a = sorted(p.name for p in a.iterdir())
    assert names_a == sorted(p.name for p in b.iterdir())
    for name in names_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def run_measured(tmp_path: Path, **options) -> tuple[Path, list[int]]:
    out = tmp_path / "packs"
    samples: list[int] = []

    def step(what: str, name: str) -> None:
        samples.append(disk_bytes(tmp_path / "hf-cache", out))

    pack = ShardPacker(resolve(REPO, PATTERN), out, on_step=step, **options).run()
    return pack, samples


def test_pack_while_downloading_is_byte_identical_and_peaks_at_pack_plus_one_shard(hub, source, reference,
                                                                                   tmp_path):
    from app.cli import main

    pack, samples = run_measured(tmp_path)
    same_files(pack, reference)
    assert main(["verify", str(pack)]) == 0
    shards = [p.stat().st_size for p in split_set_paths(source)]
    assert len(samples) == 3 * len(shards)  # downloaded, packed, deleted: per shard
    peak = max(samples)
    limit = disk_bytes(pack) + 1.2 * max(shards)
    assert peak <= limit, (peak, limit)
    assert disk_bytes(tmp_path / "hf-cache") < max(shards)  # every shard deleted at the end
    # Each shard was fetched once in full, plus one ranged request for its header.
    gets = [(p, r) for m, p, r in hub.requests if m == "GET" and p.endswith(".gguf")]
    assert sorted(p for p, r in gets if r is None) == sorted(f"MXFP4_MOE/{p.name}" for p in split_set_paths(source))
    assert all(r.startswith("bytes=0-") for _, r in gets if r is not None)


def test_keeping_the_shards_is_what_the_disk_bound_rules_out(hub, source, reference, tmp_path):
    """The control for the bound above: with the shards kept, the disk holds pack + all shards."""
    pack, samples = run_measured(tmp_path, keep_shards=True)
    same_files(pack, reference)
    shards = [p.stat().st_size for p in split_set_paths(source)]
    assert max(samples) > disk_bytes(pack) + 1.2 * max(shards)


def test_interrupted_after_the_first_shard_resumes_without_fetching_it_again(hub, source, reference, tmp_path):
    out = tmp_path / "packs"
    cancel = threading.Event()
    first = split_set_paths(source)[0].name

    def step(what: str, name: str) -> None:
        if what == "deleted" and name == first:
            cancel.set()

    job = ShardPacker(resolve(REPO, PATTERN), out, cancel=cancel, on_step=step)
    with pytest.raises(DownloadCancelled):
        job.run()
    assert job.shards_packed == [first]
    assert not job.final.exists() and job.partial.is_dir()
    before = len(hub.requests)
    again = ShardPacker(resolve(REPO, PATTERN), out)
    pack = again.run()
    assert again.shards_packed == [p.name for p in split_set_paths(source)[1:]]
    assert not any(p.endswith(first) for m, p, _ in hub.requests[before:] if m == "GET")
    same_files(pack, reference)


def test_a_changed_repository_starts_over_and_mixed_files_are_refused(hub, source, tmp_path):
    from app.cli import main
    from packer.errors import PackBuildError

    out = tmp_path / "packs"
    cancel = threading.Event()
    # Cancelled while packing shard 1: nothing journaled, the downloaded shard kept.
    job = ShardPacker(resolve(REPO, PATTERN), out, cancel=cancel, on_step=lambda what, name: cancel.set())
    with pytest.raises(BuildCancelled, match="resume"):
        job.run()
    assert job.shards_packed == [] and job.job.destination(job.shards[0]).is_file()
    cancel.clear()
    job = ShardPacker(resolve(REPO, PATTERN), out, cancel=cancel,
                      on_step=lambda what, name: what == "deleted" and cancel.set())
    with pytest.raises(DownloadCancelled):
        job.run()
    assert job.shards_packed == [split_set_paths(source)[0].name]
    # The hub now serves another revision of shard 3: the partial pack of the old files is discarded.
    name = f"MXFP4_MOE/{split_set_paths(source)[2].name}"
    data = bytearray(hub.files[name])
    data[-1] ^= 1
    hub.files[name] = bytes(data)
    again = ShardPacker(resolve(REPO, PATTERN), out)
    pack = again.run()
    assert again.shards_packed == [p.name for p in split_set_paths(source)]  # shard 1 packed again
    assert main(["verify", str(pack)]) == 0
    with pytest.raises(PackBuildError, match="not one complete model.*--include"):
        ShardPacker(resolve(REPO, "MXFP4_MOE/*-0000[12]-*"), out)


def test_cli_download_with_pack(hub, source, reference, tmp_path, capsys):
    from app.cli import main

    models, out = tmp_path / "models", tmp_path / "packs"
    assert main(["download", REPO, "--include", PATTERN, "--local-dir", str(models), "--pack", str(out)]) == 0
    pack = out / reference.name
    assert str(pack) in capsys.readouterr().out
    same_files(pack, reference)
    assert not any(models.rglob("*.gguf"))  # shards deleted once packed
    assert main(["download", REPO, "--include", "MXFP4_MOE/*-00001-*", "--pack", str(tmp_path / "p2")]) == 2
    assert "not one complete model" in capsys.readouterr().err


def test_full_disk_while_packing_keeps_what_is_packed(hub, source, reference, tmp_path, monkeypatch):
    import errno

    import packer.shard_pack as shard_pack
    from packer.errors import PackBuildError

    out = tmp_path / "packs"
    names = [p.name for p in split_set_paths(source)]
    real = shard_pack._pwrite_all
    packing: list[str] = []

    def full_after_shard_1(fd, data, offset):
        if len(packing) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    job = ShardPacker(resolve(REPO, PATTERN), out, on_step=lambda what, name: what == "downloaded"
                      and packing.append(name))
    monkeypatch.setattr(shard_pack, "_pwrite_all", full_after_shard_1)
    with pytest.raises(PackBuildError, match=f"disk filled up while packing {names[1]}: 1 of 3 shards are packed"):
        job.run()
    monkeypatch.setattr(shard_pack, "_pwrite_all", real)
    before = len(hub.requests)
    again = ShardPacker(resolve(REPO, PATTERN), out)
    same_files(again.run(), reference)
    assert again.shards_packed == names[1:]
    fetched = {p for m, p, _ in hub.requests[before:] if m == "GET" and p.endswith(".gguf")}
    assert fetched == {f"MXFP4_MOE/{names[2]}"}  # shard 2 was kept on disk, shard 1 packed


def test_crashes_between_steps_are_finished_by_a_rerun(hub, source, reference, tmp_path, monkeypatch):
    out = tmp_path / "packs"
    names = [p.name for p in split_set_paths(source)]

    def crash(what: str, name: str) -> None:
        if what == "packed":
            raise KeyboardInterrupt  # killed after journaling shard 1, before deleting it

    with pytest.raises(KeyboardInterrupt):
        ShardPacker(resolve(REPO, PATTERN), out, on_step=crash).run()
    job = ShardPacker(resolve(REPO, PATTERN), out)
    assert job.job.destination(job.shards[0]).is_file()
    # Killed after the manifest was marked complete, before the rename:
    rename = ShardPacker._rename
    monkeypatch.setattr(ShardPacker, "_rename", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        job.run()
    assert job.shards_packed == names[1:]
    assert not job.job.destination(job.shards[0]).exists()  # the packed shard left behind is deleted
    monkeypatch.setattr(ShardPacker, "_rename", rename)
    before = len(hub.requests)
    same_files(ShardPacker(resolve(REPO, PATTERN), out).run(), reference)
    assert not [r for r in hub.requests[before:] if r[1].endswith(".gguf")]  # nothing fetched again


def test_shards_it_did_not_download_are_packed_and_left_alone(hub, reference, tmp_path):
    """A model already in the shared cache (fetched by `hf` or llama.cpp) is packed but
    not deleted: only what this download fetched is its to remove."""
    shard_names = sorted(n for n in hub.files if n.endswith(".gguf"))
    before = [huggingface_hub.hf_hub_download(REPO, name, cache_dir=tmp_path / "hf-cache", endpoint=hub.url)
              for name in shard_names]
    pack = ShardPacker(resolve(REPO, [PATTERN]), tmp_path / "packs").run()
    same_files(pack, reference)
    assert all(os.path.exists(p) for p in before)


def test_links_in_a_local_folder_are_removed_not_followed(hub, reference, tmp_path):
    """With --local-dir, a shard that is a link to the user's own file: the file stays
    (it was not downloaded by this run), and no link is ever followed to delete."""
    mine, local = tmp_path / "my-models", tmp_path / "dl" / "MXFP4_MOE"
    mine.mkdir()
    local.mkdir(parents=True)
    for name, data in hub.files.items():
        if name.endswith(".gguf"):
            (mine / Path(name).name).write_bytes(data)
            (local / Path(name).name).symlink_to(mine / Path(name).name)
    pack = ShardPacker(resolve(REPO, [PATTERN]), tmp_path / "packs", local_dir=tmp_path / "dl").run()
    same_files(pack, reference)
    assert len(list(mine.iterdir())) == 3
