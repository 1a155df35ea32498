"""The speed levers of ExpertCache stay lossless: acquire_streaming, prefetch, seed mode.

Each lever may change when bytes arrive, never which bytes a consumer sees or which
experts stay protected: experts are byte-identical to the pack, protected experts are
never evicted, hits/misses are counted as for a plain acquire, and a fixed-order sum
over streamed experts is bit-identical to the sum after a plain acquire.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from engine.experts import TokensByExpert, accumulate_routed
from engine.runtime import ExpertCache, ExpertReadError, ExpertStore, StreamingBatch
from pack_factory import GatedReads, fail_first_read, make_pack, role_spec

BLOCKS = (1, 3, 5)
E = 12


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    roles = (role_spec("gate", 32, 64), role_spec("up", 32, 64), role_spec("down", 64, 32))
    return make_pack(tmp_path_factory.mktemp("levers") / "levers.expertpack", blocks=BLOCKS, num_experts=E, top_k=3,
                     roles=roles)


def open_cache(pack, slots, *, host_slots=0, stage=4, **kwargs):
    kwargs.setdefault("speculative_reads", None)  # most tests here are about guesses that read the SSD
    store = ExpertStore(pack.path, io_threads=4, stage_slots=stage, read_splits=2)
    stride = pack.manifest.expert_stride
    return ExpertCache(store, device="cpu", cache_bytes=slots * stride, reserve_bytes=0,
                       host_cache_bytes=host_slots * stride, **kwargs)


def close(cache):
    cache.close()
    cache.store.close()


def assert_exact(pack, weights, block, expert):
    layer = pack.manifest.layer_for_block(block)
    assert list(weights) == [r.name for r in layer.roles]
    for role in layer.roles:
        assert bytes(weights[role.name].raw.numpy()) == pack.role_bytes(block, expert, role.name), (block, expert)


def counters(cache):
    snap = cache.telemetry.snapshot()
    return {k: snap[k] for k in ("acquires", "cache_hits", "cache_misses", "cache_evictions", "reads")}


def wait_for(condition, timeout=10.0):
    """Poll `condition` until true (the prefetch pump runs on its own thread); fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def requests(seed, n=40, k=3):
    rng = random.Random(seed)
    return [(rng.choice(BLOCKS), rng.sample(range(E), rng.randint(1, k))) for _ in range(n)]


# acquire_streaming ---------------------------------------------------------------------------
@pytest.mark.parametrize("host_slots", [0, 6])
@pytest.mark.parametrize("pipeline_h2d", [True, False])
def test_streaming_delivers_every_expert_exactly_once_byte_identical(pack, host_slots, pipeline_h2d):
    cache = open_cache(pack, 6, host_slots=host_slots, pipeline_h2d=pipeline_h2d)
    try:
        for block, experts in requests(1):
            with cache.acquire_streaming(block, experts + experts[:1]) as batch:  # duplicates are fine
                assert isinstance(batch, StreamingBatch)
                seen = []
                for e, weights in batch:
                    assert_exact(pack, weights, block, e)
                    assert_exact(pack, batch[e], block, e)  # indexing works once delivered
                    seen.append(e)
                assert sorted(seen) == sorted(experts)
            assert cache._pinned == 0
    finally:
        close(cache)


def test_streaming_yields_resident_experts_before_misses(pack):
    cache = open_cache(pack, 6)
    try:
        with cache.acquire(1, [4, 7]):
            pass
        with cache.acquire_streaming(1, [2, 7, 9, 4]) as batch:
            order = [e for e, _w in batch]
        assert order[:2] == [7, 4] and sorted(order[2:]) == [2, 9]
    finally:
        close(cache)


