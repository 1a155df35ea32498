"""ExpertCache: exact delivery, protection, capacity rules, host tier, errors, threads."""

from __future__ import annotations

import errno
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import memory
from engine.runtime import (
    AccessTrace,
    CacheCapacityError,
    ExpertCache,
    ExpertReadError,
    ExpertStore,
    RuntimeStartError,
)
from engine.runtime import host_tier as host_tier_mod
from engine.runtime.cache import MIB
from pack_factory import fail_first_read, make_pack

BLOCKS = (1, 3)


@pytest.fixture
def pack(tmp_path):
    return make_pack(tmp_path / "tiny.expertpack", blocks=BLOCKS, num_experts=8, top_k=2)


def open_cache(pack, slots, *, host_slots=0, direct_io=True, **kwargs):
    store = ExpertStore(pack.path, direct_io=direct_io, io_threads=4, stage_slots=3)
    stride = pack.manifest.expert_stride
    return ExpertCache(store, device="cpu", cache_bytes=slots * stride, reserve_bytes=0,
                       host_cache_bytes=host_slots * stride, **kwargs)


def assert_exact(pack, batch, block, experts):
    for e in experts:
        weights = batch[e]
        layer = pack.manifest.layer_for_block(block)
        assert list(weights) == [r.name for r in layer.roles]
        for role in layer.roles:
            qt = weights[role.name]
            assert qt.ggml_type == role.ggml_type and qt.shape == role.shape
            assert qt.raw.dtype == torch.uint8 and qt.raw.dim() == 1 and qt.raw.device.type == "cpu"
            assert bytes(qt.raw.numpy()) == pack.role_bytes(block, e, role.name), (block, e, role.name)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("host_slots", [0, 5])
def test_every_acquired_expert_equals_the_source_bytes(pack, direct_io, host_slots):
    cache = open_cache(pack, 4, host_slots=host_slots, direct_io=direct_io)
    rng = random.Random(1)
    for _ in range(60):
        block = rng.choice(BLOCKS)
        experts = [rng.randrange(8) for _ in range(rng.randint(1, 4))]
        with cache.acquire(block, experts) as batch:
            assert batch.expert_ids == tuple(dict.fromkeys(experts))
            assert_exact(pack, batch, block, experts)
    snap = cache.telemetry.snapshot()
    assert snap["cache_hits"] > 0 and snap["cache_evictions"] > 0
    assert snap["io_errors"] == 0 and snap["fallback_count"] == 0
    assert snap["buffered_reads"] == (0 if direct_io else snap["reads"])
    if host_slots:
        assert snap["host_hits"] > 0
    cache.store.close()


def test_hits_and_misses_count_unique_keys_per_acquire(pack):
    cache = open_cache(pack, 4)
    with cache.acquire(1, [2, 2, 5, 2]):
        pass
    with cache.acquire(1, torch.tensor([[5, 2], [2, 5]])):  # router output as a tensor
        pass
    with cache.acquire(3, [2]):
        pass
    snap = cache.telemetry.snapshot()
    assert (snap["cache_hits"], snap["cache_misses"], snap["acquires"]) == (2, 3, 3)
    assert snap["layers"] == {"1": {"hits": 2, "misses": 2}, "3": {"hits": 0, "misses": 1}}
    assert snap["h2d_bytes"] == 3 * pack.manifest.layers[0].read_nbytes
    assert snap["slot_count"] == 4 and snap["slots_used"] == 3


def test_unknown_block_and_bad_ids_are_errors(pack):
    cache = open_cache(pack, 4)
    with pytest.raises(KeyError, match="blk.2 has no routed experts"):
        cache.acquire(2, [0])
    with pytest.raises(IndexError, match=r"\[8\] out of range 0..7"):
        cache.acquire(1, [0, 8])
    with cache.acquire(1, [0]) as batch:
        with pytest.raises(KeyError, match="expert 1 was not acquired"):
            batch[1]
    with pytest.raises(RuntimeError, match="after it was released"):
        batch[0]


