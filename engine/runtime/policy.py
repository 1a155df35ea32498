"""Which expert leaves a full cache tier: a next-use forecast, LFU/LRU hybrids, LRU.

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
5%), so `AdaptiveHybridPolicy` runs the hybrid with halflife
0.5x, 1x and 2x the slot count and follows whichever one its sampled shadow caches
show hitting most.

The runtime's default is `ForecastPolicy`: it forecasts each expert's next use from
the layer cycle, the measured reuse rate and decayed per-visit counts, and evicts the
farthest. docs/cache.md compares every policy here with Belady's optimum on recorded
and synthetic traces (benchmarks/bench_policy.py).

`plan_acquire` is the one place where a tier decides hits, misses and victims for an
acquire; the cache and `trace.simulate_policy` both call it, so a simulated hit rate
is the hit rate of the real cache.
"""

from __future__ import annotations

import bisect
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

    def log_counts(self) -> tuple[dict[Key, float], float]:
        """(a copy of every key's log2 score, the log2 decay now): decayed count = 2 ** (score - decay).

        One dict copy, so a reader (the GUI's heat map) holds the cache's lock only briefly
        and does the arithmetic for thousands of keys outside it.
        """
        return dict(self._score), (self._clock / self.halflife if math.isfinite(self.halflife) else 0.0)

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


POLICIES = ("forecast", "router", "hybrid", "lfru", "lfu", "lru")
DEFAULT_POLICY = "forecast"  # the best measured (docs/cache.md)


def make_policy(name: str = DEFAULT_POLICY, capacity: int = 1, halflife: float | None = None) -> ReplacementPolicy:
    """A policy by name (docs/cache.md compares them): `forecast` (default; learned
    next-use forecast, `ForecastPolicy`), `router` (forecast crediting the router's
    next-layer guesses), `hybrid` (the adaptive LFU/LRU hybrid), `lfru` (decayed
    counts, halflife fixed at the capacity), `lfu` (no decay) or `lru`.

    `halflife` fixes the decay: in visits of a key's layer for forecast/router, in
    accesses for the others (`hybrid` then is a fixed `HybridPolicy`).
    """
    if name in ("forecast", "router"):
        credit = 0.5 if name == "router" else 0.0
        if halflife is None:
            return ForecastPolicy(capacity, guess_credit=credit)
        return ForecastPolicy(capacity, halflife=halflife, guess_credit=credit)
    if name == "hybrid":
        if halflife is not None:
            return HybridPolicy(halflife)
        return AdaptiveHybridPolicy(max(1, capacity))
    if name == "lfru":
        return HybridPolicy(halflife if halflife is not None else max(1, capacity))
    if name == "lfu":
        return HybridPolicy(math.inf)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown cache policy {name!r}; use {', '.join(repr(p) for p in POLICIES)}")


def whole_acquire_policy(name: str) -> bool:
    """Whether policy `name` needs to see every acquire of every layer (`observe_acquire`):
    true of the forecast policies, so only the device tier can run them; a tier below
    it (the host-RAM tier sees only demotions) runs `hybrid` instead."""
    return name in ("forecast", "router")


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

    def log_counts(self) -> tuple[dict[Key, float], float]:
        """The active member's `HybridPolicy.log_counts` (the counts the real cache ranks by)."""
        return self._members[self.active].log_counts()

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