def test_a_streaming_batch_submits_its_reads_before_anything_else(pack, monkeypatch):
    """The reads go out first: by the time the first resident expert is delivered (or
    `start` returns, before the next layer's guess is queued) every miss was submitted.
    A batch released after `start` without being iterated gives everything back."""
    cache = open_cache(pack, 8, stage=4)
    submits: list[tuple[int, int]] = []
    real = cache.store.submit

    def recording(layer_index, expert, buffer, **kwargs):
        submits.append((layer_index, expert))
        return real(layer_index, expert, buffer, **kwargs)

    try:
        with cache.acquire(1, [4, 7]):
            pass
        monkeypatch.setattr(cache.store, "submit", recording)
        with cache.acquire_streaming(1, [2, 7, 9, 4]) as batch:
            delivery = iter(batch)
            first, weights = next(delivery)
            assert first == 7 and sorted(submits) == [(0, 2), (0, 9)]  # resident, after both reads went out
            assert_exact(pack, weights, 1, 7)
            assert sorted(e for e, _w in delivery) == [2, 4, 9]
        with cache.acquire_streaming(3, [1, 2, 3]) as batch:
            batch.start()
            assert sorted(submits[2:]) == [(1, 1), (1, 2), (1, 3)] and cache._demand_pending == 0
            batch.start()  # once
            assert len(submits) == 5
        staging = cache.store.staging
        wait_for(lambda: staging.free_count == staging.count)
        with cache._cond:
            assert all(s.state != "loading" for s in cache._slots) and cache._pinned == 0
        with cache.acquire(3, [1, 2, 3]) as batch:  # whatever the released batch left is exact
            for e in (1, 2, 3):
                assert_exact(pack, batch[e], 3, e)
    finally:
        close(cache)


def test_an_acquire_hurries_the_prefetch_read_it_waits_for(pack, monkeypatch):
    """A prefetch read is held back while an acquire's read is in flight (the store's
    `later_after_urgent`); an acquire that then needs that expert promotes the read, which
    starts at once instead of after every urgent read."""
    from engine.runtime import store as store_mod

    monkeypatch.setattr(store_mod, "LATER_HOLD_S", 60.0)
    cache = open_cache(pack, 8)
    reads = GatedReads(monkeypatch)
    begin = pack.manifest.block_offset(1, 5)
    wanted = range(begin, begin + pack.manifest.expert_stride)  # expert 5 of blk.3

    def started_wanted(offsets):
        return any(o in wanted for o in offsets)

    try:
        batch = cache.acquire_streaming(1, [0])
        batch.start()  # its (urgent) sub-reads wait at the gate
        reads.wait_started(2)
        cache.prefetch(3, [5])  # exact: reads at once, but held back by the store
        wait_for(lambda: cache.telemetry.get("prefetch_issued") == 1)
        time.sleep(0.05)
        assert not started_wanted(reads.wait_started(2))
        result = {}
        waiter = threading.Thread(target=lambda: result.update(batch=cache.acquire(3, [5])))
        waiter.start()
        reads.wait_started(condition=started_wanted)  # promoted: starts while the first read is at the gate
        reads.gate.set()
        waiter.join(10)
        with result["batch"] as hurried:
            assert_exact(pack, hurried[5], 3, 5)
        with batch:
            batch.settle()
            assert_exact(pack, batch[0], 1, 0)
    finally:
        reads.gate.set()
        close(cache)


def test_prompt_chunks_through_a_small_cache_compute_each_expert_as_its_read_lands(pack, monkeypatch):
    """More distinct experts than slots (a prompt through a small cache): with `streaming`
    each batch of `acquire_chunks` hands out its experts as their reads land, so the
    experts before a slow read compute while it is still on the drive. Every expert once,
    the resident one first, with its exact bytes."""
    cache = open_cache(pack, 3)
    begin = pack.manifest.block_offset(0, 1)  # expert 1 of blk.1: its reads wait for `slow_done`
    slow = range(begin, begin + pack.manifest.expert_stride)
    slow_done = threading.Event()
    real = os.preadv

    def read(fd, buffers, offset, *args):
        if offset in slow:
            assert slow_done.wait(10)
        return real(fd, buffers, offset, *args)

    try:
        with cache.acquire(1, [6]):
            pass
        monkeypatch.setattr(os, "preadv", read)
        delivered = []
        for batch in cache.acquire_chunks(1, list(range(8)) * 2, streaming=True):
            with batch:
                assert isinstance(batch, StreamingBatch) and len(batch) <= 3
                for expert, weights in batch:
                    assert_exact(pack, weights, 1, expert)
                    delivered.append((expert, slow_done.is_set()))
                    if expert == 0:  # landed while expert 1's read is still held: computed meanwhile
                        slow_done.set()
        assert delivered[:3] == [(6, False), (0, False), (1, True)]  # [6, 0, 1] is the first batch
        assert sorted(e for e, _ in delivered) == list(range(8))
    finally:
        slow_done.set()
        close(cache)


