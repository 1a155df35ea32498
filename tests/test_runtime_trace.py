"""Access traces, Belady's optimum (checked by exhaustive search) and policy replay."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from engine.runtime import AccessTrace, belady_hit_rate, belady_hits, simulate_policy
from engine.runtime.trace import simulate_policy_hits, synthetic_trace


def exhaustive_best_hits(sets, capacity):
    """Most hits any eviction schedule can get (tries every choice of victims)."""
    sets = [tuple(dict.fromkeys(s)) for s in sets]

    @functools.cache
    def best(t, resident):
        if t == len(sets):
            return 0
        keys = sets[t]
        hits = sum(1 for k in keys if k in resident)
        misses = [k for k in keys if k not in resident]
        need = len(resident) + len(misses) - capacity
        if need <= 0:
            return hits + best(t + 1, resident | frozenset(misses))
        candidates = sorted(k for k in resident if k not in keys)
        return hits + max(
            best(t + 1, (resident - frozenset(victims)) | frozenset(misses))
            for victims in itertools.combinations(candidates, need)
        )

    return best(0, frozenset())


def test_belady_equals_exhaustive_search_on_random_small_traces():
    rng = random.Random(7)
    for _ in range(400):
        capacity = rng.randint(1, 4)
        n_keys = rng.randint(2, 7)
        sets = [rng.sample(range(n_keys), rng.randint(1, min(capacity, n_keys))) for _ in range(rng.randint(1, 9))]
        hits, accesses = belady_hits(sets, capacity)
        assert accesses == sum(len(s) for s in sets)
        assert hits == exhaustive_best_hits(sets, capacity), (sets, capacity)
        for policy in ("hybrid", "lru", "lfu"):  # no online policy beats the optimum
            assert simulate_policy_hits(sets, capacity, policy)[0] <= hits


def test_belady_textbook_example():
    """Silberschatz's reference string, 3 frames: the optimal algorithm has 9 faults."""
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    hits, accesses = belady_hits([[r] for r in refs], 3)
    assert accesses - hits == 9
    assert simulate_policy([[r] for r in refs], 3, "lru") == pytest.approx((20 - 12) / 20)  # LRU: 12 faults


def test_capacity_below_one_acquire_is_an_error():
    with pytest.raises(ValueError, match="needs 3 slots"):
        belady_hit_rate([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="needs 3 slots"):
        simulate_policy([[1, 2, 3]], 2)


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_trace_save_and_load_round_trip(tmp_path, suffix):
    trace = AccessTrace()
    trace.record(3, [5, 1, 5])
    trace.next_step()
    trace.record(4, [0])
    trace.record(3, [2, 7], step=9)
    path = tmp_path / f"trace{suffix}"
    trace.save(path)
    loaded = AccessTrace.load(path)
    assert list(loaded.acquires()) == [(0, 3, (5, 1)), (1, 4, (0,)), (9, 3, (2, 7))]
    assert loaded.keysets() == trace.keysets() and loaded.accesses == 5


def test_policy_quality_on_a_skewed_trace():
    """Ours / optimal on a Zipf-like MoE trace; at least as good as LRU."""
    trace = synthetic_trace(layers=10, experts=64, top_k=4, tokens=300, seed=1)
    n_keys = 10 * 64
    # At 5% the cache holds less than one token's experts: LRU thrashes to 0 there.
    for fraction, floor in ((0.05, 0.40), (0.15, 0.75), (0.40, 0.90)):
        capacity = int(fraction * n_keys)
        optimal = belady_hit_rate(trace, capacity)
        ours = simulate_policy(trace, capacity)
        assert ours <= optimal
        assert ours / optimal >= floor, (fraction, ours, optimal)
        assert ours >= simulate_policy(trace, capacity, "lru") - 0.005


def test_synthetic_trace_shape():
    trace = synthetic_trace(layers=3, experts=16, top_k=4, tokens=5)
    acquires = list(trace.acquires())
    assert len(acquires) == 15
    assert all(len(experts) == 4 and len(set(experts)) == 4 for _s, _l, experts in acquires)
    assert [layer for _s, layer, _e in acquires[:4]] == [0, 1, 2, 0]
