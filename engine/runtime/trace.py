"""Expert access traces, the offline-optimal hit rate (Belady's MIN) and policy replay.

A trace is the sequence of acquires a model made: for each, the step (token or
prefill chunk), the layer (model block) and the distinct experts. Hit rates here use
the runtime's accounting: each acquire counts its *unique* (layer, expert) keys, a
key is a hit if it was resident when the acquire started, and every key of an acquire
must be resident together (whole-expert slots, the acquire's own keys protected).

`belady_hit_rate` is the best any replacement policy could do on the trace (it knows
the future); `simulate_policy` replays the trace through our policy with the cache's
own planning code. Policy quality = simulated / optimal.
"""

from __future__ import annotations

import heapq
import json
import os
import threading
from collections.abc import Hashable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .policy import ReplacementPolicy, make_policy, plan_acquire


class AccessTrace:
    """Records (step, layer, experts) per acquire; thread-safe; saved as .npz or .json."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step = 0
        self._steps: list[int] = []
        self._layers: list[int] = []
        self._offsets: list[int] = [0]
        self._experts: list[int] = []

    def record(self, layer: int, experts: Iterable[int], step: int | None = None) -> None:
        """Add one acquire of `experts` (duplicates are dropped, order kept) in `layer`."""
        unique = list(dict.fromkeys(int(e) for e in experts))
        with self._lock:
            self._steps.append(self.step if step is None else int(step))
            self._layers.append(int(layer))
            self._experts.extend(unique)
            self._offsets.append(len(self._experts))

    def next_step(self) -> int:
        """Advance the step counter (call once per generated token / prefill chunk)."""
        with self._lock:
            self.step += 1
            return self.step

    def __len__(self) -> int:
        return len(self._steps)

    def acquires(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """(step, layer, experts) for every recorded acquire, in order."""
        with self._lock:
            steps, layers = list(self._steps), list(self._layers)
            offsets, experts = list(self._offsets), list(self._experts)
        for i, (step, layer) in enumerate(zip(steps, layers)):
            yield step, layer, tuple(experts[offsets[i] : offsets[i + 1]])

    def keysets(self) -> list[list[tuple[int, int]]]:
        """Each acquire as a list of distinct (layer, expert) keys."""
        return [[(layer, e) for e in experts] for _step, layer, experts in self.acquires()]

    @property
    def accesses(self) -> int:
        """Unique-key accesses in the trace (the denominator of the hit rate)."""
        return len(self._experts)

    # Persistence ---------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the trace: `.json` as JSON, anything else as compressed .npz."""
        path = Path(path)
        with self._lock:
            arrays: dict[str, np.ndarray] = {
                "step": np.asarray(self._steps, dtype=np.int64),
                "layer": np.asarray(self._layers, dtype=np.int32),
                "offsets": np.asarray(self._offsets, dtype=np.int64),
                "experts": np.asarray(self._experts, dtype=np.int32),
            }
        if path.suffix == ".json":
            path.write_text(json.dumps({"format": "expertdesk-trace", "version": 1,
                                        **{k: v.tolist() for k, v in arrays.items()}}), encoding="utf-8")
        else:
            with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
                np.savez_compressed(f, **arrays)  # type: ignore[arg-type]  # mypy matches **arrays to allow_pickle too

    @classmethod
    def load(cls, path: str | os.PathLike) -> AccessTrace:
        """Read a trace written by `save`."""
        path = Path(path)
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:
            with np.load(path) as npz:
                data = {k: npz[k].tolist() for k in ("step", "layer", "offsets", "experts")}
        trace = cls()
        trace._steps = [int(x) for x in data["step"]]
        trace._layers = [int(x) for x in data["layer"]]
        trace._offsets = [int(x) for x in data["offsets"]]
        trace._experts = [int(x) for x in data["experts"]]
        if len(trace._offsets) != len(trace._steps) + 1 or trace._offsets[-1] != len(trace._experts):
            raise ValueError(f"{path}: not a consistent expert access trace")
        trace.step = max(trace._steps, default=0)
        return trace


TraceLike = AccessTrace | Sequence[Iterable[Hashable]]


def _keysets(trace: TraceLike) -> Sequence[Sequence[Hashable]]:
    if isinstance(trace, AccessTrace):
        return trace.keysets()
    return [list(dict.fromkeys(keys)) for keys in trace]


