"""`packer.download` and `expertdesk download` against a local mock of the Hugging Face Hub.

The mock (tests/hub_mock.py) serves a tiny split GGUF set with the hub's headers; the
results are checked with huggingface_hub's own cache reader and with the bytes served.
"""

from __future__ import annotations

import hashlib
import threading

import huggingface_hub
import pytest

from hub_mock import MockHub
from pack_fixtures import write_deepseek4
from packer.download import PARTIAL_SUFFIX, DownloadCancelled, DownloadError, HubDownload, resolve
from packer.gguf_source import split_set_paths

REPO = "tester/Tiny-DS4-GGUF"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, bytes]:
    first = write_deepseek4(tmp_path_factory.mktemp("src"), split=3)
    files = {f"MXFP4_MOE/{p.name}": p.read_bytes() for p in split_set_paths(first)}
    files["README.md"] = b"# tiny\n"
    return files


@pytest.fixture
def hub(gguf_files, monkeypatch, tmp_path):
    with MockHub(REPO, dict(gguf_files)) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        # Small transfer chunks, so a cancel or a dropped connection lands mid-file.
        monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
        yield h


def shards(files: dict[str, bytes]) -> list[str]:
    return sorted(p for p in files if p.endswith(".gguf"))


def test_downloads_into_the_standard_cache_that_huggingface_hub_reads(hub, gguf_files, tmp_path):
    plan = resolve(REPO, ["MXFP4_MOE/*.gguf"])
    assert plan.commit == hub.commit and [f.path for f in plan.files] == shards(gguf_files)
    assert all(f.sha256 == hashlib.sha256(gguf_files[f.path]).hexdigest() for f in plan.files)
    paths = HubDownload(plan).run()
    for f, p in zip(plan.files, paths):
        # huggingface_hub's own lookup finds every file, by branch name and by commit.
        cached = huggingface_hub.try_to_load_from_cache(REPO, f.path, cache_dir=tmp_path / "hf-cache")
        assert isinstance(cached, str) and open(cached, "rb").read() == gguf_files[f.path]
        assert p.read_bytes() == gguf_files[f.path]
    info = huggingface_hub.scan_cache_dir(tmp_path / "hf-cache")
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.nb_files == 3
    assert repo.size_on_disk == sum(len(gguf_files[p]) for p in shards(gguf_files))
    assert not any(path == "README.md" for _, path, _ in hub.requests)  # --include honoured


def test_cancel_mid_file_then_resume_with_a_range_request(hub, gguf_files):
    plan = resolve(REPO, "MXFP4_MOE/*.gguf")
    first = plan.files[0]
    cancel = threading.Event()

    def progress(done, total, rate, eta, phase):
        if done >= first.size // 2:
            cancel.set()

    job = HubDownload(plan, progress=progress, cancel=cancel)
    with pytest.raises(DownloadCancelled, match="resume"):
        job.run()
    partial = job._storage(first).with_name(job._storage(first).name + PARTIAL_SUFFIX)
    kept = partial.stat().st_size
    assert 0 < kept < first.size
    before = len(hub.requests)
    # A new run (another process after a reboot, as far as the files know) continues from the partial file.
    paths = HubDownload(resolve(REPO, "MXFP4_MOE/*.gguf")).run()
    assert ("GET", first.path, f"bytes={kept}-") in hub.requests
    assert [p.read_bytes() for p in paths] == [gguf_files[p] for p in shards(gguf_files)]
    # Nothing fetched twice: the new run's responses carry exactly the bytes not kept (counted
    # by request: the cancelled response may still be streaming into the closed connection).
    resumed = sum(hub.served_by_request.get(i, 0) for i in range(before, len(hub.requests)))
    assert resumed == plan.total_bytes - kept


def test_dropped_connection_resumes_within_the_run(hub, gguf_files):
    plan = resolve(REPO, "MXFP4_MOE/*.gguf")
    path = plan.files[1].path
    hub.cut_once[path] = 16384
    paths = HubDownload(plan).run()
    assert paths[1].read_bytes() == gguf_files[path]
    assert ("GET", path, "bytes=16384-") in hub.requests


def test_damaged_in_transit_is_fetched_again(hub, gguf_files):
    plan = resolve(REPO, "MXFP4_MOE/*.gguf")
    path = plan.files[2].path
    hub.corrupt_once.add(path)
    job = HubDownload(plan)
    paths = job.run()
    assert job.refetched == [path]
    assert paths[2].read_bytes() == gguf_files[path]