def test_an_expert_that_fails_to_compute_releases_the_streamed_batch_at_once(pack, monkeypatch):
    """A prompt chunk through a small cache (streamed batches) whose second expert's
    compute raises: the batch is released and its reads end when the error leaves the
    routed sum, not when its traceback is freed. The error is kept alive here: another
    thread's acquire of the experts the batch was loading must not wait for it."""
    cache = open_cache(pack, 4)
    real = os.preadv

    def slow(fd, buffers, offset, *args):
        time.sleep(0.02)  # reads still in flight when the compute fails
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow)

    class FailsOnSecond:
        calls = 0

        def mlp(self, weights, x):
            FailsOnSecond.calls += 1
            if FailsOnSecond.calls == 2:
                raise RuntimeError("kernel failed")
            return x[:, :32]

    groups = TokensByExpert.of(torch.arange(12).view(4, 3), torch.ones(4, 3))
    try:
        with pytest.raises(RuntimeError, match="kernel failed") as kept:
            accumulate_routed(cache.deliveries(1, groups.ids, lambda: None), torch.zeros(4, 64), groups,
                              FailsOnSecond())
        assert kept.value is not None  # the traceback, and with it the routed sum's frame, still alive
        assert cache.max_experts_per_acquire == 4  # nothing left protected
        done = threading.Event()
        worker = threading.Thread(target=lambda: (cache.acquire(1, [0, 1, 2, 3]).release(), done.set()))
        worker.start()
        assert done.wait(10)
        worker.join()
    finally:
        close(cache)


def test_streaming_counts_like_plain_acquire_and_keeps_the_same_cache(pack):
    plain, streaming = open_cache(pack, 5, host_slots=3), open_cache(pack, 5, host_slots=3)
    try:
        for block, experts in requests(2, n=60):
            with plain.acquire(block, experts):
                pass
            with streaming.acquire_streaming(block, experts) as batch:
                for _ in batch:
                    pass
        assert counters(plain) == counters(streaming)
        assert set(plain._where) == set(streaming._where)
    finally:
        close(plain)
        close(streaming)


def _mlp(weights, x):
    """A small SwiGLU on the experts' real bytes (engine kernels); NaN-free whatever the bytes."""
    gate = torch.nan_to_num(weights["gate"].dequantize(), 0.0, 1.0, -1.0)
    up = torch.nan_to_num(weights["up"].dequantize(), 0.0, 1.0, -1.0)
    down = torch.nan_to_num(weights["down"].dequantize(), 0.0, 1.0, -1.0)
    h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    return h @ down.T


def test_fixed_order_sum_over_streamed_experts_is_bit_identical(pack):
    plain, streaming = open_cache(pack, 5), open_cache(pack, 5)
    gen = torch.Generator().manual_seed(0)
    layer = pack.manifest.layer_for_block(3)
    d_in = layer.role("gate").shape[1]
    try:
        for block, experts in requests(3, n=25):
            x = torch.randn(2, d_in, generator=gen)
            w = {e: float(torch.rand((), generator=gen)) for e in experts}
            order = sorted(experts)
            with plain.acquire(block, experts) as batch:
                ref = sum((w[e] * _mlp(batch[e], x) for e in order), torch.zeros(()))
            outs = {}
            with streaming.acquire_streaming(block, experts) as batch:
                arrival = []
                for e, weights in batch:
                    outs[e] = _mlp(weights, x)
                    arrival.append(e)
            got = sum((w[e] * outs[e] for e in order), torch.zeros(()))
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (block, experts, arrival)
    finally:
        close(plain)
        close(streaming)


@pytest.mark.parametrize("stop_after", [0, 1])
def test_releasing_a_streaming_batch_early_leaves_the_cache_consistent(pack, stop_after):
    cache = open_cache(pack, 6)
    try:
        with cache.acquire_streaming(5, [0, 1, 2]) as batch:
            for i, _ in enumerate(batch):
                if i + 1 >= stop_after:
                    break
            if stop_after == 0:
                pass  # never iterated
        with cache._cond:
            assert all(s.state != "loading" for s in cache._slots)
            assert cache._pinned == 0
        with cache.acquire(5, [0, 1, 2, 3]) as batch:  # anything left must be exact
            for e in (0, 1, 2, 3):
                assert_exact(pack, batch[e], 5, e)
    finally:
        close(cache)


def test_streaming_batches_released_at_any_point_give_every_buffer_back(pack):
    """Releasing a streaming batch at any point while its reads land: every staging buffer
    comes back once, no slot stays pinned or loading, and what the cache holds afterwards
    is exact."""
    cache = open_cache(pack, 6, host_slots=4, stage=4)
    rng = random.Random(5)
    try:
        for block, experts in requests(7, n=60, k=3):
            stop = rng.randint(0, len(experts))
            with cache.acquire_streaming(block, experts) as batch:
                for i, (e, weights) in enumerate(batch):
                    assert_exact(pack, weights, block, e)
                    if i + 1 >= stop:
                        break
        assert cache.drain_prefetches(timeout=10)
        staging = cache.store.staging
        wait_for(lambda: staging.free_count == staging.count)
        with cache._cond:
            assert cache._pinned == 0 and cache._reads_inflight == 0
            assert all(s.state == "ready" for s in cache._where.values())
        for block in BLOCKS:
            with cache.acquire(block, list(range(6))) as batch:
                for e in range(6):
                    assert_exact(pack, batch[e], block, e)
    finally:
        close(cache)


