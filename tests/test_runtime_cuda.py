"""The CUDA path of the expert cache: exact bytes in VRAM and the stream-ordering rules.

Skipped without a CUDA device (CI); run on a GPU machine. The ordering tests make the
race observable: a GPU sleep delays one stream, so a missing wait would show as
wrong bytes.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.runtime import ExpertCache, ExpertStore
from pack_factory import make_pack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLEEP_CYCLES = 200_000_000  # ~0.1 s on a current GPU: far longer than any copy here


@pytest.fixture
def pack(tmp_path):
    return make_pack(tmp_path / "gpu.expertpack", blocks=(0, 2), num_experts=16, top_k=2)


def open_cache(pack, slots, host_slots=0, **kwargs):
    store = ExpertStore(pack.path, io_threads=4, stage_slots=3)
    stride = pack.manifest.expert_stride
    return ExpertCache(store, device="cuda", cache_bytes=slots * stride, reserve_bytes=0,
                       host_cache_bytes=host_slots * stride, **kwargs)


def slot_bytes(cache, block, expert):
    """The slot's read range, copied on the current stream (ordered after the acquire)."""
    index = cache.slot_of(block, expert)
    n = cache.manifest.layer_for_block(block).read_nbytes
    return cache.buffer[index * cache.stride : index * cache.stride + n].clone()


def test_staging_and_host_tier_are_pinned(pack):
    cache = open_cache(pack, 4, host_slots=4)
    assert cache.store.staging.view(0).is_pinned()
    assert cache.host.view(0).is_pinned()
    assert cache.guesses_after_compute  # on a GPU, guesses read once a layer's experts are queued


@pytest.mark.parametrize("host_slots", [0, 6])
def test_bytes_in_vram_equal_the_source(pack, host_slots):
    cache = open_cache(pack, 4, host_slots=host_slots)
    rng = random.Random(0)
    for _ in range(40):
        block = rng.choice((0, 2))
        experts = rng.sample(range(16), rng.randint(1, 4))
        with cache.acquire(block, experts) as batch:
            for e in experts:
                for role, qt in batch[e].items():
                    assert qt.raw.is_cuda
                    assert bytes(qt.raw.cpu().numpy()) == pack.role_bytes(block, e, role)
    assert cache.telemetry.get("h2d_bytes") > 0


def test_compute_waits_for_the_copy_event(pack):
    """Delay the copy stream; reading the slot right after acquire must still see the new bytes."""
    cache = open_cache(pack, 2)
    with cache.acquire(0, [1]):
        pass
    with torch.cuda.stream(cache._copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the next copy starts only after this
    with cache.acquire(0, [5]):
        seen = slot_bytes(cache, 0, 5)  # queued on the compute stream, no host sync
    torch.cuda.synchronize()
    assert bytes(seen.cpu().numpy()) == pack.block_bytes(0, 5)


def test_a_slot_read_by_queued_compute_is_not_overwritten(pack):
    """Queue slow compute that reads a slot, release, force its eviction: the reader sees the old bytes."""
    cache = open_cache(pack, 2)
    with cache.acquire(2, [3, 4]):
        torch.cuda._sleep(SLEEP_CYCLES)  # compute stream busy...
        seen = slot_bytes(cache, 2, 3)  # ...then reads the slot
    with cache.acquire(2, [7, 8]):  # evicts both slots at once, copies on the copy stream
        pass
    torch.cuda.synchronize()
    assert bytes(seen.cpu().numpy()) == pack.block_bytes(2, 3)
    with cache.acquire(2, [7]) as batch:
        assert bytes(batch[7]["down"].raw.cpu().numpy()) == pack.role_bytes(2, 7, "down")


def test_threads_with_their_own_streams(pack):
    cache = open_cache(pack, 12, host_slots=8)

    def worker(seed):
        rng = random.Random(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(25):
                block = rng.choice((0, 2))
                experts = rng.sample(range(16), 2)
                with cache.acquire(block, experts) as batch:
                    got = {e: batch[e]["gate"].raw.clone() for e in experts}
                stream.synchronize()
                for e in experts:
                    assert bytes(got[e].cpu().numpy()) == pack.role_bytes(block, e, "gate")
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))


@pytest.mark.parametrize("delayed", ["stream", "down_stream"])
def test_an_evicted_expert_moves_down_before_its_slot_is_overwritten(pack, delayed):
    """Delay the copy-up stream, or the copy-down stream (copies down have their own, so
    they do not queue ahead of the copies up), then evict and move the victims straight
    back up: the loads into the victims' slots wait for the copies down (else RAM would
    keep the new bytes), and the copies back up wait for them too (else they would read
    RAM before it was written)."""
    cache = open_cache(pack, 2, host_slots=4)
    assert cache._copier.down_stream is not None and cache._copier.down_stream != cache._copier.stream
    with cache.acquire(0, [1, 2]):
        pass
    with torch.cuda.stream(getattr(cache._copier, delayed)):
        torch.cuda._sleep(SLEEP_CYCLES)
    with cache.acquire(0, [3, 4]):  # evicts 1 and 2 down to RAM, reuses their slots
        seen = {e: slot_bytes(cache, 0, e) for e in (3, 4)}
    assert cache.telemetry.get("host_demotions") == 2 and cache.telemetry.get("d2h_bytes") > 0
    with cache.acquire(0, [1, 2]) as batch:  # straight back up from RAM, no read; 3 and 4 down
        back = {e: batch[e]["gate"].raw.clone() for e in (1, 2)}
    torch.cuda.synchronize()
    assert cache.telemetry.get("reads") == 4 and cache.telemetry.get("host_hits") == 2
    for e in (3, 4):
        assert bytes(seen[e].cpu().numpy()) == pack.block_bytes(0, e)
    for e in (1, 2):
        assert bytes(back[e].cpu().numpy()) == pack.role_bytes(0, e, "gate")
    with cache.acquire(0, [3, 4]) as batch:  # and 3, 4 from RAM: their copies down were exact
        assert cache.telemetry.get("reads") == 4
        for e in (3, 4):
            assert bytes(batch[e]["gate"].raw.cpu().numpy()) == pack.role_bytes(0, e, "gate")


def test_a_copy_down_waits_for_the_copy_that_filled_its_slot(pack):
    """Delay the copy-up stream so the experts' fills are still queued when they are
    evicted: the copies down (another stream) wait for them, and RAM gets the experts."""
    cache = open_cache(pack, 2, host_slots=4)
    with torch.cuda.stream(cache._copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    with cache.acquire(2, [5, 6]):  # fills queued behind the delay
        pass
    with cache.acquire(2, [7, 8]):  # evicts 5 and 6 at once
        pass
    with cache.acquire(2, [5, 6]) as batch:  # back from RAM
        back = {e: batch[e]["down"].raw.clone() for e in (5, 6)}
    torch.cuda.synchronize()
    assert cache.telemetry.get("host_hits") == 2
    for e in (5, 6):
        assert bytes(back[e].cpu().numpy()) == pack.role_bytes(2, e, "down")