# Sizing ---------------------------------------------------------------------------------
def test_slot_count_follows_the_budget_formula(pack, monkeypatch):
    stride = pack.manifest.expert_stride
    store = ExpertStore(pack.path)
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 20 * stride + 123)
    # The budget limits: floor(min(7.5 slots, 20 slots + 123 - 2 slots) / stride) = 7
    cache = ExpertCache(store, cache_bytes=7 * stride + stride // 2, reserve_bytes=2 * stride)
    assert cache.slot_count == 7 and cache.buffer.numel() == 7 * stride
    # Free memory limits: min(100 slots, 20 slots + 123 - 15 slots) = 5 slots + 123 bytes -> 5
    cache = ExpertCache(store, cache_bytes=100 * stride, reserve_bytes=15 * stride)
    assert cache.slot_count == 5
    assert cache.telemetry.get("slot_count") == 5
    store.close()


def test_a_cache_below_one_layers_top_k_is_refused(pack, monkeypatch):
    stride = pack.manifest.expert_stride
    store = ExpertStore(pack.path)
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 1 << 40)
    with pytest.raises(RuntimeStartError) as exc:
        ExpertCache(store, cache_bytes=stride * 2 - 1, reserve_bytes=0)  # top-k is 2
    message = str(exc.value)
    assert "holds 1 experts but one MoE layer uses 2 at once" in message
    assert f"raise cache_vram_mib to at least {-(-2 * stride // MIB)}" in message
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 3 * stride)
    with pytest.raises(RuntimeStartError, match="lower cache_vram_reserve_mib"):
        ExpertCache(store, cache_bytes=100 * stride, reserve_bytes=2 * stride)
    assert ExpertCache(store, cache_bytes=2 * stride, reserve_bytes=0).slot_count == 2
    store.close()


# Protection and capacity ------------------------------------------------------------------
def test_protected_experts_survive_pressure(pack):
    cache = open_cache(pack, 4)
    with cache.acquire(1, [0, 1]) as a:
        slots_a = {e: cache.slot_of(1, e) for e in (0, 1)}
        for round_ in range(5):  # layer B churns through the 2 other slots
            experts = [2 * round_ % 8, (2 * round_ + 1) % 8]
            with cache.acquire(3, experts) as b:
                assert_exact(pack, b, 3, experts)
            assert {e: cache.slot_of(1, e) for e in (0, 1)} == slots_a
            assert_exact(pack, a, 1, [0, 1])  # A's bytes untouched
        assert cache.telemetry.get("cache_evictions") >= 6
        # Protected + requested > slots: refused with the numbers, nothing changed.
        assert cache.max_experts_per_acquire == 2
        resident_before = cache.resident_count()
        with pytest.raises(CacheCapacityError, match="at most 2 per acquire.*acquire_chunks") as exc:
            cache.acquire(3, [4, 5, 6])
        assert exc.value.max_experts == 2 and exc.value.requested == 3
        assert cache.resident_count() == resident_before
        assert_exact(pack, a, 1, [0, 1])
        # The same request in chunks works while A is still protected.
        seen = []
        for chunk in cache.acquire_chunks(3, [4, 5, 6, 4]):
            with chunk:
                assert len(chunk) <= 2
                assert_exact(pack, chunk, 3, chunk.expert_ids)
                seen.extend(chunk.expert_ids)
        assert sorted(seen) == [4, 5, 6]
        assert_exact(pack, a, 1, [0, 1])
    assert cache.max_experts_per_acquire == 4


def test_several_batches_alive_at_once(pack):
    cache = open_cache(pack, 6)
    with cache.acquire(1, [0, 1]) as a, cache.acquire(3, [0, 1]) as b, cache.acquire(1, [1, 2]) as c:
        assert cache.max_experts_per_acquire == 1  # 5 distinct experts protected
        assert_exact(pack, a, 1, [0, 1])
        assert_exact(pack, b, 3, [0, 1])
        assert_exact(pack, c, 1, [1, 2])
        with pytest.raises(CacheCapacityError):
            cache.acquire(3, [5, 6])
    assert cache.max_experts_per_acquire == 6


def test_prefill_chunks_deliver_every_expert_once_resident_first(pack):
    cache = open_cache(pack, 3)
    with cache.acquire(1, [6, 7]):
        pass
    delivered = []
    for batch in cache.acquire_chunks(1, list(range(8)) * 2):
        with batch:
            assert len(batch) <= 3
            assert_exact(pack, batch, 1, batch.expert_ids)
            delivered.append(batch.expert_ids)
    flat = [e for ids in delivered for e in ids]
    assert sorted(flat) == list(range(8))
    assert set(delivered[0]) >= {6, 7}  # already resident: first, before later chunks evict them
    assert cache.max_experts_per_acquire == 3
    with pytest.raises(ValueError, match="max_per_chunk"):
        next(iter(cache.acquire_chunks(1, [0], max_per_chunk=0)))