def test_an_undelivered_expert_cannot_be_read_early(pack):
    cache = open_cache(pack, 6)
    try:
        with cache.acquire_streaming(1, [3, 4]) as batch:
            with pytest.raises(KeyError, match="not been delivered"):
                batch[3]
            list(batch)
            assert_exact(pack, batch[3], 1, 3)
            with pytest.raises(RuntimeError, match="only once"):
                iter(batch)
    finally:
        close(cache)


# prefetch ------------------------------------------------------------------------------------
def test_prefetched_experts_are_exact_and_count_as_hits(pack):
    cache = open_cache(pack, 8)
    try:
        assert cache.prefetch(3, [1, 2, 2, 5]) == 3
        assert cache.drain_prefetches(timeout=10)
        assert cache.prefetch(3, [1, 2]) == 0  # resident already
        snap = cache.telemetry.snapshot()
        assert snap["prefetch_issued"] == 3 and snap["reads"] == 3 and snap["cache_misses"] == 0
        with cache.acquire(3, [1, 2, 5, 6]) as batch:
            for e in (1, 2, 5, 6):
                assert_exact(pack, batch[e], 3, e)
        snap = cache.telemetry.snapshot()
        assert (snap["cache_hits"], snap["cache_misses"], snap["prefetch_hits"]) == (3, 1, 3)
        assert snap["reads"] == 4  # nothing read twice
    finally:
        close(cache)


def test_an_acquire_waits_for_a_prefetch_still_loading(pack, monkeypatch):
    cache = open_cache(pack, 8)
    real, gate = os.preadv, threading.Event()

    def slow(fd, buffers, offset, *args):
        gate.wait(10)
        return real(fd, buffers, offset, *args)

    try:
        monkeypatch.setattr(os, "preadv", slow)
        cache.prefetch(1, [0, 1])
        wait_for(lambda: cache.telemetry.get("prefetch_issued") == 2)  # started by the pump thread
        threading.Timer(0.2, gate.set).start()
        with cache.acquire(1, [0, 1]) as batch:  # loading keys: hits, waited for
            for e in (0, 1):
                assert_exact(pack, batch[e], 1, e)
        snap = cache.telemetry.snapshot()
        assert snap["cache_hits"] == 2 and snap["cache_misses"] == 0 and snap["reads"] == 2
    finally:
        gate.set()
        close(cache)


def test_prefetch_never_evicts_protected_experts(pack):
    cache = open_cache(pack, 6, stage=6)
    try:
        with cache.acquire(1, [0, 1, 2]) as held:
            with cache.acquire(3, [0, 1]) as held2:
                protected = {k: s.index for k, s in cache._where.items()}
                cache.prefetch(5, list(range(E)))  # far more than the one free slot
                cache.prefetch(5, list(range(E)), exact=False)
                assert cache.drain_prefetches(timeout=10)
                for k, index in protected.items():
                    assert cache._where[k].index == index
                for e in (0, 1, 2):
                    assert_exact(pack, held[e], 1, e)
                for e in (0, 1):
                    assert_exact(pack, held2[e], 3, e)
        assert cache.resident_count() <= cache.slot_count
    finally:
        close(cache)


def test_speculative_prefetch_never_evicts_an_unused_exact_prefetch(pack):
    cache = open_cache(pack, 6, prefetch_limit=6)
    try:
        with cache.acquire(1, [0, 1, 2]):
            pass
        cache.prefetch(3, [4, 5, 6])  # exact: the hash-layer case
        assert cache.drain_prefetches(timeout=10)
        cache.prefetch(5, [7, 8, 9, 10], exact=False)
        assert cache.drain_prefetches(timeout=10)
        for e in (4, 5, 6):
            assert cache.slot_of(3, e) is not None
        with cache.acquire(3, [4, 5, 6]) as batch:
            for e in (4, 5, 6):
                assert_exact(pack, batch[e], 3, e)
        assert cache.telemetry.get("prefetch_hits") == 3
    finally:
        close(cache)


