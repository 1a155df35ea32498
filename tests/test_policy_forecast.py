"""ForecastPolicy (the runtime's default): bookkeeping under random use, the layer cycle,
learned reuse, guesses, and hit rates against Belady, the hybrid and LRU."""

from __future__ import annotations

import random

import pytest

from engine.runtime import ExpertCache, ExpertStore
from engine.runtime.policy import (
    DEFAULT_POLICY,
    AdaptiveHybridPolicy,
    ForecastPolicy,
    HybridPolicy,
    make_policy,
    plan_acquire,
    whole_acquire_policy,
)
from engine.runtime.trace import (
    CALIBRATED,
    belady_hit_rate,
    replay_policy,
    simulate_policy,
    synthetic_trace,
    trace_statistics,
)
from pack_factory import make_pack, role_spec


@pytest.mark.parametrize("name", ["forecast", "router"])
def test_random_use_keeps_the_books_straight(name):
    """Acquires, pinned keys, prefetch admits, failed loads, guesses: the policy's resident
    set is the cache's, victims are never protected, and None means all are protected."""
    rng = random.Random(11)
    capacity = 9
    policy = make_policy(name, capacity)
    resident: set = set()
    pinned: set = set()
    for step in range(3000):
        layer = step % 4
        keys = list(dict.fromkeys((layer, rng.randrange(7)) for _ in range(rng.randint(1, 3))))
        protected = pinned | set(keys)
        misses = [k for k in keys if k not in resident]
        evictable = [k for k in resident if k not in protected]
        if len(misses) > capacity - len(resident) + len(evictable):
            continue  # the cache refuses such an acquire before planning (CacheCapacityError)
        plan = plan_acquire(policy, keys, resident.__contains__, capacity - len(resident), protected.__contains__)
        assert not set(plan.victims) & protected
        assert len(plan.victims) == max(0, len(misses) - (capacity - len(resident)))
        resident.difference_update(plan.victims)
        resident.update(plan.misses)
        assert set(policy._resident) == resident and len(policy) == len(resident)
        roll = rng.random()
        if roll < 0.1 and resident:  # a batch stays alive over the next acquires
            pinned.add(rng.choice(sorted(resident)))
        elif roll < 0.2 and pinned:
            pinned.discard(rng.choice(sorted(pinned)))
        elif roll < 0.25 and resident:  # a load failed: the key leaves without eviction
            gone = rng.choice(sorted(resident - pinned) or [None])
            if gone is not None:
                policy.remove(gone)
                resident.discard(gone)
        elif roll < 0.3 and len(resident) < capacity:  # a prefetch admitted without an access
            key = (rng.randrange(4), rng.randrange(7))
            if key not in resident:
                policy.admit(key)
                resident.add(key)
        if hasattr(policy, "observe_guess") and roll > 0.8:
            policy.observe_guess([((layer + 1) % 4, rng.randrange(7)) for _ in range(2)])
    everything = set(resident)
    assert policy.pop_victim(everything.__contains__) is None  # all protected: nothing to give
    order = []
    while (victim := policy.pop_victim(lambda k: False)) is not None:
        order.append(victim)
    assert sorted(order) == sorted(everything) and len(policy) == 0


def test_the_layer_just_visited_leaves_before_the_layer_coming_next():
    """Same history, different place in the cycle: the expert whose layer comes round
    last (the one just visited) is the one to evict; LRU evicts the other."""
    policy = ForecastPolicy(8)
    lru = make_policy("lru")
    resident: set = set()
    for p in (policy, lru):
        resident.clear()
        for token in range(3):
            for layer in range(4):
                keys = [(layer, 0)] if token < 2 else [(layer, 1)]
                plan = plan_acquire(p, keys, resident.__contains__, 8 - len(resident), set(keys).__contains__)
                resident.difference_update(plan.victims)
                resident.update(plan.misses)
    # Now at layer 3 of token 2: layer 0 is next, layer 3 was just visited. Among the
    # experts of tokens 0-1 (same history):
    this_token = lambda k: k[1] == 1  # noqa: E731
    assert policy.pop_victim(this_token) == (3, 0)  # its next visit is the farthest
    assert lru.pop_victim(this_token) == (0, 0)