def test_damaged_on_disk_is_detected_on_rerun_and_fetched_again(hub, gguf_files):
    plan = resolve(REPO, "MXFP4_MOE/*.gguf")
    paths = HubDownload(plan).run()
    blob = paths[0].resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x55
    blob.write_bytes(bytes(data))
    before = len(hub.requests)
    job = HubDownload(plan)
    again = job.run()
    assert job.refetched == [plan.files[0].path]
    assert again[0].read_bytes() == gguf_files[plan.files[0].path]
    fetched = [r for r in hub.requests[before:] if r[0] == "GET"]
    assert [r[1] for r in fetched] == [plan.files[0].path]  # the intact files were not fetched again


def test_full_disk_is_a_clear_error_and_keeps_finished_files(hub, gguf_files):
    plan = resolve(REPO, "MXFP4_MOE/*.gguf")
    calls = []

    def tiny_disk(path):
        calls.append(path)
        return (10**12 if len(calls) == 1 else 1000, 10**12)  # room for the first file only

    with pytest.raises(DownloadError, match="not enough free space for MXFP4_MOE/tiny-ds4-00002.*free space"):
        HubDownload(plan, free_space_fn=tiny_disk).run()
    job = HubDownload(plan)
    assert job.destination(plan.files[0]).read_bytes() == gguf_files[plan.files[0].path]
    before = len(hub.requests)
    job.run()
    assert [r[1] for r in hub.requests[before:] if r[0] == "GET"] == [f.path for f in plan.files[1:]]


def test_token_and_missing_repo(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    HubDownload(resolve(REPO, "README.md")).run()
    assert hub.authorization and all(a == "Bearer hf_testtoken" for a in hub.authorization)
    with pytest.raises(DownloadError, match="404.*check the repository name"):
        resolve("tester/No-Such-Repo")
    with pytest.raises(DownloadError, match="no file matches Q9_K"):
        resolve(REPO, "Q9_K/*")


def test_cli_download_to_a_local_dir(hub, gguf_files, tmp_path, capsys):
    from app.cli import main

    out = tmp_path / "models"
    assert main(["download", REPO, "--include", "MXFP4_MOE/*-00001-*", "--local-dir", str(out)]) == 0
    name = shards(gguf_files)[0]
    assert (out / name).read_bytes() == gguf_files[name]
    assert "SHA-256 verified" in capsys.readouterr().out
    assert main(["download", "tester/nope", "--local-dir", str(out)]) == 2
    assert "404" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../../escape.bin", "/etc/abs.bin", "a/../../x.bin", "a\\..\\x.bin", "a//b.bin"])
def test_a_hostile_listing_cannot_write_outside_the_folder(name, monkeypatch, tmp_path):
    """File names, commits and digests in the hub's listing come from the network (any
    HF_ENDPOINT): one that would leave the download folder is refused before any byte."""
    with MockHub("tester/evil", {name: b"pwned" * 300}) as evil:
        monkeypatch.setenv("HF_ENDPOINT", evil.url)
        with pytest.raises(DownloadError, match="outside the download folder"):
            resolve("tester/evil")
    assert not (tmp_path.parent / "escape.bin").exists()


def test_malformed_ids_and_planted_links_are_refused(tmp_path):
    from packer.download import DownloadPlan, RemoteFile, _checked_plan

    good = RemoteFile("model.gguf", 1, "ab" * 32, "0" * 40)
    with pytest.raises(DownloadError, match="not a 40-hex-digit id"):
        _checked_plan(DownloadPlan("x/y", "main", "../../../../commit", (good,), "http://h"))
    with pytest.raises(DownloadError, match="malformed digest"):
        _checked_plan(DownloadPlan("x/y", "main", "a" * 40, (RemoteFile("m.gguf", 1, "../x", "0" * 40),), "http://h"))
    with pytest.raises(DownloadError, match="not a branch"):
        _checked_plan(DownloadPlan("x/y", "../main", "a" * 40, (good,), "http://h"))
    # A link planted in the target folder must not redirect the write.
    target, elsewhere = tmp_path / "dl", tmp_path / "elsewhere"
    target.mkdir()
    elsewhere.mkdir()
    (target / "sub").symlink_to(elsewhere)
    plan = _checked_plan(DownloadPlan("x/y", "main", "a" * 40, (RemoteFile("sub/m.gguf", 1, "ab" * 32, "0" * 40),),
                                      "http://h"))
    with pytest.raises(DownloadError, match="outside"):
        HubDownload(plan, local_dir=target).destination(plan.files[0])


def test_a_pull_request_revision_is_recorded_like_huggingface_hub(tmp_path):
    from packer.download import DownloadPlan

    HubDownload(DownloadPlan("x/y", "refs/pr/1", "a" * 40, (), "http://unused"), cache_dir=tmp_path).run()
    assert (tmp_path / "models--x--y" / "refs" / "refs" / "pr" / "1").read_text() == "a" * 40