def test_speculative_prefetch_waits_for_idle_bandwidth_and_goes_stale(pack):
    cache = open_cache(pack, 8)
    try:
        with cache._cond:
            cache._demand_pending += 1  # an acquire has reads to issue
        cache.prefetch(3, [1, 2], exact=False)
        assert cache.telemetry.get("prefetch_issued") == 0
        cache.prefetch(5, [1], exact=True)  # exact prefetches do not wait for idle
        assert cache.drain_prefetches(timeout=10) or True
        with cache._cond:
            cache._demand_pending -= 1
        issued = cache.telemetry.get("prefetch_issued")
        assert issued == 1
        cache.prefetch(3, [7], exact=False)
        with cache._cond:
            cache._demand_pending += 1
        with cache.acquire(1, [0]):  # not block 3: its intents stay valid
            pass
        with cache._cond:
            cache._demand_pending -= 1
        cache._pump()
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(3, 7) is not None
        with cache._cond:
            cache._demand_pending += 1
        cache.prefetch(3, [9], exact=False)
        with cache.acquire(3, [10]):  # block 3 acquired: its pending guesses are stale
            pass
        with cache._cond:
            cache._demand_pending -= 1
        cache._pump()
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(3, 9) is None
        assert cache.telemetry.get("prefetch_dropped") >= 1
    finally:
        close(cache)


def test_prefetch_respects_its_limit_and_reports_waste(pack):
    cache = open_cache(pack, 6, prefetch_limit=2)
    try:
        cache.prefetch(1, [0, 1, 2, 3], exact=False)
        assert cache.drain_prefetches(timeout=10)
        assert cache.telemetry.get("prefetch_issued") == 2
        with cache.acquire(3, [0, 1, 2]), cache.acquire(5, [0, 1, 2]):  # fills the cache: evicts them
            pass
        assert cache.telemetry.get("prefetch_wasted") == 2
    finally:
        close(cache)


def test_a_failed_prefetch_read_is_counted_and_the_acquire_rereads(pack, monkeypatch):
    cache = open_cache(pack, 6)
    try:
        fail_first_read(monkeypatch)
        cache.prefetch(1, [4])
        assert cache.drain_prefetches(timeout=10)
        assert cache.telemetry.get("prefetch_errors") == 1 and cache.telemetry.get("io_errors") == 1
        assert cache.slot_of(1, 4) is None
        with cache.acquire(1, [4]) as batch:
            assert_exact(pack, batch[4], 1, 4)
        assert cache.telemetry.get("cache_misses") == 1
    finally:
        close(cache)


def test_a_failed_streaming_read_raises_from_the_loop(pack, monkeypatch):
    cache = open_cache(pack, 6)
    try:
        fail_first_read(monkeypatch)
        with pytest.raises(ExpertReadError):
            with cache.acquire_streaming(3, [1]) as batch:
                list(batch)
        with cache.acquire(3, [1]) as batch:
            assert_exact(pack, batch[1], 3, 1)
    finally:
        close(cache)


def test_levers_together_under_threads_stay_exact(pack):
    """Prefetches (exact and speculative) racing with streaming and plain acquires."""
    cache = open_cache(pack, 9, host_slots=4, stage=5)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for block, experts in requests(seed, n=40, k=3):
                cache.prefetch(rng.choice(BLOCKS), rng.sample(range(E), 3), exact=rng.random() < 0.5)
                if rng.random() < 0.5:
                    with cache.acquire_streaming(block, experts) as batch:
                        for e, weights in batch:
                            assert_exact(pack, weights, block, e)
                else:
                    with cache.acquire(block, experts) as batch:
                        for e in experts:
                            assert_exact(pack, batch[e], block, e)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        for t in threads:
            t.join(max(0.1, deadline - time.time()))
        assert not any(t.is_alive() for t in threads), "deadlock"
        assert not errors, errors[0]
        assert cache.drain_prefetches(timeout=10)
        with cache._cond:
            assert cache._pinned == 0 and cache._reads_inflight == 0
            assert all(s.state == "ready" for s in cache._where.values())
        snap = cache.telemetry.snapshot()
        assert snap["io_errors"] == 0 and snap["prefetch_errors"] == 0
    finally:
        close(cache)