# Host tier ----------------------------------------------------------------------------------
def test_host_tier_serves_device_misses_without_rereading(pack):
    # 8 distinct experts cycle through 2 VRAM slots + 8 RAM slots. The tiers are
    # EXCLUSIVE (VRAM victims copied down, RAM hits moved up): RAM ends holding the 6
    # experts VRAM does not, never a copy of one it does. (2 RAM slots stay free for
    # the swaps: a slot an expert moves up from is reusable once that copy is queued.)
    cache = open_cache(pack, 2, host_slots=8)
    for block in BLOCKS * 3:
        for pair in ([0, 1], [2, 3]):
            with cache.acquire(block, pair) as batch:
                assert_exact(pack, batch, block, pair)
            in_vram = set(cache._where)
            assert not in_vram & cache.host.resident_keys()  # never the same expert twice
    snap = cache.telemetry.snapshot()
    assert snap["reads"] == 8  # each expert read once; the rest came from RAM
    assert snap["host_hits"] == snap["cache_misses"] - 8
    assert snap["host_demotions"] == snap["cache_evictions"]
    assert snap["host_bytes_used"] == 6 * pack.manifest.expert_stride
    assert snap["host_bytes_budget"] == 8 * pack.manifest.expert_stride


@pytest.mark.parametrize("streaming", [False, True])
def test_an_acquire_submits_its_reads_before_copying_its_victims_down(pack, streaming):
    """The drive starts first: every SSD read of an acquire is submitted before the copies
    that demote its victims (each as costly for the host as a submit), and those copies
    come before any copy up into a slot (which may be a victim's), in the order the
    reads will fill the slots (each load waits for its own slot's copy down)."""
    cache = open_cache(pack, 3, host_slots=4)
    with cache.acquire(1, [0, 1, 2]):
        pass
    calls: list[str] = []
    read_experts: list[int] = []
    down_slots: list[int] = []
    submit, copy, copy_down = cache.store.submit, cache._copier.copy, cache._copier.copy_down

    def recording_submit(layer_index, expert, buffer, **kwargs):
        calls.append("read")
        read_experts.append(expert)
        return submit(layer_index, expert, buffer, **kwargs)

    def recording_copy(dst, src, after=()):
        calls.append("up")
        return copy(dst, src, after)

    def recording_copy_down(dst, src, after=()):
        calls.append("down")
        down_slots.append((src.data_ptr() - cache.buffer.data_ptr()) // cache.stride)
        return copy_down(dst, src, after)

    cache.store.submit = recording_submit
    cache._copier.copy, cache._copier.copy_down = recording_copy, recording_copy_down
    batch = (cache.acquire_streaming if streaming else cache.acquire)(1, [3, 4, 5])  # every slot's expert evicted
    with batch:
        if streaming:
            for _ in batch:
                pass
        assert_exact(pack, batch, 1, [3, 4, 5])
    assert calls.count("read") == 3 and calls.count("down") == 3 and calls.count("up") == 3, calls
    assert calls.index("down") > max(i for i, c in enumerate(calls) if c == "read"), calls
    assert max(i for i, c in enumerate(calls) if c == "down") < calls.index("up"), calls
    assert down_slots == [cache.slot_of(1, e) for e in read_experts]  # the order the reads fill them
    assert set(cache.host.resident_keys()) == {(0, 0), (0, 1), (0, 2)}  # the victims, demoted


def test_experts_moved_between_tiers_keep_their_bytes(pack):
    # Round trips VRAM -> RAM -> VRAM many times over (1 spare VRAM slot), each checked.
    cache = open_cache(pack, 3, host_slots=3)
    rng = random.Random(5)
    for _ in range(60):
        block = rng.choice(BLOCKS)
        experts = rng.sample(range(pack.manifest.num_experts), 2)
        with cache.acquire(block, experts) as batch:
            assert_exact(pack, batch, block, experts)
    snap = cache.telemetry.snapshot()
    assert snap["host_hits"] > 10 and snap["host_demotions"] > 10


def test_host_tier_is_clamped_to_available_ram(pack, monkeypatch, caplog):
    stride = pack.manifest.expert_stride
    monkeypatch.setattr(host_tier_mod.memory, "available_ram", lambda: 10 * stride + 5)
    monkeypatch.setattr(host_tier_mod.memory, "host_safety_margin", lambda: 4 * stride)
    with caplog.at_level("WARNING"):
        cache = open_cache(pack, 2, host_slots=100)
    assert cache.host.count == 6
    snap = cache.telemetry.snapshot()
    assert snap["host_bytes_budget"] == 6 * stride and snap["host_bytes_requested"] == 100 * stride
    assert "host expert cache clamped" in caplog.text and "never swaps" in caplog.text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    device_slots=st.integers(2, 5),
    host_slots=st.integers(0, 6),
    requests=st.lists(st.tuples(st.sampled_from(BLOCKS), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
                      min_size=1, max_size=25),
)
def test_host_tier_never_exceeds_its_budget(shared_pack, device_slots, host_slots, requests):
    stride = shared_pack.manifest.expert_stride
    cache = open_cache(shared_pack, device_slots, host_slots=host_slots)
    budget = host_slots * stride
    assert cache.host.slab.nbytes <= budget
    for block, experts in requests:
        for batch in cache.acquire_chunks(block, experts):
            with batch:
                assert_exact(shared_pack, batch, block, batch.expert_ids)
        snap = cache.telemetry.snapshot()
        assert snap["host_bytes_used"] <= snap["host_bytes_budget"] <= budget
        assert cache.host.used_bytes() <= budget
        assert cache.resident_count() <= device_slots
    cache.store.close()


@pytest.fixture(scope="module")
def shared_pack(tmp_path_factory):
    return make_pack(tmp_path_factory.mktemp("shared") / "tiny.expertpack", blocks=BLOCKS, num_experts=8, top_k=2)


# Errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("host_slots", [0, 4])
def test_a_failed_read_raises_and_the_cache_stays_usable(pack, monkeypatch, host_slots):
    cache = open_cache(pack, 4, host_slots=host_slots)
    with cache.acquire(1, [0]):
        pass
    fail_first_read(monkeypatch)
    with pytest.raises(ExpertReadError, match="I/O error reading expert"):
        cache.acquire(1, [0, 3, 4])
    assert cache.telemetry.get("io_errors") == 1
    assert cache.max_experts_per_acquire == 4  # no slot left pinned
    assert cache.store.staging.free_count == cache.store.staging.count
    with cache.acquire(1, [0, 3, 4]) as batch:  # retried: exact bytes
        assert_exact(pack, batch, 1, [0, 3, 4])
    assert cache.telemetry.get("io_errors") == 1


def test_a_vanished_drive_gives_a_clear_error(pack, monkeypatch):
    cache = open_cache(pack, 4)

    def gone(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(os, "preadv", gone)
    with pytest.raises(ExpertReadError, match="disconnected or the file removed; reconnect it"):
        cache.acquire(3, [1, 2])
    assert cache.resident_count() == 0 and cache.max_experts_per_acquire == 4


# Concurrency ---------------------------------------------------------------------------------
def test_concurrent_acquires_from_threads_stay_consistent(tmp_path):
    pack = make_pack(tmp_path / "wide.expertpack", blocks=(0, 1, 2), num_experts=24, top_k=3)
    stride = pack.manifest.expert_stride
    store = ExpertStore(pack.path, io_threads=6, stage_slots=4, read_splits=2)
    cache = ExpertCache(store, cache_bytes=30 * stride, reserve_bytes=0, host_cache_bytes=12 * stride,
                        trace=AccessTrace())

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(40):
            block = rng.randrange(3)
            experts = rng.sample(range(24), 3)
            with cache.acquire(block, experts) as batch:
                assert_exact(pack, batch, block, experts)
        return True

    with ThreadPoolExecutor(8) as pool:  # at most 8 x 3 = 24 protected of 30 slots
        assert all(pool.map(worker, range(8)))
    snap = cache.telemetry.snapshot()
    assert snap["acquires"] == 320 and len(cache.trace) == 320
    assert snap["cache_hits"] + snap["cache_misses"] == 960
    assert snap["io_errors"] == 0
    assert cache.max_experts_per_acquire == 30
    assert store.staging.free_count == store.staging.count
    store.close()


def test_trace_hook_records_each_acquire(pack):
    trace = AccessTrace()
    cache = open_cache(pack, 4, trace=trace)
    with cache.acquire(1, [3, 3, 1]):
        pass
    trace.next_step()
    with cache.acquire(3, [0]):
        pass
    assert list(trace.acquires()) == [(0, 1, (3, 1)), (1, 3, (0,))]
