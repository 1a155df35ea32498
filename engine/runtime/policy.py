"""Which expert leaves a full cache tier: an LFU/LRU hybrid with decaying counts.

`HybridPolicy` ranks every key by its *decayed access count*: each access adds 1, and
the count halves every `halflife` accesses (of any key). So frequency decides first
(a key used 8 times recently outranks one used twice), recency decides among similar
counts (the same count, more recent, decays less), and an old burst fades instead of
pinning an expert forever. It is the LRFU family of policies; `halflife` -> infinity
gives LFU, `halflife` -> 0 gives LRU.

Implementation: with clock t (accesses so far), a key's count is
sum_i 2^((t_i - t) / H). The factor 2^(-t/H) is common to every key, so the ranking
only needs P = log2(sum_i 2^(t_i / H)), which changes only when that key is accessed.
A heap over P with lazy deletion gives O(log n) victims. Counts are kept for every key
ever seen (at most layers x experts of a pack), so a key that returns after an
eviction keeps its history.

The right halflife depends on the workload and the cache size (measured on skewed
MoE-like traces: a fixed one that suits a cache of 15% of the experts collapses at
5%), so the default policy, `AdaptiveHybridPolicy`, runs the hybrid with halflife
0.5x, 1x and 2x the slot count and follows whichever one its sampled shadow caches
show hitting most.

`plan_acquire` is the one place where a tier decides hits, misses and victims for an
acquire; the cache and `trace.simulate_policy` both call it, so a simulated hit rate
is the hit rate of the real cache.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

Key = Hashable


class ReplacementPolicy(Protocol):
    """What a cache tier asks of its replacement policy. The policy tracks the resident set.

    A policy may also define `observe_acquire(keys)`, called by `plan_acquire` once per
    acquire before anything else (the adaptive policy learns from whole acquires).
    """

    def access(self, key: Key) -> None:
        """Record one use of `key` (a hit, or a miss about to be admitted)."""

    def admit(self, key: Key) -> None:
        """`key` now occupies a slot."""

    def remove(self, key: Key) -> None:
        """`key` left its slot (evicted elsewhere, or its load failed)."""

    def pop_victim(self, protected: Callable[[Key], bool]) -> Key | None:
        """Remove and return the resident key to evict, never one for which `protected` is
        true; None if every resident key is protected."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class HybridPolicy:
    """LFU/LRU hybrid with counts that halve every `halflife` accesses (module docstring)."""

    name = "hybrid"

    def __init__(self, halflife: float) -> None:
        if not halflife > 0:
            raise ValueError(f"halflife must be positive, got {halflife}")
        self.halflife = float(halflife)
        self._clock = 0
        self._score: dict[Key, float] = {}
        self._last: dict[Key, int] = {}
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def decayed_count(self, key: Key) -> float:
        """The key's access count with decay applied up to now (0 for a key never seen)."""
        score = self._score.get(key)
        if score is None:
            return 0.0
        return 2.0 ** (score - self._clock / self.halflife) if math.isfinite(self.halflife) else 2.0**score

    def access(self, key: Key) -> None:
        self._clock += 1
        # Infinite halflife (pure LFU): every access weighs the same.
        term = self._clock / self.halflife if math.isfinite(self.halflife) else 0.0
        old = self._score.get(key)
        self._score[key] = term if old is None else _logaddexp2(old, term)
        self._last[key] = self._clock
        if key in self._resident:
            self._push(key)

    def admit(self, key: Key) -> None:
        if key not in self._score:  # admitted without an access: rank it as used once, now
            self._score[key] = self._clock / self.halflife if math.isfinite(self.halflife) else 0.0
            self._last[key] = self._clock
        self._resident.add(key)
        self._push(key)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)  # its heap entries go stale and are skipped

    def pop_victim(self, protected: Callable[[Key], bool]) -> Key | None:
        skipped = []
        victim = None
        heap = self._heap
        while heap:
            score, last, key = heap[0]
            if key not in self._resident or self._score[key] != score or self._last[key] != last:
                heapq.heappop(heap)  # stale: the key was accessed again or left
                continue
            heapq.heappop(heap)
            if protected(key):
                skipped.append((score, last, key))
                continue
            victim = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if victim is not None:
            self._resident.discard(victim)
        return victim

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._score[key], self._last[key], key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries now and then
            self._heap = [(self._score[k], self._last[k], k) for k in self._resident]
            heapq.heapify(self._heap)