def test_a_cache_smaller_than_one_token_keeps_hitting():
    """A cyclic trace (the same 3 experts per layer, 6 layers) with 12 slots: LRU evicts
    every key just before its reuse and never hits; the forecast keeps most of them."""
    sets = [[(layer, e) for e in range(3)] for _token in range(50) for layer in range(6)]
    optimal = belady_hit_rate(sets, 12)
    assert simulate_policy(sets, 12, "lru") == 0.0
    forecast = simulate_policy(sets, 12, "forecast")
    assert forecast >= 0.9 * optimal > 0


def test_it_learns_the_reuse_rate():
    trace = synthetic_trace(layers=6, experts=64, top_k=4, tokens=300, seed=5, **CALIBRATED)
    policy = ForecastPolicy(60)
    replay_policy(trace, 60, policy)
    assert policy.reuse == pytest.approx(trace_statistics(trace)["reuse"], abs=0.06)


def test_router_guesses_lift_the_guessed_experts():
    def evicted_first(name: str):
        policy = make_policy(name, 12)
        resident: set = set()
        for token in range(3):
            for layer in range(2):
                keys = [(layer, 2 * token), (layer, 2 * token + 1)]
                plan = plan_acquire(policy, keys, resident.__contains__, 12 - len(resident), set(keys).__contains__)
                resident.difference_update(plan.victims)
                resident.update(plan.misses)
        cold = [(0, 0), (0, 1)]  # used once, two visits ago: equal but for the guess
        policy.observe_guess([(0, 0)])  # the router names one of them
        return policy.pop_victim(lambda k: k not in cold)

    assert evicted_first("forecast") == (0, 0)  # guesses ignored: the tie goes by key order
    assert evicted_first("router") == (0, 1)  # the guessed expert stays


def test_hit_rates_on_a_calibrated_trace_beat_the_hybrid():
    trace = synthetic_trace(layers=12, experts=64, top_k=4, tokens=250, seed=2, **CALIBRATED)
    keys = 12 * 64
    for fraction, gain in ((0.05, 0.03), (0.15, 0.015)):
        capacity = int(fraction * keys)
        optimal = belady_hit_rate(trace, capacity)
        forecast = replay_policy(trace, capacity, "forecast")
        hybrid = simulate_policy(trace, capacity, "hybrid")
        lru = simulate_policy(trace, capacity, "lru")
        assert forecast.hit_rate <= optimal
        assert forecast.hit_rate >= max(hybrid, lru) + gain * optimal, (fraction, forecast.hit_rate, hybrid, lru)
        assert forecast.acquires == 12 * 250 and forecast.us_per_acquire > 0


def test_names_and_the_runtime_default(tmp_path):
    assert DEFAULT_POLICY == "forecast" and isinstance(make_policy(), ForecastPolicy)
    assert make_policy("forecast", 10, halflife=8).halflife == 8
    assert make_policy("router", 10).guess_credit > 0 == make_policy("forecast", 10).guess_credit
    assert isinstance(make_policy("hybrid", 10), AdaptiveHybridPolicy)
    assert isinstance(make_policy("lfru", 10), HybridPolicy) and make_policy("lfru", 10).halflife == 10
    assert whole_acquire_policy("forecast") and not whole_acquire_policy("hybrid")
    with pytest.raises(ValueError, match="'forecast', 'router', 'hybrid', 'lfru', 'lfu', 'lru'"):
        make_policy("mru")
    with pytest.raises(ValueError, match="halflife must be positive"):
        ForecastPolicy(4, halflife=0)
    roles = (role_spec("gate", 32, 64), role_spec("up", 32, 64), role_spec("down", 64, 32))
    pack = make_pack(tmp_path / "p.expertpack", blocks=(1, 2), num_experts=6, top_k=2, roles=roles)
    store = ExpertStore(pack.path, io_threads=2, stage_slots=2)
    stride = pack.manifest.expert_stride
    cache = ExpertCache(store, device="cpu", cache_bytes=4 * stride, reserve_bytes=0, host_cache_bytes=4 * stride)
    try:
        assert isinstance(cache._planner.policy, ForecastPolicy)
        assert isinstance(cache.host._policy, AdaptiveHybridPolicy)  # the host tier never sees whole acquires
        for block, ids in ((1, [0, 1]), (2, [0, 1]), (1, [2, 3]), (2, [4, 5]), (1, [0, 1])):
            with cache.acquire(block, ids):
                pass
        assert cache.telemetry.get("host_hits") >= 1  # victims went down to RAM and came back
    finally:
        cache.close()
        store.close()
