"""packer.fit and `expertdesk fit`: the catalogue, the drive probe and the tokens/s estimate."""

from __future__ import annotations

import json

import pytest

from engine.resources import resource_path
from packer.diskio import GIB, MIB
from packer.fit import (
    CatalogError,
    ReadProbe,
    estimate_fit,
    find_release,
    load_catalog,
    probe_read_speed,
)
from packer.preflight import GpuInfo, ODirectProbe, RamInfo

RATE = 7e9  # a PCIe 4 drive


@pytest.fixture(scope="module")
def releases():
    return load_catalog(resource_path("catalog.json"))


def pc(free_bytes: int):
    """Probes of a 32 GB-GPU, 64 GB-RAM PC with `free_bytes` free on the target drive."""
    return {
        "read_probe": ReadProbe(RATE, True, int(RATE * 2), 2.0, "O_DIRECT reads"),
        "free_space_fn": lambda path: (free_bytes, 4 * free_bytes),
        "gpu_fn": lambda: GpuInfo("RTX 5090", 31 * GIB, 32 * GIB),
        "ram_fn": lambda: RamInfo(56 * GIB, 64 * GIB),
        "odirect_fn": lambda path: ODirectProbe(True, True, "ok"),
    }


def test_catalogue_is_consistent(releases):
    ids = {r.id for r in releases}
    assert {"deepseek-v4-flash-mxfp4", "kimi-k3-q2_k"} <= ids
    for r in releases:
        assert r.per_token_expert_bytes == r.moe_layers * r.top_k * r.expert_block_bytes
        assert r.expert_block_bytes % 4096 == 0
        # The catalogue's rounded expert total agrees with the block geometry to 0.1%.
        assert r.expert_bytes == pytest.approx(r.source_bytes - r.dense_bytes, rel=1e-3)
    assert find_release(releases, "UNSLOTH/Kimi-K3-GGUF").id == "kimi-k3-q2_k"
    with pytest.raises(CatalogError, match="choose one of: deepseek"):
        find_release(releases, "llama-9")


def test_damaged_catalogue_says_so(tmp_path):
    bad = tmp_path / "catalog.json"
    bad.write_text('{"releases": [{"id": 1}]}')
    with pytest.raises(CatalogError, match="damaged"):
        load_catalog(bad)


def test_estimate_follows_the_drive_bound(releases, tmp_path):
    ds = find_release(releases, "deepseek-v4-flash-mxfp4")
    fit = estimate_fit(ds, tmp_path, **pc(400 * 10**9))
    # Cache sizes are preflight's recommendations for this PC.
    rec = fit.preflight.recommended
    assert fit.cache_vram_bytes == rec["cache_vram_mib"] * MIB > 0
    assert fit.host_cache_bytes == rec["host_cache_mib"] * MIB > 0
    f = (fit.cache_vram_bytes + fit.host_cache_bytes) / (ds.moe_layers * ds.num_experts * ds.expert_block_bytes)
    low, high = fit.tokens_per_s
    assert low == pytest.approx(RATE / ((1 - f) * ds.per_token_expert_bytes))
    assert high == pytest.approx(RATE / ((1 - f ** (1 / 3)) * ds.per_token_expert_bytes))
    assert 0.5 < low < high < 100
    assert fit.fits_disk and fit.ok
    assert fit.disk_needed_streaming < fit.disk_needed_full
    text = "\n".join(fit.lines())
    assert f"{low:.2f} to {high:.2f} tokens/s" in text
    d = fit.to_dict()
    assert json.loads(json.dumps(d))["decode_tokens_per_s_range"] == [low, high]


def test_kimi_on_a_small_disk_does_not_fit(releases, tmp_path):
    k3 = find_release(releases, "kimi-k3-q2_k")
    fit = estimate_fit(k3, tmp_path, **pc(500 * 10**9))
    assert not fit.fits_disk and not fit.ok
    # pack + one shard + preflight's 5% margin, not pack + the whole 1 TB source.
    assert fit.disk_needed_streaming == k3.pack_bytes + k3.shard_bytes + k3.pack_bytes // 20
    assert fit.disk_needed_full == k3.pack_bytes + k3.source_bytes + k3.pack_bytes // 20
    assert "does NOT fit" in "\n".join(fit.lines())
    # Slower than DeepSeek on the same PC: five times the bytes per token, a smaller share cached.
    ds_fit = estimate_fit(find_release(releases, "deepseek-v4-flash-mxfp4"), tmp_path, **pc(500 * 10**9))
    assert fit.tokens_per_s[1] < ds_fit.tokens_per_s[1]


def test_read_probe_measures_and_cleans_up(tmp_path):
    probe = probe_read_speed(tmp_path, seconds=0.3, file_bytes=8 * MIB, block_bytes=MIB, threads=2)
    assert probe.bytes_read >= MIB and probe.bytes_read % MIB == 0
    assert probe.bytes_per_s == pytest.approx(probe.bytes_read / probe.seconds)
    assert 0.25 < probe.seconds < 5
    assert list(tmp_path.iterdir()) == []


def test_cli_fit_json(tmp_path, capsys):
    from app.cli import main

    code = main(["fit", "deepseek-v4-flash-mxfp4", "--dir", str(tmp_path), "--json", "--probe-seconds", "0.2",
                 "--probe-mib", "8"])
    (report,) = json.loads(capsys.readouterr().out)
    assert code == (0 if report["ok"] else 1)
    assert report["read_probe"]["bytes_per_s"] > 0
    assert report["release"]["repo"] == "unsloth/DeepSeek-V4-Flash-GGUF"
    assert main(["fit", "nope", "--dir", str(tmp_path)]) == 2
    assert "choose one of" in capsys.readouterr().err
