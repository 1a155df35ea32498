"""Replacement policies: eviction order, protection, decay, the adaptive halflife."""

from __future__ import annotations

import math

import pytest

from engine.runtime import HybridPolicy, LRUPolicy, make_policy, plan_acquire
from engine.runtime.policy import AdaptiveHybridPolicy
from engine.runtime.trace import simulate_policy, synthetic_trace

NONE_PROTECTED = lambda key: False  # noqa: E731


def fill(policy, accesses):
    for key in accesses:
        if key not in policy:
            policy.access(key)
            policy.admit(key)
        else:
            policy.access(key)


def eviction_order(policy, protected=NONE_PROTECTED):
    order = []
    while (victim := policy.pop_victim(protected)) is not None:
        order.append(victim)
    return order


def test_frequency_decides_first():
    policy = HybridPolicy(halflife=1000)
    fill(policy, ["a", "a", "a", "b", "c", "c", "d"])
    assert eviction_order(policy) == ["b", "d", "c", "a"]


def test_recency_decides_among_equal_frequency():
    policy = HybridPolicy(halflife=1000)
    fill(policy, ["a", "b", "c", "d"])
    assert eviction_order(policy) == ["a", "b", "c", "d"]
    policy = HybridPolicy(halflife=1000)
    fill(policy, ["a", "b", "a", "b"])  # same count, b more recent
    assert eviction_order(policy) == ["a", "b"]


def test_an_old_burst_fades():
    policy = HybridPolicy(halflife=10)
    fill(policy, ["burst"] * 50)
    fill(policy, [f"k{i}" for i in range(100)])  # ten halflives of other traffic
    assert policy.decayed_count("burst") < policy.decayed_count("k50") < 1.0
    order = eviction_order(policy)
    assert order.index("burst") < order.index("k50")  # below keys used once, more recently
    lfu = make_policy("lfu")  # without decay the burst would stay forever
    fill(lfu, ["burst"] * 50 + [f"k{i}" for i in range(100)])
    assert eviction_order(lfu)[-1] == "burst"


def test_counts_stay_bounded_numerically():
    policy = HybridPolicy(halflife=3)
    fill(policy, ["a", "b"] * 200_000)
    assert math.isfinite(policy.decayed_count("a")) and policy.decayed_count("a") < 10
    assert policy.pop_victim(NONE_PROTECTED) == "a"


def test_protected_keys_are_never_evicted():
    for policy in (HybridPolicy(halflife=100), LRUPolicy(), make_policy("hybrid", 4)):
        fill(policy, ["a", "b", "c", "c", "c"])
        protected = {"a", "b"}.__contains__
        assert policy.pop_victim(protected) == "c"
        assert policy.pop_victim(protected) is None  # everything left is protected
        assert len(policy) == 2 and "a" in policy and "b" in policy


def test_lru_order():
    policy = LRUPolicy()
    fill(policy, ["a", "b", "c", "a"])
    assert eviction_order(policy) == ["b", "c", "a"]


def test_removed_keys_are_not_victims():
    policy = HybridPolicy(halflife=100)
    fill(policy, ["a", "b", "c"])
    policy.remove("a")
    assert eviction_order(policy) == ["b", "c"]


def test_plan_acquire_evicts_just_enough_and_protects_the_acquire():
    policy = HybridPolicy(halflife=100)
    resident = set()

    def step(keys, capacity=3):
        plan = plan_acquire(policy, keys, resident.__contains__, capacity - len(resident), set(keys).__contains__)
        resident.difference_update(plan.victims)
        resident.update(plan.misses)
        assert len(resident) <= capacity and set(keys) <= resident
        return plan

    assert step(["a", "b"]).misses == ["a", "b"]
    plan = step(["a", "c", "d"])
    assert plan.hits == ["a"] and plan.misses == ["c", "d"] and plan.victims == ["b"]
    plan = step(["c", "e"])
    assert plan.victims == ["d"]  # a was used twice, d once; c is protected


def test_make_policy_names():
    assert isinstance(make_policy("hybrid", 10), AdaptiveHybridPolicy)
    assert make_policy("hybrid", 10, halflife=7).halflife == 7
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="unknown cache policy 'mru'"):
        make_policy("mru")
    with pytest.raises(ValueError):
        HybridPolicy(0)


def test_adaptive_halflife_tracks_the_best_fixed_one():
    trace = synthetic_trace(layers=12, experts=64, top_k=4, tokens=250, seed=3)
    for capacity in (40, 120):
        fixed = [simulate_policy(trace, capacity, "hybrid", halflife=f * capacity) for f in (0.5, 1.0, 2.0)]
        adaptive = simulate_policy(trace, capacity, "hybrid")
        assert adaptive >= 0.97 * max(fixed), (capacity, adaptive, fixed)
