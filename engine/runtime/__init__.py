"""The expert runtime: routed experts streamed from an Expert Pack on SSD into a VRAM cache.

    store = ExpertStore(pack_dir)                       # O_DIRECT reads, checked at start-up
    cache = ExpertCache(store, device="cuda", cache_bytes=20 << 30, host_cache_bytes=8 << 30)
    with cache.acquire(block, expert_ids) as batch:     # engine.experts.ExpertProvider
        w = batch[e]["gate"]                            # QuantTensor view into a VRAM slot
    with cache.acquire_streaming(block, expert_ids) as batch:
        for e, weights in batch: ...                    # each expert as soon as it is usable
    cache.prefetch(block, expert_ids, exact=True)       # start loading a coming acquire's experts

Tiers: VRAM slots <- host-RAM tier <- SSD. `ExpertCache` (cache.py) composes the slot
planner (slots.py), the load pipeline (load_pipeline.py) and the prefetch scheduler
(prefetch.py); its batches are in batches.py. Counters in `Telemetry` (`snapshot()`,
`write_stats_json`); access traces and the Belady optimum in `trace`.
"""

from .cache import CachedBatch, ExpertCache, StreamingBatch
from .errors import CacheCapacityError, ExpertReadError, RuntimeStartError
from .host_tier import HostTier
from .policy import AdaptiveHybridPolicy, HybridPolicy, LRUPolicy, ReplacementPolicy, make_policy, plan_acquire
from .staging import HostSlab, StagingPool, aligned_host_buffer
from .store import ExpertStore, ReadHandle, split_ranges
from .telemetry import StatsWriter, Telemetry
from .trace import (
    AccessTrace,
    belady_hit_rate,
    belady_hits,
    simulate_policy,
    simulate_policy_hits,
    synthetic_trace,
)

__all__ = [
    "AccessTrace",
    "AdaptiveHybridPolicy",
    "CacheCapacityError",
    "CachedBatch",
    "ExpertCache",
    "ExpertReadError",
    "ExpertStore",
    "HostSlab",
    "HostTier",
    "HybridPolicy",
    "LRUPolicy",
    "ReadHandle",
    "ReplacementPolicy",
    "RuntimeStartError",
    "StagingPool",
    "StatsWriter",
    "StreamingBatch",
    "Telemetry",
    "aligned_host_buffer",
    "belady_hit_rate",
    "belady_hits",
    "make_policy",
    "plan_acquire",
    "simulate_policy",
    "simulate_policy_hits",
    "split_ranges",
    "synthetic_trace",
]
