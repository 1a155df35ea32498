"""packer.preflight: real probes where the test machine has them, simulated everything else."""

from __future__ import annotations

import json

import pytest

from pack_fixtures import write_deepseek4
from packer.diskio import GIB, MIB
from packer.gguf_source import GGUFSource
from packer.preflight import (
    GpuInfo,
    ModelSizes,
    ODirectProbe,
    RamInfo,
    model_sizes,
    probe_odirect,
    run_preflight,
    vram_reserve_bytes,
)

# DeepSeek-V4-Flash-like numbers: 147 GB of experts, ~8 GB dense, 13.4 MB per expert, top-6.
DSV4 = ModelSizes("deepseek4", pack_bytes=155 * 10**9, dense_bytes=8 * 10**9, expert_block_bytes=13_369_344,
                  top_k=6, moe_layers=43, num_experts=256)
RTX5090 = GpuInfo("NVIDIA GeForce RTX 5090", free_bytes=31 * GIB, total_bytes=32 * GIB)
DESKTOP_RAM = RamInfo(available_bytes=26 * GIB, total_bytes=32 * GIB)
GOOD_DISK = lambda path: (1800 * 10**9, 2000 * 10**9)  # noqa: E731
GOOD_ODIRECT = lambda path: ODirectProbe(True, True, "ok")  # noqa: E731


def simulated(**kw):
    args = dict(sizes=DSV4, free_space_fn=GOOD_DISK, gpu_fn=lambda: RTX5090, ram_fn=lambda: DESKTOP_RAM,
                odirect_fn=GOOD_ODIRECT)
    args.update(kw)
    return run_preflight("/mnt/ssd/packs", **args)


def test_real_probes_in_tmp(tmp_path):
    src = write_deepseek4(tmp_path / "src")
    probe = probe_odirect(tmp_path)
    report = run_preflight(tmp_path / "packs", src, gpu_fn=lambda: None)
    assert report.check("free_space").status == "pass"
    assert report.check("direct_io").status == ("pass" if probe.works and probe.unaligned_rejected else
                                                 "warn" if probe.works else "fail")
    assert not list(tmp_path.glob(".expertdesk-odirect-*")), "the probe file is removed"
    data = json.loads(report.to_json())
    assert data["measurements"]["model"]["architecture"] == "deepseek4"
    assert {c["name"] for c in data["checks"]} == {"direct_io", "free_space", "vram", "ram"}
    with GGUFSource.open(src) as opened:  # a GGUFSource works as well as a path
        assert model_sizes(opened) == model_sizes(src)


def test_everything_fine_on_a_5090_desktop():
    r = simulated()
    assert r.ok and all(c.status == "pass" for c in r.checks), r.checks
    rec = r.recommended
    assert rec["cache_vram_reserve_mib"] == 2048  # what the seed used on this card
    # Whole experts only, after dense weights and the reserve.
    assert rec["cache_vram_mib"] * MIB <= RTX5090.free_bytes - DSV4.dense_bytes - 2048 * MIB
    assert (rec["cache_vram_mib"] * MIB
            > RTX5090.free_bytes - DSV4.dense_bytes - 2048 * MIB - DSV4.expert_block_bytes - MIB)
    # Host tier: leaves the OS room and never more than what is available.
    assert 0 < rec["host_cache_mib"] * MIB < DESKTOP_RAM.available_bytes - 4 * GIB
    assert "RTX 5090" in r.check("vram").reason


def test_requested_cache_is_a_ceiling():
    assert simulated(requested_cache_mib=5120).recommended["cache_vram_mib"] == 5120


def test_no_odirect():
    r = simulated(odirect_fn=lambda path: ODirectProbe(False, None,
                                                       "the filesystem refused to open a file with O_DIRECT"))
    c = r.check("direct_io")
    assert c.status == "fail" and not r.ok
    assert "refused" in c.reason and "ext4" in c.fix


def test_odirect_silently_buffered():
    c = simulated(odirect_fn=lambda path: ODirectProbe(True, False, "ok")).check("direct_io")
    assert c.status == "warn" and "silently buffers" in c.reason


def test_full_disk():
    r = simulated(free_space_fn=lambda path: (100 * 10**9, 2000 * 10**9))
    c = r.check("free_space")
    assert c.status == "fail" and not r.ok
    assert "155.0 GB" in c.reason and "100.0 GB free" in c.reason
    assert "another drive" in c.fix
    # The margin counts: exactly the pack size is not enough.
    assert simulated(free_space_fn=lambda path: (DSV4.pack_bytes, 10**13)).check("free_space").status == "fail"


def test_no_gpu():
    r = simulated(gpu_fn=lambda: None)
    c = r.check("vram")
    assert c.status == "warn" and c.reason == "no CUDA GPU found: the app will run on the CPU, slowly"
    assert r.ok
    assert r.recommended["cache_vram_mib"] == 0
    # On the CPU the dense weights live in RAM too, so less is left for the host tier.
    assert r.recommended["host_cache_mib"] < simulated().recommended["host_cache_mib"]


def test_vram_too_small_for_dense_plus_working_set():
    small = GpuInfo("Small GPU", free_bytes=9 * 10**9, total_bytes=10 * GIB)  # < 8 GB dense + 1 GiB + 80 MB
    c = simulated(gpu_fn=lambda: small).check("vram")
    assert c.status == "fail" and "top-6" in c.reason and "reserve" in c.reason


def test_vram_enough_to_start_but_cache_tiny():
    mid = GpuInfo("Mid GPU", free_bytes=11 * GIB, total_bytes=12 * GIB)
    c = simulated(gpu_fn=lambda: mid).check("vram")
    assert c.status == "warn" and "stream from the SSD" in c.reason


def test_low_ram():
    r = simulated(ram_fn=lambda: RamInfo(3 * GIB, 8 * GIB))
    assert r.check("ram").status == "warn" and r.recommended["host_cache_mib"] == 0
    r = simulated(ram_fn=lambda: RamInfo(3 * GIB, 8 * GIB), gpu_fn=lambda: None)
    assert r.check("ram").status == "fail"


def test_without_source_sizes():
    r = run_preflight("/x", gpu_fn=lambda: None, ram_fn=lambda: DESKTOP_RAM, odirect_fn=GOOD_ODIRECT,
                      free_space_fn=GOOD_DISK)
    assert r.check("free_space").status == "warn" and "unknown" in r.check("free_space").reason


@pytest.mark.parametrize("total,reserve_mib", [(8 * GIB, 1024), (24 * GIB, 1536), (32 * GIB, 2048), (80 * GIB, 5120)])
def test_reserve_scales_with_the_card(total, reserve_mib):
    assert vram_reserve_bytes(total) == reserve_mib * MIB