class LRUPolicy:
    """Least recently used: the baseline the hybrid is compared with."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def pop_victim(self, protected: Callable[[Key], bool]) -> Key | None:
        for key in self._order:
            if not protected(key):
                del self._order[key]
                return key
        return None


def make_policy(name: str = "hybrid", capacity: int = 1, halflife: float | None = None) -> ReplacementPolicy:
    """A policy by name: `hybrid` (default), `lfu` (hybrid without decay) or `lru`.

    `hybrid` adapts its halflife online (`AdaptiveHybridPolicy`) unless `halflife` is
    given, which fixes it (`HybridPolicy`).
    """
    if name == "hybrid":
        if halflife is not None:
            return HybridPolicy(halflife)
        return AdaptiveHybridPolicy(max(1, capacity))
    if name == "lfu":
        return HybridPolicy(math.inf)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown cache policy {name!r}; use 'hybrid', 'lfu' or 'lru'")


class AdaptiveHybridPolicy:
    """`HybridPolicy` whose halflife is picked online from `factors` x capacity.

    Why: the best halflife depends on the workload and the cache size. Too short and
    the cache forgets which experts are popular (LRU-like); too long and experts that
    happened to be used twice crowd out the slots that just-used experts need for
    their likely reuse on the next token, and the hit rate falls off a cliff. So
    every candidate is replayed on a sample of the keys (shadow caches, set-dueling
    style: keys whose hash falls in 1/m of the space, with 1/m of the slots), and the
    real cache follows the candidate whose shadow hit most over recent epochs.
    All candidates score every resident key, so switching is instant.
    """

    name = "hybrid"

    def __init__(self, capacity: int, factors: Sequence[float] = (0.5, 1.0, 2.0),
                 shadow_slots: int = 256, memory: float = 0.9) -> None:
        self.capacity = int(capacity)
        self.factors = tuple(float(f) for f in factors)
        self._members = [HybridPolicy(f * self.capacity) for f in self.factors]
        # Sample 1 key in `modulus` so that each shadow has about `shadow_slots` slots.
        self._modulus = max(1, self.capacity // shadow_slots)
        self._shadow_capacity = max(1, self.capacity // self._modulus)
        self._shadows = [HybridPolicy(f * self._shadow_capacity) for f in self.factors]
        self._shadow_resident: list[set[Key]] = [set() for _ in self.factors]
        self._epoch_hits = [0] * len(self.factors)
        self._scores = [0.0] * len(self.factors)
        self._seen = 0
        self._memory = memory
        self.active = self.factors.index(1.0) if 1.0 in self.factors else 0

    @property
    def halflife(self) -> float:
        """The halflife (in accesses) the real cache uses now."""
        return self._members[self.active].halflife

    def __len__(self) -> int:
        return len(self._members[0])

    def __contains__(self, key: object) -> bool:
        return key in self._members[0]

    def observe_acquire(self, keys: Sequence[Key]) -> None:
        sample = [k for k in keys if _mix(k) % self._modulus == 0] if self._modulus > 1 else list(keys)
        if not sample or len(sample) > self._shadow_capacity:
            return
        current = set(sample)
        for i, (shadow, resident) in enumerate(zip(self._shadows, self._shadow_resident)):
            plan = plan_acquire(shadow, sample, resident.__contains__, self._shadow_capacity - len(resident),
                                current.__contains__)
            resident.difference_update(plan.victims)
            resident.update(plan.misses)
            self._epoch_hits[i] += len(plan.hits)
        self._seen += len(sample)
        if self._seen >= self._shadow_capacity:  # one epoch: about one cache's worth of accesses
            self._seen = 0
            self._scores = [self._memory * s + h for s, h in zip(self._scores, self._epoch_hits)]
            self._epoch_hits = [0] * len(self.factors)
            best = max(range(len(self._scores)), key=self._scores.__getitem__)
            if self._scores[best] > 1.01 * self._scores[self.active]:  # hysteresis: no flapping on noise
                self.active = best

    def access(self, key: Key) -> None:
        for member in self._members:
            member.access(key)

    def admit(self, key: Key) -> None:
        for member in self._members:
            member.admit(key)

    def remove(self, key: Key) -> None:
        for member in self._members:
            member.remove(key)

    def pop_victim(self, protected: Callable[[Key], bool]) -> Key | None:
        victim = self._members[self.active].pop_victim(protected)
        if victim is not None:
            for i, member in enumerate(self._members):
                if i != self.active:
                    member.remove(victim)
        return victim


def _mix(key: Key) -> int:
    """A well-spread 32-bit hash of a key (tuple hashes of small ints are not)."""
    return ((hash(key) * 0x9E3779B97F4A7C15) >> 17) & 0xFFFFFFFF


@dataclass(frozen=True)
class AcquirePlan:
    """What one acquire does to a tier: keys already there, keys to load, keys evicted for them."""

    hits: list[Key]
    misses: list[Key]
    victims: list[Key]


def plan_acquire(
    policy: ReplacementPolicy,
    keys: Sequence[Key],
    is_resident: Callable[[Key], bool],
    free_slots: int,
    protected: Callable[[Key], bool],
) -> AcquirePlan:
    """Decide one acquire of distinct `keys`: hits, misses, and the victims that make room.

    `protected(key)` must be true for every resident key of this acquire and of every
    batch still in use; the caller has checked that enough unprotected keys exist.
    Updates the policy: victims removed, every key accessed, misses admitted.
    """
    observe = getattr(policy, "observe_acquire", None)
    if observe is not None:
        observe(keys)
    hits = [k for k in keys if is_resident(k)]
    misses = [k for k in keys if not is_resident(k)]
    victims = []
    for _ in range(max(0, len(misses) - free_slots)):
        victim = policy.pop_victim(protected)
        if victim is None:
            raise RuntimeError("plan_acquire: not enough unprotected slots (the caller must check first)")
        victims.append(victim)
    for key in keys:
        policy.access(key)
    for key in misses:
        policy.admit(key)
    return AcquirePlan(hits, misses, victims)


def _logaddexp2(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    if a < b:
        a, b = b, a
    return a + math.log2(1.0 + 2.0 ** (b - a))