def test_pending_acquire_reads_hold_back_guesses_until_issued(pack):
    cache = open_cache(pack, 8)
    try:
        batch = cache.acquire_streaming(1, [0, 1])  # planned: two reads to issue
        assert cache._demand_pending == 2
        cache.prefetch(3, [5], exact=False)
        assert cache.telemetry.get("prefetch_issued") == 0  # the acquire's reads go first
        with batch:
            for _ in batch:
                pass
        assert cache._demand_pending == 0 and cache._demand_reads == 0
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 5) is not None
        unused = cache.acquire_streaming(5, [2, 3])
        unused.release()  # never iterated: its planned reads are no longer pending
        assert cache._demand_pending == 0 and cache.slot_of(5, 2) is None
    finally:
        close(cache)


def test_tail_mode_guesses_may_share_the_queue_with_acquire_reads(pack):
    cache = open_cache(pack, 8, speculative="tail")
    try:
        with cache._cond:
            cache._demand_reads += 1  # an acquire read in flight, none pending
        cache.prefetch(3, [5], exact=False)
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 5) is not None
        with cache._cond:
            cache._demand_reads -= 1
        with pytest.raises(ValueError):
            open_cache(pack, 8, speculative="sometimes")
    finally:
        close(cache)


def test_guesses_in_the_host_tier_move_up_even_while_acquire_reads_are_pending(pack):
    cache = open_cache(pack, 3, host_slots=6)
    try:
        for experts in ([0, 1, 2], [3, 4, 5]):  # 0, 1, 2 evicted to RAM by the second acquire
            with cache.acquire(1, experts):
                pass
        assert {(0, 0), (0, 1), (0, 2)} <= cache.host.resident_keys()
        reads = cache.telemetry.get("reads")
        with cache._cond:
            cache._demand_pending += 1  # an acquire has reads to issue: the drive is not idle
        cache.prefetch(1, [1, 6], exact=False)  # 1 is in RAM, 6 only on the SSD
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(1, 1) is not None and cache.slot_of(1, 6) is None
        assert cache.telemetry.get("reads") == reads  # the guess cost no drive time
        with cache._cond:
            cache._demand_pending -= 1
        with cache.acquire(1, [1]) as batch:
            assert_exact(pack, batch[1], 1, 1)
        assert cache.telemetry.get("prefetch_hits") == 1
    finally:
        close(cache)


def test_ram_mode_guesses_never_read_the_ssd(pack):
    cache = open_cache(pack, 4, host_slots=4, speculative="ram")
    try:
        cache.prefetch(3, [5, 6], exact=False)  # idle drive, but neither is in RAM
        cache._pump()
        assert cache.drain_prefetches(timeout=10)
        assert cache.telemetry.get("reads") == 0 and cache.slot_of(3, 5) is None
        cache.prefetch(3, [5], exact=True)  # exact prefetches still read
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 5) is not None
    finally:
        close(cache)


def test_only_the_likeliest_guesses_may_read_the_ssd(pack):
    cache = open_cache(pack, 6, host_slots=4, speculative_reads=1)
    try:
        for experts in ([0, 1, 2], [3, 4, 5], [6, 7, 8]):  # 0..2 end in RAM
            with cache.acquire(1, experts):
                pass
        reads = cache.telemetry.get("reads")
        cache.prefetch(3, [9, 10, 11], exact=False)  # idle drive: only 9, the first, is read
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(3, 9) is not None and cache.slot_of(3, 10) is None and cache.slot_of(3, 11) is None
        assert cache.telemetry.get("reads") == reads + 1
        cache.prefetch(1, [10, 1], exact=False)  # 1 is second but in RAM: moved up, no read
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(1, 1) is not None and cache.telemetry.get("reads") == reads + 2
    finally:
        close(cache)


def test_by_default_a_guess_goes_out_behind_the_layers_reads_and_starts_as_they_end(pack, monkeypatch):
    """The default ("tail", with the store's hold): the pump submits the guess as soon as
    the acquire's reads are all submitted, while they are still in flight; the store
    starts it only once the last of them ended."""
    from engine.runtime import store as store_mod

    monkeypatch.setattr(store_mod, "LATER_HOLD_S", 60.0)
    store = ExpertStore(pack.path, io_threads=4, stage_slots=4)
    cache = ExpertCache(store, device="cpu", cache_bytes=8 * pack.manifest.expert_stride, reserve_bytes=0)
    reads = GatedReads(monkeypatch)
    begin = pack.manifest.block_offset(1, 5)
    guess = range(begin, begin + pack.manifest.expert_stride)  # expert 5 of blk.3
    try:
        with cache.acquire_streaming(1, [0]) as batch:
            batch.start()
            reads.wait_started(1)
            cache.prefetch(3, [5], exact=False)
            wait_for(lambda: cache.telemetry.get("prefetch_issued") == 1)  # submitted beside the read
            time.sleep(0.05)
            assert not any(o in guess for o in reads.wait_started(1))  # held back by the store
            reads.gate.set()
            batch.settle()
        reads.wait_started(condition=lambda offsets: any(o in guess for o in offsets))
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 5) is not None
        first_guess = next(i for i, (o, _t) in enumerate(reads.started) if o in guess)
        assert all(o not in guess for o, _t in reads.started[:first_guess]) and first_guess >= 1
    finally:
        reads.gate.set()
        close(cache)


