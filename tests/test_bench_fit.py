"""benchmarks/bench_fit.py's estimate on the demo pack (not the timed measurement): the
release read from the pack is the pack's own geometry (checked against the raw
manifest.json and the files' sizes on disk), the drive bound is the arithmetic of the
bound model, and the compute term says which side limits the speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.demo import DEMO_CACHE_MIB, ensure_demo_pack
from packer.fit import ReadProbe, speed_with_compute

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_fit import estimate  # noqa: E402

MIB = 1 << 20
RATE = 500 * MIB  # a fake drive: the probe's 2 s are not what this tests


@pytest.fixture(scope="module")
def pack(demo_home) -> Path:
    return ensure_demo_pack(demo_home)


@pytest.fixture(scope="module")
def report(pack):
    return estimate(pack, read_probe=ReadProbe(RATE, True, RATE, 1.0, "fake"))


def test_release_is_the_packs_geometry(pack, report):
    raw = json.loads((pack / "manifest.json").read_text())
    release = report.release
    assert (release.moe_layers, release.num_experts, release.top_k) == (
        len(raw["layers"]), raw["num_experts"], raw["expert_used_count"])
    # one aligned read per expert covers its last role; the experts file is exactly those reads
    reads = [-(-(layer["roles"][-1]["offset"] + layer["roles"][-1]["nbytes"]) // 4096) * 4096
             for layer in raw["layers"]]
    assert release.per_token_expert_bytes == raw["expert_used_count"] * sum(reads)
    on_disk = (pack / "experts.bin").stat().st_size - raw["data_start"]
    assert release.expert_bytes == pytest.approx(on_disk, rel=0.05)
    assert release.dense_bytes == (pack / "dense.gguf").stat().st_size
    assert release.pack_bytes == pytest.approx(sum(f.stat().st_size for f in pack.iterdir()), rel=0.05)


def test_drive_bound_is_the_bound_model(report):
    per_token = report.release.per_token_expert_bytes
    f = DEMO_CACHE_MIB * MIB / report.release.expert_bytes
    assert report.cache_vram_bytes == DEMO_CACHE_MIB * MIB and report.host_cache_bytes == 0
    assert report.cache_fraction == pytest.approx(f)
    low, high = report.tokens_per_s
    assert low == pytest.approx(RATE / ((1 - f) * per_token))
    assert high == pytest.approx(RATE / ((1 - f ** (1 / 3)) * per_token))
    assert report.fits_disk  # a 16 MB pack fits any test machine's temp folder


def test_compute_term_names_the_bound(report):
    low, high = report.tokens_per_s
    slow_cpu = speed_with_compute(report, low / 100)  # compute far slower than the reads
    assert slow_cpu.bound == "compute"
    assert slow_cpu.high == pytest.approx(low / 100)
    assert slow_cpu.low == pytest.approx(1 / (100 / low + 1 / low))  # serial: compute then the reads
    fast_gpu = speed_with_compute(report, high * 100)  # compute far faster: the drive limits
    assert fast_gpu.bound == "drive"
    assert fast_gpu.high == pytest.approx(high)
    assert speed_with_compute(report, (low + high) / 2).bound == "mixed"
    with pytest.raises(ValueError, match="positive"):
        speed_with_compute(report, 0)