def belady_hits(trace: TraceLike, capacity: int) -> tuple[int, int]:
    """(hits, accesses) of the offline-optimal policy with `capacity` whole-expert slots.

    Belady's MIN for batched requests: when an acquire needs room, evict the resident
    keys (not of this acquire) whose next use lies farthest in the future. O(n log n)
    with precomputed next-use indices and a max-heap with lazy deletion.
    """
    sets = _keysets(trace)
    ids: dict[object, int] = {}
    int_sets = [[ids.setdefault(k, len(ids)) for k in keys] for keys in sets]
    never = len(int_sets)  # "no next use": farther than any real acquire index
    next_use: list[list[int]] = [[] for _ in int_sets]
    seen: dict[int, int] = {}
    for t in range(len(int_sets) - 1, -1, -1):
        keys = int_sets[t]
        next_use[t] = [seen.get(k, never) for k in keys]
        for k in keys:
            seen[k] = t
    resident: dict[int, int] = {}  # key -> its next use (the heap entry that is current)
    heap: list[tuple[int, int]] = []  # (-next_use, key)
    hits = accesses = 0
    for t, keys in enumerate(int_sets):
        if len(keys) > capacity:
            raise ValueError(f"acquire {t} needs {len(keys)} slots at once but capacity is {capacity}")
        accesses += len(keys)
        misses = [k for k in keys if k not in resident]
        hits += len(keys) - len(misses)
        need = len(resident) + len(misses) - capacity
        if need > 0:
            current = set(keys)
            skipped = []
            while need > 0:
                neg, k = heapq.heappop(heap)
                if resident.get(k) != -neg:
                    continue  # stale entry
                if k in current:
                    skipped.append((neg, k))
                    continue
                del resident[k]
                need -= 1
            for entry in skipped:
                heapq.heappush(heap, entry)
        for k, nxt in zip(keys, next_use[t]):
            resident[k] = nxt
            heapq.heappush(heap, (-nxt, k))
        if len(heap) > 4 * capacity + 64:
            heap = [(-n, k) for k, n in resident.items()]
            heapq.heapify(heap)
    return hits, accesses


def belady_hit_rate(trace: TraceLike, capacity: int) -> float:
    """The offline-optimal (MIN) hit rate of `trace` with `capacity` slots (0.0 for an empty trace)."""
    hits, accesses = belady_hits(trace, capacity)
    return hits / accesses if accesses else 0.0


def simulate_policy(
    trace: TraceLike, capacity: int, policy: str | ReplacementPolicy = "hybrid", *, halflife: float | None = None
) -> float:
    """Hit rate of `policy` (a name for `make_policy`, or a fresh policy object) on `trace`
    with `capacity` slots, replayed through the cache's planning code (`plan_acquire`)."""
    hits, accesses = simulate_policy_hits(trace, capacity, policy, halflife=halflife)
    return hits / accesses if accesses else 0.0


def simulate_policy_hits(
    trace: TraceLike, capacity: int, policy: str | ReplacementPolicy = "hybrid", *, halflife: float | None = None
) -> tuple[int, int]:
    """(hits, accesses) of `simulate_policy`."""
    if isinstance(policy, str):
        policy = make_policy(policy, capacity, halflife)
    resident: set[object] = set()
    hits = accesses = 0
    for t, keys in enumerate(_keysets(trace)):
        if len(keys) > capacity:
            raise ValueError(f"acquire {t} needs {len(keys)} slots at once but capacity is {capacity}")
        current = set(keys)
        plan = plan_acquire(policy, keys, resident.__contains__, capacity - len(resident), current.__contains__)
        resident.difference_update(plan.victims)
        resident.update(plan.misses)
        hits += len(plan.hits)
        accesses += len(keys)
    return hits, accesses


def synthetic_trace(
    *,
    layers: int = 43,
    experts: int = 256,
    top_k: int = 6,
    tokens: int = 1000,
    zipf: float = 1.0,
    segment_tokens: int = 128,
    topic_sigma: float = 1.0,
    reuse: float = 0.3,
    seed: int = 0,
) -> AccessTrace:
    """A skewed, MoE-like routing trace for evaluating replacement policies.

    Per layer, expert popularity follows a Zipf law (exponent `zipf`) over a random
    permutation; every `segment_tokens` tokens a new "topic" multiplies it by
    log-normal noise (`topic_sigma`), so favourites shift between prompts; and each of
    the previous token's experts is kept with probability `reuse` (consecutive tokens
    share experts). Each token makes one acquire of `top_k` distinct experts per layer.
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    base = [rng.permutation(1.0 / ranks**zipf) for _ in range(layers)]
    trace = AccessTrace()
    previous: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in range(layers)]
    popularity: list[np.ndarray] = []
    for token in range(tokens):
        if token % segment_tokens == 0:
            popularity = []
            for layer in range(layers):
                p = base[layer] * rng.lognormal(0.0, topic_sigma, experts)
                popularity.append(p / p.sum())
        for layer in range(layers):
            kept = previous[layer][rng.random(previous[layer].size) < reuse]
            p = popularity[layer].copy()
            p[kept] = 0.0
            fresh = rng.choice(experts, size=top_k - kept.size, replace=False, p=p / p.sum())
            chosen = np.concatenate([kept, fresh])
            previous[layer] = chosen
            trace.record(layer, chosen.tolist(), step=token)
        trace.step = token + 1
    return trace