def test_by_default_the_two_likeliest_guesses_read_while_the_drive_idles(pack):
    store = ExpertStore(pack.path, io_threads=4, stage_slots=4)
    cache = ExpertCache(store, device="cpu", cache_bytes=8 * pack.manifest.expert_stride, reserve_bytes=0)
    try:
        cache.prefetch(3, [7, 2, 9, 4], exact=False)  # likeliest first
        assert cache.drain_prefetches(timeout=10)
        assert [e for e in (7, 2, 9, 4) if cache.slot_of(3, e) is not None] == [7, 2]
        assert cache.telemetry.get("reads") == 2
    finally:
        close(cache)


def test_prefetch_loads_start_on_the_pump_thread_never_on_the_callers(pack, monkeypatch):
    """A hint costs the model's thread no load: the slot, the victim's copy down and the
    read are all started by the scheduler's own thread (DeepSeek-V4's hash-layer hints
    at a step's start once held the decode thread for 14 ms)."""
    cache = open_cache(pack, 3, host_slots=8)
    submits, copies = [], []
    real_submit, real_copy_up = cache.store.submit, cache._pipeline.copy_up

    def submit(*args, **kwargs):
        submits.append(threading.current_thread().name)
        return real_submit(*args, **kwargs)

    def copy_up(*args, **kwargs):
        copies.append(threading.current_thread().name)
        return real_copy_up(*args, **kwargs)

    try:
        with cache.acquire(1, [0, 1, 2]):
            pass
        with cache.acquire(3, [0, 1, 2]):  # 1's experts evicted into RAM
            pass
        assert (0, 0) in cache.host.resident_keys()
        monkeypatch.setattr(cache.store, "submit", submit)
        monkeypatch.setattr(cache._pipeline, "copy_up", copy_up)
        cache.prefetch(5, [4, 5])  # two reads
        cache.prefetch(1, [0])  # from RAM
        assert cache.drain_prefetches(timeout=10)
        assert cache.slot_of(5, 4) is not None and cache.slot_of(1, 0) is not None
        assert submits == ["expert-prefetch"] * 2 and copies == ["expert-prefetch"], (submits, copies)
    finally:
        close(cache)


def test_intents_in_ram_move_up_while_the_read_queue_is_full(pack):
    """A guess (or hint) the host tier holds needs no read: it is copied up at once, even
    while as many reads are in flight as the prefetch depth allows and no staging buffer
    is free; one only the SSD holds waits for the queue."""
    cache = open_cache(pack, 6, host_slots=6, stage=2)
    try:
        for experts in ([0, 1, 2], [3, 4, 5], [6, 7, 8]):  # 0, 1, 2 end in RAM
            with cache.acquire(1, experts):
                pass
        assert (0, 0) in cache.host.resident_keys()
        buffers = [cache.store.staging.take() for _ in range(2)]  # no staging buffer free
        with cache._cond:
            cache._reads_inflight += cache.prefetch_depth  # the queue is full
        try:
            cache.prefetch(1, [9, 0], exact=False)  # 9 only on the SSD, 0 in RAM
            cache.prefetch(3, [1])  # exact, not in RAM: waits for the queue
            wait_for(lambda: cache.slot_of(1, 0) is not None)
            assert cache.slot_of(1, 9) is None and cache.slot_of(3, 1) is None
            assert cache.telemetry.get("reads") == 9  # the three acquires' only
        finally:
            with cache._cond:
                cache._reads_inflight -= cache.prefetch_depth
            for index in buffers:
                cache.store.staging.give(index)
        cache._pump()
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 1) is not None
    finally:
        close(cache)