class ForecastPolicy:
    """Evicts the expert whose next use is expected farthest away: a learned forecast.

    Why: a decode step visits the MoE layers in a fixed cycle, so an expert's next use
    is (acquires until its layer comes round again) + layers x (1 - p) / p, where p is
    the chance its layer picks it at that visit. Recency-ordered policies get the
    first term backwards (LRU evicts exactly the layers coming up next, and thrashes
    once the cache holds less than one token's experts); this policy estimates both
    terms online, per key, and evicts the largest. Measured against Belady's optimum
    and against an oracle that knows a synthetic trace's true probabilities, it
    closes most of the hybrid's gap to that oracle (docs/cache.md).

    What it learns:
    - p for a key not used at its layer's last visit ("cold"): its use count per visit
      of its layer, decayed with `halflife` visits (one visit = one token of decode).
      Cold keys sit in a min-heap on log2 of that count (the HybridPolicy trick: the
      ranking only changes when the key is used), so the cold candidate is O(log n).
    - for a key used at its layer's last visit ("hot"): p = r + (1 - r) p_cold, with r
      the measured share of a layer's experts reused at the next token (an EMA over
      acquires). A hot key's expected next use, as an absolute acquire count, is fixed
      from its use until its layer's next visit, so hot keys sit in one sorted list
      (insert O(log n) + a short shift) and the latest-due one is the hot candidate.
    - `observe_guess`: the next layer's router guess credits `guess_credit / (rank + 1)`
      of a use to each guessed key (0 = off).

    Keys must be (layer, expert) pairs, as the runtime's are; one acquire is one layer.
    """

    name = "forecast"

    def __init__(self, capacity: int = 1, halflife: float = 64.0, reuse: float = 0.3,
                 guess_credit: float = 0.0) -> None:
        if not halflife > 0:
            raise ValueError(f"halflife must be positive, got {halflife}")
        self.capacity = int(capacity)
        self.halflife = float(halflife)
        self.reuse = float(reuse)  # learned: share of a layer's experts reused at its next visit
        self.guess_credit = float(guess_credit)
        self._rate_scale = 1.0 - 2.0 ** (-1.0 / self.halflife)  # count -> uses per visit
        self._score: dict[Key, float] = {}  # log2 sum over uses of 2^(visit / halflife)
        # hot keys: expected next use (an acquire tick), fixed until their layer's next visit
        self._due: dict[Key, float] = {}
        self._visits: dict[Hashable, int] = {}  # layer -> visits so far
        self._norm: dict[Hashable, float] = {}  # layer -> decayed count -> uses per visit
        self._hot: dict[Hashable, set[Key]] = {}  # layer -> keys used at its last visit
        self._resident: set[Key] = set()
        # resident cold key -> its heap entry's (score, -tick): equal scores pop the key that
        # went cold last first, i.e. the one whose layer was visited last (farthest next visit)
        self._cold: dict[Key, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._tick = 0  # acquires seen
        self._layer: Hashable = None
        self._lo = self._hi = 0
        # Hot keys by expected next use (an acquire tick), latest first: (-due, key), stale
        # entries (used again, gone cold, evicted) skipped by checking `_due`.
        self._hot_candidates: list[tuple[float, Key]] = []

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def observe_acquire(self, keys: Sequence[Key]) -> None:
        if not keys:
            return
        layer = keys[0][0]  # type: ignore[index]
        if self._layer is None:
            self._lo = self._hi = layer
        self._lo, self._hi = min(self._lo, layer), max(self._hi, layer)
        self._layer = layer  # every acquire is a visit (a chunked prefill counts several)
        self._tick += 1
        visits = self._visits[layer] = self._visits.get(layer, 0) + 1
        self._norm[layer] = self._rate_scale / (1.0 - 2.0 ** (-visits / self.halflife))
        current = set(keys)
        previous = self._hot.get(layer)
        if previous:
            self.reuse += 0.02 * (len(previous & current) / len(previous) - self.reuse)
            for key in previous - current:  # used at the last visit but not at this one: cold now
                self._due.pop(key, None)
                if key in self._resident:
                    self._push_cold(key)
        self._hot[layer] = current
        for key in current:
            self._cold.pop(key, None)

    def access(self, key: Key) -> None:
        layer = key[0]  # type: ignore[index]
        term = self._visits.get(layer, 0) / self.halflife
        old = self._score.get(key)
        score = self._score[key] = term if old is None else _logaddexp2(old, term)
        rate = min(1.0, 2.0 ** (score - term) * self._norm.get(layer, 1.0))
        p = self.reuse + (1.0 - self.reuse) * rate
        span = self._hi - self._lo + 1  # its layer comes round again in `span` acquires, then may skip some
        due = self._due[key] = self._tick + span - 1 + span * (1.0 - p) / p
        candidates = self._hot_candidates
        bisect.insort(candidates, (-due, key))
        if len(candidates) > 4 * len(self._due) + 64:  # drop stale entries now and then
            self._hot_candidates = sorted((-d, k) for k, d in self._due.items())

    def _rate(self, key: Key) -> float:
        """Uses per visit of its layer: the decayed count over the decayed number of
        visits seen (`_norm`, so a layer's first visits do not read as a low rate)."""
        layer = key[0]  # type: ignore[index]
        count = 2.0 ** (self._score[key] - self._visits.get(layer, 0) / self.halflife)
        return min(1.0, max(1e-9, count * self._norm.get(layer, 1.0)))

    def admit(self, key: Key) -> None:
        if key not in self._score:  # admitted without an access (a prefetch): half a use, now
            self._score[key] = self._visits.get(key[0], 0) / self.halflife - 1.0  # type: ignore[index]
        self._resident.add(key)
        if key not in self._due:  # not used at this visit: ranked with the cold keys
            self._push_cold(key)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)
        self._cold.pop(key, None)
        self._due.pop(key, None)

    def observe_guess(self, keys: Sequence[Key]) -> None:
        if self.guess_credit <= 0:
            return
        for rank, key in enumerate(keys):
            term = (self._visits.get(key[0], 0) / self.halflife  # type: ignore[index]
                    + math.log2(self.guess_credit / (rank + 1)))
            old = self._score.get(key)
            self._score[key] = term if old is None else _logaddexp2(old, term)
            if key in self._cold:
                self._push_cold(key)

    def pop_victim(self, protected: Callable[[Key], bool]) -> Key | None:
        span = self._hi - self._lo + 1
        best: Key | None = None
        best_wait = -1.0
        cold_key = self._cold_candidate(protected)
        if cold_key is not None:
            p = self._rate(cold_key)
            best, best_wait = cold_key, (cold_key[0] - self._layer - 1) % span + span * (1.0 - p) / p  # type: ignore[index]
        candidates, due, resident = self._hot_candidates, self._due, self._resident
        while candidates and (due.get(candidates[0][1]) != -candidates[0][0] or candidates[0][1] not in resident):
            candidates.pop(0)  # used again, cold again or evicted since
        for neg_due, key in candidates:
            if due.get(key) == -neg_due and key in resident and not protected(key):
                if -neg_due - self._tick > best_wait:
                    best, best_wait = key, -neg_due - self._tick
                break
        if best is None:  # cannot happen while every resident key is cold or due; kept as a guard
            best = next((k for k in resident if not protected(k)), None)
        if best is not None:
            self.remove(best)
        return best

    def _cold_candidate(self, protected: Callable[[Key], bool]) -> Key | None:
        heap, cold = self._heap, self._cold
        skipped = []
        found = None
        while heap:
            score, tick, key = heap[0]
            if cold.get(key) != (score, tick):
                heapq.heappop(heap)  # stale: used again, hot again, or gone
                continue
            if protected(key):
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _push_cold(self, key: Key) -> None:
        entry = self._cold[key] = (self._score[key], -self._tick)
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries now and then
            self._heap = [(s, t, k) for k, (s, t) in self._cold.items()]
            heapq.heapify(self._heap)


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