def test_the_pump_thread_stops_at_close_and_when_the_cache_is_dropped(pack):
    import gc
    import weakref

    def pumps():
        return {t for t in threading.enumerate() if t.name == "expert-prefetch"}

    before = pumps()
    cache = open_cache(pack, 4)
    cache.prefetch(1, [0])
    assert cache.drain_prefetches(timeout=10)
    thread = cache._prefetch._thread
    assert thread is not None and thread.is_alive()
    close(cache)
    assert not thread.is_alive() and pumps() == before
    assert cache.prefetch(1, [1]) == 0  # closed: nothing queued, no thread started

    dropped = open_cache(pack, 4)
    dropped.prefetch(1, [0])
    assert dropped.drain_prefetches(timeout=10)
    thread, ref, store = dropped._prefetch._thread, weakref.ref(dropped._prefetch), dropped.store
    del dropped
    wait_for(lambda: gc.collect() is not None and ref() is None)  # once the pump's pass in progress ends
    thread.join(timeout=10)
    assert not thread.is_alive()
    store.close()


def test_a_pump_thread_that_cannot_start_costs_no_hang_and_is_tried_again(pack, monkeypatch):
    """If the process cannot start the pump thread, prefetch neither raises nor leaves a
    drain or close waiting for it; the next prefetch starts it."""
    cache = open_cache(pack, 6)
    real_start = threading.Thread.start

    def refuse(thread):
        if thread.name == "expert-prefetch":
            raise RuntimeError("can't start new thread")
        return real_start(thread)

    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        assert cache.prefetch(1, [4]) == 1  # queued; the pump could not start
        assert isinstance(cache.last_prefetch_error, RuntimeError)
        assert cache.drain_prefetches(timeout=10)  # at once: nothing was started
        monkeypatch.setattr(threading.Thread, "start", real_start)
        cache.prefetch(1, [5])
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(1, 5) is not None
    finally:
        close(cache)


def test_a_guess_whose_ram_copy_is_gone_is_dropped_not_read(pack, monkeypatch):
    """A guess that may only move up from RAM (here `speculative="ram"`) and whose RAM copy
    left the tier as it was picked is dropped: it never reads the SSD."""
    cache = open_cache(pack, 3, host_slots=6, speculative="ram")
    try:
        for experts in ([0, 1, 2], [3, 4, 5]):  # 0, 1, 2 end in RAM
            with cache.acquire(1, experts):
                pass
        assert (0, 0) in cache.host.resident_keys()
        reads, real_take = cache.telemetry.get("reads"), cache.host.take

        def gone(key):  # another thread's demotion evicted it just now
            index = real_take(key)
            cache.host.unpin(index, None)
            return None

        monkeypatch.setattr(cache.host, "take", gone)
        cache.prefetch(1, [0], exact=False)
        assert cache.drain_prefetches(timeout=10)
        assert cache.telemetry.get("reads") == reads and cache.slot_of(1, 0) is None
        assert cache.telemetry.get("prefetch_dropped") >= 1
    finally:
        close(cache)


def test_the_next_layers_guess_reads_once_the_batch_is_released_not_at_its_last_landing(pack, monkeypatch):
    """The last read of an acquire landing does not wake the pump: the model's thread is
    copying that expert up and launching the experts then, and the pump's guess reads
    would take the GIL from it. The batch's release (the experts queued) wakes it. (With
    guesses that read only while the drive idles, "idle", on a GPU; on a CPU the experts'
    compute is the long part, for the guesses' reads to overlap.)"""
    cache = open_cache(pack, 8, speculative_reads=2, speculative="idle")
    assert not cache.guesses_after_compute  # a CPU cache
    cache.guesses_after_compute = True
    real, gate = os.preadv, threading.Event()

    def gated(fd, buffers, offset, *args):
        gate.wait(10)
        return real(fd, buffers, offset, *args)

    def open_gate_when_the_pump_idles():
        scheduler = cache._prefetch
        wait_for(lambda: scheduler._passes_done == scheduler._passes_started)
        time.sleep(0.05)
        wait_for(lambda: scheduler._passes_done == scheduler._passes_started)
        gate.set()

    try:
        monkeypatch.setattr(os, "preadv", gated)
        batch = cache.acquire_streaming(1, [0])  # one miss: its read is the last
        with batch:
            cache.prefetch(3, [5], exact=False)  # held back: the acquire's read is pending
            opener = threading.Thread(target=open_gate_when_the_pump_idles)
            opener.start()
            batch.settle()  # the read lands; nothing wakes the pump
            opener.join()
            time.sleep(0.05)
            assert cache.telemetry.get("prefetch_issued") == 0
        wait_for(lambda: cache.telemetry.get("prefetch_issued") == 1)  # the release woke it
        assert cache.drain_prefetches(timeout=10) and cache.slot_of(3, 5) is not None
    finally:
        gate.set()
        close(cache)
